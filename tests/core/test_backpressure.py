"""Back-pressure: loads overtake stores where they share a resource, a slow or hung lower tier sheds stores
(counted) instead of pinning CPU slots, and late lower-tier lookups/reads are misses at a deadline.

Deterministic: copies and tier calls are held by events and released by the test; the write-through's rate
detector runs on a fake clock. The deadline tests use a short deadline against a tier held until the test
releases it, so what they check does not depend on how long anything takes.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import threading
from collections.abc import AsyncIterator, Sequence

import pytest
import torch

import aiokv
from aiokv import CPUTier, InvalidArgumentError, InvalidTypeError, Offloader
from aiokv._offloader import _WriteThrough
from aiokv.testing import FakeClock as _FakeClock
from aiokv.tiers._lanes import LanePool
from aiokv.transfer import SimulatedDevice, TransferExecutor

from ._sim import SimEngine, running_hashes
from .test_hierarchy import MemoryTier, _off, _publish, _serve

GATE_TIMEOUT_S = 10.0  # a hang guard only: every gate is opened by the test long before this


def FakeClock() -> _FakeClock:
    """aiokv.testing.FakeClock, starting at 1000.0 s."""
    return _FakeClock(1000.0)


class HeldTier(MemoryTier):
    """A MemoryTier whose lookups, reads and writes can be held until the test releases them. A held read
    behaves like a read on an I/O thread: cancelling it does not stop it; it writes the caller's buffers when
    released and only then ends (raising the cancellation)."""

    def __init__(self) -> None:
        super().__init__()
        self.hold_lookups: asyncio.Event | None = None
        self.hold_reads: asyncio.Event | None = None
        self.hold_write_calls: asyncio.Event | None = None  # cancellable, unlike the base's hold_writes
        self.reads_started = asyncio.Event()
        self.read_ended = asyncio.Event()
        self.read_cancelled = False
        self.writes_cancelled = 0
        self.write_calls = 0

    async def lookup(self, keys: Sequence[bytes]) -> int:
        if self.hold_lookups is not None:
            await self.hold_lookups.wait()
        return await super().lookup(keys)

    async def read_into(self, keys: Sequence[bytes], outs: Sequence[memoryview]) -> int:
        self.reads_started.set()
        try:
            hold = self.hold_reads
            while hold is not None and not hold.is_set():
                try:
                    await hold.wait()
                except asyncio.CancelledError:
                    self.read_cancelled = True
            n = await super().read_into(keys, outs)  # writes the buffers, even when cancelled meanwhile
        finally:
            self.read_ended.set()
        if self.read_cancelled:
            raise asyncio.CancelledError
        return n

    async def write(self, keys: Sequence[bytes], payloads: Sequence[memoryview]) -> int:
        self.write_calls += 1
        if self.hold_write_calls is not None:
            try:
                await self.hold_write_calls.wait()
            except asyncio.CancelledError:
                self.writes_cancelled += 1
                raise
        return await super().write(keys, payloads)


@contextlib.asynccontextmanager
async def _released(tier: HeldTier) -> AsyncIterator[None]:
    """Whatever the test did, release every hold before the offloader closes (it waits for the tier)."""
    try:
        yield
    finally:
        for ev in (tier.hold_lookups, tier.hold_reads, tier.hold_write_calls, tier.hold_writes):
            if ev is not None:
                ev.set()


async def _spin(n: int = 20) -> None:
    """Scheduling points only (never a timed wait)."""
    for _ in range(n):
        await asyncio.sleep(0)


def _writer(off: Offloader) -> _WriteThrough:
    return off._writers[0]


# ------------------------------------------------------------------------------ executor: loads first
def _layout(nb: int = 16) -> aiokv.KVLayout:
    gen = torch.Generator().manual_seed(3)
    return aiokv.KVLayout([torch.randn(nb, 4, 8, generator=gen) for _ in range(2)], block_size=4)


@pytest.mark.asyncio
async def test_cpu_backend_a_load_overtakes_stores_queued_before_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """Stores and loads run on separate worker threads: a load submitted while the store thread is stuck
    with a backlog completes (with the right bytes) before any of those stores."""
    held = threading.Event()
    real_store = TransferExecutor._copy_store

    def slow_store(ex: TransferExecutor, a: Sequence[int], b: Sequence[int]) -> None:
        assert held.wait(GATE_TIMEOUT_S), "store gate never opened"
        real_store(ex, a, b)

    monkeypatch.setattr(TransferExecutor, "_copy_store", slow_store)
    layout = _layout()
    host = torch.zeros(16 * layout.slot_bytes, dtype=torch.uint8)
    host[15 * layout.slot_bytes : 16 * layout.slot_bytes] = 7
    ex = TransferExecutor(layout, host, asyncio.get_running_loop(), copy_threads=1)
    order: list[str] = []
    try:
        stores = []
        for i in range(8):
            tf = ex.submit_store([i], [i])
            tf.add_done_callback(lambda _f: order.append("store"))
            stores.append(tf)
            await asyncio.sleep(0)  # one submission per tick: a backlog on the store thread
        load = ex.submit_load([15], [12])
        load.add_done_callback(lambda _f: order.append("load"))
        await load
        assert order == ["load"]
        assert all(not tf.done() for tf in stores)
        assert bool((layout.tensors[0][12].view(torch.uint8) == 7).all())
    finally:
        held.set()
        await ex.aclose()
    assert order == ["load"] + ["store"] * 8


@pytest.mark.asyncio
async def test_device_backend_a_load_overtakes_stores_queued_before_it() -> None:
    """On the device data path each direction has its own stream: with the store stream held behind a
    backlog, a later load runs and completes on the load stream."""
    sim = SimulatedDevice(seed=1)
    try:
        layout = _layout()
        host = torch.zeros(16 * layout.slot_bytes, dtype=torch.uint8)
        sim.pin(host)
        compute = sim.new_stream("compute")
        ex = TransferExecutor(layout, host, asyncio.get_running_loop(), device=sim, compute_stream=compute)
        assert ex._dev is not None
        store_pipe, load_pipe = ex._dev._pipes
        assert store_pipe.stream is not load_pipe.stream
        release = store_pipe.stream.hold()
        try:
            stores = [ex.submit_store([i], [i]) for i in range(8)]
            await ex.wait_submitted()
            load = ex.submit_load([15], [12])
            await load
            assert all(not tf.done() for tf in stores)
        finally:
            release.set()
        for tf in stores:
            await tf
        await ex.aclose()
    finally:
        sim.close()


# ------------------------------------------------------------------------- disk tier: a read lane
def test_lane_pool_runs_a_read_on_the_thread_writes_may_not_take() -> None:
    pool = LanePool(2)
    assert pool.write_threads == 1
    gate = threading.Event()
    try:
        writes = [pool.submit_write(gate.wait, GATE_TIMEOUT_S) for _ in range(3)]
        read = pool.submit(lambda: "read")
        assert read.result(GATE_TIMEOUT_S) == "read"  # while every write is held or queued
        assert not any(w.done() for w in writes)
        assert pool.reads_ahead_of_writes == 1
    finally:
        gate.set()
        pool.shutdown()
    assert all(w.result() is True for w in writes)


def test_lane_pool_takes_queued_reads_before_queued_writes() -> None:
    pool = LanePool(1)
    gate = threading.Event()
    ran: list[str] = []
    try:
        started = threading.Event()

        def job() -> bool:
            started.set()
            return gate.wait(GATE_TIMEOUT_S)

        first = pool.submit_write(job)  # running: cannot be recalled
        assert started.wait(GATE_TIMEOUT_S)
        pool.submit_write(ran.append, "write-1")
        pool.submit_write(ran.append, "write-2")
        pool.submit(ran.append, "read")
        gate.set()
        assert first.result(GATE_TIMEOUT_S) is True
    finally:
        gate.set()
        pool.shutdown()
    assert ran == ["read", "write-1", "write-2"]


def test_lane_pool_shutdown_cancels_what_did_not_start() -> None:
    pool = LanePool(1)
    gate = threading.Event()
    started = threading.Event()

    def job() -> bool:
        started.set()
        return gate.wait(GATE_TIMEOUT_S)

    running = pool.submit_write(job)
    assert started.wait(GATE_TIMEOUT_S)
    queued = pool.submit(lambda: None)
    pool.shutdown(wait=False, cancel_futures=True)
    gate.set()
    assert running.result(GATE_TIMEOUT_S) is True
    assert queued.cancelled()
    with pytest.raises(RuntimeError, match="after shutdown"):
        pool.submit(lambda: None)
    pool.shutdown()


# ------------------------------------------------------------------ write-through: shed, never pin
@pytest.mark.asyncio
async def test_a_hung_tier_under_a_store_flood_keeps_pins_bounded_and_drops_counted(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A lower tier stops answering writes. The first batch stays in flight (pinned until the tier answers);
    once the detector sees the tier's rate collapse, the flood is shed at the door (never pinned), the blocks
    queued before are dropped when older than the limit, and every drop is counted; requests finish. When the
    tier answers again, write-through resumes and what it wrote is intact."""
    tier = HeldTier()
    tier.hold_writes = asyncio.Event()  # the in-flight batch stays pinned until the tier answers
    clock = FakeClock()
    eng = SimEngine(num_blocks=256, block_size=4)
    slot = eng.layout.slot_bytes
    off = _off(eng, 1024, tier, write_through_max_bytes=512 * slot, write_through_max_delay_s=5.0)
    off._clock = clock
    async with off:
        await _serve(eng, off, "first", list(range(9)))  # 2 blocks: the write in flight
        await _spin()
        assert tier.write_calls == 1
        for i in range(3):
            await _serve(eng, off, f"queued{i}", list(range(1000 * (i + 1), 1000 * (i + 1) + 9)))
        assert off.stats().write_through[0].queued_blocks == 6  # nothing measured yet: queued
        clock.now += 10.0  # the write has now taken 10 s: the tier writes <= 2 blocks / 10 s
        for i in range(40):
            await _serve(eng, off, f"flood{i}", list(range(10**6 * (i + 1), 10**6 * (i + 1) + 9)))
            s = off.stats()
            assert off.cpu.stats().pinned == 2  # only the batch the tier is writing
            assert s.write_through_in_flight_bytes == 2 * slot
        s = off.stats()
        wt = s.write_through[0]
        assert wt.queued_blocks == 0
        assert wt.dropped_slow == 6 + 80  # the 6 expired, the 80 shed at once
        assert s.write_through_dropped_slow == wt.dropped_slow
        assert s.write_through_dropped == wt.dropped_slow
        assert wt.expected_delay_s > 5.0
        shed = [
            r for r in caplog.records if r.name == "aiokv.offloader" and "write-through to tier" in r.message
        ]
        assert shed, "shedding is logged"
        assert len(shed) == 1  # throttled: one line, the rest counted
        assert s.blocks_stored == 2 + 6 + 80
        # The tier answers again: the batch completes, the detector measures it, and a block offered with
        # nothing ahead of it is always written (so a recovered tier is noticed).
        tier.hold_writes.set()
        await off.flush()
        assert off.cpu.stats().pinned == 0
        assert off.stats().write_through_blocks == 2
        await _serve(eng, off, "after", list(range(77, 86)))
        await off.flush()
        assert off.stats().write_through_blocks >= 3
    assert off.stats().write_through[0].in_flight_bytes == 0
    # Nothing corrupt was written: a fresh CPU tier stages back exactly the KV of "first".
    tier.closed = False
    eng2 = SimEngine(block_size=4)
    async with _off(eng2, 64, tier) as b:
        req = b.open("check", [*range(9), 5])
        assert await req.lookup() == 8
        dst = eng2.alloc(2)
        assert dst is not None
        await req.load(dst)
        eng2.check_tokens(running_hashes([*range(9), 5]), dst, 8)
        await req.abort()


