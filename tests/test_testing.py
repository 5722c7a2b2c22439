"""aiokv.testing: the public test helpers behave like the real things they stand in for."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest

import aiokv
from aiokv import CapacityError, ClosedError, CPUTier, InvalidArgumentError, InvalidTypeError, Offloader
from aiokv.testing import FakeClock, FaultyTier, MemoryTier, MemoryTierStats
from aiokv.tiers import SessionPolicy, TierHealth, TierSpec
from aiokv.tiers._format import HEADER_SIZE, pack_header

from .core._sim import DeviceSimEngine, SimEngine, running_hashes

BS = 4
SPEC = TierSpec(payload_bytes=64, fingerprint=b"f" * 32, block_size=BS, description="test layout")


def _key(i: int) -> bytes:
    return i.to_bytes(32, "big")


def _payload(i: int) -> memoryview:
    return memoryview(bytes([i % 251]) * SPEC.payload_bytes)


def _outs(n: int) -> list[memoryview]:
    return [memoryview(bytearray(SPEC.payload_bytes)) for _ in range(n)]


def _offloader(eng: SimEngine, *lower: object) -> Offloader:
    return Offloader(eng.layout, tiers=[CPUTier(capacity_bytes=64 * eng.layout.slot_bytes), *lower])  # type: ignore[list-item]


async def _serve(eng: SimEngine, off: Offloader, rid: str, tokens: list[int]) -> None:
    """Prefill ``tokens`` (after loading what is cached), sample one token, finish, free the blocks."""
    req = off.open(rid, tokens)
    hit = await req.lookup()
    blocks = eng.alloc(hit // BS)
    assert blocks is not None
    await req.load(blocks)
    hashes = running_hashes(tokens)
    eng.check_tokens(hashes, blocks, hit)
    new = eng.alloc(-(-len(tokens) // BS) - len(blocks))
    assert new is not None
    blocks += new
    eng.compute(tokens, hashes, blocks, hit, len(tokens))
    req.step(len(tokens), new_token_ids=(1,), new_block_ids=new)
    await req.finish()
    eng.release(blocks)


async def _publish(store: dict[bytes, bytes], tokens: list[int]) -> None:
    """One offloader serves ``tokens`` over a MemoryTier on ``store`` and closes: ``store`` keeps the blocks."""
    eng = SimEngine(block_size=BS)
    tier = MemoryTier(store=store)
    async with _offloader(eng, tier) as off:
        await _serve(eng, off, "writer", tokens)
        await off.flush()
    assert tier.stats().stored_blocks == len(tokens) // BS


async def _lookup(store: dict[bytes, bytes], tokens: list[int]) -> tuple[int, MemoryTier]:
    """A fresh offloader over ``store`` (an empty CPU tier): how many tokens it finds, and its lower tier."""
    eng = SimEngine(block_size=BS)
    tier = MemoryTier(store=store)
    async with _offloader(eng, tier) as off:
        req = off.open("reader", [*tokens, 7])
        hit = await req.lookup()
        dst = eng.alloc(hit // BS)
        assert dst is not None
        await req.load(dst)
        eng.check_tokens(running_hashes([*tokens, 7]), dst, hit)  # the loaded KV is byte-identical
        await req.abort()
    return hit, tier


# ------------------------------------------------------------------ MemoryTier
@pytest.mark.asyncio
async def test_a_memory_tier_stores_through_a_real_offloader_and_a_fresh_one_loads_it_back() -> None:
    store: dict[bytes, bytes] = {}
    tokens = list(range(17))
    await _publish(store, tokens)
    assert len(store) == 4
    assert all(len(v) == HEADER_SIZE + SimEngine(block_size=BS).layout.slot_bytes for v in store.values())
    hit, tier = await _lookup(store, tokens)
    assert hit == 16
    stats = tier.stats()
    assert isinstance(stats, MemoryTierStats)
    assert (stats.read_blocks, stats.corrupt, stats.health) == (4, 0, TierHealth.UP)


def _truncated(value: bytes, spec_fp: bytes, key: bytes) -> bytes:
    return value[:-1]


def _foreign(value: bytes, spec_fp: bytes, key: bytes) -> bytes:
    payload = value[HEADER_SIZE:]
    return pack_header(key, bytes(32), payload) + payload  # a valid entry of another layout


def _misfiled(value: bytes, spec_fp: bytes, key: bytes) -> bytes:
    payload = value[HEADER_SIZE:]
    return pack_header(bytes(32), spec_fp, payload) + payload  # another key's entry under this key


def _bit_rot(value: bytes, spec_fp: bytes, key: bytes) -> bytes:
    raw = bytearray(value)
    raw[-1] ^= 0x10
    return bytes(raw)


def _not_an_entry(value: bytes, spec_fp: bytes, key: bytes) -> bytes:
    return b"\x00" * len(value)


@pytest.mark.asyncio
@pytest.mark.parametrize("damage", [_truncated, _foreign, _misfiled, _bit_rot, _not_an_entry])
async def test_a_truncated_corrupt_or_foreign_entry_is_a_miss_and_is_dropped(damage: object) -> None:
    store: dict[bytes, bytes] = {}
    tokens = list(range(17))
    await _publish(store, tokens)
    layout = SimEngine(block_size=BS).layout
    chain = aiokv.block_hashes(tokens, BS, root=layout.root)
    store[chain[2]] = damage(store[chain[2]], layout.fingerprint, chain[2])  # type: ignore[operator]
    hit, tier = await _lookup(store, tokens)
    assert hit == 8  # blocks 0 and 1: block 2 failed verification, so the hit stops there
    assert tier.stats().corrupt == 1
    assert chain[2] not in store  # dropped, as the disk and Redis tiers drop a bad entry
    assert chain[3] in store


@pytest.mark.asyncio
async def test_faulty_tier_stores_into_a_memory_tier_corrupt_at_rest() -> None:
    """MemoryTier has the hook FaultyTier's corruption needs; its own verification then rejects the entry."""
    layout = SimEngine(block_size=BS).layout
    tokens = list(range(17))
    chain = aiokv.block_hashes(tokens, BS, root=layout.root)
    store: dict[bytes, bytes] = {}
    eng = SimEngine(block_size=BS)
    faulty = FaultyTier(MemoryTier(store=store), corrupt_keys={chain[1]})
    async with _offloader(eng, faulty) as off:
        await _serve(eng, off, "writer", tokens)
        await off.flush()
    assert faulty.stats().corrupted == 1
    hit, tier = await _lookup(store, tokens)
    assert hit == 4
    assert tier.stats().corrupt == 1


