"""KVLayout: the supported paged layouts round-trip byte-exactly through an Offloader, and the copy plan's
address math matches the slot packing the module documents."""

from __future__ import annotations

import random
from collections.abc import Callable

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from aiokv import CPUTier, InvalidArgumentError, InvalidLayoutError, InvalidTypeError, KVLayout, Offloader
from aiokv.transfer._cpu import CopyPlanner, copy_segments

NB = 12  # engine blocks
BS = 4  # tokens per block
HEADS, DIM = 2, 8
LAYERS = 2
DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.int8]


def random_tensor(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """A contiguous tensor of random *bytes* (every bit pattern, NaNs included: copies must be bytewise)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (*shape[:-1], shape[-1] * itemsize), dtype=torch.uint8, generator=gen)
    return raw.view(dtype)


def block_bytes(t: torch.Tensor, block_dim: int, b: int) -> bytes:
    block = t.select(block_dim, b)
    fresh = torch.empty(block.numel(), dtype=t.dtype)  # standard strides, even for size-1 dims
    fresh.view(block.shape).copy_(block)
    return fresh.view(torch.uint8).numpy().tobytes()


# Each layout factory returns (tensors as the engine passes them, the flat list of tensors, block_dim).
LayoutFactory = Callable[[torch.dtype, torch.Generator], tuple[object, list[torch.Tensor], int]]


def vllm_layout(dtype: torch.dtype, gen: torch.Generator) -> tuple[object, list[torch.Tensor], int]:
    """vLLM: per layer a (K, V) pair of (num_blocks, block_size, heads, dim) tensors; block_dim=0."""
    pairs = [tuple(random_tensor((NB, BS, HEADS, DIM), dtype, gen) for _ in range(2)) for _ in range(LAYERS)]
    return pairs, [t for pair in pairs for t in pair], 0


def stacked_layout(dtype: torch.dtype, gen: torch.Generator) -> tuple[object, list[torch.Tensor], int]:
    """One (2, num_blocks, block_size, heads, dim) tensor per layer (K and V stacked); block_dim=1."""
    ts = [random_tensor((2, NB, BS, HEADS, DIM), dtype, gen) for _ in range(LAYERS)]
    return ts, ts, 1


def stacked_view_layout(dtype: torch.dtype, gen: torch.Generator) -> tuple[object, list[torch.Tensor], int]:
    """(2, num_blocks, ...) views of (num_blocks, 2, ...) storage: non-contiguous in the outer and block dims,
    contiguous within a block, which is all the layout needs."""
    ts = [random_tensor((NB, 2, BS, HEADS, DIM), dtype, gen).transpose(0, 1) for _ in range(LAYERS)]
    assert not ts[0].is_contiguous()
    return ts, ts, 1


def strided_blocks_layout(dtype: torch.dtype, gen: torch.Generator) -> tuple[object, list[torch.Tensor], int]:
    """Every other block of a bigger pool, and every other K/V plane: strided outer and block dims."""
    ts = [random_tensor((4, 2 * NB, BS, HEADS, DIM), dtype, gen)[::2, ::2] for _ in range(LAYERS)]
    assert ts[0].shape == (2, NB, BS, HEADS, DIM)
    return ts, ts, 1


LAYOUTS = {
    "vllm": vllm_layout,
    "stacked": stacked_layout,
    "stacked-view": stacked_view_layout,
    "strided-blocks": strided_blocks_layout,
}


@pytest.mark.asyncio
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", list(LAYOUTS))
async def test_layout_round_trips_through_an_offloader(kind: str, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(7)
    engine_tensors, flat, block_dim = LAYOUTS[kind](dtype, gen)
    layout = KVLayout(engine_tensors, block_size=BS, block_dim=block_dim)  # type: ignore[arg-type]
    assert len(layout.tensors) == len(flat)
    assert all(a is b for a, b in zip(layout.tensors, flat, strict=True))
    rng = random.Random(kind)
    src = rng.sample(range(NB), 5)
    dst = rng.sample([b for b in range(NB) if b not in src], 5)
    tokens = [rng.randrange(50_000) for _ in range(5 * BS + 1)]
    expected = [[block_bytes(t, block_dim, b) for b in src] for t in flat]

    async with Offloader(layout, [CPUTier(capacity_bytes=16 * layout.slot_bytes)]) as off:
        writer = off.open("w", tokens)
        writer.step(len(tokens) - 1, new_block_ids=src)
        await writer.finish()
        assert off.stats().blocks_stored == 5

        before = [[block_bytes(t, block_dim, b) for b in range(NB)] for t in flat]
        reader = off.open("r", tokens)
        assert await reader.lookup() == 5 * BS
        await reader.load(dst)
        await reader.finish()
        assert off.stats().blocks_loaded == 5

    for i, t in enumerate(flat):
        for j, b in enumerate(dst):
            assert block_bytes(t, block_dim, b) == expected[i][j], f"tensor {i} block {b}"
        for b in range(NB):  # nothing outside the destination blocks was written
            if b not in dst:
                assert block_bytes(t, block_dim, b) == before[i][b], f"tensor {i} block {b} was clobbered"


def test_layout_accepts_dicts_and_pairs_and_reports_sizes() -> None:
    k = torch.zeros(NB, BS, HEADS, DIM, dtype=torch.float16)
    v = torch.zeros_like(k)
    by_pair = KVLayout([(k, v)], block_size=BS)
    by_dict = KVLayout({"k": k, "v": v}, block_size=BS)
    single = KVLayout(k, block_size=BS)
    assert by_pair.tensors == by_dict.tensors == (k, v)
    assert by_pair.fingerprint == by_dict.fingerprint
    assert single.tensors == (k,)
    assert by_pair.slot_bytes == 2 * BS * HEADS * DIM * 2
    assert by_pair.bytes_per_token == 2 * HEADS * DIM * 2
    assert by_pair.num_blocks == NB
    assert not by_pair.is_cuda
    assert (
        repr(by_pair)
        == f"KVLayout(2 tensors x {NB} blocks of {BS} tokens, 256 bytes/block, torch.float16 on cpu)"
    )


def test_outer_strided_view_is_accepted_when_blocks_are_contiguous() -> None:
    base = torch.zeros(NB, 2, BS, HEADS, DIM)
    view = base.transpose(0, 1)  # (2, NB, ...), outer stride BS*HEADS*DIM, block stride 2*BS*HEADS*DIM
    layout = KVLayout([view], block_size=BS, block_dim=1)
    (spec,) = layout.specs
    per_block = BS * HEADS * DIM * 4
    assert spec.outer == 2
    assert spec.inner_bytes == per_block
    assert spec.outer_strides == (per_block,)
    assert spec.block_stride == 2 * per_block
    assert layout.slot_bytes == 2 * per_block


def test_copy_plan_address_math() -> None:
    # t0: fp16 (2, 5, 3, 4), block_dim=1: 2 segments of 3*4*2 = 24 B, block stride 24 B, outer stride 120 B.
    # t1: int8 (2, 5, 7), block_dim=1: 2 segments of 7 B, block stride 7 B, outer stride 35 B.
    t0 = torch.zeros(2, 5, 3, 4, dtype=torch.float16)
    t1 = torch.zeros(2, 5, 7, dtype=torch.int8)
    layout = KVLayout([t0, t1], block_size=3, block_dim=1, token_dim=None)  # t1 has no token dimension
    assert layout.slot_bytes == 2 * 24 + 2 * 7 == 62
    p0, p1 = t0.data_ptr(), t1.data_ptr()
    engine, host, nbytes = layout.copy_plan([3, 1], [0, 4], buffer_addr=1000)
    assert engine.dtype == host.dtype == nbytes.dtype == np.int64
    assert engine.tolist() == [
        p0 + 3 * 24, p0 + 120 + 3 * 24, p1 + 3 * 7, p1 + 35 + 3 * 7,
        p0 + 1 * 24, p0 + 120 + 1 * 24, p1 + 1 * 7, p1 + 35 + 1 * 7,
    ]  # fmt: skip
    assert host.tolist() == [
        1000 + 0,
        1000 + 24,
        1000 + 48,
        1000 + 55,
        1248 + 0,
        1248 + 24,
        1248 + 48,
        1248 + 55,
    ]
    assert nbytes.tolist() == [24, 24, 7, 7] * 2
    empty = layout.copy_plan([], [], buffer_addr=1000)
    assert [len(a) for a in empty] == [0, 0, 0]


def test_copy_plan_of_a_vllm_layout_is_one_segment_per_tensor() -> None:
    k = torch.zeros(NB, BS, HEADS, DIM)
    v = torch.zeros_like(k)
    layout = KVLayout([k, v], block_size=BS)
    blk = BS * HEADS * DIM * 4
    engine, host, nbytes = layout.copy_plan([5], [2], buffer_addr=0)
    assert engine.tolist() == [k.data_ptr() + 5 * blk, v.data_ptr() + 5 * blk]
    assert host.tolist() == [2 * 2 * blk, 2 * 2 * blk + blk]
    assert nbytes.tolist() == [blk, blk]


@st.composite
def layouts(draw: st.DrawFn) -> tuple[list[torch.Tensor], int]:
    block_dim = draw(st.integers(0, 2))
    num_blocks = draw(st.integers(1, 5))
    n = draw(st.integers(1, 3))
    outer = draw(st.lists(st.integers(1, 3), min_size=block_dim, max_size=block_dim))
    tensors = []
    for i in range(n):
        inner = draw(st.lists(st.integers(1, 4), min_size=0, max_size=2))
        dtype = draw(st.sampled_from([torch.int8, torch.float16, torch.float32, torch.float64]))
        shape = (*outer, num_blocks, *inner)
        numel = int(np.prod(shape))
        t = torch.arange(numel, dtype=torch.int64).reshape(shape).to(dtype) + i * 100
        if draw(st.booleans()) and block_dim > 0:
            # Reverse-pack the outer dims: same shape, non-contiguous outer strides.
            dims = list(range(t.dim()))
            perm = dims[:block_dim][::-1] + dims[block_dim:]
            t = t.permute(perm).contiguous().permute(perm)
        tensors.append(t)
    return tensors, block_dim


@settings(max_examples=60, deadline=None)
@given(spec=layouts(), data=st.data())
def test_copy_plan_packs_slots_as_documented(
    spec: tuple[list[torch.Tensor], int], data: st.DataObject
) -> None:
    """A slot holds, tensor by tensor, the block's outer segments in row-major order."""
    tensors, block_dim = spec
    layout = KVLayout(tensors, block_size=1, block_dim=block_dim, token_dim=None)
    num_blocks = layout.num_blocks
    blocks = data.draw(st.permutations(range(num_blocks)))
    slots = data.draw(st.permutations(range(num_blocks)))
    host = np.zeros(num_blocks * layout.slot_bytes, dtype=np.uint8)
    engine, host_side, nbytes = CopyPlanner(layout, torch.from_numpy(host)).plan(blocks, slots)  # via copy_plan
    copy_segments(host_side, engine, nbytes)
    for b, s in zip(blocks, slots, strict=True):
        want = b"".join(block_bytes(t, block_dim, b) for t in tensors)
        got = host[s * layout.slot_bytes : (s + 1) * layout.slot_bytes].tobytes()
        assert got == want
    # And back: loading the slots into a zeroed copy of the tensors restores them exactly.
    clones = [torch.zeros_like(t) for t in tensors]
    back = KVLayout(clones, block_size=1, block_dim=block_dim, token_dim=None)
    engine2, host2, nbytes2 = CopyPlanner(back, torch.from_numpy(host)).plan(blocks, slots)
    copy_segments(engine2, host2, nbytes2)
    for t, c in zip(tensors, clones, strict=True):
        assert torch.equal(t, c)


def test_block_size_must_match_the_tokens_a_block_holds() -> None:
    """Regression: ``KVLayout(tensors, block_size=32)`` over tensors whose blocks hold 16 tokens was accepted;
    every hash then covered 32 tokens while a block held the KV of 16, so a restored block carried the KV of
    other tokens. The token dimension (right after ``block_dim`` by default) must hold ``block_size``."""
    kv = [torch.zeros(NB, 16, HEADS, DIM) for _ in range(2)]
    with pytest.raises(
        InvalidLayoutError,
        match=r"block_size must equal the size of the token dimension \(token_dim=1\) of every tensor, got "
        r"block_size=32 and tensors\[0\] of shape \[12, 16, 2, 8\] holding 16 tokens per block",
    ):
        KVLayout(kv, block_size=32)
    assert KVLayout(kv, block_size=16).token_dim == 1
    # A stacked (2, num_blocks, block_size, ...) tensor: the token dimension follows block_dim.
    stacked = torch.zeros(2, NB, 16, DIM)
    assert KVLayout([stacked], block_size=16, block_dim=1).token_dim == 2
    with pytest.raises(InvalidLayoutError, match=r"\(token_dim=2\).*got block_size=8 and tensors\[0\]"):
        KVLayout([stacked], block_size=8, block_dim=1)
    # Only one tensor of several disagreeing is found too.
    with pytest.raises(InvalidLayoutError, match=r"tensors\[1\] of shape \[12, 8, 2, 8\] holding 8 tokens"):
        KVLayout([kv[0], torch.zeros(NB, 8, HEADS, DIM)], block_size=16)
    # Other layouts name their token dimension; a layout without one opts out of the check.
    heads_first = torch.zeros(NB, HEADS, 16, DIM)  # (num_blocks, heads, block_size, dim)
    with pytest.raises(InvalidLayoutError, match=r"holding 2 tokens per block"):
        KVLayout([heads_first], block_size=16)
    assert KVLayout([heads_first], block_size=16, token_dim=2).token_dim == 2
    fused = torch.zeros(NB, 16 * HEADS * DIM)
    assert KVLayout([fused], block_size=16, token_dim=None).token_dim is None
    assert KVLayout([fused], block_size=16, token_dim=None).bytes_per_token == HEADS * DIM * 4


@pytest.mark.parametrize(
    ("make", "kwargs", "exc", "match"),
    [
        (lambda: [torch.zeros(NB, BS, 2)], {"token_dim": "1"}, InvalidTypeError, r"token_dim must be an int, None or 'after_block_dim', got str"),
        (lambda: [torch.zeros(NB, BS, 2)], {"token_dim": 1.0}, InvalidTypeError, r"token_dim must be an int, None or 'after_block_dim', got float"),
        (lambda: [torch.zeros(NB, BS, 2)], {"token_dim": -1}, InvalidArgumentError, r"token_dim must be a non-negative int, got -1"),
        (lambda: [torch.zeros(NB, BS, 2)], {"token_dim": 0}, InvalidArgumentError, r"token_dim must differ from block_dim, got 0 for both"),
        (lambda: [torch.zeros(NB, BS * 2)], {"token_dim": 2}, InvalidLayoutError, r"tensors\[0\] has 2 dims; token_dim=2 needs at least 3 \(pass token_dim=None"),
        (lambda: [torch.zeros(NB * BS)], {}, InvalidLayoutError, r"tensors\[0\] has 1 dims; token_dim=1 needs at least 2"),
    ],
)  # fmt: skip
def test_token_dim_is_validated(make: Callable[[], list[torch.Tensor]], kwargs: dict[str, object], exc: type[Exception], match: str) -> None:  # fmt: skip
    with pytest.raises(exc, match=match):
        KVLayout(make(), block_size=BS, **kwargs)  # type: ignore[arg-type]


def test_memory_passed_twice_or_overlapping_is_refused() -> None:
    """``[k0, k0]`` instead of ``[k0, v0]`` would offload K twice and V never, and an expanded (self-
    overlapping) view would make a load write one byte for several positions: both are refused."""
    k = torch.zeros(NB, BS, HEADS, DIM)
    with pytest.raises(
        InvalidLayoutError,
        match=r"tensors\[2\] must not share memory with tensors\[0\] \(the same tensor passed twice\?\)",
    ):
        KVLayout([k, torch.zeros_like(k), k], block_size=BS)
    with pytest.raises(InvalidLayoutError, match=r"tensors\[1\] must not share memory with tensors\[0\]"):
        KVLayout([k, k.view(NB, BS, HEADS * DIM)], block_size=BS)
    # K and V stacked outside the block dimension: the outer dimension is expanded from one plane.
    plane = torch.zeros(1, NB, BS, DIM).expand(2, NB, BS, DIM)
    with pytest.raises(
        InvalidLayoutError,
        match=r"tensors\[0\] must not have overlapping elements \(shape \[2, 12, 4, 8\], stride \[0, 32, 8, 1\]\)",
    ):
        KVLayout([plane], block_size=BS, block_dim=1)
    # Interleaved views of one buffer share no element: accepted.
    kv = torch.zeros(NB, 2, BS, DIM)
    layout = KVLayout([kv[:, 0], kv[:, 1]], block_size=BS)
    assert layout.slot_bytes == 2 * BS * DIM * 4


def test_a_dimension_of_size_zero_is_refused() -> None:
    with pytest.raises(
        InvalidLayoutError,
        match=r"tensors\[1\] must have no dimension of size 0, got shape \[12, 4, 0, 8\]: a block must hold at least one byte of every tensor",
    ):
        KVLayout([torch.zeros(NB, BS, HEADS, DIM), torch.zeros(NB, BS, 0, DIM)], block_size=BS)
