"""A persistent, crash-consistent disk tier: fixed-size entries in preallocated segment files.

Layout of the directory (guarded by ``flock`` on ``aiokv-disk.lock``: exclusive for one owner, shared by the
processes of ``shared=True`` tiers)::

    aiokv-disk.lock     lock file (holds the exclusive owner's pid, for humans)
    aiokv-disk.json     layout: format version, fingerprint, payload_bytes, entry_bytes, slots_per_segment
    aiokv-disk.idx      shared=True only: the catalog every process maps (see :mod:`aiokv.tiers._catalog`)
    seg-00000.akv ...   segment files of ``slots_per_segment`` fixed-size entries each

Every entry occupies ``entry_bytes = round_up(128 + payload_bytes, 4096)`` bytes: the 128-byte header of
:mod:`aiokv.tiers._format` followed by the payload (and zero padding). A slot of the :class:`BlockIndex` is
therefore a file offset, eviction is pure bookkeeping, and a batch of blocks stored together lands in
consecutive slots and is written with one ``pwritev`` (read back with one ``preadv`` straight into the CPU
slots: no intermediate copies).

Consistency rules:

- An entry is written (header then payload, in one call) *before* it becomes visible in the index; a crash
  mid-write leaves a header whose payload checksum does not match, and the entry is dropped when read.
- On open the index is rebuilt by scanning the headers of every slot (only headers: payloads are verified on
  every read). Entries of another layout, with a bad header or cut short by a truncated file are dropped.
  Entries are re-inserted in write order (the header's sequence number), so eviction after a restart starts
  with the oldest writes.
- Evicting an entry only forgets it in memory: until its slot is reused, a restart may bring the (valid)
  entry back. A corrupt entry is erased on disk (its header is zeroed) when a read detects it.
- Reopening a directory written with a different layout (fingerprint, payload size or segment geometry)
  *starts fresh*: the old segment files are deleted. A different ``capacity_bytes`` with the same layout keeps
  every entry whose slot still exists.
- Nothing is fsynced unless ``fsync=True``: entries survive a process crash (they are in the page cache);
  after a power loss the checksums drop whatever did not reach the disk intact.

Failures never escape: a write that fails (ENOSPC, EIO, EFBIG...) is dropped and counted, a read that fails or
does not verify is a miss (the entry is dropped), and the tier's health goes ``"degraded"`` until the next
successful I/O. A filesystem out of space (ENOSPC, EDQUOT, EFBIG) at ``open()`` does not fail the open either:
the tier starts ``"degraded"`` (sparse segment files, stores fail until space is freed) or, when not even the
directory, lock or segment files can be created, ``"down"`` (lookups miss, stores are dropped; a store after a
backoff retries the set-up). Disk I/O runs on a small private thread pool, never on the event loop.

Many processes, one directory (``shared=True``): the processes map a shared catalog instead of each keeping
its own index, so an entry stored by one is found by the others as soon as it is complete. Placement is
set-associative and eviction picks the least recently used entry of a block's set; capacity is the segment
files, whoever writes. Changes take a file lock for microseconds; reads take none and rely on verification:
an entry that changes under a read fails it and is a miss (``raced``), never wrong bytes. A writer killed
mid-store leaves reserved slots that the next writer needing room reclaims.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import json
import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from .._errors import CapacityError, ClosedError, InvalidArgumentError, InvalidTypeError, TierLockedError
from .._log import Throttled, Transitions, get_logger
from ._base import BackingTier, TierSpec, check_buffers
from ._catalog import CatalogStats, Reservation, SharedCatalog, catalog_geometry
from ._format import (
    FORMAT_VERSION,
    HEADER_SIZE,
    Damage,
    EntryHeader,
    TierHealth,
    Verdict,
    check_damage,
    check_entry,
    check_header,
    damaged,
    pack_header,
)
from ._health import Breaker
from ._index import BlockIndex
from ._lanes import LanePool
from ._policies import EvictionPolicy, make_policy
from ._quota import TenantQuotas

__all__ = ["DiskTier", "DiskTierStats"]

ALIGN = 4096
META_NAME = "aiokv-disk.json"
LOCK_NAME = "aiokv-disk.lock"
CATALOG_NAME = "aiokv-disk.idx"
_SEGMENT_PREFIX = "seg-"
_SEGMENT_SUFFIX = ".akv"
_META_FORMAT = "aiokv-disk"
_IOV_MAX = max(3, min(os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024, 1024))
# One pwritev/preadv call moves at most one entry or this much: the checksum of a run is computed right
# before it is written / right after it is read, while the run is still in the CPU caches.
_RUN_BYTES = 1 << 20
# A stored batch is spread over the I/O threads only in parts of at least this much (smaller ones are written
# by one thread in file order); reads always use one thread per call, see read_into.
_SPLIT_BYTES = 16 << 20
_ZERO_HEADER = bytes(HEADER_SIZE)
# Errors that mean "no room on this filesystem" (not a misconfiguration): at open they degrade the tier.
SPACE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})
# A tier that could not set up its directory retries on a store after this long, doubling up to the maximum.
_REOPEN_BACKOFF_S = 1.0
_REOPEN_BACKOFF_MAX_S = 60.0
# Shared directories: how long a store waits for the catalog lock (held for microseconds by each change) before
# it is dropped, how long a commit waits for it, and how long set-up at open waits.
_RESERVE_LOCK_S = 1.0
_COMMIT_LOCK_S = 10.0
_SETUP_LOCK_S = 30.0

T = TypeVar("T")
_log = get_logger("tiers.disk")


def _is_space_error(exc: BaseException) -> bool:
    return isinstance(exc, OSError) and exc.errno in SPACE_ERRNOS


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def _segment_name(index: int) -> str:
    return f"{_SEGMENT_PREFIX}{index:05d}{_SEGMENT_SUFFIX}"


def _round_up(n: int, align: int) -> int:
    return (n + align - 1) // align * align


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


class _Geometry:
    __slots__ = ("entry_bytes", "num_segments", "num_slots", "pad", "payload_bytes", "slots_per_segment")

    def __init__(self, payload_bytes: int, capacity_bytes: int, segment_bytes: int) -> None:
        self.payload_bytes = payload_bytes
        self.entry_bytes = _round_up(HEADER_SIZE + payload_bytes, ALIGN)
        self.pad = self.entry_bytes - HEADER_SIZE - payload_bytes
        self.num_slots = capacity_bytes // self.entry_bytes
        self.slots_per_segment = max(1, segment_bytes // self.entry_bytes)
        self.num_segments = -(-self.num_slots // self.slots_per_segment)

    def segment_slots(self, seg: int) -> int:
        return min(self.slots_per_segment, self.num_slots - seg * self.slots_per_segment)

    def locate(self, slot: int) -> tuple[int, int]:
        seg, j = divmod(slot, self.slots_per_segment)
        return seg, j * self.entry_bytes

    def runs(self, slots: Sequence[int], order: Sequence[int]) -> list[list[int]]:
        """Split ``order`` (indices into ``slots``) into runs of consecutive slots of one segment, each small
        enough for one vectored call."""
        runs: list[list[int]] = []
        per_call = min(_IOV_MAX // 3, max(1, _RUN_BYTES // self.entry_bytes))
        run: list[int] = []
        prev = -2
        for i in order:
            slot = slots[i]
            if run and slot == prev + 1 and slot % self.slots_per_segment != 0 and len(run) < per_call:
                run.append(i)
            else:
                if run:
                    runs.append(run)
                run = [i]
            prev = slot
        if run:
            runs.append(run)
        return runs


def _advance(bufs: list[Any], n: int) -> list[Any]:
    """Drop the first ``n`` bytes of an iovec list."""
    out: list[Any] = []
    for i, b in enumerate(bufs):
        size = memoryview(b).nbytes
        if n >= size:
            n -= size
            continue
        out.append(memoryview(b).cast("B")[n:])
        out.extend(bufs[i + 1 :])
        break
    return out


def _pwritev_all(fd: int, bufs: list[Any], offset: int) -> tuple[int, OSError | None]:
    """Write every buffer at ``offset``; return bytes written and the error that stopped it (if any)."""
    total = sum(memoryview(b).nbytes for b in bufs)
    done = 0
    while done < total:
        try:
            n = os.pwritev(fd, bufs, offset + done)
        except OSError as exc:
            return done, exc
        if n <= 0:
            return done, OSError(0, "short write")
        done += n
        if done < total:
            bufs = _advance(bufs, n)
    return done, None


def _preadv_all(fd: int, bufs: list[Any], offset: int) -> tuple[int, OSError | None]:
    """Read into every buffer from ``offset``; return bytes read (short at end of file) and any error."""
    total = sum(memoryview(b).nbytes for b in bufs)
    done = 0
    while done < total:
        try:
            n = os.preadv(fd, bufs, offset + done)
        except OSError as exc:
            return done, exc
        if n <= 0:
            return done, None
        done += n
        if done < total:
            bufs = _advance(bufs, n)
    return done, None


async def _wait_thread(fut: asyncio.Future[T]) -> tuple[asyncio.Future[T], bool]:
    """Wait for a worker-thread job even if the caller is cancelled meanwhile: the thread cannot be recalled
    and may still be reading or writing the caller's buffers. Returns the future and whether a cancellation
    arrived (the caller finishes its bookkeeping, then re-raises it)."""
    cancelled = False
    while not fut.done():
        try:
            await asyncio.wait((fut,))
        except asyncio.CancelledError:
            cancelled = True
    return fut, cancelled


class _Files:
    """The open segment files of one directory (used from worker threads; no index, no loop)."""

    def __init__(
        self, geo: _Geometry, fds: list[int], fingerprint: bytes, fsync: bool, erase: bool = True
    ) -> None:
        self.geo = geo
        self.fds = fds
        self.fingerprint = fingerprint
        self.fsync = fsync
        self.erase = erase  # zero the header of an entry that fails verification (not in shared directories)
        self._pad = bytes(geo.pad)
        self._scratch = bytearray(geo.pad)
        self._probe = bytearray(1)

    def close(self) -> None:
        for fd in self.fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        self.fds = []

    # ------------------------------------------------------------------ write
    def write(
        self,
        slots: list[int],
        keys: list[bytes],
        payloads: list[memoryview],
        seqs: list[int],
        damage: list[Damage | None] | None = None,
    ) -> tuple[list[bool], OSError | None]:
        """Write entries; ``ok[i]`` tells whether entry ``i`` reached the file completely. ``damage[i]`` (fault
        injection) stores entry ``i`` with one byte flipped after its checksums were computed."""
        geo = self.geo
        ok = [False] * len(slots)
        first_error: OSError | None = None
        order = sorted(range(len(slots)), key=slots.__getitem__)
        touched: set[int] = set()
        for run in geo.runs(slots, order):
            seg, offset = geo.locate(slots[run[0]])
            bufs: list[Any] = []
            ends: list[int] = []
            pos = 0
            for k, i in enumerate(run):
                payload: Any = payloads[i]
                header = pack_header(keys[i], self.fingerprint, payload, seqs[i])
                if damage is not None and damage[i] is not None:
                    header, payload = damaged(header, payload, damage[i])  # type: ignore[arg-type]
                bufs.append(header)
                bufs.append(payload)
                pos += HEADER_SIZE + geo.payload_bytes
                ends.append(pos)
                if geo.pad and k + 1 < len(run):
                    bufs.append(self._pad)
                    pos += geo.pad
            written, err = _pwritev_all(self.fds[seg], bufs, offset)
            for k, i in enumerate(run):
                ok[i] = ends[k] <= written
            touched.add(seg)
            if err is not None and first_error is None:
                first_error = err
        if self.fsync:
            for seg in touched:
                try:
                    os.fdatasync(self.fds[seg])
                except OSError as exc:  # the entries may not be durable: drop them all
                    ok = [False] * len(slots)
                    first_error = first_error or exc
        return ok, first_error

    # ------------------------------------------------------------------- read
    def read(
        self, slots: list[int], keys: list[bytes], outs: Sequence[memoryview]
    ) -> tuple[int, Verdict | None, OSError | None]:
        """Read and verify entries in order; stop at the first that fails (its header is erased on disk).
        Returns (verified count, why the next one failed, the OSError if one occurred)."""
        geo = self.geo
        n = len(slots)
        headers = [bytearray(HEADER_SIZE) for _ in range(n)]
        runs = geo.runs(slots, range(n))  # in key order
        done = 0
        for run in runs:
            seg, offset = geo.locate(slots[run[0]])
            bufs: list[Any] = []
            ends: list[int] = []
            pos = 0
            for k, i in enumerate(run):
                bufs.append(headers[i])
                bufs.append(outs[i])
                pos += HEADER_SIZE + geo.payload_bytes
                ends.append(pos)
                if geo.pad and k + 1 < len(run):
                    bufs.append(self._scratch)
                    pos += geo.pad
            got, err = _preadv_all(self.fds[seg], bufs, offset)
            for k, i in enumerate(run):
                if ends[k] > got:
                    verdict = Verdict.WRONG_LENGTH
                else:
                    verdict = check_entry(
                        headers[i],
                        outs[i],
                        fingerprint=self.fingerprint,
                        key=keys[i],
                        payload_len=geo.payload_bytes,
                    )
                if verdict is not Verdict.OK:
                    if err is None and self.erase:
                        self._erase(slots[i])
                    return done, verdict, err
                done += 1
        return done, None, None

    def resident(self, slot: int) -> bool:
        """Whether the start of ``slot``'s entry is in the page cache (a non-blocking one-byte read)."""
        nowait = getattr(os, "RWF_NOWAIT", None)
        if nowait is None:
            return False
        seg, offset = self.geo.locate(slot)
        try:
            return os.preadv(self.fds[seg], [self._probe], offset, nowait) == 1
        except OSError:  # EAGAIN: not cached; EOPNOTSUPP: filesystem without RWF_NOWAIT
            return False

    def _erase(self, slot: int) -> None:
        seg, offset = self.geo.locate(slot)
        with contextlib.suppress(OSError):
            os.pwrite(self.fds[seg], _ZERO_HEADER, offset)


