"""The write-through: committed CPU blocks propagate to one lower tier in the background, within a byte and a
time budget (docs/tiers.md, "Write-through"). It uses the store core's public names only: a block is pinned
(:meth:`~aiokv.store.BlockStore.pin`) from the moment it is queued until the tier's write returned, so its slot
is never evicted or reused while the tier reads it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from ._log import Throttled, get_logger
from ._stats import WriteThroughStats

if TYPE_CHECKING:
    from .store import BlockStore
    from .tiers._base import BackingTier
    from .tiers._cpu import CPUTier

__all__ = ["WriteThrough"]

_log = get_logger("offloader")


class WriteThrough:
    """Propagates committed CPU blocks to one lower tier, in the background, within a byte and a time budget.

    Bounds, per tier: at most ``max_bytes`` queued or being written (beyond it, new blocks are dropped), and,
    with ``max_delay_s``, no block waits longer than that in the queue (older ones are dropped) nor is offered
    when the tier's measured write rate (an EWMA over finished writes, lowered while a write runs late) says
    the bytes already ahead of it would take longer than that to drain; a write running longer than
    ``max_delay_s`` is cancelled (its blocks stay pinned until the tier's call has really returned). So a
    slow or hung tier sheds stores early instead of pinning CPU slots; every dropped block is counted and
    logged (throttled).
    """

    BATCH = 32
    ALPHA = 0.3  # EWMA weight of the newest write's rate

    def __init__(
        self,
        store: BlockStore,
        cpu: CPUTier,
        loop: asyncio.AbstractEventLoop,
        tier: BackingTier,
        max_bytes: int,
        max_delay_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._store = store
        self._cpu = cpu
        self._loop = loop
        self._tier = tier
        self._max_bytes = max_bytes
        self._max_delay = max_delay_s
        self._clock: Callable[[], float] = clock
        self._slot_bytes = cpu.slot_bytes
        self._tenants = tier.has_tenant_quotas  # write each block for its tenant (recorded by the CPU index)
        self._queue: deque[bytes] = deque()
        self._queued_at: deque[float] = deque()  # when each queued key was offered (clock time)
        self._wake: asyncio.Event = asyncio.Event()
        self._idle: asyncio.Event = asyncio.Event()
        self._idle.set()
        self._closing = False
        self._timer: asyncio.TimerHandle | None = None
        self._log = Throttled(_log, logging.WARNING, f"write-through to tier {tier.name!r} dropped (slow)")
        self._log_full = Throttled(
            _log, logging.WARNING, f"write-through to tier {tier.name!r} dropped (queue full)"
        )
        self._log_failed = Throttled(_log, logging.WARNING, f"write-through to tier {tier.name!r} failed")
        self.in_flight_bytes = 0
        self.written = 0
        self.dropped = 0
        self.dropped_slow = 0  # of ``dropped``: shed because the tier could not keep up within max_delay_s
        self.errors = 0
        # EWMA of the achieved write rate, bytes/s (None: nothing measured yet).
        self.rate: float | None = None
        self._batch_bytes = 0  # the write running now (0: none)
        self._batch_started = 0.0
        self._task = loop.create_task(self._run(), name=f"aiokv-write-through-{tier.name}")

    # ------------------------------------------------------------ the detector
    def _estimated_rate(self, now: float) -> float | None:
        """The tier's write rate as it looks now: the EWMA, lowered to what the running write achieves so far
        when that is less (a hung tier's rate falls towards zero while its write does not return)."""
        rate = self.rate
        if self._batch_bytes:
            elapsed = now - self._batch_started
            if elapsed > 0:
                running = self._batch_bytes / elapsed
                rate = running if rate is None else min(rate, running)
        return rate

    def expected_delay_s(self) -> float:
        """Seconds the bytes queued or being written would take to drain at the estimated rate (0 when nothing
        is ahead or nothing was measured yet)."""
        ahead = self.in_flight_bytes
        if not ahead:
            return 0.0
        rate = self._estimated_rate(self._clock())
        if rate is None:
            return 0.0
        return ahead / rate if rate > 0 else float("inf")

    def _shed(self, n: int, why: str) -> None:
        self.dropped += n
        self.dropped_slow += n
        self._log.event(
            "write-through to tier %r dropped %d blocks: %s (limit %.3g s, write_through_max_delay_s); they "
            "stay in the faster tiers only: the tier is slower than the stores offered to it, check its load",
            self._tier.name,
            n,
            why,
            self._max_delay,
        )

    def _expire(self) -> None:
        """Drop queued blocks offered longer than ``max_delay_s`` ago (never those being written)."""
        if self._max_delay is None or not self._queue:
            return
        limit = self._clock() - self._max_delay
        times = self._queued_at
        n = 0
        while times and times[0] < limit:
            times.popleft()
            n += 1
        if n:
            expired = [self._queue.popleft() for _ in range(n)]
            self._store.complete_load(expired)
            self.in_flight_bytes -= n * self._slot_bytes
            self._shed(n, "queued too long, the tier does not keep up")
            if not self._queue and not self._batch_bytes:
                self._idle.set()

    def _on_timer(self) -> None:
        self._timer = None
        self._expire()
        self._arm()

    def _arm(self) -> None:
        """Schedule the expiry of the queue's head (the queue also expires on every offer and batch)."""
        if self._max_delay is None or self._timer is not None or not self._queued_at or self._closing:
            return
        due = self._queued_at[0] + self._max_delay - self._clock()
        self._timer = self._loop.call_later(max(due, 0.0) + 1e-3, self._on_timer)

    # ------------------------------------------------------------ queue
    def offer(self, keys: Sequence[bytes]) -> None:
        """Queue ``keys`` (READY in the CPU tier) for writing; over budget they are dropped and counted."""
        if self._closing:
            self.dropped += len(keys)
            return
        self._expire()
        store = self._store
        now = self._clock()
        slot_bytes = self._slot_bytes
        limit = self._max_delay
        rate = self._estimated_rate(now) if limit is not None else None
        slow = full = 0
        for key in keys:
            ahead = self.in_flight_bytes
            if ahead + slot_bytes > self._max_bytes:
                self.dropped += 1
                full += 1
                continue
            # Shed early when what is already ahead cannot drain in time; never when nothing is ahead, so a
            # tier that recovers is measured again by the next block offered.
            if rate is not None and limit is not None and ahead and (ahead + slot_bytes) > rate * limit:
                slow += 1
                continue
            store.pin(key)  # the slot must not be evicted or reused while the tier reads it
            self._queue.append(key)
            self._queued_at.append(now)
            self.in_flight_bytes += slot_bytes
        if slow:
            self._shed(slow, f"the tier writes {rate or 0.0:.3g} B/s, too slow for what is queued")
        if full:
            self._log_full.event(
                "write-through to tier %r dropped %d blocks: %d bytes already queued or being written "
                "(write_through_max_bytes %d); they stay in the faster tiers only: the tier is slower than the "
                "stores offered to it, check its load",
                self._tier.name,
                full,
                self.in_flight_bytes,
                self._max_bytes,
            )
        if self._queue:
            self._idle.clear()
            self._arm()
        self._wake.set()

    async def _run(self) -> None:
        store = self._store
        cpu = self._cpu
        queue = self._queue
        times = self._queued_at
        while True:
            self._expire()
            if not queue:
                self._idle.set()
                if self._closing:
                    return
                self._wake.clear()
                await self._wake.wait()
                continue
            k = min(self.BATCH, len(queue))
            batch = [queue.popleft() for _ in range(k)]
            for _ in range(k):
                times.popleft()
            nbytes = k * self._slot_bytes
            self._batch_bytes = nbytes
            self._batch_started = started = self._clock()
            timed_out = False
            try:
                views = [cpu.slot_view(store.slot(key)) for key in batch]
                if self._tenants:
                    write = self._tier.write_tenants(batch, views, [store.tenant(key) for key in batch])
                else:
                    write = self._tier.write(batch, views)
                if self._max_delay is None or self._closing:
                    n = await write
                else:
                    n = await asyncio.wait_for(write, self._max_delay)
            except asyncio.CancelledError:
                self._batch_bytes = 0
                store.complete_load(batch)
                self.in_flight_bytes -= nbytes
                self.dropped += k
                raise
            except asyncio.TimeoutError:
                n = 0
                timed_out = True
            except Exception as exc:
                n = 0
                self.errors += 1
                self._log_failed.event(
                    "write-through to tier %r: a write of %d blocks raised, dropped: %r",
                    self._tier.name,
                    k,
                    exc,
                )
            self._batch_bytes = 0
            elapsed = self._clock() - started
            store.complete_load(batch)
            self.in_flight_bytes -= nbytes
            n = max(0, min(n, k))
            self.written += n
            if timed_out:
                self._shed(k, "a write ran past the limit and was cancelled")
            else:
                self.dropped += k - n
            if timed_out or elapsed > 0:
                sample = 0.0 if timed_out else nbytes / elapsed
                prev = self.rate
                self.rate = sample if prev is None else (1 - self.ALPHA) * prev + self.ALPHA * sample

    async def wait_idle(self) -> None:
        if not self._task.done():
            await self._idle.wait()

    def stats(self) -> WriteThroughStats:
        now = self._clock()
        return WriteThroughStats(
            tier=self._tier.name,
            queued_blocks=len(self._queue),
            in_flight_bytes=self.in_flight_bytes,
            written=self.written,
            dropped=self.dropped,
            dropped_slow=self.dropped_slow,
            errors=self.errors,
            rate_bytes_per_s=self.rate if self.rate is not None else 0.0,
            expected_delay_s=self.expected_delay_s(),
            oldest_queued_s=now - self._queued_at[0] if self._queued_at else 0.0,
        )

    async def aclose(self, timeout: float) -> None:
        self._closing = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._wake.set()
        try:
            await asyncio.wait_for(asyncio.shield(self._task), timeout)
        except (asyncio.TimeoutError, Exception):
            self._task.cancel()
            with contextlib.suppress(BaseException):
                await self._task
        # Whatever was never attempted is released and counted.
        if self._queue:
            self._store.complete_load(list(self._queue))
            self.in_flight_bytes -= len(self._queue) * self._slot_bytes
            self.dropped += len(self._queue)
            self._queue.clear()
            self._queued_at.clear()
        self._idle.set()
        for throttle in (self._log, self._log_full, self._log_failed):
            throttle.flush()
