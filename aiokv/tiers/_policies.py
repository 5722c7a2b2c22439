"""Eviction policies: pure bookkeeping over keys, no data, no awaits.

A policy orders the *resident, evictable-in-principle* keys of one tier. The index tells it when a key is
inserted, hit, or removed (``evicted=True`` when the policy's own victim was taken, so history-keeping policies
such as ARC can remember it). ``candidates()`` yields keys in the order the policy would evict them; the index
skips keys that are pinned or pending and takes the first evictable one, so a policy never needs to know about
pins.

Chains. Blocks are keyed by prefix-chained hashes: a block can only be hit when every block before it in its
chain is hit too, so a resident block whose parent is gone is dead weight. Two things follow:

- *Runs*. An engine touches or stores a request's blocks head first. If each of those calls counted as a
  separate access, the head would be the least recent block of the request and be evicted first, orphaning
  the rest. The recency lists below therefore treat consecutive accesses that walk down one chain (each key's
  parent is the key accessed just before it) as one access, ordered so that the *head* ends up most recent
  and the tail is evicted first. vLLM's LRU offloading manager gets the same order by touching in reverse.
- :class:`ChainLRUPolicy` goes further and only evicts *leaves* (resident blocks with no resident child), so a
  block never loses its parent to eviction while it is resident.

Every operation is O(1) amortized, except :class:`ChainLRUPolicy` (O(log n) per insert, hit and eviction).
"""

from __future__ import annotations

import heapq
import itertools
import math
import time
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

from .._errors import InvalidArgumentError

__all__ = [
    "ARCPolicy",
    "AdaptivePolicy",
    "ChainLRUPolicy",
    "EvictionPolicy",
    "LRUPolicy",
    "SessionPolicy",
    "make_policy",
    "policy_names",
    "register_policy",
]


class EvictionPolicy(ABC):
    """Orders resident keys for eviction. ``parent`` is the previous block's key in its chain (``None`` for a
    chain's first block) and ``depth`` the block's index in its chain; policies may ignore both."""

    name: str = "?"

    @abstractmethod
    def insert(self, key: bytes, parent: bytes | None = None, depth: int = 0) -> None:
        """``key`` became resident (committed)."""

    @abstractmethod
    def touch(self, key: bytes) -> None:
        """``key`` was hit (looked up, loaded, or stored again). Unknown keys are ignored."""

    @abstractmethod
    def remove(self, key: bytes, evicted: bool) -> None:
        """``key`` left the tier; ``evicted`` is True when it was chosen as a victim (not dropped)."""

    @abstractmethod
    def candidates(self) -> Iterator[bytes]:
        """Resident keys, best victim first. Must tolerate the caller stopping early."""

    def _pop_victim(self) -> bytes | None:
        # The index's fast path when nothing is pinned: remove the first candidate as an eviction and return
        # it (None when empty). Built-in policies override it with an O(1) pop; any override must be
        # equivalent to this.
        for key in self.candidates():
            self.remove(key, evicted=True)
            return key
        return None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        # A subclass that changes candidates() or remove() but not _pop_victim gets the generic pop back: an
        # inherited O(1) pop would bypass its overrides.
        if "_pop_victim" not in cls.__dict__ and ("candidates" in cls.__dict__ or "remove" in cls.__dict__):
            cls._pop_victim = EvictionPolicy._pop_victim  # type: ignore[method-assign]

    def __len__(self) -> int:  # pragma: no cover - overridden
        raise NotImplementedError

    def _native_replay_spec(self) -> tuple[Any, ...] | None:
        # This policy as a spec of aiokv._native._replay.run (aiokv/_native/_replay.c: pol_new reads it) while
        # it is fresh, so the C replay starting from its initial state is this policy; None when the C
        # replay cannot stand for it (not fresh, or a policy it does not implement). The built-ins
        # LRU, ARC, session and adaptive override it; aiokv.replay._sim asks exact types only (a subclass
        # may change any method).
        return None


_ABSENT = object()


class _RecencyList:
    """Keys in recency order, least recent first, with chain runs (see the module docstring).

    The keys of the open run are the last ``len(run)`` keys of ``_order`` (any access that does not extend the
    run closes it first). Iteration yields the keys before the run, then the run reversed, which is the order
    the run will have once closed, so closing a run costs O(run) once and reading never mutates.
    """

    __slots__ = ("_last", "_order", "_run")

    def __init__(self) -> None:
        self._order: OrderedDict[bytes, bytes | None] = OrderedDict()  # key -> parent
        self._run: dict[bytes, None] = {}
        self._last: bytes | None = None

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, key: object) -> bool:
        return key in self._order

    def parent(self, key: bytes) -> bytes | None:
        return self._order[key]

    def push(self, key: bytes, parent: bytes | None) -> None:
        """Make ``key`` the most recent key (inserting it when absent)."""
        order = self._order
        run = self._run
        if parent is None or parent != self._last or key in run:
            if len(run) > 1:
                for k in reversed(run):
                    order.move_to_end(k)
            run.clear()
        order[key] = parent
        order.move_to_end(key)
        run[key] = None
        self._last = key

    def pop(self, key: bytes) -> None:
        del self._order[key]
        self._run.pop(key, None)

    def pop_first(self) -> bytes:
        """Remove and return the first key of the iteration order (the list must not be empty)."""
        order = self._order
        run = self._run
        if len(order) > len(run):  # the least recent key is not in the open run
            return order.popitem(last=False)[0]
        # Only the open run is left: it iterates reversed, so its last key comes first.
        run.popitem()
        return order.popitem()[0]

    def __iter__(self) -> Iterator[bytes]:
        run = self._run
        if len(run) <= 1:
            return iter(self._order)
        return itertools.chain(itertools.islice(self._order, len(self._order) - len(run)), reversed(run))