@pytest.mark.asyncio
async def test_the_detector_sheds_only_what_a_measured_rate_cannot_drain_in_time() -> None:
    """Rate measured on finished writes (fake clock): with 1 block/s and a 5 s limit, about 5 blocks' worth
    may wait; the rest of a burst is shed at the door, counted, never pinned."""
    tier = HeldTier()
    clock = FakeClock()
    eng = SimEngine(num_blocks=64, block_size=4)
    off = _off(eng, 256, tier, write_through_max_delay_s=5.0)
    off._clock = clock
    async with off:
        w = _writer(off)
        tier.hold_writes = asyncio.Event()
        await _serve(eng, off, "a", list(range(9)))  # 2 blocks
        await _spin()
        clock.now += 2.0
        tier.hold_writes.set()
        await off.flush()
        assert w.rate == pytest.approx(2 * eng.layout.slot_bytes / 2.0)
        tier.hold_writes = asyncio.Event()
        await _serve(eng, off, "b", list(range(100, 109)))  # 2 blocks in flight, ahead of the burst
        await _spin()
        await _serve(eng, off, "c", list(range(200, 241)))  # 10 blocks
        s = off.stats()
        # 2 in flight + 3 queued = 5 blocks = 5 s at 1 block/s; the 7 others are shed.
        assert s.write_through[0].queued_blocks == 3
        assert s.write_through_dropped_slow == 7
        assert off.cpu.stats().pinned == 5
        tier.hold_writes.set()
        await off.flush()
        assert off.cpu.stats().pinned == 0
        assert off.stats().write_through_blocks == 2 + 2 + 3


