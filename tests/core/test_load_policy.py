"""The load planner wired into the offloader: lookups restore only what beats recomputing.

Transfer costs are timed with a fake clock that only the fake lower tier advances (by a fixed cost per read
call and per block), so every decision is deterministic: no sleeps, no dependence on the machine's speed.
Loads into the engine take no fake time (the CPU tier always wins here).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import pytest

import aiokv
from aiokv import CPUTier, Offloader
from aiokv.testing import FakeClock as _FakeClock
from aiokv.tiers import BackingTier, TierSpec

from ._sim import SimEngine, running_hashes
from .test_hierarchy import MemoryTier, _serve

pytestmark = pytest.mark.asyncio

BS = 4  # tokens per block
RATE = 4000.0  # prefill tokens/s: recomputing one block takes 1 ms


def FakeClock() -> _FakeClock:
    """aiokv.testing.FakeClock, starting at 100.0 s."""
    return _FakeClock(100.0)


class TimedTier(BackingTier):
    """Wraps a tier; each read costs ``call_s + blocks * block_s`` of fake time (lookups are free)."""

    def __init__(self, inner: MemoryTier, clock: FakeClock, call_s: float, block_s: float, name: str) -> None:
        self.inner = inner
        self.clock = clock
        self.call_s = call_s
        self.block_s = block_s
        self.name = name
        self.lookups = 0
        self.read_calls = 0

    async def open(self, spec: TierSpec) -> None:
        await self.inner.open(spec)

    async def aclose(self) -> None:
        await self.inner.aclose()

    async def lookup(self, keys: Sequence[bytes]) -> int:
        self.lookups += 1
        return await self.inner.lookup(keys)

    async def read_into(self, keys: Sequence[bytes], outs: Sequence[memoryview]) -> int:
        self.read_calls += 1
        self.clock.now += self.call_s + len(keys) * self.block_s
        return await self.inner.read_into(keys, outs)

    async def write(self, keys: Sequence[bytes], payloads: Sequence[memoryview]) -> int:
        return await self.inner.write(keys, payloads)

    def stats(self) -> Any:
        return self.inner.stats()


async def _published(tokens: list[int]) -> MemoryTier:
    """A lower tier holding every full block of ``tokens`` (written by another offloader)."""
    tier = MemoryTier()
    eng = SimEngine(block_size=BS)
    async with Offloader(eng.layout, tiers=[CPUTier(capacity_bytes=64 * eng.layout.slot_bytes), tier]) as a:
        await _serve(eng, a, "publisher", tokens)
        await a.flush()
    tier.closed = False
    return tier


def _offloader(eng: SimEngine, lower: BackingTier, clock: FakeClock, **kw: Any) -> Offloader:
    off = Offloader(eng.layout, tiers=[CPUTier(capacity_bytes=64 * eng.layout.slot_bytes), lower], **kw)
    off._cost_clock = clock
    return off


async def _lookup_and_load(eng: SimEngine, off: Offloader, rid: str, tokens: list[int]) -> int:
    """Look up and load ``tokens``' cached prefix (checking the loaded KV), then abort; the hit in tokens."""
    req = off.open(rid, tokens)
    hit = await req.lookup()
    blocks = eng.alloc(hit // BS)
    assert blocks is not None
    assert await req.load(blocks) == hit
    eng.check_tokens(running_hashes(tokens), blocks, hit)
    await req.abort()
    eng.release(blocks)
    return hit


def _evict(off: Offloader, tokens: list[int], start: int, end: int | None = None) -> None:
    """Drop blocks ``start:end`` of ``tokens`` from the CPU tier only (as if evicted)."""
    chain = aiokv.block_hashes(tokens, BS, root=off.layout.root)
    for key in chain[start:end]:
        off.cpu.index.discard(key)


async def _measure(eng: SimEngine, off: Offloader, tokens: list[int], keep: int, rounds: int = 2) -> None:
    """``rounds`` lookups that stage blocks ``keep:`` from the lower tier (the planner measures it)."""
    for i in range(rounds):
        _evict(off, tokens, keep)
        assert await _lookup_and_load(eng, off, f"measure-{i}", tokens) == (len(tokens) - 1) // BS * BS


TOKENS = list(range(4 * BS + 1))  # 4 full blocks and one token


async def test_a_slow_lower_tier_is_recomputed_once_measured_while_cpu_blocks_still_load() -> None:
    """Reading from the lower tier costs 10 ms a block, recomputing 1 ms: after two measured reads the
    planner stops asking it. Blocks in the CPU tier are still restored, the rest is a miss."""
    clock = FakeClock()
    slow = TimedTier(await _published(TOKENS), clock, 0.0, 0.010, "slow")
    eng = SimEngine(block_size=BS)
    async with _offloader(eng, slow, clock, prefill_tokens_per_s=RATE) as off:
        await _measure(eng, off, TOKENS, keep=2)
        reads = slow.read_calls
        _evict(off, TOKENS, 2)
        assert await _lookup_and_load(eng, off, "r", TOKENS) == 2 * BS  # the CPU tier's 2 blocks only
        assert slow.read_calls == reads  # nothing staged from the slow tier...
        s = off.stats()
        assert s.planner_skipped_lookups == 1  # ...and it was not even asked
        assert s.load_policy == "decide"
        assert s.prefill_tokens_per_s == RATE
        assert s.misses >= 2
        tiers = {name: (lat, bw, n) for name, lat, bw, n in s.planner.tiers}
        assert tiers["slow"][2] == 2
        assert tiers["slow"][1] == pytest.approx(eng.layout.slot_bytes / 0.010)
        assert off.cpu.stats().used_slots == 2  # no slot was reserved for blocks it would not use


async def test_always_restores_from_the_slow_tier() -> None:
    clock = FakeClock()
    slow = TimedTier(await _published(TOKENS), clock, 0.0, 0.010, "slow")
    eng = SimEngine(block_size=BS)
    async with _offloader(eng, slow, clock, prefill_tokens_per_s=RATE, load_policy="always") as off:
        await _measure(eng, off, TOKENS, keep=2, rounds=4)
        s = off.stats()
        assert s.load_policy == "always"
        assert s.planner_skipped_blocks == s.planner_skipped_lookups == 0
        assert s.staged_blocks == 4 + 2 * 3  # the first lookup finds an empty CPU tier


async def test_a_fast_lower_tier_keeps_its_full_gain() -> None:
    """0.1 ms a block against 1 ms to recompute it: every lookup stages from the lower tier."""
    clock = FakeClock()
    fast = TimedTier(await _published(TOKENS), clock, 0.0, 0.0001, "fast")
    eng = SimEngine(block_size=BS)
    async with _offloader(eng, fast, clock, prefill_tokens_per_s=RATE) as off:
        await _measure(eng, off, TOKENS, keep=0, rounds=5)
        s = off.stats()
        assert s.staged_blocks == 4 * 5
        assert s.planner_skipped_blocks == s.planner_skipped_lookups == 0


async def test_a_short_run_of_a_high_latency_tier_is_recomputed_and_a_long_one_restored() -> None:
    """5 ms per read plus 0.1 ms a block: a run of 3 blocks (5.3 ms) loses to recomputing it (3 ms), a run
    of 10 (6 ms against 10 ms) wins. The tier is asked (a long run could win) and its short run skipped."""
    tokens = list(range(20 * BS + 1))
    clock = FakeClock()
    lower = TimedTier(await _published(tokens[: 10 * BS + 1]), clock, 0.005, 0.0001, "remote")
    eng = SimEngine(block_size=BS)
    async with _offloader(eng, lower, clock, prefill_tokens_per_s=RATE) as off:
        for i, keep in enumerate((0, 8)):  # runs of 10 and 2 blocks: latency and bandwidth apart
            _evict(off, tokens, keep)
            assert await _lookup_and_load(eng, off, f"m{i}", tokens) == 10 * BS
        _evict(off, tokens, 7)
        assert await _lookup_and_load(eng, off, "short", tokens) == 7 * BS
        s = off.stats()
        assert s.planner_skipped_blocks == 3
        assert s.planner_skipped_lookups == 0
        _evict(off, tokens, 0)
        assert await _lookup_and_load(eng, off, "long", tokens) == 10 * BS


async def test_the_prefill_rate_is_measured_from_engine_reports() -> None:
    """Without a given rate nothing is skipped until the engine reports its prefill speed."""
    clock = FakeClock()
    slow = TimedTier(await _published(TOKENS), clock, 0.0, 0.010, "slow")
    eng = SimEngine(block_size=BS)
    async with _offloader(eng, slow, clock) as off:
        await _measure(eng, off, TOKENS, keep=2, rounds=3)  # measured, but no rate to compare with
        assert off.stats().prefill_tokens_per_s is None
        assert off.stats().planner_skipped_lookups == 0
        off.record_prefill(2000, 0.5)
        off.record_prefill(4000, 1.0)
        off.record_prefill(0, 0.0)  # ignored
        assert off.stats().prefill_tokens_per_s == pytest.approx(RATE)
        _evict(off, TOKENS, 2)
        assert await _lookup_and_load(eng, off, "r", TOKENS) == 2 * BS


async def test_a_skipped_tier_is_measured_again_now_and_then() -> None:
    clock = FakeClock()
    slow = TimedTier(await _published(TOKENS), clock, 0.0, 0.010, "slow")
    eng = SimEngine(block_size=BS)
    async with _offloader(eng, slow, clock, prefill_tokens_per_s=RATE) as off:
        off._planner._explore_every = 3
        await _measure(eng, off, TOKENS, keep=2)
        hits = []
        for i in range(6):
            _evict(off, TOKENS, 2)
            hits.append(await _lookup_and_load(eng, off, f"r{i}", TOKENS))
        assert hits == [8, 8, 16, 8, 8, 16]
        assert off.stats().planner.explored == 2


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        (
            {"load_policy": "sometimes"},
            aiokv.InvalidArgumentError,
            r"load_policy must be one of \['always', 'decide'\], got 'sometimes'",
        ),
        ({"load_policy": None}, aiokv.InvalidTypeError, "load_policy must be a str, got NoneType"),
        (
            {"prefill_tokens_per_s": 0.0},
            aiokv.InvalidArgumentError,
            "prefill_tokens_per_s must be a finite number > 0, got 0.0",
        ),
        (
            {"prefill_tokens_per_s": math.inf},
            aiokv.InvalidArgumentError,
            "prefill_tokens_per_s must be a finite number > 0, got inf",
        ),
        (
            {"prefill_tokens_per_s": "fast"},
            aiokv.InvalidTypeError,
            "prefill_tokens_per_s must be a number or None, got str",
        ),
        (
            {"prefill_tokens_per_s": True},
            aiokv.InvalidTypeError,
            "prefill_tokens_per_s must be a number or None, got bool",
        ),
    ],
)
async def test_bad_planner_arguments_are_clear_errors(
    kwargs: dict[str, Any], error: type, message: str
) -> None:
    eng = SimEngine(block_size=BS)
    with pytest.raises(error, match=message):
        Offloader(eng.layout, tiers=[CPUTier(capacity_bytes=4 * eng.layout.slot_bytes)], **kwargs)


