"""A small decoder-only transformer with a paged KV cache, written for bitwise reproducibility.

The model is a Llama-shaped stack (RMSNorm, RoPE, grouped-query attention, SwiGLU MLP) with deterministic
seeded weights, so nothing is downloaded. It has two forwards that share the weights:

* :meth:`Transformer.forward` — the engine's forward: a batch of per-request chunks, each writing its new
  keys/values into the paged cache through the request's block table and attending over the whole context
  gathered back from it.
* :meth:`Transformer.forward_dense` — a plain non-paged reference (one sequence, full causal attention), used
  by the tests to check the paged forward.

**Cache layouts.** Besides full attention in every layer (the default), a config can mix in
sliding-window layers (``layer_types``, as Gemma 3 and gpt-oss do) or recurrent linear-attention layers
(Qwen3-Next style, a fixed-size state per request snapshotted at block boundaries), or use a DeepSeek-style
latent cache (``attention="latent"``: one ``kv_lora_rank + qk_rope_head_dim`` row per token and layer, keys
and values up-projected from it). :meth:`ModelConfig.cache_groups` says what the cache tensors look like;
layers of one kind form one group, and a chunk may give one block table per group. :meth:`ModelConfig.preset`
names a few such configs.

**Batch invariance.** A restored KV block must be bitwise equal to what a recompute would produce, and the
engine computes the same position in very different batch shapes (a 512-token prefill chunk, a decode step
batched with other requests, a 3-token tail after a cache hit). On CPU a matmul's result for one row depends
on how many rows the call has (small-row calls take other kernels), and vectorised elementwise kernels fall
back to scalar code for a tail. The paged forward therefore computes every position in a shape-independent
way: every matmul gets its row count padded to a multiple of :data:`ROW_TILE`, the attention context is
padded with masked, zeroed keys to a multiple of :data:`CTX_TILE` (a sliding window's context starts at a
multiple of it too, so every position keeps its place in its tile), RoPE reads a precomputed table, and
RMSNorm's reduction is a matmul. ``tests/engine/test_model.py`` checks that any chunking of a sequence yields
bitwise the same keys, values and logits. On CUDA the same code runs, but cuBLAS makes no such promise, so
there the guarantee is a tolerance, not bits.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Generator, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, cast

import torch
import torch.nn.functional as F

from aiokv import InvalidArgumentError

__all__ = [
    "CTX_TILE",
    "LAYER_TYPES",
    "ROW_TILE",
    "CacheGroup",
    "LayerCache",
    "ModelConfig",
    "SeqChunk",
    "Transformer",
]

ROW_TILE = 16
"""Matmul row counts are padded to a multiple of this (MKL picks other kernels below ~12 rows)."""

CTX_TILE = 256
"""Attention contexts are padded to a multiple of this many (masked, zero) positions, and the probability-value
product runs tile by tile: MKL blocks a matmul's inner dimension differently for different lengths, so a
fixed inner length followed by in-order accumulation is what keeps every position's sum order fixed."""

LAYER_TYPES = ("full_attention", "sliding_attention", "linear_attention")
"""The entries ``ModelConfig.layer_types`` may hold (Hugging Face's names for them: Gemma 3, gpt-oss and
Qwen3-Next use these)."""

_ATTENTIONS = ("gqa", "latent")
_GROUP_ORDER = ("full", "sliding_window", "latent", "state")  # cache groups come in this order
_KIND_OF_TYPE = {"full_attention": "full", "sliding_attention": "sliding_window", "linear_attention": "state"}

# Named configs, sized like the default (4 layers, hidden 256). A layer pattern is a function of num_layers so
# that ``preset(name, num_layers=n)`` stays valid.
_PRESETS: dict[str, dict[str, Any]] = {
    "llama-like": {},
    # Gemma 3 has 5 local layers per global one; 4 layers scale that to 3:1, with the last layer global.
    "gemma-like": {
        "sliding_window": 128,
        "layer_types": lambda n: _pattern(n, lambda i: i % 4 == 3 or i == n - 1),
    },
    # gpt-oss alternates, even layers sliding (window 128).
    "gpt-oss-like": {"sliding_window": 128, "layer_types": lambda n: _pattern(n, lambda i: i % 2 == 1)},
    # DeepSeek-V2/V3's MLA: a latent of 2 x head_dim plus a 16-wide decoupled RoPE key, for every layer (80
    # values per token where the default's K+V take 128).
    "mla-like": {"attention": "latent", "kv_lora_rank": 64, "qk_rope_head_dim": 16},
    # Qwen3-Next's hybrid: 3 linear-attention (recurrent state) layers per full one, the last layer full.
    "hybrid-like": {
        "layer_types": lambda n: _pattern(n, lambda i: i % 4 == 3 or i == n - 1, other="linear_attention")
    },
}


def _pattern(n: int, is_full: Any, other: str = "sliding_attention") -> tuple[str, ...]:
    return tuple("full_attention" if is_full(i) else other for i in range(n))


@dataclass(frozen=True, slots=True)
class LayerCache:
    """What one layer keeps in the paged cache: its ``kind`` (``"full"``, ``"sliding_window"``, ``"latent"``
    or ``"state"``), its ``window`` in tokens (sliding layers only) and the shapes of its tensors, in the
    order they take in :meth:`Transformer.forward`'s ``kv_caches`` (keys then values; a latent or a state
    layer has one)."""

    layer: int
    kind: str
    window: int | None
    shapes: tuple[tuple[int, ...], ...]