class LRUPolicy(EvictionPolicy):
    """Least recently used, with chain runs: a request's blocks accessed head first count as one access whose
    head is the most recent, so among equally old chains a prefix's head outlives its tail."""

    name = "lru"
    __slots__ = ("_list",)

    def __init__(self) -> None:
        self._list = _RecencyList()

    def insert(self, key: bytes, parent: bytes | None = None, depth: int = 0) -> None:
        # _RecencyList.push, inlined: this runs once per stored block.
        lst = self._list
        order = lst._order
        run = lst._run
        if parent is None or parent != lst._last or key in run:
            if len(run) > 1:
                for k in reversed(run):
                    order.move_to_end(k)
            run.clear()
        order[key] = parent
        order.move_to_end(key)
        run[key] = None
        lst._last = key

    def touch(self, key: bytes) -> None:
        parent = self._list._order.get(key, _ABSENT)
        if parent is not _ABSENT:
            LRUPolicy.insert(self, key, parent)  # type: ignore[arg-type]  # (not a subclass's insert)

    def remove(self, key: bytes, evicted: bool) -> None:
        if key in self._list:
            self._list.pop(key)

    def candidates(self) -> Iterator[bytes]:
        return iter(self._list)

    def _pop_victim(self) -> bytes | None:
        # _RecencyList.pop_first, inlined: this runs once per eviction.
        lst = self._list
        order = lst._order
        run = lst._run
        if len(order) > len(run):
            return order.popitem(last=False)[0]
        if not order:
            return None
        run.popitem()
        return order.popitem()[0]

    def __len__(self) -> int:
        return len(self._list)

    def _native_replay_spec(self) -> tuple[Any, ...] | None:
        return None if len(self._list) else ("lru",)


