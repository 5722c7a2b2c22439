"""The step rules have one definition, ``Request._apply_step_general`` (the checked path); the two fast paths
that decide plain steps inline, C (aiokv/_native/_step.c) and Python (the head of ``Request.step``), are held
to it here.

Hypothesis drives random step sequences, valid and invalid (wrong types, negative or decreasing counts, more
tokens than known, too many or repeated or foreign blocks, bools, numpy ints and arrays, tensors, lists and
tuples, positional and keyword calls), through three requests on three offloaders: one through the installed
``Request.step`` (the C path when built), one through the Python function it wraps, called directly, and one
through the checked path alone. After every call all three must agree: the same exception (type and message)
or none, the same state, tokens, block table and computed count, the same stores queued; at the end the same
KV events and the same stored blocks.

With ``AIOKV_NATIVE_STEP=0`` the first two run the Python method (the test still holds it to the checked path,
and the CI leg that sets it runs the rest of the suite on the Python path).
"""

from __future__ import annotations

import asyncio
import copy
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import aiokv
from aiokv import CPUTier, Offloader
from aiokv._request import _native_step

from ._sim import SimEngine

BS = 4
NB = 48
PY_STEP = getattr(aiokv.Request.step, "__wrapped__", aiokv.Request.step)  # the Python method


def test_the_installed_step_is_the_c_path_when_it_is_built() -> None:
    """Else the comparison below would compare the Python method with itself and prove nothing."""
    if _native_step is None:
        assert aiokv.Request.step is PY_STEP
    else:
        assert aiokv.Request.step is not PY_STEP
        assert type(aiokv.Request.__dict__["step"]).__module__.startswith("aiokv._native")


def _outcome(call: Any) -> tuple[str, str] | None:
    try:
        call()
    except Exception as exc:  # every exception, not only aiokv's: a TypeError of one path must be the other's
        return type(exc).__name__, str(exc)
    return None


def _state(req: aiokv.Request) -> tuple[Any, ...]:
    return (
        req.state,
        list(req.token_ids),
        req.block_ids,
        req.num_computed_tokens,
        req._stored_upto,
        sorted(req._block_set),
    )


def _counters(off: Offloader) -> tuple[int, ...]:
    s = off.stats()
    return (s.blocks_stored, s.stores_deduplicated, s.stores_dropped, s.in_flight, s.requests_open, s.errors)


@st.composite
def count(draw: Any, req: aiokv.Request) -> Any:
    """``num_computed_tokens``: mostly near the request's state (forward, equal, one back), else anything."""
    known, computed = len(req.token_ids), req.num_computed_tokens
    return draw(
        st.one_of(
            st.integers(computed, known + 2),
            st.integers(computed, computed + 2 * BS),
            st.just(computed - 1),
            st.integers(-3, 4 * NB),
            st.booleans(),
            st.builds(float, st.integers(0, 40)),
            st.builds(np.int64, st.integers(0, 40)),
            st.just(None),
            st.just("3"),
        )
    )


def _form(draw: Any, items: list[Any], dtype: Any) -> Any:
    """The container: list or tuple (the C path's), or numpy / torch / range (the general path's)."""
    kind = draw(st.sampled_from(["list", "list", "tuple", "numpy", "torch", "range"]))
    if kind == "tuple":
        return tuple(items)
    if kind in ("numpy", "torch", "range") and all(
        type(x) is int and -(1 << 62) < x < 1 << 62 for x in items
    ):
        if kind == "numpy":
            return np.asarray(items, dtype=dtype)
        if kind == "torch":
            return torch.tensor(items, dtype=torch.int64)
        if len(items) == 1:
            return range(items[0], items[0] + 1)
    return items


@st.composite
def tokens(draw: Any) -> Any:
    item = st.one_of(
        st.integers(0, 99),
        st.integers(0, 99),
        st.sampled_from([True, 1 << 63, -(1 << 63) - 1, -(1 << 63), (1 << 63) - 1, 2.0, "7", None]),
        st.builds(np.int64, st.integers(0, 99)),
    )
    return _form(draw, draw(st.lists(item, max_size=3)), np.int64)


@st.composite
def blocks(draw: Any, req: aiokv.Request) -> Any:
    held = list(req.block_ids)
    item = st.one_of(
        st.integers(0, NB - 1),
        st.integers(0, NB - 1),
        st.sampled_from([-1, NB, True, False, 3.0, None]),
        *([st.sampled_from(held)] if held else []),
        st.builds(np.int32, st.integers(0, NB - 1)),
    )
    ids = draw(st.lists(item, max_size=4))
    if draw(st.integers(0, 30)) == 0:  # a batch of more new blocks than the C path checks pairwise (32)
        ids = draw(st.permutations(range(NB)))[:40]
    return _form(draw, ids, np.int64)