@dataclass(frozen=True, slots=True)
class CacheGroup:
    """The layers of one cache kind, which share block tables (what an :class:`aiokv.KVGroup` describes).

    ``tensor_indices`` are the positions of the group's tensors in the flat ``kv_caches`` list, every one of
    shape ``shape``; ``bytes_per_block`` is what one block occupies across the group's layers, and
    ``bytes_per_token`` the same per token (0 for a state group, whose block is one fixed-size snapshot).
    """

    kind: str
    window: int | None
    layers: tuple[int, ...]
    tensor_indices: tuple[int, ...]
    shape: tuple[int, ...]
    bytes_per_block: int
    bytes_per_token: int


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Shape and seed of a :class:`Transformer`.

    ``hidden_size``, ``num_heads * head_dim``, ``num_kv_heads * head_dim`` and ``intermediate_size`` must be
    multiples of 16 so that no elementwise kernel runs a scalar tail (see the module docstring).

    ``layer_types`` (one entry of :data:`LAYER_TYPES` per layer; ``None``: all full) makes some layers
    sliding-window layers of ``sliding_window`` tokens: the token at position ``p`` attends to positions
    ``max(0, p - sliding_window + 1) .. p``. ``"linear_attention"`` layers are recurrent: a gated linear
    attention with a ``(num_heads, head_dim, head_dim)`` state per request and no KV, snapshotted at the
    attention layers' block boundaries (so a model needs at least one attention layer).
    ``attention="latent"`` replaces every layer's keys and values by a DeepSeek-style latent cache of
    ``kv_lora_rank + qk_rope_head_dim`` values per token (queries have ``head_dim`` non-rotated plus
    ``qk_rope_head_dim`` rotated dimensions per head; values ``head_dim``).
    """

    num_layers: int = 4
    hidden_size: int = 256
    num_heads: int = 8
    num_kv_heads: int = 2
    head_dim: int = 32
    intermediate_size: int = 768
    vocab_size: int = 1024
    max_position: int = 32768
    rope_theta: float = 10000.0
    rms_eps: float = 1e-5
    seed: int = 0
    dtype: torch.dtype = torch.float32
    layer_types: tuple[str, ...] | None = None
    sliding_window: int | None = None
    attention: str = "gqa"
    kv_lora_rank: int | None = None
    qk_rope_head_dim: int | None = None

    def __post_init__(self) -> None:
        for name in ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim", "vocab_size"):
            value = getattr(self, name)
            if value <= 0:
                raise InvalidArgumentError(f"{name} must be > 0, got {value}")
        if self.num_heads % self.num_kv_heads:
            raise InvalidArgumentError(
                f"num_heads must be a multiple of num_kv_heads, got {self.num_heads} and {self.num_kv_heads}"
            )
        if self.head_dim % 2:
            raise InvalidArgumentError(f"head_dim must be even, got {self.head_dim}")
        for name in ("hidden_size", "intermediate_size"):
            value = getattr(self, name)
            if value <= 0 or value % 16:
                raise InvalidArgumentError(f"{name} must be a positive multiple of 16, got {value}")
        if (self.num_kv_heads * self.head_dim) % 16:
            raise InvalidArgumentError(
                f"num_kv_heads * head_dim must be a multiple of 16, got {self.num_kv_heads * self.head_dim}"
            )
        self._check_layouts()

    def _check_layouts(self) -> None:
        if self.layer_types is not None:
            if isinstance(self.layer_types, str) or not isinstance(self.layer_types, Sequence):
                raise InvalidArgumentError(
                    f"layer_types must be a sequence of strings, got {self.layer_types!r}"
                )
            object.__setattr__(self, "layer_types", tuple(self.layer_types))  # a list would not hash
            if len(self.layer_types) != self.num_layers:
                raise InvalidArgumentError(
                    f"layer_types must have num_layers={self.num_layers} entries, got {len(self.layer_types)}"
                )
            for entry in self.layer_types:
                if entry not in LAYER_TYPES:
                    raise InvalidArgumentError(
                        f"layer_types entries must be one of {', '.join(LAYER_TYPES)}, got {entry!r}"
                    )
        sliding = self.layer_types is not None and "sliding_attention" in self.layer_types
        if self.layer_types is not None and set(self.layer_types) == {"linear_attention"}:
            raise InvalidArgumentError("layer_types must have at least one full or sliding attention layer")
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise InvalidArgumentError(f"sliding_window must be > 0, got {self.sliding_window}")
        if sliding and self.sliding_window is None:
            raise InvalidArgumentError(
                "sliding_window must be set when layer_types has sliding_attention layers"
            )
        if self.attention not in _ATTENTIONS:
            raise InvalidArgumentError(f"attention must be 'gqa' or 'latent', got {self.attention!r}")
        if self.attention == "gqa":
            for name in ("kv_lora_rank", "qk_rope_head_dim"):
                if getattr(self, name) is not None:
                    raise InvalidArgumentError(f"{name} is only used with attention='latent'")
            return
        if self.layer_types is not None and set(self.layer_types) != {"full_attention"}:
            raise InvalidArgumentError("layer_types must be all full_attention with attention='latent'")
        for name in ("kv_lora_rank", "qk_rope_head_dim"):
            value = getattr(self, name)
            if value is None:
                raise InvalidArgumentError(f"{name} must be set with attention='latent'")
            if value <= 0 or value % 16:
                raise InvalidArgumentError(f"{name} must be a positive multiple of 16, got {value}")

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> ModelConfig:
        """A named config: ``"llama-like"`` (the defaults: full attention everywhere), ``"gemma-like"`` (3
        sliding-window layers per full one, the last layer full, window 128), ``"gpt-oss-like"`` (sliding and
        full layers alternating, window 128), ``"mla-like"`` (a latent cache of 64 + 16 values per token
        and layer) or ``"hybrid-like"`` (3 linear-attention layers per full one, the last layer full).
        ``overrides`` replace fields; the layer pattern follows an overridden ``num_layers``."""
        if name not in _PRESETS:
            raise InvalidArgumentError(f"preset must be one of {', '.join(_PRESETS)}, got {name!r}")
        fields = dict(_PRESETS[name])
        default_layers = next(f.default for f in dataclasses.fields(cls) if f.name == "num_layers")
        num_layers = overrides.get("num_layers", default_layers)
        if callable(fields.get("layer_types")):
            fields["layer_types"] = fields["layer_types"](num_layers)
        fields.update(overrides)
        return cls(**fields)

    @property
    def layer_kinds(self) -> tuple[str, ...]:
        """Each layer's cache kind: ``"full"``, ``"sliding_window"``, ``"latent"`` or ``"state"``."""
        if self.attention == "latent":
            return ("latent",) * self.num_layers
        if self.layer_types is None:
            return ("full",) * self.num_layers
        return tuple(_KIND_OF_TYPE[t] for t in self.layer_types)

    @property
    def group_kinds(self) -> tuple[str, ...]:
        """The cache groups' kinds, in the order of :meth:`cache_groups` (and of per-group block tables)."""
        kinds = set(self.layer_kinds)
        return tuple(k for k in _GROUP_ORDER if k in kinds)

    def _latent_dims(self) -> tuple[int, int]:
        """``(kv_lora_rank, qk_rope_head_dim)`` of a latent config."""
        r, dr = self.kv_lora_rank, self.qk_rope_head_dim
        assert r is not None, "not a latent config"
        assert dr is not None, "not a latent config"
        return r, dr

    def _layer_row(self, kind: str) -> tuple[int, tuple[int, ...]]:
        """(tensors per layer, shape of each per token, or per block for a state) for a layer kind."""
        if kind == "latent":
            return 1, (sum(self._latent_dims()),)
        if kind == "state":
            return 1, (self.num_heads, self.head_dim, self.head_dim)
        return 2, (self.num_kv_heads, self.head_dim)

    def _cache_shape(self, kind: str, num_blocks: int, block_size: int) -> tuple[int, ...]:
        row = self._layer_row(kind)[1]
        return (num_blocks, *row) if kind == "state" else (num_blocks, block_size, *row)

    def layer_caches(self, num_blocks: int, block_size: int) -> tuple[LayerCache, ...]:
        """Per layer, its kind, window and cache tensor shapes for ``num_blocks`` blocks of ``block_size``
        (a state layer's tensor holds one state snapshot per block: ``(num_blocks, heads, head_dim,
        head_dim)``)."""
        out = []
        for i, kind in enumerate(self.layer_kinds):
            count = self._layer_row(kind)[0]
            window = self.sliding_window if kind == "sliding_window" else None
            out.append(
                LayerCache(i, kind, window, (self._cache_shape(kind, num_blocks, block_size),) * count)
            )
        return tuple(out)

    def cache_groups(self, num_blocks: int | Sequence[int], block_size: int) -> tuple[CacheGroup, ...]:
        """The cache grouped by kind (in :attr:`group_kinds` order); ``num_blocks`` is one count for every
        group or one per group."""
        kinds = self.group_kinds
        counts = [num_blocks] * len(kinds) if isinstance(num_blocks, int) else list(num_blocks)
        if len(counts) != len(kinds):
            raise InvalidArgumentError(
                f"num_blocks must be one count or {len(kinds)} (one per cache group), got {len(counts)}"
            )
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        members: dict[str, tuple[list[int], list[int]]] = {k: ([], []) for k in kinds}
        index = 0
        for i, kind in enumerate(self.layer_kinds):
            count = self._layer_row(kind)[0]
            members[kind][0].append(i)
            members[kind][1].extend(range(index, index + count))
            index += count
        groups = []
        for kind, blocks in zip(kinds, counts, strict=True):
            shape = self._cache_shape(kind, blocks, block_size)
            layers, tensors = members[kind]
            per_block = len(tensors) * math.prod(shape[1:]) * itemsize
            groups.append(
                CacheGroup(
                    kind=kind,
                    window=self.sliding_window if kind == "sliding_window" else None,
                    layers=tuple(layers),
                    tensor_indices=tuple(tensors),
                    shape=shape,
                    bytes_per_block=per_block,
                    bytes_per_token=0 if kind == "state" else per_block // block_size,
                )
            )
        return tuple(groups)

    @property
    def bytes_per_token(self) -> int:
        """KV-cache bytes one token occupies across all layers (keys and values, or latents).

        A sliding-window layer counts in full (its blocks out of the window need not be held); a state
        layer's snapshots are per block, not per token, and are not counted (see :meth:`cache_groups`).
        """
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        total = 0
        for kind in self.layer_kinds:
            count, row = self._layer_row(kind)
            total += 0 if kind == "state" else count * math.prod(row)
        return total * itemsize

    @property
    def num_parameters(self) -> int:
        h, q, kv = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        mlp = 3 * h * self.intermediate_size + 2 * h
        if self.attention == "latent":
            r, dr = self._latent_dims()
            per_layer = h * (self.num_heads * (self.head_dim + dr) + r + dr) + r + 2 * r * q + q * h + mlp
            return self.num_layers * per_layer + 2 * self.vocab_size * h + h
        total = 0
        for kind in self.layer_kinds:
            total += h * (3 * q if kind == "state" else q + 2 * kv) + q * h + mlp
        return total + 2 * self.vocab_size * h + h


