"""Backing tiers report their content changes to a TierEvents sink: the disk tier exactly (commits, its own
evictions, corrupt entries dropped, entries recovered at open), Redis as far as this process can see
(acknowledged writes; removals it observes: a lookup or read that finds a value gone, a corrupt value)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis

from aiokv.events import EventKind, KVEventLog, TierEvents
from aiokv.tiers import DiskTier, FaultyTier
from aiokv.tiers.redis import RedisTier

from . import _entries as entries

pytestmark = pytest.mark.asyncio
PB = 4096


def sink(log: KVEventLog, name: str, medium: str) -> TierEvents:
    return TierEvents(log, name, medium, 16)


def held(log: KVEventLog, name: str) -> set[bytes]:
    return set(log.snapshot().tiers.get(name, {}))


async def test_the_disk_tier_reports_commits_evictions_corrupt_drops_and_recovery(tmp_path: Path) -> None:
    spec = entries.spec(PB, entries.FP)
    keys = entries.keys(6)
    data = entries.payloads(6, PB)
    log = KVEventLog()
    disk = DiskTier(tmp_path / "d", 4 * (PB + 4096), io_threads=1, preallocate=False)
    tier = FaultyTier(disk, corrupt_keys={keys[3]})
    assert tier.medium == "DISK"
    tier.attach_events(sink(log, "disk", tier.medium))
    await tier.open(spec)
    try:
        slots = disk.stats().num_slots
        assert await tier.write(keys[:slots], data[:slots]) == slots
        assert held(log, "disk") == set(keys[:slots]) == set(disk._local().ready_keys())
        assert await tier.write(keys[slots:], data[slots:]) == len(keys) - slots  # evicts the oldest
        assert held(log, "disk") == set(disk._local().ready_keys())
        removed = [
            k for e in log.events_since(0) or [] if e.kind is EventKind.REMOVED for k in e.block_hashes
        ]
        assert len(removed) == len(keys) - slots
        assert keys[3] in held(log, "disk")  # stored corrupt at rest; read: dropped, reported removed
        assert await tier.read_into([keys[3]], entries.outs(1, PB)) == 0
        assert keys[3] not in held(log, "disk")
        assert disk.stats().corrupt == 1
        assert held(log, "disk") == set(disk._local().ready_keys())
    finally:
        await tier.aclose()
    # Reopened, the directory's entries are reported stored again (a new log: a new offloader's).
    log2 = KVEventLog()
    again = DiskTier(tmp_path / "d", 4 * (PB + 4096), io_threads=1, preallocate=False)
    again.attach_events(sink(log2, "disk", "DISK"))
    await again.open(spec)
    try:
        assert held(log2, "disk") == set(again._local().ready_keys())
        assert held(log2, "disk")
    finally:
        await again.aclose()


async def test_redis_reports_acknowledged_writes_and_the_removals_it_observes(
    redis_server: Any, namespace: str
) -> None:
    log = KVEventLog()
    tier = RedisTier(redis_server.url, namespace=namespace)
    assert tier.medium == "REMOTE"
    tier.attach_events(sink(log, "redis", tier.medium))
    await tier.open(entries.spec(PB, entries.FP))
    raw = aioredis.Redis.from_url(redis_server.url)
    try:
        keys = entries.keys(4, tag=namespace)
        assert await tier.write(keys, entries.payloads(4, PB)) == 4
        assert held(log, "redis") == set(keys)
        stored = log.events_since(0) or []
        assert all(e.kind is EventKind.STORED for e in stored)
        # Without an offloader resolving parents, every block is reported as a chain of its own.
        assert [k for e in stored for k in e.block_hashes] == keys
        # The server drops two values on its own (TTL, maxmemory): a lookup and a read notice.
        await raw.delete(tier.redis_key(keys[1]))
        assert await tier.lookup(keys) == 1
        assert held(log, "redis") == {keys[0], keys[2], keys[3]}
        await raw.delete(tier.redis_key(keys[3]))
        assert await tier.read_into([keys[3]], entries.outs(1, PB)) == 0
        assert held(log, "redis") == {keys[0], keys[2]}
        # A corrupt value is deleted and reported removed.
        await raw.set(tier.redis_key(keys[2]), b"garbage" * 10)
        assert await tier.read_into([keys[2]], entries.outs(1, PB)) == 0
        assert held(log, "redis") == {keys[0]}
        kinds = [e.kind for e in log.events_since(0) or []]
        assert kinds == [EventKind.STORED] * 4 + [EventKind.REMOVED] * 3
    finally:
        await raw.aclose()
        await tier.aclose()


async def test_an_offloader_over_redis_reports_its_chains_with_parents_and_tenant(
    redis_server: Any, namespace: str
) -> None:
    """Blocks written through to Redis are reported with the parent and tenant the CPU tier recorded."""
    import aiokv
    from aiokv import CPUTier, Offloader

    from ..core._sim import SimEngine
    from ..events.test_offloader_events import serve

    eng = SimEngine(num_blocks=64, block_size=4)
    tier = RedisTier(redis_server.url, namespace=namespace)
    async with Offloader(
        eng.layout, tiers=[CPUTier(capacity_bytes=8 * eng.layout.slot_bytes), tier], kv_events=True
    ) as off:
        tokens = list(range(200, 217))
        await serve(eng, off, "a", tokens, salt="tenant-x")
        await off.flush()
        hashes = aiokv.block_hashes(tokens, 4, salt="tenant-x", root=eng.layout.root)
        snap = off.kv_snapshot()
        assert snap.media["redis"] == "REMOTE"
        assert set(snap.tiers["redis"]) == set(hashes)
        for i, h in enumerate(hashes):
            info = snap.tiers["redis"][h]
            assert (info.parent_hash, info.token_count, info.tenant) == (
                hashes[i - 1] if i else None,
                4,
                "tenant-x",
            )
        stored = [e for e in off.event_log.events_since(0) or [] if e.tier == "redis"]  # type: ignore[union-attr]
        assert [k for e in stored for k in e.block_hashes] == hashes
        assert len(stored) == 1  # one chain, one event
