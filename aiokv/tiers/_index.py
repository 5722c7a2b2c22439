"""The block index of a slot-based tier: hash -> slot, entry states, pins and eviction.

This is the synchronous core shared by :class:`~aiokv.CPUTier` and by ``aiokv replay``: every method is a
plain function that never awaits, so each call is atomic with respect to the event loop. Rules:

- A stored block starts ``PENDING`` (its copy is in flight, it is invisible to lookups and cannot be evicted),
  becomes ``READY`` on :meth:`commit` or disappears on :meth:`discard` (failed copy).
- ``READY`` entries are visible; they are evictable unless pinned (a load or a write-through reads them).
- Eviction happens only inside :meth:`reserve`, takes the policy's first unpinned candidate, and removes the
  entry from the map, the policy and the slot table in one step.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from ._policies import EvictionPolicy

__all__ = ["BlockIndex", "EntryState", "IndexStats"]


class EntryState(enum.Enum):
    PENDING = "pending"
    READY = "ready"


class _Entry:
    __slots__ = ("depth", "parent", "pins", "slot", "state")

    def __init__(self, slot: int, parent: bytes | None, depth: int) -> None:
        self.slot = slot
        self.state = EntryState.PENDING
        self.pins = 0
        self.parent = parent
        self.depth = depth


@dataclass(frozen=True, slots=True)
class IndexStats:
    num_slots: int
    used_slots: int
    ready: int
    pending: int
    pinned: int
    evictions: int
    rejected: int  # reserve() calls that found no evictable slot


class BlockIndex:
    """Maps block hashes to slots ``0..num_slots-1`` of a fixed-size tier."""

    __slots__ = (
        "_entries",
        "_evictions",
        "_free",
        "_pending",
        "_pinned",
        "_rejected",
        "num_slots",
        "on_evict",
        "policy",
    )

    def __init__(self, num_slots: int, policy: EvictionPolicy) -> None:
        self.num_slots = num_slots
        self.policy = policy
        self._entries: dict[bytes, _Entry] = {}
        # Hand out low slots first (pop from the end of a descending list): fresh tiers fill contiguously.
        self._free: list[int] = list(range(num_slots - 1, -1, -1))
        self._evictions = 0
        self._rejected = 0
        self._pinned = 0
        self._pending = 0
        self.on_evict: list[bytes] | None = None  # when a list, evicted keys are appended to it

    # ----------------------------------------------------------------- queries
    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        entry = self._entries.get(key)  # type: ignore[call-overload]
        return entry is not None and entry.state is EntryState.READY

    def state(self, key: bytes) -> EntryState | None:
        entry = self._entries.get(key)
        return None if entry is None else entry.state

    def slot(self, key: bytes) -> int:
        return self._entries[key].slot

    def pins(self, key: bytes) -> int:
        entry = self._entries.get(key)
        return 0 if entry is None else entry.pins

    def match_prefix(self, keys: Sequence[bytes]) -> int:
        """Number of leading ``keys`` that are READY. No side effects."""
        entries = self._entries
        n = 0
        for key in keys:
            entry = entries.get(key)
            if entry is None or entry.state is not EntryState.READY:
                break
            n += 1
        return n

    def free_slots(self) -> int:
        return len(self._free)

    # ------------------------------------------------------------ lookup / pins
    def pin_prefix(self, keys: Sequence[bytes]) -> list[int]:
        """Pin and touch the leading READY ``keys``; return their slots (the length is the hit count)."""
        entries = self._entries
        policy = self.policy
        slots: list[int] = []
        for key in keys:
            entry = entries.get(key)
            if entry is None or entry.state is not EntryState.READY:
                break
            if entry.pins == 0:
                self._pinned += 1
            entry.pins += 1
            policy.touch(key)
            slots.append(entry.slot)
        return slots

    def pin(self, key: bytes) -> int:
        """Pin one READY entry (e.g. for a write-through read of its slot); return its slot."""
        entry = self._entries[key]
        if entry.state is not EntryState.READY:
            raise KeyError(key)
        if entry.pins == 0:
            self._pinned += 1
        entry.pins += 1
        return entry.slot

    def unpin(self, keys: Iterable[bytes]) -> None:
        entries = self._entries
        for key in keys:
            entry = entries[key]
            assert entry.pins > 0, "unpin of an unpinned entry"
            entry.pins -= 1
            if entry.pins == 0:
                self._pinned -= 1

    def touch(self, key: bytes) -> None:
        if key in self._entries:
            self.policy.touch(key)

    # -------------------------------------------------------------- store path
    def reserve(self, key: bytes, parent: bytes | None = None, depth: int = 0) -> int | None:
        """Allocate a slot for a new PENDING entry, evicting if needed.

        Returns ``None`` when ``key`` is already present (it is touched instead) or when every slot is pending
        or pinned ("no room now" is a value, not an exception).
        """
        entries = self._entries
        if key in entries:
            self.policy.touch(key)
            return None
        free = self._free
        if not free and not self._evict_one():
            self._rejected += 1
            return None
        slot = free.pop()
        entries[key] = _Entry(slot, parent, depth)
        self._pending += 1
        return slot

    def commit(self, key: bytes) -> None:
        """PENDING -> READY: the entry's copy completed; it becomes visible and evictable."""
        entry = self._entries[key]
        assert entry.state is EntryState.PENDING, "commit of a non-pending entry"
        entry.state = EntryState.READY
        self._pending -= 1
        self.policy.insert(key, entry.parent, entry.depth)

    def insert_ready(self, key: bytes, parent: bytes | None = None, depth: int = 0) -> int | None:
        """reserve + commit in one call (for replay and for tiers whose writes are synchronous)."""
        slot = self.reserve(key, parent, depth)
        if slot is not None:
            self.commit(key)
        return slot

    def discard(self, key: bytes) -> bool:
        """Remove an entry that is not pinned (a failed copy, a corrupt read). Returns whether it was present."""
        entry = self._entries.get(key)
        if entry is None:
            return False
        assert entry.pins == 0, "discard of a pinned entry"
        del self._entries[key]
        if entry.state is EntryState.READY:
            self.policy.remove(key, evicted=False)
        else:
            self._pending -= 1
        self._free.append(entry.slot)
        return True

    def _evict_one(self) -> bool:
        entries = self._entries
        victim: bytes | None = None
        for key in self.policy.candidates():
            if entries[key].pins == 0:
                victim = key
                break
        if victim is None:
            return False
        entry = entries.pop(victim)
        self.policy.remove(victim, evicted=True)
        self._free.append(entry.slot)
        self._evictions += 1
        if self.on_evict is not None:
            self.on_evict.append(victim)
        return True

    # ------------------------------------------------------- whole-chain fast path (replay)
    def touch_prefix(self, keys: Sequence[bytes], start: int = 0) -> int:
        """Touch the READY keys that ``keys[start:]`` leads with and return how many: a lookup that pins
        nothing, for callers that use the blocks at once (``aiokv replay``). The policy sees the same calls as
        for :meth:`pin_prefix`."""
        entries = self._entries
        touch = self.policy.touch
        ready = EntryState.READY
        n = 0
        for i in range(start, len(keys)):
            key = keys[i]
            entry = entries.get(key)
            if entry is None or entry.state is not ready:
                break
            touch(key)
            n += 1
        return n

    def insert_chain(self, keys: Sequence[bytes], start: int = 0) -> int:
        """:meth:`insert_ready` ``(keys[i], parent=keys[i - 1], depth=i)`` for each ``i >= start``, head first;
        return how many keys were inserted. Present keys are touched; a key that finds no room is skipped."""
        reserve = self.reserve
        commit = self.commit
        parent = keys[start - 1] if start > 0 else None
        inserted = 0
        for i in range(start, len(keys)):
            key = keys[i]
            if reserve(key, parent, i) is not None:
                commit(key)
                inserted += 1
            parent = key
        return inserted

    def stats(self) -> IndexStats:
        pending = self._pending
        return IndexStats(
            num_slots=self.num_slots,
            used_slots=self.num_slots - len(self._free),
            ready=len(self._entries) - pending,
            pending=pending,
            pinned=self._pinned,
            evictions=self._evictions,
            rejected=self._rejected,
        )

    def check_invariants(self) -> None:
        """Expensive consistency check for tests."""
        used = {e.slot for e in self._entries.values()}
        assert len(used) == len(self._entries), "two entries share a slot"
        assert not used & set(self._free), "a used slot is on the free list"
        assert len(used) + len(self._free) == self.num_slots, "slot leak"
        ready = {k for k, e in self._entries.items() if e.state is EntryState.READY}
        assert set(self.policy.candidates()) == ready, "policy out of sync with ready entries"
        assert self._pinned == sum(1 for e in self._entries.values() if e.pins > 0)
        assert self._pending == len(self._entries) - len(ready)
