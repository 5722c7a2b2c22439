"""The disk tier itself: :class:`DiskTier` (its options, open and close, lookups, verified reads, stores
through this process's :class:`~aiokv.tiers.BlockIndex` or the shared catalog, tenant quotas) and its stats
record :class:`DiskTierStats`, with the failure paths: the health breaker (degraded by failed I/O, down when
the directory cannot be set up, the set-up retried after a backoff) and their logs. Disk I/O runs on the
tier's :class:`~aiokv.tiers._lanes.LanePool`, never on the event loop; see :mod:`aiokv.tiers.disk` for the
layout and the consistency rules.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from ..._errors import CapacityError, ClosedError, InvalidArgumentError, InvalidTypeError
from ..._log import Throttled, Transitions, get_logger
from .._base import BackingTier, TierSpec, check_buffers
from .._base import wait_thread as _wait_thread
from .._catalog import CatalogStats, Reservation, SharedCatalog
from .._codec import Codec, DecodeError, EncodeError, check_encoding, make_codec
from .._format import Damage, TierHealth, Verdict, check_damage, fold_damage
from .._health import Breaker
from .._index import BlockIndex
from .._lanes import LanePool
from .._policies import EvictionPolicy, make_policy
from .._quota import TenantQuotas
from ._files import META_NAME, _Files, _is_space_error, _write_meta
from ._geometry import _Geometry
from ._setup import _open_directory, _Opened, _restore

__all__ = ["DiskTier", "DiskTierStats"]

# A stored batch is spread over the I/O threads only in parts of at least this much (smaller ones are written
# by one thread in file order); reads always use one thread per call, see read_into.
_SPLIT_BYTES = 16 << 20
# A tier that could not set up its directory retries on a store after this long, doubling up to the maximum.
_REOPEN_BACKOFF_S = 1.0
_REOPEN_BACKOFF_MAX_S = 60.0
# Shared directories: how long a store waits for the catalog lock (held for microseconds by each change) before
# it is dropped, and how long a commit waits for it.
_RESERVE_LOCK_S = 1.0
_COMMIT_LOCK_S = 10.0

T = TypeVar("T")
_log = get_logger("tiers.disk")


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


@dataclass(frozen=True, slots=True)
class DiskTierStats:
    health: TierHealth
    path: str
    capacity_bytes: int
    entry_bytes: int  # bytes one entry occupies on disk (header + payload + padding)
    num_slots: int
    entries: int  # visible entries
    pending: int  # entries being written
    pinned: int  # entries being read
    evictions: int
    lookups: int
    lookup_hits: int  # blocks reported present by lookup()
    reads: int  # read_into() calls
    read_blocks: int  # blocks read and verified
    read_bytes: int
    read_misses: int  # read_into() calls that returned fewer blocks than asked
    corrupt: int  # entries that failed verification on read (dropped)
    read_errors: int  # reads that failed with an OSError (entry dropped)
    writes: int  # write() calls
    stored_blocks: int  # blocks written
    stored_bytes: int  # payload bytes written
    skipped_existing: int  # blocks not written because the tier already held (or was writing) them
    dropped_no_room: int  # every slot was pending or pinned
    dropped_io_error: int  # write failed (ENOSPC, EIO, EFBIG, ...)
    dropped_down: int  # the tier was down: its directory could not be set up (no space), see DiskTier.open
    recovered: int  # entries found valid when the directory was opened
    recovery_dropped: int  # entries dropped when the directory was opened (torn, foreign, bad header)
    raced: int  # shared: reads of an entry another process was replacing (a miss; nothing dropped)
    dropped_busy: int  # shared: blocks not stored because the catalog lock was not free in time
    reset: bool  # the directory held another layout and was started fresh
    preallocated: bool  # segment files were fully allocated on open (else sparse: writes may hit ENOSPC)
    shared: bool  # several processes may use the directory at once (entries, pending, evictions: theirs too)
    reclaimed: int  # shared: slots taken over from writers that died mid-store (by every process)
    last_error: str | None
    reads_ahead_of_writes: int = 0  # read jobs an I/O thread took while write jobs were waiting (read lane)
    dropped_quota: int = (
        0  # blocks not stored: their tenant was at its quota with no entry of its own to evict
    )
    encoding: str = (
        "raw"  # how blocks are stored (DiskTier(encoding=...)); read/stored bytes are encoded bytes
    )
    dropped_unencodable: int = 0  # blocks not stored: a value was not finite (lossy encodings only)


@dataclass(slots=True)
class _StorePlan:
    """The slots one store will write: ``slots[j]`` for the key at ``indices[j]`` of the batch."""

    skipped: int = 0  # keys already held (or being written)
    indices: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    reservations: list[Reservation] = field(default_factory=list)  # shared directories


class DiskTier(BackingTier):
    """Persistent tier of fixed-size entries in preallocated segment files under ``path``.

    ``capacity_bytes`` bounds the segment files' total size (entries are ``entry_bytes`` each, see
    :attr:`DiskTierStats.entry_bytes`); when full, the ``eviction`` policy picks the victim. ``segment_bytes``
    is the size of one segment file, ``io_threads`` the number of I/O threads. ``preallocate`` allocates the
    segment files on open (``posix_fallocate``; falls back to sparse files when the filesystem refuses), so
    that stores cannot hit ENOSPC later. ``fsync=True`` makes every stored entry durable before it becomes
    visible (slower).

    ``tenant_quota_bytes`` (a mapping of salt to bytes, or a callable ``salt -> bytes or None`` asked once per
    tenant at its first ``open``; ``None`` for no limit), like :class:`~aiokv.CPUTier`'s: the entries
    written for a tenant (a request's salt, handed over by the offloader's write-through) hold at most that
    many bytes of segment files (``entry_bytes`` each); a write for a tenant at its quota evicts that
    tenant's own first entry in the policy's order, never another tenant's, and with none evictable the
    block is dropped (``dropped_quota``). The tenant is not stored on disk: entries recovered at ``open``
    count for nobody, so a quota bounds what a tenant writes after the tier is opened. Not with
    ``shared=True``.

    ``shared=False`` (the default): one process (one ``DiskTier``) owns the directory. ``shared=True``: any
    number of processes on this machine open it at once with ``shared=True`` and the same layout and
    ``capacity_bytes``; an entry stored by one is found by all, and eviction (least recently used within a
    block's set of slots; ``eviction`` must be ``"lru"``) and capacity hold across them. The directory must be
    on a local filesystem (the processes share a memory-mapped catalog); across machines, use a RedisTier.
    """

    name = "disk"
    medium = "DISK"

    def __init__(
        self,
        path: str | os.PathLike[str],
        capacity_bytes: int,
        *,
        eviction: str | EvictionPolicy | Callable[[int], EvictionPolicy] = "lru",
        segment_bytes: int = 1 << 30,
        io_threads: int = 4,
        preallocate: bool = True,
        fsync: bool = False,
        shared: bool = False,
        tenant_quota_bytes: Mapping[object, int] | Callable[[object], int | None] | None = None,
        encoding: str = "raw",
    ) -> None:
        if not isinstance(path, (str, os.PathLike)):
            raise InvalidTypeError(f"path must be a str or os.PathLike, got {type(path).__name__}")
        for name, value in (
            ("capacity_bytes", capacity_bytes),
            ("segment_bytes", segment_bytes),
            ("io_threads", io_threads),
        ):
            if isinstance(value, bool) or not isinstance(value, int):
                raise InvalidTypeError(f"{name} must be an int, got {type(value).__name__}")
            if value <= 0:
                raise InvalidArgumentError(f"{name} must be > 0, got {value}")
        if not isinstance(shared, bool):
            raise InvalidTypeError(f"shared must be a bool, got {type(shared).__name__}")
        if shared and eviction != "lru":
            raise InvalidArgumentError(
                "eviction must be 'lru' when shared=True (the shared catalog evicts the least recently used "
                f"entry of a block's set), got {eviction!r}"
            )
        if tenant_quota_bytes is not None and shared:
            raise InvalidArgumentError(
                "tenant_quota_bytes cannot be used with shared=True (the shared catalog evicts by set, for "
                "every process at once); use one DiskTier per process, or quotas in the CPU tier"
            )
        self.encoding = check_encoding(encoding)
        self.tenant_quota_bytes = tenant_quota_bytes
        self._quotas = TenantQuotas(tenant_quota_bytes) if tenant_quota_bytes is not None else None
        self.path = Path(path)
        self.shared = shared
        self.capacity_bytes = capacity_bytes
        self._eviction = eviction
        self._segment_bytes = segment_bytes
        self._io_threads = io_threads
        self._preallocate = preallocate
        self._fsync = fsync

        self._spec: TierSpec | None = None  # what the files hold (the encoded entries' size and fingerprint)
        self._codec: Codec | None = None  # None: blocks are stored raw
        self._block_bytes = 0  # bytes of one caller's block (a CPU slot), once open
        self._geo: _Geometry | None = None
        self._files: _Files | None = None
        self._index: BlockIndex | None = None  # shared=False: this process's index of the directory
        self._catalog: SharedCatalog | None = None  # shared=True: the catalog every process maps
        self._catalog_stats: CatalogStats | None = None  # its last figures, once closed
        self._pool: LanePool | None = None
        self._reads_ahead = 0  # the pool's count, kept once it is gone
        self._lock_fd: int | None = None
        self._opened = False
        self._closed = False
        self._inflight: set[asyncio.Future[Any]] = set()
        self._seq = 1
        self._last_error: str | None = None
        self._preallocated = False
        self._reset = False
        self._c: dict[str, int] = dict.fromkeys(
            (
                "lookups",
                "lookup_hits",
                "reads",
                "read_blocks",
                "read_bytes",
                "read_misses",
                "corrupt",
                "read_errors",
                "writes",
                "stored_blocks",
                "stored_bytes",
                "skipped_existing",
                "dropped_no_room",
                "dropped_io_error",
                "dropped_down",
                "recovered",
                "recovery_dropped",
                "raced",
                "dropped_busy",
                "dropped_quota",
                "dropped_unencodable",
            ),
            0,
        )
        self._init_degraded_state()

    def _init_degraded_state(self) -> None:
        """State of the failure paths: the set-up retried while down, the layout file still to write, logs."""
        self._clock: Callable[[], float] = time.monotonic  # times the set-up retries; replaced by tests
        self._spare_index: BlockIndex | None = None  # the index to install once a retried set-up succeeds
        # Down only when the set-up fails (trip), degraded by failed I/O; the lambda follows a replaced clock.
        self._breaker = Breaker(None, _REOPEN_BACKOFF_S, _REOPEN_BACKOFF_MAX_S, lambda: self._clock())
        self._meta_pending: dict[str, Any] | None = None
        where = f"disk tier {str(self.path)!r}"
        self._log_health = Transitions(_log, where)
        self._log_corrupt = Throttled(_log, logging.WARNING, f"{where}: corrupt entries dropped")
        self._log_io = Throttled(_log, logging.WARNING, f"{where}: failed I/O")

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open" if self._opened else "new"
        entries = self.stats().entries
        shared = " shared" if self.shared else ""
        return f"<{type(self).__name__} {str(self.path)!r} {state}{shared} health={self._breaker.state.value} entries={entries}>"

    # ------------------------------------------------------------- lifecycle
    async def open(self, spec: TierSpec) -> None:
        """Lock the directory, (re)create the segment files and rebuild the index from their headers.

        A filesystem without room (ENOSPC, EDQUOT, EFBIG) does not fail the open: the tier starts
        ``"degraded"`` when only the layout file or the preallocation could not be written (stores are tried
        and dropped while there is no room), or ``"down"`` when the directory, its lock file or a segment file
        could not even be created (lookups miss, stores are dropped and counted as ``dropped_down``; a store
        after a backoff of 1 s, doubling up to 60 s, retries the set-up). Both are logged.

        Raises :class:`TierLockedError` when another process or ``DiskTier`` holds the directory,
        :class:`CapacityError` when ``capacity_bytes`` cannot hold one entry, and ``OSError`` when the
        directory cannot be used for any other reason (``NotADirectoryError`` when ``path`` is a file,
        ``PermissionError``, a read-only filesystem, I/O errors): those are configuration errors.
        """
        if self._opened or self._closed:
            raise ClosedError("a DiskTier can be opened once; create a new one")
        if not isinstance(spec, TierSpec):
            raise InvalidTypeError(f"spec must be a TierSpec, got {type(spec).__name__}")
        if spec.payload_bytes <= 0:
            raise InvalidArgumentError(f"spec.payload_bytes must be > 0, got {spec.payload_bytes}")
        if len(spec.fingerprint) != 32:
            raise InvalidArgumentError(f"spec.fingerprint must be 32 bytes, got {len(spec.fingerprint)}")
        block_bytes = spec.payload_bytes
        codec = make_codec(self.encoding, spec.segments, block_bytes)
        if codec is not None:  # a directory written with another encoding (or raw) is then started fresh
            spec = codec.stored_spec(spec)
        geo = _Geometry(spec.payload_bytes, self.capacity_bytes, self._segment_bytes)
        if geo.num_slots == 0:
            raise CapacityError(
                f"capacity_bytes must hold at least one entry of {geo.entry_bytes} bytes, "
                f"got {self.capacity_bytes}"
            )
        index = BlockIndex(geo.num_slots, make_policy(self._eviction, geo.num_slots))
        if self._quotas is not None:
            index.set_tenant_quota(self._quotas.slots(geo.entry_bytes))
        self._opened = True
        loop = asyncio.get_running_loop()
        # Runs on the default executor: our pool does not exist yet and this is a one-off.
        fut, cancelled = await _wait_thread(loop.run_in_executor(None, self._open_sync, spec, geo))
        exc = fut.exception()
        if cancelled or (exc is not None and not _is_space_error(exc)):
            self._closed = True
            if exc is None:
                fut.result().close()
            if cancelled:
                raise asyncio.CancelledError
            assert exc is not None
            raise exc
        self._spec = spec
        self._codec = codec
        self._block_bytes = block_bytes
        self._geo = geo
        # Reads (staging, i.e. loads) never queue behind writes (write-through): see aiokv.tiers._lanes.
        self._pool = LanePool(self._io_threads, name="aiokv-disk")
        if exc is None:
            self._install(fut.result(), index)
            return
        self._spare_index = index  # never used: installed as it is once a retried set-up succeeds
        before = self._breaker.state
        self._breaker.trip()
        self._health_changed(before, exc)

    def _open_sync(self, spec: TierSpec, geo: _Geometry) -> _Opened:
        """Set up the directory (worker thread; reads the configuration, changes nothing on ``self``)."""
        return _open_directory(
            self.path,
            spec,
            geo,
            shared=self.shared,
            capacity_bytes=self.capacity_bytes,
            preallocate=self._preallocate,
            fsync=self._fsync,
        )

    def _install(self, opened: _Opened, index: BlockIndex) -> None:
        """Make a set-up directory the tier's storage (on the loop, between two calls)."""
        if opened.catalog is not None:
            self._catalog = opened.catalog
            recovered = opened.catalog.stats().ready
        else:
            _restore(index, opened.recovered)
            self._index = index
            recovered = len(opened.recovered)
            if self.kv_events is not None:  # recovered entries are stored (oldest first); evictions reported
                index.on_evict = []
                self.kv_events.stored([key for _, _, key in opened.recovered])
        self._files = opened.files
        self._lock_fd = opened.lock_fd
        self._seq = max((seq for seq, _, _ in opened.recovered), default=0) + 1
        self._c["recovered"] += recovered
        self._c["recovery_dropped"] += opened.recovery_dropped
        self._reset = opened.reset
        self._preallocated = opened.preallocated
        self._meta_pending = opened.meta_pending
        where = str(self.path)
        if opened.reset:
            _log.info("disk tier %r held another layout: started fresh (old segment files deleted)", where)
        if recovered or opened.recovery_dropped:
            _log.info(
                "disk tier %r: recovered %d entries, dropped %d (torn, foreign or damaged)",
                where,
                recovered,
                opened.recovery_dropped,
            )
        if opened.meta_pending is not None:
            _log.warning(
                "disk tier %r: no room to write %s (%s): entries stored now are lost at the next restart "
                "unless it can be written later (retried after each successful store)",
                where,
                META_NAME,
                _describe(opened.space_error) if opened.space_error else "",
            )
        elif opened.space_error is not None:
            _log.warning(
                "disk tier %r: no room to preallocate the segment files (%s): stores fail until space is freed",
                where,
                _describe(opened.space_error),
            )
        breaker = self._breaker
        before = breaker.state
        breaker.success(probe=True)  # installed at open (up already) or by the probe of a down tier
        if opened.space_error is not None:
            breaker.failure(probe=False)
        self._health_changed(before, opened.space_error)

    async def aclose(self) -> None:
        """Wait for in-flight I/O, close the files and release the lock. Idempotent."""
        if self._closed:
            return
        self._closed = True
        cancelled = False
        for fut in list(self._inflight):  # no job starts after _closed is set
            _, was_cancelled = await _wait_thread(fut)
            cancelled = cancelled or was_cancelled
        self._release()
        for throttle in (self._log_health, self._log_corrupt, self._log_io):
            throttle.flush()
        if cancelled:
            raise asyncio.CancelledError

    def _release(self) -> None:
        if self._pool is not None:
            self._reads_ahead = self._pool.reads_ahead_of_writes
            self._pool.shutdown(wait=False)
            self._pool = None
        if self._files is not None:
            self._files.close()
        if self._catalog is not None:
            self._catalog_stats = self._catalog.stats()
            self._catalog.close()
            self._catalog = None
        if self._lock_fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._lock_fd)  # releases the flock
            self._lock_fd = None

    async def __aenter__(self) -> DiskTier:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def _geometry(self) -> _Geometry:
        if self._closed:
            raise ClosedError("disk tier is closed")
        if self._geo is None:
            raise ClosedError("disk tier is not open; call open(spec) first")
        return self._geo

    def _live(self) -> tuple[_Files, _Geometry] | None:
        """The tier's files, or None while it is down (its directory could not be set up)."""
        geo = self._geometry()
        if self._files is None:
            return None
        return self._files, geo

    def _local(self) -> BlockIndex:
        """The index of a directory this process owns (``shared=False``)."""
        assert self._index is not None
        return self._index

    def _submit(self, fn: Callable[..., T], *args: Any, write: bool = False) -> asyncio.Future[T]:
        """Run ``fn(*args)`` on an I/O thread, in the write lane (stores and their set-up) or the read lane."""
        assert self._pool is not None
        pool = self._pool
        fut = asyncio.wrap_future(pool.submit_write(fn, *args) if write else pool.submit(fn, *args))
        self._inflight.add(fut)
        fut.add_done_callback(self._inflight.discard)
        return fut

    def _split(self, n: int, payload_bytes: int, threads: int | None = None) -> list[tuple[int, int]]:
        """Cut ``n`` entries into up to ``threads`` (default ``io_threads``) contiguous parts of at least
        ``_SPLIT_BYTES`` each."""
        parts = max(1, min(threads or self._io_threads, n, n * payload_bytes // _SPLIT_BYTES))
        bounds = [n * k // parts for k in range(parts + 1)]
        return [(bounds[k], bounds[k + 1]) for k in range(parts)]

    async def _run_all(
        self, calls: list[tuple[Callable[..., T], tuple[Any, ...]]], *, write: bool = False
    ) -> tuple[list[asyncio.Future[T]], bool]:
        """Run jobs on the I/O threads in parallel; wait for all of them even when cancelled."""
        futs = [self._submit(fn, *args, write=write) for fn, args in calls]
        cancelled = False
        for fut in futs:
            _, was_cancelled = await _wait_thread(fut)
            cancelled = cancelled or was_cancelled
        errors = [exc for exc in (fut.exception() for fut in futs) if exc is not None]  # retrieves them all
        if errors:
            raise errors[0]
        return futs, cancelled

    # ---------------------------------------------------------------- health
    def _health_changed(self, previous: TierHealth, error: BaseException | None = None) -> None:
        """After the breaker moved: record the error that moved it and log the transition, if any."""
        if error is not None:
            self._last_error = _describe(error)
        health = self._breaker.state
        if health is previous:
            return
        where = str(self.path)
        log = self._log_health
        if health is TierHealth.UP:
            log.changed("up", logging.INFO, "disk tier %r is up again (was %s)", where, previous.value)
        elif health is TierHealth.DEGRADED:
            log.changed(
                "degraded",
                logging.WARNING,
                "disk tier %r degraded: %s; failed reads are misses and failed stores are dropped: check the "
                "disk, its free space and the directory's permissions (the tier keeps trying on every call)",
                where,
                self._last_error,
            )
        else:
            log.changed(
                "down",
                logging.WARNING,
                "disk tier %r is down: cannot set up the directory (%s); lookups miss and stores are "
                "dropped until a retry (on a store, after %.0f s or more) succeeds: check that the directory "
                "can be created and written, and that the filesystem has space",
                where,
                self._last_error,
                self._breaker.backoff,
            )

    def _io_failed(self, exc: OSError) -> None:
        before = self._breaker.state
        self._breaker.failure(probe=False)
        self._health_changed(before, exc)

    def _io_worked(self) -> None:
        before = self._breaker.state
        self._breaker.success(probe=False)  # while down (no files) nothing touches the disk: ignored then
        self._health_changed(before)

    async def _retry_setup(self) -> tuple[_Files, _Geometry] | None:
        """While down: set the directory up again, at most once per backoff interval and one caller at a time.
        Returns the storage when it worked. Never raises but cancellation (delivered after the attempt)."""
        breaker = self._breaker
        if not breaker.allow():
            return None
        assert self._spec is not None
        assert self._geo is not None
        assert self._spare_index is not None
        try:
            fut, cancelled = await _wait_thread(
                self._submit(self._open_sync, self._spec, self._geo, write=True)
            )
        except BaseException:
            breaker.abandoned(probe=True)
            raise
        exc = fut.exception()
        if self._closed:  # aclose() ran meanwhile: it released what the tier held, not this
            breaker.abandoned(probe=True)
            if exc is None:
                fut.result().close()
        elif exc is None:
            index, self._spare_index = self._spare_index, None
            self._install(fut.result(), index)
        else:
            breaker.failure(probe=True)
            self._last_error = _describe(exc)
            self._log_io.event(
                "disk tier %r is still down: %s (next retry in %.0f s)",
                str(self.path),
                self._last_error,
                breaker.backoff,
            )
        if cancelled:
            raise asyncio.CancelledError
        return self._live() if exc is None and not self._closed else None

    async def _write_pending_meta(self, meta: dict[str, Any]) -> bool:
        """After a successful store: write the layout file that there was no room for at open. Returns whether
        a cancellation arrived meanwhile (delivered by the caller)."""
        fut, cancelled = await _wait_thread(self._submit(_write_meta, self.path, meta, write=True))
        exc = fut.exception()
        if exc is None and fut.result() is None:
            self._meta_pending = None
            _log.info(
                "disk tier %r: wrote %s, entries will be recovered at restart", str(self.path), META_NAME
            )
        else:
            err = exc if exc is not None else fut.result()
            assert err is not None
            self._log_io.event(
                "disk tier %r: writing %s failed: %s", str(self.path), META_NAME, _describe(err)
            )
        return cancelled

    # ------------------------------------------------------------ operations
    async def lookup(self, keys: Sequence[bytes]) -> int:
        live = self._live()
        self._c["lookups"] += 1
        if live is None:
            return 0
        n = (
            self._catalog.match_prefix(keys)
            if self._catalog is not None
            else self._local().match_prefix(keys)
        )
        self._c["lookup_hits"] += n
        return n

    async def read_into(self, keys: Sequence[bytes], outs: Sequence[memoryview]) -> int:
        live = self._live()
        check_buffers("outs", keys, outs, self._block_bytes)
        if not keys:
            return 0
        self._c["reads"] += 1
        if live is None:
            self._c["read_misses"] += 1
            return 0
        files, geo = live
        catalog = self._catalog
        tokens: list[int] = []  # shared: the reservation each read slot held when the read began
        if catalog is not None:
            found = catalog.begin_reads(keys)
            slots = [slot for slot, _ in found]
            tokens = [token for _, token in found]
        else:
            slots = self._local().pin_prefix(keys)
        pinned = list(keys[: len(slots)])
        if not slots:
            self._c["read_misses"] += 1
            return 0
        # Cold reads: one thread, in file order (spreading them over threads breaks the kernel's readahead and
        # cost ~25% of the device's throughput). Warm reads (the entries' pages are in the page cache, probed
        # without blocking) are split over the I/O threads, so the checksum passes run on several cores:
        # measured, two threads lift verified warm reads from ~0.65 to ~0.85 of a bare preadv.
        parts = [(0, len(slots))]
        if len(slots) > 1 and files.resident(slots[0]) and files.resident(slots[-1]):
            parts = self._split(len(slots), geo.payload_bytes)
        try:
            read = files.read if self._codec is None else functools.partial(self._read_decoded, files)
            futs, cancelled = await self._run_all(
                [(read, (slots[a:b], pinned[a:b], outs[a:b])) for a, b in parts]
            )
        finally:
            if catalog is not None:
                catalog.end_reads(slots)
            else:
                self._local().unpin(pinned)
        done = 0
        complete = True
        failed = False
        for (a, b), fut in zip(parts, futs, strict=True):
            n_ok, verdict, err = fut.result()
            if complete:
                done += n_ok
                complete = n_ok == b - a
            if verdict is None:
                continue
            failed = failed or err is not None
            i = a + n_ok
            bad = pinned[i]
            if err is not None:
                self._c["read_errors"] += 1
                self._log_io.event(
                    "disk tier %r: reading entry %s failed, dropped: %s",
                    str(self.path),
                    bad.hex()[:16],
                    _describe(err),
                )
                self._io_failed(err)
            elif catalog is not None and not catalog.holds(slots[i], bad, tokens[i]):
                self._c["raced"] += 1  # another process replaced the entry while it was read: a miss
                continue
            else:
                self._c["corrupt"] += 1
                self._log_corrupt.event(
                    "disk tier %r: entry %s failed verification (%s), dropped; a miss, its blocks are "
                    "recomputed (if this repeats: something else writes the tier's files, or the disk is failing)",
                    str(self.path),
                    bad.hex()[:16],
                    verdict.value,
                )
            self._drop(bad, slots[i], tokens[i] if catalog is not None else 0)
        if done < len(keys):
            self._c["read_misses"] += 1
        if done and not failed:
            self._io_worked()
        self._c["read_blocks"] += done
        self._c["read_bytes"] += done * geo.payload_bytes
        if cancelled:
            raise asyncio.CancelledError
        return done

    def _drop(self, key: bytes, slot: int, token: int) -> None:
        """Forget an entry that failed verification or could not be read (unless a read still holds it here,
        or, shared, another process changed it meanwhile or holds the catalog lock right now)."""
        catalog = self._catalog
        events = self.kv_events
        if catalog is None:
            index = self._local()
            if index.pins(key) == 0 and index.discard(key) and events is not None:
                events.removed([key])
        elif catalog.try_lock():
            try:
                dropped = catalog.drop_locked(slot, key, token)
            finally:
                catalog.unlock()
            if dropped and events is not None:
                events.removed([key])

    async def write(
        self,
        keys: Sequence[bytes],
        payloads: Sequence[memoryview],
        *,
        tenants: Sequence[bytes | None] | None = None,
    ) -> int:
        """Store ``payloads[i]`` under ``keys[i]``; ``tenants[i]`` (a :meth:`tenant_key`, or ``None``) is the
        tenant its entry counts against when the tier has ``tenant_quota_bytes``."""
        if tenants is not None and len(tenants) != len(keys):
            raise InvalidArgumentError(
                f"tenants must have one entry per key ({len(keys)}), got {len(tenants)}"
            )
        stored, _ = await self._store(keys, payloads, None, tenants)
        return stored

    async def write_tenants(
        self, keys: Sequence[bytes], payloads: Sequence[memoryview], tenants: Sequence[bytes | None]
    ) -> int:
        return await self.write(keys, payloads, tenants=tenants)

    @property
    def has_tenant_quotas(self) -> bool:
        return self._quotas is not None

    def tenant_key(self, salt: object) -> bytes:
        """The tenant a request with ``salt`` counts against (its canonical salt). With a callable
        ``tenant_quota_bytes``, the first request of a tenant asks it for that tenant's quota."""
        if self._quotas is None:
            return super().tenant_key(salt)
        return self._quotas.key(salt)

    def tenant_bytes(self, salt: object) -> int:
        """Bytes of segment files held by the entries written for the tenant with ``salt`` since the tier
        was opened (0 without quotas)."""
        if self._index is None or self._geo is None:
            return 0
        return self._index.tenant_slots(super().tenant_key(salt)) * self._geo.entry_bytes

    async def _write_damaged(
        self, keys: Sequence[bytes], payloads: Sequence[memoryview], damage: Sequence[Damage | None]
    ) -> tuple[int, int]:
        """Fault injection hook (used by :class:`~aiokv.tiers.FaultyTier` only): ``write``, except that entry
        ``i`` is stored with the :data:`~aiokv.tiers._format.Damage` ``damage[i]`` applied after its
        checksums were computed, i.e. corrupt at rest. Returns (stored, how many of them were damaged).

        Offsets are of an entry of the caller's block size (what a wrapper sees); with an encoding the stored
        entry is shorter and an offset past its end is folded into its payload (:func:`fold_damage`)."""
        check_damage(damage, len(keys), self._block_bytes)
        size = self._geometry().payload_bytes
        if size != self._block_bytes:
            damage = [None if dmg is None else fold_damage(dmg, size) for dmg in damage]
        return await self._store(keys, payloads, list(damage))

    async def _store(
        self,
        keys: Sequence[bytes],
        payloads: Sequence[memoryview],
        damage: list[Damage | None] | None,
        tenants: Sequence[bytes | None] | None = None,
    ) -> tuple[int, int]:
        live = self._live()
        check_buffers("payloads", keys, payloads, self._block_bytes)
        self._c["writes"] += 1
        if live is None:
            live = await self._retry_setup()
            if live is None:
                self._c["dropped_down"] += len(keys)
                return 0, 0
        files, geo = live
        plan = (
            self._reserve_local(keys, tenants) if self._catalog is None else await self._reserve_shared(keys)
        )
        if plan is None:
            return 0, 0
        self._c["skipped_existing"] += plan.skipped
        if not plan.slots:
            return plan.skipped, 0
        slots = plan.slots
        wkeys = [keys[i] for i in plan.indices]
        wpayloads = [payloads[i] for i in plan.indices]
        wdamage: list[Damage | None] = [damage[i] if damage is not None else None for i in plan.indices]
        seqs = self._sequence_numbers(len(slots))
        assert self._pool is not None
        parts = self._split(len(slots), geo.payload_bytes, self._pool.write_threads)
        write: Callable[..., tuple[list[bool | None], OSError | None]] = (
            files.write if self._codec is None else functools.partial(self._encode_and_write, files)  # type: ignore[assignment]
        )
        try:
            futs, cancelled = await self._run_all(
                [
                    (
                        write,
                        (slots[a:b], wkeys[a:b], wpayloads[a:b], seqs[a:b], wdamage[a:b] if damage else None),
                    )
                    for a, b in parts
                ],
                write=True,
            )
            ok: list[bool | None] = []  # None: not encodable, not written
            err: OSError | None = None
            for fut in futs:
                part_ok, part_err = fut.result()
                ok += part_ok
                err = err or part_err
        except BaseException:
            await self._settle(plan, wkeys, [False] * len(wkeys))
            raise
        committed, settle_cancelled = await self._settle(plan, wkeys, [bool(good) for good in ok])
        cancelled = cancelled or settle_cancelled
        stored = sum(committed)
        stored_damaged = sum(
            1 for good, dmg in zip(committed, wdamage, strict=True) if good and dmg is not None
        )
        self._c["stored_blocks"] += stored
        self._c["stored_bytes"] += stored * geo.payload_bytes
        unencodable = sum(1 for good in ok if good is None)
        self._c["dropped_unencodable"] += unencodable
        self._c["dropped_io_error"] += len(wkeys) - sum(1 for good in ok if good) - unencodable
        if unencodable:
            self._log_io.event(
                "disk tier %r: %d blocks not stored: a value was not finite (encoding %r)",
                str(self.path),
                unencodable,
                self.encoding,
            )
        if err is not None:
            self._log_io.event(
                "disk tier %r: %d of %d stores dropped: %s",
                str(self.path),
                len(wkeys) - sum(1 for good in ok if good),
                len(wkeys),
                _describe(err),
            )
            self._io_failed(err)
        elif stored:
            self._io_worked()
            if self._meta_pending is not None and not self._closed:
                cancelled = await self._write_pending_meta(self._meta_pending) or cancelled
        if cancelled:
            raise asyncio.CancelledError
        return plan.skipped + stored, stored_damaged

    # --------------------------------------------------------------- encodings (I/O threads)
    def _encode_and_write(
        self,
        files: _Files,
        slots: list[int],
        keys: list[bytes],
        payloads: list[memoryview],
        seqs: list[int],
        damage: list[Damage | None] | None,
    ) -> tuple[list[bool | None], OSError | None]:
        """``_Files.write`` of the encoded ``payloads`` (I/O thread). ``ok[i]`` is ``None`` for a block that
        could not be encoded (not written)."""
        codec = self._codec
        assert codec is not None
        size = codec.encoded_bytes
        encoded: list[memoryview] = []
        keep: list[int] = []
        for i, payload in enumerate(payloads):
            buf = bytearray(size)
            try:
                codec.encode(payload, buf)
            except EncodeError:
                continue
            encoded.append(memoryview(buf))
            keep.append(i)
        ok: list[bool | None] = [None] * len(payloads)
        if not keep:
            return ok, None
        written, err = files.write(
            [slots[i] for i in keep],
            [keys[i] for i in keep],
            encoded,
            [seqs[i] for i in keep],
            [damage[i] for i in keep] if damage is not None else None,
        )
        for i, good in zip(keep, written, strict=True):
            ok[i] = good
        return ok, err

    def _read_decoded(
        self, files: _Files, slots: list[int], keys: list[bytes], outs: Sequence[memoryview]
    ) -> tuple[int, Verdict | None, OSError | None]:
        """``_Files.read`` into scratch buffers, then each verified entry decoded into ``outs`` (I/O thread).
        An entry that verifies but does not decode ends the read there, as a corrupt one does."""
        codec = self._codec
        assert codec is not None
        scratch = [memoryview(bytearray(codec.encoded_bytes)) for _ in slots]
        done, verdict, err = files.read(slots, keys, scratch)
        for i in range(done):
            try:
                codec.decode(scratch[i], outs[i])
            except DecodeError:
                return i, Verdict.UNDECODABLE, None
        return done, verdict, err

    def _sequence_numbers(self, n: int) -> list[int]:
        """Write order stamped in the headers (recovery order): a counter when this process owns the
        directory, wall-clock nanoseconds when processes share it."""
        if self._catalog is not None:
            now = time.time_ns()
            return [now + j for j in range(n)]
        first = self._seq
        self._seq += n
        return list(range(first, first + n))

    def _reserve_local(
        self, keys: Sequence[bytes], tenants: Sequence[bytes | None] | None = None
    ) -> _StorePlan:
        """Reserve a slot of this process's index for each key it does not hold (or is not writing) yet, for
        ``tenants[i]`` when the tier has quotas."""
        index = self._local()
        quotas = self._quotas
        if quotas is None:
            tenants = None
        plan = _StorePlan()
        for i, key in enumerate(keys):
            if index.state(key) is not None:
                index.touch(key)
                plan.skipped += 1
                continue
            tenant = tenants[i] if tenants is not None else None
            slot = index.reserve(key, tenant=tenant)
            if slot is None:
                if tenant is not None and self._at_quota(index, tenant):
                    self._c["dropped_quota"] += 1
                else:
                    self._c["dropped_no_room"] += 1
                continue
            plan.indices.append(i)
            plan.slots.append(slot)
        evicted = index.on_evict
        if evicted and self.kv_events is not None:
            self.kv_events.removed(evicted)
            evicted.clear()
        return plan

    def _at_quota(self, index: BlockIndex, tenant: bytes) -> bool:
        assert self._quotas is not None
        assert self._geo is not None
        limit = self._quotas.limit_bytes(tenant)
        return limit is not None and index.tenant_slots(tenant) >= limit // self._geo.entry_bytes

    async def _reserve_shared(self, keys: Sequence[bytes]) -> _StorePlan | None:
        """Reserve slots in the shared catalog (under its lock); None when the lock was not free in time."""
        catalog = self._catalog
        assert catalog is not None
        locked, cancelled = await self._lock_catalog(catalog, _RESERVE_LOCK_S)
        if cancelled:  # nothing reserved yet
            if locked:
                catalog.unlock()
            raise asyncio.CancelledError
        if not locked:
            self._c["dropped_busy"] += len(keys)
            return None
        try:
            held, reservations, no_room = catalog.reserve_locked(keys)
        finally:
            catalog.unlock()
        self._c["dropped_no_room"] += no_room
        return _StorePlan(
            skipped=held,
            indices=[r.index for r in reservations],
            slots=[r.slot for r in reservations],
            reservations=reservations,
        )

    async def _settle(self, plan: _StorePlan, wkeys: list[bytes], ok: list[bool]) -> tuple[list[bool], bool]:
        """Make the entries written completely visible and release the others. Returns which became visible
        and whether a cancellation arrived meanwhile (delivered by the caller)."""
        catalog = self._catalog
        if catalog is None:
            index = self._local()
            for key, good in zip(wkeys, ok, strict=True):
                if good:
                    index.commit(key)
                else:
                    index.discard(key)
            if self.kv_events is not None:
                self.kv_events.stored([key for key, good in zip(wkeys, ok, strict=True) if good])
            return ok, False
        locked, cancelled = await self._lock_catalog(catalog, _COMMIT_LOCK_S)
        if not locked:  # the slots stay reserved until they are reclaimed as stale
            self._c["dropped_busy"] += sum(ok)
            return [False] * len(ok), cancelled
        try:
            committed = catalog.commit_locked(plan.reservations, ok)
        finally:
            catalog.unlock()
        if self.kv_events is not None:
            self.kv_events.stored([key for key, good in zip(wkeys, committed, strict=True) if good])
        self._c["dropped_busy"] += sum(ok) - sum(committed)  # taken over meanwhile (we looked stalled)
        return committed, cancelled

    async def _lock_catalog(self, catalog: SharedCatalog, timeout_s: float) -> tuple[bool, bool]:
        """Take the shared catalog's lock, polling (every change holds it for microseconds), for at most
        ``timeout_s``. Returns (locked, cancelled): a cancellation is remembered, not raised, so that the caller
        can finish its bookkeeping first."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        delay = 50e-6
        cancelled = False
        while not catalog.try_lock():
            if loop.time() >= deadline:
                self._log_io.event(
                    "disk tier %r: the shared catalog stayed locked for %.1f s", str(self.path), timeout_s
                )
                return False, cancelled
            try:
                await asyncio.sleep(delay)
            except asyncio.CancelledError:
                cancelled = True
            delay = min(2 * delay, 2e-3)
        return True, cancelled

    def stats(self) -> DiskTierStats:
        geo = self._geo
        entries = pending = pinned = evictions = reclaimed = 0
        shared = self._catalog.stats() if self._catalog is not None else self._catalog_stats
        if shared is not None:  # the directory's figures, every process included
            entries, pending, evictions, reclaimed = (
                shared.ready,
                shared.writing,
                shared.evictions,
                shared.reclaimed,
            )
            pinned = len(self._catalog.reading) if self._catalog is not None else 0
        elif self._index is not None:
            index_stats = self._index.stats()
            entries, pending, pinned = index_stats.ready, index_stats.pending, index_stats.pinned
            evictions = index_stats.evictions
        return DiskTierStats(
            health=self._breaker.state,
            path=str(self.path),
            capacity_bytes=self.capacity_bytes,
            entry_bytes=geo.entry_bytes if geo is not None else 0,
            num_slots=geo.num_slots if geo is not None else 0,
            entries=entries,
            pending=pending,
            pinned=pinned,
            evictions=evictions,
            reset=self._reset,
            preallocated=self._preallocated,
            shared=self.shared,
            reclaimed=reclaimed,
            last_error=self._last_error,
            encoding=self.encoding,
            reads_ahead_of_writes=self._pool.reads_ahead_of_writes
            if self._pool is not None
            else self._reads_ahead,
            **self._c,
        )