class ARCPolicy(EvictionPolicy):
    """Adaptive Replacement Cache (Megiddo & Modha, FAST'03) over a tier of ``capacity`` blocks.

    Resident keys live in T1 (seen once since they became resident) or T2 (hit again: ARC promotes on reuse);
    evicted keys are remembered in the ghost lists B1 and B2. A key inserted while in B1 means T1 was too small
    and raises the target size ``p`` of T1; one inserted while in B2 lowers it; either way it enters T2. The
    victim is T1's least recent key while ``len(T1) > p`` (or T2 is empty), otherwise T2's.

    Differences from the paper, forced by the index driving eviction: the index evicts *before* it inserts, so
    a ghost hit adapts ``p`` for the next eviction rather than the one that made room for it, and the paper's
    tie rule (evict from T1 when ``len(T1) == p`` and the incoming key is in B2) is not applied. Ghost lists are
    bounded as in the paper: ``len(T1) + len(B1) <= capacity`` and all four lists hold at most ``2 * capacity``.
    T1 and T2 use chain runs like :class:`LRUPolicy`.
    """

    name = "arc"
    __slots__ = ("_b1", "_b2", "_t1", "_t2", "capacity", "p")

    def __init__(self, capacity: int) -> None:
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity <= 0:
            raise InvalidArgumentError(f"capacity must be a positive int, got {capacity!r}")
        self.capacity = capacity
        self.p = 0.0
        self._t1 = _RecencyList()
        self._t2 = _RecencyList()
        self._b1: OrderedDict[bytes, None] = OrderedDict()
        self._b2: OrderedDict[bytes, None] = OrderedDict()

    def __repr__(self) -> str:
        return (
            f"<ARCPolicy capacity={self.capacity} p={self.p:g} t1={len(self._t1)} t2={len(self._t2)} "
            f"b1={len(self._b1)} b2={len(self._b2)}>"
        )

    # Read-only views for tests and debugging, least recent first.
    def t1(self) -> list[bytes]:
        return list(self._t1)

    def t2(self) -> list[bytes]:
        return list(self._t2)

    def b1(self) -> list[bytes]:
        return list(self._b1)

    def b2(self) -> list[bytes]:
        return list(self._b2)

    def insert(self, key: bytes, parent: bytes | None = None, depth: int = 0) -> None:
        b1, b2 = self._b1, self._b2
        if key in b1:
            self.p = min(float(self.capacity), self.p + max(len(b2) / len(b1), 1.0))
            del b1[key]
            self._t2.push(key, parent)
        elif key in b2:
            self.p = max(0.0, self.p - max(len(b1) / len(b2), 1.0))
            del b2[key]
            self._t2.push(key, parent)
        else:
            # The common case, with t1.push and _trim_ghosts inlined.
            t1 = self._t1
            o1 = t1._order
            run = t1._run
            if parent is None or parent != t1._last or key in run:
                if len(run) > 1:
                    for k in reversed(run):
                        o1.move_to_end(k)
                run.clear()
            o1[key] = parent
            o1.move_to_end(key)
            run[key] = None
            t1._last = key
            c = self.capacity
            n1 = len(o1)
            while b1 and n1 + len(b1) > c:
                b1.popitem(last=False)
            n12 = n1 + len(self._t2._order)
            while n12 + len(b1) + len(b2) > 2 * c:
                (b2 or b1).popitem(last=False)
            return
        self._trim_ghosts()

    def touch(self, key: bytes) -> None:
        t1 = self._t1
        parent = t1._order.get(key, _ABSENT)
        if parent is not _ABSENT:
            t1.pop(key)
            self._t2.push(key, parent)  # type: ignore[arg-type]
            return
        t2 = self._t2
        parent = t2._order.get(key, _ABSENT)
        if parent is not _ABSENT:
            t2.push(key, parent)  # type: ignore[arg-type]

    def remove(self, key: bytes, evicted: bool) -> None:
        if key in self._t1._order:
            self._t1.pop(key)
            if evicted:
                self._b1[key] = None
        elif key in self._t2._order:
            self._t2.pop(key)
            if evicted:
                self._b2[key] = None
        else:
            return
        self._trim_ghosts()

    def _trim_ghosts(self) -> None:
        c = self.capacity
        b1, b2 = self._b1, self._b2
        n1 = len(self._t1._order)
        if n1 + len(b1) > c:
            while b1 and n1 + len(b1) > c:
                b1.popitem(last=False)
        n12 = n1 + len(self._t2._order)
        if n12 + len(b1) + len(b2) > 2 * c:
            while n12 + len(b1) + len(b2) > 2 * c:
                (b2 or b1).popitem(last=False)

    def _pop_victim(self) -> bytes | None:
        # candidates()' first key, removed as remove(key, evicted=True) would (its _trim_ghosts inlined: it
        # only does work when a bound is exceeded).
        t1, t2 = self._t1, self._t2
        o1 = t1._order
        n1 = len(o1)
        n2 = len(t2._order)
        if n1 and (n1 > self.p or not n2):
            run = t1._run
            if n1 > len(run):  # t1.pop_first(), inlined
                key = o1.popitem(last=False)[0]
            else:
                run.popitem()
                key = o1.popitem()[0]
            self._b1[key] = None
            n1 -= 1
        elif n2:
            key = t2.pop_first()
            self._b2[key] = None
            n2 -= 1
        else:
            return None
        nb1 = len(self._b1)
        c = self.capacity
        if (nb1 and n1 + nb1 > c) or n1 + n2 + nb1 + len(self._b2) > 2 * c:
            self._trim_ghosts()
        return key

    def candidates(self) -> Iterator[bytes]:
        t1, t2 = self._t1, self._t2
        if t1 and (len(t1) > self.p or not t2):
            return itertools.chain(t1, t2)
        return itertools.chain(t2, t1)

    def __len__(self) -> int:
        return len(self._t1) + len(self._t2)

    def _native_replay_spec(self) -> tuple[Any, ...] | None:
        # ("arc", capacity): the C policy starts with p = 0 and empty lists
        if len(self._t1) or len(self._t2) or self._b1 or self._b2 or self.p != 0.0:
            return None
        return ("arc", self.capacity)


class _Node:
    __slots__ = ("children", "key", "parent", "parent_key", "stamp")

    def __init__(self, key: bytes, parent_key: bytes | None, parent: _Node | None, stamp: int) -> None:
        self.key = key
        self.parent_key = parent_key
        self.parent = parent  # the resident parent's node; None for a root or an orphan
        self.children = 0  # resident children linked to this node
        self.stamp = stamp


_ORPHAN = 1 << 62  # subtracted from an orphan's stamp: older than every block that can still be hit