@pytest.mark.asyncio
async def test_a_memory_tier_makes_the_checks_a_real_tier_makes() -> None:
    tier = MemoryTier()
    with pytest.raises(ClosedError, match="not open"):
        await tier.lookup([_key(0)])
    with pytest.raises(InvalidTypeError, match="spec must be a TierSpec"):
        await tier.open("spec")  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match="fingerprint must be 32 bytes"):
        await tier.open(TierSpec(64, b"short", BS, "x"))
    await tier.open(SPEC)
    with pytest.raises(ClosedError, match="opened once"):
        await tier.open(SPEC)
    with pytest.raises(InvalidArgumentError, match="one buffer per key"):
        await tier.write([_key(0), _key(1)], [_payload(0)])
    with pytest.raises(InvalidArgumentError, match="payload_bytes=64"):
        await tier.write([_key(0)], [memoryview(bytes(63))])
    with pytest.raises(InvalidArgumentError, match="32-byte block hash"):
        await tier.write([b"short"], [_payload(0)])
    with pytest.raises(InvalidArgumentError, match="outs"):
        await tier.read_into([_key(0)], [memoryview(bytearray(65))])
    assert await tier.write([_key(0), _key(1)], [_payload(0), _payload(1)]) == 2
    assert await tier.write([_key(1)], [_payload(1)]) == 1
    assert tier.stats().skipped_existing == 1
    assert await tier.lookup([_key(0), _key(1), _key(2), _key(0)]) == 2
    outs = _outs(3)
    assert await tier.read_into([_key(0), _key(1), _key(2)], outs) == 2
    assert bytes(outs[1]) == bytes(_payload(1))
    assert tier.stats().read_misses == 1
    assert "open" in repr(tier)
    await tier.aclose()
    await tier.aclose()  # idempotent
    with pytest.raises(ClosedError, match="closed"):
        await tier.read_into([_key(0)], _outs(1))
    assert len(tier.store) == 2  # the entries outlive the tier


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"capacity_bytes": 0}, InvalidArgumentError),
        ({"capacity_bytes": True}, InvalidArgumentError),
        ({"store": [1]}, InvalidTypeError),
        ({"name": ""}, InvalidArgumentError),
        ({"medium": 3}, InvalidArgumentError),
    ],
)
async def test_a_memory_tier_refuses_bad_settings(kwargs: dict[str, object], error: type[Exception]) -> None:
    with pytest.raises(error):
        MemoryTier(**kwargs)  # type: ignore[arg-type]


