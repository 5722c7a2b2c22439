"""TransferExecutor (CPU backend): futures stand for submitted work, complete in FIFO order per direction,
carry copy failures as TransferError, survive cancelled awaiters and a closed loop, and aclose() drains."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest
import torch

import aiokv
from aiokv import ClosedError, CPUTier, KVLayout, Offloader, TransferError
from aiokv.transfer import ExecutorStats, TransferExecutor, TransferFuture
from aiokv.transfer import _cpu as cpu_mod
from aiokv.transfer._future import call_soon_threadsafe_guarded, resolve

try:
    import uvloop
except ImportError:  # pragma: no cover
    uvloop = None

NB = 16
BS = 4
GATE_TIMEOUT_S = 10.0  # a hang guard: a gate is always opened by the test long before this


def make_layout() -> KVLayout:
    gen = torch.Generator().manual_seed(1)
    k = torch.randn(NB, BS, 2, 8, generator=gen)
    return KVLayout([k, torch.randn(NB, BS, 2, 8, generator=gen)], block_size=BS)


def make_host(layout: KVLayout, slots: int = NB) -> torch.Tensor:
    return torch.zeros(slots * layout.slot_bytes, dtype=torch.uint8)


def slot_bytes_of(layout: KVLayout, host: torch.Tensor, slot: int) -> bytes:
    return host[slot * layout.slot_bytes : (slot + 1) * layout.slot_bytes].numpy().tobytes()


def block_bytes_of(layout: KVLayout, b: int) -> bytes:
    return b"".join(t[b].contiguous().view(torch.uint8).numpy().tobytes() for t in layout.tensors)


class Gate:
    """Holds copies on their worker thread until the test opens it; records what ran, in order."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.ran: list[tuple[str, list[int]]] = []

    def wrap(self, kind: str, real: Callable[..., None]) -> Callable[..., None]:
        def copy(ex: TransferExecutor, a: Sequence[int], b: Sequence[int]) -> None:
            assert self.event.wait(GATE_TIMEOUT_S), "gate never opened"
            self.ran.append((kind, list(a)))
            real(ex, a, b)

        return copy

    def open(self) -> None:
        self.event.set()


@pytest.fixture
def gate(monkeypatch: pytest.MonkeyPatch) -> Iterator[Gate]:
    g = Gate()
    monkeypatch.setattr(TransferExecutor, "_copy_store", g.wrap("store", TransferExecutor._copy_store))
    monkeypatch.setattr(TransferExecutor, "_copy_load", g.wrap("load", TransferExecutor._copy_load))
    yield g
    g.open()  # never leave a worker thread blocked, whatever the test did


async def settle(n: int = 5) -> None:
    """Let already-scheduled callbacks run (no waiting on time)."""
    for _ in range(n):
        await asyncio.sleep(0)