@dataclass(frozen=True, slots=True)
class SeqChunk:
    """One request's share of a forward: compute ``token_ids`` at positions ``start, start + 1, ...``.

    Positions ``[0, start)`` must already hold their keys/values in the blocks of ``block_table``, which must
    cover every position up to ``start + len(token_ids)``. ``block_table`` is one table for every layer, or
    one per cache group (a sequence of tables, in :meth:`ModelConfig.cache_groups` order, aiokv's per-group
    convention). A sliding-window group's table may hold ``-1`` (no block) for blocks wholly before the
    chunk's window, ``max(0, start - sliding_window + 1)``: those are never read.

    A state group's block ``j`` holds the recurrent state after the last position of token block ``j``
    computed so far (token blocks are the first group's): at a block boundary, that boundary's snapshot. The
    chunk reads its state from the block of position ``start - 1`` (the zero state at 0), writes the snapshot
    of every block it completes (``-1``: not kept) and the state after its last token.
    """

    token_ids: Sequence[int]
    start: int
    block_table: Sequence[int] | Sequence[Sequence[int]]

    @property
    def end(self) -> int:
        return self.start + len(self.token_ids)


class _AttentionPlan(NamedTuple):
    """What one chunk's attention needs in every layer of one cache group: computed once per forward."""

    n: int  # new tokens
    ctx: int  # context length after them
    padded: int  # gathered context length, a multiple of the context tile
    rows: int  # query rows per kv head (group * n)
    padded_rows: int  # rows padded to ROW_TILE
    table: (
        torch.Tensor
    )  # full: the block table cut to the blocks it covers; sliding: the window's cache slots
    mask: torch.Tensor  # (rows, padded): True where a query row must not see the position
    offset: int = 0  # sliding: where the window's first position lies in the gathered context


class _StatePlan(NamedTuple):
    """Where one chunk's state layers read their state and write snapshots: computed once per forward."""

    n: int  # new tokens
    read: int  # state block holding the state at the chunk's start (-1: the zero state at position 0)
    writes: dict[int, int]  # token index -> state block that receives the state after that token


