"""retain_s on Offloader.open: a finished request's blocks outlive others in the session policy until the
retention is over."""

from __future__ import annotations

import pytest

import aiokv
from aiokv import CPUTier, Offloader
from aiokv.testing import FakeClock as _FakeClock
from aiokv.tiers import SessionPolicy

from ._sim import SimEngine
from .test_request import _prefill_and_decode

pytestmark = pytest.mark.asyncio

BS = 4


def _Clock() -> _FakeClock:
    """aiokv.testing.FakeClock, starting at 0.0 s."""
    return _FakeClock(0.0)


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


@pytest.mark.parametrize("retain", [True, False])
async def test_a_retained_conversation_survives_newer_traffic_until_its_retention_ends(retain: bool) -> None:
    """4 slots. Conversation a (2 blocks) finishes with retain_s=60, then b and c (2 blocks each, no
    retention) are served: c evicts b, not the older a. Without retention c evicts a (least recent)."""
    eng = SimEngine(block_size=BS)
    clock = _Clock()
    cpu = CPUTier(capacity_bytes=4 * eng.layout.slot_bytes, eviction=SessionPolicy(4, clock=clock))
    async with Offloader(eng.layout, tiers=[cpu]) as off:
        pa, pb, pc = list(range(8)), list(range(20, 28)), list(range(40, 48))
        await _serve(eng, off, "a", pa, retain_s=60.0 if retain else None)
        await _serve(eng, off, "b", pb)
        await _serve(eng, off, "c", pc)
        if retain:
            assert (await _hit(off, pa), await _hit(off, pb)) == (8, 0)
        else:
            assert (await _hit(off, pa), await _hit(off, pb)) == (0, 8)


async def test_retention_ends_after_retain_s() -> None:
    eng = SimEngine(block_size=BS)
    clock = _Clock()
    cpu = CPUTier(capacity_bytes=4 * eng.layout.slot_bytes, eviction=SessionPolicy(4, clock=clock))
    async with Offloader(eng.layout, tiers=[cpu]) as off:
        pa, pb, pc = list(range(8)), list(range(20, 28)), list(range(40, 48))
        await _serve(eng, off, "a", pa, retain_s=60.0)
        await _serve(eng, off, "b", pb)
        clock.now = 61.0
        await _serve(eng, off, "c", pc)
        assert (await _hit(off, pa), await _hit(off, pb)) == (0, 8)


async def test_retain_s_is_ignored_by_policies_without_retention() -> None:
    eng = SimEngine(block_size=BS)
    cpu = CPUTier(capacity_bytes=4 * eng.layout.slot_bytes, eviction="lru")
    async with Offloader(eng.layout, tiers=[cpu]) as off:
        await _serve(eng, off, "a", list(range(8)), retain_s=60.0)
        assert await _hit(off, list(range(8))) == 8


@pytest.mark.parametrize(
    ("value", "error", "message"),
    [
        (-1.0, aiokv.InvalidArgumentError, r"retain_s must be a finite number >= 0, got -1.0"),
        (float("inf"), aiokv.InvalidArgumentError, r"retain_s must be a finite number >= 0, got inf"),
        ("10", aiokv.InvalidTypeError, r"retain_s must be a number or None, got str"),
        (True, aiokv.InvalidTypeError, r"retain_s must be a number or None, got bool"),
    ],
)
async def test_open_rejects_a_bad_retain_s(value: object, error: type, message: str) -> None:
    eng = SimEngine(block_size=BS)
    async with Offloader(eng.layout, tiers=[CPUTier(capacity_bytes=4 * eng.layout.slot_bytes)]) as off:
        with pytest.raises(error, match=message):
            off.open("a", [1, 2, 3], retain_s=value)  # type: ignore[arg-type]
        assert off.get("a") is None