@pytest.mark.asyncio
async def test_a_write_running_past_the_limit_is_cancelled_and_its_blocks_released() -> None:
    """A tier whose write never returns (but honours cancellation): after write_through_max_delay_s the write
    is cancelled, its blocks are dropped (counted as shed) and unpinned once the call has returned."""
    tier = HeldTier()
    tier.hold_write_calls = asyncio.Event()  # never set
    eng = SimEngine(block_size=4)
    async with _off(eng, 64, tier, write_through_max_delay_s=0.05) as off:
        await _serve(eng, off, "a", list(range(9)))
        await off.flush()  # returns once the late write was cancelled
        s = off.stats()
        assert tier.writes_cancelled == 1
        assert s.write_through_dropped_slow == 2
        assert s.write_through_blocks == 0
        assert off.cpu.stats().pinned == 0
        assert s.write_through[0].rate_bytes_per_s == 0.0


@pytest.mark.asyncio
async def test_without_a_delay_limit_only_the_byte_budget_bounds_the_queue() -> None:
    tier = HeldTier()
    tier.hold_writes = asyncio.Event()
    clock = FakeClock()
    eng = SimEngine(block_size=4)
    off = _off(eng, 64, tier, write_through_max_delay_s=None)
    off._clock = clock
    async with off:
        await _serve(eng, off, "a", list(range(9)))
        await _spin()
        clock.now += 1000.0
        await _serve(eng, off, "b", list(range(100, 109)))
        s = off.stats()
        assert s.write_through_dropped == 0
        assert s.write_through[0].queued_blocks == 2
        tier.hold_writes.set()
        await off.flush()
        assert off.stats().write_through_blocks == 4


