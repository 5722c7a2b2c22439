"""priority on Offloader.open: under the session policy, a higher-priority request's blocks are evicted after
lower-priority ones."""

from __future__ import annotations

import pytest

import aiokv
from aiokv import CPUTier, Offloader
from aiokv.tiers import SessionPolicy

from ._sim import SimEngine
from .test_hierarchy import MemoryTier, _publish
from .test_request import _prefill_and_decode

pytestmark = pytest.mark.asyncio

BS = 4


async def _serve(eng: SimEngine, off: Offloader, rid: str, prompt: list[int], **kw: object) -> None:
    req = off.open(rid, prompt, **kw)  # type: ignore[arg-type]
    await req.lookup()
    blocks = await _prefill_and_decode(eng, req, prompt, [1])
    await req.finish()
    eng.release(blocks)


async def _hit(off: Offloader, prompt: list[int]) -> int:
    probe = off.open("probe", [*prompt, 0])
    got = int(await probe.lookup())
    await probe.abort()
    return got


@pytest.mark.parametrize("priority", [5, 0])
async def test_a_high_priority_requests_blocks_outlive_newer_low_priority_traffic(priority: int) -> None:
    """4 slots. Request a (2 blocks) is served with the given priority, then b and c (2 blocks each, priority
    0): with priority 5, c evicts b, not the older a; with priority 0, c evicts a (least recent)."""
    eng = SimEngine(block_size=BS)
    cpu = CPUTier(capacity_bytes=4 * eng.layout.slot_bytes, eviction=SessionPolicy(4))
    async with Offloader(eng.layout, tiers=[cpu]) as off:
        pa, pb, pc = list(range(8)), list(range(20, 28)), list(range(40, 48))
        await _serve(eng, off, "a", pa, priority=priority)
        assert off.get("a") is None
        await _serve(eng, off, "b", pb)
        await _serve(eng, off, "c", pc)
        if priority:
            assert (await _hit(off, pa), await _hit(off, pb)) == (8, 0)
        else:
            assert (await _hit(off, pa), await _hit(off, pb)) == (0, 8)


async def test_a_low_priority_request_is_evicted_before_newer_default_traffic() -> None:
    """4 slots. a (2 blocks, priority -1) then b (2 blocks, priority 0): c evicts a even after a was hit."""
    eng = SimEngine(block_size=BS)
    cpu = CPUTier(capacity_bytes=4 * eng.layout.slot_bytes, eviction=SessionPolicy(4))
    async with Offloader(eng.layout, tiers=[cpu]) as off:
        pa, pb, pc = list(range(8)), list(range(20, 28)), list(range(40, 48))
        await _serve(eng, off, "a", pa, priority=-1)
        await _serve(eng, off, "b", pb)
        assert await _hit(off, pa) == 8  # a hit does not change a block's priority
        await _serve(eng, off, "c", pc)
        assert (await _hit(off, pa), await _hit(off, pb), await _hit(off, pc)) == (0, 8, 8)


async def test_priority_is_ignored_by_policies_without_priorities() -> None:
    eng = SimEngine(block_size=BS)
    cpu = CPUTier(capacity_bytes=4 * eng.layout.slot_bytes, eviction="lru")
    async with Offloader(eng.layout, tiers=[cpu]) as off:
        pa, pb, pc = list(range(8)), list(range(20, 28)), list(range(40, 48))
        await _serve(eng, off, "a", pa, priority=100)
        await _serve(eng, off, "b", pb)
        await _serve(eng, off, "c", pc)
        assert (await _hit(off, pa), await _hit(off, pb)) == (0, 8)


async def test_the_request_shows_its_priority() -> None:
    eng = SimEngine(block_size=BS)
    async with Offloader(eng.layout, tiers=[CPUTier(capacity_bytes=4 * eng.layout.slot_bytes)]) as off:
        assert off.open("a", [1, 2, 3]).priority == 0
        assert off.open("b", [1, 2, 3], priority=-100).priority == -100


@pytest.mark.parametrize(
    ("value", "error", "message"),
    [
        (101, aiokv.InvalidArgumentError, r"priority must be in \[-100, 100\], got 101"),
        (-101, aiokv.InvalidArgumentError, r"priority must be in \[-100, 100\], got -101"),
        (1.0, aiokv.InvalidTypeError, r"priority must be an int, got float"),
        (None, aiokv.InvalidTypeError, r"priority must be an int, got NoneType"),
        (True, aiokv.InvalidTypeError, r"priority must be an int, got bool"),
    ],
)
async def test_open_rejects_a_bad_priority(value: object, error: type, message: str) -> None:
    eng = SimEngine(block_size=BS)
    async with Offloader(eng.layout, tiers=[CPUTier(capacity_bytes=4 * eng.layout.slot_bytes)]) as off:
        with pytest.raises(error, match=message):
            off.open("a", [1, 2, 3], priority=value)  # type: ignore[arg-type]
        assert off.get("a") is None


async def test_blocks_staged_from_a_lower_tier_carry_the_staging_requests_priority() -> None:
    shared = MemoryTier()
    tokens = list(range(17))
    await _publish(shared, tokens)
    eng = SimEngine(block_size=BS)
    policy = SessionPolicy(64)
    cpu = CPUTier(capacity_bytes=64 * eng.layout.slot_bytes, eviction=policy)
    async with Offloader(eng.layout, tiers=[cpu, shared]) as off:
        req = off.open("b", [*tokens, 1], priority=9)
        assert await req.lookup() == 16
        await req.abort()
        assert off.stats().staged_blocks == 4
        staged = cpu.index.ready_keys()
        assert len(staged) == 4
        assert {policy.priority(key) for key in staged} == {9}
