"""CUDA backend: the same guarantees on a GPU engine cache (skipped without a CUDA device)."""

from __future__ import annotations

import pytest
import torch

import aiokv

pytestmark = [pytest.mark.gpu, pytest.mark.asyncio]


def _layout(
    num_blocks: int = 64, dtype: torch.dtype = torch.float16
) -> tuple[list[torch.Tensor], aiokv.KVLayout]:
    kv = [torch.randn(num_blocks, 16, 8, 128, device="cuda").to(dtype) for _ in range(8)]
    return kv, aiokv.KVLayout(kv, block_size=16)


async def test_cuda_round_trip_is_bitwise() -> None:
    kv, layout = _layout()
    async with aiokv.Offloader(layout, tiers=[aiokv.CPUTier(capacity_bytes=64 * layout.slot_bytes)]) as off:
        assert off.cpu.stats().pinned_memory
        assert off.stats().backend == "cuda"
        prompt = list(range(16 * 5 + 3))
        req = off.open("a", prompt)
        await req.lookup()
        blocks = [5, 17, 3, 40, 41, 9]
        req.step(len(prompt), new_token_ids=(1,), new_block_ids=blocks)
        await req.finish()
        expect = [t[blocks[:5]].clone() for t in kv]
        for t in kv:
            t[blocks].fill_(float("nan"))  # the engine reuses the blocks at once
        req2 = off.open("b", prompt)
        assert await req2.lookup() == 80
        dst = [60, 61, 62, 63, 0]
        await req2.load(dst)
        for t, e in zip(kv, expect):
            assert torch.equal(t[dst], e)
        await req2.abort()


async def test_store_is_ordered_after_the_compute_stream() -> None:
    """A kernel still running on the compute stream when step() is called writes the KV the store must see."""
    kv, layout = _layout(dtype=torch.float32)
    async with aiokv.Offloader(layout, tiers=[aiokv.CPUTier(capacity_bytes=64 * layout.slot_bytes)]) as off:
        prompt = list(range(33))
        req = off.open("a", prompt)
        await req.lookup()
        big = torch.randn(4096, 4096, device="cuda")
        for _ in range(20):  # keep the compute stream busy
            big = big @ big / 4096
        for t in kv:
            t[[1, 2]] = torch.full_like(t[[1, 2]], 3.0)  # queued behind the matmuls
        req.step(33, new_token_ids=(1,), new_block_ids=[1, 2, 3])
        await req.finish()
        slot0 = off.cpu.slot_tensor(off.cpu.index.slot(aiokv.block_hashes(prompt, 16, root=layout.root)[0]))
        assert torch.all(slot0.view(torch.float32) == 3.0)


async def test_cuda_block_dim_1_layout() -> None:
    kv = [torch.randn(2, 32, 16, 4, 64, device="cuda") for _ in range(4)]
    layout = aiokv.KVLayout(kv, block_size=16, block_dim=1)
    async with aiokv.Offloader(layout, tiers=[aiokv.CPUTier(capacity_bytes=32 * layout.slot_bytes)]) as off:
        req = off.open("a", list(range(33)))
        await req.lookup()
        req.step(33, new_token_ids=(1,), new_block_ids=[4, 5, 6])
        await req.finish()
        expect = [t[:, [4, 5]].clone() for t in kv]
        req2 = off.open("b", list(range(33)))
        assert await req2.lookup() == 32
        await req2.load([10, 20])
        for t, e in zip(kv, expect):
            assert torch.equal(t[:, [10, 20]], e)
        await req2.abort()