# ---------------------------------------------------------------------- staging deadline: a miss
@pytest.mark.asyncio
async def test_a_read_past_the_deadline_is_a_miss_and_its_slots_wait_for_the_read_to_end() -> None:
    """The lower tier's read hangs: lookup() returns a miss at the deadline, counted; the CPU slots the read
    writes into stay reserved (pending, never handed out) until the read really ends; afterwards the same
    prefix stages normally and loads the right KV."""
    tier = HeldTier()
    tokens = list(range(17))
    await _publish(tier, tokens)
    tier.hold_reads = asyncio.Event()
    eng = SimEngine(block_size=4)
    async with _off(eng, 64, tier, lower_tier_deadline_s=0.05) as off, _released(tier):
        req = off.open("r", [*tokens, 1])
        assert await req.lookup() == 0
        s = off.stats()
        assert s.lower_tier_deadline_misses == 1
        assert s.staged_blocks == 0
        assert s.misses == 4
        assert tier.read_cancelled
        assert not tier.read_ended.is_set()
        assert off.cpu.index.stats().pending == 4  # still the read's: not reusable yet
        # The abandoned read is the load planner's measurement of the tier: at least the deadline for 4 blocks.
        (_name, _latency, bytes_per_s, samples), *_ = [t for t in s.planner.tiers if t[0] != "cpu"]
        assert samples == 1
        assert bytes_per_s <= 4 * eng.layout.slot_bytes / 0.04  # ~0.05 s (uvloop timers may fire ~1 ms early)
        await req.abort()
        tier.hold_reads.set()
        await tier.read_ended.wait()
        await _spin()
        assert off.cpu.index.stats().pending == 0
        assert off.cpu.index.stats().ready == 0  # the late bytes were never published
        tier.hold_reads = None
        tier.read_cancelled = False
        again = off.open("again", [*tokens, 1])
        assert await again.lookup() == 16
        dst = eng.alloc(4)
        assert dst is not None
        await again.load(dst)
        eng.check_tokens(running_hashes([*tokens, 1]), dst, 16)
        await again.abort()
        assert off.stats().lower_tier_deadline_misses == 1


