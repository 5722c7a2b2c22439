"""Eviction policies on hand-computed sequences, driven the way BlockIndex drives them."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aiokv._errors import InvalidArgumentError
from aiokv.testing import FakeClock as _FakeClock
from aiokv.tiers._policies import (
    ARCPolicy,
    ChainLRUPolicy,
    EvictionPolicy,
    LRUPolicy,
    SessionPolicy,
    make_policy,
    policy_names,
    register_policy,
)

a, b, c, d, x, y = (k.encode() for k in "abcdxy")


def evict(policy: EvictionPolicy) -> bytes:
    """What BlockIndex does when nothing is pinned: take the first candidate, tell the policy."""
    victim = next(policy.candidates())
    policy.remove(victim, evicted=True)
    return victim


def order(policy: EvictionPolicy) -> list[bytes]:
    return list(policy.candidates())


# ---------------------------------------------------------------------------------------------- registry
def test_registry_names_and_factories() -> None:
    assert {"lru", "arc", "chain-lru"} <= set(policy_names())
    assert isinstance(make_policy("lru", 4), LRUPolicy)
    arc = make_policy("arc", 4)
    assert isinstance(arc, ARCPolicy)
    assert arc.capacity == 4
    assert isinstance(make_policy("chain-lru", 4), ChainLRUPolicy)
    session = make_policy("session", 4)
    assert isinstance(session, SessionPolicy)
    assert session.capacity == 4


def test_make_policy_rejects_unknown_name() -> None:
    with pytest.raises(InvalidArgumentError, match=r"eviction must be one of \[.*'arc'.*\]"):
        make_policy("mru", 4)


def test_register_policy_adds_a_name() -> None:
    register_policy("test-lru", lambda capacity: LRUPolicy())
    try:
        assert "test-lru" in policy_names()
        assert isinstance(make_policy("test-lru", 1), LRUPolicy)
    finally:
        from aiokv.tiers import _policies

        del _policies._REGISTRY["test-lru"]


def test_arc_rejects_bad_capacity() -> None:
    with pytest.raises(InvalidArgumentError, match="capacity must be a positive int, got 0"):
        ARCPolicy(0)


# ---------------------------------------------------------------------------------------------------- LRU
def test_lru_orders_independent_keys_by_recency() -> None:
    p = LRUPolicy()
    for k in (a, b, c):
        p.insert(k)
    p.touch(a)
    assert order(p) == [b, c, a]
    p.touch(x)  # unknown keys are ignored
    assert evict(p) == b
    assert order(p) == [c, a]
    assert len(p) == 2


def test_lru_chain_inserted_head_first_evicts_tail_first() -> None:
    p = LRUPolicy()
    p.insert(a, None, 0)
    p.insert(b, a, 1)
    p.insert(c, b, 2)
    assert order(p) == [c, b, a]
    p.insert(d)  # closes the run
    assert order(p) == [c, b, a, d]


def test_lru_chain_hit_counts_as_one_access_with_head_most_recent() -> None:
    p = LRUPolicy()
    p.insert(a, None, 0)
    p.insert(b, a, 1)
    p.insert(c, b, 2)
    p.insert(d)
    p.touch(a)  # a request hits a, b (head first)
    p.touch(b)
    assert order(p) == [c, d, b, a]
    assert evict(p) == c
    assert order(p) == [d, b, a]


def test_lru_run_breaks_when_parent_is_not_the_last_key() -> None:
    p = LRUPolicy()
    p.insert(a)
    p.insert(x)
    p.insert(b, a, 1)  # a's child, but x came in between: a separate, more recent access
    assert order(p) == [a, x, b]


def test_lru_remove_inside_open_run() -> None:
    p = LRUPolicy()
    p.insert(a, None, 0)
    p.insert(b, a, 1)
    p.insert(c, b, 2)
    p.remove(b, evicted=False)
    assert order(p) == [c, a]
    p.insert(d)
    assert order(p) == [c, a, d]


# ---------------------------------------------------------------------------------------------------- ARC
def test_arc_promotes_on_reuse() -> None:
    p = ARCPolicy(2)
    p.insert(a)
    p.insert(b)
    assert (p.t1(), p.t2()) == ([a, b], [])
    p.touch(a)
    assert (p.t1(), p.t2()) == ([b], [a])
    p.touch(a)  # a hit in T2 stays in T2
    assert (p.t1(), p.t2()) == ([b], [a])


def test_arc_hand_computed_sequence_adapts_p_on_ghost_hits() -> None:
    p = ARCPolicy(2)
    p.insert(a)
    p.insert(b)
    p.touch(a)  # T1=[b] T2=[a]
    assert evict(p) == b  # len(T1)=1 > p=0
    assert p.b1() == [b]
    p.insert(c)  # T1=[c]
    assert evict(p) == c
    assert p.b1() == [b, c]
    p.insert(b)  # ghost hit in B1: p += max(|B2|/|B1|, 1) = 1; b enters T2
    assert p.p == 1.0
    assert (p.t1(), p.t2(), p.b1()) == ([], [a, b], [c])
    assert evict(p) == a  # T1 empty: from T2
    assert p.b2() == [a]
    p.insert(d)  # T1=[d]
    assert order(p) == [b, d]  # len(T1)=1 is not > p=1: T2 first
    assert evict(p) == b
    assert p.b2() == [a, b]
    p.insert(a)  # ghost hit in B2: p -= max(|B1|/|B2|, 1) = 1
    assert p.p == 0.0
    assert (p.t1(), p.t2(), p.b2()) == ([d], [a], [b])
    assert order(p) == [d, a]


def test_arc_ghost_lists_are_bounded_by_capacity() -> None:
    p = ARCPolicy(1)
    p.insert(a)
    assert evict(p) == a
    assert p.b1() == [a]
    p.insert(b)  # |T1| + |B1| would be 2 > 1: the oldest ghost goes
    assert (p.t1(), p.b1()) == ([b], [])


def test_arc_dropped_keys_leave_no_ghost() -> None:
    p = ARCPolicy(4)
    p.insert(a)
    p.insert(b)
    p.touch(b)
    p.remove(a, evicted=False)
    p.remove(b, evicted=False)
    assert (p.t1(), p.t2(), p.b1(), p.b2()) == ([], [], [], [])
    assert len(p) == 0


def test_arc_random_operations_keep_the_paper_bounds() -> None:
    rng = random.Random(7)
    cap = 5
    p = ARCPolicy(cap)
    resident: set[bytes] = set()
    for _ in range(3000):
        key = bytes([rng.randrange(20)])
        if key in resident:
            p.touch(key)
        else:
            if len(resident) == cap:
                resident.discard(evict(p))
            p.insert(key)
            resident.add(key)
        assert set(p.candidates()) == resident
        assert len(p.t1()) + len(p.b1()) <= cap
        assert len(p.t1()) + len(p.t2()) + len(p.b1()) + len(p.b2()) <= 2 * cap
        assert 0 <= p.p <= cap
        assert not set(p.b1() + p.b2()) & resident


# ---------------------------------------------------------------------------------------------- chain-LRU
def test_chain_lru_evicts_leaves_first() -> None:
    p = ChainLRUPolicy()
    p.insert(a, None, 0)  # stamp 1
    p.insert(b, a, 1)  # 2
    p.insert(c, b, 2)  # 3
    p.insert(x)  # 4
    assert order(p) == [c, x, a, b]  # leaves by age, then inner blocks by age
    assert evict(p) == c
    assert order(p) == [b, x, a]  # b became a leaf with its own (old) stamp
    p.touch(a)  # inner block: its recency counts once it is a leaf
    assert evict(p) == b
    assert order(p) == [x, a]


def test_chain_lru_keeps_a_head_that_plain_lru_would_orphan() -> None:
    """The head's access is older than its child's (the store came in a later step): LRU evicts the head and
    strands the child; chain-LRU evicts an unrelated leaf."""
    lru, chain = LRUPolicy(), ChainLRUPolicy()
    for p in (lru, chain):
        p.insert(a, None, 0)
        p.insert(x)
        p.insert(b, a, 1)
    assert evict(lru) == a
    assert evict(chain) == x
    assert order(chain) == [b, a]


def test_chain_lru_touch_refreshes_a_leaf() -> None:
    p = ChainLRUPolicy()
    p.insert(a)
    p.insert(x)
    p.touch(a)
    assert order(p) == [x, a]


def test_chain_lru_dropped_inner_block_detaches_its_children() -> None:
    p = ChainLRUPolicy()
    p.insert(a, None, 0)
    p.insert(b, a, 1)
    p.remove(a, evicted=False)  # e.g. a failed read dropped the head
    assert order(p) == [b]
    p.insert(a, None, 0)  # a comes back as a fresh root with no known children
    assert order(p) == [b, a]
    p.remove(b, evicted=True)  # b's detached parent must not be revived
    assert order(p) == [a]
    assert len(p) == 1


def test_chain_lru_candidates_skip_stale_heap_entries() -> None:
    p = ChainLRUPolicy()
    for i in range(200):
        p.insert(bytes([i % 256, i // 256]))
    keys = list(p.candidates())
    for k in keys[:150]:
        p.touch(k)
    assert list(p.candidates()) == keys[150:] + keys[:150]
    assert len(p._heap) <= 2 * len(p) + 64


def test_chain_lru_matches_a_reference_on_random_chains() -> None:
    """Reference: the victim is the resident leaf with the oldest access, recomputed from scratch."""
    rng = random.Random(3)
    p = ChainLRUPolicy()
    parent: dict[bytes, bytes | None] = {}
    last: dict[bytes, int] = {}
    clock = 0
    for step in range(2000):
        if len(parent) > 12:
            leaves = [k for k in parent if not any(pp == k for pp in parent.values())]
            want = min(leaves, key=last.__getitem__)
            assert evict(p) == want
            del parent[want]
            continue
        clock += 1
        if parent and rng.random() < 0.4:
            key = rng.choice(sorted(parent))
            p.touch(key)
            last[key] = clock
            continue
        par = rng.choice([None, *sorted(parent)])
        key = f"k{step}".encode()
        p.insert(key, par, 0)
        parent[key] = par
        last[key] = clock
    assert set(p.candidates()) == set(parent)


@pytest.mark.parametrize("name", ["lru", "arc", "chain-lru", "session"])
def test_candidates_tolerate_early_stop_and_do_not_mutate(name: str) -> None:
    p = make_policy(name, 8)
    prev: bytes | None = None
    for i in range(6):
        key = bytes([i])
        p.insert(key, prev, i)
        prev = key
    full = list(p.candidates())
    it = p.candidates()
    next(it)
    next(it)
    del it
    assert list(p.candidates()) == full
    assert sorted(full) == [bytes([i]) for i in range(6)]


# ------------------------------------------------------------------------------------------------ session
@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"capacity": 0}, r"capacity must be a positive int, got 0"),
        ({"capacity": True}, r"capacity must be a positive int, got True"),
        ({"capacity": 4, "ghost": -1}, r"ghost must be an int >= 0, got -1"),
        ({"capacity": 4, "step": -1.0}, r"step must be a finite number >= 0, got -1.0"),
        ({"capacity": 4, "step": float("nan")}, r"step must be a finite number >= 0, got nan"),
        ({"capacity": 4, "step": float("inf")}, r"step must be a finite number >= 0, got inf"),
    ],
)
def test_session_rejects_bad_arguments(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(InvalidArgumentError, match=message):
        SessionPolicy(**kwargs)  # type: ignore[arg-type]


def test_session_bonus_zero_is_lru_and_a_large_bonus_protects_reused_blocks() -> None:
    """b is stored after a and never hit; a is hit after b was stored. LRU evicts b, then a, then c (stored
    last); with a bonus of 8 ticks the reused a outlives the newer c."""
    for bonus, want in ((0.0, [b, a, c]), (8.0, [b, c, a])):
        p = SessionPolicy(8)
        p.bonus = bonus
        p.insert(a)  # tick 1
        p.insert(b)  # tick 2
        p.touch(a)  # tick 3: a moves to T2
        p.insert(c)  # tick 4
        assert p.t1() == [b, c]
        assert p.t2() == [a]
        assert order(p) == want
        assert [evict(p) for _ in range(3)] == want


def test_session_starts_with_a_bonus_of_one_capacity() -> None:
    assert SessionPolicy(8).bonus == 8.0


def test_session_chain_runs_evict_the_tail_first() -> None:
    p = SessionPolicy(8)
    p.insert(a)
    p.insert(b, a, 1)
    p.insert(c, b, 2)
    p.insert(x)
    assert order(p) == [c, b, a, x]


def test_session_cold_hint_evicts_the_hinted_block_first_until_it_is_hit() -> None:
    p = SessionPolicy(8)
    p.insert(a)
    p.hint_cold(b)
    p.insert(b, a, 1)  # the hinted key: cold
    p.insert(c)  # not hinted: the hint was used
    assert p.cold() == [b]
    assert order(p) == [b, a, c]
    p.touch(b)  # a hit: a reused block now
    assert p.cold() == []
    assert p.t2() == [b]
    assert order(p)[-1] == b


def test_session_cold_hint_for_another_key_is_ignored() -> None:
    p = SessionPolicy(8)
    p.hint_cold(x)
    p.insert(a)
    assert p.cold() == []
    assert order(p) == [a]


def test_session_ghost_hits_adapt_the_bonus_like_arc() -> None:
    """Capacity 4, step 1: a B1 ghost hit lowers the bonus by max(|B2|/|B1|, 1), a B2 ghost hit raises it by
    max(|B1|/|B2|, 1), and either enters T2."""
    p = SessionPolicy(4, step=1.0)
    assert p.bonus == 4.0
    p.insert(a)
    p.insert(b)
    p.insert(c)
    p.touch(c)  # c in T2
    assert evict(p) == a  # T1 head, stamp 1 <= 4 + 4
    assert evict(p) == b
    p.bonus = 0.0
    assert evict(p) == c  # T2 head, now alone
    # ghosts: B1 = [a, b], B2 = [c]
    p.insert(a)  # B1 ghost: bonus - max(1/2, 1), floored at 0
    assert p.bonus == 0.0
    assert p.t2() == [a]
    p.insert(c)  # B2 ghost: bonus + max(|B1|/|B2|, 1) = 0 + max(1/1, 1)
    assert p.bonus == 1.0
    assert p.t2() == [a, c]


def test_session_ghost_lists_are_bounded() -> None:
    p = SessionPolicy(2, ghost=2)
    for i in range(20):
        p.insert(bytes([i]))
        if len(p) > 2:
            evict(p)
    assert len(p._b1) <= 4
    assert len(p._b2) <= 4
    q = SessionPolicy(2, ghost=0)
    for i in range(5):
        q.insert(bytes([i]))
        evict(q)
    assert len(q._b1) == 0


def test_session_dropped_keys_leave_no_ghost() -> None:
    p = SessionPolicy(4)
    p.insert(a)
    p.remove(a, evicted=False)
    assert len(p) == 0
    assert len(p._b1) == 0
    p.insert(a)
    assert p.t1() == [a]  # not a ghost hit


@settings(max_examples=150, deadline=None)
@given(
    ops=st.lists(
        st.tuples(st.sampled_from(["insert", "touch", "drop", "evict", "hint"]), st.integers(0, 11)),
        max_size=80,
    ),
    capacity=st.integers(1, 6),
)
def test_session_pop_victim_is_the_first_candidate_and_candidates_are_the_resident_keys(
    ops: list[tuple[str, int]], capacity: int
) -> None:
    """The contract the index relies on, under random inserts, hits, drops, evictions and cold hints:
    candidates() yields each resident key once, reading it changes nothing, and _pop_victim() takes the
    first candidate."""
    p = SessionPolicy(capacity, step=0.5)
    resident: set[bytes] = set()
    for op, n in ops:
        key = bytes([n])
        parent = bytes([n - 1]) if n % 3 else None
        if op == "insert" and key not in resident:
            p.insert(key, parent, n % 3)
            resident.add(key)
        elif op == "touch":
            p.touch(key)
        elif op == "drop" and key in resident:
            p.remove(key, evicted=False)
            resident.discard(key)
        elif op == "evict":
            first = next(p.candidates(), None)
            assert p._pop_victim() == first
            resident.discard(first)  # type: ignore[arg-type]
        elif op == "hint":
            p.hint_cold(key)
        listed = list(p.candidates())
        assert len(listed) == len(set(listed)) == len(p)
        assert set(listed) == resident
        assert list(p.candidates()) == listed


def _Clock() -> _FakeClock:
    """aiokv.testing.FakeClock, starting at 100.0 s."""
    return _FakeClock(100.0)


def test_session_retained_blocks_go_after_the_others_until_the_deadline() -> None:
    clock = _Clock()
    p = SessionPolicy(8, clock=clock)
    for key in (a, b, c):
        p.insert(key)
    p.retain([a, b, x], 10.0)  # x is not resident: ignored
    assert p.retained() == [a, b]
    assert order(p) == [c, a, b]
    clock.now = 109.9
    assert evict(p) == c
    assert p._pop_victim() == a  # everything is retained: still evictable, in the usual order
    clock.now = 110.0  # b's retention is over
    p.insert(d)
    assert order(p) == [b, d]
    assert p._pop_victim() == b
    assert p.retained() == []


def test_session_retention_keeps_the_longer_deadline_and_dropped_keys_lose_it() -> None:
    clock = _Clock()
    p = SessionPolicy(8, clock=clock)
    p.insert(a)
    p.insert(b)
    p.retain([a], 10.0)
    p.retain([a], 1.0)
    clock.now = 105.0
    assert order(p) == [b, a]
    p.remove(a, evicted=False)
    assert p.retained() == []
    p.insert(a)
    assert order(p) == [b, a]  # a fresh insert, not retained
    assert p.retained() == []


def test_session_lower_priority_blocks_go_first_then_the_usual_order() -> None:
    p = SessionPolicy(8)
    for key in (a, b, c, d):
        p.insert(key)
    p.set_priority(a, 5)
    p.set_priority(c, -1)
    p.set_priority(x, 9)  # x is not resident: ignored
    assert (p.priority(a), p.priority(b), p.priority(c), p.priority(x)) == (5, 0, -1, 0)
    assert order(p) == [c, b, d, a]
    assert p._pop_victim() == c
    assert evict(p) == b
    p.set_priority(a, 0)  # back to the default: recency decides again
    assert order(p) == [a, d]


def test_session_retention_comes_before_priority() -> None:
    """No retention before retention, then priority ascending, then the policy's order."""
    clock = _Clock()
    p = SessionPolicy(8, clock=clock)
    for key in (a, b, c, d):
        p.insert(key)
    p.set_priority(a, 3)
    p.set_priority(b, 3)
    p.retain([c, b], 10.0)
    assert order(p) == [d, a, c, b]
    clock.now = 110.0  # retention is over: priority alone
    assert order(p) == [c, d, a, b]
    assert p._pop_victim() == c