class _Group(NamedTuple):
    kind: str
    window: int | None
    first_tensor: int  # index in kv_caches of the group's first tensor (gives its block size)
    group: int  # query rows per cached head


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` whose rows are bitwise independent of how many rows ``a`` has (see the module docstring)."""
    rows = a.shape[-2]
    padded = max(ROW_TILE, _round_up(rows, ROW_TILE))
    if padded == rows:
        return a @ b
    pad = a.new_zeros((*a.shape[:-2], padded - rows, a.shape[-1]))
    return (torch.cat([a, pad], dim=-2) @ b)[..., :rows, :]


def _weight(gen: torch.Generator, fan_in: int, fan_out: int) -> torch.Tensor:
    # Stored transposed (in, out) so the forward is ``x @ w``.
    return torch.randn(fan_in, fan_out, generator=gen, dtype=torch.float64) / math.sqrt(fan_in)


def _norm_weight(gen: torch.Generator, n: int) -> torch.Tensor:
    return 1.0 + 0.1 * torch.randn(n, generator=gen, dtype=torch.float64)


class _Layer:
    __slots__ = ("attn_norm", "down_t", "gate_t", "mlp_norm", "o_t", "qkv_t", "up_t")

    def __init__(self, cfg: ModelConfig, gen: torch.Generator) -> None:
        h, q, kv = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.attn_norm = _norm_weight(gen, h)
        self.qkv_t = _weight(gen, h, q + 2 * kv)
        self.o_t = _weight(gen, q, h)
        self._init_mlp(cfg, gen)

    def _init_mlp(self, cfg: ModelConfig, gen: torch.Generator) -> None:
        h, ffn = cfg.hidden_size, cfg.intermediate_size
        self.mlp_norm = _norm_weight(gen, h)
        self.gate_t = _weight(gen, h, ffn)
        self.up_t = _weight(gen, h, ffn)
        self.down_t = _weight(gen, ffn, h)

    def to(self, device: torch.device, dtype: torch.dtype) -> _Layer:
        for cls in type(self).__mro__:
            for name in getattr(cls, "__slots__", ()):
                setattr(self, name, getattr(self, name).to(device=device, dtype=dtype).contiguous())
        return self


class _LatentLayer(_Layer):
    """MLA weights: ``qkv_t`` projects to the queries (per head ``head_dim`` + ``qk_rope_head_dim``), the
    latent (``kv_lora_rank``) and the shared RoPE key (``qk_rope_head_dim``); ``uk_t`` / ``uv`` up-project the
    latent to each head's non-rotated key and its value."""

    __slots__ = ("kv_norm", "uk_t", "uv")

    def __init__(self, cfg: ModelConfig, gen: torch.Generator) -> None:
        h, heads, hd = cfg.hidden_size, cfg.num_heads, cfg.head_dim
        r, dr = cfg._latent_dims()
        self.attn_norm = _norm_weight(gen, h)
        self.qkv_t = _weight(gen, h, heads * (hd + dr) + r + dr)
        self.kv_norm = _norm_weight(gen, r)
        # (heads, head_dim, r): the absorbed query is q_nope @ uk_t; the key is latent @ uk_t[h].T.
        self.uk_t = _weight(gen, r, heads * hd).view(r, heads, hd).permute(1, 2, 0)
        self.uv = _weight(gen, r, heads * hd).view(r, heads, hd).permute(1, 0, 2)  # (heads, r, head_dim)
        self.o_t = _weight(gen, heads * hd, h)
        self._init_mlp(cfg, gen)


class _StateLayer(_Layer):
    """A gated linear-attention layer (RetNet-style, a fixed decay per head): per request a ``(heads,
    head_dim, head_dim)`` state ``S``; token ``t`` does ``S = decay * S + k_t v_t^T`` and outputs
    ``(1 - decay) * q_t S``. ``qkv_t`` projects to queries, keys and values of ``heads * head_dim`` each."""

    __slots__ = ("decay", "gain")

    def __init__(self, cfg: ModelConfig, gen: torch.Generator) -> None:
        h, q = cfg.hidden_size, cfg.num_heads * cfg.head_dim
        self.attn_norm = _norm_weight(gen, h)
        self.qkv_t = _weight(gen, h, 3 * q)
        self.o_t = _weight(gen, q, h)
        self._init_mlp(cfg, gen)
        decay = 1.0 - 2.0 ** (-5.0 - torch.arange(cfg.num_heads, dtype=torch.float64))
        self.decay = decay.view(-1, 1, 1)  # broadcasts over a state
        self.gain = (1.0 - decay).view(-1, 1)  # broadcasts over (heads, head_dim)


class Transformer:
    """A Llama-shaped decoder with seeded weights; see the module docstring for the two forwards."""

    def __init__(self, config: ModelConfig | None = None, *, device: torch.device | str = "cpu") -> None:
        self.config = cfg = config if config is not None else ModelConfig()
        self.device = torch.device(device)
        gen = torch.Generator().manual_seed(cfg.seed)
        dt = cfg.dtype
        self.embed = (torch.randn(cfg.vocab_size, cfg.hidden_size, generator=gen, dtype=torch.float64)).to(
            self.device, dt
        )
        classes = {"full": _Layer, "sliding_window": _Layer, "latent": _LatentLayer, "state": _StateLayer}
        self.layers = [classes[kind](cfg, gen).to(self.device, dt) for kind in cfg.layer_kinds]
        self.final_norm = torch.ones(cfg.hidden_size, dtype=dt, device=self.device)
        self.lm_head_t = (
            torch.randn(cfg.hidden_size, cfg.vocab_size, generator=gen, dtype=torch.float64)
            / math.sqrt(cfg.hidden_size)
        ).to(self.device, dt)
        # RoPE table, computed once in float64: positions index it, so no sin/cos runs per forward.
        self._rope_dim = cfg._latent_dims()[1] if cfg.attention == "latent" else cfg.head_dim
        inv_freq = 1.0 / (
            cfg.rope_theta ** (torch.arange(0, self._rope_dim, 2, dtype=torch.float64) / self._rope_dim)
        )
        angles = torch.outer(torch.arange(cfg.max_position, dtype=torch.float64), inv_freq)
        self._cos = angles.cos().to(self.device, dt)
        self._sin = angles.sin().to(self.device, dt)
        # Sum of squares as a matmul against ones: a row-independent reduction (see the module docstring).
        self._ones = torch.ones(
            max(cfg.hidden_size, cfg.kv_lora_rank or 0), ROW_TILE, dtype=dt, device=self.device
        )
        # Where each layer's tensors are in kv_caches, and its cache group.
        kinds = cfg.layer_kinds
        counts = [cfg._layer_row(k)[0] for k in kinds]
        self._first_tensor = [sum(counts[:i]) for i in range(cfg.num_layers)]
        self._num_tensors = sum(counts)
        self._layer_group = [cfg.group_kinds.index(k) for k in kinds]
        self._state_layers = [i for i, k in enumerate(kinds) if k == "state"]
        self._groups = [
            _Group(
                k,
                cfg.sliding_window if k == "sliding_window" else None,
                self._first_tensor[kinds.index(k)],
                cfg.num_heads if k == "latent" else cfg.num_heads // cfg.num_kv_heads,
            )
            for k in cfg.group_kinds
        ]

    def __repr__(self) -> str:
        c = self.config
        layout = "" if set(c.layer_kinds) == {"full"} else f" kinds={'/'.join(c.group_kinds)}"
        return (
            f"<Transformer layers={c.num_layers} hidden={c.hidden_size} heads={c.num_heads}/{c.num_kv_heads}"
            f" head_dim={c.head_dim} vocab={c.vocab_size} params={c.num_parameters / 1e6:.1f}M{layout}"
            f" device={self.device}>"
        )

    # -- the cache -----------------------------------------------------------------------------------------

    def cache_groups(self, num_blocks: int | Sequence[int], block_size: int) -> tuple[CacheGroup, ...]:
        """:meth:`ModelConfig.cache_groups` of this model's config."""
        return self.config.cache_groups(num_blocks, block_size)

    def allocate_kv_caches(
        self, num_blocks: int | Sequence[int], block_size: int, *, device: torch.device | str | None = None
    ) -> tuple[torch.Tensor, ...]:
        """Zeroed cache tensors in :meth:`forward`'s ``kv_caches`` order (per layer, keys then values, or its
        latent, or its states), on the model's device unless ``device`` is given; ``num_blocks`` may be one
        count per group."""
        if block_size <= 0 or block_size & (block_size - 1):
            raise InvalidArgumentError(f"block_size must be a positive power of two, got {block_size}")
        for count in [num_blocks] if isinstance(num_blocks, int) else num_blocks:
            if count <= 0:
                raise InvalidArgumentError(f"num_blocks must be > 0, got {count}")
        dev = self.device if device is None else torch.device(device)
        out: list[torch.Tensor | None] = [None] * self._num_tensors
        for group in self.cache_groups(num_blocks, block_size):
            for i in group.tensor_indices:
                out[i] = torch.zeros(group.shape, dtype=self.config.dtype, device=dev)
        return tuple(t for t in out if t is not None)

    # -- shared pieces -------------------------------------------------------------------------------------

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ss = _mm(x * x, self._ones[: x.shape[-1]])[:, :1]
        return x * torch.rsqrt(ss / x.shape[-1] + self.config.rms_eps) * weight

    def _rope_table(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per position ``[cos, cos]`` and ``[-sin, sin]`` over the rotated dimensions, shaped to broadcast
        over heads: one table for every layer of a forward."""
        cos, sin = self._cos[positions].unsqueeze(1), self._sin[positions].unsqueeze(1)
        return torch.cat([cos, cos], dim=-1), torch.cat([-sin, sin], dim=-1)

    @staticmethod
    def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # x: (tokens, heads, head_dim); rotate-half convention: [x1 cos - x2 sin, x2 cos + x1 sin], written as
        # x * [cos, cos] + [x2, x1] * [-sin, sin] (a - b is a + (-b) in IEEE arithmetic: the same bits).
        return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin

    def _qkv(
        self, layer: _Layer, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, ...]:
        c = self.config
        n = x.shape[0]
        qkv = _mm(self._rms_norm(x, layer.attn_norm), layer.qkv_t)
        q_dim, kv_dim = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        # Queries and keys rotate together: one set of elementwise ops for both (the same values per element).
        qk = self._rope(qkv[:, : q_dim + kv_dim].reshape(n, c.num_heads + c.num_kv_heads, c.head_dim), *rope)
        v = qkv[:, q_dim + kv_dim :].reshape(n, c.num_kv_heads, c.head_dim).contiguous()
        return qk[:, : c.num_heads], qk[:, c.num_heads :], v

    def _latent_qkv(
        self, layer: _LatentLayer, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(non-rotated queries ``(n, heads, head_dim)``, rotated queries ``(n, heads, dr)``, cache rows
        ``(n, kv_lora_rank + dr)``: the normalised latent then the rotated shared key)."""
        c = self.config
        (r, dr), n, heads, hd = c._latent_dims(), x.shape[0], c.num_heads, c.head_dim
        proj = _mm(self._rms_norm(x, layer.attn_norm), layer.qkv_t)
        q_dim = heads * (hd + dr)
        q = proj[:, :q_dim].reshape(n, heads, hd + dr)
        latent = self._rms_norm(proj[:, q_dim : q_dim + r], layer.kv_norm)
        # The queries' rotated parts and the shared key rotate together, as in _qkv.
        rot = self._rope(torch.cat([q[:, :, hd:], proj[:, None, q_dim + r :]], dim=1), *rope)
        return q[:, :, :hd], rot[:, :heads], torch.cat([latent, rot[:, heads]], dim=-1)

    def _mlp(self, layer: _Layer, x: torch.Tensor) -> torch.Tensor:
        h = self._rms_norm(x, layer.mlp_norm)
        return _mm(F.silu(_mm(h, layer.gate_t)) * _mm(h, layer.up_t), layer.down_t)

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        return _mm(self._rms_norm(x, self.final_norm), self.lm_head_t)

    # -- the paged forward ---------------------------------------------------------------------------------

    def forward(
        self,
        chunks: Sequence[SeqChunk],
        kv_caches: Sequence[torch.Tensor],
        *,
        all_logits: bool = False,
    ) -> torch.Tensor:
        """Run one engine step over ``chunks``; return each chunk's last-position logits ``(chunks, vocab)``.

        ``kv_caches`` is the flat list of every layer's cache tensors in layer order (as
        :meth:`allocate_kv_caches` makes them): ``[k0, v0, k1, v1, ...]`` of ``(num_blocks, block_size,
        kv_heads, head_dim)`` tensors, a latent layer contributing one ``(num_blocks, block_size,
        kv_lora_rank + qk_rope_head_dim)`` tensor instead and a state layer one ``(num_blocks, heads,
        head_dim, head_dim)`` tensor of states. Each chunk's keys/values are written into it through its block
        table(s). With ``all_logits`` the result is every position's logits, concatenated in chunk order.
        """
        stages = self.forward_layers(chunks, kv_caches, all_logits=all_logits)
        while True:
            try:
                next(stages)
            except StopIteration as done:
                return cast(torch.Tensor, done.value)

    def forward_layers(
        self,
        chunks: Sequence[SeqChunk],
        kv_caches: Sequence[torch.Tensor],
        *,
        all_logits: bool = False,
    ) -> Generator[int, None, torch.Tensor]:
        """:meth:`forward` in stages: a generator that yields ``i`` right before layer ``i`` touches its cache
        tensors and returns the logits (``StopIteration.value``). An engine restoring a prefix layer by layer
        advances it one stage at a time, ordering stage ``i`` after layer ``i``'s copy (on a device: enqueue
        each advance as a kernel, after ``LoadCompletion.order_layer_before(i)``)."""
        c = self.config
        if not chunks:
            raise InvalidArgumentError("chunks must not be empty")
        if len(kv_caches) != self._num_tensors:
            raise InvalidArgumentError(
                f"kv_caches must hold {self._num_tensors} tensors, got {len(kv_caches)}"
            )
        dev = self.device
        token_ids = torch.tensor([t for ch in chunks for t in ch.token_ids], dtype=torch.long, device=dev)
        positions = torch.cat([torch.arange(ch.start, ch.end, dtype=torch.long) for ch in chunks]).to(dev)
        if int(positions.max()) >= c.max_position:
            raise InvalidArgumentError(f"positions must be < max_position={c.max_position}")
        # Per cache group: the flat cache slot of every new token, and each chunk's attention plan (the same
        # for every layer of the group).
        tables = [self._group_tables(ch) for ch in chunks]
        group_slots: list[torch.Tensor] = []
        group_plans: list[list[_AttentionPlan]] = []
        state_plans: list[_StatePlan] = []
        for g, group in enumerate(self._groups):
            slots, plans = [], []
            if group.kind == "state":  # snapshots at the first group's block boundaries
                block_size = kv_caches[self._groups[0].first_tensor].shape[1]
                state_plans = [
                    self._state_plan(ch, t[g], block_size) for ch, t in zip(chunks, tables, strict=True)
                ]
                group_slots.append(torch.empty(0, dtype=torch.long, device=dev))
                group_plans.append([])
                continue
            block_size = kv_caches[group.first_tensor].shape[1]
            for ch, chunk_tables in zip(chunks, tables, strict=True):
                slot, plan = self._plan(ch, chunk_tables[g], group, block_size)
                slots.append(slot)
                plans.append(plan)
            group_slots.append(torch.cat(slots).to(dev))
            group_plans.append(plans)

        # Every token-parallel op runs on a row count padded to ROW_TILE (zero rows), so no kernel sees a
        # shape-dependent tail; pad rows never reach the cache or attention.
        n_tokens = token_ids.shape[0]
        n_padded = _round_up(n_tokens, ROW_TILE)
        x = F.pad(self.embed[token_ids], (0, 0, 0, n_padded - n_tokens))
        rope = self._rope_table(F.pad(positions, (0, n_padded - n_tokens)))
        for i, layer in enumerate(self.layers):
            yield i  # layer i reads and writes its cache from here on
            g = self._layer_group[i]
            slot_idx, plans, window = group_slots[g], group_plans[g], self._groups[g].window
            first = self._first_tensor[i]
            if isinstance(layer, _LatentLayer):
                attn = self._latent_attention(layer, x, rope, kv_caches[first], slot_idx, plans)
            elif isinstance(layer, _StateLayer):
                attn = self._linear_attention(layer, x, kv_caches[first], state_plans)
            else:
                k_cache, v_cache = kv_caches[first], kv_caches[first + 1]
                q, k, v = self._qkv(layer, x, rope)
                k_cache.view(-1, c.num_kv_heads, c.head_dim).index_copy_(0, slot_idx, k[:n_tokens])
                v_cache.view(-1, c.num_kv_heads, c.head_dim).index_copy_(0, slot_idx, v[:n_tokens])
                attn = x.new_zeros((n_padded, c.num_heads * c.head_dim))
                offset = 0
                for plan in plans:
                    n = plan.n
                    attn[offset : offset + n] = self._paged_attention(
                        q[offset : offset + n], plan, k_cache, v_cache, window
                    )
                    offset += n
            x = x + _mm(attn, layer.o_t)
            x = x + self._mlp(layer, x)
        if all_logits:
            return self._logits(x)[:n_tokens]
        last = torch.tensor(
            [sum(len(ch.token_ids) for ch in chunks[: j + 1]) - 1 for j in range(len(chunks))], device=dev
        )
        return self._logits(F.pad(x[last], (0, 0, 0, _round_up(len(chunks), ROW_TILE) - len(chunks))))[
            : len(chunks)
        ]

    def _group_tables(self, chunk: SeqChunk) -> Sequence[Sequence[int]]:
        table = chunk.block_table
        n_groups = len(self._groups)
        if len(table) and isinstance(table[0], Sequence):
            if len(table) != n_groups:
                raise InvalidArgumentError(
                    f"block_table must hold one table per cache group ({n_groups}), got {len(table)}"
                )
            return table  # type: ignore[return-value]
        return (table,) * n_groups  # type: ignore[return-value]

    def _plan(
        self, chunk: SeqChunk, block_table: Sequence[int], group: _Group, block_size: int
    ) -> tuple[torch.Tensor, _AttentionPlan]:
        """The cache slots of ``chunk``'s new tokens in one group's tensors, and its attention plan there."""
        n, ctx = len(chunk.token_ids), chunk.end
        n_blocks = -(-ctx // block_size)
        if len(block_table) < n_blocks:
            raise InvalidArgumentError(
                f"block_table must cover {ctx} positions ({n_blocks} blocks), got {len(block_table)}"
            )
        rows = group.group * n
        padded_rows = max(ROW_TILE, _round_up(rows, ROW_TILE))
        dev = self.device
        window = group.window
        if window is None:
            entries = list(block_table[:n_blocks])
            if entries and min(entries) < 0:
                raise InvalidArgumentError(
                    f"block_table must hold a block for each of the {n_blocks} blocks of a {group.kind}"
                    f" group, got {entries}"
                )
            table = torch.tensor(entries, dtype=torch.long)
            pos = torch.arange(chunk.start, ctx, dtype=torch.long)
            slots = table[pos // block_size] * block_size + pos % block_size
            table = table.to(dev)
            padded = _round_up(ctx, max(CTX_TILE, block_size))  # block sizes are powers of two
            # Query row r (of a kv head) is token r % n: it sees the positions up to its own.
            q_pos = torch.arange(chunk.start, ctx, device=dev).repeat(group.group)
            mask = torch.arange(padded, device=dev)[None, :] > q_pos[:, None]
            return slots, _AttentionPlan(n, ctx, padded, rows, padded_rows, table, mask)
        # A sliding window: position p attends to max(0, p - window + 1) .. p, i.e. keys with
        # p - key < window (Hugging Face's transformers.masking_utils.sliding_window_overlay, ``kv_idx >
        # q_idx - sliding_window``; vLLM's FlashAttention backend passes window_size=(sliding_window - 1, 0)).
        # The chunk reads exactly the positions [lo, ctx) some query of it sees, slot by slot, so no byte of
        # the cache outside the window is read: those blocks may be stale, NaN, or not held (-1). The gathered
        # context starts at lo rounded down to CTX_TILE, so a position has the same place in its tile in
        # every chunking (the zeroed, masked positions before lo add exact zeros).
        lo = max(0, chunk.start - window + 1)
        first = lo // block_size
        held = list(block_table[first:n_blocks])
        if min(held) < 0:
            raise InvalidArgumentError(
                f"block_table must hold the blocks {first}..{n_blocks - 1} of a sliding_window group"
                f" (positions {lo}..{ctx - 1}), got {held}"
            )
        table = torch.tensor(held, dtype=torch.long)
        pos = torch.arange(lo, ctx, dtype=torch.long)
        window_slots = table[pos // block_size - first] * block_size + pos % block_size
        base = lo // CTX_TILE * CTX_TILE
        padded = _round_up(ctx - base, CTX_TILE)
        q_pos = torch.arange(chunk.start, ctx, device=dev).repeat(group.group)[:, None]
        key_pos = torch.arange(base, base + padded, device=dev)[None, :]
        mask = (key_pos > q_pos) | (key_pos <= q_pos - window)
        plan = _AttentionPlan(n, ctx, padded, rows, padded_rows, window_slots.to(dev), mask, lo - base)
        return window_slots[chunk.start - lo :], plan

    def _state_plan(self, chunk: SeqChunk, block_table: Sequence[int], block_size: int) -> _StatePlan:
        """Where ``chunk``'s state layers read their state and write snapshots (see :class:`SeqChunk`)."""
        n, start, end = len(chunk.token_ids), chunk.start, chunk.end
        n_blocks = -(-end // block_size)
        if len(block_table) < n_blocks:
            raise InvalidArgumentError(
                f"block_table must cover {end} positions ({n_blocks} blocks), got {len(block_table)}"
            )
        read = -1
        if start:
            read = block_table[(start - 1) // block_size]
            if read < 0:
                raise InvalidArgumentError(
                    f"block_table must hold the state block {(start - 1) // block_size} (the state at"
                    f" position {start}), got -1"
                )
        last = block_table[(end - 1) // block_size]
        if last < 0:
            raise InvalidArgumentError(
                f"block_table must hold the state block {(end - 1) // block_size} (the chunk's last), got -1"
            )
        # After token t: the snapshot of every block the chunk completes (where the table holds one), and the
        # state after the chunk's last token in the block it ends in.
        writes = {}
        for p in range(_round_up(start + 1, block_size) - 1, end, block_size):
            if block_table[p // block_size] >= 0:
                writes[p - start] = block_table[p // block_size]
        writes[n - 1] = last
        return _StatePlan(n, read, writes)

    def _linear_attention(
        self, layer: _StateLayer, x: torch.Tensor, states: torch.Tensor, plans: list[_StatePlan]
    ) -> torch.Tensor:
        """The recurrent layer, token by token per request: every step has the same shapes whatever the batch,
        so states and outputs are bitwise independent of chunking (a reference, not a fast kernel)."""
        c = self.config
        heads, hd = c.num_heads, c.head_dim
        n_padded, q_dim = x.shape[0], heads * hd
        qkv = _mm(self._rms_norm(x, layer.attn_norm), layer.qkv_t)
        scale = 1.0 / math.sqrt(hd)
        q = (qkv[:, :q_dim] * scale).reshape(n_padded, heads, 1, hd)
        kv = (qkv[:, q_dim : 2 * q_dim] * scale).reshape(n_padded, heads, hd, 1) * qkv[
            :, 2 * q_dim :
        ].reshape(n_padded, heads, 1, hd)  # every token's k v^T, (tokens, heads, hd, hd)
        out = x.new_zeros((n_padded, heads, 1, hd))
        decay = layer.decay
        offset = 0
        for plan in plans:
            state = states[plan.read].clone() if plan.read >= 0 else x.new_zeros((heads, hd, hd))
            for t in range(plan.n):
                state.mul_(decay).add_(kv[offset + t])
                torch.matmul(q[offset + t], state, out=out[offset + t])
                slot = plan.writes.get(t)
                if slot is not None:
                    states[slot] = state
            offset += plan.n
        return (out.view(n_padded, heads, hd) * layer.gain).view(n_padded, q_dim)

    def state_snapshot(self, kv_caches: Sequence[torch.Tensor], block: int) -> tuple[torch.Tensor, ...]:
        """Copies of every state layer's state held in state block ``block`` (in layer order)."""
        return tuple(kv_caches[self._first_tensor[i]][block].clone() for i in self._state_layers)

    def restore_state(
        self, kv_caches: Sequence[torch.Tensor], block: int, snapshot: Sequence[torch.Tensor]
    ) -> None:
        """Write a :meth:`state_snapshot` into state block ``block`` (of the same or another request)."""
        if len(snapshot) != len(self._state_layers):
            raise InvalidArgumentError(
                f"snapshot must hold {len(self._state_layers)} states (one per state layer),"
                f" got {len(snapshot)}"
            )
        for i, state in zip(self._state_layers, snapshot, strict=True):
            kv_caches[self._first_tensor[i]][block].copy_(state)

    def _paged_attention(
        self,
        q: torch.Tensor,
        plan: _AttentionPlan,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        window: int | None,
    ) -> torch.Tensor:
        c = self.config
        n, kvh, hd = plan.n, c.num_kv_heads, c.head_dim
        group = c.num_heads // kvh
        padded, rows = plan.padded, plan.rows
        k_ctx = k_cache.new_empty((padded, kvh, hd))
        v_ctx = v_cache.new_empty((padded, kvh, hd))
        if window is None:
            ctx = plan.ctx
            block_size = k_cache.shape[1]
            filled = plan.table.shape[0] * block_size
            # Gather the context through the block table straight into buffers padded to the context tile: no
            # intermediate copies (moving the context is most of a decode step's attention cost).
            torch.index_select(k_cache, 0, plan.table, out=k_ctx[:filled].view(-1, block_size, kvh, hd))
            torch.index_select(v_cache, 0, plan.table, out=v_ctx[:filled].view(-1, block_size, kvh, hd))
            k_ctx[filled:] = 0  # masked positions: any finite key would do
            v_ctx[ctx:] = 0  # stale slots of the last block must not leak through 0 * nan
        else:
            start, end = plan.offset, plan.offset + plan.table.shape[0]
            torch.index_select(k_cache.view(-1, kvh, hd), 0, plan.table, out=k_ctx[start:end])
            torch.index_select(v_cache.view(-1, kvh, hd), 0, plan.table, out=v_ctx[start:end])
            for buf in (k_ctx, v_ctx):  # what lies outside the window is zeros, never cache bytes
                buf[:start] = 0
                buf[end:] = 0
        # (n, heads, hd) -> (kv_heads, group * n, hd): every query row of a kv head in one matmul.
        q_rows = (
            (q * (1.0 / math.sqrt(hd))).reshape(n, kvh, group, hd).permute(1, 2, 0, 3).reshape(kvh, rows, hd)
        )
        out = self._attend(q_rows, plan, k_ctx, v_ctx)
        return out.reshape(kvh, group, n, hd).permute(2, 0, 1, 3).reshape(n, c.num_heads * hd)

    @staticmethod
    def _attend(
        q_rows: torch.Tensor, plan: _AttentionPlan, k_ctx: torch.Tensor, v_ctx: torch.Tensor
    ) -> torch.Tensor:
        """Masked softmax attention of ``q_rows`` ``(kv_heads, rows, d)`` (scaled) over the gathered context
        ``k_ctx`` ``(padded, kv_heads, d)`` / ``v_ctx`` ``(padded, kv_heads, dv)``; returns ``(kv_heads, rows,
        dv)``."""
        rows, padded = plan.rows, plan.padded
        # The rows are padded to ROW_TILE once, here, for the matmuls below (what _mm does per call); a zero
        # pad row scores 0 everywhere and no real row depends on it.
        qg = q_rows.new_zeros((q_rows.shape[0], plan.padded_rows, q_rows.shape[-1]))
        qg[:, :rows] = q_rows
        scores = qg @ k_ctx.permute(1, 2, 0)  # (kvh, padded_rows, padded)
        scores[:, :rows].masked_fill_(plan.mask, float("-inf"))
        if rows == plan.padded_rows:
            probs = torch.softmax(scores, dim=-1)
        else:  # only the real rows (a decode has 4 of 16): the pad rows keep finite scores nobody reads
            probs = scores
            probs[:, :rows] = torch.softmax(scores[:, :rows], dim=-1)
        v_t = v_ctx.permute(1, 0, 2)  # (kvh, padded, dv)
        out = probs[..., :CTX_TILE] @ v_t[:, :CTX_TILE]
        for start in range(CTX_TILE, padded, CTX_TILE):
            out = out + probs[..., start : start + CTX_TILE] @ v_t[:, start : start + CTX_TILE]
        return out[:, :rows]

    def _latent_attention(
        self,
        layer: _LatentLayer,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        cache: torch.Tensor,
        slot_idx: torch.Tensor,
        plans: list[_AttentionPlan],
    ) -> torch.Tensor:
        """MLA in its absorbed form: each head's query is mapped into latent space (``q_nope @ W_uk[h].T``),
        so a head attends over the cache rows themselves (one shared "kv head" whose key is the whole row and
        whose value is its latent part), and the result is up-projected by ``W_uv[h]`` afterwards.
        Mathematically the same as up-projecting keys and values, which :meth:`forward_dense` does."""
        c = self.config
        (r, dr), heads, hd = c._latent_dims(), c.num_heads, c.head_dim
        width = r + dr
        n_tokens, n_padded = slot_idx.shape[0], x.shape[0]
        q_nope, q_rope, row = self._latent_qkv(layer, x, rope)
        cache.view(-1, width).index_copy_(0, slot_idx, row[:n_tokens])
        scale = 1.0 / math.sqrt(hd + dr)
        # (heads, tokens, r + dr): the absorbed queries, scaled.
        q_lat = torch.cat([_mm(q_nope.transpose(0, 1), layer.uk_t), q_rope.transpose(0, 1)], dim=-1) * scale
        block_size = cache.shape[1]
        out = x.new_zeros((heads, n_padded, r))
        offset = 0
        for plan in plans:
            n, ctx, filled = plan.n, plan.ctx, plan.table.shape[0] * block_size
            buf = cache.new_empty((plan.padded, width))
            torch.index_select(cache, 0, plan.table, out=buf[:filled].view(-1, block_size, width))
            buf[ctx:] = 0  # masked keys and zero values (a stale row must not leak through 0 * nan)
            ctx_rows = buf.view(plan.padded, 1, width)
            q_rows = q_lat[:, offset : offset + n].reshape(1, heads * n, width)  # row h * n + t: as the mask
            out[:, offset : offset + n] = self._attend(q_rows, plan, ctx_rows, ctx_rows[..., :r]).view(
                heads, n, r
            )
            offset += n
        return _mm(out, layer.uv).transpose(0, 1).reshape(n_padded, heads * hd)

    # -- the dense reference ---------------------------------------------------------------------------------

    def forward_dense(self, token_ids: Sequence[int]) -> torch.Tensor:
        """Reference forward over one whole sequence without a cache; returns ``(len, vocab)`` logits.

        It shares nothing with :meth:`forward` but the weights: plain matmuls, a textbook RMSNorm and RoPE,
        ``scaled_dot_product_attention`` with a causal (or sliding-window) mask, for a latent config keys
        and values up-projected from the latent, and a linear-attention layer's parallel form instead of its
        recurrence. It agrees with the paged forward within float rounding, not
        bitwise.
        """
        c = self.config
        n = len(token_ids)
        ids = torch.tensor(list(token_ids), dtype=torch.long, device=self.device)
        rot = self._rope_dim
        inv_freq = 1.0 / (c.rope_theta ** (torch.arange(0, rot, 2, dtype=torch.float64) / rot))
        ang = torch.outer(torch.arange(n, dtype=torch.float64), inv_freq).to(self.device)
        cos, sin = ang.cos().to(c.dtype)[:, None, :], ang.sin().to(c.dtype)[:, None, :]
        pos = torch.arange(n, device=self.device)
        window_mask = None
        if c.sliding_window is not None:
            window_mask = (pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - c.sliding_window)

        def norm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + c.rms_eps) * w

        def rope(x: torch.Tensor) -> torch.Tensor:
            x1, x2 = x.chunk(2, dim=-1)
            return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)

        heads, hd = c.num_heads, c.head_dim
        q_dim, kv_dim = heads * hd, c.num_kv_heads * hd
        x = self.embed[ids]
        for layer, kind in zip(self.layers, c.layer_kinds, strict=True):
            if isinstance(layer, _StateLayer):
                # The recurrence's parallel form: out_t = (1 - g) * sum_{s <= t} g^(t - s) (q_t . k_s) v_s.
                qkv = norm(x, layer.attn_norm) @ layer.qkv_t
                q, k, v = (
                    qkv[:, j * q_dim : (j + 1) * q_dim].view(n, heads, hd).transpose(0, 1) for j in range(3)
                )
                age = pos[:, None] - pos[None, :]
                gamma = layer.decay.view(heads, 1, 1).double()
                weights = torch.where(age >= 0, gamma ** age.clamp(min=0), 0.0).to(c.dtype)
                attn = ((q @ k.transpose(1, 2)) / hd * weights) @ v * layer.gain.view(heads, 1, 1)
                x = x + attn.transpose(0, 1).reshape(n, q_dim) @ layer.o_t
                h = norm(x, layer.mlp_norm)
                x = x + (F.silu(h @ layer.gate_t) * (h @ layer.up_t)) @ layer.down_t
                continue
            if isinstance(layer, _LatentLayer):
                r, dr = c._latent_dims()
                proj = norm(x, layer.attn_norm) @ layer.qkv_t
                qq = proj[:, : heads * (hd + dr)].view(n, heads, hd + dr)
                latent = norm(proj[:, heads * (hd + dr) : heads * (hd + dr) + r], layer.kv_norm)
                k_rope = rope(proj[:, None, heads * (hd + dr) + r :]).expand(n, heads, dr)
                k_nope = latent @ layer.uk_t.permute(2, 0, 1).reshape(r, heads * hd)
                v = (latent @ layer.uv.permute(1, 0, 2).reshape(r, heads * hd)).view(n, heads, hd)
                q = torch.cat([qq[..., :hd], rope(qq[..., hd:])], dim=-1)
                k = torch.cat([k_nope.view(n, heads, hd), k_rope], dim=-1)
            else:
                qkv = norm(x, layer.attn_norm) @ layer.qkv_t
                q = rope(qkv[:, :q_dim].view(n, heads, hd))
                k = rope(qkv[:, q_dim : q_dim + kv_dim].view(n, c.num_kv_heads, hd))
                v = qkv[:, q_dim + kv_dim :].view(n, c.num_kv_heads, hd)
                rep = heads // c.num_kv_heads
                k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
            if kind == "sliding_window":
                attn = F.scaled_dot_product_attention(
                    q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=window_mask
                )
            else:
                attn = F.scaled_dot_product_attention(
                    q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True
                )
            x = x + attn.transpose(0, 1).reshape(n, q_dim) @ layer.o_t
            h = norm(x, layer.mlp_norm)
            x = x + (F.silu(h @ layer.gate_t) * (h @ layer.up_t)) @ layer.down_t
        return norm(x, self.final_norm) @ self.lm_head_t
