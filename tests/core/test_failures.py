"""Failure paths: a failed copy or tier read is a miss (never data, never an exception to the engine), and
every failure, cancellation and shutdown releases what it held and resolves what it promised."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

import pytest
import torch

import aiokv
import aiokv.transfer
from aiokv import CPUTier, Offloader, RequestState
from aiokv.testing import FaultyTier
from aiokv.tiers import DiskTier

from ..tiers._memory import MemoryTier
from ._device import Harness
from ._sim import Gate, SimEngine, running_hashes

pytestmark = pytest.mark.asyncio

BS = 4


def _offloader(eng: SimEngine, *lower: Any, blocks: int = 64, **kw: Any) -> Offloader:
    return Offloader(eng.layout, tiers=[CPUTier(capacity_bytes=blocks * eng.layout.slot_bytes), *lower], **kw)


async def _serve(eng: SimEngine, off: Offloader, rid: str, prompt: list[int]) -> list[torch.Tensor]:
    """Prefill ``prompt`` from scratch, sample one token, finish; return the KV of its blocks (a copy, taken
    before the blocks are freed and poisoned)."""
    req = off.open(rid, prompt)
    await req.lookup()
    blocks = eng.alloc(-(-len(prompt) // eng.block_size))
    assert blocks is not None
    eng.compute(prompt, running_hashes(prompt), blocks, 0, len(prompt))
    req.step(len(prompt), new_token_ids=[1], new_block_ids=blocks)
    await req.finish()
    kv = [t[blocks].clone() for t in eng.tensors]
    eng.release(blocks)
    return kv


def _same_bytes(eng: SimEngine, dst: list[int], kv: list[torch.Tensor], n: int) -> bool:
    return all(
        torch.equal(t[dst[:n]].view(torch.uint8), k[:n].view(torch.uint8))
        for t, k in zip(eng.tensors, kv, strict=True)
    )


async def _wait(aw: Any) -> Any:
    return await aw


async def _spin(n: int = 20) -> None:
    """Scheduling points only: lets callbacks and request tasks run (never a timed wait)."""
    for _ in range(n):
        await asyncio.sleep(0)


# ------------------------------------------------------------------------------------- copies that fail
async def test_a_failed_load_copy_is_a_miss_not_an_exception(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Regression: a copy failing during load() raised TransferError into the engine. It is a miss: load()
    resolves to 0, the request counts nothing computed, the pins are released, the failure is counted and
    logged; the engine recomputes and the request goes on."""
    eng = SimEngine(block_size=BS)
    prompt = list(range(9))
    async with _offloader(eng) as off:
        kv = await _serve(eng, off, "seed", prompt)
        real = aiokv.transfer.TransferExecutor._copy_load

        def broken(self: object, a: object, b: object) -> None:
            raise OSError("injected load copy failure")

        monkeypatch.setattr(aiokv.transfer.TransferExecutor, "_copy_load", broken)
        req = off.open("r", prompt)
        assert await req.lookup() == 8
        dst = eng.alloc(3)
        assert dst is not None
        with caplog.at_level(logging.WARNING, logger="aiokv.offloader"):
            assert await req.load(dst[:2]) == 0
        assert req.num_computed_tokens == 0
        assert req.state is RequestState.RUNNING
        assert off.cpu.stats().pinned == 0
        s = off.stats()
        assert (s.load_errors, s.blocks_loaded) == (2, 0)
        assert any(
            "load of 2 blocks failed, restored nothing (a miss)" in r.getMessage() for r in caplog.records
        )
        # The engine recomputes everything; the request carries on as if nothing had been cached.
        eng.compute(prompt, running_hashes(prompt), dst, 0, 9)
        req.step(9, new_token_ids=[1], new_block_ids=dst[2:])
        await req.finish()
        eng.release(dst)
        monkeypatch.setattr(aiokv.transfer.TransferExecutor, "_copy_load", real)
        probe = off.open("probe", prompt)
        assert await probe.lookup() == 8
        dst = eng.alloc(2)
        assert dst is not None
        assert await probe.load(dst) == 8
        assert _same_bytes(eng, dst, kv, 2)
        await probe.abort()


