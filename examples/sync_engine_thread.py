"""A synchronous engine loop in its own thread, offloading through aiokv's thread bridge.

Many engines schedule in a plain thread (a ``while True: schedule(); forward(); ...`` loop) while an asyncio
loop runs elsewhere. ``ThreadBridge`` hands each aiokv call over to the offloader's loop and answers with a
``concurrent.futures.Future``: the engine waits (``.result()``) where it must — a lookup before admitting, a
load before the forward reads the blocks, ``finish()`` before the blocks go back to the pool — and fires
``step()`` without waiting.

Here the engine thread serves a few chat turns that share a system prompt with the reference model, greedy,
one request at a time, once with aiokv and once recomputing everything, and checks the tokens agree.

    python examples/sync_engine_thread.py
"""

from __future__ import annotations

import asyncio
import sys

import torch

import aiokv
from aiokv.bridge import ThreadBridge
from aiokv.engine import BlockAllocator, ModelConfig, PagedKVCache, SeqChunk, Transformer

CONFIG = ModelConfig(num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16,
                     intermediate_size=128, vocab_size=512, max_position=4096)  # fmt: skip
MAX_TOKENS = 8


def engine_loop(
    model: Transformer, cache: PagedKVCache, bridge: ThreadBridge | None, prompts: list[list[int]]
) -> list[tuple[list[int], int]]:
    """The engine: runs in a worker thread, never touches asyncio. Returns (tokens, restored) per prompt."""
    bs = cache.block_size
    pool = BlockAllocator(cache.num_blocks)
    out = []
    for i, prompt in enumerate(prompts):
        blocks = pool.allocate(-(-(len(prompt) + MAX_TOKENS) // bs))
        assert blocks is not None
        hit = 0
        req = bridge.open(f"req-{i}", prompt).result() if bridge else None
        if req is not None:
            hit = req.lookup().result()  # tokens of the prompt aiokv holds (whole blocks)
            if hit:
                req.load(blocks[: hit // bs]).result()  # the KV is in our blocks once this returns
        tokens = list(prompt)
        start, new = hit, prompt[hit:]
        reported = hit // bs  # the loaded blocks are in aiokv's block table already
        with torch.inference_mode():
            for _ in range(MAX_TOKENS):
                logits = model.forward([SeqChunk(new, start, blocks)], cache.tensors)
                token = int(torch.argmax(logits[0]))
                start += len(new)
                tokens.append(token)
                if req is not None:  # fire and forget: later calls run after it, in order
                    req.step(start, new_token_ids=[token], new_block_ids=blocks[reported:])
                    reported = len(blocks)
                new = [token]
        if req is not None:
            req.finish().result()  # every copy of these blocks has ended: now they may be reused
        pool.free(blocks)
        out.append((tokens[len(prompt) :], hit))
    return out


async def run(offload: bool, prompts: list[list[int]]) -> list[tuple[list[int], int]]:
    model = Transformer(CONFIG)
    cache = PagedKVCache(CONFIG, 64)
    if not offload:
        return await asyncio.to_thread(engine_loop, model, cache, None, prompts)
    async with aiokv.Offloader(cache.layout(), tiers=[aiokv.CPUTier(capacity_bytes=16 << 20)]) as off:
        bridge = ThreadBridge(off)  # the loop keeps running (and serving aiokv) while the engine thread works
        result = await asyncio.to_thread(engine_loop, model, cache, bridge, prompts)
        print(
            "offloader:",
            off.stats().blocks_stored,
            "blocks stored,",
            off.stats().hit_tokens,
            "tokens restored",
        )
        return result


def main() -> int:
    system = [(7 * i) % 256 for i in range(100)]  # a shared "system prompt"
    prompts = [system + [200 + turn] * (5 + turn) for turn in range(4)]
    cached = asyncio.run(run(True, prompts))
    recomputed = asyncio.run(run(False, prompts))
    for (a, hit), (b, _) in zip(cached, recomputed, strict=True):
        print(f"restored {hit:3d} prompt tokens, generated {a}")
        if a != b:
            print("tokens differ from the recompute run", file=sys.stderr)
            return 1
    assert all(hit > 0 for _, hit in cached[1:]), "later turns should reuse the system prompt"
    print("outputs matched the recompute run")
    return 0


if __name__ == "__main__":
    sys.exit(main())
