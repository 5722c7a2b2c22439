"""The store core (``aiokv.store.BlockStore``) on its own, synchronously, against a fake executor.

In the style of vLLM's offloading-manager tests: every operation is a plain call that returns a plan; the copies
are done (or failed, or delayed) by a fake worker the test drives, so every interleaving of prepare, copy and
complete is reachable without an event loop.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aiokv import RequestStateError
from aiokv.store import BlockStore, EntryState, StorePlan


def chain(n: int, tag: int = 0) -> list[bytes]:
    return [bytes([tag, i]) * 4 for i in range(n)]


# ------------------------------------------------------------------------------------------ store protocol
def test_a_store_is_invisible_until_completed() -> None:
    s = BlockStore(8, block_size=16)
    keys = chain(4)
    plan = s.prepare_store(keys)
    assert isinstance(plan, StorePlan)
    assert plan.keys == keys
    assert plan.positions == [0, 1, 2, 3]
    assert len(set(plan.slots)) == 4
    assert (plan.deduplicated, plan.dropped) == (0, 0)
    assert s.lookup(keys) == 0
    assert all(s.state(k) is EntryState.PENDING for k in keys)
    s.complete_store(plan.keys[:2])
    assert s.lookup(keys) == 2
    s.complete_store(plan.keys[2:])
    assert s.lookup(keys) == 4
    assert keys[3] in s
    st_ = s.stats()
    assert (st_.entries, st_.pending, st_.committed, st_.free_slots) == (4, 0, 4, 4)


def test_present_blocks_are_deduplicated_and_full_stores_drop() -> None:
    s = BlockStore(4, block_size=16)
    keys = chain(6)
    s.complete_store(s.prepare_store(keys, 0, 2).keys)
    # Keys 0, 1 are READY (touched, deduplicated); 2, 3 take the two free slots and stay PENDING; 4 and 5
    # evict the two READY keys (nothing else is evictable); nothing is dropped.
    plan = s.prepare_store(keys)
    assert plan.deduplicated == 2
    assert plan.keys == keys[2:]
    assert plan.dropped == 0
    # Now every slot is PENDING: a further store finds no room.
    more = s.prepare_store(chain(3, tag=9))
    assert more.keys == []
    assert more.dropped == 3
    st_ = s.stats()
    assert (st_.deduplicated, st_.dropped, st_.evictions) == (2, 3, 2)


def test_pending_and_pinned_blocks_are_never_evicted() -> None:
    s = BlockStore(3, block_size=16)
    a = chain(3, tag=1)
    plan = s.prepare_store(a)
    s.complete_store(plan.keys[:1])  # a[0] READY, a[1], a[2] PENDING
    slots = s.prepare_load(a[:1])  # a[0] pinned
    assert len(slots) == 1
    other = s.prepare_store(chain(2, tag=2))
    assert other.keys == []
    assert other.dropped == 2
    s.complete_load(a[:1])
    other = s.prepare_store(chain(1, tag=2))
    assert len(other.keys) == 1
    assert a[0] not in s


def test_a_failed_store_frees_its_slots_and_can_be_stored_again() -> None:
    s = BlockStore(4, block_size=16)
    keys = chain(4)
    plan = s.prepare_store(keys)
    s.complete_store(plan.keys, success=False)
    assert len(s) == 0
    assert s.stats().free_slots == 4
    assert s.stats().discarded == 4
    again = s.prepare_store(keys)
    assert again.keys == keys  # not taken for duplicates


@pytest.mark.parametrize("case", ["absent", "ready", "twice"])
def test_completing_what_is_not_pending_is_an_error_that_changes_nothing(case: str) -> None:
    s = BlockStore(8, block_size=16)
    keys = chain(3)
    plan = s.prepare_store(keys)
    s.complete_store(plan.keys[:1])
    bad = {"absent": [keys[1], b"nope"], "ready": [keys[1], keys[0]], "twice": [keys[1], keys[1]]}[case]
    before = (s.lookup(keys), s.stats())
    with pytest.raises(RequestStateError, match=r"complete_store: key .* nothing was changed"):
        s.complete_store(bad)
    with pytest.raises(RequestStateError):
        s.complete_store(bad, success=False)
    assert (s.lookup(keys), s.stats()) == before
    assert s.state(keys[1]) is EntryState.PENDING


def test_load_pins_until_completed_and_misuse_is_an_error() -> None:
    s = BlockStore(4, block_size=16)
    keys = chain(3)
    s.complete_store(s.prepare_store(keys).keys)
    slots = s.prepare_load([*keys, b"missing"])
    assert len(slots) == 3
    assert s.index.pins(keys[0]) == 1
    with pytest.raises(RequestStateError, match="not pinned"):
        s.complete_load([keys[0], keys[0]])  # pinned once, unpinned twice: refused whole
    assert s.index.pins(keys[0]) == 1
    s.complete_load(keys)
    with pytest.raises(RequestStateError, match="not pinned"):
        s.complete_load(keys[:1])
    s.prepare_load(keys[:1])
    with pytest.raises(RequestStateError, match="is pinned"):
        s.discard([keys[1], keys[0]])  # refused whole: keys[1] (unpinned) stays too
    assert keys[1] in s
    s.complete_load(keys[:1])
    assert s.discard([keys[1], b"absent"]) == 1
    assert keys[1] not in s


def test_discard_refuses_pending_reservations() -> None:
    """A pending key's copy may still write its slot: only complete_store(success=False) may end it."""
    s = BlockStore(4, block_size=16)
    plan = s.prepare_store(chain(2))
    with pytest.raises(RequestStateError, match="pending reservation"):
        s.discard(plan.keys)
    assert all(s.state(k) is EntryState.PENDING for k in plan.keys)
    assert s.stats().free_slots == 2


