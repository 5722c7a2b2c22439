"""BlockIndex's fast paths pinned to a straightforward reference.

The index has fast paths that must not change what is evicted: ``insert_chain`` and ``touch_prefix`` with the
LRU policy inlined, eviction through ``EvictionPolicy._pop_victim`` when nothing is pinned, and the built-in
policies' O(1) ``_pop_victim``. The reference below is the plain per-block protocol the index is specified by
(reserve evicts the first unpinned candidate and calls ``remove(key, evicted=True)``, commit inserts), over
list-based policies written for clarity rather than speed. Random operation sequences (the replay's
lookup-then-store, the offloader's reserve/commit/pin/unpin/discard) must give the same return values, slots,
victims, candidate order and stats after every step.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator, Sequence

import pytest

from aiokv.tiers import _index
from aiokv.tiers._index import BlockIndex
from aiokv.tiers._policies import ChainLRUPolicy, EvictionPolicy, LRUPolicy, SessionPolicy, make_policy


# ------------------------------------------------------------------------------------ reference policies
class RefRecency:
    """Recency list with chain runs, as the policies module specifies it: keys least recent first; the open
    run (consecutive pushes walking down one chain) is the tail of the list and iterates reversed."""

    def __init__(self) -> None:
        self.order: list[bytes] = []
        self.parent: dict[bytes, bytes | None] = {}
        self.run: list[bytes] = []
        self.last: bytes | None = None

    def push(self, key: bytes, parent: bytes | None) -> None:
        if parent is None or parent != self.last or key in self.run:
            for k in self.run:  # close the run: it takes the order it iterates in
                self.order.remove(k)
            self.order.extend(reversed(self.run))
            self.run = []
        if key in self.order:
            self.order.remove(key)
        self.order.append(key)
        self.parent[key] = parent
        self.run.append(key)
        self.last = key

    def pop(self, key: bytes) -> None:
        self.order.remove(key)
        del self.parent[key]
        if key in self.run:
            self.run.remove(key)

    def keys(self) -> list[bytes]:
        n = len(self.order) - len(self.run)
        return self.order[:n] + self.run[::-1]


class RefLRU(EvictionPolicy):
    name = "ref-lru"

    def __init__(self) -> None:
        self.lst = RefRecency()

    def insert(self, key: bytes, parent: bytes | None = None, depth: int = 0) -> None:
        self.lst.push(key, parent)

    def touch(self, key: bytes) -> None:
        if key in self.lst.parent:
            self.lst.push(key, self.lst.parent[key])

    def remove(self, key: bytes, evicted: bool) -> None:
        if key in self.lst.parent:
            self.lst.pop(key)

    def candidates(self) -> Iterator[bytes]:
        return iter(self.lst.keys())

    def __len__(self) -> int:
        return len(self.lst.order)


class RefARC(EvictionPolicy):
    """ARC as ARCPolicy documents it, on lists."""

    name = "ref-arc"

    def __init__(self, capacity: int) -> None:
        self.c = capacity
        self.p = 0.0
        self.t1 = RefRecency()
        self.t2 = RefRecency()
        self.b1: list[bytes] = []
        self.b2: list[bytes] = []

    def _trim(self) -> None:
        while self.b1 and len(self.t1.order) + len(self.b1) > self.c:
            self.b1.pop(0)
        while len(self.t1.order) + len(self.t2.order) + len(self.b1) + len(self.b2) > 2 * self.c:
            (self.b2 or self.b1).pop(0)

    def insert(self, key: bytes, parent: bytes | None = None, depth: int = 0) -> None:
        if key in self.b1:
            self.p = min(float(self.c), self.p + max(len(self.b2) / len(self.b1), 1.0))
            self.b1.remove(key)
            self.t2.push(key, parent)
        elif key in self.b2:
            self.p = max(0.0, self.p - max(len(self.b1) / len(self.b2), 1.0))
            self.b2.remove(key)
            self.t2.push(key, parent)
        else:
            self.t1.push(key, parent)
        self._trim()

    def touch(self, key: bytes) -> None:
        if key in self.t1.parent:
            parent = self.t1.parent[key]
            self.t1.pop(key)
            self.t2.push(key, parent)
        elif key in self.t2.parent:
            self.t2.push(key, self.t2.parent[key])

    def remove(self, key: bytes, evicted: bool) -> None:
        if key in self.t1.parent:
            self.t1.pop(key)
            if evicted:
                self.b1.append(key)
        elif key in self.t2.parent:
            self.t2.pop(key)
            if evicted:
                self.b2.append(key)
        else:
            return
        self._trim()

    def candidates(self) -> Iterator[bytes]:
        t1, t2 = self.t1.keys(), self.t2.keys()
        if t1 and (len(t1) > self.p or not t2):
            return iter(t1 + t2)
        return iter(t2 + t1)

    def __len__(self) -> int:
        return len(self.t1.order) + len(self.t2.order)


class FIFO(EvictionPolicy):
    """A user-defined policy with no _pop_victim of its own: the index's default hook must serve it."""

    name = "fifo"

    def __init__(self) -> None:
        self.keys: dict[bytes, None] = {}

    def insert(self, key: bytes, parent: bytes | None = None, depth: int = 0) -> None:
        self.keys.setdefault(key, None)

    def touch(self, key: bytes) -> None:
        pass

    def remove(self, key: bytes, evicted: bool) -> None:
        self.keys.pop(key, None)

    def candidates(self) -> Iterator[bytes]:
        return iter(list(self.keys))

    def __len__(self) -> int:
        return len(self.keys)


