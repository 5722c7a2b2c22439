"""The model and the paged cache: the paged forward against the dense reference, and batch invariance."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

import aiokv
from aiokv.engine import BlockAllocator, ModelConfig, PagedKVCache, SeqChunk, Transformer

from .conftest import TINY

DENSE_ATOL = 1e-4
"""Paged vs dense logits (|logits| ~ 5): different kernels and summation orders, fp32 rounding only."""


def _tokens(n: int, seed: int, vocab: int = TINY.vocab_size) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(vocab) for _ in range(n)]


def _prefill(
    model: Transformer,
    cache: PagedKVCache,
    tokens: list[int],
    chunk_sizes: list[int],
    table: list[int],
    rng: random.Random | None = None,
) -> torch.Tensor:
    """Run ``tokens`` through the paged forward in the given chunks; return all positions' logits. With
    ``rng``, each step also carries an unrelated request (different blocks) in the same batch."""
    out, pos = [], 0
    with torch.inference_mode():
        for n in chunk_sizes:
            chunks = [SeqChunk(tokens[pos : pos + n], pos, table)]
            if rng is not None and rng.random() < 0.5:
                other = _tokens(rng.randrange(1, 40), rng.randrange(1 << 30))
                chunks.insert(
                    rng.randrange(2), SeqChunk(other, 0, [cache.num_blocks - 3 + i for i in range(3)])
                )
            logits = model.forward(chunks, cache.tensors, all_logits=True)
            offset = 0
            for ch in chunks:
                if ch.block_table is table:
                    out.append(logits[offset : offset + n])
                offset += len(ch.token_ids)
            pos += n
    return torch.cat(out)


def _random_chunks(total: int, rng: random.Random) -> list[int]:
    sizes = []
    while total:
        n = min(total, rng.choice([1, 1, 2, 3, 7, 15, 16, 17, 31, 64, 100, 257]))
        sizes.append(n)
        total -= n
    return sizes


def test_paged_forward_matches_dense_reference(tiny_model: Transformer) -> None:
    tokens = _tokens(300, seed=1)
    cache = PagedKVCache(TINY, num_blocks=24)
    paged = _prefill(tiny_model, cache, tokens, [100, 77, 1, 122], list(range(19)))
    dense = tiny_model.forward_dense(tokens)
    assert paged.shape == dense.shape == (300, TINY.vocab_size)
    torch.testing.assert_close(paged, dense, atol=DENSE_ATOL, rtol=0)
    assert torch.equal(paged.argmax(-1), dense.argmax(-1))


def test_paged_forward_matches_dense_reference_on_default_shape() -> None:
    cfg = ModelConfig(num_layers=1, vocab_size=512, max_position=2048)
    model = Transformer(cfg)
    tokens = _tokens(600, seed=2, vocab=cfg.vocab_size)
    cache = PagedKVCache(cfg, num_blocks=40)
    paged = _prefill(model, cache, tokens, [512, 88], list(range(38)))
    torch.testing.assert_close(paged, model.forward_dense(tokens), atol=DENSE_ATOL, rtol=0)


@pytest.mark.parametrize("seed", range(4))
def test_paged_forward_is_bitwise_independent_of_chunking_batching_and_blocks(
    tiny_model: Transformer, seed: int
) -> None:
    """Any chunking of a sequence, any batch companions and any block placement give bitwise the same
    logits and the same KV bytes: what makes a restored block equal to a recomputed one."""
    rng = random.Random(seed)
    total = 600
    tokens = _tokens(total, seed=100 + seed)
    n_blocks = -(-total // 16)
    ref_cache = PagedKVCache(TINY, num_blocks=n_blocks + 3)
    ref = _prefill(tiny_model, ref_cache, tokens, [total], list(range(n_blocks)))
    ref_kv = ref_cache.read_positions(range(n_blocks), 0, total)
    cache = PagedKVCache(TINY, num_blocks=n_blocks + 3)
    table = list(range(n_blocks))
    rng.shuffle(table)
    got = _prefill(tiny_model, cache, tokens, _random_chunks(total, rng), table, rng)
    assert torch.equal(got, ref)
    for a, b in zip(cache.read_positions(table, 0, total), ref_kv, strict=True):
        assert torch.equal(a, b)


def test_forward_rejects_a_short_block_table(tiny_model: Transformer) -> None:
    cache = PagedKVCache(TINY, num_blocks=4)
    with pytest.raises(
        aiokv.InvalidArgumentError, match=r"block_table must cover 17 positions \(2 blocks\), got 1"
    ):
        tiny_model.forward([SeqChunk(_tokens(17, 0), 0, [0])], cache.tensors)


def test_weights_are_deterministic_per_seed() -> None:
    a, b = Transformer(TINY), Transformer(TINY)
    c = Transformer(dataclasses.replace(TINY, seed=8))
    tokens = _tokens(20, 3)
    assert torch.equal(a.forward_dense(tokens), b.forward_dense(tokens))
    assert not torch.equal(a.forward_dense(tokens), c.forward_dense(tokens))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_heads": 6, "num_kv_heads": 4}, "num_heads must be a multiple of num_kv_heads, got 6 and 4"),
        ({"hidden_size": 72}, "hidden_size must be a positive multiple of 16, got 72"),
        ({"num_layers": 0}, "num_layers must be > 0, got 0"),
        ({"head_dim": 7}, "head_dim must be even, got 7"),
    ],
)
def test_model_config_rejects_bad_shapes(kwargs: dict[str, int], message: str) -> None:
    with pytest.raises(aiokv.InvalidArgumentError, match=message):
        ModelConfig(**kwargs)


def test_cache_has_the_vllm_layout_and_an_aiokv_layout() -> None:
    cache = PagedKVCache(TINY, num_blocks=10, block_size=16)
    assert len(cache.tensors) == 2 * TINY.num_layers
    assert all(t.shape == (10, 16, TINY.num_kv_heads, TINY.head_dim) for t in cache.tensors)
    layout = cache.layout()
    assert layout.num_blocks == 10
    assert layout.slot_bytes == 16 * TINY.bytes_per_token
    with pytest.raises(
        aiokv.InvalidArgumentError, match="block_size must be a positive power of two, got 12"
    ):
        PagedKVCache(TINY, num_blocks=10, block_size=12)


def test_block_allocator_returns_none_when_full_and_catches_double_frees() -> None:
    alloc = BlockAllocator(4)
    got = alloc.allocate(3)
    assert got is not None
    assert sorted(got) == [0, 1, 2]
    assert alloc.allocate(2) is None
    assert alloc.num_free == 1
    alloc.free(got[:1])
    assert alloc.allocate(1) == got[:1]  # LIFO: the freed block is reused first
    with pytest.raises(AssertionError, match="freed twice"):
        alloc.free([3, 3])
