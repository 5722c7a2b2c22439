"""The block index of a slot-based tier: hash -> slot, entry states, pins and eviction.

This is the synchronous core shared by :class:`~aiokv.CPUTier` and by ``aiokv replay``: every method is a
plain function that never awaits, so each call is atomic with respect to the event loop. Rules:

- A stored block starts ``PENDING`` (its copy is in flight, it is invisible to lookups and cannot be evicted),
  becomes ``READY`` on :meth:`commit` or disappears on :meth:`discard` (failed copy).
- ``READY`` entries are visible; they are evictable unless pinned (a load or a write-through reads them).
- Eviction happens only inside :meth:`reserve` (and :meth:`insert_chain`, a reserve + commit per key), takes
  the policy's first unpinned candidate, and removes the entry from the map, the policy and the slot table in
  one step.

Fast paths, each the same sequence of policy operations as the plain per-key code (``aiokv replay`` runs
through them millions of times; tests/tiers/test_index_fastpath.py pins them to a per-block reference):
while nothing is pinned the first candidate is the victim, so eviction asks the policy to pop it
(``EvictionPolicy._pop_victim``, O(1) for the built-in policies) instead of iterating ``candidates()``;
:meth:`insert_chain` inlines reserve + commit (an evicted slot is reused at once, as the free list would hand
it back), and with the LRU policy :meth:`insert_chain` and :meth:`touch_prefix` also inline the policy's list
operations.
"""

from __future__ import annotations

import enum
import importlib
import os
from array import array
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from .._errors import InvalidArgumentError
from ._policies import ARCPolicy, EvictionPolicy, LRUPolicy, SessionPolicy, _RecencyList

try:  # touch_prefix / insert_chain with LRU in C (aiokv/_native/_lru.c); the Python methods below define them
    from .._native import _lru as _native_lru
except ImportError:  # pragma: no cover - built without a C compiler
    _native_lru = None  # type: ignore[assignment]
if os.environ.get("AIOKV_NATIVE_LRU", "1") == "0":
    _native_lru = None  # type: ignore[assignment]
# commit_run with the LRU policy in C (the completion of every stored block); None: the Python loop.
_native_commit = getattr(_native_lru, "commit_run", None) if _native_lru is not None else None
_native_first_not_pending = (
    getattr(_native_lru, "first_not_pending", None) if _native_lru is not None else None
)


def _policy_fast_paths() -> dict[type, tuple[Callable[..., Any], Callable[..., Any]]]:
    """The replay loops of other policies in C, by policy type: ``touch_prefix(index, policy, keys, start) ->
    n`` and ``insert_chain(index, policy, keys, start) -> (inserted, evicted, rejected)``, each doing exactly
    what the generic Python loops of :meth:`BlockIndex.touch_prefix` and :meth:`BlockIndex.insert_chain` do
    with that policy's methods, or returning None, having changed nothing, for a state it does not cover
    (the Python loop runs then). ``AIOKV_NATIVE_LRU=0`` turns them off with the LRU ones."""
    paths: dict[type, tuple[Callable[..., Any], Callable[..., Any]]] = {}
    if _native_lru is None:
        return paths
    for name, cls in (("_arc", ARCPolicy), ("_session", SessionPolicy)):
        try:
            mod = importlib.import_module(f"aiokv._native.{name}")
        except ImportError:  # pragma: no cover - built without a C compiler
            continue
        paths[cls] = (mod.touch_prefix, mod.insert_chain)
    return paths


_FAST_PATHS = _policy_fast_paths()

__all__ = ["BlockIndex", "EntryState", "IndexStats"]


class EntryState(enum.Enum):
    PENDING = "pending"
    READY = "ready"


