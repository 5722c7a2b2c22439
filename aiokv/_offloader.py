"""The Offloader: owns the tiers, the transfer executor and the open requests.

Sync core, async shell: index changes (reserve, commit, pin, evict) are plain calls on
:class:`~aiokv.tiers._index.BlockIndex`, made on the loop thread and therefore atomic; the async parts only
execute copies (executor), lower-tier I/O (staging and write-through) and wait for them.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import math
import threading
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any

from ._config import OffloaderConfig
from ._errors import (
    ClosedError,
    DuplicateRequestError,
    InvalidArgumentError,
    InvalidTypeError,
    WrongThreadError,
)
from ._groups import GroupedLayout
from ._hashing import _canon, _chain_in_place, check_token_ids
from ._host import RequestHost
from ._layout import KVLayout
from ._log import Throttled, get_logger
from ._planner import LoadPlanner
from ._request import Request, StepUpdate, _Ev, _flush_plain, _track_all, step_batch
from ._staging import Staging
from ._stats import Counters, OffloaderStats
from ._writethrough import WriteThrough
from .store import BlockStore
from .tiers._base import BackingTier, TierSpec
from .tiers._codec import segments_of
from .tiers._cpu import CPUTier
from .tiers._policies import EvictionPolicy
from .transfer._binding import DeviceBinding
from .transfer._executor import DEFAULT_STAGING_BYTES, TransferExecutor
from .transfer._future import LayeredTransfer, TransferFuture

if TYPE_CHECKING:
    from .events._emit import TierEvents
    from .events._log import KVEventLog, KVEventStream, KVSnapshot
    from .events._zmq import ZmqEventPublisher

__all__ = ["Offloader", "OffloaderState"]

_log = get_logger("offloader")

_GROUPED_LOOKUP_TRIES = 8  # boundaries a grouped lookup tries before giving up (each may ask the lower tiers)
_MAX_PRIORITY = 100  # Offloader.open(priority=...) is in [-_MAX_PRIORITY, _MAX_PRIORITY]


class OffloaderState(enum.Enum):
    """Where an :class:`Offloader` is in its lifecycle (``Offloader.state``, shown in its ``repr``):
    ``NEW`` -> ``RUNNING`` (:meth:`~Offloader.start`, or entering ``async with``) -> ``CLOSING``
    (:meth:`~Offloader.aclose` is draining requests, copies and write-through) -> ``CLOSED``. An offloader
    closed before it started goes from ``NEW`` to ``CLOSED``; none is started twice."""

    NEW = "new"
    RUNNING = "running"
    CLOSING = "closing"
    CLOSED = "closed"

    def __str__(self) -> str:
        return self.value


class Offloader:
    """Offloads full KV blocks of an engine's requests to tiers and loads cached prefixes back.

    Use as ``async with Offloader(layout, tiers=[CPUTier(capacity_bytes=...)]) as off:``. The first tier must
    be a :class:`~aiokv.CPUTier`; further tiers (disk, Redis) are written through from it and staged back
    into it on lookup.

    Parameters:
        layout: the engine's paged KV tensors.
        tiers: the tier hierarchy, fastest first.
        eviction: the CPU tier's eviction policy name (``"lru"``, ``"arc"``, ...) or an EvictionPolicy; set it
            here or on the :class:`~aiokv.CPUTier`, not both (two different policies are refused). Default:
            the tier's, else ``"lru"``. ``stats().eviction`` names the active one.
        write_through_max_bytes: bound on bytes queued or in flight towards each lower tier; writes beyond
            it are dropped and counted (the decode path never waits on a slow tier).
        close_timeout: seconds ``aclose()`` waits for queued write-through before dropping it.
        store_partial_last_block: also store a request's partially filled last block at finish/preempt (under
            a key that commits to exactly its tokens). ``lookup()`` may then return a count that is not a
            multiple of ``block_size``: the last loaded block is partially filled. CPU tier only.
        compute_stream: device layouts only: the stream the engine's forward writes the KV on. ``step()``,
            ``load()``, ``finish()`` and ``preempt()`` mark its current point when called, and the copies they
            cause wait for that point on the device. ``None``: the calling thread's current stream at each call.
        device: the device the layout's tensors live on, for the device data path. ``None`` picks CUDA for a
            CUDA layout and the CPU copy kernel for a CPU layout; a :class:`~aiokv.transfer.SimulatedDevice`
            runs a CPU layout through the device data path with CUDA's stream semantics (tests, benchmarks).
        staging_bytes: device memory for staging copies, both directions together, allocated once at start.
            Larger transfers are cut into chunks; never more is allocated.
        copy_threads: CPU backend: threads one large copy is split over (default: the usable cores, at most 4).
        kv_events: record every tier's block stored / removed / cleared events (see docs/events.md): ``True``
            for a :class:`~aiokv.events.KVEventLog` with the default replay buffer, or the log to use. Read
            them with :meth:`events` and :meth:`kv_snapshot`. Off by default: then nothing is recorded and the
            data path pays one ``is None`` test per operation.
        kv_events_endpoint: also publish the events in vLLM's KV-events wire format (ZMQ PUB, msgpack) on
            this endpoint, e.g. ``"tcp://127.0.0.1:5557"`` (implies ``kv_events``; needs ``aiokv[events]``).
            The publisher runs from :meth:`start` to :meth:`aclose`; :attr:`kv_events_publisher` is it.
        kv_events_replay_endpoint: the publisher's replay socket (ZMQ ROUTER) for subscribers that missed
            messages, e.g. ``"tcp://127.0.0.1:5558"``; ``None``: no replay service.
        write_through_max_delay_s: back-pressure on each lower tier's write-through: a block queued longer than
            this is dropped, a block is dropped at once when the tier's measured write rate (an EWMA) says what
            is ahead of it would take longer than this to write, and a write running longer is cancelled. So
            a slow or hung tier never pins CPU slots for long; drops are counted in
            ``stats().write_through_dropped_slow`` and logged. ``None``: only ``write_through_max_bytes``
            bounds the queue. See docs/backpressure.md.
        lower_tier_deadline_s: staging deadline: a lower tier's lookup plus read of one run of blocks that
            takes longer is abandoned and the run is a miss (counted in
            ``stats().lower_tier_deadline_misses``); the CPU slots it was reading into are released only once
            the tier's read has really ended. ``None``: no deadline (the tiers' own timeouts still apply).
        load_policy: ``"decide"`` (default): :meth:`Request.lookup` returns only the prefix whose restore is
            expected to finish before recomputing it would, from each tier's measured load cost and the
            engine's prefill rate (the fast tier's blocks, stopping where a slower tier loses; docs/tuning.md).
            Until both are measured it restores every hit, exactly as ``"always"`` does.
        prefill_tokens_per_s: the engine's prefill speed, for ``"decide"``. ``None``: measured from
            :meth:`record_prefill` reports (the reference engine makes them); while unknown, every hit is
            restored.

    Threads: an offloader and its requests belong to the thread running the event loop it was started on;
    every method of theirs raises :class:`~aiokv.WrongThreadError` when called from another thread (hand calls
    over with ``loop.call_soon_threadsafe``). Failures of copies and lower tiers are misses, counted in
    :meth:`stats` and logged to the ``aiokv.offloader`` logger, never exceptions raised into an engine's step.
    """

    def __init__(
        self,
        layout: KVLayout,
        tiers: Sequence[CPUTier | BackingTier] | None = None,
        *,
        eviction: str | EvictionPolicy | None = None,
        write_through_max_bytes: int = 256 << 20,
        close_timeout: float = 30.0,
        store_partial_last_block: bool = False,
        compute_stream: Any = None,
        device: DeviceBinding | None = None,
        staging_bytes: int = DEFAULT_STAGING_BYTES,
        copy_threads: int | None = None,
        kv_events: bool | KVEventLog = False,
        kv_events_endpoint: str | None = None,
        kv_events_replay_endpoint: str | None = None,
        write_through_max_delay_s: float | None = 5.0,
        lower_tier_deadline_s: float | None = 10.0,
        load_policy: str = "decide",
        prefill_tokens_per_s: float | None = None,
    ) -> None:
        cfg = OffloaderConfig.build(
            layout,
            tiers,
            eviction=eviction,
            write_through_max_bytes=write_through_max_bytes,
            close_timeout=close_timeout,
            store_partial_last_block=store_partial_last_block,
            compute_stream=compute_stream,
            device=device,
            staging_bytes=staging_bytes,
            copy_threads=copy_threads,
            kv_events=kv_events,
            kv_events_endpoint=kv_events_endpoint,
            kv_events_replay_endpoint=kv_events_replay_endpoint,
            write_through_max_delay_s=write_through_max_delay_s,
            lower_tier_deadline_s=lower_tier_deadline_s,
            load_policy=load_policy,
            prefill_tokens_per_s=prefill_tokens_per_s,
        )
        self.config = cfg
        device = cfg.device
        assert tiers is not None
        cpu = tiers[0]
        assert isinstance(cpu, CPUTier)  # (checked by OffloaderConfig.build)
        self._grouped: GroupedLayout | None = layout if isinstance(layout, GroupedLayout) else None
        # Grouped layouts under TP: units of replicated parts that rank 0 writes through (this rank does not).
        self._local_only: set[bytes] = set()
        self.layout = layout
        self.block_size = layout.block_size
        self._num_blocks = layout.num_blocks  # read on every step(): an attribute, not a property chain
        self.store_partial_last_block = cfg.store_partial_last_block
        self._compute_stream = cfg.compute_stream
        self._device = device
        self._staging_bytes = cfg.staging_bytes
        self._copy_threads = cfg.copy_threads
        self.cpu: CPUTier = cpu
        # Allocates the host buffer (pinned for a device); raises CapacityError if too small.
        self.cpu.bind(layout, cfg.eviction, device)
        self.lower: tuple[BackingTier, ...] = tuple(tiers[1:])  # type: ignore[arg-type]
        # Every decision about the CPU tier's blocks goes through the store core (aiokv.store), never around it.
        self._store = BlockStore.over(self.cpu.index, block_size=self.block_size)
        # Lower tiers with per-tenant quotas: the CPU index records each block's tenant for their write-through.
        self._tenant_tiers = tuple(t for t in self.lower if t.has_tenant_quotas)
        if self._tenant_tiers:
            self.cpu.index.track_tenants()
        self._write_through_max_bytes = cfg.write_through_max_bytes
        self._close_timeout = cfg.close_timeout
        self._write_through_max_delay = cfg.write_through_max_delay_s
        self._lower_tier_deadline = cfg.lower_tier_deadline_s
        self._clock: Callable[[], float] = time.monotonic  # write-through rate and queue ages (tests fake it)
        self._requests: dict[str, Request] = {}
        self._counters = Counters()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._executor: TransferExecutor | None = None
        self._writers: list[WriteThrough] = []
        self._state = OffloaderState.NEW
        self._thread: int | None = None  # the loop's thread, recorded at start
        self._closer: asyncio.Task[None] | None = None
        self._closed_tiers: set[int] = set()
        self._io: set[asyncio.Task[Any]] = set()  # lower-tier reads into CPU slots still running
        self._log_copy = Throttled(_log, logging.WARNING, "failed copies")
        self._log_tier = Throttled(_log, logging.WARNING, "failed lower-tier reads")
        # Bound once: completion callbacks are per copy, and the control path avoids allocating per copy.
        self._store_done_cb = self._store_done
        self._tick_store: TransferFuture | None = None  # the store future later stores of this tick may join
        self._load_done_cb = self._load_done
        self._event_log: KVEventLog | None = None
        self._ev: TierEvents | None = None  # the CPU tier's event sink (None: events off)
        self._ev_sinks: list[TierEvents] = []
        self._ev_endpoints = cfg.kv_events_endpoints
        self.kv_events_publisher: ZmqEventPublisher | None = None
        self._planner = LoadPlanner(
            layout.slot_bytes,
            layout.block_size,
            mode=cfg.load_policy,
            prefill_tokens_per_s=cfg.prefill_tokens_per_s,
            load_tier="cpu",
        )
        self._tier_names = _planner_names(self.lower)
        self._staging = Staging(
            self._store,
            self.cpu,
            self.lower,
            self._tier_names,
            self._planner,
            self._counters,
            cfg.lower_tier_deadline_s,
            layout.slot_bytes,
            self._log_tier,
            self._io,
            self._promote,
        )
        # Transfer costs for the planner are timed with this clock (tests replace it with a fake one).
        self._cost_clock: Callable[[], float] = time.perf_counter
        if cfg.events_on:
            self._enable_events(cfg.kv_events)
        # What requests may use of this offloader (public names only; loop, executor, thread set by start()).
        # ``deferred``: stores that steps of this tick completed, submitted together by the executor's flush
        # (see _flush_deferred): (request, first block, end block, its block list, generation).
        self._host = RequestHost(
            layout=layout,
            block_size=self.block_size,
            num_blocks=self._num_blocks,
            store_partial_last_block=self.store_partial_last_block,
            grouped=self._grouped,
            device=self._device,
            counters=self._counters,
            wrong_thread=self._wrong_thread,
            mark=self._mark,
            flush_deferred=self._flush_deferred,
            lookup_and_pin=self._lookup_and_pin,
            grouped_lookup=self._grouped_lookup,
            pin_ready=self._pin_ready,
            unpin=self._unpin,
            retain=self._retain,
            store_blocks=self._store_blocks,
            store_units=self._store_units,
            store_one=self._store_one,
            load_blocks=self._load_blocks,
            store_not_submitted=self._store_not_submitted,
            load_not_submitted=self._load_not_submitted,
            load_poisoned=self._load_poisoned,
            request_ended=self._request_ended,
        )

    def _enable_events(self, kv_events: object) -> None:
        """Give every tier an event sink writing to one log (the CPU tier's evictions are reported too)."""
        from .events._emit import TierEvents
        from .events._log import KVEventLog

        log = kv_events if isinstance(kv_events, KVEventLog) else KVEventLog()
        bs = self.block_size
        self._event_log = log
        self._ev = TierEvents(log, "cpu", "CPU", bs)
        self._ev_sinks = [self._ev]
        self._store.record_events(self._ev)

        def resolve(key: bytes) -> Any:
            return log.block("cpu", key)

        names = {"cpu"}
        for i, tier in enumerate(self.lower, start=1):
            name = tier.name if tier.name not in names else f"{tier.name}{i}"
            names.add(name)
            sink = TierEvents(log, name, tier.medium, bs, resolve)
            tier.attach_events(sink)
            self._ev_sinks.append(sink)

    # ------------------------------------------------------------- lifecycle
    async def __aenter__(self) -> Offloader:
        await self.start()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    async def start(self) -> None:
        if self._state is not OffloaderState.NEW:
            raise ClosedError(f"offloader cannot be started twice (it is {self._state})")
        self._loop = asyncio.get_running_loop()
        self._thread = threading.get_ident()
        self._executor = TransferExecutor(
            self.layout,
            self.cpu.buffer,
            self._loop,
            device=self._device,
            compute_stream=self._compute_stream,
            staging_bytes=self._staging_bytes,
            copy_threads=self._copy_threads,
        )
        self._executor.before_flush(self._flush_deferred)
        host = self._host
        host.loop, host.executor, host.thread = self._loop, self._executor, self._thread
        self._staging.loop, self._staging.clock = self._loop, self._cost_clock
        spec = TierSpec(
            payload_bytes=self.layout.slot_bytes,
            fingerprint=self.layout.fingerprint,
            block_size=self.layout.block_size,
            description=self.layout.describe(),
            segments=segments_of(self.layout),
        )
        opened: list[BackingTier] = []
        try:
            for tier in self.lower:
                await tier.open(spec)
                opened.append(tier)
        except BaseException:
            for tier in opened:
                await tier.aclose()
            await self._executor.aclose()
            raise
        self._writers = [
            WriteThrough(
                self._store,
                self.cpu,
                self._loop,
                t,
                self._write_through_max_bytes,
                self._write_through_max_delay,
                self._clock,
            )
            for t in self.lower
        ]
        if self._ev_endpoints is not None and self._event_log is not None:
            try:
                from .events._zmq import ZmqEventPublisher

                self.kv_events_publisher = ZmqEventPublisher(self._event_log, *self._ev_endpoints)
                self.kv_events_publisher.start()
            except BaseException:
                for w in self._writers:
                    await w.aclose(0.0)
                for tier in opened:
                    await tier.aclose()
                await self._executor.aclose()
                raise
        self._state = OffloaderState.RUNNING
        _log.debug(
            "offloader started: %s; tiers: cpu (%d slots)%s",
            self.layout.describe(),
            self.cpu.stats().num_slots,
            "".join(f", {t.name}" for t in self.lower),
        )

    async def aclose(self) -> None:
        """Abort open requests, wait for their copies, flush write-through (bounded), close tiers.

        Idempotent and complete: the close runs in a task of its own, which a cancelled ``aclose()`` leaves
        running; calling ``aclose()`` again waits for it. If that task is cancelled itself (a loop shutting
        down), it finishes as a hard close: write-through still queued is dropped at once and requests' tasks
        are cancelled, but copies in flight are still waited for (they cannot be recalled) and every thread is
        stopped. Nothing aiokv started outlives it; the host buffer is released last.
        """
        if self._state is OffloaderState.CLOSED:
            return
        if self._state is OffloaderState.NEW:
            self._state = OffloaderState.CLOSED
            self.cpu.release()
            if self._event_log is not None:
                self._event_log.close()  # no tier ever held a block: streams just end
            return
        self._check_thread("aclose")
        self._state = OffloaderState.CLOSING
        closer = self._closer
        if closer is None or closer.done():  # first call, or a closer that failed: start (again)
            closer = self._closer = self.loop.create_task(self._close(), name="aiokv-offloader-close")
        await asyncio.shield(closer)

    async def _close(self) -> None:
        steps: list[Callable[[bool], Awaitable[None]]] = [
            self._close_requests,
            self._close_io,
            self._close_writers,
            self._close_executor,
            self._close_tiers,
            self._close_events,
        ]
        cancelled = False
        for step in steps:
            while True:
                try:
                    await step(cancelled)
                    break
                except asyncio.CancelledError:
                    cancelled = True  # every step is idempotent: redo this one, hard
        self._state = OffloaderState.CLOSED
        self.cpu.release()
        self._log_copy.flush()
        self._log_tier.flush()
        if cancelled:
            raise asyncio.CancelledError

    async def _close_requests(self, hard: bool) -> None:
        reqs = list(self._requests.values())
        if hard:
            for req in reqs:
                if req._task is not None:
                    req._task.cancel()  # a request ends as aborted once its copies are done
        pending = [req._abort_future() for req in reqs]
        for p in pending:
            with contextlib.suppress(Exception):
                await p

    async def _close_io(self, hard: bool) -> None:
        if not self._io:
            return
        if hard:
            for task in self._io:
                task.cancel()
        await asyncio.wait(list(self._io))

    async def _close_writers(self, hard: bool) -> None:
        for w in self._writers:
            await w.aclose(0.0 if hard else self._close_timeout)

    async def _close_executor(self, hard: bool) -> None:
        if self._executor is not None:
            await self._executor.aclose()

    async def _close_tiers(self, hard: bool) -> None:
        for i, tier in enumerate(self.lower):
            if i in self._closed_tiers:
                continue
            try:
                await tier.aclose()
            except Exception as exc:
                _log.warning("closing tier %r failed: %r", tier.name, exc)
            self._closed_tiers.add(i)

    async def _close_events(self, hard: bool) -> None:
        """Every tier is cleared (this offloader serves none of its blocks any more), then the log is closed
        (its subscriptions end once drained) and the publisher, if any, sends what is left and stops."""
        log = self._event_log
        if log is None:
            return
        if not log.closed:
            for sink in self._ev_sinks:
                sink.cleared()
            log.close()
        pub = self.kv_events_publisher
        if pub is not None:
            if not hard:
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(pub.wait_published(), 1.0)
            await pub.aclose()

    async def flush(self) -> None:
        """Wait until every block committed so far has been written through to the lower tiers (or dropped)."""
        self._check_thread("flush")
        for w in self._writers:
            await w.wait_idle()

    @property
    def running(self) -> bool:
        """True between :meth:`start` and :meth:`aclose`: requests may be opened."""
        return self._state is OffloaderState.RUNNING

    @property
    def state(self) -> OffloaderState:
        """Where the offloader is in its lifecycle (:class:`OffloaderState`)."""
        return self._state

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            raise ClosedError("offloader is not started; use 'async with Offloader(...)'")
        return self._loop

    @property
    def executor(self) -> TransferExecutor:
        if self._executor is None:
            raise ClosedError("offloader is not started; use 'async with Offloader(...)'")
        return self._executor

    @property
    def device(self) -> DeviceBinding | None:
        """The device binding of the data path (CUDA or simulated), ``None`` on the CPU backend."""
        return self._device

    # ------------------------------------------------------------- KV events
    @property
    def event_log(self) -> KVEventLog | None:
        """The :class:`~aiokv.events.KVEventLog` every tier reports to (``None`` when ``kv_events`` is off)."""
        return self._event_log

    def events(self, from_seq: int | None = None) -> KVEventStream:
        """``async for item in off.events():`` every tier's KV events in order (see docs/events.md).

        The first item is a :class:`~aiokv.events.KVSnapshot` of every tier (unless ``from_seq`` names an
        event still in the replay buffer: then the events after it come first); after that,
        :class:`~aiokv.events.KVEvent` items, and another snapshot whenever the consumer fell further behind
        than the buffer (the consumer replaces its state with it). The stream ends after :meth:`aclose`, whose
        last events clear every tier."""
        log = self._events_on("events")
        if from_seq is not None and (
            isinstance(from_seq, bool) or not isinstance(from_seq, int) or from_seq < 0
        ):
            raise InvalidArgumentError(f"from_seq must be an int >= 0 or None, got {from_seq!r}")
        return log.subscribe(from_seq)

    def kv_snapshot(self) -> KVSnapshot:
        """Every tier's blocks now, with the sequence number of the last event they include."""
        return self._events_on("kv_snapshot").snapshot()

    def _events_on(self, what: str) -> KVEventLog:
        self._check_thread(what)
        if self._event_log is None:
            raise InvalidArgumentError(
                f"{what}() needs KV events: create the Offloader with kv_events=True (or a KVEventLog)"
            )
        return self._event_log

    def _check_thread(self, what: str) -> None:
        if self._thread is not None and threading.get_ident() != self._thread:
            raise self._wrong_thread(what)

    def _wrong_thread(self, what: str) -> WrongThreadError:
        return WrongThreadError(
            f"{what}() must be called on the thread running the offloader's event loop (thread "
            f"{self._thread}), got thread {threading.get_ident()}: hand the call over with "
            "loop.call_soon_threadsafe"
        )

    def _mark(self) -> Any:
        """The compute stream's current point, for copies to wait on (``None`` without a device)."""
        if self._device is None:
            return None
        return self.executor.mark()

    # --------------------------------------------------------------- requests
    def open(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        salt: object = None,
        *,
        extra_keys: Sequence[object] = (),
        max_store_tokens: int | None = None,
        max_load_tokens: int | None = None,
        store_decode: bool = True,
        retain_s: float | None = None,
        priority: int = 0,
    ) -> Request:
        """Open a request and start its state-machine task. ``salt`` (e.g. a tenant id) makes its block
        hashes disjoint from other salts'; ``extra_keys`` (LoRA id, multimodal hashes, ...) likewise.

        Per-request caps, counted in tokens from the start of the sequence (prompt, then generated tokens):
        ``max_store_tokens`` stores only blocks lying entirely within the first ``max_store_tokens`` tokens
        (``0``: store nothing); ``max_load_tokens`` makes :meth:`Request.lookup` return at most that many
        tokens; ``store_decode=False`` stores only blocks lying entirely within the prompt, not the blocks
        completed by generated tokens. ``None`` / ``True`` (the defaults) cap nothing. The caps are applied
        where blocks are stored and looked up, so :meth:`Request.step` costs the same.

        ``retain_s``: when the request finishes, its blocks in the CPU tier get retention for that many seconds
        (a conversation's next turn is expected within it): a policy with retention (``eviction="session"``)
        evicts them only after every block without it until the time is up; other policies ignore it.

        ``priority`` (an int in ``-100..100``, default 0): the blocks this request stores in the CPU tier, or
        stages into it from a lower tier, carry it; with ``eviction="session"`` lower-priority blocks are
        evicted first among blocks with the same retention status (a block stored again by a higher-priority
        request takes the higher priority; a hit does not change it). Other policies ignore it; the
        write-through queues and the lower tiers do not use it."""
        self._check_thread("open")
        if self._state is not OffloaderState.RUNNING:
            raise ClosedError(
                "offloader is not started; use 'async with Offloader(...)'"
                if self._state is OffloaderState.NEW
                else f"offloader is {self._state}"
            )
        if not isinstance(request_id, (str, int)) or isinstance(request_id, bool):
            raise InvalidTypeError(f"request_id must be a str or int, got {type(request_id).__name__}")
        key = str(request_id)
        if key in self._requests:
            raise DuplicateRequestError(f"request_id {key!r} is already open")
        tokens = check_token_ids(prompt_token_ids, "prompt_token_ids")
        if not tokens:
            raise InvalidArgumentError("prompt_token_ids must not be empty")
        _canon(salt)  # validates the salt's type early
        extra = tuple(extra_keys)
        _canon(extra)
        _check_token_cap(max_store_tokens, "max_store_tokens")
        _check_token_cap(max_load_tokens, "max_load_tokens")
        if not isinstance(store_decode, bool):
            raise InvalidTypeError(f"store_decode must be a bool, got {type(store_decode).__name__}")
        if retain_s is not None:
            if isinstance(retain_s, bool) or not isinstance(retain_s, (int, float)):
                raise InvalidTypeError(f"retain_s must be a number or None, got {type(retain_s).__name__}")
            if not (math.isfinite(retain_s) and retain_s >= 0):
                raise InvalidArgumentError(f"retain_s must be a finite number >= 0, got {retain_s}")
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise InvalidTypeError(f"priority must be an int, got {type(priority).__name__}")
        if not -_MAX_PRIORITY <= priority <= _MAX_PRIORITY:
            raise InvalidArgumentError(
                f"priority must be in [-{_MAX_PRIORITY}, {_MAX_PRIORITY}], got {priority}"
            )
        tenant = self._tenant_key(salt)
        req = Request(
            self._host,
            key,
            tokens,
            salt,
            extra,
            max_store_tokens=max_store_tokens,
            max_load_tokens=max_load_tokens,
            store_decode=store_decode,
            tenant=tenant,
            retain_s=retain_s,
            priority=priority,
        )
        self._requests[key] = req
        self._counters.requests_opened += 1
        req._start()
        return req

    def _tenant_key(self, salt: object) -> bytes | None:
        """The tenant (canonical salt) a request's blocks count against in the tiers with quotas, each asked
        for it (a callable quota learns the tenant's quota here); ``None`` when no tier has quotas."""
        tenant = None
        if self.cpu.has_tenant_quotas:
            tenant = self.cpu.tenant_key(salt)
        for tier in self._tenant_tiers:
            tenant = tier.tenant_key(salt)
        return tenant

    def step_batch(self, updates: Iterable[StepUpdate]) -> None:
        """Report one engine step for many requests: each update is a
        ``(request, num_computed_tokens, new_token_ids, new_block_ids)`` tuple, applied exactly as
        ``request.step(num_computed_tokens, new_token_ids, new_block_ids)`` would be, in order.

        The per-engine-step form of :meth:`Request.step` (as vLLM's connector gets one scheduler output per
        step): one call per engine iteration, and through :meth:`aiokv.ThreadBridge.step_batch` one hand-over
        to the loop per iteration for an engine running in another thread. An invalid update raises the error
        ``step()`` raises for it; the updates before it were applied, it and those after it were not.
        Synchronous, like ``step()``."""
        step_batch(self._host, updates)

    def get(self, request_id: str) -> Request | None:
        return self._requests.get(str(request_id))

    def _request_ended(self, req: Request) -> None:
        if self._requests.get(req.request_id) is req:
            del self._requests[req.request_id]
        self._counters.requests_finished += 1

    # ------------------------------------------------------------ data path
    def _unpin(self, keys: Sequence[bytes]) -> None:
        self._store.complete_load(keys)

    def _retain(self, keys: Sequence[bytes], seconds: float) -> None:
        """Give ``keys`` retention in the CPU tier's policy, when it has any (SessionPolicy.retain)."""
        self._store.retain(keys, seconds)

    def _store_blocks(
        self,
        chain: list[bytes],
        start: int,
        end: int,
        blocks: list[int],
        mark: Any = None,
        source: Request | None = None,
    ) -> TransferFuture | None:
        """Reserve CPU slots for blocks ``start..end-1`` (engine blocks ``blocks[i]``, hashes ``chain[i]``) and
        submit one store copy for them. ``source`` (the storing request) gives the blocks' quota tenant and
        eviction priority, and their tenant and tokens in KV events."""
        if self._grouped is not None:
            assert source is not None
            return self._store_units(chain, start, end, blocks, mark, source)
        if source is None:
            plan = self._store.prepare_store(chain, start, end)
        else:
            plan = self._store.prepare_store(
                chain, start, end, tenant=source._tenant, priority=source.priority, origin=source
            )
        if not plan.keys:
            return None
        return self._submit_store(plan.keys, plan.slots, [blocks[i] for i in plan.positions], mark)

    def _flush_deferred(self) -> None:
        """Submit the stores this tick's steps completed (the executor's flush calls this first, and so does
        its drain; every event posted to a request calls it before, so a store a step completed is always
        submitted before anything the engine did after that step). Decided as if each was submitted at its
        step: a request whose task has events queued or is busy gets it as a STORE event, in order; the
        others' are reserved and joined into one copy for the whole tick."""
        host = self._host
        deferred = host.deferred
        if not deferred:
            return
        host.deferred = []
        store = self._store
        plain = not store.records_events and self._grouped is None
        reserve, reserve_run = store.prepare_store_one, store.prepare_store
        bs = self.block_size
        keys: list[bytes] = []
        slots: list[int] = []
        ids: list[int] = []
        owners: list[Request] = []
        # The C loop (aiokv/_native/_step.c) takes the common entries (an idle request's decode block, absent,
        # with a free slot) and stops at the first it does not; this loop takes that one, and so on: the
        # order is this loop's. It needs a tier index without quotas or tenant accounting.
        index = store.index
        native = (
            _flush_plain
            if plain and _flush_plain is not None and index._quota is None and index._tenant_of is None
            else None
        )
        i = 0
        n = len(deferred)
        while i < n:
            if native is not None:
                i, reserved = native(deferred, i, bs, _chain_in_place, index, keys, slots, ids, owners)
                index._pending += reserved
                if i >= n:
                    break
            req, start, end, blocks, epoch = deferred[i]
            i += 1
            waiter = req._waiter
            if req._events or waiter is None or waiter.done():
                req._post_nowait(_Ev.STORE, (start, end, blocks, None, epoch))
                continue
            if not plain:
                req._store((start, end, blocks, None, epoch))
                continue
            # Request._store and _store_blocks, inline, for the whole tick.
            if req._abort_requested:
                continue
            if end * bs > req._store_cap:  # max_store_tokens / store_decode=False
                end = req._store_cap // bs
                if start >= end:
                    continue
            if epoch == req._failed_epoch:
                self._counters.stores_invalidated += end - start
                continue
            try:
                chain = req._chain(end)
                if end - start == 1:  # a decode step's block: reserve() alone costs half of reserve_run()
                    key = chain[start]
                    slot = reserve(key, chain[start - 1] if start else None, start, req._tenant, req.priority)
                    if slot is not None:
                        keys.append(key)
                        ids.append(blocks[start])
                        slots.append(slot)
                        owners.append(req)
                    continue
                plan = reserve_run(chain, start, end, tenant=req._tenant, priority=req.priority)
            except Exception as exc:
                self._store_not_submitted(req.request_id, exc)
                continue
            if plan.keys:
                keys += plan.keys
                ids += [blocks[p] for p in plan.positions]
                slots += plan.slots
                owners.append(req)
        if not keys:
            return
        try:
            tf = self._submit_store(keys, slots, ids, None)
        except Exception as exc:
            for req in owners:
                self._store_not_submitted(req.request_id, exc)
            return
        if _track_all is not None:
            _track_all(owners, tf)
        else:
            for req in owners:
                req._track(tf)

    def _store_one(
        self,
        key: bytes,
        parent: bytes | None,
        depth: int,
        block_id: int,
        mark: Any = None,
        source: Request | None = None,
        num_tokens: int | None = None,
    ) -> TransferFuture | None:
        tenant, priority = (None, 0) if source is None else (source._tenant, source.priority)
        slot = self._store.prepare_store_one(key, parent, depth, tenant, priority, source, num_tokens)
        if slot is None:
            return None
        return self._submit_store([key], [slot], [block_id], mark)

    # ----------------------------------------------------- grouped layouts
    def _store_units(
        self,
        chain: list[bytes],
        start: int,
        end: int,
        rows: list[Any],
        mark: Any,
        source: Request,
        final: bool = False,
    ) -> TransferFuture | None:
        """A grouped layout's store of key blocks ``start..end-1`` (``rows[i]``: block ``i``'s engine id per
        group): every base unit, and the window and state units some kept boundary can use (see
        :class:`aiokv._groups.Retention`). ``final``: the request's last boundary is ``end``: store what it
        needs that the fill-time rule left out (and nothing else)."""
        lay = self._grouped
        assert lay is not None
        reserve = self._store.prepare_store_one
        c = self._counters
        tenant, priority = source._tenant, source.priority
        keep = lay.retention
        prompt = source._prompt_blocks
        parts = lay.parts
        keys: list[bytes] = []
        slots: list[int] = []
        refs: list[Any] = []

        # Replicated parts (latent groups) hold the same bytes on every TP rank: rank 0 writes them through
        # to the shared lower tiers, once; every rank keeps its own copy in its (private) CPU tier.
        local_only = self._local_only if lay.tp_rank and self._writers else None
        identity = lay._identity_first

        def add(key: bytes, unit: int, row: Any, parent: bytes | None, depth: int) -> int:
            slot = reserve(key, parent, depth, tenant, priority)
            if slot is None:
                return 0
            if local_only is not None and parts[lay.unit_parts[unit][0]].replicated:
                local_only.add(key)
            keys.append(key)
            slots.append(slot)
            refs.append((unit, row))
            return 1

        def held(part: int, row: Any) -> bool:
            return all(row[c] >= 0 for c in parts[part].columns)

        if final:
            for p, w in lay.windows:
                for j in range(max(start, end - w), end):
                    if keep.keep_window_at_fill(j, w, prompt) or not held(p, rows[j]):
                        continue
                    for u in lay.part_units(p):
                        c.retention_units_late += add(lay.unit_key(chain[j], u), u, rows[j], None, j)
            if end > 0 and end > start:
                for p in lay.state_parts:
                    if keep.keep_state_at_fill(end, prompt) or not held(p, rows[end - 1]):
                        continue
                    for u in lay.part_units(p):
                        c.retention_units_late += add(
                            lay.unit_key(chain[end - 1], u), u, rows[end - 1], None, end - 1
                        )
        else:
            base_units = lay.base_units
            key_of = lay.unit_key
            for i in range(start, end):
                key = chain[i]
                row = rows[i]
                parent = chain[i - 1] if i else None
                # A block already cached (its base units deduplicated) saves nothing by skipping its parts.
                new = True
                if base_units:
                    new = (
                        sum(
                            add(key if u == 0 and identity else key_of(key, u), u, row, parent, i)
                            for u in base_units
                        )
                        > 0
                    )
                for p, w in lay.windows:
                    if keep.keep_window_at_fill(i, w, prompt):
                        if held(p, row):  # (a position the engine holds no block at has nothing to store)
                            for u in lay.part_units(p):
                                add(lay.unit_key(key, u), u, row, None, i)
                    elif new:
                        c.retention_units_skipped += parts[p].units
                for p in lay.state_parts:
                    if keep.keep_state_at_fill(i + 1, prompt):
                        if held(p, row):
                            for u in lay.part_units(p):
                                add(lay.unit_key(key, u), u, row, None, i)
                    elif new:
                        c.retention_units_skipped += parts[p].units
        if not keys:
            return None
        return self._submit_store(keys, slots, refs, mark)

    async def _grouped_lookup(
        self, keys: list[bytes], source: Request | None = None
    ) -> tuple[int, list[bytes], list[int], list[tuple[int, int]]]:
        """A grouped layout's lookup: the longest ``N`` whose base units ``[0, N)``, window units before ``N``
        and state units at ``N`` are all pinned (staged from the lower tiers as needed). Returns ``N``, the
        pinned keys and their slots, and per pinned key its ``(block, unit)``."""
        lay = self._grouped
        assert lay is not None
        store = self._store
        n = len(keys)
        pinned: list[bytes] = []
        slots: list[int] = []
        plan: list[tuple[int, int]] = []
        try:
            top = n
            bases = lay.base_parts
            if bases:
                first = lay.part_units(bases[0])
                # The first base part is one unit: one probe per block, whatever the number of groups.
                k0 = keys if lay._identity_first else [lay.unit_key(k, first.start) for k in keys]
                got, got_slots = await self._staging.pin_run(k0, source)
                top = len(got)
                pinned += got
                slots += got_slots
                plan += [(i, first.start) for i in range(top)]
                for p in bases[1:]:
                    for u in lay.part_units(p):
                        gk, gs = await self._staging.pin_run([lay.unit_key(k, u) for k in keys[:top]], source)
                        if len(gk) < top:  # the blocks from there on miss this base unit: give them up
                            drop = [i for i, (b, _u) in enumerate(plan) if b >= len(gk)]
                            store.complete_load([pinned[i] for i in drop])
                            keep_i = [i for i in range(len(plan)) if plan[i][0] < len(gk)]
                            pinned = [pinned[i] for i in keep_i]
                            slots = [slots[i] for i in keep_i]
                            plan = [plan[i] for i in keep_i]
                            top = len(gk)
                            gk, gs = gk[:top], gs[:top]
                        pinned += gk
                        slots += gs
                        plan += [(i, u) for i in range(len(gk))]
            boundary = top
            if lay.windows or lay.state_parts:
                got, got_slots, boundary, need = await self._window_boundary(keys, top, source)
                pinned += got
                slots += got_slots
                plan += need
            if boundary < top:  # base units past the boundary found are not needed
                drop = [i for i, (b, u) in enumerate(plan) if b >= boundary]
                store.complete_load([pinned[i] for i in drop])
                keep_i = [i for i in range(len(plan)) if plan[i][0] < boundary]
                pinned = [pinned[i] for i in keep_i]
                slots = [slots[i] for i in keep_i]
                plan = [plan[i] for i in keep_i]
        except BaseException:
            store.complete_load(pinned)
            raise
        self._count_lookup(n, boundary, source)
        return boundary, pinned, slots, plan

    def _local_boundary(self, keys: list[bytes], top: int, memo: dict[tuple[int, int], bytes]) -> int:
        """The hit rule over what the CPU tier holds READY (dictionary probes, no I/O): the largest boundary
        ``<= top`` whose window units before it and state units at it are all there. Each (block, unit) is
        probed at most once: a window unit missing at block ``j`` rules out every boundary in ``(j, j + w]``,
        a state unit missing at ``N`` only ``N``."""
        lay = self._grouped
        assert lay is not None
        store = self._store
        key_of = lay.unit_key
        seen: dict[tuple[int, int], bool] = {}

        def present(j: int, u: int) -> bool:
            got = seen.get((j, u))
            if got is None:
                key = memo[(j, u)] = key_of(keys[j], u)
                got = seen[(j, u)] = key in store
            return got

        states = [u for p in lay.state_parts for u in lay.part_units(p)]
        windows = [(w, list(lay.part_units(p))) for p, w in lay.windows]
        n = top
        while n > 0:
            if not all(present(n - 1, u) for u in states):
                n -= 1
                continue
            bad = -1
            for w, units in windows:
                for j in range(n - 1, max(0, n - w) - 1, -1):
                    if not all(present(j, u) for u in units):
                        bad = max(bad, j)
                        break
            if bad < 0:
                return n
            n = bad
        return 0

    async def _window_boundary(
        self, keys: list[bytes], top: int, source: Request | None
    ) -> tuple[list[bytes], list[int], int, list[tuple[int, int]]]:
        """Pin the window and state units of the best boundary ``<= top``: the CPU tier's best (found without
        I/O), unless a boundary above it can be completed from the lower tiers. Those are tried at ``top``
        first (a conversation's next turn resumes where the last one ended), then at the checkpoints below,
        ``_GROUPED_LOOKUP_TRIES`` round trips at most. Returns the pins, the boundary and per pin its
        ``(block, unit)``."""
        lay = self._grouped
        assert lay is not None
        store = self._store
        every = lay.retention.checkpoint
        memo: dict[tuple[int, int], bytes] = {}  # unit keys computed so far, by (block, unit)

        def unit_keys(need: list[tuple[int, int]]) -> list[bytes]:
            out = []
            for j, u in need:
                key = memo.get((j, u))
                if key is None:
                    key = memo[(j, u)] = lay.unit_key(keys[j], u)
                out.append(key)
            return out

        for _attempt in range(2):
            local = self._local_boundary(keys, top, memo)
            cand = top
            tries = 0
            while cand > local and self.lower and tries < _GROUPED_LOOKUP_TRIES:
                need = lay.needed_units(cand)
                nk = unit_keys(need)
                gk, gs = await self._staging.pin_run(nk, source, planned=False)
                if len(gk) == len(nk):
                    return gk, gs, cand, need
                store.complete_load(gk)
                j, u = need[len(gk)]
                nxt = lay.back_off(cand, j, u)
                cand = nxt if nxt <= local else max(local, nxt // every * every)
                tries += 1
            if local == 0:
                return [], [], 0, []
            need = lay.needed_units(local)
            nk = unit_keys(need)
            got = store.prepare_load(nk)
            if len(got) == len(nk):
                return nk, got, local, need
            store.complete_load(nk[: len(got)])  # evicted while the lower tiers were asked: look again, once
        return [], [], 0, []

    def _submit_store(self, keys: list[bytes], slots: list[int], ids: list[int], mark: Any) -> TransferFuture:
        # Stores accepted in the same loop tick (from any request) join one TransferFuture: one completion and
        # one index update per tick instead of one per stored block. Each request still tracks that future.
        join = self._tick_store
        try:
            tf = self.executor._submit("store", ids, slots, mark, join=join)
        except BaseException:
            # Nothing was queued: the reservations must not stay pending (a later store of the same blocks
            # would be taken for a duplicate and never happen).
            self._store.complete_store(keys, success=False)
            self._local_only.difference_update(keys)
            raise
        if tf is join:
            tf.context.extend(keys)
        else:
            tf.context = keys
            tf.add_done_callback(self._store_done_cb)
            self._tick_store = tf
        return tf

    def _store_not_submitted(self, request_id: str, exc: BaseException) -> None:
        """A request's store could not be submitted (its reservations are already released)."""
        self._counters.store_errors += 1
        self._log_copy.event("store for request %r could not be submitted, dropped: %r", request_id, exc)
        self.loop.call_exception_handler(
            {"message": f"aiokv: store for request {request_id!r} failed", "exception": exc}
        )

    def _store_done(self, tf: TransferFuture) -> None:
        keys: list[bytes] = tf.context
        c = self._counters
        if tf.exception() is None:
            self._store.complete_store(keys)
            c.blocks_stored += len(keys)
            c.bytes_stored += len(keys) * self.layout.slot_bytes
            local = self._local_only
            if local:  # replicated units another rank writes through: this rank keeps them in its CPU tier
                wt = [k for k in keys if k not in local]
                local.difference_update(keys)
            else:
                wt = keys
            for w in self._writers:
                w.offer(wt)
        else:
            self._store.complete_store(keys, success=False)
            self._local_only.difference_update(keys)
            c.store_errors += len(keys)
            self._log_copy.event("store of %d blocks failed, dropped: %s", len(keys), tf.exception())

    def _load_blocks(
        self,
        keys: list[bytes],
        slots: list[int],
        block_ids: list[int],
        mark: Any = None,
        layerwise: bool = False,
    ) -> TransferFuture | LayeredTransfer:
        if layerwise:
            tf: TransferFuture | LayeredTransfer = self.executor._submit_layers(block_ids, slots, mark)
        else:
            tf = self.executor._submit("load", block_ids, slots, mark)
        tf.context = (keys, self._cost_clock())
        tf.add_done_callback(self._load_done_cb)
        return tf

    def _load_done(self, tf: TransferFuture | LayeredTransfer) -> None:
        keys: list[bytes]
        keys, submitted = tf.context
        self._store.complete_load(keys)
        c = self._counters
        if tf.exception() is None:
            c.blocks_loaded += len(keys)
            c.bytes_loaded += len(keys) * self.layout.slot_bytes
            if self._device is None:
                # The copy's cost as a request waits for it. Not on a device: a load there also waits for the
                # compute stream's point (the forward in flight), which is not the copy's cost.
                self._planner.record_transfer(
                    "cpu", len(keys) * self.layout.slot_bytes, self._cost_clock() - submitted
                )
        else:
            c.load_errors += len(keys)
            self._log_copy.event(
                "load of %d blocks failed, restored nothing (a miss): %s", len(keys), tf.exception()
            )

    def _load_not_submitted(self, request_id: str, num_blocks: int, exc: BaseException) -> None:
        self._counters.load_errors += num_blocks
        self._log_copy.event(
            "load of %d blocks for request %r could not be submitted, restored nothing (a miss): %r",
            num_blocks,
            request_id,
            exc,
        )

    def _load_poisoned(self, request_id: str, num_computed_tokens: int) -> None:
        _log.warning(
            "request %r: a load failed after the engine computed over it (%d tokens); nothing the request "
            "computes is stored until it is preempted",
            request_id,
            num_computed_tokens,
        )

    def _pin_ready(self, keys: Sequence[bytes]) -> list[int]:
        """Pin the leading READY ``keys`` of the CPU tier; their slots."""
        return self._store.prepare_load(keys)

    async def _lookup_and_pin(
        self, keys: list[bytes], source: Request | None = None
    ) -> tuple[list[bytes], list[int]]:
        """:meth:`_pin_run`, counted as one lookup of ``keys`` (one-group layouts)."""
        n_keys = len(keys)
        pinned, slots = await self._staging.pin_run(keys, source)
        self._count_lookup(n_keys, len(pinned), source)
        return pinned, slots

    def _count_lookup(self, n_keys: int, hit: int, source: Request | None) -> None:
        c = self._counters
        c.lookups += 1
        c.hits += hit
        c.misses += n_keys - hit
        c.hit_tokens += hit * self.block_size
        if _log.isEnabledFor(logging.DEBUG):
            _log.debug(
                "lookup%s: %d of %d blocks cached",
                "" if source is None else f" of request {source.request_id!r}",
                hit,
                n_keys,
            )

    def _promote(self, tier: int, keys: list[bytes]) -> None:
        """Blocks found in lower tier ``tier`` are also written to the faster lower tiers (e.g. a Redis hit
        lands on the local disk too), through the same bounded write-through."""
        if self._state is OffloaderState.RUNNING:
            for w in self._writers[:tier]:
                w.offer(keys)

    # ------------------------------------------------------------ load planner
    def record_prefill(self, tokens: int, seconds: float) -> None:
        """Report that the engine computed ``tokens`` prefill tokens in ``seconds`` (one forward, or one
        request's prefill). ``load_policy="decide"`` compares restoring a prefix with recomputing it at the
        rate these reports measure (an exponentially weighted mean), unless ``prefill_tokens_per_s`` was
        given. Reports of 0 tokens or 0 seconds are ignored. Cheap: call it after every prefill forward."""
        self._check_thread("record_prefill")
        if isinstance(tokens, bool) or not isinstance(tokens, int):
            raise InvalidTypeError(f"tokens must be an int, got {type(tokens).__name__}")
        if tokens < 0:
            raise InvalidArgumentError(f"tokens must be >= 0, got {tokens}")
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)):
            raise InvalidTypeError(f"seconds must be a number, got {type(seconds).__name__}")
        if not (seconds >= 0 and math.isfinite(seconds)):
            raise InvalidArgumentError(f"seconds must be a finite number >= 0, got {seconds!r}")
        self._planner.record_prefill(tokens, seconds)

    @property
    def load_policy(self) -> str:
        """``"decide"`` or ``"always"`` (see the constructor)."""
        return self._planner.mode

    # ------------------------------------------------------------------ stats
    def stats(self) -> OffloaderStats:
        c = self._counters
        ex = self._executor.stats() if self._executor is not None else None
        tiers: list[Any] = [self.cpu.stats()]
        for t in self.lower:
            try:
                tiers.append(t.stats())
            except Exception as exc:  # a tier's stats must never break the caller's metrics loop
                tiers.append(repr(exc))
        cpu = tiers[0]
        store = self._store.stats()
        wt_errors = sum(w.errors for w in self._writers)
        planner = self._planner.stats()
        return OffloaderStats(
            hits=c.hits,
            misses=c.misses,
            hit_tokens=c.hit_tokens,
            lookups=c.lookups,
            blocks_stored=c.blocks_stored,
            bytes_stored=c.bytes_stored,
            blocks_loaded=c.blocks_loaded,
            bytes_loaded=c.bytes_loaded,
            stores_deduplicated=store.deduplicated,
            stores_dropped=store.dropped,
            in_flight=ex.in_flight if ex else 0,
            in_flight_bytes=ex.in_flight_bytes if ex else 0,
            evictions=cpu.evictions,
            errors=c.store_errors + c.load_errors + c.staging_misses + wt_errors,
            store_errors=c.store_errors,
            load_errors=c.load_errors,
            staged_blocks=c.staged_blocks,
            write_through_blocks=sum(w.written for w in self._writers),
            write_through_dropped=sum(w.dropped for w in self._writers),
            write_through_in_flight_bytes=sum(w.in_flight_bytes for w in self._writers),
            requests_open=len(self._requests),
            requests_opened=c.requests_opened,
            requests_finished=c.requests_finished,
            backend=ex.backend if ex else ("cuda" if self.layout.is_cuda else "cpu"),
            tiers=tuple(tiers),
            eviction=cpu.eviction,
            stores_invalidated=c.stores_invalidated,
            write_through_dropped_slow=sum(w.dropped_slow for w in self._writers),
            lower_tier_deadline_misses=c.lower_tier_deadline_misses,
            write_through=tuple(w.stats() for w in self._writers),
            load_policy=planner.mode,
            prefill_tokens_per_s=planner.prefill_tokens_per_s,
            planner_skipped_blocks=planner.skipped_blocks,
            planner_skipped_lookups=planner.skipped_lookups,
            retention_bytes_saved=max(0, c.retention_units_skipped - c.retention_units_late)
            * self.layout.slot_bytes,
            planner=planner,
        )

    def __repr__(self) -> str:
        return f"<Offloader {self._state.name} {self.layout.describe()} requests={len(self._requests)}>"


_WriteThrough = WriteThrough  # the name tests knew (tests/core/test_backpressure.py)


def _check_token_cap(value: object, name: str) -> None:
    """A per-request token cap: ``None`` or an int >= 0."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidTypeError(f"{name} must be an int or None, got {type(value).__name__}")
    if value < 0:
        raise InvalidArgumentError(f"{name} must be >= 0, got {value}")


def _planner_names(lower: Sequence[BackingTier]) -> tuple[str, ...]:
    """The lower tiers' names in the load planner: their own, numbered where two share one; "cpu" is the
    CPU tier's (the copy into the engine)."""
    names = [t.name for t in lower]
    return tuple(
        f"{name}#{i + 1}" if names.count(name) > 1 or name == "cpu" else name for i, name in enumerate(names)
    )
