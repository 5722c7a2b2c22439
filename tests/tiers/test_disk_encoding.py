"""Encoded disk tiers (``DiskTier(encoding="fp8" | "int8")``): restores close to the original KV in the
engine's dtype, more blocks in the same bytes, entries of another encoding never decoded, corrupt or
undecodable entries a miss, blocks that cannot be encoded not stored; the codec itself."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

import aiokv
from aiokv import CPUTier, InvalidArgumentError, Offloader
from aiokv.tiers import FaultyTier
from aiokv.tiers._base import TierSpec
from aiokv.tiers._codec import DecodeError, EncodeError, make_codec, segments_of
from aiokv.tiers._format import HEADER_SIZE
from aiokv.tiers.disk import DiskTier

BS = 16
HEADS, DIM = 4, 32
# Relative to the largest |value| of a head's block: e4m3 keeps 3 mantissa bits, int8 127 levels.
TOLERANCE = {"fp8": 0.07, "int8": 0.01}


def _kv(num_blocks: int, dtype: torch.dtype, seed: int = 0, block_dim: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shape = (num_blocks, BS, HEADS, DIM) if block_dim == 0 else (2, num_blocks, BS, HEADS, DIM)
    # Heads of very different magnitudes: one scale per block would crush the small ones.
    scale = torch.tensor([0.01, 1.0, 30.0, 500.0]).view(HEADS, 1)
    return [(torch.randn(*shape, generator=g) * scale).to(dtype) for _ in range(4)]


def _slot_of(layout: aiokv.KVLayout, block: int) -> bytearray:
    slot = bytearray(layout.slot_bytes)
    view = torch.frombuffer(slot, dtype=torch.uint8)
    for t, spec in zip(layout.tensors, layout.specs, strict=True):
        data = t.select(layout.block_dim, block).contiguous().view(torch.uint8).reshape(-1)
        view[spec.slot_offset : spec.slot_offset + data.numel()].copy_(data)
    return slot


def _per_head_error(want: torch.Tensor, got: torch.Tensor) -> float:
    """The largest error of a head's block relative to that head's largest |value|."""
    want, got = want.float(), got.float()
    amax = want.abs().amax(dim=(-3, -1), keepdim=True).clamp_min(1e-30)
    return float(((want - got).abs() / amax).max())


# ------------------------------------------------------------------------------------------------- codec


@pytest.mark.parametrize("encoding", ["fp8", "int8"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("block_dim", [0, 1])
def test_codec_round_trip_is_close_per_head(encoding: str, dtype: torch.dtype, block_dim: int) -> None:
    kv = _kv(3, dtype, block_dim=block_dim)
    layout = aiokv.KVLayout(kv, block_size=BS, block_dim=block_dim)
    codec = make_codec(encoding, segments_of(layout), layout.slot_bytes)
    assert codec is not None
    slot = _slot_of(layout, 1)
    enc = bytearray(codec.encoded_bytes)
    codec.encode(memoryview(slot), memoryview(enc))
    out = bytearray(layout.slot_bytes)
    codec.decode(bytes(enc), memoryview(out))  # read-only input, as a Redis value
    shape = (-1, BS, HEADS, DIM)
    want = torch.frombuffer(slot, dtype=dtype).view(shape)
    got = torch.frombuffer(out, dtype=dtype).view(shape)
    assert _per_head_error(want, got) <= TOLERANCE[encoding]
    ratio = layout.slot_bytes / codec.encoded_bytes
    assert ratio >= (3.9 if dtype is torch.float32 else 1.9)


def test_codec_zero_blocks_decode_to_zero_and_raw_needs_no_codec() -> None:
    layout = aiokv.KVLayout([torch.zeros(2, BS, HEADS, DIM, dtype=torch.bfloat16)], block_size=BS)
    codec = make_codec("fp8", segments_of(layout), layout.slot_bytes)
    assert codec is not None
    enc = bytearray(codec.encoded_bytes)
    codec.encode(memoryview(bytearray(layout.slot_bytes)), memoryview(enc))
    out = bytearray(b"\xff" * layout.slot_bytes)
    codec.decode(enc, memoryview(out))
    assert out == bytearray(layout.slot_bytes)
    assert make_codec("raw", segments_of(layout), layout.slot_bytes) is None


def test_codec_keeps_integer_tensors_exact() -> None:
    ints = torch.randint(-1000, 1000, (2, BS, HEADS, DIM), dtype=torch.int32)
    floats = torch.randn(2, BS, HEADS, DIM).to(torch.bfloat16)
    layout = aiokv.KVLayout([ints, floats], block_size=BS)
    codec = make_codec("int8", segments_of(layout), layout.slot_bytes)
    assert codec is not None
    slot = _slot_of(layout, 0)
    enc = bytearray(codec.encoded_bytes)
    codec.encode(memoryview(slot), memoryview(enc))
    out = bytearray(layout.slot_bytes)
    codec.decode(enc, memoryview(out))
    n = ints[0].numel() * 4
    assert out[:n] == slot[:n]


def test_codec_refuses_non_finite_values_and_bad_scales() -> None:
    layout = aiokv.KVLayout([torch.zeros(2, BS, HEADS, DIM, dtype=torch.float16)], block_size=BS)
    codec = make_codec("fp8", segments_of(layout), layout.slot_bytes)
    assert codec is not None
    for bad in (math.inf, -math.inf, math.nan):
        slot = bytearray(layout.slot_bytes)
        torch.frombuffer(slot, dtype=torch.float16)[77] = bad
        with pytest.raises(EncodeError):
            codec.encode(memoryview(slot), memoryview(bytearray(codec.encoded_bytes)))
    enc = bytearray(codec.encoded_bytes)  # all-zero scales: never written by an encoder
    with pytest.raises(DecodeError):
        codec.decode(enc, memoryview(bytearray(layout.slot_bytes)))


def test_codec_fingerprints_differ_by_encoding_and_layout() -> None:
    a = aiokv.KVLayout(_kv(2, torch.bfloat16), block_size=BS)
    b = aiokv.KVLayout(_kv(2, torch.float16), block_size=BS)
    fp8_a = make_codec("fp8", segments_of(a), a.slot_bytes)
    int8_a = make_codec("int8", segments_of(a), a.slot_bytes)
    fp8_b = make_codec("fp8", segments_of(b), b.slot_bytes)
    assert fp8_a is not None
    assert int8_a is not None
    assert fp8_b is not None
    prints = {
        fp8_a.fingerprint(a.fingerprint),
        int8_a.fingerprint(a.fingerprint),
        fp8_b.fingerprint(b.fingerprint),
    }
    assert len(prints) == 3
    assert a.fingerprint not in prints


# ---------------------------------------------------------------------------------------------- the tier


class Engine:
    def __init__(self, dtype: torch.dtype, num_blocks: int = 32, seed: int = 0) -> None:
        self.kv = _kv(num_blocks, dtype, seed)
        self.layout = aiokv.KVLayout(self.kv, block_size=BS, model_id="encoding-test", tensors_per_layer=2)
        self.original = [t.clone() for t in self.kv]

    def wipe(self) -> None:
        for t in self.kv:
            t.fill_(-3.0)


async def _store(off: Offloader, tokens: list[int], blocks: list[int]) -> None:
    req = off.open("store", tokens)
    assert await req.lookup() == 0
    req.step(len(blocks) * BS, (), blocks)
    await req.finish()
    await off.flush()


async def _restore(off: Offloader, tokens: list[int], blocks: list[int]) -> int:
    req = off.open("restore", tokens)
    hit = await req.lookup()
    restored = await req.load(blocks[: hit // BS])
    await req.abort()
    return int(restored)


def _tokens(n_blocks: int) -> list[int]:
    return [(7 * i + 3) % 1000 for i in range(n_blocks * BS + 1)]


@pytest.mark.asyncio
@pytest.mark.parametrize("encoding", ["fp8", "int8"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
async def test_a_restore_from_an_encoded_disk_tier_is_close_in_the_engines_dtype(
    tmp_path: Path, encoding: str, dtype: torch.dtype
) -> None:
    eng = Engine(dtype)
    tokens, blocks = _tokens(8), list(range(8))
    disk = DiskTier(tmp_path / "d", 64 << 20, encoding=encoding)
    async with Offloader(eng.layout, [CPUTier(capacity_bytes=1 << 20), disk]) as off:
        await _store(off, tokens, blocks)
    assert disk.stats().encoding == encoding
    assert disk.stats().stored_blocks == 8
    eng.wipe()
    # A new offloader: its CPU tier is empty, the restore comes from the disk tier's files.
    disk2 = DiskTier(tmp_path / "d", 64 << 20, encoding=encoding)
    async with Offloader(eng.layout, [CPUTier(capacity_bytes=1 << 20), disk2]) as off:
        assert await _restore(off, tokens, blocks) == 8 * BS
    assert disk2.stats().read_blocks == 8
    for want, got in zip(eng.original, eng.kv, strict=True):
        assert got.dtype == dtype
        assert _per_head_error(want[:8], got[:8]) <= TOLERANCE[encoding]
        assert torch.all(got[8:] == -3.0)  # nothing written outside the loaded blocks


@pytest.mark.asyncio
async def test_fp8_holds_twice_the_blocks_of_raw_in_the_same_bytes(tmp_path: Path) -> None:
    # A block of a real model's size (8 layers of 8 heads x 128, 512 KiB in bf16): entries are rounded up to
    # 4 KiB pages on disk, which a small block's header and scales would cross.
    kv = [torch.zeros(2, BS, 8, 128, dtype=torch.bfloat16) for _ in range(16)]
    layout = aiokv.KVLayout(kv, block_size=BS, tensors_per_layer=2)
    spec = TierSpec(layout.slot_bytes, layout.fingerprint, BS, "t", segments_of(layout))
    raw, fp8 = DiskTier(tmp_path / "raw", 64 << 20), DiskTier(tmp_path / "fp8", 64 << 20, encoding="fp8")
    await raw.open(spec)
    await fp8.open(spec)
    try:
        assert fp8.stats().num_slots >= 1.9 * raw.stats().num_slots
        assert fp8.stats().entry_bytes < raw.stats().entry_bytes
    finally:
        await raw.aclose()
        await fp8.aclose()


@pytest.mark.asyncio
async def test_a_directory_written_in_another_encoding_is_never_decoded(tmp_path: Path) -> None:
    eng = Engine(torch.bfloat16)
    tokens, blocks = _tokens(4), list(range(4))
    async with Offloader(
        eng.layout, [CPUTier(capacity_bytes=1 << 20), DiskTier(tmp_path / "d", 32 << 20)]
    ) as off:
        await _store(off, tokens, blocks)
    for encoding in ("fp8", "int8", "raw"):
        disk = DiskTier(tmp_path / "d", 32 << 20, encoding=encoding)
        async with Offloader(eng.layout, [CPUTier(capacity_bytes=1 << 20), disk]) as off:
            hit = await _restore(off, tokens, blocks)
        # raw written first: fp8 starts the directory fresh (another layout to it), int8 too, then raw does.
        assert hit == 0
        assert disk.stats().reset


@pytest.mark.asyncio
async def test_a_damaged_encoded_entry_is_a_miss(tmp_path: Path) -> None:
    eng = Engine(torch.bfloat16)
    tokens, blocks = _tokens(4), list(range(4))
    spec = TierSpec(eng.layout.slot_bytes, eng.layout.fingerprint, BS, "t", segments_of(eng.layout))
    disk = DiskTier(tmp_path / "d", 32 << 20, encoding="fp8")
    await disk.open(spec)
    try:
        keys = [bytes([i]) * 32 for i in range(4)]
        payloads = [memoryview(_slot_of(eng.layout, b)) for b in blocks]
        stored, damaged = await disk._write_damaged(
            keys, payloads, [None, (HEADER_SIZE + 200, 0x10), None, None]
        )
        assert (stored, damaged) == (4, 1)
        outs = [memoryview(bytearray(eng.layout.slot_bytes)) for _ in keys]
        assert await disk.read_into(keys, outs) == 1
        assert disk.stats().corrupt == 1
    finally:
        await disk.aclose()
    del tokens


@pytest.mark.asyncio
async def test_an_entry_that_verifies_but_does_not_decode_is_a_miss(tmp_path: Path) -> None:
    eng = Engine(torch.bfloat16)
    spec = TierSpec(eng.layout.slot_bytes, eng.layout.fingerprint, BS, "t", segments_of(eng.layout))
    disk = DiskTier(tmp_path / "d", 32 << 20, encoding="fp8")
    await disk.open(spec)
    try:
        keys = [bytes([i]) * 32 for i in range(3)]
        assert await disk.write(keys, [memoryview(_slot_of(eng.layout, b)) for b in range(3)]) == 3
        codec = disk._codec
        assert codec is not None

        def broken(src: object, dst: object) -> None:
            raise DecodeError("planted")

        calls = iter([codec.decode, broken])
        codec.decode = lambda src, dst: next(calls)(src, dst)  # type: ignore[method-assign]
        outs = [memoryview(bytearray(eng.layout.slot_bytes)) for _ in keys]
        assert await disk.read_into(keys, outs) == 1
        assert disk.stats().corrupt == 1
    finally:
        await disk.aclose()


@pytest.mark.asyncio
async def test_a_block_that_cannot_be_encoded_is_not_stored(tmp_path: Path) -> None:
    eng = Engine(torch.float16)
    spec = TierSpec(eng.layout.slot_bytes, eng.layout.fingerprint, BS, "t", segments_of(eng.layout))
    disk = DiskTier(tmp_path / "d", 32 << 20, encoding="int8")
    await disk.open(spec)
    try:
        keys = [bytes([i]) * 32 for i in range(3)]
        slots = [_slot_of(eng.layout, b) for b in range(3)]
        torch.frombuffer(slots[1], dtype=torch.float16)[5] = math.inf
        assert await disk.write(keys, [memoryview(s) for s in slots]) == 2
        assert disk.stats().dropped_unencodable == 1
        assert await disk.lookup(keys) == 1  # the second block is missing
        assert await disk.lookup(keys[2:]) == 1
    finally:
        await disk.aclose()


def test_a_bad_encoding_is_a_clear_error(tmp_path: Path) -> None:
    for bad in ("fp4", "", None, 8):
        with pytest.raises(InvalidArgumentError, match="encoding must be one of"):
            DiskTier(tmp_path, 1 << 20, encoding=bad)  # type: ignore[arg-type]


@pytest.mark.asyncio
async def test_an_encoding_without_the_layouts_shapes_is_refused_at_open(tmp_path: Path) -> None:
    disk = DiskTier(tmp_path / "d", 1 << 20, encoding="fp8")
    with pytest.raises(InvalidArgumentError, match="needs the layout's tensor shapes"):
        await disk.open(TierSpec(4096, b"f" * 32, BS, "hand-made"))


@pytest.mark.asyncio
async def test_faulty_tier_over_an_encoded_disk_tier(tmp_path: Path) -> None:
    # FaultyTier wraps it like any tier: injected read failures are misses, the rest restores close.
    eng = Engine(torch.bfloat16)
    tokens, blocks = _tokens(4), list(range(4))
    disk = DiskTier(tmp_path / "d", 32 << 20, encoding="fp8")
    async with Offloader(eng.layout, [CPUTier(capacity_bytes=1 << 20), FaultyTier(disk)]) as off:
        await _store(off, tokens, blocks)
    assert disk.stats().stored_blocks == 4


@pytest.mark.asyncio
async def test_damage_offsets_past_the_encoded_entry_still_hit_it(tmp_path: Path) -> None:
    """A fault injector draws offsets over the caller's block (what it sees); the encoded entry is shorter, so
    an offset past its end is folded into its payload: still stored damaged, still a miss."""
    eng = Engine(torch.bfloat16)
    spec = TierSpec(eng.layout.slot_bytes, eng.layout.fingerprint, BS, "t", segments_of(eng.layout))
    disk = DiskTier(tmp_path / "d", 32 << 20, encoding="fp8")
    await disk.open(spec)
    try:
        keys = [bytes([i]) * 32 for i in range(2)]
        payloads = [memoryview(_slot_of(eng.layout, b)) for b in range(2)]
        last = (
            HEADER_SIZE + eng.layout.slot_bytes - 1
        )  # past the encoded entry's end, inside the caller's block
        assert last >= HEADER_SIZE + disk.stats().entry_bytes
        assert await disk._write_damaged(keys, payloads, [None, (last, 0x01)]) == (2, 1)
        outs = [memoryview(bytearray(eng.layout.slot_bytes)) for _ in keys]
        assert await disk.read_into(keys, outs) == 1
        assert disk.stats().corrupt == 1
        with pytest.raises(InvalidArgumentError, match=r"damage\[0\] offset must be in"):
            await disk._write_damaged(keys[:1], payloads[:1], [(last + 1, 0x01)])
    finally:
        await disk.aclose()


@pytest.mark.asyncio
async def test_every_entry_corrupted_at_rest_by_faulty_tier_is_a_miss(tmp_path: Path) -> None:
    eng = Engine(torch.bfloat16)
    tokens, blocks = _tokens(4), list(range(4))
    disk = DiskTier(tmp_path / "d", 32 << 20, encoding="fp8")
    async with Offloader(
        eng.layout, [CPUTier(capacity_bytes=1 << 20), FaultyTier(disk, corrupt_rate=1.0, seed=3)]
    ) as off:
        await _store(off, tokens, blocks)
    assert disk.stats().stored_blocks == 4
    eng.wipe()
    disk2 = DiskTier(tmp_path / "d", 32 << 20, encoding="fp8")
    async with Offloader(eng.layout, [CPUTier(capacity_bytes=1 << 20), disk2]) as off:
        assert await _restore(off, tokens, blocks) == 0
    assert all(torch.all(t == -3.0) for t in eng.kv)  # nothing corrupt was ever written into the engine


# ---------------------------------------------------------------------------------------- --tiers grammar


def test_tiers_setting_takes_an_encoding_for_disk_and_redis() -> None:
    from aiokv.tiers._settings import parse_tiers

    cpu, disk, redis = parse_tiers(
        "cpu=1GiB,disk=/tmp/x:2GiB:encoding=fp8,redis=redis://h:6379/0:encoding=int8"
    )
    assert (cpu.encoding, disk.encoding, redis.encoding) == ("raw", "fp8", "int8")
    assert (disk.path, disk.capacity_bytes, redis.url) == ("/tmp/x", 2 << 30, "redis://h:6379/0")
    assert disk.describe().endswith(":encoding=fp8")
    built = disk.build()
    assert isinstance(built, DiskTier)
    assert built.encoding == "fp8"
    assert parse_tiers("cpu=1GiB,disk=/tmp/x:2GiB")[1].encoding == "raw"


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("cpu=1GiB:encoding=fp8", "encoding applies to the disk and redis tiers only"),
        ("cpu=1GiB,shm=a:1GiB:encoding=fp8", "encoding applies to the disk and redis tiers only"),
        ("cpu=1GiB,disk=/x:1GiB:encoding=fp4", "encoding must be one of"),
        ("cpu=1GiB,disk=/x:1GiB:encoding=", "encoding must be one of"),
    ],
)
def test_tiers_setting_refuses_a_bad_encoding(text: str, match: str) -> None:
    from aiokv.tiers._settings import parse_tiers

    with pytest.raises(InvalidArgumentError, match=match):
        parse_tiers(text)


# ---------------------------------------------------------------------------------------- sizing, public


@pytest.mark.asyncio
@pytest.mark.parametrize("encoding", ["raw", "fp8", "int8"])
async def test_tier_entry_and_encoded_payload_bytes_are_what_an_open_tier_reports(
    tmp_path: Path, encoding: str
) -> None:
    from aiokv.tiers import encoded_payload_bytes, tier_entry

    layout = aiokv.KVLayout(_kv(2, torch.bfloat16), block_size=BS)
    payload = encoded_payload_bytes(encoding, segments_of(layout), layout.slot_bytes)
    tier = DiskTier(tmp_path / "d", 3 << 20, encoding=encoding, preallocate=False)
    await tier.open(TierSpec(layout.slot_bytes, layout.fingerprint, BS, "t", segments_of(layout)))
    try:
        st = tier.stats()
        assert tier_entry("disk", payload, 3 << 20) == (st.entry_bytes, st.num_slots)
    finally:
        await tier.aclose()
    assert tier_entry("redis", payload) == (HEADER_SIZE + payload, None)


def test_tier_entry_refuses_bad_arguments() -> None:
    from aiokv.tiers import tier_entry

    with pytest.raises(InvalidArgumentError, match="kind must be"):
        tier_entry("cpu", 100)
    with pytest.raises(InvalidArgumentError, match="payload_bytes must be"):
        tier_entry("disk", 0)
    with pytest.raises(InvalidArgumentError, match="capacity_bytes must be"):
        tier_entry("redis", 10, -1)