@dataclass(slots=True)
class _StorePlan:
    """The slots one store will write: ``slots[j]`` for the key at ``indices[j]`` of the batch."""

    skipped: int = 0  # keys already held (or being written)
    indices: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    reservations: list[Reservation] = field(default_factory=list)  # shared directories


@dataclass(slots=True)
class _Opened:
    """What setting up a directory produced (built on a worker thread, installed on the loop)."""

    lock_fd: int
    files: _Files
    recovered: list[tuple[int, int, bytes]]  # (seq, slot, key), oldest write first
    recovery_dropped: int
    reset: bool  # the directory held another layout: its segments were deleted
    preallocated: bool
    space_error: OSError | None  # no room met on the way (metadata or preallocation): start degraded
    meta_pending: dict[str, Any] | None  # the layout file could not be written (no room): retried later
    catalog: SharedCatalog | None = None  # shared directories

    def close(self) -> None:
        self.files.close()
        if self.catalog is not None:
            self.catalog.close()
        with contextlib.suppress(OSError):
            os.close(self.lock_fd)


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

        self._spec: TierSpec | None = None
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
        path = self.path
        try:
            path.mkdir(parents=True, exist_ok=True)
        except FileExistsError:
            raise NotADirectoryError(
                errno.ENOTDIR, f"disk tier path {str(path)!r} exists and is not a directory"
            ) from None
        except OSError as exc:
            _raise_explained(exc, path)
            raise
        try:
            lock_fd = os.open(path / LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            _raise_explained(exc, path)
            raise
        setup_fd: int | None = None  # shared: the catalog file, its flock held during the set-up
        fds: list[int] = []
        try:
            if self.shared:
                setup_fd, alone = self._lock_shared(lock_fd)
            else:
                self._lock_exclusive(lock_fd)
                alone = True
            meta = {
                "format": _META_FORMAT,
                "version": FORMAT_VERSION,
                "fingerprint": spec.fingerprint.hex(),
                "payload_bytes": spec.payload_bytes,
                "entry_bytes": geo.entry_bytes,
                "slots_per_segment": geo.slots_per_segment,
            }
            existing = self._read_meta()
            reset = False
            space_error: OSError | None = None
            meta_pending: dict[str, Any] | None = None
            if existing is None or any(existing.get(k) != v for k, v in meta.items()):
                if not alone:
                    raise TierLockedError(
                        f"disk tier directory {str(path)!r} is shared by processes using another layout "
                        f"({(existing or {}).get('description', 'unknown')}); use the same layout or another "
                        "directory"
                    )
                reset = existing is not None
                for seg_path in self._segment_paths():
                    seg_path.unlink()
                meta["block_size"] = spec.block_size
                meta["description"] = spec.description
                space_error = _write_meta(path, meta)
                if space_error is not None:
                    meta_pending = meta
            rebuild = setup_fd is not None and self._catalog_needs_rebuild(setup_fd, geo, spec, alone, reset)
            if alone:
                for seg_path in self._segment_paths():
                    number = int(seg_path.name[len(_SEGMENT_PREFIX) : -len(_SEGMENT_SUFFIX)])
                    if number >= geo.num_segments:  # capacity shrank
                        seg_path.unlink()
            recovered: dict[bytes, tuple[int, int]] = {}
            dropped = 0
            preallocated = True
            for seg in range(geo.num_segments):
                fd = os.open(path / _segment_name(seg), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
                fds.append(fd)
                size = geo.segment_slots(seg) * geo.entry_bytes
                if alone and os.fstat(fd).st_size > size:
                    os.ftruncate(fd, size)
                if setup_fd is None or rebuild:
                    dropped += _scan(fd, seg, geo, spec.fingerprint, recovered)
                allocated, err = self._allocate(fd, size)
                preallocated &= allocated
                if space_error is None and err is not None and _is_space_error(err):
                    space_error = err
            catalog: SharedCatalog | None = None
            if setup_fd is not None:
                catalog, _ = SharedCatalog.attach(
                    setup_fd,
                    geo.num_slots,
                    geo.entry_bytes,
                    spec.fingerprint,
                    rebuild=rebuild,
                    recovered=lambda: ((key, slot, seq) for key, (seq, slot) in recovered.items()),
                )
                fcntl.flock(setup_fd, fcntl.LOCK_UN)  # the set-up is done; the catalog owns the file now
                recovered = {}
        except BaseException as exc:
            for fd in fds:
                os.close(fd)
            if setup_fd is not None:
                os.close(setup_fd)
            os.close(lock_fd)
            if isinstance(exc, OSError):
                _raise_explained(exc, path)
            raise
        return _Opened(
            lock_fd=lock_fd,
            files=_Files(geo, fds, spec.fingerprint, self._fsync, erase=catalog is None),
            recovered=sorted((seq, slot, key) for key, (seq, slot) in recovered.items()),
            recovery_dropped=dropped,
            reset=reset,
            preallocated=preallocated,
            space_error=space_error,
            meta_pending=meta_pending,
            catalog=catalog,
        )

    def _lock_exclusive(self, lock_fd: int) -> None:
        """Own the directory alone (``shared=False``), or raise TierLockedError."""
        try:
            fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise TierLockedError(
                f"disk tier directory {str(self.path)!r} is already opened by another process or DiskTier"
            ) from None
        with contextlib.suppress(OSError):
            os.ftruncate(lock_fd, 0)
            os.pwrite(lock_fd, f"{os.getpid()}\n".encode(), 0)
        with contextlib.suppress(FileNotFoundError):  # a catalog left by shared use no longer describes it
            (self.path / CATALOG_NAME).unlink()

    def _lock_shared(self, lock_fd: int) -> tuple[int, bool]:
        """Join the processes sharing the directory (``shared=True``): take the set-up lock (the catalog file's
        flock; released by the caller) and a shared flock on the lock file. Returns the catalog file and
        whether no other process had the directory open (then the layout may be reset or resized)."""
        path = self.path
        setup_fd = os.open(path / CATALOG_NAME, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            deadline = time.monotonic() + _SETUP_LOCK_S
            while True:  # held for microseconds by each change: poll, bounded
                try:
                    fcntl.flock(setup_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        raise TierLockedError(
                            f"disk tier directory {str(path)!r}: its catalog stayed locked for "
                            f"{_SETUP_LOCK_S:.0f} s (a process holding it is stopped?)"
                        ) from None
                    time.sleep(0.001)
            try:
                fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                alone = True
            except BlockingIOError:
                alone = False
            try:
                fcntl.flock(lock_fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                raise TierLockedError(
                    f"disk tier directory {str(path)!r} is already opened by a process that does not share it "
                    "(a DiskTier with shared=False)"
                ) from None
        except BaseException:
            os.close(setup_fd)
            raise
        return setup_fd, alone

    def _catalog_needs_rebuild(
        self, setup_fd: int, geo: _Geometry, spec: TierSpec, alone: bool, reset: bool
    ) -> bool:
        """Whether the shared catalog must be made afresh (from the segment headers). Raises when other
        processes share a catalog of another capacity."""
        found = catalog_geometry(setup_fd)
        if found is not None and not reset:
            num_slots, _ways, entry_bytes, fingerprint = found
            if (num_slots, entry_bytes, fingerprint) == (geo.num_slots, geo.entry_bytes, spec.fingerprint):
                return False
            if not alone:
                raise InvalidArgumentError(
                    f"capacity_bytes must match the processes sharing {str(self.path)!r}: they use "
                    f"{num_slots} entries of {entry_bytes} bytes ({num_slots * entry_bytes} bytes), got "
                    f"{self.capacity_bytes} ({geo.num_slots} entries)"
                )
        return True

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

    def _read_meta(self) -> dict[str, Any] | None:
        try:
            data = json.loads((self.path / META_NAME).read_text())
        except (OSError, ValueError):
            return None
        return data if isinstance(data, dict) else None

    def _segment_paths(self) -> list[Path]:
        return sorted(
            p
            for p in self.path.iterdir()
            if p.name.startswith(_SEGMENT_PREFIX)
            and p.name.endswith(_SEGMENT_SUFFIX)
            and p.name[len(_SEGMENT_PREFIX) : -len(_SEGMENT_SUFFIX)].isdigit()
        )

    def _allocate(self, fd: int, size: int) -> tuple[bool, OSError | None]:
        """Preallocate ``fd`` to ``size`` bytes, else extend it sparsely. Returns (preallocated, the error)."""
        error: OSError | None = None
        if self._preallocate:
            try:
                os.posix_fallocate(fd, 0, size)
                return True, None
            except OSError as exc:  # no room, no fallocate support, a file-size limit
                error = exc
        try:  # sparse; stores beyond the limit will fail and be dropped
            if os.fstat(fd).st_size < size:
                os.ftruncate(fd, size)
        except OSError as exc:
            error = error or exc
        return False, error

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
        check_buffers("outs", keys, outs, self._geometry().payload_bytes)
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
            futs, cancelled = await self._run_all(
                [(files.read, (slots[a:b], pinned[a:b], outs[a:b])) for a, b in parts]
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
        checksums were computed, i.e. corrupt at rest. Returns (stored, how many of them were damaged)."""
        check_damage(damage, len(keys), self._geometry().payload_bytes)
        return await self._store(keys, payloads, list(damage))

    async def _store(
        self,
        keys: Sequence[bytes],
        payloads: Sequence[memoryview],
        damage: list[Damage | None] | None,
        tenants: Sequence[bytes | None] | None = None,
    ) -> tuple[int, int]:
        live = self._live()
        check_buffers("payloads", keys, payloads, self._geometry().payload_bytes)
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
        try:
            futs, cancelled = await self._run_all(
                [
                    (
                        files.write,
                        (slots[a:b], wkeys[a:b], wpayloads[a:b], seqs[a:b], wdamage[a:b] if damage else None),
                    )
                    for a, b in parts
                ],
                write=True,
            )
            ok: list[bool] = []
            err: OSError | None = None
            for fut in futs:
                part_ok, part_err = fut.result()
                ok += part_ok
                err = err or part_err
        except BaseException:
            await self._settle(plan, wkeys, [False] * len(wkeys))
            raise
        committed, settle_cancelled = await self._settle(plan, wkeys, ok)
        cancelled = cancelled or settle_cancelled
        stored = sum(committed)
        stored_damaged = sum(
            1 for good, dmg in zip(committed, wdamage, strict=True) if good and dmg is not None
        )
        self._c["stored_blocks"] += stored
        self._c["stored_bytes"] += stored * geo.payload_bytes
        self._c["dropped_io_error"] += len(wkeys) - sum(ok)
        if err is not None:
            self._log_io.event(
                "disk tier %r: %d of %d stores dropped: %s",
                str(self.path),
                len(wkeys) - sum(ok),
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
            reads_ahead_of_writes=self._pool.reads_ahead_of_writes
            if self._pool is not None
            else self._reads_ahead,
            **self._c,
        )


def _raise_explained(exc: OSError, path: Path) -> None:
    """Raise ``exc`` again (same type and errno) with a message that says which tier directory could not be
    used; returns when ``exc`` is a space error (handled by the caller) or carries no errno."""
    if exc.errno is None or exc.errno in SPACE_ERRNOS:
        return
    what = f"cannot use {str(path)!r} as a disk tier directory: {exc.strerror}"
    explained = type(exc)(exc.errno, what, exc.filename) if exc.filename else type(exc)(exc.errno, what)
    raise explained from exc


def _write_meta(path: Path, meta: dict[str, Any]) -> OSError | None:
    """Write the layout file atomically. Returns the error when there is no room (the file is then absent, so
    that no stale layout describes the segment files); raises any other ``OSError``."""
    tmp = path / (META_NAME + ".tmp")
    try:
        tmp.write_text(json.dumps(meta, indent=1) + "\n")
        os.replace(tmp, path / META_NAME)
    except OSError as exc:
        if not _is_space_error(exc):
            raise
        for leftover in (tmp, path / META_NAME):
            with contextlib.suppress(OSError):
                leftover.unlink()
        return exc
    return None


def _scan(fd: int, seg: int, geo: _Geometry, fingerprint: bytes, found: dict[bytes, tuple[int, int]]) -> int:
    """Add the valid headers of segment ``seg`` to ``found`` (key -> (seq, slot), the newest write wins);
    returns how many entries were dropped (torn, foreign or damaged header)."""
    size = os.fstat(fd).st_size
    base = seg * geo.slots_per_segment
    dropped = 0
    for j in range(geo.segment_slots(seg)):
        offset = j * geo.entry_bytes
        if offset >= size:
            break
        head = check_header(
            os.pread(fd, HEADER_SIZE, offset), fingerprint=fingerprint, payload_len=geo.payload_bytes
        )
        if head is Verdict.EMPTY:
            continue
        if not isinstance(head, EntryHeader) or offset + HEADER_SIZE + geo.payload_bytes > size:
            dropped += 1  # torn (truncated), foreign or damaged header
            continue
        previous = found.get(head.key)
        if previous is None or previous[0] < head.seq:
            found[head.key] = (head.seq, base + j)
    return dropped


def _restore(index: BlockIndex, entries: list[tuple[int, int, bytes]]) -> None:
    """Insert recovered ``(seq, slot, key)`` entries (sorted by seq, oldest first) at their own slots."""
    index.restore((key, slot) for _, slot, key in entries)
