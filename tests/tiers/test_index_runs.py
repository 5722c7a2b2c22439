"""``BlockIndex.reserve_run`` / ``commit_run`` against a loop of ``reserve`` / ``commit``: the store path's one
loop must decide exactly what the per-block calls decide (slots, present keys, refusals, evictions, pending
counts, the policy's order), under eviction pressure, present keys, pins, priorities and tenant quotas."""

from __future__ import annotations

import random

import pytest

from aiokv.tiers._index import BlockIndex
from aiokv.tiers._policies import make_policy


def _snapshot(index: BlockIndex) -> tuple[object, ...]:
    return (
        sorted(index._slots.items()),
        bytes(index._state),
        index._depth.tobytes(),
        index._prio.tobytes(),
        list(index._parent),
        index._pending,
        index._rejected,
        index._evictions,
        index.ready_keys(),
        index.free_slots(),
    )


def _loop_reserve(
    index: BlockIndex, chain: list[bytes], start: int, end: int, tenant: bytes | None, priority: int
) -> tuple[list[int], list[int], int]:
    positions, slots, present = [], [], 0
    for i in range(start, end):
        if index.state(chain[i]) is not None:
            present += 1
        slot = index.reserve(chain[i], chain[i - 1] if i else None, i, tenant, priority)
        if slot is not None:
            positions.append(i)
            slots.append(slot)
    return positions, slots, present


@pytest.mark.parametrize("policy", ["lru", "arc", "session"])
@pytest.mark.parametrize("quota", [False, True])
@pytest.mark.parametrize("seed", range(8))
def test_runs_decide_exactly_what_per_block_calls_decide(policy: str, quota: bool, seed: int) -> None:
    rng = random.Random(seed)
    num_slots = 24
    indexes = [BlockIndex(num_slots, make_policy(policy, num_slots)) for _ in range(2)]
    if quota:
        for ix in indexes:
            ix.set_tenant_quota(lambda tenant: 6 if tenant == b"small" else None)
    # A few chains sharing prefixes, so runs meet present keys; twice the capacity, so they meet eviction.
    chains = [
        [f"c{c % 3}-{i}".encode() if i < 3 else f"c{c}-{i}".encode() for i in range(16)] for c in range(6)
    ]
    pinned: dict[int, list[bytes]] = {id(ix): [] for ix in indexes}
    for _ in range(60):
        chain = rng.choice(chains)
        start = rng.randrange(0, 12)
        end = rng.randrange(start, 17)
        tenant = rng.choice([None, b"small", b"big"])
        priority = rng.randrange(-2, 3)
        got = indexes[0].reserve_run(chain, start, end, tenant, priority)
        want = _loop_reserve(indexes[1], chain, start, end, tenant, priority)
        assert got == want
        keys = [chain[i] for i in got[0]]
        if rng.random() < 0.8:  # the copy completed
            indexes[0].commit_run(keys)
            for k in keys:
                indexes[1].commit(k)
        else:  # it failed
            for ix in indexes:
                for k in keys:
                    ix.discard(k)
        for ix in indexes:  # a reader's pins from the last round end; a new reader pins a prefix for a while
            ix.unpin(pinned[id(ix)])
            pinned[id(ix)] = []
        if rng.random() < 0.4:
            prefix = rng.choice(chains)[:4]
            for ix in indexes:
                pinned[id(ix)] = prefix[: len(ix.pin_prefix(prefix))]
        assert _snapshot(indexes[0]) == _snapshot(indexes[1])