@pytest.mark.asyncio
async def test_a_lookup_past_the_deadline_is_a_miss() -> None:
    tier = HeldTier()
    tokens = list(range(9))
    await _publish(tier, tokens)
    tier.hold_lookups = asyncio.Event()
    eng = SimEngine(block_size=4)
    async with _off(eng, 64, tier, lower_tier_deadline_s=0.05) as off, _released(tier):
        req = off.open("r", tokens)
        assert await req.lookup() == 0
        assert off.stats().lower_tier_deadline_misses == 1
        assert off.cpu.index.stats().pending == 0  # a lookup reserves nothing
        await req.abort()
        tier.hold_lookups.set()


@pytest.mark.asyncio
async def test_a_cancelled_lookup_abandons_a_held_read_and_releases_its_slots_after_it_ends() -> None:
    tier = HeldTier()
    tokens = list(range(9))
    await _publish(tier, tokens)
    tier.hold_reads = asyncio.Event()
    eng = SimEngine(block_size=4)
    async with _off(eng, 64, tier, lower_tier_deadline_s=None) as off, _released(tier):
        task = asyncio.ensure_future(off._lookup_and_pin(aiokv.block_hashes(tokens, 4, root=eng.layout.root)))
        await tier.reads_started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert off.cpu.index.stats().pending == 2
        tier.hold_reads.set()
        await tier.read_ended.wait()
        await _spin()
        assert off.cpu.index.stats().pending == 0


# ------------------------------------------------------------------------------------ validation
@pytest.mark.parametrize("name", ["write_through_max_delay_s", "lower_tier_deadline_s"])
@pytest.mark.parametrize("value", [0, -1.0, float("inf"), float("nan")])
def test_time_limits_must_be_positive_and_finite(name: str, value: float) -> None:
    eng = SimEngine(block_size=4)
    with pytest.raises(InvalidArgumentError, match=rf"^{name} must be > 0 seconds \(or None for no limit\)"):
        Offloader(eng.layout, tiers=[CPUTier(capacity_bytes=8 * eng.layout.slot_bytes)], **{name: value})


