"""The model's other cache layouts: sliding-window layers, the latent (MLA) cache and recurrent-state layers,
against the dense reference, bitwise chunking invariance, out-of-window blocks that are never read, state
snapshots restored at block boundaries, and config validation."""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

import pytest
import torch

import aiokv
from aiokv.engine import ModelConfig, SeqChunk, Transformer
from aiokv.engine._model import CTX_TILE

from .test_model import DENSE_ATOL, _random_chunks, _tokens

BLOCK = 16
TINY_SHAPE = dict(
    num_layers=2,
    hidden_size=64,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    intermediate_size=128,
    vocab_size=256,
    max_position=4096,
    seed=7,
)


def _tiny(name: str, **overrides: object) -> ModelConfig:
    return ModelConfig.preset(name, **{**TINY_SHAPE, **overrides})


# Windows: shorter than a block, not a multiple of a block, longer than a context tile.
TINY_PRESETS = {
    "gemma-like/w100": _tiny("gemma-like", sliding_window=100),
    "gpt-oss-like/w5": _tiny("gpt-oss-like", num_layers=3, sliding_window=5),
    "gpt-oss-like/w300": _tiny("gpt-oss-like", num_layers=3, sliding_window=300),
    "mla-like": _tiny("mla-like", kv_lora_rank=32),
    "hybrid-like": _tiny("hybrid-like", num_layers=3),
    # Three groups: full, sliding_window and state.
    "mixed/w50": _tiny(
        "llama-like",
        num_layers=3,
        layer_types=("linear_attention", "sliding_attention", "full_attention"),
        sliding_window=50,
    ),
}

_models: dict[str, Transformer] = {}


def _model(name: str) -> Transformer:
    if name not in _models:
        _models[name] = Transformer(TINY_PRESETS[name])
    return _models[name]


def _window_start(model: Transformer, start: int) -> int:
    w = model.config.sliding_window
    return 0 if w is None else max(0, start - w + 1)


def _sliding_tensors(model: Transformer) -> list[int]:
    return [i for g in model.cache_groups(1, BLOCK) if g.kind == "sliding_window" for i in g.tensor_indices]


