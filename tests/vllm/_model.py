"""Random-weight Llama checkpoints for the vLLM tests: made offline with transformers, loaded by vLLM with
``skip_tokenizer_init=True`` (no tokenizer files are written: vLLM never asks for one then).

``make_tiny_llama`` is the test model (about 3.9 M parameters, 16 MB in fp32); ``make_bench_llama`` is large enough that a 2k-token
prefill costs real time on a CPU, for benchmarks of what a KV hit saves.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# The benchmark preset: hidden 1024, 8 layers, GQA 16/4 heads, about 0.10 G parameters (0.42 GB in fp32). On two
# cores vLLM prefills a 2k-token prompt at ~200 tokens/s (~10 s), and a prefix hit on it takes ~0.2 s.
BENCH_PRESET: dict[str, Any] = {
    "hidden_size": 1024,
    "num_layers": 8,
    "vocab_size": 8192,
    "num_heads": 16,
    "num_kv_heads": 4,
    "max_position": 8192,
}


def make_tiny_llama(
    path: str | Path,
    *,
    hidden_size: int = 256,
    num_layers: int = 4,
    vocab_size: int = 2048,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    max_position: int = 4096,
    seed: int = 0,
    dtype: str = "float32",
    init_std: float = 0.05,
) -> Path:
    """Write a seeded random-weight ``LlamaForCausalLM`` to ``path`` (created if missing) and return it.

    Weights use transformers' init (normal with std ``init_std``, its ``initializer_range``). At HF's default 0.02
    greedy outputs already depend on early tokens, but the top-1/top-2 logit margin is ~0.05; at 0.05 it is ~0.35
    (median over random prompts), so float noise between attention paths (full prefill vs. cached prefix) cannot flip
    a greedy token, while changing one early prompt token still changes the output of 8 of 8 prompts.
    Same arguments, same bytes.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 4 * 2 // 3 // 32 * 32 or 32,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        initializer_range=init_std,
        dtype=dtype,
    )
    # The init draws from the global RNG: seed it (and put it back after), so the weights are the same whatever the
    # caller drew before.
    state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    finally:
        torch.random.set_rng_state(state)
    model = model.to(getattr(torch, dtype)).eval()
    return _save(model, path)


def _save(model: Any, path: Path) -> Path:
    model.save_pretrained(path, safe_serialization=True)
    # Without a tokenizer vLLM uses no EOS id ("Using None for EOS token id"), but it also reads
    # generation_config.json for default stop tokens: drop the eos id there, so a random model that happens to emit
    # it never ends a generation early and every request runs to max_tokens.
    gen = path / "generation_config.json"
    if gen.exists():
        data = json.loads(gen.read_text())
        data.pop("eos_token_id", None)
        gen.write_text(json.dumps(data, indent=2) + "\n")
    return path


def make_tiny_gemma3(
    path: str | Path,
    *,
    hidden_size: int = 256,
    num_layers: int = 4,
    sliding_window: int = 64,
    vocab_size: int = 2048,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 64,
    max_position: int = 4096,
    seed: int = 0,
    dtype: str = "float32",
    init_std: float = 0.05,
) -> Path:
    """Write a seeded random-weight Gemma 3 text model (``Gemma3ForCausalLM``) to ``path`` and return it: layers
    alternate sliding-window attention (``sliding_window`` tokens) and full attention, starting with a sliding one,
    so vLLM's hybrid KV-cache manager makes two KV-cache groups of ``num_layers // 2`` layers each.

    The output embedding is not tied to the input one: tied (Gemma's default), a random model's greedy output repeats
    the last prompt token. Untied at ``init_std`` 0.05, changing one early prompt token changes the greedy output of
    8 of 8 200-token prompts (top-1/top-2 margin ~0.16, median). Same arguments, same bytes."""
    import torch
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = Gemma3TextConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 4 * 2 // 3 // 32 * 32 or 32,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        query_pre_attn_scalar=head_dim,
        max_position_embeddings=max_position,
        sliding_window=sliding_window,
        layer_types=[("sliding_attention", "full_attention")[i % 2] for i in range(num_layers)],
        bos_token_id=2,
        eos_token_id=1,
        pad_token_id=0,
        initializer_range=init_std,
        tie_word_embeddings=False,
        dtype=dtype,
    )
    state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        model = Gemma3ForCausalLM(config)
    finally:
        torch.random.set_rng_state(state)
    model = model.to(getattr(torch, dtype)).eval()
    return _save(model, path)


def make_bench_llama(path: str | Path, *, seed: int = 0, dtype: str = "float32", **overrides: Any) -> Path:
    """The benchmark preset (``BENCH_PRESET``, with ``overrides``) written by ``make_tiny_llama``."""
    return make_tiny_llama(path, seed=seed, dtype=dtype, **{**BENCH_PRESET, **overrides})
