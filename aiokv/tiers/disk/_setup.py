"""Setting a disk tier directory up (on a worker thread, at open and on each retry of a tier that is down):
lock it (alone, or shared with other processes through the catalog file's set-up lock), check its layout
file and start fresh when it describes another layout, open and allocate the segment files, scan their
headers (or attach the shared catalog), and hand what it found over as an :class:`_Opened`.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..._errors import InvalidArgumentError, TierLockedError
from .._base import TierSpec
from .._catalog import SharedCatalog, catalog_geometry
from .._format import FORMAT_VERSION
from .._index import BlockIndex
from ._files import (
    _META_FORMAT,
    _SEGMENT_PREFIX,
    _SEGMENT_SUFFIX,
    CATALOG_NAME,
    LOCK_NAME,
    SPACE_ERRNOS,
    _Files,
    _is_space_error,
    _read_meta,
    _scan,
    _segment_name,
    _segment_paths,
    _write_meta,
)
from ._geometry import _Geometry

__all__ = ["_Opened", "_open_directory", "_restore"]

# Shared directories: how long set-up at open waits for the catalog lock (held for microseconds by each
# change).
_SETUP_LOCK_S = 30.0


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


def _open_directory(
    path: Path,
    spec: TierSpec,
    geo: _Geometry,
    *,
    shared: bool,
    capacity_bytes: int,
    preallocate: bool,
    fsync: bool,
) -> _Opened:
    """Set up the directory ``path`` of a DiskTier with these options (worker thread; changes no tier: the
    caller installs what it returns, see ``DiskTier._open_sync``)."""
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
        if shared:
            setup_fd, alone = _lock_shared(path, lock_fd)
        else:
            _lock_exclusive(path, lock_fd)
            alone = True
        meta = {
            "format": _META_FORMAT,
            "version": FORMAT_VERSION,
            "fingerprint": spec.fingerprint.hex(),
            "payload_bytes": spec.payload_bytes,
            "entry_bytes": geo.entry_bytes,
            "slots_per_segment": geo.slots_per_segment,
        }
        existing = _read_meta(path)
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
            for seg_path in _segment_paths(path):
                seg_path.unlink()
            meta["block_size"] = spec.block_size
            meta["description"] = spec.description
            space_error = _write_meta(path, meta)
            if space_error is not None:
                meta_pending = meta
        rebuild = setup_fd is not None and _catalog_needs_rebuild(
            path, capacity_bytes, setup_fd, geo, spec, alone, reset
        )
        if alone:
            for seg_path in _segment_paths(path):
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
            allocated, err = _allocate(fd, size, preallocate)
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
        files=_Files(geo, fds, spec.fingerprint, fsync, erase=catalog is None),
        recovered=sorted((seq, slot, key) for key, (seq, slot) in recovered.items()),
        recovery_dropped=dropped,
        reset=reset,
        preallocated=preallocated,
        space_error=space_error,
        meta_pending=meta_pending,
        catalog=catalog,
    )


def _lock_exclusive(path: Path, lock_fd: int) -> None:
    """Own the directory alone (``shared=False``), or raise TierLockedError."""
    try:
        fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise TierLockedError(
            f"disk tier directory {str(path)!r} is already opened by another process or DiskTier"
        ) from None
    with contextlib.suppress(OSError):
        os.ftruncate(lock_fd, 0)
        os.pwrite(lock_fd, f"{os.getpid()}\n".encode(), 0)
    with contextlib.suppress(FileNotFoundError):  # a catalog left by shared use no longer describes it
        (path / CATALOG_NAME).unlink()


def _lock_shared(path: Path, lock_fd: int) -> tuple[int, bool]:
    """Join the processes sharing the directory (``shared=True``): take the set-up lock (the catalog file's
    flock; released by the caller) and a shared flock on the lock file. Returns the catalog file and
    whether no other process had the directory open (then the layout may be reset or resized)."""
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
    path: Path, capacity_bytes: int, setup_fd: int, geo: _Geometry, spec: TierSpec, alone: bool, reset: bool
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
                f"capacity_bytes must match the processes sharing {str(path)!r}: they use "
                f"{num_slots} entries of {entry_bytes} bytes ({num_slots * entry_bytes} bytes), got "
                f"{capacity_bytes} ({geo.num_slots} entries)"
            )
    return True


def _allocate(fd: int, size: int, preallocate: bool) -> tuple[bool, OSError | None]:
    """Preallocate ``fd`` to ``size`` bytes, else extend it sparsely. Returns (preallocated, the error)."""
    error: OSError | None = None
    if preallocate:
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


def _raise_explained(exc: OSError, path: Path) -> None:
    """Raise ``exc`` again (same type and errno) with a message that says which tier directory could not be
    used; returns when ``exc`` is a space error (handled by the caller) or carries no errno."""
    if exc.errno is None or exc.errno in SPACE_ERRNOS:
        return
    what = f"cannot use {str(path)!r} as a disk tier directory: {exc.strerror}"
    explained = type(exc)(exc.errno, what, exc.filename) if exc.filename else type(exc)(exc.errno, what)
    raise explained from exc


def _restore(index: BlockIndex, entries: list[tuple[int, int, bytes]]) -> None:
    """Insert recovered ``(seq, slot, key)`` entries (sorted by seq, oldest first) at their own slots."""
    index.restore((key, slot) for _, slot, key in entries)
