"""The Offloader: owns the tiers, the transfer executor and the open requests.

Sync core, async shell: index changes (reserve, commit, pin, evict) are plain calls on
:class:`~aiokv.tiers._index.BlockIndex`, made on the loop thread and therefore atomic; the async parts only
execute copies (executor), lower-tier I/O (staging and write-through) and wait for them.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Sequence
from types import TracebackType
from typing import Any

from ._errors import ClosedError, DuplicateRequestError, InvalidArgumentError, InvalidTypeError
from ._hashing import _canon, check_token_ids
from ._layout import KVLayout
from ._request import Request
from ._stats import Counters, OffloaderStats
from .tiers._base import BackingTier, TierSpec
from .tiers._cpu import CPUTier
from .tiers._policies import EvictionPolicy
from .transfer._binding import DeviceBinding
from .transfer._executor import DEFAULT_STAGING_BYTES, TransferExecutor
from .transfer._future import TransferFuture

__all__ = ["Offloader"]


class Offloader:
    """Offloads full KV blocks of an engine's requests to tiers and loads cached prefixes back.

    Use as ``async with Offloader(layout, tiers=[CPUTier(capacity_bytes=...)]) as off:``. The first tier must
    be a :class:`~aiokv.CPUTier`; further tiers (disk, Redis) are written through from it and staged back
    into it on lookup.

    Parameters:
        layout: the engine's paged KV tensors.
        tiers: the tier hierarchy, fastest first.
        eviction: the CPU tier's eviction policy name (``"lru"``, ``"arc"``, ...) or an EvictionPolicy.
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
    """

    def __init__(
        self,
        layout: KVLayout,
        tiers: Sequence[CPUTier | BackingTier] | None = None,
        *,
        eviction: str | EvictionPolicy = "lru",
        write_through_max_bytes: int = 256 << 20,
        close_timeout: float = 30.0,
        store_partial_last_block: bool = False,
        compute_stream: Any = None,
        device: DeviceBinding | None = None,
        staging_bytes: int = DEFAULT_STAGING_BYTES,
        copy_threads: int | None = None,
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
        device = self._resolve_device(layout, device)
        self.layout = layout
        self.block_size = layout.block_size
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
        # Bound once: completion callbacks are per copy, and the control path avoids allocating per copy.
        self._store_done_cb = self._store_done
        self._load_done_cb = self._load_done

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

        Idempotent. Nothing aiokv started outlives it.
        """
        if self._state in ("closing", "closed"):
            return
        if self._state == "new":
            self._state = "closed"
            self.cpu.release()
            return
        self._state = "closing"
        try:
            pending = [req.abort() for req in list(self._requests.values())]
            for p in pending:
                with contextlib.suppress(Exception):
                    await p
            for w in self._writers:
                await w.aclose(self._close_timeout)
            if self._executor is not None:
                await self._executor.aclose()
            for tier in self.lower:
                with contextlib.suppress(Exception):
                    await tier.aclose()
        finally:
            self._state = "closed"
            self.cpu.release()

    async def flush(self) -> None:
        """Wait until every block committed so far has been written through to the lower tiers (or dropped)."""
        for w in self._writers:
            await w.wait_idle()

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
        tf = self.executor._submit("store", ids, slots, mark)
        tf.context = keys
        tf.add_done_callback(self._store_done_cb)
        return tf

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

    def _load_blocks(
        self, keys: list[bytes], slots: list[int], block_ids: list[int], mark: Any = None
    ) -> TransferFuture:
        tf = self.executor._submit("load", block_ids, slots, mark)
        tf.context = keys
        tf.add_done_callback(self._load_done_cb)
        return tf

    def _load_done(self, tf: TransferFuture) -> None:
        keys: list[bytes] = tf.context
        self._index.unpin(keys)
        c = self._counters
        if tf.exception() is None:
            c.blocks_loaded += len(keys)
            c.bytes_loaded += len(keys) * self.layout.slot_bytes
        else:
            c.load_errors += len(keys)

    async def _lookup_and_pin(self, keys: list[bytes]) -> tuple[list[bytes], list[int]]:
        """Pin the longest cached prefix of ``keys``, staging blocks from lower tiers into the CPU tier."""
        index = self._index
        slots = index.pin_prefix(keys)
        pinned = keys[: len(slots)]
        if len(pinned) < len(keys) and self.lower:
            for pos, tier in enumerate(self.lower):
                if len(pinned) == len(keys):
                    break
                got_keys, got_slots = await self._stage(tier, keys, len(pinned))
                pinned.extend(got_keys)
                slots.extend(got_slots)
                # Promote: blocks found in a slower tier are also written to the faster lower tiers (e.g. a
                # Redis hit lands on the local disk too), through the same bounded write-through.
                if got_keys and self._state == "running":
                    for w in self._writers[:pos]:
                        w.offer(got_keys)
        c = self._counters
        c.lookups += 1
        c.hits += len(pinned)
        c.misses += len(keys) - len(pinned)
        c.hit_tokens += len(pinned) * self.block_size
        return pinned, slots

    async def _stage(self, tier: BackingTier, keys: list[bytes], start: int) -> tuple[list[bytes], list[int]]:
        """Copy the run of ``keys[start:]`` held by ``tier`` into fresh CPU slots; pin and return them."""
        c = self._counters
        rest = keys[start:]
        try:
            n = await tier.lookup(rest)
        except Exception:
            c.staging_misses += 1
            return [], []
        if n <= 0:
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
        try:
            got = await tier.read_into(want, [self.cpu.slot_view(s) for s in slots])
        except Exception:
            got = 0
        got = max(0, min(got, len(want)))
        for key in want[got:]:
            index.discard(key)
        for key in want[:got]:
            index.commit(key)
            index.pin(key)
        c.staged_blocks += got
        c.staging_misses += len(want) - got
        return want[:got], slots[:got]

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