@pytest.mark.parametrize(
    ("call", "exc", "match"),
    [
        (lambda s, c: s.prepare_store(c, priority=200), ValueError, r"priority must be in \[-128, 127\]"),
        (lambda s, c: s.prepare_store(c, priority=1.5), TypeError, "priority must be an int"),
        (lambda s, c: s.prepare_store(c, tenant="t"), TypeError, "tenant must be bytes or None"),
        (lambda s, c: s.prepare_store([*c, "k"]), TypeError, r"chain\[3\] must be bytes"),
        (lambda s, c: s.prepare_store(c, 0, True), TypeError, "end must be an int"),
        (lambda s, c: s.prepare_store_one("k"), TypeError, "key must be bytes"),
        (lambda s, c: s.prepare_store_one(c[0], priority=-129), ValueError, "priority must be in"),
        (lambda s, c: s.prepare_fill(c, 0, 3, tenant=1), TypeError, "tenant must be bytes or None"),
    ],
)
def test_bad_reservations_raise_before_the_index_changes(call, exc, match) -> None:  # type: ignore[no-untyped-def]
    s = BlockStore(4, block_size=16)
    keys = chain(3)
    s.complete_store(s.prepare_store(keys, 0, 1).keys)
    before = (s.stats(), s.index.free_slots(), s.lookup(keys))
    with pytest.raises(exc, match=match):
        call(s, keys)
    assert (s.stats(), s.index.free_slots(), s.lookup(keys)) == before
    s.index.check_invariants()


def test_fill_pins_what_arrived_and_releases_the_rest() -> None:
    s = BlockStore(8, block_size=16)
    keys = chain(5)
    s.complete_store(s.prepare_store(keys, 0, 1).keys)
    got, slots = s.prepare_fill(keys, 1, 5)
    assert got == keys[1:5]
    assert len(slots) == 4
    before = s.stats().dropped
    with pytest.raises(Exception, match="arrived must be an int in"):
        s.complete_fill(got, 5)
    pinned = s.complete_fill(got, 2)
    assert pinned == keys[1:3]
    assert s.lookup(keys) == 3
    assert s.state(keys[3]) is None
    assert s.index.pins(keys[1]) == 1
    assert s.index.pins(keys[0]) == 0
    assert s.stats().dropped == before  # staging is not a store decision
    # A fill stops at the first block it cannot reserve (present): the run must be a prefix.
    got2, _ = s.prepare_fill(keys, 0, 5)
    assert got2 == []


def test_bad_ranges_and_arguments_name_the_parameter() -> None:
    with pytest.raises(TypeError, match="num_slots must be an int"):
        BlockStore(2.0, block_size=16)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="num_slots must be > 0"):
        BlockStore(0, block_size=16)
    with pytest.raises(ValueError, match="block_size must be an int > 0"):
        BlockStore(4, block_size=0)
    with pytest.raises(ValueError, match="eviction must be one of"):
        BlockStore(4, block_size=16, eviction="nope")
    s = BlockStore(4, block_size=16)
    with pytest.raises(ValueError, match="start and end must satisfy"):
        s.prepare_store(chain(2), 1, 3)
    with pytest.raises(ValueError, match="start and end must satisfy"):
        s.prepare_fill(chain(2), 2, 1)
    with pytest.raises(RequestStateError, match="not ready"):
        s.pin(b"absent")


def test_tenant_quotas_and_priorities_reach_the_index() -> None:
    s = BlockStore(8, block_size=16, eviction="session")
    s.index.set_tenant_quota(lambda tenant: 2 if tenant == b"t" else None)
    plan = s.prepare_store(chain(4), tenant=b"t", priority=50)
    assert len(plan.keys) == 2
    assert plan.dropped == 2
    s.complete_store(plan.keys)
    assert s.index.tenant_slots(b"t") == 2
    assert s.index.policy.priority(plan.keys[0]) == 50  # type: ignore[attr-defined]