# ------------------------------------------------------------------------------------------ reference index
class RefIndex:
    """BlockIndex's rules, one block at a time, through the policy's public methods only."""

    def __init__(self, num_slots: int, policy: EvictionPolicy) -> None:
        self.policy = policy
        self.free = list(range(num_slots - 1, -1, -1))
        self.slot: dict[bytes, int] = {}
        self.ready: dict[bytes, bool] = {}
        self.pins: dict[bytes, int] = {}
        self.parent: dict[bytes, tuple[bytes | None, int]] = {}
        self.evicted: list[bytes] = []
        self.evictions = 0
        self.rejected = 0

    def _release(self, key: bytes) -> None:
        self.free.append(self.slot.pop(key))
        del self.ready[key], self.pins[key], self.parent[key]

    def reserve(self, key: bytes, parent: bytes | None = None, depth: int = 0) -> int | None:
        if key in self.slot:
            if self.ready[key]:
                self.policy.touch(key)
            return None
        if not self.free:
            victim = next((k for k in self.policy.candidates() if self.pins[k] == 0), None)
            if victim is None:
                self.rejected += 1
                return None
            self.policy.remove(victim, evicted=True)
            self._release(victim)
            self.evictions += 1
            self.evicted.append(victim)
        slot = self.free.pop()
        self.slot[key] = slot
        self.ready[key] = False
        self.pins[key] = 0
        self.parent[key] = (parent, depth)
        return slot

    def commit(self, key: bytes) -> None:
        self.ready[key] = True
        self.policy.insert(key, *self.parent[key])

    def _ready_run(self, keys: Sequence[bytes], start: int) -> list[bytes]:
        run: list[bytes] = []
        for key in keys[start:]:
            if not self.ready.get(key, False):
                break
            run.append(key)
        return run

    def touch_prefix(self, keys: Sequence[bytes], start: int = 0) -> int:
        run = self._ready_run(keys, start)
        for key in run:
            self.policy.touch(key)
        return len(run)

    def pin_prefix(self, keys: Sequence[bytes]) -> list[int]:
        run = self._ready_run(keys, 0)
        for key in run:
            self.pins[key] += 1
            self.policy.touch(key)
        return [self.slot[key] for key in run]

    def unpin(self, key: bytes) -> None:
        self.pins[key] -= 1

    def insert_chain(self, keys: Sequence[bytes], start: int = 0) -> int:
        inserted = 0
        for i in range(start, len(keys)):
            if self.reserve(keys[i], keys[i - 1] if i else None, i) is not None:
                self.commit(keys[i])
                inserted += 1
        return inserted

    def touch(self, key: bytes) -> None:
        if key in self.slot:
            self.policy.touch(key)

    def discard(self, key: bytes) -> bool:
        if key not in self.slot:
            return False
        if self.ready[key]:
            self.policy.remove(key, evicted=False)
        self._release(key)
        return True


# ---------------------------------------------------------------------------------------------- the run
def _chains(rng: random.Random) -> list[list[bytes]]:
    """Prefix-chained requests over a small block universe: shared heads, branching tails."""
    chains: list[list[bytes]] = []
    for root in range(4):
        for branch in range(3):
            depth = rng.randint(1, 7)
            chains.append([f"r{root}".encode()] + [f"r{root}b{branch}d{d}".encode() for d in range(1, depth)])
    # Degenerate chains (no hash chain does this): a key recurring in its own request, and two keys that end
    # up each other's parent, so a touch can find its key in the open run with its parent the last key.
    chains += [[b"loop", b"loop1", b"loop", b"loop1"], [b"cx", b"cy", b"cx"], [b"cy", b"cx", b"cy"]]
    return chains


