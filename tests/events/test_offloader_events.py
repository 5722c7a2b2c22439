"""An offloader's tiers report every content change: a consumer of ``Offloader.events()`` rebuilds exactly
what the CPU and disk tiers hold, through stores, evictions, a corrupt entry dropped, and the clear at close;
seeded random schedules check the same, also for a consumer that falls behind the replay buffer."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path
from typing import Any

import pytest

import aiokv
from aiokv import CPUTier, DiskTier, Offloader
from aiokv.events import EventKind, KVEventLog
from aiokv.testing import FaultyTier

from ..core._sim import SimEngine, running_hashes
from ._consumer import Consumer, meta, tier_contents

pytestmark = pytest.mark.asyncio
HANG_GUARD_S = 30.0
BS = 4
ENTRY = 4096  # one disk entry of SimEngine(block_size=4)'s 256-byte slots (header + payload, aligned)


async def serve(eng: SimEngine, off: Offloader, rid: str, tokens: list[int], salt: Any = None) -> None:
    """Look up, load, prefill ``tokens``, sample one token, finish, free the engine blocks."""
    req = off.open(rid, tokens, salt)
    hit = await req.lookup()
    blocks = eng.alloc(hit // BS)
    assert blocks is not None
    await req.load(blocks)
    hashes = running_hashes(tokens)
    new = eng.alloc(-(-len(tokens) // BS) - len(blocks))
    assert new is not None
    blocks += new
    eng.compute(tokens, hashes, blocks, hit, len(tokens))
    req.step(len(tokens), new_token_ids=(1,), new_block_ids=new)
    await req.finish()
    eng.release(blocks)


def make_disk(tmp_path: Path, entries: int) -> DiskTier:
    return DiskTier(tmp_path / "disk", entries * ENTRY, io_threads=1, preallocate=False)


async def settle(off: Offloader, consumer: Consumer) -> None:
    await asyncio.wait_for(off.flush(), HANG_GUARD_S)
    log = off.event_log
    assert log is not None
    await asyncio.wait_for(consumer.caught_up(log.seq), HANG_GUARD_S)


async def test_a_consumer_rebuilds_the_cpu_and_disk_tiers_through_evictions_corruption_and_close(
    tmp_path: Path,
) -> None:
    eng = SimEngine(num_blocks=64, block_size=BS)
    prompts = [(f"tenant-{i % 2}", [100 * i + t for t in range(13)]) for i in range(6)]  # 3 full blocks each
    hashes0 = aiokv.block_hashes(prompts[0][1], BS, salt=prompts[0][0], root=eng.layout.root)
    disk = make_disk(tmp_path, 12)
    lower = FaultyTier(disk, corrupt_keys={hashes0[1]})  # stored corrupt at rest: dropped when read
    cpu = CPUTier(capacity_bytes=5 * eng.layout.slot_bytes)
    async with Offloader(eng.layout, tiers=[cpu, lower], kv_events=True) as off:
        consumer = Consumer(off.events())
        task = asyncio.create_task(consumer.run())
        # Prompt 0 comes back once the CPU tier evicted it but the disk still holds it: staged from disk, its
        # corrupt block is dropped there (and stored again from the engine's recomputation).
        for n, i in enumerate([0, 1, 2, 0, 3, 4, 5, 1, 2]):
            salt, tokens = prompts[i]
            await serve(eng, off, f"r{n}", tokens, salt)
            await settle(off, consumer)
            assert consumer.blocks() == tier_contents(off, disk, "faulty-disk")
        assert off.kv_snapshot().tiers.keys() == {"cpu", "faulty-disk"}
        assert consumer.media == {"cpu": "CPU", "faulty-disk": "DISK"}
        # Every block the consumer holds carries its chain parent and its request's tenant.
        truth = meta(off, prompts)
        for tier in ("cpu", "faulty-disk"):
            for key, info in consumer.state[tier].items():
                assert (info.parent_hash, info.tenant) == truth[key]
                assert info.token_count == BS
        kinds = {(e.tier, e.kind) for e in consumer.events}
        assert ("cpu", EventKind.REMOVED) in kinds  # CPU evictions
        assert ("faulty-disk", EventKind.REMOVED) in kinds  # disk evictions and the corrupt entry
        assert disk.stats().corrupt >= 1
        dropped = [e for e in consumer.events if e.tier == "faulty-disk" and hashes0[1] in e.block_hashes]
        assert [e.kind for e in dropped][:2] == [EventKind.STORED, EventKind.REMOVED]
        stored = [e for e in consumer.events if e.kind is EventKind.STORED and e.tier == "cpu"]
        for e in stored:  # CPU stores know their tokens: the request's, block by block
            assert e.token_ids is not None
            assert len(e.token_ids) == sum(e.token_counts)
    await asyncio.wait_for(task, HANG_GUARD_S)  # the stream ends after the close clears every tier
    assert consumer.ended
    assert consumer.blocks() == {"cpu": set(), "faulty-disk": set()}
    assert [e.kind for e in consumer.events[-2:]] == [EventKind.CLEARED, EventKind.CLEARED]


async def test_stored_events_name_the_token_ids_of_each_chain(tmp_path: Path) -> None:
    eng = SimEngine(num_blocks=64, block_size=BS)
    tokens = list(range(50, 67))  # 4 full blocks
    async with Offloader(
        eng.layout, tiers=[CPUTier(capacity_bytes=16 * eng.layout.slot_bytes)], kv_events=True
    ) as off:
        stream = off.events()
        first = await anext(stream)
        assert isinstance(first, aiokv.events.KVSnapshot)
        assert first.tiers == {"cpu": {}}
        await serve(eng, off, "a", tokens, salt=7)
        got = stream.drain_nowait()
        assert got is not None
        (ev,) = got
        hashes = aiokv.block_hashes(tokens, BS, salt=7, root=eng.layout.root)
        assert ev.kind is EventKind.STORED
        assert (ev.tier, ev.medium) == ("cpu", "CPU")
        assert ev.block_hashes == tuple(hashes)
        assert ev.parent_hash is None
        assert ev.token_ids == tuple(tokens[:16])
        assert ev.token_counts == (BS,) * 4
        assert ev.tenant == 7
        # A later request extending the prompt stores a chain continuing from the cached prefix.
        await serve(eng, off, "b", [*tokens, 1, 2, 3, 4, 5], salt=7)
        got = stream.drain_nowait()
        assert got is not None
        (ev2,) = got
        longer = aiokv.block_hashes([*tokens, 1, 2, 3, 4, 5], BS, salt=7, root=eng.layout.root)
        assert ev2.block_hashes == tuple(longer[4:])
        assert ev2.parent_hash == hashes[3]
        assert ev2.token_ids == (66, 1, 2, 3)


async def test_a_partial_last_block_is_reported_with_its_token_count() -> None:
    eng = SimEngine(num_blocks=64, block_size=BS)
    tokens = list(range(10))  # 2 full blocks + 2 tokens (then one sampled token: 3 in the last block)
    async with Offloader(
        eng.layout,
        tiers=[CPUTier(capacity_bytes=16 * eng.layout.slot_bytes)],
        kv_events=True,
        store_partial_last_block=True,
    ) as off:
        stream = off.events(from_seq=0)
        await serve(eng, off, "a", tokens)
        events = stream.drain_nowait()
        assert events is not None
        counts = [n for e in events for n in e.token_counts]
        assert sorted(counts) == [2, BS, BS] or sorted(counts) == [3, BS, BS]
        partial = next(e for e in events if e.token_counts[0] < BS)
        full = aiokv.block_hashes(tokens, BS, root=eng.layout.root)
        assert partial.parent_hash == full[1]
        assert set(off.cpu.index.ready_keys()) == {k for e in events for k in e.block_hashes}


async def test_nothing_is_recorded_when_events_are_off() -> None:
    eng = SimEngine(num_blocks=64, block_size=BS)
    async with Offloader(eng.layout, tiers=[CPUTier(capacity_bytes=4 * eng.layout.slot_bytes)]) as off:
        assert off.event_log is None
        assert off.cpu.index.on_evict is None
        await serve(eng, off, "a", list(range(30)))
        with pytest.raises(aiokv.InvalidArgumentError, match=r"events\(\) needs KV events: .*kv_events=True"):
            off.events()
        with pytest.raises(aiokv.InvalidArgumentError, match=r"kv_snapshot\(\) needs KV events"):
            off.kv_snapshot()


async def test_bad_event_arguments_name_the_parameter() -> None:
    eng = SimEngine(num_blocks=8, block_size=BS)
    tiers = [CPUTier(capacity_bytes=4 * eng.layout.slot_bytes)]
    with pytest.raises(
        aiokv.InvalidTypeError, match=r"kv_events must be a bool or an aiokv\.events\.KVEventLog"
    ):
        Offloader(eng.layout, tiers=tiers, kv_events="yes")  # type: ignore[arg-type]
    with pytest.raises(aiokv.InvalidTypeError, match="kv_events_endpoint must be a non-empty str"):
        Offloader(eng.layout, tiers=tiers, kv_events_endpoint=5557)  # type: ignore[arg-type]
    with pytest.raises(
        aiokv.InvalidArgumentError, match="kv_events_replay_endpoint needs kv_events_endpoint"
    ):
        Offloader(eng.layout, tiers=tiers, kv_events_replay_endpoint="tcp://127.0.0.1:5558")
    log = KVEventLog(buffer=4)
    async with Offloader(
        eng.layout, tiers=[CPUTier(capacity_bytes=4 * eng.layout.slot_bytes)], kv_events=log
    ) as off:
        assert off.event_log is log
        with pytest.raises(aiokv.InvalidArgumentError, match="from_seq must be an int >= 0 or None, got -1"):
            off.events(from_seq=-1)


@pytest.mark.parametrize("seed", range(4))
async def test_random_schedules_rebuild_the_tiers_also_when_the_consumer_falls_behind(
    tmp_path: Path, seed: int
) -> None:
    """Random prompts sharing prefixes, random tenants and capacities; the consumer sometimes stalls for
    several requests, longer than the log's small buffer: it resynchronizes from a snapshot and still ends
    with exactly the tiers' contents after every request."""
    rng = random.Random(seed)
    eng = SimEngine(num_blocks=64, block_size=BS)
    disk = make_disk(tmp_path, rng.randint(3, 10))
    cpu = CPUTier(capacity_bytes=rng.randint(2, 8) * eng.layout.slot_bytes)
    log = KVEventLog(buffer=rng.choice([4, 16, 1000]))
    stems = [[rng.randrange(1000) for _ in range(8)] for _ in range(3)]
    async with Offloader(eng.layout, tiers=[cpu, disk], kv_events=log) as off:
        gate = asyncio.Event()
        gate.set()
        consumer = Consumer(off.events())
        task = asyncio.create_task(consumer.run(gate))
        for n in range(25):
            stall = rng.random() < 0.3
            if stall:
                gate.clear()
            tokens = rng.choice(stems)[: rng.randint(0, 8)] + [
                rng.randrange(1000) for _ in range(rng.randint(1, 12))
            ]
            await serve(eng, off, f"r{n}", tokens, rng.choice([None, "a", "b"]))
            await off.flush()
            if stall and rng.random() < 0.5:
                continue  # stay behind for another request
            gate.set()
            await settle(off, consumer)
            assert consumer.blocks() == tier_contents(off, disk)
            off.cpu.index.check_invariants()
        if log._events.maxlen == 4:
            assert consumer.snapshots >= 1
    await asyncio.wait_for(task, HANG_GUARD_S)


