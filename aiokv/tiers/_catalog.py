"""The catalog of a DiskTier directory shared by several processes (``DiskTier(..., shared=True)``).

Every process maps the same file, ``aiokv-disk.idx``, with ``MAP_SHARED``; it says what each slot of the segment
files holds. This module is the synchronous core: plain functions over that mapping that never block nor await;
:class:`~aiokv.tiers.DiskTier` takes the lock, calls them, and does the I/O.

**Placement is set-associative.** Slots are grouped into sets of about ``ways`` consecutive slots; a block can
only live in the set its hash selects, so finding it reads the keys of one set (one slice of the mapping) and
nothing else: there is no shared hash table to keep consistent, and a reader needs no lock. Eviction picks the
least recently used slot of the set (stamps are wall-clock nanoseconds, comparable across processes).

Layout (little endian)::

    0        4096 bytes   header: magic, version, num_slots, ways, entry_bytes, fingerprint, counters, checksum
    4096     32 * n       keys: the block hash each slot holds (zeros when free)
    ...      n            states: FREE 0, WRITING 1, READY 2
    ...      32 * n       records: token (u64), stamp (u64, last use), pid (u32), pid namespace (u32), 8 spare

**Concurrency.** Changes (reserve a slot, commit or abandon it, drop a corrupt entry) are made under an
exclusive ``flock`` on the catalog file, held for the few microseconds the change takes; lookups and reads
take no lock. A reader may therefore act on a record that changes under it: it then reads an entry that is
being rewritten or belongs to another block, whose verification fails (header key, payload checksum), and
the read is a miss -- never wrong bytes. Only when the record still holds the same reservation token after a
failed verification is the entry corrupt at rest (and dropped).

**Crashes.** A writer marks its slots WRITING (with its pid, a random token and the time) before writing and
READY after: a writer killed mid-store leaves WRITING slots that nobody reads, which the next writer needing
room reclaims once their pid is gone (same pid namespace) or they are older than ``stale_s``. A process killed
while holding the lock loses it (the kernel releases flocks); a half-made change is at worst a record whose
entry fails verification. The mapping survives the crash of any process (it is the file's page cache).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import mmap
import os
import random
import struct
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import xxhash

__all__ = [
    "FREE",
    "READY",
    "WRITING",
    "CatalogStats",
    "Reservation",
    "SharedCatalog",
    "catalog_bytes",
    "catalog_geometry",
]

FREE, WRITING, READY = 0, 1, 2
MAGIC = b"AKVCAT\x00\x01"
VERSION = 1
HEADER_BYTES = 4096
KEY_BYTES = 32
RECORD_BYTES = 32
DEFAULT_WAYS = 16

# magic, version, num_slots, ways, entry_bytes, fingerprint, then the checksum of those bytes
_HEAD = struct.Struct("<8sIQIQ32s")
_HEAD_CRC = struct.Struct("<Q")
_COUNTERS_AT = 256  # evictions, reclaimed (u64 each), changed under the lock
_COUNTERS = struct.Struct("<QQ")
_RECORD = struct.Struct("<QQII")  # token, stamp, pid, pid namespace
_STAMP = struct.Struct("<Q")
_FREE_BYTE = bytes([FREE])


def catalog_bytes(num_slots: int) -> int:
    """Size of the catalog file of a tier of ``num_slots`` slots."""
    return HEADER_BYTES + num_slots * (KEY_BYTES + 1 + RECORD_BYTES)


def _pid_namespace() -> int:
    try:
        return os.stat("/proc/self/ns/pid").st_ino & 0xFFFFFFFF
    except OSError:
        return 0


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: it exists, owned by another user
        return True
    return True


@dataclass(frozen=True, slots=True)
class CatalogStats:
    ready: int  # entries any process may read
    writing: int  # slots reserved by a writer (alive or not yet reclaimed)
    evictions: int  # READY entries replaced, by every process since the catalog was made
    reclaimed: int  # WRITING slots taken over from writers that died or stalled, by every process


@dataclass(frozen=True, slots=True)
class Reservation:
    """A slot reserved for ``key``; ``token`` proves it is still this writer's when it commits."""

    index: int  # position of the key in the batch
    slot: int
    token: int


