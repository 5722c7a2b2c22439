"""Lower tiers through the real BackingTier interface: write-through, staging, failures, back-pressure.

The fake tier here implements the real interface (httpcore-style mock backend); the disk and Redis tiers
have their own tests against real files and a real server.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass

import pytest

import aiokv
from aiokv import CPUTier, Offloader
from aiokv.tiers import BackingTier, TierSpec

from ._sim import SimEngine, running_hashes

pytestmark = pytest.mark.asyncio


@dataclass(frozen=True)
class MemoryTierStats:
    entries: int
    writes: int
    reads: int


class MemoryTier(BackingTier):
    name = "memory"

    def __init__(self) -> None:
        self.data: dict[bytes, bytes] = {}
        self.spec: TierSpec | None = None
        self.fail = False  # every call raises (server gone)
        self.corrupt: set[bytes] = set()  # reads of these keys fail verification
        self.hold_writes: asyncio.Event | None = None  # writes wait for this (slow tier)
        self.writes = 0
        self.reads = 0
        self.closed = False

    async def open(self, spec: TierSpec) -> None:
        self.spec = spec

    async def aclose(self) -> None:
        self.closed = True

    async def lookup(self, keys: Sequence[bytes]) -> int:
        if self.fail:
            raise ConnectionError("down")
        n = 0
        for k in keys:
            if k not in self.data:
                break
            n += 1
        return n

    async def read_into(self, keys: Sequence[bytes], outs: Sequence[memoryview]) -> int:
        if self.fail:
            raise ConnectionError("down")
        n = 0
        for k, out in zip(keys, outs):
            payload = self.data.get(k)
            if payload is None or k in self.corrupt:
                break
            out[:] = payload
            self.reads += 1
            n += 1
        return n

    async def write(self, keys: Sequence[bytes], payloads: Sequence[memoryview]) -> int:
        if self.hold_writes is not None:
            await self.hold_writes.wait()
        if self.fail:
            raise ConnectionError("down")
        assert self.spec is not None
        for k, p in zip(keys, payloads):
            assert len(p) == self.spec.payload_bytes
            self.data[k] = bytes(p)
            self.writes += 1
        return len(keys)

    def stats(self) -> MemoryTierStats:
        return MemoryTierStats(len(self.data), self.writes, self.reads)


async def _serve(eng: SimEngine, off: Offloader, rid: str, tokens: list[int], sampled: int = 1) -> None:
    """Prefill ``tokens`` (after loading whatever is cached), sample one token, finish, free the blocks."""
    bs = eng.block_size
    req = off.open(rid, tokens)
    hit = await req.lookup()
    blocks = eng.alloc(hit // bs)
    assert blocks is not None
    await req.load(blocks)
    hashes = running_hashes(tokens)
    eng.check_tokens(hashes, blocks, hit)
    need = -(-len(tokens) // bs) - len(blocks)
    new = eng.alloc(need)
    assert new is not None
    blocks += new
    eng.compute(tokens, hashes, blocks, hit, len(tokens))
    req.step(len(tokens), new_token_ids=(sampled,), new_block_ids=new)
    await req.finish()
    eng.release(blocks)


async def _publish(tier: MemoryTier, tokens: list[int]) -> None:
    """Another process serves ``tokens`` with ``tier`` below its CPU tier and exits: the tier holds its blocks."""
    eng = SimEngine(block_size=4)
    async with _off(eng, 64, tier) as a:
        await _serve(eng, a, "a", tokens)
        await a.flush()
    tier.closed = False  # reused by the next offloader in this test


def _off(eng: SimEngine, cpu_blocks: int, *lower: BackingTier, **kw: object) -> Offloader:
    return Offloader(
        eng.layout, tiers=[CPUTier(capacity_bytes=cpu_blocks * eng.layout.slot_bytes), *lower], **kw
    )  # type: ignore[arg-type]


async def test_write_through_then_stage_back_into_a_fresh_cpu_tier() -> None:
    """Process A writes through to a shared lower tier; process B (fresh CPU tier) stages the prefix back
    and loads byte-identical KV."""
    shared = MemoryTier()
    eng = SimEngine(block_size=4)
    tokens = list(range(17))
    async with _off(eng, 64, shared) as a:
        await _serve(eng, a, "a", tokens)
        await a.flush()
        assert a.stats().write_through_blocks == 4
    assert shared.closed
    assert len(shared.data) == 4

    shared.closed = False
    eng2 = SimEngine(block_size=4)
    async with _off(eng2, 64, shared) as b:
        req = b.open("b", [*tokens, 1, 2])
        assert await req.lookup() == 16
        dst = eng2.alloc(4)
        assert dst is not None
        await req.load(dst)
        eng2.check_tokens(running_hashes([*tokens, 1, 2]), dst, 16)
        await req.abort()
        s = b.stats()
        assert s.staged_blocks == 4
        assert s.hits == 4
        # Promoted: the next lookup is served by the CPU tier alone.
        reads = shared.reads
        again = b.open("c", tokens)
        assert await again.lookup() == 16
        assert shared.reads == reads
        await again.abort()


async def test_cpu_hit_continues_into_the_lower_tier() -> None:
    """Longest prefix across tiers: head in CPU, tail only in the lower tier (CPU evicted it)."""
    shared = MemoryTier()
    eng = SimEngine(block_size=4)
    tokens = list(range(25))
    async with _off(eng, 64, shared) as off:
        await _serve(eng, off, "a", tokens)
        await off.flush()
        index = off.cpu.index
        chain = aiokv.block_hashes(tokens, 4, root=eng.layout.root)
        for key in chain[3:]:
            index.discard(key)  # as if evicted from CPU only
        req = off.open("b", [*tokens, 3])
        assert await req.lookup() == 24
        assert off.stats().staged_blocks == 3
        dst = eng.alloc(6)
        assert dst is not None
        await req.load(dst)
        eng.check_tokens(running_hashes([*tokens, 3]), dst, 24)
        await req.abort()


async def test_corrupt_lower_tier_entry_truncates_the_hit() -> None:
    shared = MemoryTier()
    eng = SimEngine(block_size=4)
    tokens = list(range(17))
    await _publish(shared, tokens)
    chain = aiokv.block_hashes(tokens, 4, root=eng.layout.root)
    shared.corrupt.add(chain[2])
    eng2 = SimEngine(block_size=4)
    async with _off(eng2, 64, shared) as b:
        req = b.open("b", [*tokens, 1])
        assert await req.lookup() == 8  # blocks 0-1 only: block 2 failed verification
        await req.abort()
        s = b.stats()
        assert s.staged_blocks == 2
        assert s.errors >= 1
        assert b.cpu.stats().used_slots == 2  # the failed slot was released
        b.cpu.index.check_invariants()


async def test_lower_tier_outage_degrades_to_misses_and_dropped_writes() -> None:
    shared = MemoryTier()
    shared.fail = True
    eng = SimEngine(block_size=4)
    async with _off(eng, 64, shared) as off:
        await _serve(eng, off, "a", list(range(9)))
        await off.flush()
        s = off.stats()
        assert s.blocks_stored == 2
        assert s.write_through_blocks == 0
        assert s.write_through_dropped == 2
        assert off.cpu.stats().pinned == 0
        # A lookup past the CPU tier's content asks the dead tier, gets an error, and reports a miss.
        req = off.open("b", list(range(100, 120)))
        assert await req.lookup() == 0
        await req.abort()
        shared.fail = False
        await _serve(eng, off, "c", list(range(200, 209)))
        await off.flush()
        assert len(shared.data) == 2  # recovered


async def test_slow_lower_tier_never_blocks_the_decode_path() -> None:
    """Writes beyond write_through_max_bytes are dropped and counted; requests finish regardless."""
    shared = MemoryTier()
    shared.hold_writes = asyncio.Event()
    eng = SimEngine(block_size=4)
    budget = 3 * eng.layout.slot_bytes
    async with _off(eng, 64, shared, write_through_max_bytes=budget) as off:
        for i in range(4):
            await _serve(eng, off, f"r{i}", list(range(i * 100, i * 100 + 9)))  # 2 blocks each
        s = off.stats()
        assert s.blocks_stored == 8
        assert s.write_through_in_flight_bytes <= budget
        assert s.write_through_dropped == 8 - 3
        assert off.cpu.stats().pinned == 3  # slots held for the tier's pending reads, not evictable
        shared.hold_writes.set()
        await off.flush()
        assert off.stats().write_through_blocks == 3
        assert off.cpu.stats().pinned == 0


async def test_aclose_bounds_the_wait_for_a_hung_tier() -> None:
    shared = MemoryTier()
    shared.hold_writes = asyncio.Event()  # never set: the tier hangs forever
    eng = SimEngine(block_size=4)
    off = _off(eng, 64, shared, close_timeout=0.05)
    async with off:
        await _serve(eng, off, "a", list(range(9)))
    s = off.stats()
    assert s.write_through_blocks == 0
    assert s.write_through_dropped == 2
    assert shared.closed


async def test_blocks_staged_from_a_slower_tier_are_promoted_to_faster_lower_tiers() -> None:
    """A Redis-like hit on a machine whose disk-like tier lacks the blocks lands on that disk tier too."""
    disk, remote = MemoryTier(), MemoryTier()
    tokens = list(range(13))
    await _publish(remote, tokens)  # another machine: writes only the shared tier
    assert len(remote.data) == 3
    eng2 = SimEngine(block_size=4)
    async with _off(eng2, 64, disk, remote) as b:
        req = b.open("b", [*tokens, 1])
        assert await req.lookup() == 12
        await req.abort()
        await b.flush()
        assert set(disk.data) == set(remote.data)
        assert b.cpu.stats().pinned == 0


async def test_lookup_stages_a_missing_head_and_continues_through_the_cpu_tier() -> None:
    """Regression: with the head block evicted from the CPU tier and the next five still in it, lookup()
    returned 16 tokens instead of 96: staging stopped at the first block already in the CPU tier. The head is
    staged from the lower tier and the walk continues through the CPU tier's blocks."""
    shared = MemoryTier()
    eng = SimEngine(block_size=16)
    tokens = list(range(97))
    async with _off(eng, 64, shared) as off:
        await _serve(eng, off, "a", tokens)
        await off.flush()
        chain = aiokv.block_hashes(tokens, 16, root=eng.layout.root)
        off.cpu.index.discard(chain[0])  # as if evicted from the CPU tier only
        req = off.open("b", [*tokens, 5])
        assert await req.lookup() == 96
        s = off.stats()
        assert s.staged_blocks == 1
        assert shared.reads == 1
        dst = eng.alloc(6)
        assert dst is not None
        assert await req.load(dst) == 96
        eng.check_tokens(running_hashes([*tokens, 5]), dst, 96)
        await req.abort()
        assert off.cpu.stats().pinned == 0
        off.cpu.index.check_invariants()


async def test_lookup_fills_every_gap_and_stops_where_no_tier_has_the_block() -> None:
    """Gaps in the CPU tier (blocks 1 and 3 evicted) are staged one run at a time; block 5, in no tier,
    ends the prefix, and the CPU blocks after it are not counted (nor left pinned)."""
    shared = MemoryTier()
    eng = SimEngine(block_size=4)
    tokens = list(range(33))
    async with _off(eng, 64, shared) as off:
        await _serve(eng, off, "a", tokens)
        await off.flush()
        chain = aiokv.block_hashes(tokens, 4, root=eng.layout.root)
        for i in (1, 3, 5):
            off.cpu.index.discard(chain[i])
        del shared.data[chain[5]]
        req = off.open("b", tokens)
        assert await req.lookup() == 5 * 4
        assert off.stats().staged_blocks == 2
        assert off.cpu.stats().pinned == 5  # blocks 0-4, held for the load; 6 and 7 were let go
        dst = eng.alloc(5)
        assert dst is not None
        assert await req.load(dst) == 20
        eng.check_tokens(running_hashes(tokens), dst, 20)
        await req.abort()
        assert off.cpu.stats().pinned == 0
        off.cpu.index.check_invariants()