@pytest.mark.parametrize(
    ("args", "error", "message"),
    [
        ((-1, 1.0), aiokv.InvalidArgumentError, "tokens must be >= 0, got -1"),
        ((1.5, 1.0), aiokv.InvalidTypeError, "tokens must be an int, got float"),
        ((10, -1.0), aiokv.InvalidArgumentError, "seconds must be a finite number >= 0, got -1.0"),
        ((10, math.nan), aiokv.InvalidArgumentError, "seconds must be a finite number >= 0, got nan"),
        ((10, "1"), aiokv.InvalidTypeError, "seconds must be a number, got str"),
    ],
)
async def test_bad_prefill_reports_are_clear_errors(args: tuple[Any, Any], error: type, message: str) -> None:
    eng = SimEngine(block_size=BS)
    async with Offloader(eng.layout, tiers=[CPUTier(capacity_bytes=4 * eng.layout.slot_bytes)]) as off:
        with pytest.raises(error, match=message):
            off.record_prefill(*args)
        assert off.stats().prefill_tokens_per_s is None  # a rejected report changes nothing


async def test_the_default_policy_decides_and_loads_are_measured() -> None:
    eng = SimEngine(block_size=BS)
    async with Offloader(eng.layout, tiers=[CPUTier(capacity_bytes=16 * eng.layout.slot_bytes)]) as off:
        assert off.load_policy == "decide"
        await _serve(eng, off, "a", TOKENS)
        for i in range(2):
            assert await _lookup_and_load(eng, off, f"b{i}", TOKENS) == 4 * BS
        s = off.stats()
        cpu = {name: n for name, _, _, n in s.planner.tiers}["cpu"]
        assert cpu == 2  # each load copy is one measurement of the CPU tier