# ------------------------------------------------------------------------------------- submission
@pytest.mark.asyncio
async def test_copies_accepted_in_one_tick_reach_their_stream_as_one_submission_that_tick(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A TransferFuture stands for an accepted copy: the executor hands everything accepted in one loop tick
    to the stream at the end of that tick, one submission per direction, in submission order."""
    handed: list[tuple[str, list[TransferFuture]]] = []
    real_submit = cpu_mod.CPUStream.submit

    def submit(stream: cpu_mod.CPUStream, jobs: list[TransferFuture]) -> None:
        handed.append((jobs[0].kind, list(jobs)))
        real_submit(stream, jobs)

    monkeypatch.setattr(cpu_mod.CPUStream, "submit", submit)
    layout = make_layout()
    ex = TransferExecutor(layout, make_host(layout), asyncio.get_running_loop())
    try:
        stores = [ex.submit_store([b], [b]) for b in range(3)]
        loads = [ex.submit_load([8 + i], [8 + i]) for i in range(2)]
        assert handed == []  # accepted, handed over at the end of this tick
        assert not any(tf.submitted or tf.done() for tf in stores + loads)
        assert (stores[0].kind, stores[0].num_blocks, stores[0].nbytes) == ("store", 1, layout.slot_bytes)
        await asyncio.sleep(0)
        assert handed == [("store", stores), ("load", loads)]
        assert all(tf.submitted for tf in stores + loads)
        for tf in stores + loads:
            await tf
        assert ex.stats().batches == 2
        assert block_bytes_of(layout, 0) != b""  # the copies ran
        tf2 = ex.submit_load([0, 1], [12, 13])  # a later tick: a submission of its own
        assert tf2.event is None  # the CPU backend has no device event
        await tf2
        assert block_bytes_of(layout, 12) == block_bytes_of(layout, 0)
        assert ex.stats().batches == 3
    finally:
        await ex.aclose()


@pytest.mark.asyncio
async def test_before_flush_hooks_submit_into_the_ticks_flush_and_before_a_drain() -> None:
    """A producer that gathers work during a tick (the offloader's decode stores) registers a hook: the tick's
    flush runs it first, so what it submits joins that flush; drain() runs it first, so nothing it holds is
    missed; a failing hook is reported and the flush goes on."""
    layout = make_layout()
    loop = asyncio.get_running_loop()
    ex = TransferExecutor(layout, make_host(layout), loop)
    held: list[int] = []
    made: list[TransferFuture] = []
    errors: list[dict[str, Any]] = []
    loop.set_exception_handler(lambda _loop, ctx: errors.append(ctx))

    def hook() -> None:
        while held:
            b = held.pop()
            made.append(ex.submit_store([b], [b]))

    def broken() -> None:
        raise RuntimeError("hook bug")

    ex.before_flush(broken)
    ex.before_flush(hook)
    try:
        held.append(1)
        ex.schedule_flush()
        ex.schedule_flush()  # once per tick
        await asyncio.sleep(0)
        assert len(made) == 1
        assert made[0].submitted  # joined the flush that ran the hook
        assert ex.stats().batches == 1
        assert [str(e["exception"]) for e in errors] == ["hook bug"]
        held.append(2)
        await ex.drain()  # no tick has passed: drain runs the hook itself
        assert len(made) == 2
        assert all(tf.done() and tf.exception() is None for tf in made)
    finally:
        loop.set_exception_handler(None)
        await ex.aclose()


@pytest.mark.asyncio
async def test_a_batch_that_cannot_reach_its_stream_fails_its_futures_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def refuse(stream: cpu_mod.CPUStream, jobs: object) -> None:
        raise RuntimeError("stream is closed")

    monkeypatch.setattr(cpu_mod.CPUStream, "submit", refuse)
    layout = make_layout()
    ex = TransferExecutor(layout, make_host(layout), asyncio.get_running_loop())
    try:
        tf = ex.submit_store([0], [0])
        with pytest.raises(TransferError, match=r"store copy failed: RuntimeError\('stream is closed'\)"):
            await tf
        stats = ex.stats()
        assert (stats.submitted, stats.failed, stats.in_flight, stats.in_flight_bytes) == (1, 1, 0, 0)
    finally:
        monkeypatch.undo()
        await ex.aclose()
    with pytest.raises(ClosedError, match=r"transfer executor is closed"):
        ex.submit_store([0], [0])
    assert ex.stats().submitted == 1  # a refused call creates no future


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda ex: ex.submit_load([10**7], [0]), r"slot_ids must be in \[0, 16\), got 10000000"),
        (lambda ex: ex.submit_load([0], [10**7]), r"block_ids must be in \[0, 16\), got 10000000"),
        (
            lambda ex: ex.submit_store([0, 1], [0]),
            r"slot_ids must have one slot per block, got 1 slots for 2",
        ),
        (lambda ex: ex.submit_store([], []), r"block_ids must not be empty"),
        (lambda ex: ex.submit_store([0, 1], [3, 3]), r"slot_ids must not contain duplicates"),
        (lambda ex: ex.submit_store([0], [-1]), r"slot_ids must be in \[0, 16\), got -1"),
        (lambda ex: ex.submit_store([0], ["1"]), r"slot_ids must contain ints, got '1'"),
        (lambda ex: ex.submit_store([0], "1"), r"slot_ids must be a sequence of ints, got str"),
    ],
)
async def test_public_submissions_are_validated(call: Any, message: str) -> None:
    """A bad block or slot id is a clear error, never a copy out of bounds (it used to crash the process)."""
    layout = make_layout()
    ex = TransferExecutor(layout, make_host(layout), asyncio.get_running_loop())
    try:
        with pytest.raises(aiokv.AiokvError, match=message):
            call(ex)
        assert ex.stats().submitted == 0
    finally:
        await ex.aclose()


# ------------------------------------------------------------------------------------------ order
@pytest.mark.asyncio
async def test_futures_complete_in_fifo_order_per_direction(gate: Gate) -> None:
    layout = make_layout()
    ex = TransferExecutor(layout, make_host(layout), asyncio.get_running_loop())
    completed: list[tuple[str, int]] = []
    futures = []
    try:
        for i in range(NB):
            # Stores tagged by block id, loads by slot id (the first argument of each copy).
            tf = ex.submit_store([i], [i]) if i % 3 else ex.submit_load([i], [(i + 1) % NB])
            tag = (tf.kind, i)
            tf.add_done_callback(lambda _f, tag=tag: completed.append(tag))
            futures.append(tf)
        await settle()
        assert completed == []  # every copy is held by the gate
        stats = ex.stats()
        assert stats.in_flight == NB
        assert stats.in_flight_bytes == NB * layout.slot_bytes
        gate.open()
        for tf in futures:
            await tf
    finally:
        gate.open()
        await ex.aclose()
    for kind in ("store", "load"):
        submitted = [i for i in range(NB) if (i % 3 != 0) == (kind == "store")]
        assert [i for k, i in completed if k == kind] == submitted
        assert sorted(i for k, ids in gate.ran if k == kind for i in ids) == submitted  # each ran once
    assert ex.stats().in_flight_bytes == 0


# ----------------------------------------------------------------------------------------- errors
def failing_copy(ex: TransferExecutor, a: Sequence[int], b: Sequence[int]) -> None:
    raise OSError("injected copy failure")


@pytest.mark.asyncio
async def test_a_failing_copy_resolves_with_transfer_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(TransferExecutor, "_copy_store", failing_copy)
    layout = make_layout()
    ex = TransferExecutor(layout, make_host(layout), asyncio.get_running_loop())
    try:
        tf = ex.submit_store([0, 1], [0, 1])
        with pytest.raises(
            TransferError, match=r"store copy failed: OSError\('injected copy failure'\)"
        ) as info:
            await tf
        assert isinstance(info.value.__cause__, OSError)
        assert isinstance(tf.exception(), TransferError)
        ok = ex.submit_load([0], [3])  # the stream survives a failed job
        await ok
        stats = ex.stats()
        assert (stats.submitted, stats.failed, stats.in_flight) == (2, 1, 0)
    finally:
        await ex.aclose()


@pytest.mark.asyncio
async def test_failed_store_is_discarded_never_visible_and_counted(
    monkeypatch: pytest.MonkeyPatch, gate: Gate
) -> None:
    fail = threading.Event()
    real = TransferExecutor._copy_store  # the gated copy

    def maybe_failing(ex: TransferExecutor, a: Sequence[int], b: Sequence[int]) -> None:
        if fail.is_set():
            assert gate.event.wait(GATE_TIMEOUT_S)
            raise OSError("injected copy failure")
        real(ex, a, b)

    monkeypatch.setattr(TransferExecutor, "_copy_store", maybe_failing)
    layout = make_layout()
    tokens = list(range(3 * BS + 1))
    async with Offloader(layout, [CPUTier(capacity_bytes=8 * layout.slot_bytes)]) as off:
        fail.set()
        writer = off.open("w", tokens)
        writer.step(3 * BS, new_block_ids=[0, 1, 2])
        await settle()
        assert off.stats().tiers[0].pending == 3
        probe = off.open("p", tokens)
        assert await probe.lookup() == 0  # pending entries are invisible
        await probe.abort()
        gate.open()
        await writer.finish()  # finish resolves: a failed store only costs the cache entry
        stats = off.stats()
        assert stats.store_errors == 3
        assert stats.errors == 3
        assert stats.blocks_stored == 0
        cpu = stats.tiers[0]
        assert (cpu.used_slots, cpu.pending, cpu.ready, cpu.pinned) == (0, 0, 0, 0)
        off.cpu.index.check_invariants()
        probe = off.open("p", tokens)
        assert await probe.lookup() == 0
        await probe.abort()
        # The discarded slots are reusable: the next store of the same blocks succeeds.
        fail.clear()
        writer = off.open("w", tokens)
        writer.step(3 * BS, new_block_ids=[0, 1, 2])
        await writer.finish()
        assert off.stats().blocks_stored == 3
        probe = off.open("p", tokens)
        assert await probe.lookup() == 3 * BS
        await probe.abort()


@pytest.mark.asyncio
async def test_a_store_joins_the_store_future_of_its_tick_only_while_that_one_waits_for_the_flush() -> None:
    """``_submit(join=tf)`` adds blocks to ``tf`` while it is the last copy of its kind accepted this tick (same
    mark); after the flush, for another kind, or for another mark, it is a copy of its own."""
    layout = make_layout()
    ex = TransferExecutor(layout, make_host(layout), asyncio.get_running_loop())
    try:
        first = ex._submit("store", [0], [0])
        assert ex._submit("store", [1, 2], [1, 2], join=first) is first
        assert (first.block_ids, first.slot_ids, first.num_blocks) == ([0, 1, 2], [0, 1, 2], 3)
        assert first.nbytes == 3 * layout.slot_bytes == ex.stats().in_flight_bytes
        other_mark = ex._submit("store", [3], [3], object(), join=first)
        assert other_mark is not first
        assert ex._submit("store", [4], [4], join=first) is not first  # no longer the last of the tick
        load = ex._submit("load", [8], [8], join=other_mark)
        assert load is not other_mark
        assert load.kind == "load"
        await asyncio.sleep(0)  # the flush
        assert first.submitted
        later = ex._submit("store", [5], [5], join=first)
        assert later is not first
        assert later.block_ids == [5]
        for tf in (first, other_mark, load, later):
            await tf
        assert slot_bytes_of(layout, ex._host, 2) == block_bytes_of(layout, 2)  # joined blocks were copied
    finally:
        await ex.aclose()


@pytest.mark.asyncio
async def test_stores_of_one_tick_from_many_requests_complete_together_and_fail_together(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Three requests complete a block each in the same tick: their stores are one future (one completion,
    one index update), each request waits for it before its blocks are reusable, and when that copy fails
    every block of it is dropped (none becomes visible), as when the stream ran them as one copy before."""
    fail = threading.Event()
    real = TransferExecutor._copy_store

    def maybe_failing(ex: TransferExecutor, a: Sequence[int], b: Sequence[int]) -> None:
        if fail.is_set():
            raise OSError("injected copy failure")
        real(ex, a, b)

    monkeypatch.setattr(TransferExecutor, "_copy_store", maybe_failing)
    layout = make_layout()
    async with Offloader(layout, [CPUTier(capacity_bytes=8 * layout.slot_bytes)]) as off:
        for failing in (True, False):
            if failing:
                fail.set()
            else:
                fail.clear()
            reqs = [off.open(f"r{i}-{failing}", [100 * i + j for j in range(BS + 1)]) for i in range(3)]
            for r in reqs:
                await r.wait_processed()  # each task is parked: step() submits the store itself
            for i, r in enumerate(reqs):  # one tick
                r.step(BS, new_block_ids=[i])
            futures = {tf for r in reqs for tf in r._in_flight}
            assert len(futures) == 1
            (tf,) = futures
            assert sorted(tf.block_ids) == [0, 1, 2]
            for r in reqs:
                await r.finish()
            assert tf.done()
            stats = off.stats()
            if failing:
                assert (stats.store_errors, stats.blocks_stored) == (3, 0)
            else:
                assert (stats.store_errors, stats.blocks_stored) == (3, 3)
            off.cpu.index.check_invariants()
            for i in range(3):
                probe = off.open(f"p{i}", [100 * i + j for j in range(BS + 1)])
                assert await probe.lookup() == (0 if failing else BS)
                await probe.abort()


# ----------------------------------------------------------------------------------- cancellation
@pytest.mark.asyncio
async def test_cancelling_an_awaiter_does_not_cancel_the_copy(gate: Gate) -> None:
    layout = make_layout()
    host = make_host(layout)
    ex = TransferExecutor(layout, host, asyncio.get_running_loop())
    try:
        tf = ex.submit_store([5], [2])

        async def waiter() -> None:
            await tf

        task = asyncio.create_task(waiter())
        await settle()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert not tf.done()  # abandoned by its awaiter, still on the stream
        assert ex.stats().in_flight == 1
        gate.open()
        await tf
        assert slot_bytes_of(layout, host, 2) == block_bytes_of(layout, 5)
    finally:
        gate.open()
        await ex.aclose()


@pytest.mark.asyncio
async def test_completion_of_a_cancelled_future_is_ignored(gate: Gate) -> None:
    """The worker's completion must not call set_result on a future somebody cancelled."""
    loop = asyncio.get_running_loop()
    errors: list[dict[str, Any]] = []
    loop.set_exception_handler(lambda _loop, ctx: errors.append(ctx))
    layout = make_layout()
    ex = TransferExecutor(layout, make_host(layout), loop)
    try:
        tf = ex.submit_store([1], [1])

        async def wait() -> None:
            await tf

        waiter = asyncio.ensure_future(wait())
        await settle(1)  # the waiter is now awaiting the transfer
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        gate.open()
        nxt = ex.submit_store([2], [2])  # same stream: done after the cancelled one was resolved
        await nxt
        await settle()
        assert errors == []
        assert tf.done()  # the copy itself was not cancelled
        assert ex.stats().in_flight == 0
    finally:
        loop.set_exception_handler(None)
        gate.open()
        await ex.aclose()


def loop_factories() -> list[Any]:
    factories: list[Any] = [pytest.param(asyncio.new_event_loop, id="asyncio")]
    if uvloop is not None:
        factories.append(pytest.param(uvloop.new_event_loop, id="uvloop"))
    return factories


@pytest.mark.parametrize("new_loop", loop_factories())
def test_guarded_call_soon_threadsafe_on_a_closed_loop(
    new_loop: Callable[[], asyncio.AbstractEventLoop],
) -> None:
    loop = new_loop()
    fut = loop.create_future()
    loop.close()
    assert call_soon_threadsafe_guarded(loop, resolve, fut, None) is False
    assert not fut.done()


@pytest.mark.parametrize("new_loop", loop_factories())
def test_completion_after_the_loop_closed_does_not_kill_the_worker(
    new_loop: Callable[[], asyncio.AbstractEventLoop], gate: Gate, monkeypatch: pytest.MonkeyPatch
) -> None:
    thread_errors: list[threading.ExceptHookArgs] = []
    monkeypatch.setattr(threading, "excepthook", thread_errors.append)
    layout = make_layout()
    host = make_host(layout)
    loop = new_loop()
    ex = TransferExecutor(layout, host, loop)
    assert ex._streams is not None
    store_stream = ex._streams[0]
    tf = ex.submit_store([3], [0])
    loop.run_until_complete(asyncio.sleep(0))  # one tick: the copy is handed to its stream
    loop.close()  # the engine went away with a copy still running
    gate.open()
    store_stream.close()  # joins the worker after it completed the copy and tried to notify the loop
    ex._streams[1].close()
    assert not store_stream._thread.is_alive()
    assert thread_errors == []
    assert gate.ran == [("store", [3])]
    assert slot_bytes_of(layout, host, 0) == block_bytes_of(layout, 3)
    assert not tf.done()  # nobody was left to resolve it


# ---------------------------------------------------------------------------------------- aclose
@pytest.mark.asyncio
async def test_aclose_drains_in_flight_copies(gate: Gate) -> None:
    layout = make_layout()
    host = make_host(layout)
    ex = TransferExecutor(layout, host, asyncio.get_running_loop())
    futures = [ex.submit_store([b], [b]) for b in range(4)] + [ex.submit_load([0], [9])]
    closer = asyncio.create_task(ex.aclose())
    await settle()
    assert not closer.done()  # waiting for the gated copies
    with pytest.raises(ClosedError, match=r"transfer executor is closed"):
        ex.submit_store([7], [7])
    assert ex.stats().submitted == 5
    gate.open()
    await closer
    assert all(tf.done() and tf.exception() is None for tf in futures)
    stats = ex.stats()
    assert (stats.in_flight, stats.in_flight_bytes, stats.failed) == (0, 0, 0)
    assert ex._streams is None  # the worker threads were joined
    for b in range(4):
        assert slot_bytes_of(layout, host, b) == block_bytes_of(layout, b)
    await ex.aclose()  # idempotent


@pytest.mark.asyncio
async def test_executor_rejects_a_bad_host_buffer() -> None:
    layout = make_layout()
    loop = asyncio.get_running_loop()
    for bad in (
        torch.zeros(64, dtype=torch.float32),
        torch.zeros(8, 8, dtype=torch.uint8),
        torch.zeros(64, dtype=torch.uint8)[::2],
    ):
        with pytest.raises(ValueError, match=r"host buffer must be a contiguous 1-d uint8 tensor"):
            TransferExecutor(layout, bad, loop)


def test_executor_stats_is_a_frozen_record() -> None:
    stats = ExecutorStats(backend="cpu", in_flight=0, in_flight_bytes=0, submitted=0, failed=0)
    with pytest.raises(AttributeError):
        stats.in_flight = 1  # type: ignore[misc]
