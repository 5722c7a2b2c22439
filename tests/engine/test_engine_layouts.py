"""The reference engine on every cache layout (issue 20): alternating sliding-window/full layers, an MLA-like
latent cache, a recurrent state: offloading on vs off, bitwise, through restores, preemption and cancellation.

Each preset runs at the tiny size of conftest.TINY, on a pool small enough that requests are preempted, with
short windows (so prefixes span several windows) and frequent checkpoints (so shared prefixes hit)."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import pytest
import torch

import aiokv
from aiokv.engine import Engine, ModelConfig, PagedKVCache, Transformer

from ._workload import chat

STALL_S = 120.0
TINY = dict(
    num_layers=4,
    hidden_size=64,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    intermediate_size=128,
    vocab_size=256,
    max_position=4096,
    seed=11,
)
PRESETS: dict[str, dict[str, Any]] = {
    "gemma-like": {"sliding_window": 24},
    "gpt-oss-like": {"sliding_window": 20},
    "mla-like": {"kv_lora_rank": 32, "qk_rope_head_dim": 16},
    "hybrid-like": {},
}


@pytest.fixture(scope="module", params=sorted(PRESETS))
def model(request: pytest.FixtureRequest) -> Transformer:
    name = request.param
    return Transformer(ModelConfig.preset(name, **TINY, **PRESETS[name]))


def _offloader(cache: PagedKVCache) -> aiokv.Offloader:
    return aiokv.Offloader(
        cache.layout(checkpoint_blocks=4),
        tiers=[aiokv.CPUTier(capacity_bytes=32 << 20)],
        eviction="lru",
        load_policy="always",
    )


async def _chats(model: Transformer, num_blocks: int, offload: bool, **workload: Any) -> tuple[Any, ...]:
    cache = PagedKVCache(model.config, num_blocks)
    if not offload:
        async with Engine(model, cache, max_num_batched_tokens=64) as engine:
            out = await asyncio.wait_for(chat(engine, **workload), STALL_S)
            await engine.wait_idle()
            return out, engine.stats(), None
    async with (
        _offloader(cache) as off,
        Engine(model, cache, offloader=off, max_num_batched_tokens=64) as engine,
    ):
        out = await asyncio.wait_for(chat(engine, **workload), STALL_S)
        await engine.wait_idle()
        return out, engine.stats(), off.stats()


@pytest.mark.asyncio
@pytest.mark.parametrize(("seed", "num_blocks", "temperature"), [(0, 20, 0.0), (1, 24, 0.8)])
async def test_offload_matches_recompute_with_preemption(
    model: Transformer, seed: int, num_blocks: int, temperature: float
) -> None:
    """Concurrent 3-turn chats sharing a system prompt on a small pool: tokens and last logits bitwise equal
    with and without aiokv, prefixes restored (turns continue from the previous turn's final boundary), and
    requests preempted and resumed."""
    workload = dict(sessions=4, turns=3, seed=seed, temperature=temperature)
    cold, _cold_stats, _ = await _chats(model, num_blocks, offload=False, **workload)
    warm, warm_stats, off_stats = await _chats(model, num_blocks, offload=True, **workload)
    assert cold.keys() == warm.keys()
    for rid, c in cold.items():
        assert warm[rid].output_token_ids == c.output_token_ids, rid
        assert torch.equal(warm[rid].last_logits, c.last_logits), rid
    assert warm_stats.preemptions > 0
    assert warm_stats.cached_tokens > 0
    assert warm_stats.cached_tokens == off_stats.hit_tokens
    if model.config.group_kinds != ("latent",):
        assert off_stats.retention_bytes_saved > 0  # window or state parts left out where no hit needs them
    assert off_stats.load_errors == off_stats.store_errors == 0


@pytest.mark.asyncio
async def test_cancellations_leak_nothing_and_survivors_match(model: Transformer) -> None:
    """Streams left at seeded points (their requests aborted mid-decode), the others exact; every block and
    every aiokv request is freed, and a prompt served again restores from the cache."""
    rng = random.Random(3)
    system = [rng.randrange(256) for _ in range(50)]
    prompts = [system + [rng.randrange(256) for _ in range(rng.randint(5, 60))] for _ in range(8)]
    async with Engine(model, PagedKVCache(model.config, 24)) as ref:
        expected = [(await ref.generate(p, max_tokens=12)).output_token_ids for p in prompts]
    cache = PagedKVCache(model.config, 24)
    async with (
        _offloader(cache) as off,
        Engine(model, cache, offloader=off, max_num_batched_tokens=32) as eng,
    ):
        victims = sorted(rng.sample(range(1, 8), 3))
        cuts = {i: rng.randint(0, 10) for i in victims}

        async def left_early(i: int) -> list[int]:
            got: list[int] = []
            async with eng.stream(prompts[i], max_tokens=12) as tokens:
                async for t in tokens:
                    got.append(t)
                    if len(got) > cuts[i]:
                        break  # leaving the stream aborts the request mid-decode
            return got

        plain = [
            asyncio.create_task(eng.generate(p, max_tokens=12))
            for i, p in enumerate(prompts)
            if i not in cuts
        ]
        early = await asyncio.gather(*(left_early(i) for i in victims))
        for i, got in zip(victims, early, strict=True):
            assert tuple(got) == expected[i][: len(got)], i
        survivors = [i for i in range(8) if i not in cuts]
        for i, t in zip(survivors, plain, strict=True):
            assert (await t).output_token_ids == expected[i], i
        again = await eng.generate(prompts[0], max_tokens=12)  # served from the cache
        assert again.output_token_ids == expected[0]
        assert again.cached_tokens > 0
        await eng.wait_idle()
        assert eng.stats().free_blocks == 24
        assert off.stats().requests_open == 0
        assert off.stats().in_flight == 0


def test_layout_groups_follow_the_model() -> None:
    cfg = ModelConfig.preset("gemma-like", **TINY, sliding_window=24)
    cache = PagedKVCache(cfg, 8)
    lay = cache.layout()
    assert lay.is_grouped
    assert [g.kind.value for g in lay.groups] == list(cfg.group_kinds)  # type: ignore[attr-defined]
    assert not PagedKVCache(ModelConfig(**TINY), 8).layout().is_grouped  # llama-like: the one-group layout