class ChainLRUPolicy(EvictionPolicy):
    """Chain-aware LRU: evict the least recently used *leaf*, a resident block none of whose children is
    resident (the tail of a cached chain), like SGLang's radix cache.

    A block whose parent is gone can never be hit again (a prefix hit needs every leading block), so evicting a
    chain's head before its tail wastes the tail's slot until it ages out. Here an inner block only becomes a
    candidate once its last resident child is evicted, and then competes with its own last access time.
    *Orphans*, blocks inserted while their parent is not resident (a request longer than the tier, a parent
    evicted while the request was in flight), go first: they cannot be hit until the parent returns, which
    relinks them on their next access. Inner blocks are offered after all leaves, oldest first, for the rare
    case that every leaf is pinned.

    Leaves are kept in a heap keyed by last access with lazy deletion: O(log n) per insert, hit and eviction.
    """

    name = "chain-lru"
    __slots__ = ("_clock", "_heap", "_nodes")

    def __init__(self) -> None:
        self._nodes: dict[bytes, _Node] = {}
        self._heap: list[tuple[int, bytes]] = []  # (stamp, key); valid iff key is a leaf with that stamp
        self._clock = 0

    def _push_leaf(self, node: _Node) -> None:
        heap = self._heap
        heapq.heappush(heap, (node.stamp, node.key))
        if len(heap) > 2 * len(self._nodes) + 64:  # drop stale entries; amortized O(1) per push
            self._rebuild_heap()

    def _rebuild_heap(self) -> None:
        heap = [(n.stamp, k) for k, n in self._nodes.items() if n.children == 0]
        heapq.heapify(heap)
        self._heap = heap

    def insert(self, key: bytes, parent: bytes | None = None, depth: int = 0) -> None:
        nodes = self._nodes
        if key in nodes:  # a second insert is a hit
            self.touch(key)
            return
        self._clock += 1
        stamp = self._clock
        pnode = None
        if parent is not None:
            pnode = nodes.get(parent)
            if pnode is None:
                stamp -= _ORPHAN
            else:
                pnode.children += 1  # its heap entry, if any, is now stale
        nodes[key] = _Node(key, parent, pnode, stamp)
        heap = self._heap  # _push_leaf, inlined
        heapq.heappush(heap, (stamp, key))
        if len(heap) > 2 * len(nodes) + 64:
            self._rebuild_heap()

    def touch(self, key: bytes) -> None:
        nodes = self._nodes
        node = nodes.get(key)
        if node is None:
            return
        pkey = node.parent_key
        if pkey is not None:
            pnode = nodes.get(pkey)
            if pnode is not node.parent:  # an orphan whose parent came back, or a child of a dropped parent
                node.parent = pnode
                if pnode is not None:
                    pnode.children += 1
        self._clock += 1
        node.stamp = self._clock
        if node.children == 0:
            self._push_leaf(node)

    def remove(self, key: bytes, evicted: bool) -> None:
        node = self._nodes.pop(key, None)
        if node is None:
            return
        pnode = node.parent
        if pnode is not None:
            pnode.children -= 1
            # A parent that was dropped while it had children is detached (no longer the node for its key).
            if pnode.children == 0 and self._nodes.get(pnode.key) is pnode:
                self._push_leaf(pnode)
        # Children of a dropped inner node keep pointing at the detached node until their next access.

    def _pop_victim(self) -> bytes | None:
        # candidates()' first key, removed as remove(key, evicted=True) would. Popping its heap entry (remove
        # leaves it to go stale) changes nothing else: valid entries have distinct stamps, so their order does
        # not depend on the stale entries around them.
        heap = self._heap
        nodes = self._nodes
        heappop = heapq.heappop
        while heap:
            stamp, key = heappop(heap)
            node = nodes.get(key)
            if node is not None and node.children == 0 and node.stamp == stamp:
                del nodes[key]
                pnode = node.parent
                if pnode is not None:
                    pnode.children -= 1
                    if pnode.children == 0 and nodes.get(pnode.key) is pnode:  # _push_leaf, inlined
                        heapq.heappush(heap, (pnode.stamp, pnode.key))
                        if len(heap) > 2 * len(nodes) + 64:
                            self._rebuild_heap()
                return key
        return super()._pop_victim()  # no leaf (every resident block has a resident child)

    def _valid(self, entry: tuple[int, bytes]) -> bool:
        node = self._nodes.get(entry[1])
        return node is not None and node.children == 0 and node.stamp == entry[0]

    def candidates(self) -> Iterator[bytes]:
        heap = self._heap
        nodes = self._nodes
        while heap:  # drop stale entries from the top (inlined _valid: this runs once per eviction)
            stamp, key = heap[0]
            node = nodes.get(key)
            if node is not None and node.children == 0 and node.stamp == stamp:
                break
            heapq.heappop(heap)
        return self._iter_candidates(heap)

    def _iter_candidates(self, heap: list[tuple[int, bytes]]) -> Iterator[bytes]:
        # Leaves in heap order without mutating the heap (the caller may stop at any point): walk the heap as
        # a binary tree, expanding a frontier of indices ordered by stamp.
        valid = self._valid
        if heap:
            n = len(heap)
            frontier = [(heap[0][0], 0)]
            while frontier:
                i = heapq.heappop(frontier)[1]
                entry = heap[i]
                if valid(entry):
                    yield entry[1]
                for c in (2 * i + 1, 2 * i + 2):
                    if c < n:
                        heapq.heappush(frontier, (heap[c][0], c))
        for _, key in sorted((n.stamp, k) for k, n in self._nodes.items() if n.children > 0):
            yield key

    def __len__(self) -> int:
        return len(self._nodes)