class SharedCatalog:
    """The mapped catalog of ``num_slots`` slots in sets of about ``ways`` (see the module docstring).

    Create it with :meth:`attach` (which also builds a fresh catalog when needed). Methods named ``*_locked``
    must be called between :meth:`try_lock` and :meth:`unlock`; the others take no lock.
    """

    def __init__(
        self,
        fd: int,
        mm: mmap.mmap,
        num_slots: int,
        ways: int,
        *,
        stale_s: float = 60.0,
        clock_ns: Callable[[], int] = time.time_ns,
    ) -> None:
        self._fd = fd
        self._mm = mm
        self.num_slots = num_slots
        self.num_sets = max(1, num_slots // max(1, ways))
        self._keys_at = HEADER_BYTES
        self._states_at = self._keys_at + num_slots * KEY_BYTES
        self._records_at = self._states_at + num_slots
        self._stale_ns = int(stale_s * 1e9)
        self._clock_ns = clock_ns
        self._pid = os.getpid()
        self._pidns = _pid_namespace()
        self._rng = random.Random()
        self._locked = False
        self.reading: dict[int, int] = {}  # slot -> reads of this process in progress (never evicted by it)

    # -------------------------------------------------------------------------------------- lifecycle
    @classmethod
    def attach(
        cls,
        fd: int,
        num_slots: int,
        entry_bytes: int,
        fingerprint: bytes,
        *,
        ways: int = DEFAULT_WAYS,
        rebuild: bool,
        recovered: Callable[[], Iterable[tuple[bytes, int, int]]] = lambda: (),
        stale_s: float = 60.0,
    ) -> tuple[SharedCatalog, bool]:
        """Map the catalog file ``fd`` (the caller holds the lock). An existing catalog of the same geometry
        is used as it is; otherwise, or with ``rebuild``, a fresh one is made (preallocated first, so that a
        full filesystem fails here rather than with SIGBUS later) and filled with ``recovered()``: ``(key,
        slot, seq)`` of the valid entries found in the segment files, placed when their slot is in their set.
        Returns the catalog and whether it was made fresh."""
        size = catalog_bytes(num_slots)
        ways = max(1, min(ways, num_slots))
        wanted = _HEAD.pack(MAGIC, VERSION, num_slots, ways, entry_bytes, fingerprint)
        fresh = rebuild or not _valid_header(fd, wanted, size)
        if fresh:
            os.ftruncate(fd, 0)  # no stale byte survives, the header last of all
            os.posix_fallocate(fd, 0, size)
        mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        catalog = cls(fd, mm, num_slots, ways, stale_s=stale_s)
        if fresh:
            catalog._fill(recovered())
            mm[: _HEAD.size] = wanted
            _HEAD_CRC.pack_into(mm, _HEAD.size, xxhash.xxh3_64_intdigest(wanted))
            mm.flush()
        return catalog, fresh

    def _fill(self, entries: Iterable[tuple[bytes, int, int]]) -> None:
        now = self._clock_ns()
        for key, slot, seq in entries:
            lo, hi = self._bounds(key)
            if lo <= slot < hi:
                self._mm[self._key_at(slot) : self._key_at(slot) + KEY_BYTES] = key
                self._mm[self._states_at + slot] = READY
                _RECORD.pack_into(self._mm, self._record_at(slot), self._token(), min(seq, now), 0, 0)

    def close(self) -> None:
        """Unmap the catalog and close its file (releasing the lock if held)."""
        self._locked = False
        with contextlib.suppress(BufferError, ValueError):
            self._mm.close()
        with contextlib.suppress(OSError):
            os.close(self._fd)

    # ---------------------------------------------------------------------------------------- locking
    def try_lock(self) -> bool:
        """Take the exclusive lock without blocking; False when another process (or tier) holds it."""
        assert not self._locked, "the catalog lock is not reentrant"
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                return False
            raise
        self._locked = True
        return True

    def unlock(self) -> None:
        if self._locked:
            self._locked = False
            fcntl.flock(self._fd, fcntl.LOCK_UN)

    # ------------------------------------------------------------------------------ queries (no lock)
    def _bounds(self, key: bytes) -> tuple[int, int]:
        s = int.from_bytes(key[8:16], "little") % self.num_sets
        return s * self.num_slots // self.num_sets, (s + 1) * self.num_slots // self.num_sets

    def _key_at(self, slot: int) -> int:
        return self._keys_at + slot * KEY_BYTES

    def _record_at(self, slot: int) -> int:
        return self._records_at + slot * RECORD_BYTES

    def _find(self, key: bytes) -> int | None:
        """The slot whose key is ``key`` (in any state), or None."""
        lo, hi = self._bounds(key)
        keys = self._mm[self._key_at(lo) : self._key_at(hi)]
        pos = keys.find(key)
        while pos >= 0 and pos % KEY_BYTES:
            pos = keys.find(key, pos + 1)
        return None if pos < 0 else lo + pos // KEY_BYTES

    def state(self, slot: int) -> int:
        return self._mm[self._states_at + slot]

    def token(self, slot: int) -> int:
        token: int = _RECORD.unpack_from(self._mm, self._record_at(slot))[0]
        return token

    def lookup(self, key: bytes) -> tuple[int, int] | None:
        """``(slot, token)`` of ``key`` when it is READY."""
        slot = self._find(key)
        if slot is None or self.state(slot) != READY:
            return None
        return slot, self.token(slot)

    def match_prefix(self, keys: Sequence[bytes]) -> int:
        n = 0
        for key in keys:
            if self.lookup(key) is None:
                break
            n += 1
        return n

    def begin_reads(self, keys: Sequence[bytes]) -> list[tuple[int, int]]:
        """``(slot, token)`` of the leading READY ``keys``, marked as used now and as being read by this
        process (its own stores will not evict them until :meth:`end_reads`)."""
        now = _STAMP.pack(self._clock_ns())
        out: list[tuple[int, int]] = []
        for key in keys:
            found = self.lookup(key)
            if found is None:
                break
            slot = found[0]
            stamp_at = self._record_at(slot) + 8
            self._mm[stamp_at : stamp_at + 8] = now  # a racing change of the record only skews its age
            self.reading[slot] = self.reading.get(slot, 0) + 1
            out.append(found)
        return out

    def end_reads(self, slots: Iterable[int]) -> None:
        for slot in slots:
            left = self.reading[slot] - 1
            if left:
                self.reading[slot] = left
            else:
                del self.reading[slot]

    def holds(self, slot: int, key: bytes, token: int) -> bool:
        """Whether ``slot`` is still READY with ``key`` under the reservation ``token`` (after a failed
        verification: True means the entry is corrupt at rest, False that it changed under the read)."""
        at = self._key_at(slot)
        return (
            self.state(slot) == READY and self._mm[at : at + KEY_BYTES] == key and self.token(slot) == token
        )

    def stats(self) -> CatalogStats:
        states = self._mm[self._states_at : self._states_at + self.num_slots]
        evictions, reclaimed = _COUNTERS.unpack_from(self._mm, _COUNTERS_AT)
        return CatalogStats(
            ready=states.count(READY), writing=states.count(WRITING), evictions=evictions, reclaimed=reclaimed
        )

    # ------------------------------------------------------------------------------ changes (locked)
    def reserve_locked(self, keys: Sequence[bytes]) -> tuple[int, list[Reservation], int]:
        """Reserve a slot for each of ``keys`` not held yet. Returns (keys already READY or being written by a
        live writer, the reservations, keys without room: every slot of their set is being written)."""
        assert self._locked
        now = self._clock_ns()
        held = 0
        no_room = 0
        out: list[Reservation] = []
        for i, key in enumerate(keys):
            slot = self._find(key)
            if slot is not None:
                state = self.state(slot)
                if state == READY:
                    _STAMP.pack_into(self._mm, self._record_at(slot) + 8, now)
                    held += 1
                    continue
                if state == WRITING and not self._reclaimable(slot, now):
                    held += 1
                    continue
            victim = slot if slot is not None and self.state(slot) != READY else self._victim(key, now)
            if victim is None:
                no_room += 1
                continue
            self._count(evicted=self.state(victim) == READY, reclaimed=self.state(victim) == WRITING)
            token = self._token()
            self._mm[self._states_at + victim] = WRITING
            _RECORD.pack_into(self._mm, self._record_at(victim), token, now, self._pid, self._pidns)
            self._mm[self._key_at(victim) : self._key_at(victim) + KEY_BYTES] = key
            out.append(Reservation(i, victim, token))
        return held, out, no_room

    def _victim(self, key: bytes, now: int) -> int | None:
        """A FREE slot of ``key``'s set, else one whose writer is gone, else the least recently used READY
        slot that this process is not reading."""
        lo, hi = self._bounds(key)
        states = self._mm[self._states_at + lo : self._states_at + hi]
        free = states.find(_FREE_BYTE)
        if free >= 0:
            return lo + free
        oldest: tuple[int, int] | None = None
        for j, state in enumerate(states):
            slot = lo + j
            if state == WRITING:
                if self._reclaimable(slot, now):
                    return slot
            elif slot not in self.reading:
                stamp = _STAMP.unpack_from(self._mm, self._record_at(slot) + 8)[0]
                if oldest is None or stamp < oldest[0]:
                    oldest = (stamp, slot)
        return None if oldest is None else oldest[1]

    def _reclaimable(self, slot: int, now: int) -> bool:
        """A WRITING slot whose writer died (same pid namespace) or has held it longer than ``stale_s``."""
        _token, stamp, pid, pidns = _RECORD.unpack_from(self._mm, self._record_at(slot))
        if now - stamp > self._stale_ns:
            return True
        if pid == self._pid and pidns == self._pidns:
            return False  # one of this process's stores in flight
        return pidns == self._pidns and not _alive(pid)

    def commit_locked(self, reservations: Sequence[Reservation], ok: Sequence[bool]) -> list[bool]:
        """Make the written slots READY and free the failed ones. Returns, per reservation, whether it became
        READY (False also when another process reclaimed the slot meanwhile: the entry is then lost)."""
        assert self._locked
        now = self._clock_ns()
        out: list[bool] = []
        for res, good in zip(reservations, ok, strict=True):
            if self.state(res.slot) != WRITING or self.token(res.slot) != res.token:
                out.append(False)
                continue
            if good:
                _STAMP.pack_into(self._mm, self._record_at(res.slot) + 8, now)
                self._mm[self._states_at + res.slot] = READY
            else:
                self._free(res.slot)
            out.append(good)
        return out

    def drop_locked(self, slot: int, key: bytes, token: int) -> bool:
        """Free ``slot`` if it still holds ``key`` under ``token`` (a corrupt entry). Whether it was freed."""
        assert self._locked
        if not self.holds(slot, key, token):
            return False
        self._free(slot)
        return True

    def _free(self, slot: int) -> None:
        self._mm[self._states_at + slot] = FREE
        self._mm[self._key_at(slot) : self._key_at(slot) + KEY_BYTES] = bytes(KEY_BYTES)

    def _count(self, *, evicted: bool, reclaimed: bool) -> None:
        if evicted or reclaimed:
            evictions, total = _COUNTERS.unpack_from(self._mm, _COUNTERS_AT)
            _COUNTERS.pack_into(self._mm, _COUNTERS_AT, evictions + evicted, total + reclaimed)

    def _token(self) -> int:
        return self._rng.getrandbits(64) or 1


def catalog_geometry(fd: int) -> tuple[int, int, int, bytes] | None:
    """``(num_slots, ways, entry_bytes, fingerprint)`` of the complete catalog in file ``fd``, or None."""
    try:
        head = os.pread(fd, _HEAD.size + _HEAD_CRC.size, 0)
        size = os.fstat(fd).st_size
    except OSError:
        return None
    if len(head) != _HEAD.size + _HEAD_CRC.size:
        return None
    magic, version, num_slots, ways, entry_bytes, fingerprint = _HEAD.unpack_from(head)
    if magic != MAGIC or version != VERSION or size != catalog_bytes(num_slots):
        return None
    if _HEAD_CRC.unpack_from(head, _HEAD.size)[0] != xxhash.xxh3_64_intdigest(head[: _HEAD.size]):
        return None
    return num_slots, ways, entry_bytes, fingerprint


def _valid_header(fd: int, wanted: bytes, size: int) -> bool:
    """Whether the catalog file holds a complete catalog of exactly this geometry."""
    try:
        if os.fstat(fd).st_size != size:
            return False
        head = os.pread(fd, _HEAD.size + _HEAD_CRC.size, 0)
    except OSError:
        return False
    if len(head) != _HEAD.size + _HEAD_CRC.size or head[: _HEAD.size] != wanted:
        return False
    return bool(_HEAD_CRC.unpack_from(head, _HEAD.size)[0] == xxhash.xxh3_64_intdigest(wanted))
