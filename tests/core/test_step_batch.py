"""``Request.step``'s inline path and ``Offloader.step_batch``, the per-engine-step form of ``step()``.

``step()`` takes an inline path for a running request fed plain ``int`` lists or tuples, and a general path
(validate everything, then apply) for everything else. The inline path must be indistinguishable from the
general one, and ``step_batch`` from ``step()`` per update in order: the same block tables, token lists and
stored blocks, the same errors (with the updates before a bad one applied and the rest not).
"""

from __future__ import annotations

import random
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest
import torch

import aiokv
from aiokv import CPUTier, InvalidArgumentError, InvalidTypeError, Offloader, RequestStateError
from aiokv._request import _step_batch_py

from ._sim import SimEngine

pytestmark = pytest.mark.asyncio

BS = 4


def _offloader(eng: SimEngine, blocks: int = 256) -> Offloader:
    return Offloader(eng.layout, tiers=[CPUTier(capacity_bytes=blocks * eng.layout.slot_bytes)])


def _state(req: aiokv.Request) -> tuple[Any, ...]:
    return (req.state, list(req.token_ids), req.block_ids, req.num_computed_tokens)


def _error(call: Any) -> tuple[type[BaseException], str] | None:
    try:
        call()
    except aiokv.AiokvError as exc:
        return type(exc), str(exc)
    return None


