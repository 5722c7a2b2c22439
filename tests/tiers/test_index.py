"""BlockIndex: manager scenarios in the style of vLLM's offloading-manager tests, and a model-based state
machine run with every registered policy."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from aiokv.tiers._index import BlockIndex, EntryState
from aiokv.tiers._policies import ARCPolicy, LRUPolicy, SessionPolicy, make_policy

POLICIES = ["lru", "arc", "chain-lru", "session"]


def k(name: str) -> bytes:
    return name.encode()


def store(index: BlockIndex, keys: list[bytes]) -> list[int | None]:
    """Store a chain head first, the way the offloader does: reserve everything, then commit."""
    slots = [index.reserve(key, keys[i - 1] if i else None, i) for i, key in enumerate(keys)]
    for key, slot in zip(keys, slots, strict=True):
        if slot is not None:
            index.commit(key)
    index.check_invariants()
    return slots


@pytest.fixture(params=POLICIES)
def policy(request: pytest.FixtureRequest) -> str:
    return str(request.param)


# ----------------------------------------------------------------------------------------- scenarios
def test_pending_entries_are_invisible_to_lookups(policy: str) -> None:
    index = BlockIndex(4, make_policy(policy, 4))
    slot = index.reserve(k("a"))
    assert slot == 0
    assert index.state(k("a")) is EntryState.PENDING
    assert k("a") not in index
    assert index.match_prefix([k("a")]) == 0
    assert index.pin_prefix([k("a")]) == []
    index.commit(k("a"))
    assert index.match_prefix([k("a")]) == 1
    index.check_invariants()


def test_pending_entries_are_never_evicted(policy: str) -> None:
    index = BlockIndex(2, make_policy(policy, 2))
    assert index.reserve(k("a")) is not None
    assert index.reserve(k("b")) is not None
    assert index.reserve(k("c")) is None  # "no room now" is a value
    assert index.stats().rejected == 1
    assert index.state(k("a")) is EntryState.PENDING
    index.check_invariants()


def test_pinned_entries_are_never_evicted(policy: str) -> None:
    index = BlockIndex(2, make_policy(policy, 2))
    store(index, [k("a")])
    store(index, [k("b")])
    assert index.pin_prefix([k("a")]) == [index.slot(k("a"))]
    assert index.pin_prefix([k("b")]) == [index.slot(k("b"))]
    assert index.reserve(k("c")) is None
    index.unpin([k("b")])
    assert index.reserve(k("c")) is not None
    assert k("b") not in index
    assert k("a") in index
    assert index.pins(k("a")) == 1
    index.check_invariants()


def test_eviction_is_atomic_and_reuses_the_victims_slot(policy: str) -> None:
    index = BlockIndex(2, make_policy(policy, 2))
    index.on_evict = []
    store(index, [k("a")])
    store(index, [k("b")])
    victim_slot = {key: index.slot(key) for key in (k("a"), k("b"))}
    slot = index.reserve(k("c"))
    [victim] = index.on_evict
    assert slot == victim_slot[victim]
    assert index.state(victim) is None
    assert victim not in set(index.policy.candidates())
    assert index.stats().evictions == 1
    assert index.free_slots() == 0
    index.check_invariants()


def test_failed_store_discard_removes_the_entry(policy: str) -> None:
    index = BlockIndex(2, make_policy(policy, 2))
    slot = index.reserve(k("a"))
    assert index.discard(k("a"))
    assert index.state(k("a")) is None
    assert index.free_slots() == 2
    assert not index.discard(k("a"))
    assert index.reserve(k("b")) == slot  # the slot is free again
    index.commit(k("b"))
    assert index.discard(k("b"))  # a ready entry can be dropped too (corrupt read)
    assert list(index.policy.candidates()) == []
    index.check_invariants()


def test_reserve_of_a_present_key_touches_it(policy: str) -> None:
    index = BlockIndex(4, make_policy(policy, 4))
    store(index, [k("a")])
    assert index.reserve(k("a")) is None
    assert index.stats().rejected == 0
    index.check_invariants()


@pytest.mark.parametrize("policy_name", ["lru", "chain-lru"])
def test_lru_keeps_a_prefix_head_longer_than_its_tail(policy_name: str) -> None:
    index = BlockIndex(3, make_policy(policy_name, 3))
    index.on_evict = []
    store(index, [k("a0"), k("a1"), k("a2")])
    store(index, [k("x")])
    assert index.on_evict == [k("a2")]
    assert index.match_prefix([k("a0"), k("a1"), k("a2")]) == 2
    # A hit on the remaining prefix renews it as one access; the unrelated block goes next.
    index.unpin([k("a0"), k("a1")]) if index.pin_prefix([k("a0"), k("a1")]) else None
    store(index, [k("y")])
    assert index.on_evict == [k("a2"), k("x")]
    store(index, [k("z")])
    assert index.on_evict == [k("a2"), k("x"), k("a1")]


def test_arc_promotes_on_reuse_and_keeps_the_reused_block() -> None:
    index = BlockIndex(2, ARCPolicy(2))
    index.on_evict = []
    store(index, [k("a")])
    index.unpin([k("a")]) if index.pin_prefix([k("a")]) else None  # reuse: T1 -> T2
    store(index, [k("b")])
    store(index, [k("c")])
    assert index.on_evict == [k("b")]  # plain LRU would have evicted a
    lru = BlockIndex(2, make_policy("lru", 2))
    lru.on_evict = []
    store(lru, [k("a")])
    lru.unpin([k("a")]) if lru.pin_prefix([k("a")]) else None
    store(lru, [k("b")])
    store(lru, [k("c")])
    assert lru.on_evict == [k("a")]


def test_insert_ready_is_reserve_plus_commit(policy: str) -> None:
    index = BlockIndex(2, make_policy(policy, 2))
    assert index.insert_ready(k("a")) == 0
    assert k("a") in index
    assert index.insert_ready(k("a")) is None
    index.check_invariants()


def test_touch_prefix_counts_the_ready_run_from_start_and_pins_nothing(policy: str) -> None:
    index = BlockIndex(8, make_policy(policy, 8))
    chain = [k("a"), k("b"), k("c"), k("d")]
    store(index, chain[:3])
    index.reserve(k("d"), k("c"), 3)  # pending: invisible
    assert index.touch_prefix(chain) == 3
    assert index.touch_prefix(chain, 1) == 2
    assert index.touch_prefix(chain, 3) == 0
    assert index.touch_prefix([k("x"), *chain]) == 0
    assert index.stats().pinned == 0
    index.check_invariants()


def test_touch_prefix_refreshes_like_pin_prefix() -> None:
    index = BlockIndex(3, make_policy("lru", 3))
    index.on_evict = []
    store(index, [k("a")])
    store(index, [k("b")])
    store(index, [k("c")])
    assert index.touch_prefix([k("a")]) == 1
    store(index, [k("d")])
    assert index.on_evict == [k("b")]


def test_insert_chain_links_parents_and_counts_new_keys(policy: str) -> None:
    index = BlockIndex(8, make_policy(policy, 8))
    chain = [k("a"), k("b"), k("c")]
    assert index.insert_chain(chain) == 3
    assert all(key in index for key in chain)
    assert index.insert_chain([*chain, k("d")], 1) == 1  # b, c touched; d inserted with parent c
    assert index.insert_chain(chain) == 0
    if policy == "chain-lru":
        assert next(index.policy.candidates()) == k("d")  # the only leaf
    index.check_invariants()


def test_insert_chain_skips_keys_that_find_no_room(policy: str) -> None:
    index = BlockIndex(2, make_policy(policy, 2))
    index.reserve(k("p"))  # pending: cannot be evicted
    store(index, [k("q")])
    index.pin_prefix([k("q")])
    assert index.insert_chain([k("a"), k("b")]) == 0
    assert index.stats().rejected == 2
    index.check_invariants()


# ------------------------------------------------------------------------------------- state machine
CHAIN_PARENT: dict[bytes, bytes | None] = {}
CHAIN_DEPTH: dict[bytes, int] = {}
for _root in range(3):
    _prev: bytes | None = None
    for _d in range(4):
        _key = f"r{_root}d{_d}".encode()
        CHAIN_PARENT[_key] = _prev
        CHAIN_DEPTH[_key] = _d
        _prev = _key
KEYS = sorted(CHAIN_PARENT)


def chain_of(key: bytes) -> list[bytes]:
    out: list[bytes] = []
    cur: bytes | None = key
    while cur is not None:
        out.append(cur)
        cur = CHAIN_PARENT[cur]
    return out[::-1]


@dataclass
class _Modeled:
    state: EntryState
    pins: int = 0


class IndexMachine(RuleBasedStateMachine):
    """Model: key -> (state, pins). The index must agree with it after every step."""

    policy_name = "lru"
    num_slots = 5

    def __init__(self) -> None:
        super().__init__()
        self.index = BlockIndex(self.num_slots, make_policy(self.policy_name, self.num_slots))
        self.index.on_evict = []
        self.model: dict[bytes, _Modeled] = {}

    def _ready(self, key: bytes) -> bool:
        entry = self.model.get(key)
        return entry is not None and entry.state is EntryState.READY

    def _leading_ready(self, keys: list[bytes]) -> int:
        n = 0
        for key in keys:
            if not self._ready(key):
                break
            n += 1
        return n

    def _apply_evictions(self, before: int) -> None:
        assert self.index.on_evict is not None
        evicted = self.index.on_evict[before:]
        assert len(evicted) <= 1, "one reserve evicts at most one entry"
        for victim in evicted:
            entry = self.model.pop(victim)
            assert entry.state is EntryState.READY, "a pending entry was evicted"
            assert entry.pins == 0, "a pinned entry was evicted"

    @rule(key=st.sampled_from(KEYS))
    def reserve(self, key: bytes) -> None:
        assert self.index.on_evict is not None
        before = len(self.index.on_evict)
        present = key in self.model
        evictable = any(e.state is EntryState.READY and e.pins == 0 for e in self.model.values())
        full = len(self.model) == self.num_slots
        slot = self.index.reserve(key, CHAIN_PARENT[key], CHAIN_DEPTH[key])
        self._apply_evictions(before)
        if present:
            assert slot is None
        elif full and not evictable:
            assert slot is None, "reserve succeeded with every slot pending or pinned"
        else:
            assert slot is not None, "reserve failed although a slot was free or evictable"
            self.model[key] = _Modeled(EntryState.PENDING)

    @rule(data=st.data())
    def commit(self, data: st.DataObject) -> None:
        pending = sorted(key for key, e in self.model.items() if e.state is EntryState.PENDING)
        if not pending:
            return
        key = data.draw(st.sampled_from(pending))
        self.index.commit(key)
        self.model[key].state = EntryState.READY

    @rule(data=st.data())
    def discard(self, data: st.DataObject) -> None:
        unpinned = sorted(key for key, e in self.model.items() if e.pins == 0)
        if not unpinned:
            return
        key = data.draw(st.sampled_from(unpinned))
        assert self.index.discard(key)
        del self.model[key]

    @rule(key=st.sampled_from(KEYS))
    def pin_chain(self, key: bytes) -> None:
        chain = chain_of(key)
        want = self._leading_ready(chain)
        slots = self.index.pin_prefix(chain)
        assert len(slots) == want, "pin_prefix saw a pending or missing entry"
        for hit in chain[:want]:
            self.model[hit].pins += 1

    @rule(data=st.data())
    def unpin(self, data: st.DataObject) -> None:
        pinned = sorted(key for key, e in self.model.items() if e.pins)
        if not pinned:
            return
        key = data.draw(st.sampled_from(pinned))
        self.index.unpin([key])
        self.model[key].pins -= 1

    @rule(key=st.sampled_from(KEYS))
    def lookup(self, key: bytes) -> None:
        chain = chain_of(key)
        assert self.index.match_prefix(chain) == self._leading_ready(chain)
        self.index.touch(key)

    @precondition(lambda self: len(self.model) < self.num_slots)
    @rule(key=st.sampled_from(KEYS))
    def insert_ready(self, key: bytes) -> None:
        assert self.index.on_evict is not None
        before = len(self.index.on_evict)
        slot = self.index.insert_ready(key, CHAIN_PARENT[key], CHAIN_DEPTH[key])
        self._apply_evictions(before)
        assert (slot is None) == (key in self.model)
        if slot is not None:  # a present key (pending or ready) is only touched
            self.model[key] = _Modeled(EntryState.READY)

    @rule(key=st.sampled_from(KEYS))
    def touch_prefix(self, key: bytes) -> None:
        chain = chain_of(key)
        assert self.index.touch_prefix(chain) == self._leading_ready(chain)

    @rule(key=st.sampled_from(KEYS), start=st.integers(0, 3))
    def insert_chain(self, key: bytes, start: int) -> None:
        assert self.index.on_evict is not None
        chain = chain_of(key)
        start = min(start, len(chain))
        inserted = 0
        for i in range(start, len(chain)):  # one reserve at a time, each checked like the reserve rule
            before = len(self.index.on_evict)
            present = chain[i] in self.model
            evictable = any(e.state is EntryState.READY and e.pins == 0 for e in self.model.values())
            full = len(self.model) == self.num_slots
            got = self.index.insert_chain(chain[: i + 1], i)
            self._apply_evictions(before)
            if present or (full and not evictable):
                assert got == 0
            else:
                assert got == 1
                self.model[chain[i]] = _Modeled(EntryState.READY)
            inserted += got
        assert inserted <= len(chain) - start

    @invariant()
    def agrees_with_model(self) -> None:
        index = self.index
        index.check_invariants()
        assert len(index) == len(self.model) <= self.num_slots
        for key in KEYS:
            entry = self.model.get(key)
            assert index.state(key) is (None if entry is None else entry.state)
            assert index.pins(key) == (0 if entry is None else entry.pins)
        stats = index.stats()
        assert stats.pinned == sum(1 for e in self.model.values() if e.pins)
        assert stats.pending == sum(1 for e in self.model.values() if e.state is EntryState.PENDING)


_SETTINGS = settings(
    max_examples=60,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


class LRUIndexMachine(IndexMachine):
    policy_name = "lru"


class ARCIndexMachine(IndexMachine):
    policy_name = "arc"


class ChainLRUIndexMachine(IndexMachine):
    policy_name = "chain-lru"


TestLRUIndexMachine = LRUIndexMachine.TestCase
TestLRUIndexMachine.settings = _SETTINGS
TestARCIndexMachine = ARCIndexMachine.TestCase
TestARCIndexMachine.settings = _SETTINGS
TestChainLRUIndexMachine = ChainLRUIndexMachine.TestCase
TestChainLRUIndexMachine.settings = _SETTINGS


class SessionIndexMachine(IndexMachine):
    policy_name = "session"


TestSessionIndexMachine = SessionIndexMachine.TestCase
TestSessionIndexMachine.settings = _SETTINGS


def test_reserve_priority_reaches_the_session_policy_at_commit_and_a_restore_raises_it() -> None:
    policy = SessionPolicy(8)
    index = BlockIndex(3, policy)
    for key, prio in ((k("a"), 5), (k("b"), 0), (k("c"), -2)):
        index.reserve(key, priority=prio)
    assert policy.priority(k("a")) == 0  # pending: not in the policy yet
    for key in (k("a"), k("b"), k("c")):
        index.commit(key)
    assert list(policy.candidates()) == [k("c"), k("b"), k("a")]
    assert index.reserve(k("c"), priority=1) is None  # stored again by a higher priority: raised
    assert index.reserve(k("b"), priority=-5) is None  # never lowered
    assert (policy.priority(k("b")), policy.priority(k("c"))) == (0, 1)
    assert index.reserve(k("d"), priority=3) is not None  # full: evicts the lowest priority, b
    assert k("b") not in index
    assert index.state(k("b")) is None
    assert index.reserve(k("d"), priority=9) is None  # pending: the raise is kept for the commit
    index.commit(k("d"))
    assert policy.priority(k("d")) == 9
    index.check_invariants()


def test_reserve_priority_is_ignored_by_a_policy_without_priorities() -> None:
    index = BlockIndex(2, LRUPolicy())
    index.reserve(k("a"), priority=50)
    index.reserve(k("b"))
    index.commit(k("a"))
    index.commit(k("b"))
    assert index.reserve(k("c"), priority=50) is not None
    assert k("a") not in index  # LRU: the least recent, whatever its priority