@pytest.mark.asyncio
async def test_a_memory_tier_with_a_capacity_evicts_the_least_recently_used() -> None:
    entry = HEADER_SIZE + SPEC.payload_bytes
    with pytest.raises(CapacityError):
        await MemoryTier(capacity_bytes=entry - 1).open(SPEC)
    tier = MemoryTier(capacity_bytes=2 * entry + entry // 2)
    await tier.open(SPEC)
    await tier.write([_key(0), _key(1)], [_payload(0), _payload(1)])
    assert await tier.read_into([_key(0)], _outs(1)) == 1  # key 0 is now the most recently used
    await tier.write([_key(2)], [_payload(2)])
    assert set(tier.store) == {_key(0), _key(2)}
    stats = tier.stats()
    assert (stats.evictions, stats.entries, stats.entry_bytes) == (1, 2, entry)


@pytest.mark.asyncio
async def test_an_unavailable_memory_tier_misses_and_drops_without_raising() -> None:
    tier = MemoryTier()
    await tier.open(SPEC)
    await tier.write([_key(0)], [_payload(0)])
    tier.available = False
    assert await tier.lookup([_key(0)]) == 0
    assert await tier.read_into([_key(0)], _outs(1)) == 0
    assert await tier.write([_key(1)], [_payload(1)]) == 0
    stats = tier.stats()
    assert (stats.health, stats.dropped_down) == (TierHealth.DOWN, 1)
    tier.available = True
    assert await tier.lookup([_key(0), _key(1)]) == 1
    assert tier.stats().health is TierHealth.UP


@pytest.mark.asyncio
async def test_an_offloader_survives_its_memory_tier_going_away() -> None:
    store: dict[bytes, bytes] = {}
    tokens = list(range(17))
    eng = SimEngine(block_size=BS)
    tier = MemoryTier(store=store)
    async with _offloader(eng, tier) as off:
        tier.available = False
        await _serve(eng, off, "writer", tokens)
        await off.flush()
        assert off.stats().hits == 0
    assert store == {}
    assert tier.stats().dropped_down == 4


# ------------------------------------------------------------------- FakeClock
def test_a_fake_clock_moves_only_forward_and_only_when_told() -> None:
    clock = FakeClock()
    assert clock() == clock.now == 0.0
    assert clock.advance(1.5) == 1.5
    assert clock() == 1.5
    clock.now += 2
    assert clock() == 3.5
    clock.now = 10
    assert clock() == 10.0
    assert repr(clock) == "FakeClock(now=10)"
    assert FakeClock(100)() == 100.0
    for bad, error in [
        (-1, InvalidArgumentError),
        (math.nan, InvalidArgumentError),
        (True, InvalidTypeError),
    ]:
        with pytest.raises(error):
            clock.advance(bad)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match="cannot go back"):
        clock.now = 9
    with pytest.raises(InvalidArgumentError):
        FakeClock(math.inf)
    assert clock() == 10.0


@pytest.mark.asyncio
async def test_a_fake_clock_drives_a_redis_tiers_backoff() -> None:
    """Nothing listens on port 1: the tier is down at once, and it probes again only when the backoff has
    passed on its clock (no real time waited)."""
    pytest.importorskip("redis")
    clock = FakeClock()
    tier = aiokv.RedisTier(
        "redis://127.0.0.1:1/0", failures_to_down=1, backoff_s=5, backoff_max_s=60, timeout_s=0.5, clock=clock
    )
    await tier.open(SPEC)
    try:
        assert tier.stats().health is TierHealth.DOWN
        errors = tier.stats().errors
        for _ in range(3):
            assert await tier.lookup([_key(0)]) == 0
        assert (tier.stats().errors, tier.stats().skipped) == (errors, 3)  # answered locally
        clock.advance(4.9)
        assert await tier.lookup([_key(0)]) == 0
        assert tier.stats().errors == errors
        clock.advance(0.1)
        assert await tier.lookup([_key(0)]) == 0  # the probe: it touches the (absent) server
        assert tier.stats().errors == errors + 1
        assert tier.stats().backoff_s == 10  # still gone: the next probe waits twice as long
    finally:
        await tier.aclose()


def test_a_fake_clock_drives_session_retention() -> None:
    clock = FakeClock()
    policy = SessionPolicy(4, clock=clock)
    policy.insert(_key(0))
    policy.insert(_key(1))
    policy.retain([_key(0)], 10)
    assert next(iter(policy.candidates())) == _key(1)  # the retained block goes last
    clock.advance(10)
    assert next(iter(policy.candidates())) == _key(0)  # retention over: least recently used first


# ----------------------------------------------------------- the module itself
def test_importing_aiokv_testing_imports_no_torch() -> None:
    code = "import sys, aiokv.testing; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


@pytest.mark.asyncio
async def test_the_simulated_device_runs_an_offloader_over_a_memory_tier() -> None:
    """The simulated device of aiokv.testing is aiokv.transfer's: an offloader on it stores a prefix through to a
    MemoryTier, and a second request on a fresh CPU tier loads it back byte-identical (checks run as kernels)."""
    from aiokv.testing import SimulatedDevice
    from aiokv.transfer import SimulatedDevice as TransferSimulatedDevice

    assert SimulatedDevice is TransferSimulatedDevice
    sim = SimulatedDevice(seed=1)
    try:
        store: dict[bytes, bytes] = {}
        tokens = list(range(17))
        for rid in ("writer", "reader"):
            compute = sim.new_stream("compute")
            eng = DeviceSimEngine(sim, compute, block_size=BS)
            cpu = CPUTier(capacity_bytes=64 * eng.layout.slot_bytes)
            async with Offloader(
                eng.layout, tiers=[cpu, MemoryTier(store=store)], device=sim, compute_stream=compute
            ) as off:
                await _serve(eng, off, rid, tokens)
                await off.flush()
                if rid == "reader":
                    assert off.stats().staged_blocks == 4
            sim.synchronize_all()
            eng.verify()
        assert len(store) == 4
    finally:
        sim.close()