async def test_a_load_that_cannot_be_submitted_releases_its_pins_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Regression: a load whose submission raised kept the lookup's pins forever (even after abort()), and
    raised into the engine. The pins are released, load() resolves to 0, the failure is counted."""
    eng = SimEngine(block_size=BS)
    prompt = list(range(9))
    async with _offloader(eng) as off:
        await _serve(eng, off, "seed", prompt)
        real = aiokv.transfer.TransferExecutor._submit

        def refuse_loads(
            self: aiokv.transfer.TransferExecutor, kind: str, *args: Any, **kw: Any
        ) -> aiokv.transfer.TransferFuture:
            if kind == "load":
                raise RuntimeError("injected submission failure")
            return real(self, kind, *args, **kw)

        monkeypatch.setattr(aiokv.transfer.TransferExecutor, "_submit", refuse_loads)
        req = off.open("r", prompt)
        assert await req.lookup() == 8
        assert off.cpu.stats().pinned == 2
        pending = req.load([10, 11])
        assert await pending == 0
        assert await pending.wait_submitted() == 0
        assert off.cpu.stats().pinned == 0
        assert off.stats().load_errors == 2
        assert req.num_computed_tokens == 0
        await req.abort()
        assert off.cpu.stats().pinned == 0
        off.cpu.index.check_invariants()


async def test_a_store_that_cannot_be_submitted_releases_its_reservations(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Regression: a store whose submission raised left its reserved entries pending forever; later stores of
    the same blocks were taken for duplicates and never happened. The reservations are released, so the next
    request storing those blocks stores them."""
    eng = SimEngine(block_size=BS)
    prompt = list(range(9))
    real = aiokv.transfer.TransferExecutor._submit
    failures = [1]

    def refuse_once(
        self: aiokv.transfer.TransferExecutor, kind: str, *args: Any, **kw: Any
    ) -> aiokv.transfer.TransferFuture:
        if kind == "store" and failures:
            failures.pop()
            raise RuntimeError("injected submission failure")
        return real(self, kind, *args, **kw)

    reported: list[dict[str, Any]] = []
    asyncio.get_running_loop().set_exception_handler(lambda _loop, ctx: reported.append(ctx))
    try:
        async with _offloader(eng) as off:
            monkeypatch.setattr(aiokv.transfer.TransferExecutor, "_submit", refuse_once)
            await _serve(eng, off, "a", prompt)
            s = off.stats()
            assert (s.store_errors, s.blocks_stored) == (1, 0)
            assert (off.cpu.stats().pending, off.cpu.stats().used_slots) == (0, 0)
            await _serve(eng, off, "b", prompt)
            s = off.stats()
            assert (s.blocks_stored, s.stores_deduplicated) == (2, 0)
            off.cpu.index.check_invariants()
    finally:
        asyncio.get_running_loop().set_exception_handler(None)
    assert any("store for request 'a' failed" in ctx["message"] for ctx in reported)


