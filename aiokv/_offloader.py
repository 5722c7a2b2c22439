"""The Offloader: owns the tiers, the transfer executor and the open requests.

Sync core, async shell: index changes (reserve, commit, pin, evict) are plain calls on
:class:`~aiokv.tiers._index.BlockIndex`, made on the loop thread and therefore atomic; the async parts only
execute copies (executor), lower-tier I/O (staging and write-through) and wait for them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterable, Sequence
from types import TracebackType
from typing import Any

from ._errors import (
    ClosedError,
    DuplicateRequestError,
    InvalidArgumentError,
    InvalidTypeError,
    WrongThreadError,
)
from ._hashing import _canon, check_token_ids
from ._layout import KVLayout
from ._log import Throttled, get_logger
from ._planner import LoadPlanner
from ._request import Request, StepUpdate, step_batch
from ._stats import Counters, OffloaderStats
from .tiers._base import BackingTier, TierSpec
from .tiers._cpu import CPUTier
from .tiers._policies import EvictionPolicy
from .transfer._binding import DeviceBinding
from .transfer._executor import DEFAULT_STAGING_BYTES, TransferExecutor
from .transfer._future import TransferFuture

__all__ = ["Offloader"]

_log = get_logger("offloader")


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
        load_policy: str = "decide",
        prefill_tokens_per_s: float | None = None,
    ) -> None:
        if not isinstance(layout, KVLayout):
            raise InvalidTypeError(f"layout must be an aiokv.KVLayout, got {type(layout).__name__}")
        if tiers is None or len(tiers) == 0:
            raise InvalidArgumentError(
                "tiers must contain at least one tier, e.g. [aiokv.CPUTier(capacity_bytes=8 << 30)]"
            )
        if not isinstance(tiers[0], CPUTier):
            raise InvalidArgumentError(f"tiers[0] must be a CPUTier, got {type(tiers[0]).__name__}")
        for i, t in enumerate(tiers[1:], start=1):
            if not isinstance(t, BackingTier):
                raise InvalidTypeError(
                    f"tiers[{i}] must be a BackingTier (e.g. DiskTier, RedisTier), got {type(t).__name__}"
                )
        if (
            isinstance(write_through_max_bytes, bool)
            or not isinstance(write_through_max_bytes, int)
            or write_through_max_bytes < 0
        ):
            raise InvalidArgumentError(
                f"write_through_max_bytes must be an int >= 0, got {write_through_max_bytes!r}"
            )
        if close_timeout < 0:
            raise InvalidArgumentError(f"close_timeout must be >= 0, got {close_timeout!r}")
        if prefill_tokens_per_s is not None and (
            isinstance(prefill_tokens_per_s, bool) or not isinstance(prefill_tokens_per_s, (int, float))
        ):
            raise InvalidTypeError(
                f"prefill_tokens_per_s must be a number or None, got {type(prefill_tokens_per_s).__name__}"
            )
        device = self._resolve_device(layout, device)
        self.layout = layout
        self.block_size = layout.block_size
        self._num_blocks = layout.num_blocks  # read on every step(): an attribute, not a property chain
        self.store_partial_last_block = bool(store_partial_last_block)
        self._compute_stream = compute_stream
        self._device = device
        self._staging_bytes = staging_bytes
        self._copy_threads = copy_threads
        self.cpu: CPUTier = tiers[0]
        # Allocates the host buffer (pinned for a device); raises CapacityError if too small.
        self.cpu.bind(layout, eviction, device)
        self.lower: tuple[BackingTier, ...] = tuple(tiers[1:])  # type: ignore[arg-type]
        self._index = self.cpu.index
        self._write_through_max_bytes = write_through_max_bytes
        self._close_timeout = close_timeout
        self._requests: dict[str, Request] = {}
        self._counters = Counters()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._executor: TransferExecutor | None = None
        self._writers: list[_WriteThrough] = []
        self._state = "new"  # new -> running -> closing -> closed
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
        self._planner = LoadPlanner(
            layout.slot_bytes,
            layout.block_size,
            mode=load_policy,
            prefill_tokens_per_s=prefill_tokens_per_s,
            load_tier="cpu",
        )
        self._tier_names = _planner_names(self.lower)
        # Transfer costs are timed with this clock (tests replace it with a fake one).
        self._clock: Callable[[], float] = time.perf_counter

    # ------------------------------------------------------------- lifecycle
    async def __aenter__(self) -> Offloader:
        await self.start()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    async def start(self) -> None:
        if self._state != "new":
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
        spec = TierSpec(
            payload_bytes=self.layout.slot_bytes,
            fingerprint=self.layout.fingerprint,
            block_size=self.layout.block_size,
            description=self.layout.describe(),
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
        self._writers = [_WriteThrough(self, t, self._write_through_max_bytes) for t in self.lower]
        self._state = "running"

    async def aclose(self) -> None:
        """Abort open requests, wait for their copies, flush write-through (bounded), close tiers.

        Idempotent and complete: the close runs in a task of its own, which a cancelled ``aclose()`` leaves
        running; calling ``aclose()`` again waits for it. If that task is cancelled itself (a loop shutting
        down), it finishes as a hard close: write-through still queued is dropped at once and requests' tasks
        are cancelled, but copies in flight are still waited for (they cannot be recalled) and every thread is
        stopped. Nothing aiokv started outlives it; the host buffer is released last.
        """
        if self._state == "closed":
            return
        if self._state == "new":
            self._state = "closed"
            self.cpu.release()
            return
        self._check_thread("aclose")
        self._state = "closing"
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
        ]
        cancelled = False
        for step in steps:
            while True:
                try:
                    await step(cancelled)
                    break
                except asyncio.CancelledError:
                    cancelled = True  # every step is idempotent: redo this one, hard
        self._state = "closed"
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

    async def flush(self) -> None:
        """Wait until every block committed so far has been written through to the lower tiers (or dropped)."""
        self._check_thread("flush")
        for w in self._writers:
            await w.wait_idle()

    @property
    def running(self) -> bool:
        """True between :meth:`start` and :meth:`aclose`: requests may be opened."""
        return self._state == "running"

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

    @staticmethod
    def _resolve_device(layout: KVLayout, device: DeviceBinding | None) -> DeviceBinding | None:
        if device is None:
            if layout.is_cuda:
                from ._cuda import CudaDevice

                return CudaDevice(layout.device)
            return None
        if not isinstance(device, DeviceBinding):
            raise InvalidTypeError(
                f"device must be an aiokv device binding (e.g. aiokv.transfer.SimulatedDevice), got {type(device).__name__}"
            )
        if device.kind == "sim" and layout.is_cuda:
            raise InvalidArgumentError(
                "device=SimulatedDevice needs a cpu layout (its memory is host memory)"
            )
        if device.kind == "cuda" and not layout.is_cuda:
            raise InvalidArgumentError("a cuda device needs a cuda layout")
        return device

    @property
    def device(self) -> DeviceBinding | None:
        """The device binding of the data path (CUDA or simulated), ``None`` on the CPU backend."""
        return self._device

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
    ) -> Request:
        """Open a request and start its state-machine task. ``salt`` (e.g. a tenant id) makes its block
        hashes disjoint from other salts'; ``extra_keys`` (LoRA id, multimodal hashes, ...) likewise."""
        self._check_thread("open")
        if self._state != "running":
            raise ClosedError(
                "offloader is not started; use 'async with Offloader(...)'"
                if self._state == "new"
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
        req = Request(self, key, tokens, salt, extra)
        self._requests[key] = req
        self._counters.requests_opened += 1
        req._start()
        return req

    def step_batch(self, updates: Iterable[StepUpdate]) -> None:
        """Report one engine step for many requests: each update is a
        ``(request, num_computed_tokens, new_token_ids, new_block_ids)`` tuple, applied exactly as
        ``request.step(num_computed_tokens, new_token_ids, new_block_ids)`` would be, in order.

        The per-engine-step form of :meth:`Request.step` (as vLLM's connector gets one scheduler output per
        step): one call per engine iteration, and through :meth:`aiokv.ThreadBridge.step_batch` one hand-over
        to the loop per iteration for an engine running in another thread. An invalid update raises the error
        ``step()`` raises for it; the updates before it were applied, it and those after it were not.
        Synchronous, like ``step()``."""
        step_batch(self, updates)

    def get(self, request_id: str) -> Request | None:
        return self._requests.get(str(request_id))

    def _request_ended(self, req: Request) -> None:
        if self._requests.get(req.request_id) is req:
            del self._requests[req.request_id]
        self._counters.requests_finished += 1

    # ------------------------------------------------------------ data path
    def _unpin(self, keys: Sequence[bytes]) -> None:
        self._index.unpin(keys)

    def _store_blocks(
        self, chain: list[bytes], start: int, end: int, blocks: list[int], mark: Any = None
    ) -> TransferFuture | None:
        """Reserve CPU slots for blocks ``start..end-1`` (engine blocks ``blocks[i]``, hashes ``chain[i]``) and
        submit one store copy for them."""
        index = self._index
        c = self._counters
        keys: list[bytes] = []
        slots: list[int] = []
        ids: list[int] = []
        for i in range(start, end):
            key = chain[i]
            slot = index.reserve(key, chain[i - 1] if i else None, i)
            if slot is None:
                if index.state(key) is not None:
                    c.stores_deduplicated += 1
                else:
                    c.stores_dropped += 1
                continue
            keys.append(key)
            slots.append(slot)
            ids.append(blocks[i])
        if not keys:
            return None
        return self._submit_store(keys, slots, ids, mark)

    def _store_one(
        self, key: bytes, parent: bytes | None, depth: int, block_id: int, mark: Any = None
    ) -> TransferFuture | None:
        slot = self._index.reserve(key, parent, depth)
        if slot is None:
            if self._index.state(key) is not None:
                self._counters.stores_deduplicated += 1
            else:
                self._counters.stores_dropped += 1
            return None
        return self._submit_store([key], [slot], [block_id], mark)

    def _submit_store(self, keys: list[bytes], slots: list[int], ids: list[int], mark: Any) -> TransferFuture:
        # Stores accepted in the same loop tick (from any request) join one TransferFuture: one completion and
        # one index update per tick instead of one per stored block. Each request still tracks that future.
        join = self._tick_store
        try:
            tf = self.executor._submit("store", ids, slots, mark, join=join)
        except BaseException:
            # Nothing was queued: the reservations must not stay pending (a later store of the same blocks
            # would be taken for a duplicate and never happen).
            for key in keys:
                self._index.discard(key)
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
        index = self._index
        c = self._counters
        if tf.exception() is None:
            for key in keys:
                index.commit(key)
            c.blocks_stored += len(keys)
            c.bytes_stored += len(keys) * self.layout.slot_bytes
            for w in self._writers:
                w.offer(keys)
        else:
            for key in keys:
                index.discard(key)
            c.store_errors += len(keys)
            self._log_copy.event("store of %d blocks failed, dropped: %s", len(keys), tf.exception())

    def _load_blocks(
        self, keys: list[bytes], slots: list[int], block_ids: list[int], mark: Any = None
    ) -> TransferFuture:
        tf = self.executor._submit("load", block_ids, slots, mark)
        tf.context = (keys, self._clock())
        tf.add_done_callback(self._load_done_cb)
        return tf

    def _load_done(self, tf: TransferFuture) -> None:
        keys: list[bytes]
        keys, submitted = tf.context
        self._index.unpin(keys)
        c = self._counters
        if tf.exception() is None:
            c.blocks_loaded += len(keys)
            c.bytes_loaded += len(keys) * self.layout.slot_bytes
            if self._device is None:
                # The copy's cost as a request waits for it. Not on a device: a load there also waits for the
                # compute stream's point (the forward in flight), which is not the copy's cost.
                self._planner.record_transfer(
                    "cpu", len(keys) * self.layout.slot_bytes, self._clock() - submitted
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
        return self._index.pin_prefix(keys)

    async def _lookup_and_pin(self, keys: list[bytes]) -> tuple[list[bytes], list[int]]:
        """Pin the longest prefix of ``keys`` available across all tiers; return its keys and CPU slots.

        The load planner (``load_policy``) decides run by run: the CPU tier's leading run, then each lower
        tier's run, each restored only when that is expected to be faster than recomputing its tokens; a tier
        that loses is not used (its blocks are misses, counted in ``planner_skipped_blocks``) and one that
        cannot win is not even asked (``planner_skipped_lookups``). Blocks in the CPU tier are pinned where they are. Each run of blocks missing from it is staged from the
        lower tiers (fastest first) into fresh CPU slots, and the walk continues through the CPU blocks after
        the run (pinned before staging, so eviction cannot take them meanwhile). The prefix ends at a block no
        tier holds, one a tier fails to read or finds corrupt, or one still pending in the CPU tier. Cancelled,
        it releases every pin it took.
        """
        index = self._index
        n_keys = len(keys)
        slots = index.pin_prefix(keys)
        pinned = keys[: len(slots)]
        ahead: list[bytes] = []
        if pinned and not self._planner.worth("cpu", len(pinned)):
            # Even the CPU tier's blocks restore slower than they recompute: so would every block after them.
            index.unpin(pinned)
            pinned, slots = [], []
            keys = []
        try:
            pos = len(pinned)
            while pos < len(keys) and self.lower:
                end = pos
                while end < len(keys) and index.state(keys[end]) is None:
                    end += 1
                if end == pos:
                    break  # keys[pos] is pending in the CPU tier (being stored or staged)
                ahead_slots = index.pin_prefix(keys[end:])
                ahead = keys[end : end + len(ahead_slots)]
                got_keys, got_slots = await self._stage_run(keys, pos, end)
                pinned.extend(got_keys)
                slots.extend(got_slots)
                if len(got_keys) < end - pos:
                    break
                pinned.extend(ahead)
                slots.extend(ahead_slots)
                ahead = []
                pos = end + len(ahead_slots)
        except BaseException:
            index.unpin(pinned)
            raise
        finally:
            index.unpin(ahead)
        c = self._counters
        c.lookups += 1
        c.hits += len(pinned)
        c.misses += n_keys - len(pinned)
        c.hit_tokens += len(pinned) * self.block_size
        return pinned, slots

    async def _stage_run(self, keys: list[bytes], start: int, end: int) -> tuple[list[bytes], list[int]]:
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
                if not planner.worth_asking(name, end - pos):
                    continue  # no run this tier could hold would restore faster than it recomputes
                k, s = await self._stage(tier, name, keys, pos, end)
                if not k:
                    continue
                got_keys.extend(k)
                got_slots.extend(s)
                pos += len(k)
                # Promote: blocks found in a slower tier are also written to the faster lower tiers (e.g. a
                # Redis hit lands on the local disk too), through the same bounded write-through.
                if self._state == "running":
                    for w in self._writers[:ti]:
                        w.offer(k)
        except BaseException:
            self._index.unpin(got_keys)
            raise
        return got_keys, got_slots

    async def _stage(
        self, tier: BackingTier, name: str, keys: list[bytes], start: int, end: int
    ) -> tuple[list[bytes], list[int]]:
        """Copy the run of ``keys[start:end]`` held by ``tier`` into fresh CPU slots; pin and return the
        verified prefix. A tier that fails (or raises) yields a miss from the failing block on; a run the
        planner finds slower to restore than to recompute is left alone (nothing staged). The time from the
        lookup to the end of the read is the tier's measured cost for the blocks that arrived."""
        c = self._counters
        rest = keys[start:end]
        started = self._clock()
        try:
            n = await tier.lookup(rest)
        except Exception as exc:
            c.staging_misses += 1
            self._log_tier.event("lookup in tier %r failed, a miss: %r", tier.name, exc)
            return [], []
        n = min(n, len(rest))
        if n <= 0 or not self._planner.worth(name, n):
            return [], []
        index = self._index
        want: list[bytes] = []
        slots: list[int] = []
        for j, key in enumerate(rest[:n]):
            i = start + j
            slot = index.reserve(key, keys[i - 1] if i else None, i)
            if slot is None:  # raced with another stager / store, or no room: stop the run here
                break
            want.append(key)
            slots.append(slot)
        if not want:
            return [], []
        got = await self._read_into(tier, want, slots)
        got = max(0, min(got, len(want)))
        if got:
            self._planner.record_transfer(name, got * self.layout.slot_bytes, self._clock() - started)
        for key in want[got:]:
            index.discard(key)
        for key in want[:got]:
            index.commit(key)
            index.pin(key)
        c.staged_blocks += got
        c.staging_misses += len(want) - got
        return want[:got], slots[:got]

    async def _read_into(self, tier: BackingTier, keys: list[bytes], slots: list[int]) -> int:
        """``tier.read_into`` the reserved (pending) ``slots``. If the caller is cancelled, the read is
        cancelled too, and the slots are released only once the read has really ended (a tier's I/O thread
        may still be writing them)."""
        views = [self.cpu.slot_view(s) for s in slots]
        task = self.loop.create_task(tier.read_into(keys, views), name=f"aiokv-stage-{tier.name}")
        self._io.add(task)
        task.add_done_callback(self._io.discard)
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            if not task.done():  # the caller was cancelled: abandon the read, keep its slots until it ends
                task.cancel()
                task.add_done_callback(lambda t: self._abandon_read(t, keys))
                raise
            exc: BaseException = asyncio.CancelledError()
        except Exception as err:
            exc = err
        self._log_tier.event("reading %d blocks from tier %r failed, a miss: %r", len(keys), tier.name, exc)
        return 0

    def _abandon_read(self, task: asyncio.Task[Any], keys: list[bytes]) -> None:
        if not task.cancelled():
            task.exception()  # retrieved: an abandoned read's failure is not news
        for key in keys:
            self._index.discard(key)

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
            stores_deduplicated=c.stores_deduplicated,
            stores_dropped=c.stores_dropped,
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
            load_policy=planner.mode,
            prefill_tokens_per_s=planner.prefill_tokens_per_s,
            planner_skipped_blocks=planner.skipped_blocks,
            planner_skipped_lookups=planner.skipped_lookups,
            planner=planner,
        )

    def __repr__(self) -> str:
        return f"<Offloader {self._state} {self.layout.describe()} requests={len(self._requests)}>"


class _WriteThrough:
    """Propagates committed CPU blocks to one lower tier, in the background, within a byte budget."""

    BATCH = 32

    def __init__(self, off: Offloader, tier: BackingTier, max_bytes: int) -> None:
        self._off = off
        self._tier = tier
        self._max_bytes = max_bytes
        self._slot_bytes = off.layout.slot_bytes
        self._queue: deque[bytes] = deque()
        self._wake: asyncio.Event = asyncio.Event()
        self._idle: asyncio.Event = asyncio.Event()
        self._idle.set()
        self._closing = False
        self.in_flight_bytes = 0
        self.written = 0
        self.dropped = 0
        self.errors = 0
        self._task = off.loop.create_task(self._run(), name=f"aiokv-write-through-{tier.name}")

    def offer(self, keys: Sequence[bytes]) -> None:
        """Queue ``keys`` (READY in the CPU tier) for writing; over budget they are dropped and counted."""
        if self._closing:
            self.dropped += len(keys)
            return
        index = self._off._index
        for key in keys:
            if self.in_flight_bytes + self._slot_bytes > self._max_bytes:
                self.dropped += 1
                continue
            index.pin(key)  # the slot must not be evicted or reused while the tier reads it
            self._queue.append(key)
            self.in_flight_bytes += self._slot_bytes
        if self._queue:
            self._idle.clear()
        self._wake.set()

    async def _run(self) -> None:
        index = self._off._index
        cpu = self._off.cpu
        queue = self._queue
        while True:
            if not queue:
                self._idle.set()
                if self._closing:
                    return
                self._wake.clear()
                await self._wake.wait()
                continue
            batch = [queue.popleft() for _ in range(min(self.BATCH, len(queue)))]
            try:
                views = [cpu.slot_view(index.slot(k)) for k in batch]
                n = await self._tier.write(batch, views)
            except asyncio.CancelledError:
                index.unpin(batch)
                self.in_flight_bytes -= len(batch) * self._slot_bytes
                self.dropped += len(batch)
                raise
            except Exception:
                n = 0
                self.errors += 1
            index.unpin(batch)
            self.in_flight_bytes -= len(batch) * self._slot_bytes
            self.written += max(0, n)
            self.dropped += len(batch) - max(0, n)

    async def wait_idle(self) -> None:
        if not self._task.done():
            await self._idle.wait()

    async def aclose(self, timeout: float) -> None:
        self._closing = True
        self._wake.set()
        try:
            await asyncio.wait_for(asyncio.shield(self._task), timeout)
        except (asyncio.TimeoutError, Exception):
            self._task.cancel()
            with contextlib.suppress(BaseException):
                await self._task
        # Whatever was never attempted is released and counted.
        if self._queue:
            self._off._index.unpin(list(self._queue))
            self.in_flight_bytes -= len(self._queue) * self._slot_bytes
            self.dropped += len(self._queue)
            self._queue.clear()
        self._idle.set()


def _planner_names(lower: Sequence[BackingTier]) -> tuple[str, ...]:
    """The lower tiers' names in the load planner: their own, numbered where two share one; "cpu" is the
    CPU tier's (the copy into the engine)."""
    names = [t.name for t in lower]
    return tuple(
        f"{name}#{i + 1}" if names.count(name) > 1 or name == "cpu" else name for i, name in enumerate(names)
    )