# --------------------------------------------------------------------------------------------- events
@dataclass
class Sink:
    stored_: list[tuple[bytes, object]] = field(default_factory=list)
    removed_: list[bytes] = field(default_factory=list)

    def stored(self, keys, infos=None):  # type: ignore[no-untyped-def]
        self.stored_ += list(zip(keys, infos or [None] * len(keys), strict=True))

    def removed(self, keys):  # type: ignore[no-untyped-def]
        self.removed_ += list(keys)


@dataclass
class Origin:
    salt: object
    token_ids: list[int]


def test_events_name_parent_tokens_and_tenant_and_report_evictions() -> None:
    s = BlockStore(2, block_size=2)
    sink = Sink()
    s.record_events(sink)
    keys = chain(3)
    origin = Origin("salt", [10, 11, 12, 13, 14, 15])
    plan = s.prepare_store(keys, 0, 2, origin=origin)
    assert sink.stored_ == []  # pending: not stored yet
    s.complete_store(plan.keys)
    assert sink.stored_ == [
        (keys[0], (None, 2, "salt", [10, 11])),
        (keys[1], (keys[0], 2, "salt", [12, 13])),
    ]
    failed = s.prepare_store(keys, 2, 3, origin=origin)  # evicts the chain's tail first: keys[1]
    assert sink.removed_ == [keys[1]]
    s.complete_store(failed.keys, success=False)
    assert len(sink.stored_) == 2  # a failed store is never reported
    one = s.prepare_store_one(keys[2], keys[1], 2, origin=origin, num_tokens=1)  # evicts keys[0]
    assert one is not None
    s.complete_store([keys[2]])
    assert sink.stored_[-1] == (keys[2], (keys[1], 1, "salt", [14]))
    with pytest.raises(TypeError, match="sink must have stored"):
        s.record_events(object())  # type: ignore[arg-type]


# ------------------------------------------------------------------- a fake executor, random schedules
@dataclass
class FakeWorker:
    """Copies between engine blocks and CPU slots when the test says so; each copy is (kind, keys, pairs)."""

    engine: dict[int, bytes]
    cpu: dict[int, bytes]
    queue: list[tuple[str, list[bytes], list[tuple[int, int]]]] = field(default_factory=list)

    def run(self, i: int, fail: bool) -> tuple[str, list[bytes], list[tuple[int, int]], bool]:
        kind, keys, pairs = self.queue.pop(i)
        if not fail:
            for block, slot in pairs:
                if kind == "store":
                    self.cpu[slot] = self.engine[block]
                else:
                    self.engine[block] = self.cpu[slot]
        return kind, keys, pairs, not fail


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), num_slots=st.integers(2, 12))
def test_random_schedules_never_load_another_blocks_data(seed: int, num_slots: int) -> None:
    """Stores and loads of overlapping chains, copies run out of order, some fail: every load that completes
    copies each key's own bytes, and the index stays consistent."""
    rng = random.Random(seed)
    s = BlockStore(num_slots, block_size=4, eviction=rng.choice(["lru", "arc", "session"]))
    chains = [chain(rng.randint(1, 8), tag=t) for t in range(4)]
    data = {k: b"kv:" + k for c in chains for k in c}  # what each key's block holds in the engine
    w = FakeWorker(engine={}, cpu={})
    nblock = 0
    loaded = 0
    for _ in range(80):
        op = rng.random()
        c = rng.choice(chains)
        if op < 0.4:
            plan = s.prepare_store(c, 0, rng.randint(0, len(c)))
            pairs = []
            for key, slot in zip(plan.keys, plan.slots, strict=True):
                w.engine[nblock] = data[key]
                pairs.append((nblock, slot))
                nblock += 1
            if plan.keys:
                w.queue.append(("store", plan.keys, pairs))
        elif op < 0.7:
            slots = s.prepare_load(c)
            if slots:
                pairs = []
                for slot in slots:
                    pairs.append((nblock, slot))
                    nblock += 1
                w.queue.append(("load", c[: len(slots)], pairs))
        elif w.queue:
            kind, keys, pairs, ok = w.run(rng.randrange(len(w.queue)), fail=rng.random() < 0.15)
            if kind == "store":
                s.complete_store(keys, success=ok)
            else:
                s.complete_load(keys)
                if ok:
                    loaded += 1
                    for key, (block, _slot) in zip(keys, pairs, strict=True):
                        assert w.engine[block] == data[key], "a load copied another block's bytes"
        s.index.check_invariants()
        for key, slot in ((k, s.index.slot(k)) for k in data if k in s):
            assert w.cpu[slot] == data[key], "a READY key's slot holds another block's bytes"
    while w.queue:
        kind, keys, _pairs, _ok = w.run(0, fail=False)
        (s.complete_store if kind == "store" else s.complete_load)(keys)
    assert s.stats().pending == 0
    assert s.index.stats().pinned == 0
