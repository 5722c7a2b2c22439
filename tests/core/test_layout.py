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

from aiokv import CPUTier, KVLayout, Offloader
from aiokv.transfer._cpu import copy_segments

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
    layout = KVLayout([t0, t1], block_size=3, block_dim=1)
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
    layout = KVLayout(tensors, block_size=1, block_dim=block_dim)
    num_blocks = layout.num_blocks
    blocks = data.draw(st.permutations(range(num_blocks)))
    slots = data.draw(st.permutations(range(num_blocks)))
    host = np.zeros(num_blocks * layout.slot_bytes, dtype=np.uint8)
    engine, host_addrs, nbytes = layout.copy_plan(blocks, slots, host.ctypes.data)
    copy_segments(host_addrs, engine, nbytes)
    for b, s in zip(blocks, slots, strict=True):
        want = b"".join(block_bytes(t, block_dim, b) for t in tensors)
        got = host[s * layout.slot_bytes : (s + 1) * layout.slot_bytes].tobytes()
        assert got == want
    # And back: loading the slots into a zeroed copy of the tensors restores them exactly.
    clones = [torch.zeros_like(t) for t in tensors]
    back = KVLayout(clones, block_size=1, block_dim=block_dim)
    engine2, host2, nbytes2 = back.copy_plan(blocks, slots, host.ctypes.data)
    copy_segments(engine2, host2, nbytes2)
    for t, c in zip(tensors, clones, strict=True):
        assert torch.equal(t, c)
