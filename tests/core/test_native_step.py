"""The C fast path of ``Request.step`` and ``Offloader.step_batch`` (aiokv/_native/_step.c).

It accelerates the Python method, which stays the definition: test_step_batch.py drives both with the same
seeded schedules and compares them with the general path. These tests pin what those schedules do not reach:
that the C path is really taken (else the comparison proves nothing), the cases it must hand back (aliasing,
many new blocks, other threads, int-likes), and that ``AIOKV_NATIVE_STEP=0`` turns it off.
"""

from __future__ import annotations

import subprocess
import sys
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import aiokv
from aiokv import CPUTier, Offloader
from aiokv._request import _native_step

from ._sim import SimEngine

BS = 4
needs_native = pytest.mark.skipif(
    _native_step is None, reason="aiokv._native._step is not built (no C compiler at install time)"
)


def _offloader(eng: SimEngine) -> Offloader:
    return Offloader(eng.layout, tiers=[CPUTier(capacity_bytes=64 * eng.layout.slot_bytes)])


def _python_step_calls(call: Callable[[], Any]) -> int:
    """How many times ``call()`` entered the Python ``Request.step``."""
    code = aiokv.Request.step.__wrapped__.__code__  # type: ignore[attr-defined]
    calls = 0

    def profile(frame: Any, event: str, _arg: Any) -> None:
        nonlocal calls
        if event == "call" and frame.f_code is code:
            calls += 1

    sys.setprofile(profile)
    try:
        call()
    finally:
        sys.setprofile(None)
    return calls


@needs_native
@pytest.mark.asyncio
async def test_plain_steps_take_the_c_path_and_anything_else_the_python_method() -> None:
    eng = SimEngine(block_size=BS)
    async with _offloader(eng) as off:
        r = off.open("r", [1, 2, 3])
        assert _python_step_calls(lambda: r.step(2, [], [5])) == 1  # waiting: the Python method decides
        assert _python_step_calls(lambda: r.step(3, [4], ())) == 0  # running, plain ints: C
        assert _python_step_calls(lambda: r.step(4, (5,), (6,))) == 0
        assert _python_step_calls(lambda: off.step_batch([(r, 5, [6], [])])) == 0
        assert _python_step_calls(lambda: r.step(6, [np.int64(7)], [])) == 1
        assert _python_step_calls(lambda: r.step(7, np.array([8]), [])) == 1
        assert _python_step_calls(lambda: r.step(8, [9], [7])) == 0
        assert r.num_computed_tokens == 8
        assert list(r.token_ids) == list(range(1, 10))
        assert r.block_ids == (5, 6, 7)
        await r.finish()
        assert off.stats().blocks_stored == 2  # tokens 1..8: two full blocks of 4


@needs_native
@pytest.mark.asyncio
async def test_every_documented_calling_convention_takes_the_c_path() -> None:
    """Positional, keywords (as the README and the guide write it), both mixed, lists and tuples."""
    eng = SimEngine(block_size=BS)
    async with _offloader(eng) as off:
        r = off.open("r", [1, 2, 3])
        r.step(3, [4], [0])  # the first step leaves WAITING: the Python method
        calls: list[Callable[[], Any]] = [
            lambda: r.step(4, new_token_ids=[5], new_block_ids=[1]),
            lambda: r.step(5, new_token_ids=(6,), new_block_ids=()),
            lambda: r.step(num_computed_tokens=6, new_token_ids=[7]),
            lambda: r.step(new_block_ids=[2], num_computed_tokens=7, new_token_ids=(8,)),
            lambda: r.step(8, [9], new_block_ids=(3,)),
            lambda: r.step(9, new_token_ids=[10]),
            lambda: r.step(num_computed_tokens=9),
        ]
        for call in calls:
            assert _python_step_calls(call) == 0
        assert r.num_computed_tokens == 9
        assert list(r.token_ids) == list(range(1, 11))
        assert r.block_ids == (0, 1, 2, 3)
        await r.finish()
        assert off.stats().blocks_stored == 2