async def test_kv_computed_over_a_load_that_failed_on_the_device_is_never_stored() -> None:
    """A device engine orders its forward after the load (wait_submitted + order_before) and steps at once;
    then the copy fails on the device. Awaiting the load says 0 (the host side is the truth), and the blocks
    the request computed over the garbage are not stored, until the request is preempted."""
    h = Harness("sim")
    try:
        kv = h.tensors(16, BS)
        layout = aiokv.KVLayout(kv, block_size=BS)
        async with h.offloader(layout) as off:
            assert h.sim is not None
            prompt = list(range(4 * BS + 1))
            seed = off.open("seed", prompt[: 2 * BS + 1])
            await seed.lookup()
            h.fill(kv, [0, 1, 2], 1.0)
            seed.step(2 * BS + 1, new_token_ids=[1], new_block_ids=[0, 1, 2])
            await seed.finish()
            load_stream = off.executor._dev._pipes[1].stream  # type: ignore[union-attr]
            held = h.hold(load_stream)
            h.sim.fail_next("scatter")  # the load's copy fails when it runs
            req = off.open("r", prompt)
            assert await req.lookup() == 2 * BS
            pending = req.load([4, 5])
            assert await pending.wait_submitted() == 2 * BS  # the copy is queued, not run
            pending.order_before()
            h.fill(kv, [4, 5, 6, 7, 8], 2.0)  # the forward, computed over the restored blocks
            req.step(4 * BS + 1, new_token_ids=[1], new_block_ids=[6, 7, 8])  # completes blocks 2 and 3
            h.release(held)
            assert await pending == 0
            await req.finish()
            s = off.stats()
            assert s.stores_invalidated == 2
            assert s.blocks_stored == 2  # the seed's blocks only
            assert s.load_errors == 2
            probe = off.open("probe", prompt)
            assert await probe.lookup() == 2 * BS
            await probe.abort()
    finally:
        h.close()


# ------------------------------------------------------------------------------------- lower tiers
def _faulty_disk(tmp_path: Path, **faults: Any) -> FaultyTier:
    return FaultyTier(DiskTier(tmp_path / "disk", 1 << 20, io_threads=1, preallocate=False), **faults)


@pytest.mark.parametrize("backing", ["memory", "disk"])
@pytest.mark.parametrize("fault", ["read", "corrupt"])
@pytest.mark.parametrize("k", [0, 2, 5])
async def test_a_lower_tier_fault_at_block_k_restores_exactly_the_prefix_before_it(
    tmp_path: Path, backing: str, fault: str, k: int
) -> None:
    """A lower tier fails to read block ``k`` of a 6-block prefix (or holds it corrupt at rest): lookup() and
    load() restore exactly blocks ``0..k-1``, byte-identical, and neither raises. Block ``k`` is a miss."""
    eng = SimEngine(block_size=BS)
    prompt = list(range(6 * BS + 1))
    chain = aiokv.block_hashes(prompt, BS, root=eng.layout.root)
    keys = {"fail_keys" if fault == "read" else "corrupt_keys": {chain[k]}}
    faulty = FaultyTier(MemoryTier(), **keys) if backing == "memory" else _faulty_disk(tmp_path, **keys)
    async with _offloader(eng, faulty) as off:
        faulty.enabled = fault == "corrupt"  # a read fault must not stop the block from being written
        kv = await _serve(eng, off, "a", prompt)
        await off.flush()
        faulty.enabled = True
        for key in chain:  # as if the CPU tier had evicted them all
            off.cpu.index.discard(key)
        before = off.stats()
        req = off.open("b", prompt)
        assert await req.lookup() == k * BS
        dst = eng.alloc(k)
        assert dst is not None
        assert await req.load(dst) == k * BS
        assert _same_bytes(eng, dst, kv, k)
        await req.abort()
        s = off.stats()
        assert s.staged_blocks == k
        assert (s.hits - before.hits, s.misses - before.misses) == (k, 6 - k)
        assert off.cpu.stats().used_slots == k  # the slot reserved for block k was released
        assert off.cpu.stats().pinned == 0
        off.cpu.index.check_invariants()


async def test_a_lower_tier_that_raises_is_a_miss() -> None:
    """A tier breaking its contract (raising OSError from lookup or read) costs the blocks it holds, never
    an exception to the engine; the CPU tier's own blocks still count."""
    eng = SimEngine(block_size=BS)
    prompt = list(range(4 * BS + 1))
    chain = aiokv.block_hashes(prompt, BS, root=eng.layout.root)
    faulty = FaultyTier(MemoryTier(), fail_keys={chain[3]}, fail_mode="raise")
    async with _offloader(eng, faulty) as off:
        faulty.enabled = False
        await _serve(eng, off, "a", prompt)
        await off.flush()
        faulty.enabled = True
        for key in chain[2:]:
            off.cpu.index.discard(key)
        req = off.open("b", prompt)
        assert await req.lookup() == 2 * BS  # the read of blocks 2-3 raised: nothing of it is staged
        dst = eng.alloc(2)
        assert dst is not None
        assert await req.load(dst) == 2 * BS
        await req.abort()
        assert off.cpu.stats().used_slots == 2
        assert off.cpu.stats().pinned == 0
        assert off.stats().errors >= 1