def _compare(index: BlockIndex, ref: RefIndex) -> None:
    index.check_invariants()
    assert index.on_evict == ref.evicted
    assert list(index.policy.candidates()) == list(ref.policy.candidates())
    stats = index.stats()
    assert (stats.evictions, stats.rejected) == (ref.evictions, ref.rejected)
    assert stats.pinned == sum(1 for n in ref.pins.values() if n)
    for key, slot in ref.slot.items():
        assert index.slot(key) == slot
    assert len(index) == len(ref.slot)


def _run(seed: int, make: Callable[[int], tuple[EvictionPolicy, EvictionPolicy]], live: bool) -> None:
    """``live=False``: only what ``aiokv replay`` does (no pins, no pending entries). ``live=True`` mixes in
    the offloader's reserve/commit, pins and discards, so the slow paths and their hand-over are covered."""
    rng = random.Random(seed)
    slots = rng.randint(1, 12)
    fast_policy, ref_policy = make(slots)
    index = BlockIndex(slots, fast_policy)
    index.on_evict = []
    ref = RefIndex(slots, ref_policy)
    chains = _chains(rng)
    pending: list[bytes] = []
    for _ in range(150):
        chain = rng.choice(chains)
        op = rng.random() if live else rng.random() * 0.5
        if op < 0.35:  # the replay step: look up the leading run, then store the rest
            hit = index.touch_prefix(chain)
            assert hit == ref.touch_prefix(chain)
            assert index.insert_chain(chain, hit) == ref.insert_chain(chain, hit)
        elif op < 0.42:
            start = rng.randint(0, len(chain))
            assert index.touch_prefix(chain, start) == ref.touch_prefix(chain, start)
        elif op < 0.5:
            start = rng.randint(0, len(chain))
            assert index.insert_chain(chain, start) == ref.insert_chain(chain, start)
        elif op < 0.62:  # the offloader's store: reserve head first, commit later
            for i, key in enumerate(chain):
                parent = chain[i - 1] if i else None
                got = index.reserve(key, parent, i)
                assert got == ref.reserve(key, parent, i)
                if got is not None:
                    pending.append(key)
        elif op < 0.72 and pending:
            rng.shuffle(pending)
            for key in pending[: rng.randint(1, len(pending))]:
                pending.remove(key)
                if rng.random() < 0.8:
                    index.commit(key)
                    ref.commit(key)
                else:  # a failed copy
                    assert index.discard(key) == ref.discard(key) is True
        elif op < 0.8:
            assert index.pin_prefix(chain) == ref.pin_prefix(chain)
        elif op < 0.88:
            pinned = sorted(k for k, n in ref.pins.items() if n)
            if pinned:
                key = rng.choice(pinned)
                index.unpin([key])
                ref.unpin(key)
        elif op < 0.94:
            key = rng.choice(chain)
            index.touch(key)
            ref.touch(key)
        else:
            key = rng.choice(chain)
            if key not in pending and ref.pins.get(key, 0) == 0:
                assert index.discard(key) == ref.discard(key)
        _compare(index, ref)


POLICIES: dict[str, Callable[[int], tuple[EvictionPolicy, EvictionPolicy]]] = {
    "lru": lambda n: (make_policy("lru", n), RefLRU()),
    "arc": lambda n: (make_policy("arc", n), RefARC(n)),
    # chain-LRU against itself driven through candidates()/remove() only: pins its O(1) _pop_victim and the
    # index's fast paths to the protocol (test_policies pins the policy's own order to a from-scratch one).
    "chain-lru": lambda n: (make_policy("chain-lru", n), ChainLRUPolicy()),
    # session against itself driven through candidates()/remove() only (its O(1) _pop_victim vs the protocol).
    "session": lambda n: (make_policy("session", n), SessionPolicy(n)),
    "fifo": lambda n: (FIFO(), FIFO()),
}


