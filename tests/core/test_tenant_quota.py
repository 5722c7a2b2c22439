"""Per-tenant (salt) byte quotas of the CPU tier, through the offloader."""

from __future__ import annotations

from typing import Any

import pytest

import aiokv
from aiokv import CPUTier, Offloader

from ._sim import SimEngine
from .test_request import _prefill_and_decode

pytestmark = pytest.mark.asyncio

BS = 4


async def _serve(eng: SimEngine, off: Offloader, rid: str, prompt: list[int], salt: object) -> None:
    req = off.open(rid, prompt, salt=salt)
    await req.lookup()
    blocks = await _prefill_and_decode(eng, req, prompt, [1])
    await req.finish()
    eng.release(blocks)


async def _hit(off: Offloader, prompt: list[int], salt: object) -> int:
    probe = off.open("probe", [*prompt, 0], salt=salt)
    got = int(await probe.lookup())
    await probe.abort()
    return got


@pytest.mark.parametrize("form", ["mapping", "callable"])
async def test_a_tenant_over_quota_evicts_its_own_blocks_and_never_anothers(form: str) -> None:
    """16 slots; tenant a may hold 2 blocks, tenant b is unlimited. b stores 3 blocks, then a stores two
    prompts of 3 blocks each: a never holds more than 2 blocks, its second prompt displaces its first, and
    every block of b stays."""
    eng = SimEngine(block_size=BS)
    slot = eng.layout.slot_bytes
    quotas: Any = {"a": 2 * slot} if form == "mapping" else (lambda salt: 2 * slot if salt == "a" else None)
    cpu = CPUTier(capacity_bytes=16 * slot, tenant_quota_bytes=quotas)
    async with Offloader(eng.layout, tiers=[cpu]) as off:
        pb = list(range(100, 112))
        await _serve(eng, off, "b1", pb, "b")
        pa1, pa2 = list(range(12)), list(range(50, 62))
        await _serve(eng, off, "a1", pa1, "a")
        assert cpu.tenant_bytes("a") == 2 * slot
        await _serve(eng, off, "a2", pa2, "a")
        assert cpu.tenant_bytes("a") == 2 * slot
        assert cpu.tenant_bytes("b") == 3 * slot
        assert await _hit(off, pb, "b") == 12
        assert await _hit(off, pa2, "a") == 2 * BS
        assert await _hit(off, pa1, "a") == 0
        assert cpu.stats().used_slots == 5


async def test_without_quotas_nothing_is_counted() -> None:
    eng = SimEngine(block_size=BS)
    cpu = CPUTier(capacity_bytes=16 * eng.layout.slot_bytes)
    async with Offloader(eng.layout, tiers=[cpu]) as off:
        await _serve(eng, off, "a", list(range(12)), "a")
        assert cpu.tenant_bytes("a") == 0
        assert off.stats().blocks_stored == 3


@pytest.mark.parametrize(
    ("quotas", "error", "message"),
    [
        ({"a": -1}, aiokv.InvalidArgumentError, r"tenant_quota_bytes for salt 'a' must be >= 0, got -1"),
        (
            {"a": 1.5},
            aiokv.InvalidTypeError,
            r"tenant_quota_bytes for salt 'a' must be an int or None, got float",
        ),
        ({1.5: 10}, aiokv.InvalidTypeError, r"tenant_quota_bytes keys must be None, bool, int, str, bytes"),
        (
            42,
            aiokv.InvalidTypeError,
            r"tenant_quota_bytes must be a mapping of salt to bytes, a callable or None",
        ),
    ],
)
async def test_bad_quotas_are_refused_when_the_tier_is_made(quotas: Any, error: type, message: str) -> None:
    with pytest.raises(error, match=message):
        CPUTier(capacity_bytes=1 << 20, tenant_quota_bytes=quotas)


async def test_a_callable_returning_a_bad_quota_is_refused_at_open() -> None:
    eng = SimEngine(block_size=BS)
    cpu = CPUTier(capacity_bytes=16 * eng.layout.slot_bytes, tenant_quota_bytes=lambda salt: -3)
    async with Offloader(eng.layout, tiers=[cpu]) as off:
        with pytest.raises(aiokv.InvalidArgumentError, match=r"tenant_quota_bytes for salt 'x' must be >= 0"):
            off.open("r", [1, 2, 3], salt="x")
        assert off.get("r") is None