# ----------------------------------------------------------------------------- cancellation / shutdown
@pytest.mark.parametrize("queued_abort", [True, False])
async def test_aborts_of_a_request_whose_task_was_cancelled_wait_for_its_copies(
    monkeypatch: pytest.MonkeyPatch, queued_abort: bool
) -> None:
    """Regression: a shutdown handler cancels every task while a request's load copy is in flight. An abort()
    queued before resolved at once, under the copy; one called afterwards never resolved. Both now resolve
    once the copy is complete, and nothing stays pinned."""
    gate = Gate()
    gate.install(monkeypatch)
    gate.open()
    eng = SimEngine(block_size=BS)
    prompt = list(range(9))
    async with _offloader(eng) as off:
        await _serve(eng, off, "seed", prompt)
        gate.close()
        req = off.open("r", prompt)
        assert await req.lookup() == 8
        dst = eng.alloc(2)
        assert dst is not None
        pending = req.load(dst)
        loading = asyncio.ensure_future(_wait(pending))
        assert await pending.wait_submitted() == 8  # the copy is on its stream, held by the gate
        early = asyncio.ensure_future(_wait(req.abort())) if queued_abort else None
        for task in asyncio.all_tasks():
            if task.get_name().startswith("aiokv-request-"):
                task.cancel()  # what an application's shutdown handler does
        await _spin()
        assert req.state is RequestState.ABORTED
        with pytest.raises(
            aiokv.RequestStateError, match=r"lookup\(\) after the request ended: request 'r' is aborted"
        ):
            req.lookup()
        late = asyncio.ensure_future(_wait(req.abort()))
        await _spin()
        assert early is None or not early.done()
        assert not late.done()
        assert not loading.done()
        assert off.cpu.stats().pinned == 2  # the copy still reads its source slots
        gate.open()
        await asyncio.wait_for(late, 10)  # a hang guard, not a wait
        if early is not None:
            await early
        assert await loading == 0  # the load's request ended before it could report the restore
        eng.check_tokens(running_hashes(prompt), dst, 8)  # the copy did complete before the aborts resolved
        assert off.stats().in_flight == 0
        assert off.cpu.stats().pinned == 0
        assert off.stats().requests_open == 0
        await req.abort()  # and later still: at once


async def test_a_request_task_cancelled_before_it_ever_ran_still_ends() -> None:
    """Regression (found by the API fuzz): a task cancelled before its first step never enters its coroutine,
    so its ``finally`` never runs. The request must still end as aborted, its queued calls must resolve, and
    the offloader must close instead of waiting for it forever."""
    eng = SimEngine(block_size=BS)
    async with _offloader(eng) as off:
        req = off.open("r", list(range(9)))
        looking = asyncio.ensure_future(_wait(req.lookup()))
        assert req._task is not None
        req._task.cancel()  # before the loop ever ran it: what a shutdown handler cancelling all tasks does
        aborting = asyncio.ensure_future(_wait(req.abort()))
        await asyncio.wait_for(aborting, 10)  # a hang guard, not a wait
        assert req.state is RequestState.ABORTED
        assert await looking == 0
        assert off.stats().requests_open == 0
        other = off.open("other", list(range(9)))
        await other.finish()
    assert off.stats().requests_finished == 2