@pytest.mark.parametrize("name", ["write_through_max_delay_s", "lower_tier_deadline_s"])
def test_time_limits_must_be_numbers(name: str) -> None:
    eng = SimEngine(block_size=4)
    with pytest.raises(InvalidTypeError, match=f"^{name} must be a number of seconds or None, got str"):
        Offloader(eng.layout, tiers=[CPUTier(capacity_bytes=8 * eng.layout.slot_bytes)], **{name: "1"})


# ------------------------------------------------------------------ seeded schedules: accounting
class SteppedTier(MemoryTier):
    """Each write waits until the test ends it: storing its first ``n`` blocks, or failing."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[asyncio.Future[int], int]] = []

    async def write(self, keys: Sequence[bytes], payloads: Sequence[memoryview]) -> int:
        fut: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self.calls.append((fut, len(keys)))
        n = await fut
        for k, p in zip(keys[:n], payloads[:n], strict=True):
            self.data[k] = bytes(p)
        return n


@pytest.mark.asyncio
@pytest.mark.parametrize("seed", range(4))
async def test_seeded_schedules_keep_write_through_accounting_exact(seed: int) -> None:
    """Random interleavings of store floods, clock jumps and writes that finish, finish partly or fail: every
    block offered is written, dropped, queued or being written (exactly one), the CPU tier pins exactly the
    queued and in-flight blocks, no queued block is older than the limit after an offer, and every block the
    tier stored holds the bytes of the CPU tier's copy."""
    rng = random.Random(seed)
    tier = SteppedTier()
    clock = FakeClock()
    eng = SimEngine(num_blocks=64, block_size=4)
    slot = eng.layout.slot_bytes
    limit = 5.0
    off = _off(eng, 4096, tier, write_through_max_bytes=24 * slot, write_through_max_delay_s=limit)
    off._clock = clock
    async with off:
        w = _writer(off)
        served = 0
        for _step in range(120):
            action = rng.random()
            if action < 0.45:
                nblocks = rng.randint(1, 6)
                base = 10_000 * (served + 1) + seed * 10**8
                await _serve(eng, off, f"r{served}", list(range(base, base + 4 * nblocks + 1)))
                served += 1
                assert w.stats().oldest_queued_s <= limit
            elif action < 0.65:
                clock.now += rng.choice([0.1, 0.5, 1.0, 3.0, 6.0])
            elif tier.calls and not tier.calls[-1][0].done():
                fut, k = tier.calls[-1]
                roll = rng.random()
                if roll < 0.15:
                    fut.set_exception(ConnectionError("injected"))
                else:
                    fut.set_result(k if roll < 0.7 else rng.randint(0, k))
            await _spin(5)
            batch = w._batch_bytes // slot
            queued = len(w._queue)
            s = off.stats()
            assert w.in_flight_bytes == (queued + batch) * slot
            assert off.cpu.stats().pinned == queued + batch
            assert s.blocks_stored == w.written + w.dropped + queued + batch
            assert s.write_through_dropped_slow <= s.write_through_dropped
        for fut, k in tier.calls:
            if not fut.done():
                fut.set_result(k)
        while True:  # finish whatever is queued, one write at a time
            await _spin(5)
            open_calls = [(f, k) for f, k in tier.calls if not f.done()]
            if not open_calls and not w._queue and not w._batch_bytes:
                break
            for f, k in open_calls:
                f.set_result(k)
        await off.flush()
        s = off.stats()
        assert s.blocks_stored == w.written + w.dropped
        assert off.cpu.stats().pinned == 0
        # The schedule exercised every path.
        assert w.written > 0
        assert w.dropped_slow > 0
        assert w.errors > 0
        index = off.cpu.index
        for key, payload in tier.data.items():
            assert bytes(off.cpu.slot_view(index.slot(key))) == payload