@st.composite
def plausible(draw: Any, req: aiokv.Request) -> tuple[Any, Any, Any]:
    """What an engine sends (plain ints in lists or tuples, fresh blocks for the tokens), with the count at
    and one past each bound: the known tokens, the block table's capacity, the computed count."""
    toks = draw(st.lists(st.integers(0, 99), max_size=2))
    known = len(req.token_ids) + len(toks)
    target = draw(st.integers(req.num_computed_tokens, max(req.num_computed_tokens, known)))
    free = [b for b in range(NB) if b not in req._block_set]
    need = max(0, -(-target // BS) - len(req.block_ids)) + draw(st.sampled_from([0, 0, 0, -1, 1]))
    ids = draw(st.permutations(free))[: max(0, need)]
    capacity = (len(req.block_ids) + len(ids)) * BS
    n = draw(
        st.sampled_from(
            [target] * 4
            + [known, known + 1, capacity, capacity + 1, req.num_computed_tokens, req.num_computed_tokens - 1]
        )
    )
    if draw(st.booleans()):
        toks = tuple(toks)
    if draw(st.booleans()):
        ids = tuple(ids)
    return n, toks, ids


def _call(step: Any, req: aiokv.Request, how: str, n: Any, toks: Any, ids: Any) -> None:
    if how == "positional":
        step(req, n, toks, ids)
    elif how == "keywords":
        step(req, num_computed_tokens=n, new_token_ids=toks, new_block_ids=ids)
    elif how == "mixed":
        step(req, n, new_block_ids=ids, new_token_ids=toks)
    elif how == "count_only":
        step(req, n)
    else:  # "tokens_only"
        step(req, n, new_token_ids=toks)


def _installed(req: aiokv.Request, *args: Any, **kwargs: Any) -> None:
    req.step(*args, **kwargs)  # through the class attribute: the C descriptor when built


def _general(
    req: aiokv.Request, num_computed_tokens: Any, new_token_ids: Any = (), new_block_ids: Any = ()
) -> None:
    """The checked path alone: the definition of the step rules, which both fast paths defer to in doubt."""
    req._apply_step_general(num_computed_tokens, new_token_ids, new_block_ids)


async def _run(data: st.DataObject) -> None:
    prompt = data.draw(st.lists(st.integers(0, 99), min_size=1, max_size=3 * BS), label="prompt")
    offs = []
    for _ in range(3):
        eng = SimEngine(block_size=BS, num_blocks=NB)
        offs.append(
            Offloader(eng.layout, tiers=[CPUTier(capacity_bytes=NB * eng.layout.slot_bytes)], kv_events=True)
        )
    off_c, off_py, off_gen = offs
    async with off_c, off_py, off_gen:
        req_c, req_py, req_gen = off_c.open("r", prompt), off_py.open("r", prompt), off_gen.open("r", prompt)
        for _ in range(data.draw(st.integers(1, 25), label="steps")):
            op = data.draw(st.sampled_from(["step"] * 8 + ["append_tokens"]))
            if op == "append_tokens":
                toks = data.draw(tokens())
                got = [
                    _outcome(lambda r=r, t=t: r.append_tokens(t))
                    for r, t in ((req_c, toks), (req_py, copy.deepcopy(toks)), (req_gen, copy.deepcopy(toks)))
                ]
            else:
                if data.draw(st.integers(0, 9)) < 6:  # an engine's step, at and around every bound
                    n, toks, ids = data.draw(plausible(req_c))
                else:  # anything
                    n, toks, ids = data.draw(count(req_c)), data.draw(tokens()), data.draw(blocks(req_c))
                how = data.draw(
                    st.sampled_from(["positional", "keywords", "mixed"] * 3 + ["count_only", "tokens_only"])
                )
                args = (how, n, toks, ids)
                copies = (how, *copy.deepcopy((n, toks, ids)))
                again = (how, *copy.deepcopy((n, toks, ids)))
                got = [
                    _outcome(lambda a=args: _call(_installed, req_c, *a)),
                    _outcome(lambda a=copies: _call(PY_STEP, req_py, *a)),
                    _outcome(lambda a=again: _call(_general, req_gen, *a)),
                ]
            assert got[0] == got[1] == got[2]
            assert _state(req_c) == _state(req_py) == _state(req_gen)
            assert _counters(off_c) == _counters(off_py) == _counters(off_gen)
        await asyncio.gather(req_c.finish(), req_py.finish(), req_gen.finish())
        await asyncio.gather(off_c.flush(), off_py.flush(), off_gen.flush())
        assert _counters(off_c) == _counters(off_py) == _counters(off_gen)
        logs = [off.event_log for off in (off_c, off_py, off_gen)]
        assert all(log is not None for log in logs)
        events = [[e[:-1] for e in log._events] for log in logs if log is not None]  # the last field: a time
        assert events[0] == events[1] == events[2]


@settings(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data())
def test_the_c_step_and_the_python_method_agree_on_random_sequences(data: st.DataObject) -> None:
    asyncio.run(_run(data))


@pytest.mark.skipif(_native_step is None, reason="aiokv._native._step is not built")
def test_the_sequences_reach_the_c_path() -> None:
    """A plain running step is taken by C (no Python frame of the method): the generated plain steps test it."""
    import sys

    async def main() -> int:
        eng = SimEngine(block_size=BS, num_blocks=NB)
        async with Offloader(eng.layout, tiers=[CPUTier(capacity_bytes=NB * eng.layout.slot_bytes)]) as off:
            r = off.open("r", [1, 2, 3])
            r.step(2, [], [5])  # waiting -> running: the Python method
            calls = 0

            def profile(frame: Any, event: str, _arg: Any) -> None:
                nonlocal calls
                calls += event == "call" and frame.f_code is PY_STEP.__code__

            sys.setprofile(profile)
            try:
                r.step(3, [4], [])
                r.step(num_computed_tokens=4, new_token_ids=(9,), new_block_ids=(6,))
            finally:
                sys.setprofile(None)
            return calls

    assert asyncio.run(main()) == 0