async def test_streams_of_an_offloader_closed_before_it_started_end() -> None:
    eng = SimEngine(num_blocks=8, block_size=BS)
    off = Offloader(eng.layout, tiers=[CPUTier(capacity_bytes=4 * eng.layout.slot_bytes)], kv_events=True)
    stream = off.events()
    await off.aclose()
    items = [item async for item in stream]
    assert len(items) == 1  # the (empty) snapshot, then the end
    assert isinstance(items[0], aiokv.events.KVSnapshot)
    assert items[0].tiers == {"cpu": {}}


async def test_evictions_forced_by_a_tenant_quota_are_reported() -> None:
    """A tenant at its CPU quota evicts its own blocks (not the LRU victim): the stream reports exactly those."""
    eng = SimEngine(num_blocks=64, block_size=BS)
    slot = eng.layout.slot_bytes
    cpu = CPUTier(capacity_bytes=16 * slot, tenant_quota_bytes={"small": 4 * slot})  # room for all of "big"
    prompts = [("small" if i % 3 else "big", [100 * i + t for t in range(13)]) for i in range(7)]
    async with Offloader(eng.layout, tiers=[cpu], kv_events=True) as off:
        consumer = Consumer(off.events())
        task = asyncio.create_task(consumer.run())
        for n, (salt, tokens) in enumerate(prompts):
            await serve(eng, off, f"r{n}", tokens, salt)
            await settle(off, consumer)
            assert consumer.blocks() == tier_contents(off)
            assert cpu.tenant_bytes("small") <= 4 * slot
        truth = meta(off, prompts)
        for key, info in consumer.state["cpu"].items():
            assert (info.parent_hash, info.tenant) == truth[key]
        removed = {h for e in consumer.events if e.kind is EventKind.REMOVED for h in e.block_hashes}
        assert removed
        assert all(truth[h][1] == "small" for h in removed)  # the big tenant was never evicted
    await asyncio.wait_for(task, HANG_GUARD_S)