_FREE = 0
_PENDING = 1
_READY = 2


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
    """Maps block hashes to slots ``0..num_slots-1`` of a fixed-size tier.

    Storage is a ``key -> slot`` dict plus per-slot arrays (state, pins, parent, depth): no per-entry Python
    object, so the index costs little memory per cached block and gives the garbage collector nothing to
    traverse (``bench_memory.py`` measures it).
    """

    __slots__ = (
        "_depth",
        "_evictions",
        "_free",
        "_get_priority",
        "_keys",
        "_parent",
        "_pending",
        "_pinned",
        "_pins",
        "_prio",
        "_quota",
        "_rejected",
        "_set_priority",
        "_slots",
        "_state",
        "_tenant_of",
        "_tenant_used",
        "num_slots",
        "on_evict",
        "policy",
    )

    def __init__(self, num_slots: int, policy: EvictionPolicy) -> None:
        self.num_slots = num_slots
        self.policy = policy
        self._slots: dict[bytes, int] = {}
        self._keys: list[bytes | None] = [None] * num_slots
        self._state = bytearray(num_slots)  # _FREE, _PENDING or _READY
        self._pins = array("I", bytes(4 * num_slots))
        self._parent: list[bytes | None] = [None] * num_slots
        self._depth = array("I", bytes(4 * num_slots))
        # Each slot's priority, set at reserve and given to the policy at commit when it orders by priority
        # (SessionPolicy.set_priority); other policies ignore it. -128..127 (the offloader allows -100..100).
        self._prio = array("b", bytes(num_slots))
        self._set_priority: Callable[[bytes, int], None] | None = getattr(policy, "set_priority", None)
        self._get_priority: Callable[[bytes], int] = getattr(policy, "priority", lambda key: 0)
        # Hand out low slots first (pop from the end of a descending list): fresh tiers fill contiguously.
        self._free = array("I", range(num_slots - 1, -1, -1))  # 4 bytes per slot, no int objects
        self._evictions = 0
        self._rejected = 0
        self._pinned = 0
        self._pending = 0
        self.on_evict: list[bytes] | None = None  # when a list, evicted keys are appended to it
        # Per-tenant quotas (set_tenant_quota): each slot's tenant and each tenant's slot count.
        self._quota: Callable[[bytes], int | None] | None = None
        self._tenant_of: list[bytes | None] | None = None
        self._tenant_used: dict[bytes, int] = {}

    # ----------------------------------------------------------------- queries
    def __len__(self) -> int:
        return len(self._slots)

    def __contains__(self, key: object) -> bool:
        slot = self._slots.get(key)  # type: ignore[call-overload]
        return slot is not None and self._state[slot] == _READY

    def state(self, key: bytes) -> EntryState | None:
        slot = self._slots.get(key)
        if slot is None:
            return None
        return EntryState.READY if self._state[slot] == _READY else EntryState.PENDING

    def slot(self, key: bytes) -> int:
        return self._slots[key]

    def pins(self, key: bytes) -> int:
        slot = self._slots.get(key)
        return 0 if slot is None else self._pins[slot]

    def match_prefix(self, keys: Sequence[bytes]) -> int:
        """Number of leading ``keys`` that are READY. No side effects."""
        slots = self._slots
        state = self._state
        n = 0
        for key in keys:
            slot = slots.get(key)
            if slot is None or state[slot] != _READY:
                break
            n += 1
        return n

    def first_not_pending(self, keys: Iterable[bytes]) -> bytes | None:
        """The first of ``keys`` that is not a PENDING entry (absent or READY), else ``None``."""
        slots = self._slots
        state = self._state
        for key in keys:
            slot = slots.get(key)
            if slot is None or state[slot] != _PENDING:
                return key
        return None

    def first_not_pending_or_repeated(self, keys: Sequence[bytes]) -> bytes | None:
        """The first of ``keys`` that is not a PENDING entry; when all are, the first that repeats an earlier
        one (a copy's keys must be distinct pending reservations); else ``None``. One completed copy's check,
        in C where it is built."""
        if _native_first_not_pending is not None and type(keys) in (list, tuple):
            i = _native_first_not_pending(keys, self._slots, self._state)
            return None if i < 0 else keys[i]
        key = self.first_not_pending(keys)
        if key is None and len(keys) > 1 and len(set(keys)) < len(keys):
            key = next(k for i, k in enumerate(keys) if k in keys[:i])
        return key

    def first_not_pinned(self, keys: Iterable[bytes]) -> bytes | None:
        """The first of ``keys`` that is absent or not pinned, else ``None``. (A key given twice must be pinned
        twice: counted.)"""
        slots = self._slots
        pins = self._pins
        seen: dict[int, int] = {}
        for key in keys:
            slot = slots.get(key)
            if slot is None:
                return key
            n = seen.get(slot, 0) + 1
            if pins[slot] < n:
                return key
            seen[slot] = n
        return None

    def free_slots(self) -> int:
        return len(self._free)

    def ready_keys(self) -> list[bytes]:
        """The keys of every READY entry (what lookups can find), in no particular order. O(entries)."""
        state = self._state
        return [key for key, slot in self._slots.items() if state[slot] == _READY]

    # ------------------------------------------------------------------ tenants
    def set_tenant_quota(self, quota: Callable[[bytes], int | None]) -> None:
        """Turn on per-tenant quotas: ``quota(tenant)`` is the most slots (pending or ready) entries reserved
        for ``tenant`` may hold, ``None`` for no limit. A reserve for a tenant at its quota evicts that tenant's
        own first unpinned candidate (never another tenant's) or, with none, fails. Set it before the first
        reserve; entries reserved without a tenant count for nobody."""
        if self._slots:
            raise InvalidArgumentError("tenant quotas must be set before the first entry is reserved")
        self._quota = quota
        self._tenant_of = [None] * self.num_slots

    def track_tenants(self) -> None:
        """Record each entry's tenant (``reserve(..., tenant=)``, read back by :meth:`tenant`) without limiting
        any: for the tiers below, which enforce their own quotas. Set it before the first reserve; a no-op
        when quotas already record tenants."""
        if self._tenant_of is not None:
            return
        if self._slots:
            raise InvalidArgumentError("tenant tracking must be set before the first entry is reserved")
        self._tenant_of = [None] * self.num_slots

    def tenant(self, key: bytes) -> bytes | None:
        """The tenant ``key``'s entry was reserved for (``None``: none, not tracked, or absent)."""
        tenant_of = self._tenant_of
        if tenant_of is None:
            return None
        slot = self._slots.get(key)
        return None if slot is None else tenant_of[slot]

    def tenant_slots(self, tenant: bytes) -> int:
        """Slots (pending or ready) held by ``tenant``'s entries."""
        return self._tenant_used.get(tenant, 0)

    def _evict_own(self, tenant: bytes) -> bool:
        """Evict ``tenant``'s first unpinned candidate in the policy's order; whether there was one."""
        assert self._tenant_of is not None
        return self._evict_first_unpinned(tenant)

    def _evict_first_unpinned(self, tenant: bytes | None = None) -> bool:
        """Evict the first candidate in the policy's order that is not pinned (and, given ``tenant``, is that
        tenant's); whether there was one."""
        slots = self._slots
        pins = self._pins
        tenant_of = self._tenant_of
        for key in self.policy.candidates():
            slot = slots[key]
            if pins[slot] == 0 and (tenant is None or (tenant_of is not None and tenant_of[slot] == tenant)):
                self.policy.remove(key, evicted=True)
                self._evicted(key, slot)
                return True
        return False

    # ------------------------------------------------------------ lookup / pins
    def pin_prefix(self, keys: Sequence[bytes]) -> list[int]:
        """Pin and touch the leading READY ``keys``; return their slots (the length is the hit count)."""
        slots = self._slots
        state = self._state
        pins = self._pins
        touch = self.policy.touch
        out: list[int] = []
        for key in keys:
            slot = slots.get(key)
            if slot is None or state[slot] != _READY:
                break
            if pins[slot] == 0:
                self._pinned += 1
            pins[slot] += 1
            touch(key)
            out.append(slot)
        return out

    def pin(self, key: bytes) -> int:
        """Pin one READY entry (e.g. for a write-through read of its slot); return its slot."""
        slot = self._slots[key]
        if self._state[slot] != _READY:
            raise KeyError(key)
        if self._pins[slot] == 0:
            self._pinned += 1
        self._pins[slot] += 1
        return slot

    def unpin(self, keys: Iterable[bytes]) -> None:
        slots = self._slots
        pins = self._pins
        for key in keys:
            slot = slots[key]
            assert pins[slot] > 0, "unpin of an unpinned entry"
            pins[slot] -= 1
            if pins[slot] == 0:
                self._pinned -= 1

    def touch(self, key: bytes) -> None:
        if key in self._slots:
            self.policy.touch(key)

    # -------------------------------------------------------------- store path
    def reserve(
        self,
        key: bytes,
        parent: bytes | None = None,
        depth: int = 0,
        tenant: bytes | None = None,
        priority: int = 0,
    ) -> int | None:
        """Allocate a slot for a new PENDING entry, evicting if needed.

        Returns ``None`` when ``key`` is already present (it is touched instead, and its priority raised to
        ``priority`` if lower), when every slot is pending or pinned, or when ``tenant`` is at its quota and
        holds nothing evictable ("no room now" is a value, not an exception). ``priority`` (-128..127) is
        handed to a policy with ``set_priority`` when the entry commits; other policies ignore it.
        """
        slots = self._slots
        if key in slots:
            slot = slots[key]
            if self._state[slot] == _READY:
                self.policy.touch(key)
                if self._set_priority is not None and priority > self._get_priority(key):
                    self._set_priority(key, priority)
            elif priority > self._prio[slot]:
                self._prio[slot] = priority
            return None
        if self._quota is not None and tenant is not None:
            limit = self._quota(tenant)
            if (
                limit is not None
                and self._tenant_used.get(tenant, 0) >= limit
                and not self._evict_own(tenant)
            ):
                self._rejected += 1
                return None
        free = self._free
        if not free and not self._evict_one():
            self._rejected += 1
            return None
        slot = free.pop()
        slots[key] = slot
        self._keys[slot] = key
        self._state[slot] = _PENDING
        self._parent[slot] = parent
        self._depth[slot] = depth
        self._prio[slot] = priority
        self._pending += 1
        if self._tenant_of is not None and tenant is not None:
            self._tenant_of[slot] = tenant
            self._tenant_used[tenant] = self._tenant_used.get(tenant, 0) + 1
        return slot

    def reserve_run(
        self,
        chain: Sequence[bytes],
        start: int,
        end: int,
        tenant: bytes | None = None,
        priority: int = 0,
    ) -> tuple[list[int], list[int], int]:
        """:meth:`reserve` for the blocks ``start..end-1`` of one request's chain (``chain[i]``, parent
        ``chain[i - 1]`` (none for block 0), depth ``i``), in order: the store path's one loop.

        Returns ``(positions, slots, present)``: the positions reserved and their slots, and how many keys were
        present already (touched as by :meth:`reserve`); the remaining positions found no room."""
        positions: list[int] = []
        slots_out: list[int] = []
        present = 0
        slots = self._slots
        if tenant is not None and (self._quota is not None or self._tenant_of is not None):
            for i in range(start, end):  # quotas and tenant accounting: reserve() decides each block
                key = chain[i]
                if key in slots:
                    present += 1
                slot = self.reserve(key, chain[i - 1] if i else None, i, tenant, priority)
                if slot is not None:
                    positions.append(i)
                    slots_out.append(slot)
            return positions, slots_out, present
        free = self._free
        keys = self._keys
        state = self._state
        parents = self._parent
        depths = self._depth
        prios = self._prio
        for i in range(start, end):
            key = chain[i]
            if key in slots:
                present += 1
                self.reserve(key, None, i, tenant, priority)  # the touch and priority rules of reserve()
                continue
            if not free and not self._evict_one():
                self._rejected += 1
                continue
            slot = free.pop()
            slots[key] = slot
            keys[slot] = key
            state[slot] = _PENDING
            parents[slot] = chain[i - 1] if i else None
            depths[slot] = i
            prios[slot] = priority
            positions.append(i)
            slots_out.append(slot)
        self._pending += len(slots_out)
        return positions, slots_out, present

    def commit_run(self, keys: Iterable[bytes]) -> None:
        """:meth:`commit` for each of ``keys``, in order (one completed store copy's blocks)."""
        if (
            _native_commit is not None
            and type(self.policy) is LRUPolicy
            and self._set_priority is None
            and type(keys) in (list, tuple)
        ):
            lst = self.policy._list
            n, lst._last = _native_commit(
                keys, self._slots, self._state, self._parent, lst._order, lst._run, lst._last
            )
            self._pending -= n
            return
        slots = self._slots
        state = self._state
        parents = self._parent
        depths = self._depth
        prios = self._prio
        insert = self.policy.insert
        set_priority = self._set_priority
        n = 0
        for key in keys:
            slot = slots[key]
            assert state[slot] == _PENDING, "commit of a non-pending entry"
            state[slot] = _READY
            n += 1
            insert(key, parents[slot], depths[slot])
            if prios[slot] and set_priority is not None:
                set_priority(key, prios[slot])
        self._pending -= n

    def commit(self, key: bytes) -> None:
        """PENDING -> READY: the entry's copy completed; it becomes visible and evictable."""
        slot = self._slots[key]
        assert self._state[slot] == _PENDING, "commit of a non-pending entry"
        self._state[slot] = _READY
        self._pending -= 1
        self.policy.insert(key, self._parent[slot], self._depth[slot])
        if self._prio[slot] and self._set_priority is not None:
            self._set_priority(key, self._prio[slot])

    def insert_ready(self, key: bytes, parent: bytes | None = None, depth: int = 0) -> int | None:
        """reserve + commit in one call (for replay and for tiers whose writes are synchronous)."""
        slot = self.reserve(key, parent, depth)
        if slot is not None:
            self.commit(key)
        return slot

    def restore(self, entries: Iterable[tuple[bytes, int]]) -> int:
        """Put recovered READY entries back at their own slots (a persistent tier reopening).

        ``entries`` are ``(key, slot)`` pairs, oldest first: the policy sees them inserted in that order.
        Each slot must be free and each key absent. Returns how many were restored.
        """
        taken: set[int] = set()
        for key, slot in entries:
            if not 0 <= slot < self.num_slots:
                raise InvalidArgumentError(f"slot must be in [0, {self.num_slots}), got {slot}")
            if self._state[slot] != _FREE or slot in taken:
                raise InvalidArgumentError(f"slot {slot} is not free")
            if key in self._slots:
                raise InvalidArgumentError("key is already present")
            self._slots[key] = slot
            self._keys[slot] = key
            self._state[slot] = _READY
            self.policy.insert(key, None, 0)
            taken.add(slot)
        if taken:
            self._free = array("I", [s for s in self._free if s not in taken])
        return len(taken)

    def discard(self, key: bytes) -> bool:
        """Remove an entry that is not pinned (a failed copy, a corrupt read). Returns whether it was present."""
        slot = self._slots.get(key)
        if slot is None:
            return False
        assert self._pins[slot] == 0, "discard of a pinned entry"
        if self._state[slot] == _READY:
            self.policy.remove(key, evicted=False)
        else:
            self._pending -= 1
        self._release(key, slot)
        return True

    def _release(self, key: bytes, slot: int) -> None:
        tenant_of = self._tenant_of
        if tenant_of is not None:
            tenant = tenant_of[slot]
            if tenant is not None:
                tenant_of[slot] = None
                used = self._tenant_used
                if used[tenant] == 1:
                    del used[tenant]
                else:
                    used[tenant] -= 1
        del self._slots[key]
        self._keys[slot] = None
        self._parent[slot] = None
        self._state[slot] = _FREE
        self._free.append(slot)

    def _evicted(self, victim: bytes, slot: int) -> None:
        """``victim`` (already out of the policy) leaves the index: its slot is free, the eviction counted and
        reported to ``on_evict``."""
        self._release(victim, slot)
        self._evictions += 1
        if self.on_evict is not None:
            self.on_evict.append(victim)

    def _evict_one(self) -> bool:
        if self._pinned:
            return self._evict_first_unpinned()
        # Every candidate is evictable: the policy pops its first one.
        victim = self.policy._pop_victim()
        if victim is None:
            return False
        self._evicted(victim, self._slots[victim])
        return True

    # ------------------------------------------------------- whole-chain fast path (replay)
    def touch_prefix(self, keys: Sequence[bytes], start: int = 0) -> int:
        """Touch the READY keys that ``keys[start:]`` leads with and return how many: a lookup that pins
        nothing, for callers that use the blocks at once (``aiokv replay``). The policy sees the same calls as
        for :meth:`pin_prefix`."""
        slots = self._slots
        state = self._state
        policy = self.policy
        if type(policy) is LRUPolicy:
            lst = policy._list
            if _native_lru is not None and type(keys) in (tuple, list):
                n, lst._last = _native_lru.touch_prefix(
                    keys, start, slots, state, lst._order, lst._run, lst._last
                )
                return n
            return self._touch_prefix_lru(keys, start, lst)
        fast = _FAST_PATHS.get(type(policy))
        if fast is not None and type(keys) in (tuple, list):
            n = fast[0](self, policy, keys, start)
            if n is not None:
                return n  # type: ignore[no-any-return]
        touch = policy.touch
        n = 0
        for i in range(start, len(keys)):
            key = keys[i]
            slot = slots.get(key)
            if slot is None or state[slot] != _READY:
                break
            touch(key)
            n += 1
        return n

    def _touch_prefix_lru(self, keys: Sequence[bytes], start: int, lst: _RecencyList) -> int:
        # touch_prefix with LRUPolicy.touch inlined (push(key, its parent) for each READY key).
        slots = self._slots
        state = self._state
        order = lst._order
        run = lst._run
        move = order.move_to_end
        last = lst._last
        n = 0
        for i in range(start, len(keys)):
            key = keys[i]
            slot = slots.get(key)
            if slot is None or state[slot] != _READY:
                break
            p = order[key]
            if p is None or p != last or key in run:
                if len(run) > 1:
                    for k in reversed(run):
                        move(k)
                run.clear()
            move(key)
            run[key] = None
            last = key
            n += 1
        lst._last = last
        return n

    def insert_chain(self, keys: Sequence[bytes], start: int = 0) -> int:
        """:meth:`insert_ready` ``(keys[i], parent=keys[i - 1], depth=i)`` for each ``i >= start``, head first;
        return how many keys were inserted. Present keys are touched; a key that finds no room is skipped."""
        if self._pinned or self._tenant_of is not None:  # pins and quotas need the general path
            return self._insert_chain_slow(keys, start)
        if type(self.policy) is LRUPolicy:
            lst = self.policy._list
            if _native_lru is not None and type(keys) in (tuple, list):
                inserted, evicted, rejected, lst._last = _native_lru.insert_chain(
                    keys,
                    start,
                    self._slots,
                    self._state,
                    self._free,
                    self._keys,
                    self._parent,
                    self._depth,
                    self.on_evict,
                    lst._order,
                    lst._run,
                    lst._last,
                )
                self._evictions += evicted
                self._rejected += rejected
                return inserted
            return self._insert_chain_lru(keys, start, lst)
        fast = _FAST_PATHS.get(type(self.policy))
        if fast is not None and type(keys) in (tuple, list):
            done = fast[1](self, self.policy, keys, start)
            if done is not None:
                inserted, evicted, rejected = done
                self._evictions += evicted
                self._rejected += rejected
                return inserted  # type: ignore[no-any-return]
        # reserve + commit inlined; an evicted slot is reused at once (reserve would free it and pop it back).
        slots = self._slots
        state = self._state
        free = self._free
        key_of = self._keys
        parent_of = self._parent
        depth_of = self._depth
        policy = self.policy
        insert = policy.insert
        touch = policy.touch
        pop_victim = policy._pop_victim
        on_evict = self.on_evict
        parent = keys[start - 1] if start > 0 else None
        inserted = 0
        evicted = 0
        rejected = 0
        for i in range(start, len(keys)):
            key = keys[i]
            slot = slots.get(key)
            if slot is not None:
                if state[slot] == _READY:
                    touch(key)
                parent = key
                continue
            if free:
                slot = free.pop()
            else:
                victim = pop_victim()
                if victim is None:
                    rejected += 1
                    parent = key
                    continue
                slot = slots.pop(victim)  # key_of[slot] is overwritten below
                evicted += 1
                if on_evict is not None:
                    on_evict.append(victim)
            slots[key] = slot
            key_of[slot] = key
            state[slot] = _READY
            parent_of[slot] = parent
            depth_of[slot] = i
            insert(key, parent, i)
            inserted += 1
            parent = key
        self._evictions += evicted
        self._rejected += rejected
        return inserted

    def _insert_chain_lru(self, keys: Sequence[bytes], start: int, lst: _RecencyList) -> int:
        # insert_chain with LRUPolicy's insert, touch and _pop_victim inlined (the same operations on its list).
        slots = self._slots
        state = self._state
        free = self._free
        key_of = self._keys
        parent_of = self._parent
        depth_of = self._depth
        on_evict = self.on_evict
        order = lst._order
        run = lst._run
        move = order.move_to_end
        popitem = order.popitem
        last = lst._last
        parent = keys[start - 1] if start > 0 else None
        inserted = 0
        evicted = 0
        rejected = 0
        for i in range(start, len(keys)):
            key = keys[i]
            slot = slots.get(key)
            if slot is not None:
                if state[slot] == _READY:  # touch: push(key, its parent)
                    p = order[key]
                    if p is None or p != last or key in run:
                        if len(run) > 1:
                            for k in reversed(run):
                                move(k)
                        run.clear()
                    move(key)
                    run[key] = None
                    last = key
                parent = key
                continue
            if free:
                slot = free.pop()
            elif len(order) > len(run):  # pop the first candidate: the least recent key outside the run
                victim = popitem(False)[0]
                slot = slots.pop(victim)  # key_of[slot] is overwritten below
                evicted += 1
                if on_evict is not None:
                    on_evict.append(victim)
            elif order:  # only the open run is left: its last key comes first
                run.popitem()
                victim = popitem()[0]
                slot = slots.pop(victim)  # key_of[slot] is overwritten below
                evicted += 1
                if on_evict is not None:
                    on_evict.append(victim)
            else:
                rejected += 1
                parent = key
                continue
            slots[key] = slot
            key_of[slot] = key
            state[slot] = _READY
            parent_of[slot] = parent
            depth_of[slot] = i
            # push(key, parent) for an absent key: assignment appends it, so no move_to_end
            if parent is None or parent != last:
                if len(run) > 1:
                    for k in reversed(run):
                        move(k)
                run.clear()
            order[key] = parent
            run[key] = None
            last = key
            inserted += 1
            parent = key
        lst._last = last
        self._evictions += evicted
        self._rejected += rejected
        return inserted

    def _insert_chain_slow(self, keys: Sequence[bytes], start: int) -> int:
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
            ready=len(self._slots) - pending,
            pending=pending,
            pinned=self._pinned,
            evictions=self._evictions,
            rejected=self._rejected,
        )

    def check_invariants(self) -> None:
        """Expensive consistency check for tests."""
        used = set(self._slots.values())
        assert len(used) == len(self._slots), "two entries share a slot"
        assert not used & set(self._free), "a used slot is on the free list"
        assert len(used) + len(self._free) == self.num_slots, "slot leak"
        for key, slot in self._slots.items():
            assert self._keys[slot] == key, "slot table out of sync"
            assert self._state[slot] in (_PENDING, _READY)
        for slot in self._free:
            assert self._state[slot] == _FREE
            assert self._pins[slot] == 0
            assert self._keys[slot] is None
        ready = {k for k, slot in self._slots.items() if self._state[slot] == _READY}
        assert set(self.policy.candidates()) == ready, "policy out of sync with ready entries"
        assert self._pinned == sum(1 for slot in self._slots.values() if self._pins[slot] > 0)
        assert self._pending == len(self._slots) - len(ready)
        if self._tenant_of is not None:
            counted: dict[bytes, int] = {}
            for slot in self._slots.values():
                tenant = self._tenant_of[slot]
                if tenant is not None:
                    counted[tenant] = counted.get(tenant, 0) + 1
            assert counted == self._tenant_used, "tenant slot counts out of sync"
            assert all(self._tenant_of[slot] is None for slot in self._free)
