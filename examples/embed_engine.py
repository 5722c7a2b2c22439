"""Embed aiokv in an engine loop: look up, load, step, preempt, finish. The user guide's complete example
(docs/guide.md, kept identical by tests/test_docs.py); run it with ``python examples/embed_engine.py``."""

import asyncio

import torch

import aiokv

BLOCK, NUM_BLOCKS, LAYERS = 16, 32, 2
# The engine's paged KV cache: per layer a K and a V tensor of (num_blocks, block_size, kv_heads, head_dim).
kv = [torch.zeros(NUM_BLOCKS, BLOCK, 4, 8) for _ in range(2 * LAYERS)]


class Pool:
    """A tiny block allocator. Freed blocks are poisoned with NaN: a block reused too early shows."""

    def __init__(self) -> None:
        self.free_ids = list(range(NUM_BLOCKS))

    def allocate(self, n: int) -> list[int]:
        assert n <= len(self.free_ids), "pool exhausted"
        out, self.free_ids = self.free_ids[:n], self.free_ids[n:]
        return out

    def free(self, ids: list[int]) -> None:
        for t in kv:
            t[ids] = float("nan")
        self.free_ids += ids


pool = Pool()


def forward(cache: list[torch.Tensor], blocks: list[int], start: int, tokens: list[int]) -> int:
    """A fake model: writes each new token's "KV" (made of its position and id), returns the next token."""
    for pos, tok in enumerate(tokens, start):
        for layer, t in enumerate(cache):
            t[blocks[pos // BLOCK], pos % BLOCK] = layer * 1e6 + pos * 1e3 + tok
    return (tokens[-1] * 7 + start + len(tokens)) % 1000


async def admit(req: aiokv.Request) -> tuple[list[int], int]:
    hit = await req.lookup()  # tokens aiokv holds: whole blocks, fewer than the request knows
    blocks = pool.allocate(hit // BLOCK)
    return blocks, await req.load(blocks)  # prefill from what load() restored (0 if its copy failed)


async def generate(off: aiokv.Offloader, rid: str, prompt: list[int], n: int, preempt_at: int) -> int:
    req = off.open(rid, prompt)
    blocks, computed = await admit(req)
    first_restored, tokens = computed, list(prompt)
    for i in range(n):
        new = pool.allocate(-(-len(tokens) // BLOCK) - len(blocks))  # room for every known token
        blocks += new
        sampled = forward(kv, blocks, computed, tokens[computed:])
        computed = len(tokens)  # the sampled token's KV is written by the next forward
        tokens.append(sampled)
        req.step(computed, new_token_ids=[sampled], new_block_ids=new)
        if i == preempt_at:  # the engine needs the blocks: give them back, keep the request
            await req.preempt()  # resolves once no copy reads the blocks any more
            pool.free(blocks)
            blocks, computed = await admit(req)  # resume: its own blocks come back from the CPU tier
            print(f"{rid}: preempted with {len(tokens)} tokens, {computed} restored on resume")
    await req.finish()  # every full block stored; only now may the blocks be reused
    pool.free(blocks)
    print(f"{rid}: {first_restored} of {len(prompt)} prompt tokens restored, generated {tokens[-n:]}")
    return first_restored


async def main() -> None:
    layout = aiokv.KVLayout(kv, block_size=BLOCK, model_id="fake-model")
    async with aiokv.Offloader(layout, tiers=[aiokv.CPUTier(capacity_bytes=16 << 20)]) as off:
        system = list(range(100, 140))  # a 40-token system prompt shared by both requests
        assert await generate(off, "req-1", [*system, 1, 2], n=8, preempt_at=3) == 0
        restored = await generate(off, "req-2", [*system, 3, 4, 5], n=4, preempt_at=-1)
        assert restored == 32  # the shared prompt's two full blocks
        # Check the restore bit for bit: load the prefix again and compare with a recompute of it.
        req = off.open("req-3", [*system, 6])
        blocks, n = await admit(req)
        recomputed = [torch.zeros_like(t) for t in kv]
        forward(recomputed, blocks, 0, system[:n])
        assert all(torch.equal(t[blocks], r[blocks]) for t, r in zip(kv, recomputed))
        await req.abort()
        pool.free(blocks)
        print(f"req-3: the KV of the {n} restored tokens equals a recompute, bit for bit")
        print(f"{off.stats().hit_tokens} tokens found in aiokv's CPU tier in all")


asyncio.run(main())
