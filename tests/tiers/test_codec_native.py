"""The C block codec (``aiokv/_native/_codec.c``) against its definition, the torch code of
``aiokv.tiers._codec``: byte for byte the same entries and the same restored slots, for every dtype, block
shape and encoding, the same refusals (a value that is not finite, a scale that is not finite and positive),
and a plan that does not fit its buffers refused before any byte is read."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from aiokv.tiers import _codec
from aiokv.tiers._codec import Codec, DecodeError, EncodeError, SegmentSpec, make_codec

pytestmark = pytest.mark.skipif(
    _codec._native_codec is None, reason="aiokv._native._codec is not built (or AIOKV_NATIVE_CODEC=0)"
)

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float64]
# The largest finite value the test data may reach per dtype (fp16's range is small).
LIMIT = {torch.bfloat16: 1e30, torch.float16: 6e4, torch.float32: 1e30, torch.float64: 1e30}


def _codec_of(encoding: str, segments: list[SegmentSpec]) -> Codec:
    codec = make_codec(encoding, segments, sum(s.nbytes for s in segments))
    assert codec is not None
    assert codec.native
    return codec


def _data(n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Values over many magnitudes: zeros, negative zeros, tiny (subnormal in 16 bits) and large ones."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g, dtype=torch.float64)
    x *= torch.exp(torch.randn(n, generator=g, dtype=torch.float64) * 3)
    x[torch.rand(n, generator=g) < 0.05] *= 1e-7
    x[torch.rand(n, generator=g) < 0.02] = 0.0
    x[torch.rand(n, generator=g) < 0.02] = -0.0
    return x.clamp(-LIMIT[dtype], LIMIT[dtype]).to(dtype)


def _both_encode(codec: Codec, slot: bytes) -> tuple[bytearray, bytearray]:
    native, torch_ = bytearray(codec.encoded_bytes), bytearray(codec.encoded_bytes)
    codec.encode(slot, native)
    codec._encode_torch(bytearray(slot), torch_)
    return native, torch_


def _both_decode(codec: Codec, entry: bytes) -> tuple[bytearray, bytearray]:
    native, torch_ = bytearray(codec.decoded_bytes), bytearray(codec.decoded_bytes)
    codec.decode(entry, native)
    codec._decode_torch(bytearray(entry), torch_)
    return native, torch_


def _first_difference(a: bytes, b: bytes) -> str:
    x, y = np.frombuffer(a, np.uint8), np.frombuffer(b, np.uint8)
    where = np.nonzero(x != y)[0]
    return f"{len(where)} bytes differ, first at {where[:5].tolist()}: {x[where[:5]]} vs {y[where[:5]]}"


SHAPES = [(16, 4, 32), (16, 8, 128), (16, 72), (64,), (3, 5, 7, 9), (1, 1), (2, 300, 3)]


@pytest.mark.parametrize("encoding", ["fp8", "int8"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("inner", SHAPES, ids=str)
def test_native_matches_torch_byte_for_byte(
    encoding: str, dtype: torch.dtype, inner: tuple[int, ...]
) -> None:
    count = 3
    codec = _codec_of(encoding, [SegmentSpec(0, count, inner, dtype)])
    slot = _data(count * math.prod(inner), dtype, seed=hash((encoding, str(dtype), inner)) & 0xFFFF)
    native, reference = _both_encode(codec, slot.view(torch.uint8).numpy().tobytes())
    assert native == reference, _first_difference(native, reference)
    restored, restored_ref = _both_decode(codec, bytes(native))
    assert restored == restored_ref, _first_difference(restored, restored_ref)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_fp8_conversion_of_every_16_bit_value(dtype: torch.dtype) -> None:
    """Every finite 16-bit value of [-448, 448] quantized with scale 1 (the block's amax is 448): the C
    float -> e4m3 rounding against torch's, value by value, ties and subnormals included."""
    every = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(dtype)
    values = every[torch.isfinite(every) & (every.float().abs() <= 448)]
    values = torch.cat([values, torch.tensor([448.0], dtype=dtype)])
    codec = _codec_of("fp8", [SegmentSpec(0, 1, (values.numel(),), dtype)])
    native, reference = _both_encode(codec, values.view(torch.uint8).numpy().tobytes())
    assert native[:4] == np.float32(1.0).tobytes()  # the one scale
    assert native == reference, _first_difference(native, reference)


@pytest.mark.parametrize("encoding", ["fp8", "int8"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_decode_of_every_byte_over_many_scales(encoding: str, dtype: torch.dtype) -> None:
    """Each of the 256 codes decoded with scales from 2^-40 to 2^40 (fp16 subnormals and overflow to inf
    included): the C table against torch's multiply and conversion."""
    groups = 81
    scales = (2.0 ** torch.linspace(-40, 40, groups)).float() * 1.37
    codec = _codec_of(encoding, [SegmentSpec(0, 1, (groups, 256), dtype)])
    codes = torch.arange(256, dtype=torch.uint8)
    if encoding == "fp8":  # 0x7f and 0xff are e4m3's NaNs, never written: leave them out of the comparison
        codes[0x7F], codes[0xFF] = 0x7E, 0xFE
    entry = scales.numpy().tobytes() + codes.repeat(groups).numpy().tobytes()
    restored, reference = _both_decode(codec, entry)
    assert restored == reference, _first_difference(restored, reference)


def test_mixed_parts_and_raw_ones() -> None:
    """A slot of float parts of different dtypes and an integer part (stored as it is), at odd offsets."""
    segments = [
        SegmentSpec(0, 2, (16, 4, 8), torch.bfloat16),
        SegmentSpec(2 * 16 * 4 * 8 * 2, 3, (5,), torch.int64),
        SegmentSpec(2 * 16 * 4 * 8 * 2 + 3 * 5 * 8, 2, (16, 3), torch.float32),
    ]
    for encoding in ("fp8", "int8"):
        codec = _codec_of(encoding, segments)
        parts = [
            _data(2 * 16 * 4 * 8, torch.bfloat16, 1).view(torch.uint8),
            torch.arange(15, dtype=torch.int64).view(torch.uint8),
            _data(2 * 16 * 3, torch.float32, 2).view(torch.uint8),
        ]
        slot = torch.cat(parts).numpy().tobytes()
        native, reference = _both_encode(codec, slot)
        assert native == reference
        restored, restored_ref = _both_decode(codec, bytes(native))
        assert restored == restored_ref
        assert (
            restored[parts[0].numel() : parts[0].numel() + 120]
            == slot[parts[0].numel() : parts[0].numel() + 120]
        )


@settings(max_examples=60, deadline=None)
@given(
    encoding=st.sampled_from(["fp8", "int8"]),
    dtype=st.sampled_from(DTYPES),
    inner=st.lists(st.integers(1, 9), min_size=1, max_size=4).map(tuple),
    count=st.integers(1, 4),
    seed=st.integers(0, 2**16),
)
def test_native_matches_torch_on_random_shapes(
    encoding: str, dtype: torch.dtype, inner: tuple[int, ...], count: int, seed: int
) -> None:
    codec = _codec_of(encoding, [SegmentSpec(0, count, inner, dtype)])
    slot = _data(count * math.prod(inner), dtype, seed).view(torch.uint8).numpy().tobytes()
    native, reference = _both_encode(codec, slot)
    assert native == reference
    restored, restored_ref = _both_decode(codec, bytes(native))
    assert restored == restored_ref


@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_value_that_is_not_finite_is_refused_by_both(bad: float, dtype: torch.dtype) -> None:
    codec = _codec_of("fp8", [SegmentSpec(0, 2, (4, 2, 8), dtype)])
    x = _data(2 * 4 * 2 * 8, dtype, 3)
    x[77] = bad
    slot = x.view(torch.uint8).numpy().tobytes()
    with pytest.raises(EncodeError):
        codec.encode(slot, bytearray(codec.encoded_bytes))
    with pytest.raises(EncodeError):
        codec._encode_torch(bytearray(slot), bytearray(codec.encoded_bytes))


def test_float64_beyond_float32_range_is_refused() -> None:
    """torch's x.float() turns it into inf: not finite, not encoded (rather than a clamped, wrong value)."""
    codec = _codec_of("int8", [SegmentSpec(0, 1, (4, 8), torch.float64)])
    x = torch.ones(32, dtype=torch.float64)
    x[5] = 1e300
    with pytest.raises(EncodeError):
        codec.encode(x.view(torch.uint8).numpy().tobytes(), bytearray(codec.encoded_bytes))


@pytest.mark.parametrize("bad", [0.0, -1.0, math.inf, math.nan, -0.0])
@pytest.mark.parametrize("encoding", ["fp8", "int8"])
def test_a_scale_that_is_not_finite_and_positive_is_refused_by_both(bad: float, encoding: str) -> None:
    codec = _codec_of(encoding, [SegmentSpec(0, 2, (4, 3, 8), torch.bfloat16)])
    entry = bytearray(codec.encoded_bytes)
    codec.encode(_data(2 * 4 * 3 * 8, torch.bfloat16, 4).view(torch.uint8).numpy().tobytes(), entry)
    entry[4 * 4 : 4 * 5] = np.float32(bad).tobytes()  # the second segment's second scale
    with pytest.raises(DecodeError):
        codec.decode(bytes(entry), bytearray(codec.decoded_bytes))
    with pytest.raises(DecodeError):
        codec._decode_torch(entry, bytearray(codec.decoded_bytes))


def test_plan_that_does_not_fit_is_refused_before_reading() -> None:
    native = _codec._native_codec
    codec = _codec_of("fp8", [SegmentSpec(0, 2, (4, 3, 8), torch.bfloat16)])
    slot = bytes(codec.decoded_bytes)
    with pytest.raises(ValueError, match="does not fit"):
        native.encode(codec._plan, slot, bytearray(codec.encoded_bytes - 1), native.KIND_FP8)
    with pytest.raises(ValueError, match="does not fit"):
        native.decode(
            codec._plan, bytes(codec.encoded_bytes), bytearray(codec.decoded_bytes - 1), native.KIND_FP8
        )
    with pytest.raises(ValueError, match="int64 records"):
        native.encode(codec._plan[:-8], slot, bytearray(codec.encoded_bytes), native.KIND_FP8)
    bad = np.frombuffer(codec._plan, np.int64).copy()
    bad[6] = 9  # no such dtype code
    with pytest.raises(ValueError, match="malformed"):
        native.encode(bad.tobytes(), slot, bytearray(codec.encoded_bytes), native.KIND_FP8)
    bad = np.frombuffer(codec._plan, np.int64).copy()
    bad[2] = 1 << 62  # a count whose byte size overflows
    with pytest.raises(ValueError, match="malformed"):
        native.encode(bad.tobytes(), slot, bytearray(codec.encoded_bytes), native.KIND_FP8)
    with pytest.raises(ValueError, match="kind"):
        native.encode(codec._plan, slot, bytearray(codec.encoded_bytes), 7)
    with pytest.raises(BufferError):  # a read-only destination
        native.decode(codec._plan, bytes(codec.encoded_bytes), slot, native.KIND_FP8)


def test_read_only_sources_are_read_in_place() -> None:
    """A Redis reply is ``bytes``: the C path reads it without the copy the torch path needs."""
    codec = _codec_of("int8", [SegmentSpec(0, 1, (16, 2, 8), torch.float16)])
    slot = _data(256, torch.float16, 5).view(torch.uint8).numpy().tobytes()
    entry = bytearray(codec.encoded_bytes)
    codec.encode(memoryview(slot), entry)
    out = bytearray(codec.decoded_bytes)
    codec.decode(memoryview(bytes(entry)), out)
    want = torch.frombuffer(bytearray(slot), dtype=torch.float16).float()
    got = torch.frombuffer(out, dtype=torch.float16).float()
    assert float((want - got).abs().max()) <= float(want.abs().max()) / 127
