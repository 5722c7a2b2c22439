"""The files of a disk tier directory, used from worker threads: the open segment files (:class:`_Files`:
entries written with one ``pwritev`` per run of slots and read back, verified, with one ``preadv``), the
layout file ``aiokv-disk.json`` (read, written atomically), and the scan of segment headers that rebuilds
the index at open. Nothing here knows of an index, a catalog or the event loop.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .._format import (
    HEADER_SIZE,
    Damage,
    EntryHeader,
    Verdict,
    check_entry,
    check_header,
    damaged,
    pack_header,
)
from ._geometry import _Geometry

__all__ = [
    "CATALOG_NAME",
    "LOCK_NAME",
    "META_NAME",
    "SPACE_ERRNOS",
    "_Files",
    "_is_space_error",
    "_read_meta",
    "_scan",
    "_segment_name",
    "_segment_paths",
    "_write_meta",
]

META_NAME = "aiokv-disk.json"
LOCK_NAME = "aiokv-disk.lock"
CATALOG_NAME = "aiokv-disk.idx"
_SEGMENT_PREFIX = "seg-"
_SEGMENT_SUFFIX = ".akv"
_META_FORMAT = "aiokv-disk"
_ZERO_HEADER = bytes(HEADER_SIZE)
# Errors that mean "no room on this filesystem" (not a misconfiguration): at open they degrade the tier.
SPACE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})


def _is_space_error(exc: BaseException) -> bool:
    return isinstance(exc, OSError) and exc.errno in SPACE_ERRNOS


def _segment_name(index: int) -> str:
    return f"{_SEGMENT_PREFIX}{index:05d}{_SEGMENT_SUFFIX}"


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


def _read_meta(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads((path / META_NAME).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _segment_paths(path: Path) -> list[Path]:
    return sorted(
        p
        for p in path.iterdir()
        if p.name.startswith(_SEGMENT_PREFIX)
        and p.name.endswith(_SEGMENT_SUFFIX)
        and p.name[len(_SEGMENT_PREFIX) : -len(_SEGMENT_SUFFIX)].isdigit()
    )


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