def _run(
    model: Transformer,
    caches: Sequence[torch.Tensor],
    tokens: list[int],
    sizes: list[int],
    tables: Sequence[list[int]],
    *,
    rng: random.Random | None = None,
    poison: float | None = None,
    unheld: bool = False,
) -> torch.Tensor:
    """Run ``tokens`` through the paged forward in chunks of ``sizes`` with one block table per cache group;
    return every position's logits. With ``rng`` a step may carry an unrelated request too. With ``poison``
    every sliding-window cache position before a chunk's window is overwritten with that value first; with
    ``unheld`` the sliding group's table says -1 for the blocks wholly before the window."""
    kinds = model.config.group_kinds
    sliding = _sliding_tensors(model)
    spare = caches[0].shape[0] - 3
    out, pos = [], 0
    with torch.inference_mode():
        for n in sizes:
            lo = _window_start(model, pos)
            if poison is not None and lo:
                for i in sliding:
                    flat = caches[i].view(-1, *caches[i].shape[2:])
                    table = tables[kinds.index("sliding_window")]
                    p = torch.arange(lo)
                    flat[torch.tensor(table)[p // BLOCK] * BLOCK + p % BLOCK] = poison
            chunk_tables = [list(t) for t in tables]
            if unheld and "sliding_window" in kinds:
                g = kinds.index("sliding_window")
                chunk_tables[g][: lo // BLOCK] = [aiokv.NO_BLOCK] * (lo // BLOCK)
            target = SeqChunk(tokens[pos : pos + n], pos, tuple(chunk_tables))
            chunks = [target]
            if rng is not None and rng.random() < 0.5:
                other = _tokens(rng.randrange(1, 40), rng.randrange(1 << 30))
                chunks.insert(rng.randrange(2), SeqChunk(other, 0, [spare, spare + 1, spare + 2]))
            logits = model.forward(chunks, caches, all_logits=True)
            offset = 0
            for ch in chunks:
                if ch is target:
                    out.append(logits[offset : offset + n])
                    break
                offset += len(ch.token_ids)
            pos += n
    return torch.cat(out)


def _read(caches: Sequence[torch.Tensor], model: Transformer, tables: Sequence[list[int]], end: int) -> list:
    """Copies of every cache tensor's rows for positions [0, end), read through each group's table (a state
    group: the state held for every block)."""
    out = []
    for g, group in enumerate(model.cache_groups(1, BLOCK)):
        table = torch.tensor(tables[g])
        if group.kind == "state":
            out.extend(caches[i][table[: -(-end // BLOCK)]].clone() for i in group.tensor_indices)
            continue
        pos = torch.arange(end)
        slots = table[pos // BLOCK] * BLOCK + pos % BLOCK
        for i in group.tensor_indices:
            out.append(caches[i].view(-1, *caches[i].shape[2:])[slots].clone())
    return out


@pytest.mark.parametrize("name", list(TINY_PRESETS))
def test_paged_forward_matches_dense_reference(name: str) -> None:
    model = _model(name)
    tokens = _tokens(600, seed=11)
    n_blocks = -(-600 // BLOCK)
    caches = model.allocate_kv_caches(n_blocks + 3, BLOCK)
    tables = [list(range(n_blocks))] * len(model.config.group_kinds)
    paged = _run(model, caches, tokens, [300, 1, 17, 282], tables)
    dense = model.forward_dense(tokens)
    assert paged.shape == dense.shape == (600, TINY_SHAPE["vocab_size"])
    torch.testing.assert_close(paged, dense, atol=DENSE_ATOL, rtol=0)
    assert torch.equal(paged.argmax(-1), dense.argmax(-1))


@pytest.mark.parametrize(
    "cfg",
    [
        ModelConfig.preset("gemma-like", num_layers=2, vocab_size=512, max_position=2048, sliding_window=200),
        ModelConfig.preset("mla-like", num_layers=1, vocab_size=512, max_position=2048),
    ],
    ids=["gemma-like", "mla-like"],
)
def test_paged_forward_matches_dense_reference_on_default_shape(cfg: ModelConfig) -> None:
    model = Transformer(cfg)
    tokens = _tokens(600, seed=2, vocab=cfg.vocab_size)
    caches = model.allocate_kv_caches(40, BLOCK)
    paged = _run(model, caches, tokens, [512, 1, 87], [list(range(38))] * len(cfg.group_kinds))
    torch.testing.assert_close(paged, model.forward_dense(tokens), atol=DENSE_ATOL, rtol=0)


@pytest.mark.parametrize("seed", range(2))
@pytest.mark.parametrize("name", list(TINY_PRESETS))
def test_paged_forward_is_bitwise_independent_of_chunking_batching_and_blocks(name: str, seed: int) -> None:
    """Any chunking (decode steps included), batch companions, block placement and per-group tables give
    bitwise the same logits and cache bytes as one whole-prompt chunk, for every layout."""
    model = _model(name)
    rng = random.Random(seed)
    total = 600
    tokens = _tokens(total, seed=200 + seed)
    n_blocks = -(-total // BLOCK)
    n_groups = len(model.config.group_kinds)
    ref_tables = [list(range(n_blocks))] * n_groups
    ref_caches = model.allocate_kv_caches(n_blocks + 3, BLOCK)
    ref = _run(model, ref_caches, tokens, [total], ref_tables)
    tables = []
    for _ in range(n_groups):  # every group its own placement
        table = list(range(n_blocks))
        rng.shuffle(table)
        tables.append(table)
    caches = model.allocate_kv_caches(n_blocks + 3, BLOCK)
    got = _run(model, caches, tokens, _random_chunks(total, rng), tables, rng=rng)
    assert torch.equal(got, ref)
    for a, b in zip(
        _read(caches, model, tables, total), _read(ref_caches, model, ref_tables, total), strict=True
    ):
        assert torch.equal(a, b)


@pytest.mark.parametrize("mode", ["nan", "garbage", "unheld"])
@pytest.mark.parametrize("name", ["gemma-like/w100", "gpt-oss-like/w5", "gpt-oss-like/w300", "mixed/w50"])
def test_sliding_layers_never_read_positions_before_their_window(name: str, mode: str) -> None:
    """After a restore a sliding layer's blocks before the window may hold stale bytes, NaN, or be unheld
    (-1): poisoning every position before each chunk's window (the partial first block's head included),
    or not holding those blocks, changes no bit of the logits."""
    model = _model(name)
    total = 700
    tokens = _tokens(total, seed=5)
    n_blocks = -(-total // BLOCK)
    tables = [list(range(n_blocks))] * len(model.config.group_kinds)
    sizes = _random_chunks(total, random.Random(9))
    clean = _run(model, model.allocate_kv_caches(n_blocks, BLOCK), tokens, sizes, tables)
    caches = model.allocate_kv_caches(n_blocks, BLOCK)
    poison = {"nan": math.nan, "garbage": 3e38, "unheld": None}[mode]
    got = _run(model, caches, tokens, sizes, tables, poison=poison, unheld=mode == "unheld")
    assert torch.equal(got, clean)
    if poison is not None:  # the poison really was in the cache when the last chunks ran
        for i in _sliding_tensors(model):
            assert (torch.isnan(caches[i]) | (caches[i] == poison)).any()


def test_sliding_window_convention_is_p_minus_window_plus_one_to_p() -> None:
    """With one sliding layer, the last position's logits depend on the token ``window - 1`` back but not on
    the one ``window`` back (Hugging Face's / vLLM's convention), in the paged and the dense forward."""
    w = 20
    cfg = ModelConfig(
        **{**TINY_SHAPE, "num_layers": 1, "sliding_window": w, "layer_types": ("sliding_attention",)}
    )
    model = Transformer(cfg)
    tokens = _tokens(50, seed=3)
    p = len(tokens) - 1

    def last_logits(toks: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        caches = model.allocate_kv_caches(4, BLOCK)
        paged = _run(model, caches, toks, [len(toks)], [list(range(4))])[-1]
        return paged, model.forward_dense(toks)[-1]

    base = last_logits(tokens)
    outside = last_logits([*tokens[: p - w], (tokens[p - w] + 1) % 256, *tokens[p - w + 1 :]])
    inside = last_logits([*tokens[: p - w + 1], (tokens[p - w + 1] + 1) % 256, *tokens[p - w + 2 :]])
    assert torch.equal(outside[0], base[0])
    torch.testing.assert_close(outside[1], base[1], atol=1e-6, rtol=0)
    assert not torch.allclose(inside[0], base[0], atol=1e-3)
    assert not torch.allclose(inside[1], base[1], atol=1e-3)


def test_a_state_snapshot_restored_at_a_block_boundary_continues_bitwise() -> None:
    """A prefix hit on a hybrid model: the full layers' KV blocks and the state snapshot of the hit's last
    block are copied into other blocks of a fresh cache (what a restore does); continuing from the boundary
    there gives bitwise the logits of the uninterrupted run. Snapshots the table does not keep (-1) are
    skipped, and a continuation whose state block is not held is refused."""
    model = _model("hybrid-like")
    tokens = _tokens(300, seed=21)
    n_blocks, hit = -(-300 // BLOCK), 10  # a hit of 10 blocks: continue at position 160
    ref = _run(
        model,
        model.allocate_kv_caches(n_blocks, BLOCK),
        tokens,
        [1, 150, 70, 79],
        [list(range(n_blocks))] * 2,
    )

    first = model.allocate_kv_caches(n_blocks, BLOCK)
    # The first chunk ends in block 0, which must hold its live state; of the rest only the hit's is kept.
    kept = [b if b in (0, hit - 1) else aiokv.NO_BLOCK for b in range(hit)]
    _run(model, first, tokens[: hit * BLOCK], [7, 153], [list(range(hit)), kept])
    assert first[0][0].any()
    assert not first[0][1 : hit - 1].any()  # the unkept snapshots were never written
    snapshot = model.state_snapshot(first, hit - 1)
    assert len(snapshot) == 2
    assert snapshot[0].shape == (4, 16, 16)

    second = model.allocate_kv_caches(n_blocks + hit, BLOCK)
    full_table = [n_blocks + b for b in range(hit)] + list(range(hit, n_blocks))
    for i in model.cache_groups(1, BLOCK)[0].tensor_indices:  # the full group's KV of the hit
        second[i][n_blocks : n_blocks + hit] = first[i][:hit]
    state_table = [aiokv.NO_BLOCK] * (hit - 1) + [n_blocks + 3, *range(hit, n_blocks)]
    model.restore_state(second, n_blocks + 3, snapshot)
    start = hit * BLOCK
    with torch.inference_mode():
        got = model.forward(
            [SeqChunk(tokens[start:], start, (full_table, state_table))], second, all_logits=True
        )
        assert torch.equal(got, ref[start:])
        unheld = [aiokv.NO_BLOCK] * hit + state_table[hit:]
        with pytest.raises(
            aiokv.InvalidArgumentError,
            match=r"block_table must hold the state block 9 \(the state at position 160\)",
        ):
            model.forward([SeqChunk(tokens[start:], start, (full_table, unheld))], second)
    with pytest.raises(
        aiokv.InvalidArgumentError, match=r"snapshot must hold 2 states \(one per state layer\), got 1"
    ):
        model.restore_state(second, 0, snapshot[:1])


def test_presets_describe_their_caches() -> None:
    assert ModelConfig.preset("llama-like") == ModelConfig()
    gemma = ModelConfig.preset("gemma-like")
    assert gemma.layer_types == ("sliding_attention",) * 3 + ("full_attention",)
    assert gemma.layer_kinds == ("sliding_window",) * 3 + ("full",)
    assert ModelConfig.preset("gemma-like", num_layers=8).layer_kinds == (
        *("sliding_window",) * 3,
        "full",
        *("sliding_window",) * 3,
        "full",
    )
    assert ModelConfig.preset("gpt-oss-like").layer_kinds == ("sliding_window", "full") * 2
    (full, sliding) = gemma.cache_groups(10, 16)
    assert (full.kind, full.window, full.layers, full.tensor_indices) == ("full", None, (3,), (6, 7))
    assert (sliding.kind, sliding.window, sliding.layers) == ("sliding_window", 128, (0, 1, 2))
    assert sliding.tensor_indices == (0, 1, 2, 3, 4, 5)
    assert full.shape == sliding.shape == (10, 16, 2, 32)
    assert full.bytes_per_token == 2 * 2 * 32 * 4
    assert sliding.bytes_per_token == 3 * full.bytes_per_token
    assert gemma.bytes_per_token == ModelConfig().bytes_per_token == 2048
    mla = ModelConfig.preset("mla-like")
    (latent,) = mla.cache_groups(10, 16)
    assert (latent.kind, latent.window, latent.layers) == ("latent", None, (0, 1, 2, 3))
    assert latent.shape == (10, 16, 64 + 16)
    assert mla.bytes_per_token == latent.bytes_per_token == 4 * 80 * 4
    layers = mla.layer_caches(10, 16)
    assert [(lc.layer, lc.kind, lc.shapes) for lc in layers] == [
        (i, "latent", ((10, 16, 80),)) for i in range(4)
    ]
    assert [lc.shapes for lc in gemma.layer_caches(3, 8)] == [((3, 8, 2, 32),) * 2] * 4
    assert [g.shape[0] for g in gemma.cache_groups([10, 4], 16)] == [10, 4]
    hybrid = ModelConfig.preset("hybrid-like")
    assert hybrid.layer_kinds == ("state", "state", "state", "full")
    full, state = hybrid.cache_groups(10, 16)
    assert (state.kind, state.layers, state.tensor_indices, state.shape) == (
        "state",
        (0, 1, 2),
        (0, 1, 2),
        (10, 8, 32, 32),
    )
    assert (state.bytes_per_block, state.bytes_per_token) == (3 * 8 * 32 * 32 * 4, 0)
    assert (full.layers, full.tensor_indices, full.bytes_per_block) == ((3,), (3, 4), 16 * 2 * 2 * 32 * 4)
    assert hybrid.bytes_per_token == full.bytes_per_token == 512


def test_allocate_kv_caches_gives_forwards_order_and_per_group_counts() -> None:
    model = _model("gpt-oss-like/w5")
    caches = model.allocate_kv_caches([6, 4], BLOCK)  # full group, sliding group
    assert [t.shape[0] for t in caches] == [4, 4, 6, 6, 4, 4]
    assert all(t.dtype == torch.float32 and not t.any() for t in caches)
    latent = _model("mla-like").allocate_kv_caches(5, 8)
    assert [t.shape for t in latent] == [(5, 8, 48)] * 2
    with pytest.raises(
        aiokv.InvalidArgumentError, match="block_size must be a positive power of two, got 12"
    ):
        model.allocate_kv_caches(4, 12)
    with pytest.raises(aiokv.InvalidArgumentError, match="num_blocks must be > 0, got 0"):
        model.allocate_kv_caches([4, 0], BLOCK)
    with pytest.raises(
        aiokv.InvalidArgumentError, match=r"num_blocks must be one count or 2 \(one per cache"
    ):
        model.allocate_kv_caches([4, 4, 4], BLOCK)


def test_forward_rejects_bad_tables_and_caches() -> None:
    model = _model("gemma-like/w100")
    caches = model.allocate_kv_caches(20, BLOCK)
    toks = _tokens(1, 0)
    table = list(range(20))
    with pytest.raises(
        aiokv.InvalidArgumentError, match=r"block_table must hold one table per cache group \(2\)"
    ):
        model.forward([SeqChunk(toks, 0, (table,))], caches)
    with pytest.raises(aiokv.InvalidArgumentError, match="kv_caches must hold 4 tensors, got 3"):
        model.forward([SeqChunk(toks, 0, table)], caches[:3])
    # Position 200 with window 100 sees 101..200: blocks 6..12 must be held, block 5 need not be.
    sliding = [-1] * 6 + table[6:]
    model.forward([SeqChunk(toks, 200, (table, sliding))], caches)
    with pytest.raises(
        aiokv.InvalidArgumentError,
        match=r"block_table must hold the blocks 6\.\.12 of a sliding_window group \(positions 101\.\.200\)",
    ):
        model.forward([SeqChunk(toks, 200, (table, [-1] * 7 + table[7:]))], caches)
    with pytest.raises(
        aiokv.InvalidArgumentError, match="block_table must hold a block for each of the 13 blocks"
    ):
        model.forward([SeqChunk(toks, 200, (sliding, sliding))], caches)


def test_a_sliding_context_starts_on_a_tile_boundary() -> None:
    """The plan behind the bitwise invariance: the gathered context of a sliding layer begins at the window
    start rounded down to CTX_TILE, and covers exactly the window's slots."""
    model = _model("gemma-like/w100")
    group = model._groups[1]
    assert group.kind == "sliding_window"
    _, plan = model._plan(SeqChunk([1, 2, 3], 400, list(range(40))), list(range(40)), group, BLOCK)
    assert plan.offset == 301 - CTX_TILE
    assert plan.table.tolist() == list(range(301, 403))
    assert plan.padded == CTX_TILE


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"layer_types": ("full_attention", "local") * 2},
            "layer_types entries must be one of full_attention, sliding_attention, linear_attention,"
            " got 'local'",
        ),
        ({"layer_types": ("full_attention",)}, "layer_types must have num_layers=4 entries, got 1"),
        ({"layer_types": "full_attention"}, "layer_types must be a sequence of strings"),
        (
            {"layer_types": ("sliding_attention",) * 4},
            "sliding_window must be set when layer_types has sliding_attention layers",
        ),
        (
            {"layer_types": ("sliding_attention",) * 4, "sliding_window": 0},
            "sliding_window must be > 0, got 0",
        ),
        ({"sliding_window": -3}, "sliding_window must be > 0, got -3"),
        ({"attention": "mqa"}, "attention must be 'gqa' or 'latent', got 'mqa'"),
        (
            {"layer_types": ("linear_attention",) * 4},
            "layer_types must have at least one full or sliding attention layer",
        ),
        ({"kv_lora_rank": 64}, "kv_lora_rank is only used with attention='latent'"),
        ({"attention": "latent", "qk_rope_head_dim": 16}, "kv_lora_rank must be set with attention='latent'"),
        (
            {"attention": "latent", "kv_lora_rank": 40, "qk_rope_head_dim": 16},
            "kv_lora_rank must be a positive multiple of 16, got 40",
        ),
        (
            {"attention": "latent", "kv_lora_rank": 0, "qk_rope_head_dim": 16},
            "kv_lora_rank must be a positive multiple of 16, got 0",
        ),
        (
            {"attention": "latent", "kv_lora_rank": 64, "qk_rope_head_dim": 8},
            "qk_rope_head_dim must be a positive multiple of 16, got 8",
        ),
        (
            {"attention": "latent", "kv_lora_rank": 64},
            "qk_rope_head_dim must be set with attention='latent'",
        ),
        (
            {
                "attention": "latent",
                "kv_lora_rank": 64,
                "qk_rope_head_dim": 16,
                "layer_types": ("sliding_attention",) * 4,
                "sliding_window": 8,
            },
            "layer_types must be all full_attention with attention='latent'",
        ),
    ],
)
def test_model_config_rejects_bad_layouts(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(aiokv.InvalidArgumentError, match=message):
        ModelConfig(**kwargs)  # type: ignore[arg-type]


def test_preset_rejects_an_unknown_name_and_layer_types_become_a_tuple() -> None:
    with pytest.raises(
        aiokv.InvalidArgumentError, match="preset must be one of llama-like, gemma-like, gpt-oss"
    ):
        ModelConfig.preset("gemma")
    types = ["full_attention", "sliding_attention"]
    cfg = ModelConfig(num_layers=2, layer_types=types, sliding_window=4)  # type: ignore[arg-type]
    assert cfg.layer_types == ("full_attention", "sliding_attention")
    assert hash(cfg) == hash(ModelConfig(num_layers=2, layer_types=cfg.layer_types, sliding_window=4))