async def test_a_cancelled_lookup_releases_its_pins_and_staging_slots() -> None:
    """The request's task is cancelled while its lookup stages blocks from a slow lower tier: the pins the
    lookup took are released, and the slots reserved for the read are freed once the read has ended."""
    eng = SimEngine(block_size=BS)
    prompt = list(range(4 * BS + 1))
    chain = aiokv.block_hashes(prompt, BS, root=eng.layout.root)
    lower = MemoryTier()
    gate = asyncio.Event()
    reading = asyncio.Event()
    real_read = lower.read_into

    async def slow_read(keys: Any, outs: Any) -> int:
        reading.set()
        try:
            await gate.wait()
        except asyncio.CancelledError:
            await gate.wait()  # like an I/O thread that cannot be stopped: the read ends when it ends
            raise
        return await real_read(keys, outs)

    lower.read_into = slow_read  # type: ignore[method-assign]
    async with _offloader(eng, lower) as off:
        await _serve(eng, off, "a", prompt)
        await off.flush()
        for key in chain[2:]:
            off.cpu.index.discard(key)
        req = off.open("b", prompt)
        looking = asyncio.ensure_future(_wait(req.lookup()))
        await reading.wait()
        assert off.cpu.stats().pinned == 2
        assert off.cpu.stats().pending == 2
        req._task.cancel()  # type: ignore[union-attr]
        await _spin()
        assert off.cpu.stats().pinned == 0
        assert off.cpu.stats().pending == 2  # the read was cancelled but has not ended yet
        gate.set()
        assert await looking == 0
        await _spin()
        assert (off.cpu.stats().pending, off.cpu.stats().used_slots) == (0, 2)
        off.cpu.index.check_invariants()


async def test_a_cancelled_aclose_can_be_retried_and_finishes_the_job(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Regression: aclose() cancelled half-way marked the offloader closed without closing the executor (its
    threads lived on), and a second aclose() did nothing. The close goes on; a retried aclose() waits for it;
    the host buffer is released only after the copies in flight; nothing outlives it."""
    gate = Gate()
    gate.install(monkeypatch)
    eng = SimEngine(block_size=BS)
    off = _offloader(eng)
    await off.start()
    threads = [s._thread for s in off.executor._streams]  # type: ignore[union-attr]
    req = off.open("r", list(range(9)))
    req.step(9, new_token_ids=[1], new_block_ids=[0, 1, 2])  # a store, held by the gate
    await req.wait_processed()
    closing = asyncio.ensure_future(off.aclose())
    await _spin()
    closing.cancel()
    with pytest.raises(asyncio.CancelledError):
        await closing
    assert not off.running
    with pytest.raises(aiokv.ClosedError, match="offloader is closing"):
        off.open("x", [1])
    assert off.cpu.buffer is not None  # still there: a copy reads it
    assert all(t.is_alive() for t in threads)
    gate.open()
    await asyncio.wait_for(off.aclose(), 10)  # a hang guard, not a wait
    assert not any(t.is_alive() for t in threads)
    assert req.state is RequestState.ABORTED
    assert off.stats().in_flight == 0
    with pytest.raises(aiokv.ClosedError, match="offloader is closed"):
        off.open("x", [1])
    await off.aclose()  # idempotent


async def test_a_cancelled_close_task_still_closes_everything(monkeypatch: pytest.MonkeyPatch) -> None:
    """The close task itself is cancelled (a loop shutting down cancels every task): it finishes as a hard
    close -- request tasks cancelled, copies still waited for, threads stopped -- then re-raises."""
    gate = Gate()
    gate.install(monkeypatch)
    eng = SimEngine(block_size=BS)
    lower = MemoryTier()
    off = _offloader(eng, lower)
    await off.start()
    threads = [s._thread for s in off.executor._streams]  # type: ignore[union-attr]
    req = off.open("r", list(range(9)))
    req.step(9, new_token_ids=[1], new_block_ids=[0, 1, 2])
    await req.wait_processed()
    closing = asyncio.ensure_future(off.aclose())
    await _spin()
    assert off._closer is not None
    off._closer.cancel()
    await _spin()
    assert not closing.done()  # still waiting for the store the gate holds
    gate.open()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(closing, 10)
    assert not any(t.is_alive() for t in threads)
    assert lower.closed
    assert req.state is RequestState.ABORTED
    assert off.stats().in_flight == 0
    await off.aclose()  # closed: returns at once
