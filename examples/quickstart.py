"""Offload a request's KV blocks to the CPU tier and restore them into other engine blocks."""

import asyncio

import torch

import aiokv


async def main() -> None:
    # The engine's paged KV cache: per layer a K and a V tensor of (num_blocks, block_size, kv_heads, head_dim).
    kv = [torch.randn(64, 16, 8, 64) for _ in range(2 * 4)]
    layout = aiokv.KVLayout(kv, block_size=16)
    async with aiokv.Offloader(layout, tiers=[aiokv.CPUTier(capacity_bytes=256 << 20)]) as off:
        req = off.open("req-1", list(range(40)))
        assert await req.lookup() == 0  # cold cache
        req.step(40, new_token_ids=[7], new_block_ids=[0, 1, 2])  # prefill wrote 40 tokens into blocks 0-2
        await req.finish()  # blocks 0-2 may be reused now; the full blocks 0 and 1 were stored
        req2 = off.open("req-2", [*range(40), 7, 8, 9])
        hit = await req2.lookup()  # 32 tokens: two full blocks
        await req2.load([10, 11])  # KV of tokens 0..31 now in engine blocks 10 and 11
        assert all(torch.equal(t[[0, 1]], t[[10, 11]]) for t in kv)
        await req2.abort()
        print(f"restored {hit} tokens;", off.stats())


asyncio.run(main())
