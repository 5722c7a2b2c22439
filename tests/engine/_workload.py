"""A seeded multi-turn chat workload shared by the engine tests."""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass, field

import torch

from aiokv.engine import BlockEvent, Engine, GenerationResult, PagedKVCache


@dataclass
class KVRecorder:
    """An ``on_blocks`` callback that keeps copies of the KV the engine blocks hold at each event."""

    cache: PagedKVCache
    loaded: list[tuple[str, tuple[int, ...], list[torch.Tensor]]] = field(default_factory=list)
    released: dict[str, tuple[tuple[int, ...], list[torch.Tensor]]] = field(default_factory=dict)

    def __call__(self, ev: BlockEvent) -> None:
        kv = self.cache.read_positions(ev.block_ids, 0, len(ev.token_ids))
        if ev.kind == "loaded":
            self.loaded.append((ev.request_id, ev.token_ids, kv))
        else:
            self.released[ev.request_id] = (ev.token_ids, kv)  # the last release holds the most positions


async def chat(
    engine: Engine,
    *,
    sessions: int,
    turns: int,
    seed: int,
    system_len: int = 40,
    user_len: tuple[int, int] = (5, 30),
    max_tokens: tuple[int, int] = (8, 40),
    temperature: float = 0.0,
    vocab: int = 256,
) -> dict[str, GenerationResult]:
    """``sessions`` concurrent conversations sharing a system prompt; each turn's prompt is the previous
    turn's prompt and answer plus a new user message. Deterministic per seed whatever the interleaving."""
    system = [random.Random(seed).randrange(vocab) for _ in range(system_len)]
    results: dict[str, GenerationResult] = {}

    async def session(i: int) -> None:
        rng = random.Random(seed * 1000 + i)
        ctx = list(system)
        for turn in range(turns):
            ctx += [rng.randrange(vocab) for _ in range(rng.randint(*user_len))]
            rid = f"s{i}-t{turn}"
            res = await engine.generate(
                ctx,
                max_tokens=rng.randint(*max_tokens),
                temperature=temperature,
                seed=seed * 7919 + i * 31 + turn,
                request_id=rid,
                return_logits=True,
            )
            results[rid] = res
            ctx += res.output_token_ids

    await asyncio.gather(*(session(i) for i in range(sessions)))
    return results