class SessionPolicy(EvictionPolicy):
    """Session-aware eviction: recency with an adaptive bonus for reused blocks, and hinted cold blocks first.

    - **Cold blocks first.** :meth:`hint_cold` names a block that no later request is expected to reuse;
      ``aiokv replay`` names a prompt's last block when the prompt ends inside it (the conversation's next
      turn continues the prompt inside that block, so the block's key changes). Cold blocks are evicted before
      any other, least recent first; a hit makes a cold block a reused one.
    - **Recency with a reuse bonus.** The other blocks are in T1 (not hit since they became resident) or T2
      (hit again), each a recency list with chain runs like :class:`LRUPolicy`, stamped with the access clock
      (one tick per insert or hit). The victim is T1's least recent block unless T2's least recent block is
      older by more than ``bonus`` ticks. ``bonus = 0`` is LRU; a large bonus is ARC with ``p = 0``.
    - **Adaptation.** Evicted blocks are remembered (ghosts B1 and B2, each at most ``ghost * capacity``
      keys, longer than ARC's so that conversations returning after more than a cache-full of traffic are
      seen). A block inserted while in B1 was evicted too early from T1: the bonus shrinks by
      ``step * max(len(B2) / len(B1), 1)``; one found in B2 grows it by ``step * max(len(B1) / len(B2), 1)``
      (ARC's rule, in clock ticks instead of list sizes). Either way the block enters T2.

    - **Retention.** :meth:`retain` gives blocks (a finished conversation's, until its next turn is expected)
      retention until ``seconds`` from now on ``clock``: while it lasts they are offered for eviction only after
      every block without it, in the same order among themselves. It is a priority, not a pin: a tier full of
      retained blocks still evicts.
    - **Priority.** :meth:`set_priority` gives a resident block an integer priority (default 0; the offloader
      sets the ``priority`` of the request that stored or staged it). Among blocks with the same retention
      status, lower priorities are offered for eviction first, and blocks of one priority in the order above
      (cold, then T1/T2). So the full order is: no retention before retention, then priority ascending, then
      cold/T1/T2. Like retention it orders, it does not pin.

    Only past accesses and the hints are used. O(1) per operation while no block has retention or a
    non-zero priority (otherwise eviction skips the blocks that go later, one pass over the order per
    retention status and priority level present); the ghosts cost ``2 * ghost * capacity`` keys at most.
    """

    name = "session"

    def __init__(
        self,
        capacity: int,
        *,
        ghost: int = 4,
        step: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity <= 0:
            raise InvalidArgumentError(f"capacity must be a positive int, got {capacity!r}")
        if isinstance(ghost, bool) or not isinstance(ghost, int) or ghost < 0:
            raise InvalidArgumentError(f"ghost must be an int >= 0, got {ghost!r}")
        if step is None:
            step = capacity / 32
        if isinstance(step, bool) or not isinstance(step, (int, float)) or not step >= 0 or step == math.inf:
            raise InvalidArgumentError(f"step must be a finite number >= 0, got {step!r}")
        self.capacity = capacity
        self.bonus = float(capacity)
        self._step = float(step)
        self._ghost_cap = ghost * capacity
        self._cold = _RecencyList()
        self._t1 = _RecencyList()
        self._t2 = _RecencyList()
        self._b1: OrderedDict[bytes, None] = OrderedDict()
        self._b2: OrderedDict[bytes, None] = OrderedDict()
        self._stamp: dict[bytes, int] = {}
        self._clock = 0
        self._next_cold: bytes | None = None
        self._now = clock
        self._retained: dict[bytes, float] = {}  # resident key -> deadline on ``clock``
        self._deadlines: list[tuple[float, bytes]] = []  # heap, for dropping expired retention
        self._priority: dict[bytes, int] = {}  # resident key -> its priority, when not 0
        self._levels: dict[int, int] = {}  # priority (not 0) -> how many resident keys have it

    def __repr__(self) -> str:
        return (
            f"<SessionPolicy capacity={self.capacity} bonus={self.bonus:g} cold={len(self._cold)} "
            f"t1={len(self._t1)} t2={len(self._t2)} b1={len(self._b1)} b2={len(self._b2)}>"
        )

    # Read-only views for tests and debugging, first victim first within each list.
    def cold(self) -> list[bytes]:
        return list(self._cold)

    def t1(self) -> list[bytes]:
        return list(self._t1)

    def t2(self) -> list[bytes]:
        return list(self._t2)

    def retained(self) -> list[bytes]:
        return list(self._retained)

    def hint_cold(self, key: bytes) -> None:
        """If the next key inserted is ``key``, it is cold: evicted before any other block until it is hit."""
        self._next_cold = key

    def retain(self, keys: Iterable[bytes], seconds: float) -> None:
        """Retain the resident ``keys`` for ``seconds`` (from now on the policy's clock): they are evicted only
        after every block without retention. Keys not resident are ignored; a longer retention is kept."""
        deadline = self._now() + seconds
        retained = self._retained
        stamp = self._stamp
        for key in keys:
            if key in stamp and retained.get(key, -math.inf) < deadline:
                retained[key] = deadline
                heapq.heappush(self._deadlines, (deadline, key))

    def priority(self, key: bytes) -> int:
        """The priority of ``key`` (0 for a block never given one, or not resident)."""
        return self._priority.get(key, 0)

    def set_priority(self, key: bytes, priority: int) -> None:
        """Give the resident ``key`` ``priority``: among blocks with the same retention status, lower
        priorities are evicted first (0 is every block's default). A key not resident is ignored."""
        if key not in self._stamp:
            return
        self._drop_priority(key)
        if priority:
            self._priority[key] = priority
            self._levels[priority] = self._levels.get(priority, 0) + 1

    def _drop_priority(self, key: bytes) -> None:
        old = self._priority.pop(key, 0)
        if old:
            levels = self._levels
            if levels[old] == 1:
                del levels[old]
            else:
                levels[old] -= 1

    def _expire(self) -> None:
        now = self._now()
        heap = self._deadlines
        retained = self._retained
        while heap and heap[0][0] <= now:
            deadline, key = heapq.heappop(heap)
            if retained.get(key) == deadline:
                del retained[key]
        if not retained:
            heap.clear()

    def insert(self, key: bytes, parent: bytes | None = None, depth: int = 0) -> None:
        if key in self._stamp:  # a second insert is a hit
            self.touch(key)
            return
        if key == self._next_cold:  # cold blocks take no clock tick: they are outside the T1/T2 order
            self._next_cold = None
            self._stamp[key] = self._clock
            self._cold.push(key, parent)
            return
        self._insert(key, parent)

    def _insert(self, key: bytes, parent: bytes | None) -> None:
        self._clock += 1
        self._stamp[key] = self._clock
        b1, b2 = self._b1, self._b2
        if key in b1:
            self.bonus = max(0.0, self.bonus - self._step * max(len(b2) / len(b1), 1.0))
            del b1[key]
            self._t2.push(key, parent)
        elif key in b2:
            self.bonus += self._step * max(len(b1) / len(b2), 1.0)
            del b2[key]
            self._t2.push(key, parent)
        else:
            self._t1.push(key, parent)

    def touch(self, key: bytes) -> None:
        if key not in self._stamp:
            return
        cold = self._cold
        if key in cold:  # a hit on a cold block: it joins the order as if stored now, then is hit
            parent = cold.parent(key)
            cold.pop(key)
            self._insert(key, parent)
        self._clock += 1
        self._stamp[key] = self._clock
        t1 = self._t1
        if key in t1:
            parent = t1.parent(key)
            t1.pop(key)
            self._t2.push(key, parent)
        else:
            self._t2.push(key, self._t2.parent(key))

    def remove(self, key: bytes, evicted: bool) -> None:
        if self._stamp.pop(key, None) is None:
            return
        if self._retained:
            self._retained.pop(key, None)
        if self._priority:
            self._drop_priority(key)
        if key in self._t1:
            self._t1.pop(key)
            ghosts = self._b1
        elif key in self._t2:
            self._t2.pop(key)
            ghosts = self._b2
        else:
            self._cold.pop(key)
            return
        if evicted and self._ghost_cap:
            ghosts[key] = None
            if len(ghosts) > self._ghost_cap:
                ghosts.popitem(last=False)

    def _t1_first(self, h1: bytes | None, h2: bytes | None) -> bool:
        # Whether T1's head goes before T2's head (one of them may be absent).
        if h2 is None:
            return True
        if h1 is None:
            return False
        return self._stamp[h1] <= self._stamp[h2] + self.bonus

    def candidates(self) -> Iterator[bytes]:
        if not self._retained and not self._priority:
            return self._candidates()
        now = self._now()
        retained = self._retained
        prios = self._priority
        levels = sorted({0, *self._levels})

        def group(held: bool, level: int) -> Iterator[bytes]:
            for k in self._candidates():
                if (retained.get(k, -math.inf) > now) is held and prios.get(k, 0) == level:
                    yield k

        # Without retention first, then the retained blocks; within each, priority ascending; within each
        # priority, the policy's order. Lazy: a caller stopping at the first victim pays only for the groups
        # it went through.
        return itertools.chain.from_iterable(
            group(held, level) for held in ((False, True) if retained else (False,)) for level in levels
        )

    def _candidates(self) -> Iterator[bytes]:
        yield from self._cold
        i1, i2 = iter(self._t1), iter(self._t2)
        h1, h2 = next(i1, None), next(i2, None)
        while h1 is not None or h2 is not None:
            if self._t1_first(h1, h2):
                yield h1  # type: ignore[misc]
                h1 = next(i1, None)
            else:
                yield h2  # type: ignore[misc]
                h2 = next(i2, None)

    def _pop_victim(self) -> bytes | None:
        if self._retained or self._priority:
            if self._retained:
                self._expire()
            if self._retained or self._priority:
                for key in self.candidates():
                    self.remove(key, evicted=True)
                    return key
                return None
        if self._cold:
            key = self._cold.pop_first()
            del self._stamp[key]
            return key
        t1, t2 = self._t1, self._t2
        h1 = next(iter(t1), None) if t1 else None
        h2 = next(iter(t2), None) if t2 else None
        if h1 is None and h2 is None:
            return None
        if self._t1_first(h1, h2):
            key = t1.pop_first()
            ghosts = self._b1
        else:
            key = t2.pop_first()
            ghosts = self._b2
        del self._stamp[key]
        if self._ghost_cap:
            ghosts[key] = None
            if len(ghosts) > self._ghost_cap:
                ghosts.popitem(last=False)
        return key

    def __len__(self) -> int:
        return len(self._stamp)

    def _native_replay_spec(self) -> tuple[Any, ...] | None:
        # ("session", capacity, ghost capacity, step, bonus): the C policy starts with empty lists, no
        # hint, no retention or priorities, and this bonus
        if (
            self._stamp
            or self._retained
            or self._priority
            or self._next_cold is not None
            or self._b1
            or self._b2
        ):
            return None
        return ("session", self.capacity, self._ghost_cap, self._step, self.bonus)


_EXPERTS: dict[str, Callable[[int], EvictionPolicy]] = {
    "arc": ARCPolicy,
    "chain-lru": lambda capacity: ChainLRUPolicy(),
    "lru": lambda capacity: LRUPolicy(),
    "session": lambda capacity: SessionPolicy(capacity),
}


class AdaptivePolicy(EvictionPolicy):
    """Follows whichever of several expert policies the workload currently rewards (``eviction="adaptive"``).

    - **Shadows.** Each expert (by default ``lru``, ``arc`` and ``session``: recency, frequency, session
      structure) runs as a *shadow*: an instance of that policy over its own key set of the tier's capacity
      (keys only, no data), fed every access this tier sees (a hit or a store of a resident key is an access;
      so is every insert). A shadow that misses inserts the key and, when full, evicts its own victim. Each
      shadow counts the *prefix hits* it would have had: a hit counts while every access before it down the
      same chain was a hit in that shadow too (the replay's and the engine's notion of a hit).
    - **Leadership.** Once per epoch (``max(capacity, 256)`` accesses, i.e. about one cache-full, and at least
      ``starts`` chain heads) each expert's score decays by ``decay`` and adds its epoch's prefix hits; the
      expert with the highest score leads (ties keep the leader). The defaults (``decay=0.997``, a horizon of
      about 330 cache-fulls of accesses, and ``starts=1``) were chosen by leave-one-workload-out
      cross-validation over six workloads (docs/policies.md); nothing is tuned per trace.
    - **Following.** The tier's victim is a resident key its leader's shadow does not hold (the one that left
      that shadow first), or, when the leader's shadow holds every resident key, the leader's own first victim
      among them. So a tier whose leader stays put converges to the leader's contents within one cache-full
      of evictions and then evicts exactly as it would: following a single expert *is* that expert
      (``tests/tiers/test_adaptive.py`` checks this for each built-in). Evicted keys stay in the shadows.
    - ``hint_cold`` reaches the experts that take hints. Retention and priorities are not supported (like
      ``lru`` and ``arc``): use ``session`` for them.

    Cost: every access is one access per expert, so about the sum of the experts' costs (O(1) amortized per
    expert, ``ChainLRUPolicy`` O(log n)); memory: each shadow's keys and ghosts (``session``'s ghosts are
    ``8 * capacity`` keys at most). An eviction may skip keys the leader's shadow holds but the tier dropped
    (``discard``), each at most once per shadow eviction.
    """

    name = "adaptive"

    def __init__(
        self,
        capacity: int,
        *,
        experts: Sequence[str] = ("lru", "arc", "session"),
        decay: float = 0.997,
        starts: int = 1,
    ) -> None:
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity <= 0:
            raise InvalidArgumentError(f"capacity must be a positive int, got {capacity!r}")
        if isinstance(experts, str) or not experts:
            raise InvalidArgumentError(
                f"experts must be a non-empty sequence of policy names, got {experts!r}"
            )
        names = list(experts)
        for name in names:
            if name not in _EXPERTS:
                raise InvalidArgumentError(f"experts must be names from {list(_EXPERTS)}, got {name!r}")
        if len(set(names)) != len(names):
            raise InvalidArgumentError(f"experts must not repeat a name, got {names}")
        if isinstance(decay, bool) or not isinstance(decay, (int, float)) or not 0 <= decay < 1:
            raise InvalidArgumentError(f"decay must be a number in [0, 1), got {decay!r}")
        if isinstance(starts, bool) or not isinstance(starts, int) or starts < 1:
            raise InvalidArgumentError(f"starts must be an int >= 1, got {starts!r}")
        self.capacity = capacity
        self.experts = tuple(names)
        self._shadows = [_EXPERTS[n](capacity) for n in names]
        self._has = [_holds(s) for s in self._shadows]
        self._out: list[OrderedDict[bytes, None]] = [OrderedDict() for _ in names]  # resident, not in shadow
        self._real: dict[bytes, bytes | None] = {}  # resident key -> parent
        self._score = [0.0] * len(names)
        self._epoch_hits = [0] * len(names)
        self._chain_ok = [False] * len(names)
        self._last: bytes | None = None
        self._leader = 0
        self._epoch_refs = max(capacity, 256)
        self._decay = float(decay)
        self._starts_needed = starts
        self._refs = 0
        self._starts = 0
        self.switches = 0

    def __repr__(self) -> str:
        return (
            f"<AdaptivePolicy capacity={self.capacity} leader={self.leader!r} "
            f"resident={len(self._real)} switches={self.switches}>"
        )

    @property
    def leader(self) -> str:
        """The name of the expert the tier follows now."""
        return self.experts[self._leader]

    def scores(self) -> dict[str, float]:
        """Each expert's decayed prefix-hit score (the current epoch's hits not yet included)."""
        return dict(zip(self.experts, self._score, strict=True))

    def shadow(self, name: str) -> EvictionPolicy:
        """The shadow of expert ``name`` (read-only use: tests and debugging)."""
        try:
            return self._shadows[self.experts.index(name)]
        except ValueError:
            raise InvalidArgumentError(
                f"name must be one of the experts {list(self.experts)}, got {name!r}"
            ) from None

    def hint_cold(self, key: bytes) -> None:
        """Forwarded to the experts that take hints (``session``)."""
        for shadow in self._shadows:
            hint = getattr(shadow, "hint_cold", None)
            if hint is not None:
                hint(key)

    def _access(self, key: bytes, parent: bytes | None, depth: int) -> None:
        walk = parent is None or parent == self._last
        real = self._real
        cap = self.capacity
        ok = self._chain_ok
        for i, shadow in enumerate(self._shadows):
            if self._has[i](key):
                if parent is None or (walk and ok[i]):
                    self._epoch_hits[i] += 1
                    ok[i] = True
                elif not walk:  # not a walk down a chain: no prefix to judge by
                    ok[i] = True
                shadow.touch(key)
            else:
                ok[i] = False
                if len(shadow) >= cap:
                    victim = shadow._pop_victim()
                    if victim is not None and victim in real:
                        self._out[i][victim] = None
                shadow.insert(key, parent, depth)
                self._out[i].pop(key, None)
        self._last = key
        self._refs += 1
        if parent is None:
            self._starts += 1
        if self._refs >= self._epoch_refs and self._starts >= self._starts_needed:
            self._end_epoch()

    def _end_epoch(self) -> None:
        self._refs = 0
        self._starts = 0
        score = self._score
        hits = self._epoch_hits
        for i in range(len(score)):
            score[i] = score[i] * self._decay + hits[i]
            hits[i] = 0
        lead = self._leader
        best = max(range(len(score)), key=lambda i: (score[i], i == lead))
        if best != lead:
            self._leader = best
            self.switches += 1

    def insert(self, key: bytes, parent: bytes | None = None, depth: int = 0) -> None:
        if key in self._real:  # a second insert is a hit
            self.touch(key)
            return
        self._real[key] = parent
        self._access(key, parent, depth)

    def touch(self, key: bytes) -> None:
        parent = self._real.get(key, _ABSENT)
        if parent is not _ABSENT:
            self._access(key, parent, 0)  # type: ignore[arg-type]

    def remove(self, key: bytes, evicted: bool) -> None:
        if self._real.pop(key, _ABSENT) is _ABSENT:
            return
        for out in self._out:
            out.pop(key, None)

    def candidates(self) -> Iterator[bytes]:
        lead = self._leader
        out = self._out[lead]
        real = self._real
        yield from list(out)
        for key in self._shadows[lead].candidates():
            if key in real and key not in out:
                yield key

    def _pop_victim(self) -> bytes | None:
        out = self._out[self._leader]
        real = self._real
        if out:
            key = next(iter(out))
        else:
            for key in self._shadows[self._leader].candidates():
                if key in real:
                    break
            else:
                return None
        del real[key]
        for o in self._out:
            o.pop(key, None)
        return key

    def __len__(self) -> int:
        return len(self._real)

    def _native_replay_spec(self) -> tuple[Any, ...] | None:
        # ("adaptive", capacity, (expert specs...), decay, starts, epoch_refs): the C policy starts with
        # fresh experts (lru, arc or session; not adaptive), zero scores and the first expert leading
        if (
            self._real
            or self._refs
            or self.switches
            or self._starts
            or self._leader
            or self._last is not None
            or any(self._score)
            or any(self._epoch_hits)
            or any(self._out)
        ):
            return None
        experts = tuple(s._native_replay_spec() for s in self._shadows)
        if any(e is None or e[0] == "adaptive" for e in experts):
            return None
        return ("adaptive", self.capacity, experts, self._decay, self._starts_needed, self._epoch_refs)


def _holds(policy: EvictionPolicy) -> Callable[[bytes], bool]:
    """A membership test for a shadow's resident keys."""
    if type(policy) is LRUPolicy:
        return policy._list._order.__contains__
    if type(policy) is ARCPolicy:
        t1, t2 = policy._t1._order, policy._t2._order
        return lambda key: key in t1 or key in t2
    if type(policy) is SessionPolicy:
        return policy._stamp.__contains__
    if type(policy) is ChainLRUPolicy:
        return policy._nodes.__contains__
    raise InvalidArgumentError(f"experts must be built-in policies {list(_EXPERTS)}, got {policy.name!r}")


_REGISTRY: dict[str, Callable[[int], EvictionPolicy]] = {
    "lru": lambda capacity: LRUPolicy(),
    "arc": ARCPolicy,
    "chain-lru": lambda capacity: ChainLRUPolicy(),
    "session": lambda capacity: SessionPolicy(capacity),
    "adaptive": lambda capacity: AdaptivePolicy(capacity),
}


def register_policy(name: str, factory: Callable[[int], EvictionPolicy]) -> None:
    """Make ``eviction=name`` available; ``factory(capacity_in_blocks)`` builds a fresh policy."""
    _REGISTRY[name] = factory


def policy_names() -> list[str]:
    """The registered policy names, sorted: ``["arc", "chain-lru", "lru", ...]``."""
    return sorted(_REGISTRY)


def make_policy(
    policy: str | EvictionPolicy | Callable[[int], EvictionPolicy], capacity: int
) -> EvictionPolicy:
    """Resolve an ``eviction=`` argument (a name, a policy instance or a factory) to a policy."""
    if isinstance(policy, EvictionPolicy):
        return policy
    if isinstance(policy, str):
        try:
            factory = _REGISTRY[policy]
        except KeyError:
            raise InvalidArgumentError(
                f"eviction must be one of {policy_names()} or an EvictionPolicy, got {policy!r}"
            ) from None
        return factory(capacity)
    if callable(policy):
        made = policy(capacity)
        if not isinstance(made, EvictionPolicy):
            raise InvalidArgumentError("eviction factory must return an EvictionPolicy")
        return made
    raise InvalidArgumentError(
        f"eviction must be a policy name, an EvictionPolicy or a factory, got {policy!r}"
    )
