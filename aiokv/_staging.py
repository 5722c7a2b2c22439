"""Staging: blocks missing from the CPU tier are read from the lower tiers (fastest first) into fresh CPU slots,
under the load planner's decisions and the lower tiers' deadline (docs/tiers.md). It changes the CPU tier only
through the store core's public names (:meth:`~aiokv.store.BlockStore.prepare_fill` /
:meth:`~aiokv.store.BlockStore.complete_fill`, ``prepare_load`` / ``complete_load``): a slot being read into is
PENDING (invisible, never evicted) until the read has really ended, even when the caller gave up on it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._log import Throttled
    from ._planner import LoadPlanner
    from ._request import Request
    from ._stats import Counters
    from .store import BlockStore
    from .tiers._base import BackingTier
    from .tiers._cpu import CPUTier

__all__ = ["Staging"]


class Staging:
    """The offloader's reads from its lower tiers into the CPU tier. ``loop`` and ``clock`` are set when the
    offloader starts; ``promote(i, keys)`` offers blocks found in lower tier ``i`` to the faster ones'
    write-through; ``io`` is the offloader's set of reads still running (its close waits for them)."""

    def __init__(
        self,
        store: BlockStore,
        cpu: CPUTier,
        lower: tuple[BackingTier, ...],
        tier_names: tuple[str, ...],
        planner: LoadPlanner,
        counters: Counters,
        deadline_s: float | None,
        slot_bytes: int,
        log: Throttled,
        io: set[asyncio.Task[Any]],
        promote: Callable[[int, list[bytes]], None],
    ) -> None:
        self._store = store
        self._cpu = cpu
        self.lower = lower
        self._tier_names = tier_names
        self._planner = planner
        self._counters = counters
        self._deadline = deadline_s
        self._slot_bytes = slot_bytes
        self._log = log
        self._io = io
        self._promote = promote
        self.loop: asyncio.AbstractEventLoop = None  # type: ignore[assignment]  # set by Offloader.start()
        self.clock: Callable[[], float] = time.perf_counter

    async def pin_run(
        self, keys: list[bytes], source: Request | None = None, planned: bool = True
    ) -> tuple[list[bytes], list[int]]:
        """Pin the longest prefix of ``keys`` available across all tiers; return its keys and CPU slots.

        The load planner (``load_policy``) decides run by run: the CPU tier's leading run, then each lower
        tier's run, each restored only when that is expected to be faster than recomputing its tokens; a tier
        that loses is not used (its blocks are misses, counted in ``planner_skipped_blocks``) and one that
        cannot win is not even asked (``planner_skipped_lookups``). Blocks in the CPU tier are pinned where they are. Each run of blocks missing from it is staged from the
        lower tiers (fastest first) into fresh CPU slots, and the walk continues through the CPU blocks after
        the run (pinned before staging, so eviction cannot take them meanwhile). The prefix ends at a block no
        tier holds, one a tier fails to read or finds corrupt, or one still pending in the CPU tier. Cancelled,
        it releases every pin it took. ``planned=False`` (a grouped layout's window and state units, which
        are not token blocks): every run is restored, the planner is not asked.
        """
        store = self._store
        slots = store.prepare_load(keys)
        pinned = keys[: len(slots)]
        ahead: list[bytes] = []
        if planned and pinned and not self._planner.worth("cpu", len(pinned)):
            # Even the CPU tier's blocks restore slower than they recompute: so would every block after them.
            store.complete_load(pinned)
            pinned, slots = [], []
            keys = []
        try:
            pos = len(pinned)
            while pos < len(keys) and self.lower:
                end = pos
                while end < len(keys) and store.state(keys[end]) is None:
                    end += 1
                if end == pos:
                    break  # keys[pos] is pending in the CPU tier (being stored or staged)
                ahead_slots = store.prepare_load(keys[end:])
                ahead = keys[end : end + len(ahead_slots)]
                got_keys, got_slots = await self._stage_run(keys, pos, end, source, planned)
                pinned.extend(got_keys)
                slots.extend(got_slots)
                if len(got_keys) < end - pos:
                    break
                pinned.extend(ahead)
                slots.extend(ahead_slots)
                ahead = []
                pos = end + len(ahead_slots)
        except BaseException:
            store.complete_load(pinned)
            raise
        finally:
            store.complete_load(ahead)
        return pinned, slots

    async def _stage_run(
        self,
        keys: list[bytes],
        start: int,
        end: int,
        source: Request | None = None,
        planned: bool = True,
    ) -> tuple[list[bytes], list[int]]:
        """Stage ``keys[start:end]`` (all missing from the CPU tier) from the lower tiers, fastest first; return
        the pinned prefix that arrived."""
        got_keys: list[bytes] = []
        got_slots: list[int] = []
        pos = start
        try:
            planner = self._planner
            for ti, tier in enumerate(self.lower):
                if pos == end:
                    break
                name = self._tier_names[ti]
                if planned and not planner.worth_asking(name, end - pos):
                    continue  # no run this tier could hold would restore faster than it recomputes
                k, s = await self._stage(tier, name, keys, pos, end, source, planned)
                if not k:
                    continue
                got_keys.extend(k)
                got_slots.extend(s)
                pos += len(k)
                # Promote: blocks found in a slower tier are also written to the faster lower tiers (e.g. a
                # Redis hit lands on the local disk too), through the same bounded write-through.
                self._promote(ti, k)
        except BaseException:
            self._store.complete_load(got_keys)
            raise
        return got_keys, got_slots

    async def _stage(
        self,
        tier: BackingTier,
        name: str,
        keys: list[bytes],
        start: int,
        end: int,
        source: Request | None = None,
        planned: bool = True,
    ) -> tuple[list[bytes], list[int]]:
        """Copy the run of ``keys[start:end]`` held by ``tier`` into fresh CPU slots; pin and return the
        verified prefix. A tier that fails (or raises) yields a miss from the failing block on; so does one
        that has not answered the lookup and the read within ``lower_tier_deadline_s``; a run the planner
        finds slower to restore than to recompute is left alone (nothing staged). The time from the lookup
        to the end of the read is the tier's measured cost for the blocks that arrived (or, for a read
        abandoned at the deadline, for the blocks it was asked for)."""
        c = self._counters
        rest = keys[start:end]
        started = self.clock()
        deadline = None if self._deadline is None else self.loop.time() + self._deadline
        tenant, priority = (None, 0) if source is None else (source._tenant, source.priority)
        try:
            n = await self._tier_lookup(tier, rest, deadline)
        except Exception as exc:
            c.staging_misses += 1
            self._log.event("lookup in tier %r failed, a miss: %r", tier.name, exc)
            return [], []
        if n is None:  # past the deadline (counted and logged)
            c.staging_misses += 1
            return [], []
        n = min(n, len(rest))
        if n <= 0 or (planned and not self._planner.worth(name, n)):
            return [], []
        want, slots = self._store.prepare_fill(
            keys, start, start + n, tenant=tenant, priority=priority, origin=source
        )
        if not want:
            return [], []
        got = await self._read_into(tier, want, slots, deadline)
        if got is None:  # abandoned at the deadline: the read keeps its reservations until it ends
            c.staging_misses += len(want)
            # At least this slow: the planner learns it, so a tier that keeps missing the deadline is
            # recomputed rather than waited for (and re-measured now and then).
            self._planner.record_transfer(name, len(want) * self._slot_bytes, self.clock() - started)
            return [], []
        got = max(0, min(got, len(want)))
        if got:
            self._planner.record_transfer(name, got * self._slot_bytes, self.clock() - started)
        self._store.complete_fill(want, got)
        c.staged_blocks += got
        c.staging_misses += len(want) - got
        return want[:got], slots[:got]

    async def _tier_lookup(self, tier: BackingTier, keys: list[bytes], deadline: float | None) -> int | None:
        """``tier.lookup(keys)``, or ``None`` (counted, logged) when it has not answered by ``deadline`` (loop
        time): the lookup is then cancelled and left to end in the background (it holds no CPU slot)."""
        if deadline is None:
            return await tier.lookup(keys)
        task = self.loop.create_task(tier.lookup(keys), name=f"aiokv-lookup-{tier.name}")
        self._io.add(task)  # aclose() waits for an abandoned lookup too
        task.add_done_callback(self._io.discard)
        try:
            done, _ = await asyncio.wait((task,), timeout=max(0.0, deadline - self.loop.time()))
        except asyncio.CancelledError:
            task.cancel()
            task.add_done_callback(_retrieve)
            raise
        if done:
            return 0 if task.cancelled() else task.result()  # cancelled by a hard close: a miss
        task.cancel()
        task.add_done_callback(_retrieve)
        self._deadline_missed(tier, f"lookup of {len(keys)} blocks")
        return None

    def _deadline_missed(self, tier: BackingTier, what: str) -> None:
        self._counters.lower_tier_deadline_misses += 1
        self._log.event(
            "%s in tier %r passed the %.3g s deadline (lower_tier_deadline_s), abandoned (a miss, its blocks are "
            "recomputed): the tier is overloaded or hung, check it",
            what,
            tier.name,
            self._deadline,
        )

    async def _read_into(
        self, tier: BackingTier, keys: list[bytes], slots: list[int], deadline: float | None = None
    ) -> int | None:
        """``tier.read_into`` the reserved (pending) ``slots``. If the caller is cancelled, or the read has not
        ended by ``deadline`` (loop time; then ``None`` is returned), the read is cancelled too, and the slots
        are released only once the read has really ended (a tier's I/O thread may still be writing them)."""
        views = [self._cpu.slot_view(s) for s in slots]
        task = self.loop.create_task(tier.read_into(keys, views), name=f"aiokv-stage-{tier.name}")
        self._io.add(task)
        task.add_done_callback(self._io.discard)
        try:
            if deadline is None:
                return await asyncio.shield(task)
            await asyncio.wait((task,), timeout=max(0.0, deadline - self.loop.time()))
            if not task.done():
                task.cancel()
                task.add_done_callback(lambda t: self._abandon_read(t, keys))
                self._deadline_missed(tier, f"read of {len(keys)} blocks")
                return None
            return task.result()
        except asyncio.CancelledError:
            if not task.done():  # the caller was cancelled: abandon the read, keep its slots until it ends
                task.cancel()
                task.add_done_callback(lambda t: self._abandon_read(t, keys))
                raise
            exc: BaseException = asyncio.CancelledError()
        except Exception as err:
            exc = err
        self._log.event("reading %d blocks from tier %r failed, a miss: %r", len(keys), tier.name, exc)
        return 0

    def _abandon_read(self, task: asyncio.Task[Any], keys: list[bytes]) -> None:
        if not task.cancelled():
            task.exception()  # retrieved: an abandoned read's failure is not news
        self._store.complete_store(keys, success=False)


def _retrieve(task: asyncio.Task[Any]) -> None:
    """Done callback of an abandoned task: its outcome is not news."""
    if not task.cancelled():
        task.exception()
