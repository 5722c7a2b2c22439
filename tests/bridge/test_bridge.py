"""The thread bridge, driven from a real thread running a synchronous engine loop."""

from __future__ import annotations

import asyncio
import concurrent.futures
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import anyio
import pytest

import aiokv
from aiokv._bridge import ThreadBridge, ThreadRequest, call_in_loop
from tests.core._sim import Gate, SimEngine, running_hashes

T = TypeVar("T")
WAIT = 30.0
ROOT = Path(__file__).resolve().parents[2]


async def _in_thread(fn: Callable[[ThreadBridge, SimEngine], T], eng: SimEngine) -> T:
    async with aiokv.Offloader(eng.layout, tiers=[aiokv.CPUTier(capacity_bytes=4 << 20)]) as off:
        return await anyio.to_thread.run_sync(fn, ThreadBridge(off), eng)


def _prefill(req: ThreadRequest, eng: SimEngine, tokens: list[int], hit: int, blocks: list[int]) -> None:
    eng.compute(tokens, running_hashes(tokens), blocks, hit, len(tokens))
    req.step(len(tokens), new_token_ids=(), new_block_ids=blocks[hit // eng.block_size :])


@pytest.mark.asyncio
async def test_a_sync_engine_thread_reuses_blocks_only_after_finish_resolves(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The engine thread fires step() and finish(); while the store copy is held, finish's future stays
    pending; once it resolves the engine poisons and reuses the blocks, and the stored KV is intact."""
    gate = Gate()
    gate.install(monkeypatch)
    tokens = list(range(40))

    def engine(bridge: ThreadBridge, eng: SimEngine) -> None:
        req = bridge.open("a", tokens).result(WAIT)
        assert req.lookup().result(WAIT) == 0
        blocks = eng.alloc(3)
        assert blocks is not None
        _prefill(req, eng, tokens, 0, blocks)
        finished = req.finish()
        bridge.stats().result(WAIT)  # calls run in order: finish has reached the loop
        assert not finished.done()  # the store is held at the gate: the blocks are not reusable yet
        gate.open()
        assert finished.result(WAIT) is None
        eng.release(blocks)  # poisons them, as a reusing engine would
        req2 = bridge.open("b", [*tokens, 99]).result(WAIT)
        assert req2.lookup().result(WAIT) == 32
        reused = eng.alloc(2)
        assert reused is not None
        assert req2.load(reused).result(WAIT) == 32
        eng.check_tokens(running_hashes(tokens), reused, 32)
        req2.abort().result(WAIT)

    await _in_thread(engine, SimEngine(num_blocks=8))


@pytest.mark.asyncio
async def test_a_sync_scheduler_loop_with_many_requests_and_preemption() -> None:
    """A scheduler thread interleaves requests step by step, preempts one and resumes it through
    lookup/load; every future resolves in call order and every block comes back."""
    eng = SimEngine(num_blocks=24)
    bs = eng.block_size
    prompts = [[1000 + i] * 10 + list(range(50 + 7 * i)) for i in range(4)]

    def engine(bridge: ThreadBridge, eng: SimEngine) -> list[int]:
        reqs = [bridge.open(f"r{i}", p).result(WAIT) for i, p in enumerate(prompts)]
        held: dict[int, list[int]] = {}
        for i, (req, p) in enumerate(zip(reqs, prompts, strict=True)):
            assert req.lookup().result(WAIT) == 0
            held[i] = eng.alloc(-(-len(p) // bs)) or []
            _prefill(req, eng, p, 0, held[i])
        reqs[3].preempt().result(WAIT)
        eng.release(held.pop(3))
        hit = reqs[3].lookup().result(WAIT)
        assert hit == (len(prompts[3]) - 1) // bs * bs
        blocks = eng.alloc(-(-len(prompts[3]) // bs)) or []
        assert reqs[3].load(blocks[: hit // bs]).result(WAIT) == hit
        eng.check_tokens(running_hashes(prompts[3]), blocks, hit)
        held[3] = blocks
        _prefill(reqs[3], eng, prompts[3], hit, blocks)
        done = [r.finish() for r in reqs]
        for f in concurrent.futures.as_completed(done, timeout=WAIT):
            assert f.result() is None
        for b in held.values():
            eng.release(b)
        return [len(eng.free)]

    assert await _in_thread(engine, eng) == [24]


@pytest.mark.asyncio
async def test_cancel_before_the_loop_runs_it_means_it_never_happens() -> None:
    eng = SimEngine(num_blocks=8)
    async with aiokv.Offloader(eng.layout, tiers=[aiokv.CPUTier(capacity_bytes=4 << 20)]) as off:
        bridge = ThreadBridge(off)
        release = threading.Event()
        stuck = threading.Event()

        def engine() -> None:
            req = bridge.open("a", list(range(20))).result(WAIT)
            hold = call_in_loop(off.loop, lambda: (stuck.set(), release.wait(WAIT)))  # the loop is busy
            stuck.wait(WAIT)
            aborted = req.abort()
            assert aborted.cancel()  # not on the loop yet: withdrawn
            release.set()
            hold.result(WAIT)
            assert bridge.stats().result(WAIT).requests_open == 1  # the abort never happened
            looked = req.lookup()
            assert looked.result(WAIT) == 0
            assert not looked.cancel()  # done: too late
            req.abort().result(WAIT)
            assert bridge.stats().result(WAIT).requests_open == 0

        await anyio.to_thread.run_sync(engine)


@pytest.mark.asyncio
async def test_errors_come_back_through_the_future() -> None:
    eng = SimEngine(num_blocks=8)

    def engine(bridge: ThreadBridge, eng: SimEngine) -> None:
        req = bridge.open("a", list(range(20))).result(WAIT)
        with pytest.raises(aiokv.DuplicateRequestError, match="already open"):
            bridge.open("a", [1]).result(WAIT)
        req.step(16, new_block_ids=[0, 1]).result(WAIT)
        with pytest.raises(aiokv.InvalidArgumentError, match="must not decrease"):
            req.step(3).result(WAIT)
        req.abort().result(WAIT)
        with pytest.raises(aiokv.RequestStateError, match="after the request ended"):
            req.step(20).result(WAIT)

    await _in_thread(engine, eng)


@pytest.mark.asyncio
async def test_an_engine_thread_reports_its_prefill_speed() -> None:
    eng = SimEngine(num_blocks=8)

    def engine(bridge: ThreadBridge, eng: SimEngine) -> float | None:
        bridge.record_prefill(4000, 1.0).result(WAIT)
        with pytest.raises(aiokv.InvalidArgumentError, match="tokens must be >= 0, got -1"):
            bridge.record_prefill(-1, 1.0).result(WAIT)
        return bridge.stats().result(WAIT).prefill_tokens_per_s

    assert await _in_thread(engine, eng) == 4000.0


@pytest.mark.asyncio
async def test_the_loop_thread_itself_is_refused() -> None:
    eng = SimEngine(num_blocks=8)
    async with aiokv.Offloader(eng.layout, tiers=[aiokv.CPUTier(capacity_bytes=4 << 20)]) as off:
        with pytest.raises(aiokv.InvalidArgumentError, match="for other threads"):
            ThreadBridge(off).open("a", [1, 2, 3])


def test_a_closed_loop_fails_the_future_with_closed_error() -> None:
    loop = asyncio.new_event_loop()
    loop.close()
    fut: concurrent.futures.Future[Any] = call_in_loop(loop, lambda: 1)
    with pytest.raises(aiokv.ClosedError, match="event loop is closed"):
        fut.result(WAIT)


def test_the_example_runs() -> None:
    proc = subprocess.run(
        [sys.executable, "examples/sync_engine_thread.py"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "outputs matched the recompute run" in proc.stdout


@pytest.mark.asyncio
async def test_a_sync_engine_hands_each_engine_step_over_once_with_step_batch() -> None:
    """Two requests prefill and decode through ThreadBridge.step_batch (one hand-over per engine step, the
    engine reusing its own lists at once); their full blocks are stored and a follow-up finds them. A bad
    update's error comes back in the batch's future, after the updates before it were applied."""
    eng = SimEngine(num_blocks=16)
    bs = eng.block_size
    prompts = [list(range(100, 100 + 2 * bs)), list(range(300, 300 + 2 * bs + 3))]

    def engine(bridge: ThreadBridge, eng: SimEngine) -> None:
        reqs = [bridge.open(f"r{i}", p).result(WAIT) for i, p in enumerate(prompts)]
        tables = [eng.alloc(3) or [] for _ in reqs]
        tokens = [list(p) for p in prompts]
        updates: list[tuple[ThreadRequest, int, list[int], list[int]]] = []
        for req, toks, blocks in zip(reqs, tokens, tables, strict=True):
            eng.compute(toks, running_hashes(toks), blocks, 0, len(toks))
            updates.append((req, len(toks), [7], blocks))
        assert bridge.step_batch(updates).result(WAIT) is None
        for _, _, sampled, blocks in updates:
            sampled.clear()  # the bridge copied them: reusing the engine's lists changes nothing
            blocks.clear()
        for toks in tokens:
            toks.append(7)
        bad = bridge.step_batch([(reqs[0], len(tokens[0]), [8], []), (reqs[1], 0, [], [])])
        with pytest.raises(aiokv.InvalidArgumentError, match=r"num_computed_tokens must not decrease"):
            bad.result(WAIT)
        with pytest.raises(aiokv.InvalidTypeError, match=r"updates must name ThreadRequest handles"):
            bridge.step_batch([("r0", 1, [], [])])  # type: ignore[list-item]
        for req in reqs:
            req.finish().result(WAIT)
        for blocks in tables:
            eng.release(blocks)
        stats = bridge.stats().result(WAIT)
        assert stats.blocks_stored == 4
        again = bridge.open("again", [*prompts[1], 7, 1]).result(WAIT)
        assert again.lookup().result(WAIT) == 2 * bs
        again.abort().result(WAIT)

    await _in_thread(engine, eng)


@pytest.mark.asyncio
async def test_open_forwards_the_per_request_caps() -> None:
    eng = SimEngine(num_blocks=8)

    def engine(bridge: ThreadBridge, eng: SimEngine) -> aiokv.Request:
        req = bridge.open(
            "a", list(range(20)), max_store_tokens=8, max_load_tokens=4, store_decode=False, priority=7
        )
        handle = req.result(WAIT)
        inner = handle._req
        handle.abort().result(WAIT)
        with pytest.raises(aiokv.InvalidArgumentError, match=r"max_load_tokens must be >= 0, got -1"):
            bridge.open("b", [1], max_load_tokens=-1).result(WAIT)
        return inner

    inner = await _in_thread(engine, eng)
    assert (inner.max_store_tokens, inner.max_load_tokens, inner.store_decode) == (8, 4, False)
    assert inner.priority == 7


@pytest.mark.asyncio
async def test_a_grouped_layout_through_the_bridge() -> None:
    """Per-group block ids from an engine thread (the bridge copies the nested lists the engine reuses),
    drop_blocks, and an exact restore."""
    from tests.core.test_groups import BS, GroupSim, _hashes

    sim = GroupSim([("full", None), ("sliding_window", 40)], checkpoint_blocks=4)
    prompt = list(range(4 * BS + 1))
    keys = _hashes(sim.layout, prompt)

    def engine(bridge: ThreadBridge) -> int:
        req = bridge.open("a", prompt).result(WAIT)
        assert req.lookup().result(WAIT) == 0
        blocks = sim.alloc(5)
        sim.compute(keys, blocks)
        ids = sim.rows(blocks)
        req.step(len(prompt), [7], ids)
        ids[0].clear()  # the engine reuses its lists at once: the bridge copied them
        req.drop_blocks(([], [blocks[4]])).result(WAIT)
        req.finish().result(WAIT)
        req2 = bridge.open("b", prompt).result(WAIT)
        hit = req2.lookup().result(WAIT)
        dst = sim.alloc(hit // BS)
        sim.poison(dst)
        assert req2.load(sim.rows(dst)).result(WAIT) == hit
        assert all(sim.holds(0, dst[i], keys[i]) for i in range(hit // BS))
        req2.abort().result(WAIT)
        return hit

    lay = sim.layout
    async with aiokv.Offloader(lay, tiers=[aiokv.CPUTier(capacity_bytes=64 * lay.slot_bytes)]) as off:
        assert await anyio.to_thread.run_sync(engine, ThreadBridge(off)) == 4 * BS


@pytest.mark.asyncio
async def test_a_sync_engine_thread_waits_for_a_layerwise_load_layer_by_layer() -> None:
    """``ThreadRequest.load(..., layerwise=True)`` from the engine's thread: each layer's future resolves to
    the tokens restored, and the whole load's future as before; a layer of a refused load is an error."""
    tokens = list(range(40))

    def engine(bridge: ThreadBridge, eng: SimEngine) -> None:
        req = bridge.open("a", tokens).result(WAIT)
        assert req.lookup().result(WAIT) == 0
        blocks = eng.alloc(3)
        assert blocks is not None
        _prefill(req, eng, tokens, 0, blocks)
        req.finish().result(WAIT)
        eng.release(blocks)
        req2 = bridge.open("b", [*tokens, 99]).result(WAIT)
        assert req2.lookup().result(WAIT) == 32
        reused = eng.alloc(2)
        assert reused is not None
        pending = req2.load(reused, layerwise=True)
        layers = bridge.offloader.layout.num_layers
        assert [pending.layer(i).result(WAIT) for i in range(layers)] == [32] * layers
        assert pending.result(WAIT) == 32
        eng.check_tokens(running_hashes(tokens), reused, 32)
        with pytest.raises(aiokv.InvalidArgumentError, match="index must be in"):
            pending.layer(layers).result(WAIT)
        req2.abort().result(WAIT)
        refused = req2.load([0], layerwise=True)  # aborted: refused on the loop
        with pytest.raises(aiokv.RequestStateError):
            refused.result(WAIT)
        with pytest.raises(aiokv.InvalidArgumentError, match="a load that was refused"):
            refused.layer(0).result(WAIT)

    await _in_thread(engine, SimEngine(num_blocks=8))
