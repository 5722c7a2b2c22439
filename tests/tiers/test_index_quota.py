"""Per-tenant quotas in the block index: over quota, a tenant's own entries are evicted first, another
tenant's never."""

from __future__ import annotations

import random

import pytest

from aiokv._errors import InvalidArgumentError
from aiokv.tiers._index import BlockIndex
from aiokv.tiers._policies import make_policy

A, B = b"tenant-a", b"tenant-b"


def k(name: str) -> bytes:
    return name.encode()


def _index(slots: int, quotas: dict[bytes, int | None], policy: str = "lru") -> BlockIndex:
    index = BlockIndex(slots, make_policy(policy, slots))
    index.set_tenant_quota(quotas.get)
    index.on_evict = []
    return index


def _put(index: BlockIndex, key: str, tenant: bytes | None) -> int | None:
    slot = index.reserve(k(key), None, 0, tenant)
    if slot is not None:
        index.commit(k(key))
    index.check_invariants()
    return slot


@pytest.mark.parametrize("policy", ["lru", "arc", "chain-lru", "session"])
def test_over_quota_evicts_the_tenants_own_oldest_block_not_anothers(policy: str) -> None:
    """8 slots, tenant a limited to 2: a1, b1, a2 stored; a3 evicts a1 (a's oldest) although b1 is older
    than a2 and slots are free."""
    index = _index(8, {A: 2}, policy)
    _put(index, "a1", A)
    _put(index, "b1", B)
    _put(index, "a2", A)
    assert _put(index, "a3", A) is not None
    assert index.on_evict == [k("a1")]
    assert index.tenant_slots(A) == 2
    assert index.tenant_slots(B) == 1
    assert index.free_slots() == 8 - 3


def test_a_tenant_at_quota_with_only_pinned_or_pending_entries_is_refused() -> None:
    index = _index(8, {A: 2})
    _put(index, "a1", A)
    assert index.reserve(k("a2"), None, 0, A) is not None  # pending: counts, cannot be evicted
    index.pin(k("a1"))
    assert index.reserve(k("a3"), None, 0, A) is None
    assert index.stats().rejected == 1
    assert index.on_evict == []
    index.unpin([k("a1")])
    assert index.reserve(k("a3"), None, 0, A) is not None  # now a1 can go
    assert index.on_evict == [k("a1")]
    index.check_invariants()


def test_a_zero_quota_stores_nothing_and_no_quota_is_unlimited() -> None:
    index = _index(4, {A: 0, B: None})
    assert _put(index, "a1", A) is None
    for i in range(4):
        assert _put(index, f"b{i}", B) is not None
    assert index.tenant_slots(B) == 4
    assert _put(index, "x", b"unlisted") is not None  # a tenant without a quota: the usual LRU eviction
    assert index.on_evict == [k("b0")]


def test_a_full_tier_still_evicts_across_tenants_for_a_tenant_under_quota() -> None:
    """The quota only limits the tenant over it: a tenant under its quota may take the least recent block of
    any tenant when the tier is full."""
    index = _index(2, {A: 2, B: 2})
    _put(index, "b1", B)
    _put(index, "b2", B)
    assert _put(index, "a1", A) is not None
    assert index.on_evict == [k("b1")]


def test_reserve_without_a_tenant_counts_for_nobody() -> None:
    index = _index(4, {A: 1})
    _put(index, "x", None)
    _put(index, "a1", A)
    assert index.tenant_slots(A) == 1
    assert _put(index, "a2", A) is not None
    assert index.on_evict == [k("a1")]


def test_discard_and_eviction_release_the_tenants_slots() -> None:
    index = _index(2, {A: 2})
    _put(index, "a1", A)
    _put(index, "a2", A)
    assert index.discard(k("a1"))
    assert index.tenant_slots(A) == 1
    _put(index, "b1", B)
    _put(index, "b2", B)  # full: evicts a2 (least recent), which releases a's slot
    assert index.tenant_slots(A) == 0
    index.check_invariants()


def test_quotas_must_be_set_before_the_first_reserve() -> None:
    index = BlockIndex(2, make_policy("lru", 2))
    index.reserve(k("x"))
    with pytest.raises(InvalidArgumentError, match="tenant quotas must be set before the first entry"):
        index.set_tenant_quota(lambda tenant: None)


@pytest.mark.parametrize("policy", ["lru", "arc", "session"])
def test_random_operations_never_exceed_a_quota_nor_evict_another_tenant_for_it(policy: str) -> None:
    """Seeded random reserves, commits, pins, discards and chain inserts from three tenants with quotas 3, 5
    and none over 8 slots: after every step no tenant is over its quota, and an eviction made for a tenant
    at quota took that tenant's own entry."""
    quotas: dict[bytes, int | None] = {b"t0": 3, b"t1": 5, b"t2": None}
    tenants = list(quotas)
    for seed in range(40):
        rng = random.Random(seed)
        index = _index(8, quotas, policy)
        assert index.on_evict is not None
        pending: list[bytes] = []
        owner: dict[bytes, bytes] = {}
        for step in range(120):
            tenant = rng.choice(tenants)
            key = f"{tenant.decode()}-{rng.randrange(12)}".encode()
            op = rng.random()
            before = len(index.on_evict)
            at_quota = (q := quotas[tenant]) is not None and index.tenant_slots(tenant) >= q
            if op < 0.5:
                if index.reserve(key, None, 0, tenant) is not None:
                    owner[key] = tenant
                    if rng.random() < 0.8:
                        index.commit(key)
                    else:
                        pending.append(key)
                for victim in index.on_evict[before:]:
                    if at_quota:
                        assert owner[victim] == tenant, (seed, step)
                    del owner[victim]
            elif op < 0.65 and pending:
                index.commit(pending.pop(rng.randrange(len(pending))))
            elif op < 0.8:
                if index.pin_prefix([key]) and rng.random() < 0.5:
                    index.unpin([key])
            elif op < 0.9:
                if key in owner and key not in pending and index.pins(key) == 0:
                    index.discard(key)
                    del owner[key]
            else:
                for other in list(owner):
                    if index.pins(other):
                        index.unpin([other] * index.pins(other))
            index.check_invariants()
            for t, q in quotas.items():
                if q is not None:
                    assert index.tenant_slots(t) <= q, (seed, step)