@pytest.fixture(params=["native", "python"])
def lru_loops(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The LRU loops of touch_prefix/insert_chain in C (aiokv/_native/_lru.c) and in Python (the definition,
    and what runs without a compiler)."""
    if request.param == "python":
        monkeypatch.setattr(_index, "_native_lru", None)
    elif _index._native_lru is None:
        pytest.skip("aiokv._native._lru is not built (no C compiler at install time)")
    return str(request.param)


@pytest.mark.parametrize("name", sorted(POLICIES))
@pytest.mark.parametrize("live", [False, True], ids=["replay", "live"])
def test_fast_paths_match_the_reference(name: str, live: bool, lru_loops: str) -> None:
    for seed in range(60):
        _run(seed, POLICIES[name], live)


def test_the_reference_policies_are_the_documented_ones() -> None:
    """Guard the guard: the reference reproduces hand-computed orders from the policies' docstrings."""
    a0, a1, a2, x = b"a0", b"a1", b"a2", b"x"
    lru = RefLRU()
    for i, key in enumerate((a0, a1, a2)):
        lru.insert(key, (a0, a1, a2)[i - 1] if i else None, i)
    lru.insert(x)
    assert list(lru.candidates()) == [a2, a1, a0, x]  # the run closed head-most-recent
    arc = RefARC(2)
    arc.insert(a0)
    arc.touch(a0)  # reuse promotes to T2
    arc.insert(x)
    assert list(arc.candidates()) == [x, a0]
    arc.remove(x, evicted=True)
    assert arc.b1 == [x]
    arc.insert(x)  # a B1 ghost hit raises p and enters T2
    assert arc.p == 1.0
    assert arc.t2.keys() == [a0, x]


def test_a_custom_policy_without_pop_victim_gets_the_default_hook() -> None:
    policy = FIFO()
    index = BlockIndex(2, policy)
    index.on_evict = []
    assert index.insert_chain([b"a", b"b", b"c"]) == 3
    assert index.on_evict == [b"a"]
    assert policy._pop_victim() == b"b"
    assert policy._pop_victim() == b"c"
    assert policy._pop_victim() is None


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_a_touch_that_finds_its_key_in_the_open_run_closes_the_run(name: str, lru_loops: str) -> None:
    """Two keys that became each other's parent (a degenerate chain): touching the first again, right after
    the second, must close the open run instead of extending it."""
    x, y = b"x", b"y"
    fast_policy, ref_policy = POLICIES[name](4)
    index = BlockIndex(4, fast_policy)
    index.on_evict = []
    ref = RefIndex(4, ref_policy)
    steps: list[Callable[[BlockIndex | RefIndex], object]] = [
        lambda t: t.insert_chain([y, x]),  # x's parent is y
        lambda t: t.discard(y),
        lambda t: t.insert_chain([x, y]),  # y comes back as x's child
        lambda t: t.insert_chain([b"z"]),
        lambda t: t.touch_prefix([x, y, x]),  # the second x: its parent y is the last key, x is in the run
        lambda t: t.insert_chain([x, y, x, b"k"], 3),  # extends the run x opened
        lambda t: t.insert_chain([b"w", b"v"]),
    ]
    for step in steps:
        assert step(index) == step(ref)
        _compare(index, ref)


def test_a_subclass_that_reorders_candidates_is_evicted_by_its_own_order() -> None:
    """A built-in policy's O(1) pop must not bypass a subclass's candidates(): here most recent first."""

    class MRU(LRUPolicy):
        def candidates(self) -> Iterator[bytes]:
            return reversed(list(super().candidates()))

    index = BlockIndex(2, MRU())
    index.on_evict = []
    index.insert_ready(b"a")
    index.insert_ready(b"b")
    index.insert_ready(b"c")  # reserve -> _evict_one
    assert index.insert_chain([b"d"]) == 1  # the generic insert_chain path
    assert index.on_evict == [b"b", b"c"]
    assert MRU._pop_victim is EvictionPolicy._pop_victim
    assert LRUPolicy._pop_victim is not EvictionPolicy._pop_victim


def test_the_c_loops_refuse_bad_arguments_instead_of_reading_out_of_bounds() -> None:
    lru = _index._native_lru
    if lru is None:
        pytest.skip("aiokv._native._lru is not built (no C compiler at install time)")
    args = ({}, bytearray(1), {}, {}, None)
    with pytest.raises(ValueError, match="start must be >= 0"):
        lru.touch_prefix((b"a",), -1, *args)
    with pytest.raises(TypeError, match="keys must be a list or tuple"):
        lru.touch_prefix(iter([b"a"]), 0, *args)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="unexpected index or policy structures"):
        lru.touch_prefix([b"a"], 0, {}, b"x", {}, {}, None)  # type: ignore[arg-type]
    assert lru.touch_prefix([b"a"], 5, *args) == (0, None)  # start past the end: nothing to touch