def test_session_priority_is_forgotten_with_the_block() -> None:
    p = SessionPolicy(8)
    p.insert(a)
    p.insert(b)
    p.set_priority(a, 7)
    p.remove(a, evicted=False)
    assert p.priority(a) == 0
    assert p._levels == {}
    p.insert(a)
    assert order(p) == [b, a]  # recency: a is newer, and its old priority is gone
    p.insert(c)
    p.set_priority(b, 2)
    assert evict(p) == a
    assert p._pop_victim() == c
    assert p._pop_victim() == b
    assert (p._priority, p._levels) == ({}, {})


@given(
    ops=st.lists(
        st.tuples(st.sampled_from(["insert", "touch", "drop", "evict", "prio"]), st.integers(0, 9)),
        max_size=80,
    )
)
def test_session_with_priorities_pop_victim_is_the_first_candidate(ops: list[tuple[str, int]]) -> None:
    """Under random operations with priorities: candidates() yields every resident key once, ordered by
    priority, and _pop_victim() takes the first."""
    p = SessionPolicy(4, step=0.5)
    resident: set[bytes] = set()
    for op, n in ops:
        key = bytes([n])
        if op == "insert" and key not in resident:
            p.insert(key)
            resident.add(key)
        elif op == "touch":
            p.touch(key)
        elif op == "drop" and key in resident:
            p.remove(key, evicted=False)
            resident.discard(key)
        elif op == "evict":
            first = next(p.candidates(), None)
            assert p._pop_victim() == first
            resident.discard(first)  # type: ignore[arg-type]
        elif op == "prio":
            p.set_priority(key, n % 3 - 1)
        listed = list(p.candidates())
        assert set(listed) == resident
        assert len(listed) == len(p)
        prios = [p.priority(k) for k in listed]
        assert prios == sorted(prios)
        assert sum(p._levels.values()) == len(p._priority)
