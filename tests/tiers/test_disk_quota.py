"""Per-tenant byte quotas of the disk tier (``DiskTier(tenant_quota_bytes=...)``) against the real filesystem."""

from __future__ import annotations

from pathlib import Path

import pytest

from aiokv._errors import InvalidArgumentError, InvalidTypeError
from aiokv.tiers._format import HEADER_SIZE
from aiokv.tiers.disk import DiskTier

from . import _entries as entries

pytestmark = pytest.mark.asyncio

PB = 8192
ENTRY = (HEADER_SIZE + PB + 4095) // 4096 * 4096
SPEC = entries.spec(PB)


async def _open(path: Path, capacity_entries: int, **kw: object) -> DiskTier:
    tier = DiskTier(path, capacity_entries * ENTRY, **kw)  # type: ignore[arg-type]
    await tier.open(SPEC)
    return tier


async def _held(tier: DiskTier, keys: list[bytes]) -> list[bytes]:
    return [k for k in keys if await tier.lookup([k]) == 1]


async def test_a_noisy_tenant_evicts_only_its_own_entries(tmp_path: Path) -> None:
    """8 entries; the noisy tenant may hold 2. The quiet tenant writes 3 entries, then the noisy one writes 6:
    it keeps only its last 2, every quiet entry stays, and 3 slots are still free."""
    tier = await _open(tmp_path, 8, tenant_quota_bytes={"noisy": 2 * ENTRY})
    try:
        quiet, noisy = tier.tenant_key("quiet"), tier.tenant_key("noisy")
        qk, nk = entries.keys(3, "q"), entries.keys(6, "n")
        assert await tier.write(qk, entries.payloads(3, PB), tenants=[quiet] * 3) == 3
        for i in range(0, 6, 2):
            assert await tier.write(nk[i : i + 2], entries.payloads(2, PB, i), tenants=[noisy] * 2) == 2
        assert await _held(tier, qk) == qk
        assert await _held(tier, nk) == nk[4:]
        assert (tier.tenant_bytes("noisy"), tier.tenant_bytes("quiet")) == (2 * ENTRY, 3 * ENTRY)
        s = tier.stats()
        assert (s.entries, s.evictions, s.dropped_quota) == (5, 4, 0)
        outs = entries.outs(2, PB)
        assert await tier.read_into(nk[4:], outs) == 2
        assert [bytes(o) for o in outs] == [bytes(p) for p in entries.payloads(2, PB, 4)]
    finally:
        await tier.aclose()


async def test_a_full_tier_still_evicts_for_a_tenant_under_its_quota(tmp_path: Path) -> None:
    tier = await _open(tmp_path, 4, tenant_quota_bytes={"noisy": 2 * ENTRY})
    try:
        quiet, noisy = tier.tenant_key("quiet"), tier.tenant_key("noisy")
        qk, nk = entries.keys(4, "q"), entries.keys(1, "n")
        assert await tier.write(qk, entries.payloads(4, PB), tenants=[quiet] * 4) == 4
        assert await tier.write(nk, entries.payloads(1, PB), tenants=[noisy]) == 1
        assert await _held(tier, qk) == qk[1:]  # the tier was full: the usual victim, quiet's oldest
    finally:
        await tier.aclose()


async def test_a_tenant_at_a_zero_quota_is_dropped_and_counted(tmp_path: Path) -> None:
    tier = await _open(tmp_path, 8, tenant_quota_bytes=lambda salt: 0 if salt == "banned" else None)
    try:
        banned = tier.tenant_key("banned")
        keys = entries.keys(3)
        assert await tier.write(keys, entries.payloads(3, PB), tenants=[banned, None, banned]) == 1
        assert await _held(tier, keys) == [keys[1]]
        s = tier.stats()
        assert (s.dropped_quota, s.dropped_no_room, s.stored_blocks) == (2, 0, 1)
    finally:
        await tier.aclose()


async def test_writes_without_tenants_count_for_nobody(tmp_path: Path) -> None:
    tier = await _open(tmp_path, 4, tenant_quota_bytes={"noisy": 0})
    try:
        keys = entries.keys(4)
        assert await tier.write(keys, entries.payloads(4, PB)) == 4
        assert tier.tenant_bytes("noisy") == 0
    finally:
        await tier.aclose()


async def test_recovered_entries_count_for_nobody_after_reopen(tmp_path: Path) -> None:
    """The tenant is not on disk: after a reopen the noisy tenant's old entries are held but uncounted, and
    its quota bounds what it writes from then on (its new entries evict each other, not the old ones)."""
    quotas = {"noisy": 1 * ENTRY}
    tier = await _open(tmp_path, 8, tenant_quota_bytes=quotas)
    old = entries.keys(1, "old")
    assert await tier.write(old, entries.payloads(1, PB), tenants=[tier.tenant_key("noisy")]) == 1
    await tier.aclose()
    tier = await _open(tmp_path, 8, tenant_quota_bytes=quotas)
    try:
        assert tier.stats().recovered == 1
        assert tier.tenant_bytes("noisy") == 0
        noisy = tier.tenant_key("noisy")
        new = entries.keys(2, "new")
        for i, key in enumerate(new):
            assert await tier.write([key], entries.payloads(1, PB, i), tenants=[noisy]) == 1
        assert await _held(tier, [*old, *new]) == [*old, new[1]]
        assert tier.tenant_bytes("noisy") == ENTRY
    finally:
        await tier.aclose()


@pytest.mark.parametrize(
    ("kw", "error", "message"),
    [
        (
            {"tenant_quota_bytes": 5},
            InvalidTypeError,
            r"tenant_quota_bytes must be a mapping of salt to bytes, a callable or None, got int",
        ),
        (
            {"tenant_quota_bytes": {"a": -1}},
            InvalidArgumentError,
            r"tenant_quota_bytes for salt 'a' must be >= 0, got -1",
        ),
        (
            {"tenant_quota_bytes": {"a": 1.5}},
            InvalidTypeError,
            r"tenant_quota_bytes for salt 'a' must be an int or None, got float",
        ),
        (
            {"tenant_quota_bytes": {"a": 1}, "shared": True, "eviction": "lru"},
            InvalidArgumentError,
            r"tenant_quota_bytes cannot be used with shared=True",
        ),
    ],
)
async def test_bad_tenant_quota_bytes_is_refused(
    tmp_path: Path, kw: dict[str, object], error: type, message: str
) -> None:
    with pytest.raises(error, match=message):
        DiskTier(tmp_path, 4 * ENTRY, **kw)  # type: ignore[arg-type]


async def test_a_callable_quota_is_checked_when_the_tenant_is_first_seen(tmp_path: Path) -> None:
    tier = await _open(tmp_path, 4, tenant_quota_bytes=lambda salt: "lots")
    try:
        with pytest.raises(InvalidTypeError, match=r"tenant_quota_bytes for salt 'x' must be an int or None"):
            tier.tenant_key("x")
    finally:
        await tier.aclose()


async def test_write_rejects_tenants_of_another_length(tmp_path: Path) -> None:
    tier = await _open(tmp_path, 4, tenant_quota_bytes={})
    try:
        with pytest.raises(InvalidArgumentError, match=r"tenants must have one entry per key \(2\), got 1"):
            await tier.write(entries.keys(2), entries.payloads(2, PB), tenants=[None])
        assert tier.stats().writes == 0
    finally:
        await tier.aclose()
