"""Per-tenant (salt) byte quotas of the CPU tier, through the offloader."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import aiokv
from aiokv import CPUTier, Offloader
from aiokv.tiers._format import HEADER_SIZE
from aiokv.tiers.disk import DiskTier

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


async def test_the_disk_tiers_quota_keeps_a_noisy_tenant_from_evicting_a_quiet_ones_entries(
    tmp_path: Path,
) -> None:
    """CPU tier without quotas, a 16-entry disk tier where tenant "noisy" may hold 2 entries. "quiet" stores 3
    blocks, "noisy" two prompts of 3 blocks each, each written through before the next request: on disk the
    noisy tenant ends with its second prompt's first 2 blocks, and a fresh offloader over the same directory
    finds every quiet block."""
    eng = SimEngine(block_size=BS)
    entry = (HEADER_SIZE + eng.layout.slot_bytes + 4095) // 4096 * 4096
    quotas = {"noisy": 2 * entry}
    pq, pn1, pn2 = list(range(12)), list(range(50, 62)), list(range(100, 112))
    disk = DiskTier(tmp_path, 16 * entry, tenant_quota_bytes=quotas)
    cpu = CPUTier(capacity_bytes=64 * eng.layout.slot_bytes)
    async with Offloader(eng.layout, tiers=[cpu, disk]) as off:
        for rid, prompt, salt in (("q", pq, "quiet"), ("n1", pn1, "noisy"), ("n2", pn2, "noisy")):
            await _serve(eng, off, rid, prompt, salt)
            await off.flush()
        assert (disk.tenant_bytes("quiet"), disk.tenant_bytes("noisy")) == (3 * entry, 2 * entry)
        assert cpu.tenant_bytes("noisy") == 0  # the CPU tier only records tenants for the disk tier
        assert disk.stats().dropped_quota == 2
        assert disk.stats().entries == 5
    eng2 = SimEngine(block_size=BS)
    disk2 = DiskTier(tmp_path, 16 * entry, tenant_quota_bytes=quotas)
    async with Offloader(
        eng2.layout, tiers=[CPUTier(capacity_bytes=64 * eng2.layout.slot_bytes), disk2]
    ) as off2:
        assert await _hit(off2, pq, "quiet") == 12
        assert await _hit(off2, pn1, "noisy") == 0
        assert await _hit(off2, pn2, "noisy") == 2 * BS


async def test_a_disk_tiers_callable_quota_is_asked_at_open_and_a_bad_answer_refuses_the_request(
    tmp_path: Path,
) -> None:
    eng = SimEngine(block_size=BS)
    asked: list[object] = []

    def quota(salt: object) -> object:
        asked.append(salt)
        return "lots" if salt == "bad" else None

    disk = DiskTier(tmp_path, 1 << 20, tenant_quota_bytes=quota)  # type: ignore[arg-type]
    async with Offloader(eng.layout, tiers=[CPUTier(capacity_bytes=16 * eng.layout.slot_bytes), disk]) as off:
        off.open("a", [1, 2, 3], salt="good")
        with pytest.raises(aiokv.InvalidTypeError, match=r"tenant_quota_bytes for salt 'bad' must be an int"):
            off.open("b", [1, 2, 3], salt="bad")
        assert off.get("b") is None
        off.open("c", [1, 2, 3], salt="good")
        assert asked == ["good", "bad"]