@needs_native
@pytest.mark.asyncio
async def test_keywords_the_method_does_not_take_raise_the_python_error_and_change_nothing() -> None:
    eng = SimEngine(block_size=BS)
    async with _offloader(eng) as off:
        r = off.open("r", [1, 2, 3])
        r.step(3, [4], [0])
        before = (list(r.token_ids), r.block_ids, r.num_computed_tokens)
        bad: list[tuple[Callable[[], Any], str]] = [
            (lambda: r.step(4, num_computed_tokens=4), "multiple values for argument 'num_computed_tokens'"),
            (lambda: r.step(4, [5], new_token_ids=[5]), "multiple values for argument 'new_token_ids'"),
            (lambda: r.step(4, new_tokens=[5]), "unexpected keyword argument 'new_tokens'"),
            (lambda: r.step(new_token_ids=[5]), "missing 1 required positional argument"),
            (lambda: r.step(4, [5], [1], [2]), "takes from 2 to 4 positional arguments"),
        ]
        for call, match in bad:
            with pytest.raises(TypeError, match=match):
                call()
            assert (list(r.token_ids), r.block_ids, r.num_computed_tokens) == before
        with pytest.raises(aiokv.InvalidArgumentError, match="must not decrease"):
            r.step(num_computed_tokens=2, new_token_ids=[5])  # a keyword call the C path hands back
        assert (list(r.token_ids), r.block_ids, r.num_computed_tokens) == before
        await r.finish()


@needs_native
@pytest.mark.asyncio
async def test_a_rejected_step_on_the_c_path_raises_the_python_error_and_changes_nothing() -> None:
    eng = SimEngine(block_size=BS)
    async with _offloader(eng) as off:
        r = off.open("r", [1, 2, 3])
        r.step(3, [4], [0])
        before = (list(r.token_ids), r.block_ids, r.num_computed_tokens)
        cases: list[tuple[tuple[Any, ...], type[BaseException], str]] = [
            ((2, [5], []), aiokv.InvalidArgumentError, "must not decrease"),
            ((6, [5], []), aiokv.InvalidArgumentError, r"known tokens \(5\)"),
            ((5, [5], []), aiokv.InvalidArgumentError, "fit in the request's 1 blocks"),
            ((5, [5], [0]), aiokv.InvalidArgumentError, "must not repeat a block the request holds"),
            ((5, [5], [1, 1]), aiokv.InvalidArgumentError, "must not repeat|duplicate"),
            ((5, [5], [eng.layout.num_blocks]), aiokv.BlockRangeError, "new_block_ids"),
            ((5, [5], [-1]), aiokv.BlockRangeError, "new_block_ids"),
            ((5, [True], [1]), aiokv.InvalidTypeError, "new_token_ids"),
            ((5, [1 << 63], [1]), aiokv.InvalidArgumentError, "int64"),
            ((1 << 70, [5], [1]), aiokv.InvalidArgumentError, "known tokens"),
            ((4.0, [5], [1]), aiokv.InvalidTypeError, "num_computed_tokens must be an int"),
        ]
        for args, exc, match in cases:
            with pytest.raises(exc, match=match):
                r.step(*args)
            assert (list(r.token_ids), r.block_ids, r.num_computed_tokens) == before, args
        await r.finish()


@pytest.mark.asyncio
async def test_lists_aliasing_the_requests_own_are_applied_like_the_python_method() -> None:
    """A token list that is the request's own token list (or a block list that is its own table) would be
    read while it grows: the C path hands it to the Python method, whatever it then decides."""
    py_step = getattr(aiokv.Request.step, "__wrapped__", aiokv.Request.step)
    results = []
    for step in (aiokv.Request.step, py_step):
        eng = SimEngine(block_size=BS)
        async with _offloader(eng) as off:
            r = off.open("r", [1, 2])
            r.step(2, [3], [0, 1])
            step(r, 3, r.token_ids, [])
            errors = []
            for args in ((3, [], r._blocks), (3, r._blocks, []), (3, [], r.token_ids), (4, r._blocks, [2])):
                try:
                    step(r, *args)
                    errors.append(None)
                except aiokv.AiokvError as exc:
                    errors.append(type(exc))
            results.append((list(r.token_ids), r.block_ids, r.num_computed_tokens, errors))
            await r.finish()
    assert results[0] == results[1]
    assert results[0][3][0] is aiokv.InvalidArgumentError  # repeats the blocks it holds


@pytest.mark.asyncio
async def test_a_prefill_bringing_many_new_blocks_is_applied_and_stored() -> None:
    """More new blocks than the C path checks pairwise (32) go to the Python method: same result."""
    eng = SimEngine(block_size=BS, num_blocks=128)
    prompt = list(range(100, 100 + 40 * BS + 1))
    async with _offloader(eng) as off:
        r = off.open("r", prompt)
        blocks = list(range(41))
        r.step(len(prompt), [7], blocks)
        assert r.block_ids == tuple(blocks)
        await r.finish()
        assert off.stats().blocks_stored == 40


@pytest.mark.asyncio
async def test_step_from_another_thread_is_refused_and_changes_nothing() -> None:
    eng = SimEngine(block_size=BS)
    async with _offloader(eng) as off:
        r = off.open("r", [1, 2, 3])
        r.step(3, [4], [0])
        caught: list[BaseException] = []

        def call() -> None:
            try:
                r.step(4, [5], [])
            except BaseException as exc:
                caught.append(exc)

        t = threading.Thread(target=call)
        t.start()
        t.join()
        assert len(caught) == 1
        assert isinstance(caught[0], aiokv.WrongThreadError)
        assert r.num_computed_tokens == 3
        await r.finish()


