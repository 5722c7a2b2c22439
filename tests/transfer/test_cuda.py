"""The CUDA binding: what only a GPU can show (skipped without a CUDA device).

The ordering tests (non-default compute stream, step before the forward ran, loads awaited on the device,
staging, failures) run on CUDA through ``test_device_path.py``'s harness; this file covers the binding itself:
bitwise round trips across dtypes and layouts, host memory registration, the gather element width and many
concurrent requests.
"""

from __future__ import annotations

import random

import pytest
import torch

import aiokv
from aiokv.transfer._cuda import CudaDevice, _CudaCopier

pytestmark = pytest.mark.gpu

BS = 16


def _layout(
    num_blocks: int, dtype: torch.dtype, block_dim: int = 0
) -> tuple[list[torch.Tensor], aiokv.KVLayout]:
    if block_dim == 0:
        kv = [torch.randn(num_blocks, BS, 8, 128, device="cuda").to(dtype) for _ in range(8)]
    else:
        kv = [torch.randn(2, num_blocks, BS, 4, 64, device="cuda").to(dtype) for _ in range(4)]
    return kv, aiokv.KVLayout(kv, block_size=BS, block_dim=block_dim)


def _blocks(t: torch.Tensor, ids: list[int], block_dim: int) -> torch.Tensor:
    return t[ids] if block_dim == 0 else t[:, ids]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("block_dim", [0, 1])
@pytest.mark.asyncio
async def test_round_trip_is_bitwise(dtype: torch.dtype, block_dim: int) -> None:
    kv, layout = _layout(64, dtype, block_dim)
    stream = torch.cuda.Stream()
    async with aiokv.Offloader(
        layout, tiers=[aiokv.CPUTier(capacity_bytes=64 * layout.slot_bytes)], compute_stream=stream
    ) as off:
        assert off.stats().backend == "cuda"
        prompt = list(range(BS * 5 + 3))
        req = off.open("a", prompt)
        await req.lookup()
        blocks = [5, 17, 3, 40, 41, 9]
        req.step(len(prompt), new_token_ids=(1,), new_block_ids=blocks)
        await req.finish()
        expect = [_blocks(t, blocks[:5], block_dim).clone() for t in kv]
        for t in kv:  # the engine reuses the blocks at once (an in-place write, on the compute stream)
            with torch.cuda.stream(stream):
                if block_dim == 0:
                    t[blocks] = float("nan")
                else:
                    t[:, blocks] = float("nan")
        req2 = off.open("b", prompt)
        assert await req2.lookup() == 5 * BS
        dst = [60, 61, 62, 63, 0]
        assert await req2.load(dst) == 5 * BS
        torch.cuda.synchronize()
        for t, e in zip(kv, expect, strict=True):
            assert torch.equal(_blocks(t, dst, block_dim), e)
        await req2.abort()


@pytest.mark.asyncio
async def test_host_buffer_is_registered_in_place_and_released() -> None:
    """40 MiB asked, 40 MiB (rounded down to whole slots) pinned: no power-of-two rounding, no copy."""
    _, layout = _layout(16, torch.float16)
    capacity = 40 << 20
    tier = aiokv.CPUTier(capacity_bytes=capacity)
    async with aiokv.Offloader(layout, tiers=[tier]) as off:
        buf = off.cpu.buffer
        assert off.cpu.stats().pinned_memory
        assert buf.is_pinned()
        assert buf.numel() == (capacity // layout.slot_bytes) * layout.slot_bytes
    assert not off.cpu.stats().pinned_memory
    assert not buf.is_pinned()  # unregistered at close


@pytest.mark.asyncio
async def test_unpinned_host_memory_is_refused_for_a_cuda_layout() -> None:
    _, layout = _layout(16, torch.float16)
    with pytest.raises(aiokv.InvalidArgumentError, match="pinned=False cannot serve a cuda layout"):
        aiokv.Offloader(layout, tiers=[aiokv.CPUTier(capacity_bytes=1 << 24, pinned=False)])


def test_gathers_move_eight_bytes_per_element() -> None:
    _, layout = _layout(16, torch.float16)
    assert _CudaCopier(layout)._unit_dtype == torch.int64


def test_completion_events_block_instead_of_spinning() -> None:
    dev = CudaDevice()
    ev = dev.new_event(blocking=True)
    assert ev.blocking  # torch.cuda.Event(blocking=True) -> cudaEventBlockingSync


@pytest.mark.asyncio
async def test_many_concurrent_requests_restore_their_own_blocks() -> None:
    kv, layout = _layout(1024, torch.float16)
    rng = random.Random(0)
    async with aiokv.Offloader(layout, tiers=[aiokv.CPUTier(capacity_bytes=600 * layout.slot_bytes)]) as off:
        prompts = [[rng.randrange(1 << 20) for _ in range(2 * BS + 1)] for _ in range(128)]
        pool = rng.sample(range(1024), 3 * 128)
        reqs = []
        for i, p in enumerate(prompts):
            r = off.open(f"r{i}", p)
            await r.lookup()
            r.step(len(p), new_token_ids=[1], new_block_ids=pool[3 * i : 3 * i + 3])
            reqs.append(r)
        for r in reqs:
            await r.finish()
        expect = [[t[pool[3 * i : 3 * i + 2]].clone() for t in kv] for i in range(128)]
        free = [b for b in range(1024) if b not in set(pool)]
        loads = []
        for i, p in enumerate(prompts):
            r = off.open(f"l{i}", p)
            assert await r.lookup() == 2 * BS
            loads.append((r, free[2 * i : 2 * i + 2], r.load(free[2 * i : 2 * i + 2])))
        for _r, _dst, pending in loads:
            assert await pending == 2 * BS
        torch.cuda.synchronize()
        for (r, dst, _), e in zip(loads, expect, strict=True):
            assert all(torch.equal(t[dst], x) for t, x in zip(kv, e, strict=True))
            await r.abort()