class _Driver:
    """One engine's view of N requests: draws valid and invalid step updates from a seeded RNG."""

    def __init__(self, rng: random.Random, num_blocks: int) -> None:
        self.rng = rng
        self.num_blocks = num_blocks
        self.free = list(range(num_blocks))
        rng.shuffle(self.free)

    def update(self, req: aiokv.Request, fresh: set[int]) -> tuple[int, Any, Any]:
        rng = self.rng
        known = len(req.token_ids)
        computed = req.num_computed_tokens
        end = min(known, computed + rng.choice((1, 1, 1, 2, BS, 3 * BS)))
        sampled: list[int] = [rng.randrange(50)] if end == known else []
        have = len(req.block_ids)
        need = max(0, -(-(end + len(sampled)) // BS) - have)
        new = [self.free.pop() for _ in range(need) if self.free]
        fresh.update(new)
        bad = rng.random()
        n: Any = end
        toks: Any = sampled
        ids: Any = new
        if bad < 0.05 and computed:
            n = computed - 1  # decreasing
        elif bad < 0.10:
            n = known + len(sampled) + 1  # beyond the known tokens
        elif bad < 0.13 and req.block_ids:
            ids = [*new, req.block_ids[0]]  # repeats a held block
        elif bad < 0.16:
            ids = [*new, self.num_blocks]  # out of range
        elif bad < 0.18 and sampled:
            toks = [True]  # a bool is not a token
        elif bad < 0.20:
            n = float(end)
        elif bad < 0.22 and sampled:
            toks = [1 << 63]  # beyond int64
        elif bad < 0.24 and len(new) >= 1:
            ids = [new[0], new[0]]  # duplicate within the update
        # Representation: mostly the inline path's lists and tuples, sometimes the general path's types.
        form = rng.random()
        if toks is not sampled or ids is not new:
            form = 1.0  # keep the invalid values as they are (arrays could not hold some of them)
        # Tokens and block ids independently: a list of tokens with an array of block ids must not be taken
        # for the inline path (an array holding block 0 is falsy).
        if form < 0.05:
            toks = np.asarray(toks, dtype=np.int64)
        elif form < 0.1:
            ids = np.asarray(ids, dtype=np.int64)
        elif form < 0.13:
            toks = torch.tensor(toks, dtype=torch.int64)
        elif form < 0.16:
            ids = torch.tensor(ids, dtype=torch.int64)
        elif form < 0.3:
            toks, ids = tuple(toks), tuple(ids)
        elif form < 0.35 and type(n) is int:
            n = np.int64(n)
        return n, toks, ids


_PY_STEP = getattr(aiokv.Request.step, "__wrapped__", aiokv.Request.step)  # the Python method, C path or not


def _apply(off: Offloader, how: str, ups: Sequence[tuple[Any, ...]]) -> None:
    """Apply a batch of updates the way ``how`` says, stopping at the first error as a batch does."""
    if how == "step_batch":  # the C path of step_batch when built
        off.step_batch(ups)
    elif how == "step_batch_py":
        _step_batch_py(off._host, ups)  # what Offloader.step_batch hands it
    else:
        for req, n, toks, ids in ups:
            if how == "step":  # the C path of step() when built
                req.step(n, toks, ids)
            else:  # "step_py": the Python inline path, whatever is built
                _PY_STEP(req, n, toks, ids)


@pytest.mark.parametrize("how", ["step_batch", "step_batch_py", "step", "step_py"])
@pytest.mark.parametrize("seed", range(8))
async def test_step_batch_and_the_inline_path_behave_like_the_general_path(seed: int, how: str) -> None:
    """Two offloaders, the same seeded schedule of valid and invalid updates for 8 requests: one applies each
    batch through the general path only (validate, then apply; stopping at the first error, as a batch does),
    the other through ``how``: step_batch() or step() (their C fast path when the extension is built), or the
    Python implementations of both (the definition, and what runs without a compiler). Every error, every
    request's state and every stored block must be the same."""
    rng_a, rng_b = random.Random(seed), random.Random(seed)
    eng_a, eng_b = SimEngine(block_size=BS, num_blocks=256), SimEngine(block_size=BS, num_blocks=256)
    prompts = [[random.Random(seed * 100 + i).randrange(50) for _ in range(3 + 5 * i)] for i in range(8)]
    async with _offloader(eng_a) as off_a, _offloader(eng_b) as off_b:
        reqs_a = [off_a.open(f"r{i}", p) for i, p in enumerate(prompts)]
        reqs_b = [off_b.open(f"r{i}", p) for i, p in enumerate(prompts)]
        drv_a, drv_b = _Driver(rng_a, 256), _Driver(rng_b, 256)
        errors = 0
        for _batch in range(40):
            picks = rng_a.sample(range(8), rng_a.randrange(1, 9))
            assert picks == rng_b.sample(range(8), rng_b.randrange(1, 9))
            ups_a = [(reqs_a[i], *drv_a.update(reqs_a[i], set())) for i in picks]
            ups_b = [(reqs_b[i], *drv_b.update(reqs_b[i], set())) for i in picks]

            def per_update(ups: Sequence[tuple[Any, ...]] = ups_a) -> None:
                for req, n, toks, ids in ups:
                    req._apply_step_general(n, toks, ids)  # the reference: never the inline path

            err_a = _error(per_update)
            err_b = _error(lambda ups=ups_b: _apply(off_b, how, ups))
            assert err_a == err_b
            errors += err_a is not None
            for ra, rb in zip(reqs_a, reqs_b, strict=True):
                assert _state(ra) == _state(rb)
        assert errors >= 5, "the schedule must exercise invalid updates"
        for ra, rb in zip(reqs_a, reqs_b, strict=True):
            await ra.finish()
            await rb.finish()
        assert off_a.stats().blocks_stored == off_b.stats().blocks_stored > 0
        chains = [aiokv.block_hashes(r.token_ids, BS, root=off_a.layout.root) for r in reqs_a]
        assert chains == [aiokv.block_hashes(r.token_ids, BS, root=off_b.layout.root) for r in reqs_b]
        assert [[k in off_a.cpu.index for k in c] for c in chains] == [
            [k in off_b.cpu.index for k in c] for c in chains
        ]


async def test_a_bad_update_is_refused_with_the_steps_before_it_applied_and_none_after() -> None:
    eng = SimEngine(block_size=BS)
    async with _offloader(eng) as off:
        a, b, c = (off.open(name, [1, 2, 3]) for name in "abc")
        for r in (a, b, c):
            r.step(3, [4], eng.alloc(1))
        before_c = _state(c)
        with pytest.raises(
            InvalidArgumentError, match=r"num_computed_tokens must not decrease, got 2 after 3"
        ):
            off.step_batch([(a, 4, [5], eng.alloc(1)), (b, 2, [], []), (c, 4, [5], eng.alloc(1))])
        assert a.num_computed_tokens == 4
        assert list(a.token_ids) == [1, 2, 3, 4, 5]
        assert b.num_computed_tokens == 3
        assert list(b.token_ids) == [1, 2, 3, 4]
        assert _state(c) == before_c
        for r in (a, b, c):
            await r.finish()


async def test_misshapen_updates_and_foreign_requests_are_clear_errors() -> None:
    eng = SimEngine(block_size=BS)
    async with _offloader(eng) as off, _offloader(SimEngine(block_size=BS)) as other:
        r = off.open("r", [1, 2, 3])
        stranger = other.open("s", [1, 2, 3])
        with pytest.raises(InvalidTypeError, match=r"updates must be an iterable of tuples, got int"):
            off.step_batch(5)  # type: ignore[arg-type]
        with pytest.raises(InvalidTypeError, match=r"updates must contain \(request, num_computed_tokens"):
            off.step_batch([(r, 3)])  # type: ignore[list-item]
        with pytest.raises(InvalidTypeError, match=r"updates must name Request objects, got str"):
            off.step_batch([("r", 3, [], [])])  # type: ignore[list-item]
        with pytest.raises(InvalidArgumentError, match=r"updates must name requests of this offloader"):
            off.step_batch([(stranger, 3, [4], eng.alloc(1))])
        assert r.num_computed_tokens == 0
        assert stranger.num_computed_tokens == 0
        await r.abort()
        await stranger.abort()


async def test_step_batch_from_another_thread_is_refused() -> None:
    eng = SimEngine(block_size=BS)
    async with _offloader(eng) as off:
        r = off.open("r", [1, 2, 3])
        caught: list[BaseException] = []

        def call() -> None:
            try:
                off.step_batch([(r, 3, [4], [0])])
            except BaseException as exc:
                caught.append(exc)

        t = threading.Thread(target=call)
        t.start()
        t.join()
        assert len(caught) == 1
        assert isinstance(caught[0], aiokv.WrongThreadError)
        assert "step_batch" in str(caught[0])
        assert r.num_computed_tokens == 0
        await r.abort()


async def test_step_batch_on_an_ended_request_raises_like_step() -> None:
    eng = SimEngine(block_size=BS)
    async with _offloader(eng) as off:
        r = off.open("r", [1, 2, 3])
        r.step(3, [4], eng.alloc(1))
        await r.finish()
        with pytest.raises(RequestStateError, match=r"step\(\) after the request ended"):
            off.step_batch([(r, 4, [5], [])])


async def test_a_block_id_array_holding_block_0_is_not_taken_for_no_blocks() -> None:
    """Regression: the inline path once tested ``if new_block_ids:``, and ``np.array([0])`` is falsy: block 0
    was silently dropped from the table (then the step refused, or worse, later blocks shifted)."""
    eng = SimEngine(block_size=BS)
    async with _offloader(eng) as off:
        r = off.open("r", [1, 2, 3])
        r.step(2, [], [5])  # running: later steps are candidates for the inline path
        r.step(3, [4], np.array([0]))
        assert r.block_ids == (5, 0)
        r.step(4, [5], torch.tensor([1]))
        assert r.block_ids == (5, 0, 1)
        off.step_batch([(r, 5, [6], np.array([2]))])
        assert r.block_ids == (5, 0, 1, 2)
        await r.finish()


async def test_blocks_filled_through_step_batch_are_stored_and_found_again() -> None:
    """The inline path queues stores like step(): a second request with the same prompt finds them."""
    eng = SimEngine(block_size=BS)
    prompt = list(range(10, 10 + 4 * BS + 1))
    async with _offloader(eng) as off:
        r = off.open("r", prompt)
        assert await r.lookup() == 0
        blocks = eng.alloc(5)
        assert blocks is not None
        off.step_batch([(r, 2 * BS, [], blocks[:2])])  # a chunk of the prefill
        off.step_batch([(r, len(prompt), [7], blocks[2:])])  # the rest, first sampled token
        await r.finish()
        eng.release(blocks)
        assert off.stats().blocks_stored == 4
        again = off.open("again", prompt)
        assert await again.lookup() == 4 * BS
        await again.abort()