def test_the_environment_variable_turns_the_c_path_off() -> None:
    code = "import aiokv._request as r; print(r._native_step is None, hasattr(r.Request.step, '__wrapped__'))"
    out = subprocess.run(
        [sys.executable, "-c", code],
        env={"AIOKV_NATIVE_STEP": "0", "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    assert out == ["True", "False"]


@needs_native
def test_the_method_keeps_the_python_methods_signature_and_documentation() -> None:
    import inspect

    step = aiokv.Request.step
    assert step.__doc__ == step.__wrapped__.__doc__  # type: ignore[attr-defined]
    params = list(inspect.signature(step).parameters)
    assert params == ["self", "num_computed_tokens", "new_token_ids", "new_block_ids"]
    assert step.__name__ == "step"


@needs_native
def test_an_extension_that_cannot_read_the_requests_slots_turns_the_fast_path_off_not_the_import(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """configure() refuses a class whose slots it does not find (a renamed slot, an extension built from other
    sources): aiokv then runs the Python method alone, with a warning."""
    from aiokv import _request
    from aiokv._native import _step

    class Other:
        __slots__ = ("state",)

    with pytest.raises(TypeError, match="must be a __slots__ attribute"):
        _step.configure(Other, object())

    def refuse(*_args: object) -> None:
        raise TypeError("configure(): Request._tid must be a __slots__ attribute")

    monkeypatch.setattr(_step, "configure", refuse)
    with pytest.warns(RuntimeWarning, match=r"C fast path of Request.step\(\) is off .*_tid"):
        assert _request._load_native_step() is None


@needs_native
@pytest.mark.asyncio
async def test_ints_at_every_width_are_read_exactly_and_out_of_range_ones_go_to_the_python_method() -> None:
    """The C path reads one-digit ints inline and wider ones through CPython's conversion: the token ids at
    the boundaries of both (and of int64) are stored exactly, and one past int64 is the Python method's error."""
    eng = SimEngine(block_size=BS)
    async with _offloader(eng) as off:
        r = off.open("r", [1, 2, 3])
        r.step(3, [4], [0])
        edge = [2**30 - 1, 2**30, -(2**30) + 1, -(2**30), -1, 0, 2**62, 2**63 - 1, -(2**63)]
        n = 3
        for tok in edge:
            n += 1
            new = [1 + (n // BS)] if n >= len(r.block_ids) * BS else []
            assert _python_step_calls(lambda n=n, tok=tok, new=new: r.step(n, [tok], new)) == 0, tok
        assert list(r.token_ids) == [1, 2, 3, 4, *edge]
        assert r.num_computed_tokens == n
        before = list(r.token_ids)
        with pytest.raises(aiokv.InvalidArgumentError, match="new_token_ids"):
            r.step(n + 1, [2**63], [])
        assert list(r.token_ids) == before
        # Block ids are range-checked on the value read: a negative one (one digit, sign in the size), the
        # first past the layout and a two-digit one are the Python method's BlockRangeError.
        for bad in (-1, -(2**30), off.layout.num_blocks, 2**30, 2**62):
            blocks = r.block_ids
            with pytest.raises(aiokv.BlockRangeError, match="new_block_ids"):
                r.step(n, [], [bad])
            assert (list(r.token_ids), r.block_ids, r.num_computed_tokens) == (before, blocks, n)
        await r.finish()


@needs_native
@pytest.mark.asyncio
async def test_a_long_decode_grows_the_token_list_exactly() -> None:
    """The C path grows a request's token list itself (by half, not CPython's eighth): thousands of steps
    later every token is in place, in order."""
    eng = SimEngine(num_blocks=1024, block_size=BS, num_tensors=1, width=1)
    cap = 64 * eng.layout.slot_bytes
    async with Offloader(eng.layout, tiers=[CPUTier(capacity_bytes=cap)]) as off:
        r = off.open("r", [1, 2, 3], store_decode=False)
        r.step(3, [4], [0])
        toks = [1, 2, 3, 4]
        blocks = 1
        for n in range(4, 3000):
            new = []
            if n >= blocks * BS:
                new = [blocks]
                blocks += 1
            r.step(n, [n * 7 + 1], new)
            toks.append(n * 7 + 1)
        assert list(r.token_ids) == toks
        assert r.num_computed_tokens == 2999
        assert r.block_ids == tuple(range(blocks))
        await r.finish()
