"""A persistent, crash-consistent disk tier: fixed-size entries in preallocated segment files.

Layout of the directory (one tier per directory, guarded by ``flock`` on ``aiokv-disk.lock``)::

    aiokv-disk.lock     lock file (holds the owner's pid, for humans)
    aiokv-disk.json     layout: format version, fingerprint, payload_bytes, entry_bytes, slots_per_segment
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
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from .._errors import CapacityError, ClosedError, InvalidArgumentError, InvalidTypeError, TierLockedError
from .._log import Throttled, get_logger
from ._base import BackingTier, TierSpec, check_buffers
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
from ._index import BlockIndex
from ._policies import EvictionPolicy, make_policy

__all__ = ["DiskTier", "DiskTierStats"]

ALIGN = 4096
META_NAME = "aiokv-disk.json"
LOCK_NAME = "aiokv-disk.lock"
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
    reset: bool  # the directory held another layout and was started fresh
    preallocated: bool  # segment files were fully allocated on open (else sparse: writes may hit ENOSPC)
    last_error: str | None


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

    def __init__(self, geo: _Geometry, fds: list[int], fingerprint: bytes, fsync: bool) -> None:
        self.geo = geo
        self.fds = fds
        self.fingerprint = fingerprint
        self.fsync = fsync
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
                    if err is None:
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

    def close(self) -> None:
        self.files.close()
        with contextlib.suppress(OSError):
            os.close(self.lock_fd)


class DiskTier(BackingTier):
    """Persistent tier of fixed-size entries in preallocated segment files under ``path``.

    ``capacity_bytes`` bounds the segment files' total size (entries are ``entry_bytes`` each, see
    :attr:`DiskTierStats.entry_bytes`); when full, the ``eviction`` policy picks the victim. ``segment_bytes``
    is the size of one segment file, ``io_threads`` the number of I/O threads. ``preallocate`` allocates the
    segment files on open (``posix_fallocate``; falls back to sparse files when the filesystem refuses), so
    that stores cannot hit ENOSPC later. ``fsync=True`` makes every stored entry durable before it becomes
    visible (slower). Only one process (one ``DiskTier``) may open a directory at a time.
    """

    name = "disk"

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
        self.path = Path(path)
        self.capacity_bytes = capacity_bytes
        self._eviction = eviction
        self._segment_bytes = segment_bytes
        self._io_threads = io_threads
        self._preallocate = preallocate
        self._fsync = fsync

        self._spec: TierSpec | None = None
        self._geo: _Geometry | None = None
        self._files: _Files | None = None
        self._index: BlockIndex | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._lock_fd: int | None = None
        self._opened = False
        self._closed = False
        self._inflight: set[asyncio.Future[Any]] = set()
        self._seq = 1
        self._health = TierHealth.UP
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
            ),
            0,
        )
        self._init_degraded_state()

    def _init_degraded_state(self) -> None:
        """State of the failure paths: the set-up retried while down, the layout file still to write, logs."""
        self._clock: Callable[[], float] = time.monotonic  # times the set-up retries; replaced by tests
        self._spare_index: BlockIndex | None = None  # the index to install once a retried set-up succeeds
        self._retry_at = 0.0
        self._retry_backoff = _REOPEN_BACKOFF_S
        self._probing = False
        self._meta_pending: dict[str, Any] | None = None
        where = f"disk tier {str(self.path)!r}"
        self._log_degraded = Throttled(_log, logging.WARNING, f"{where}: degraded again")
        self._log_up = Throttled(_log, logging.INFO, f"{where}: up again")
        self._log_corrupt = Throttled(_log, logging.WARNING, f"{where}: corrupt entries dropped")
        self._log_io = Throttled(_log, logging.WARNING, f"{where}: failed I/O")

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open" if self._opened else "new"
        entries = len(self._index) if self._index is not None else 0
        return f"<DiskTier {str(self.path)!r} {state} health={self._health.value} entries={entries}>"

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
        self._pool = ThreadPoolExecutor(max_workers=self._io_threads, thread_name_prefix="aiokv-disk")
        if exc is None:
            self._install(fut.result(), index)
            return
        self._spare_index = index  # never used: installed as it is once a retried set-up succeeds
        self._retry_at = self._clock() + self._retry_backoff
        self._set_health(TierHealth.DOWN, exc)

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
        try:
            fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(lock_fd)
            raise TierLockedError(
                f"disk tier directory {str(path)!r} is already opened by another process or DiskTier"
            ) from None
        fds: list[int] = []
        try:
            with contextlib.suppress(OSError):
                os.ftruncate(lock_fd, 0)
                os.pwrite(lock_fd, f"{os.getpid()}\n".encode(), 0)
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
                reset = existing is not None
                for seg_path in self._segment_paths():
                    seg_path.unlink()
                meta["block_size"] = spec.block_size
                meta["description"] = spec.description
                space_error = _write_meta(path, meta)
                if space_error is not None:
                    meta_pending = meta
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
                if os.fstat(fd).st_size > size:
                    os.ftruncate(fd, size)
                dropped += _scan(fd, seg, geo, spec.fingerprint, recovered)
                allocated, err = self._allocate(fd, size)
                preallocated &= allocated
                if space_error is None and err is not None and _is_space_error(err):
                    space_error = err
        except BaseException as exc:
            for fd in fds:
                os.close(fd)
            os.close(lock_fd)
            if isinstance(exc, OSError):
                _raise_explained(exc, path)
            raise
        return _Opened(
            lock_fd=lock_fd,
            files=_Files(geo, fds, spec.fingerprint, self._fsync),
            recovered=sorted((seq, slot, key) for key, (seq, slot) in recovered.items()),
            recovery_dropped=dropped,
            reset=reset,
            preallocated=preallocated,
            space_error=space_error,
            meta_pending=meta_pending,
        )

    def _install(self, opened: _Opened, index: BlockIndex) -> None:
        """Make a set-up directory the tier's storage (on the loop, between two calls)."""
        _restore(index, opened.recovered)
        self._index = index
        self._files = opened.files
        self._lock_fd = opened.lock_fd
        self._seq = max((seq for seq, _, _ in opened.recovered), default=0) + 1
        self._c["recovered"] += len(opened.recovered)
        self._c["recovery_dropped"] += opened.recovery_dropped
        self._reset = opened.reset
        self._preallocated = opened.preallocated
        self._meta_pending = opened.meta_pending
        where = str(self.path)
        if opened.reset:
            _log.info("disk tier %r held another layout: started fresh (old segment files deleted)", where)
        if opened.recovered or opened.recovery_dropped:
            _log.info(
                "disk tier %r: recovered %d entries, dropped %d (torn, foreign or damaged)",
                where,
                len(opened.recovered),
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
        if opened.space_error is not None:
            self._set_health(TierHealth.DEGRADED, opened.space_error)
        elif self._health is not TierHealth.UP:
            self._set_health(TierHealth.UP)

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
        for throttle in (self._log_degraded, self._log_up, self._log_corrupt, self._log_io):
            throttle.flush()
        if cancelled:
            raise asyncio.CancelledError

    def _release(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False)
            self._pool = None
        if self._files is not None:
            self._files.close()
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

    def _live(self) -> tuple[BlockIndex, _Files, _Geometry] | None:
        """The tier's storage, or None while it is down (its directory could not be set up)."""
        geo = self._geometry()
        if self._index is None or self._files is None:
            return None
        return self._index, self._files, geo

    def _submit(self, fn: Callable[..., T], *args: Any) -> asyncio.Future[T]:
        assert self._pool is not None
        fut = asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)
        self._inflight.add(fut)
        fut.add_done_callback(self._inflight.discard)
        return fut

    def _split(self, n: int, payload_bytes: int) -> list[tuple[int, int]]:
        """Cut ``n`` entries into up to ``io_threads`` contiguous parts of at least ``_SPLIT_BYTES`` each."""
        parts = max(1, min(self._io_threads, n, n * payload_bytes // _SPLIT_BYTES))
        bounds = [n * k // parts for k in range(parts + 1)]
        return [(bounds[k], bounds[k + 1]) for k in range(parts)]

    async def _run_all(
        self, calls: list[tuple[Callable[..., T], tuple[Any, ...]]]
    ) -> tuple[list[asyncio.Future[T]], bool]:
        """Run jobs on the I/O threads in parallel; wait for all of them even when cancelled."""
        futs = [self._submit(fn, *args) for fn, args in calls]
        cancelled = False
        for fut in futs:
            _, was_cancelled = await _wait_thread(fut)
            cancelled = cancelled or was_cancelled
        errors = [exc for exc in (fut.exception() for fut in futs) if exc is not None]  # retrieves them all
        if errors:
            raise errors[0]
        return futs, cancelled

    # ---------------------------------------------------------------- health
    def _set_health(self, health: TierHealth, error: BaseException | None = None) -> None:
        """Record the health (and the error that changed it), logging transitions."""
        if error is not None:
            self._last_error = _describe(error)
        previous, self._health = self._health, health
        if health is previous:
            return
        where = str(self.path)
        if health is TierHealth.UP:
            self._log_up.event("disk tier %r is up again (was %s)", where, previous.value)
        elif health is TierHealth.DEGRADED:
            self._log_degraded.event("disk tier %r degraded: %s", where, self._last_error)
        else:
            _log.warning(
                "disk tier %r is down: cannot set up the directory (%s); lookups miss and stores are "
                "dropped until a retry (on a store, after %.0f s or more) succeeds",
                where,
                self._last_error,
                self._retry_backoff,
            )

    def _io_failed(self, exc: OSError) -> None:
        self._set_health(TierHealth.DEGRADED, exc)

    async def _retry_setup(self) -> tuple[BlockIndex, _Files, _Geometry] | None:
        """While down: set the directory up again, at most once per backoff interval and one caller at a time.
        Returns the storage when it worked. Never raises but cancellation (delivered after the attempt)."""
        if self._probing or self._clock() < self._retry_at:
            return None
        assert self._spec is not None
        assert self._geo is not None
        assert self._spare_index is not None
        self._probing = True
        try:
            fut, cancelled = await _wait_thread(self._submit(self._open_sync, self._spec, self._geo))
        finally:
            self._probing = False
        exc = fut.exception()
        if self._closed:  # aclose() ran meanwhile: it released what the tier held, not this
            if exc is None:
                fut.result().close()
        elif exc is None:
            index, self._spare_index = self._spare_index, None
            self._install(fut.result(), index)
        else:
            self._retry_backoff = min(self._retry_backoff * 2, _REOPEN_BACKOFF_MAX_S)
            self._retry_at = self._clock() + self._retry_backoff
            self._last_error = _describe(exc)
            self._log_io.event(
                "disk tier %r is still down: %s (next retry in %.0f s)",
                str(self.path),
                self._last_error,
                self._retry_backoff,
            )
        if cancelled:
            raise asyncio.CancelledError
        return self._live() if exc is None and not self._closed else None

    async def _write_pending_meta(self, meta: dict[str, Any]) -> bool:
        """After a successful store: write the layout file that there was no room for at open. Returns whether
        a cancellation arrived meanwhile (delivered by the caller)."""
        fut, cancelled = await _wait_thread(self._submit(_write_meta, self.path, meta))
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
        n = live[0].match_prefix(keys)
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
        index, files, geo = live
        slots = index.pin_prefix(keys)
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
            index.unpin(pinned)
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
            bad = pinned[a + n_ok]
            if err is not None:
                self._c["read_errors"] += 1
                self._log_io.event(
                    "disk tier %r: reading entry %s failed, dropped: %s",
                    str(self.path),
                    bad.hex()[:16],
                    _describe(err),
                )
                self._io_failed(err)
            else:
                self._c["corrupt"] += 1
                self._log_corrupt.event(
                    "disk tier %r: entry %s failed verification (%s), dropped",
                    str(self.path),
                    bad.hex()[:16],
                    verdict.value,
                )
            if index.pins(bad) == 0:
                index.discard(bad)
        if done < len(keys):
            self._c["read_misses"] += 1
        if done and not failed:
            self._set_health(TierHealth.UP)
        self._c["read_blocks"] += done
        self._c["read_bytes"] += done * geo.payload_bytes
        if cancelled:
            raise asyncio.CancelledError
        return done

    async def write(self, keys: Sequence[bytes], payloads: Sequence[memoryview]) -> int:
        stored, _ = await self._store(keys, payloads, None)
        return stored

    async def _write_damaged(
        self, keys: Sequence[bytes], payloads: Sequence[memoryview], damage: Sequence[Damage | None]
    ) -> tuple[int, int]:
        """Fault injection hook (used by :class:`~aiokv.tiers.FaultyTier` only): ``write``, except that entry
        ``i`` is stored with the :data:`~aiokv.tiers._format.Damage` ``damage[i]`` applied after its
        checksums were computed, i.e. corrupt at rest. Returns (stored, how many of them were damaged)."""
        check_damage(damage, len(keys), self._geometry().payload_bytes)
        return await self._store(keys, payloads, list(damage))

    async def _store(
        self, keys: Sequence[bytes], payloads: Sequence[memoryview], damage: list[Damage | None] | None
    ) -> tuple[int, int]:
        live = self._live()
        check_buffers("payloads", keys, payloads, self._geometry().payload_bytes)
        self._c["writes"] += 1
        if live is None:
            live = await self._retry_setup()
            if live is None:
                self._c["dropped_down"] += len(keys)
                return 0, 0
        index, files, geo = live
        slots: list[int] = []
        wkeys: list[bytes] = []
        wpayloads: list[memoryview] = []
        wdamage: list[Damage | None] = []
        seqs: list[int] = []
        skipped = 0
        for i, (key, payload) in enumerate(zip(keys, payloads, strict=True)):
            if index.state(key) is not None:
                index.touch(key)
                skipped += 1
                continue
            slot = index.reserve(key)
            if slot is None:
                self._c["dropped_no_room"] += 1
                continue
            slots.append(slot)
            wkeys.append(key)
            wpayloads.append(payload)
            wdamage.append(damage[i] if damage is not None else None)
            seqs.append(self._seq)
            self._seq += 1
        self._c["skipped_existing"] += skipped
        if not slots:
            return skipped, 0
        parts = self._split(len(slots), geo.payload_bytes)
        try:
            futs, cancelled = await self._run_all(
                [
                    (
                        files.write,
                        (slots[a:b], wkeys[a:b], wpayloads[a:b], seqs[a:b], wdamage[a:b] if damage else None),
                    )
                    for a, b in parts
                ]
            )
            ok: list[bool] = []
            err: OSError | None = None
            for fut in futs:
                part_ok, part_err = fut.result()
                ok += part_ok
                err = err or part_err
        except BaseException:
            for key in wkeys:
                index.discard(key)
            raise
        stored = 0
        stored_damaged = 0
        for key, good, dmg in zip(wkeys, ok, wdamage, strict=True):
            if good:
                index.commit(key)
                stored += 1
                stored_damaged += dmg is not None
            else:
                index.discard(key)
        self._c["stored_blocks"] += stored
        self._c["stored_bytes"] += stored * geo.payload_bytes
        self._c["dropped_io_error"] += len(wkeys) - stored
        if err is not None:
            self._log_io.event(
                "disk tier %r: %d of %d stores dropped: %s",
                str(self.path),
                len(wkeys) - stored,
                len(wkeys),
                _describe(err),
            )
            self._io_failed(err)
        elif stored:
            self._set_health(TierHealth.UP)
            if self._meta_pending is not None and not self._closed:
                cancelled = await self._write_pending_meta(self._meta_pending) or cancelled
        if cancelled:
            raise asyncio.CancelledError
        return skipped + stored, stored_damaged

    def stats(self) -> DiskTierStats:
        index_stats = self._index.stats() if self._index is not None else None
        geo = self._geo
        return DiskTierStats(
            health=self._health,
            path=str(self.path),
            capacity_bytes=self.capacity_bytes,
            entry_bytes=geo.entry_bytes if geo is not None else 0,
            num_slots=geo.num_slots if geo is not None else 0,
            entries=index_stats.ready if index_stats else 0,
            pending=index_stats.pending if index_stats else 0,
            pinned=index_stats.pinned if index_stats else 0,
            evictions=index_stats.evictions if index_stats else 0,
            reset=self._reset,
            preallocated=self._preallocated,
            last_error=self._last_error,
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
