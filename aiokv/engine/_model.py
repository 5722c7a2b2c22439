"""A small decoder-only transformer with a paged KV cache, written for bitwise reproducibility.

The model is a Llama-shaped stack (RMSNorm, RoPE, grouped-query attention, SwiGLU MLP) with deterministic
seeded weights, so nothing is downloaded. It has two forwards that share the weights:

* :meth:`Transformer.forward` — the engine's forward: a batch of per-request chunks, each writing its new
  keys/values into the paged cache through the request's block table and attending over the whole context
  gathered back from it.
* :meth:`Transformer.forward_dense` — a plain non-paged reference (one sequence, full causal attention), used
  by the tests to check the paged forward.

**Batch invariance.** A restored KV block must be bitwise equal to what a recompute would produce, and the
engine computes the same position in very different batch shapes (a 512-token prefill chunk, a decode step
batched with other requests, a 3-token tail after a cache hit). On CPU a matmul's result for one row depends
on how many rows the call has (small-row calls take other kernels), and vectorised elementwise kernels fall
back to scalar code for a tail. The paged forward therefore computes every position in a shape-independent
way: every matmul gets its row count padded to a multiple of :data:`ROW_TILE`, the attention context is
padded with masked, zeroed keys to a multiple of :data:`CTX_TILE`, RoPE reads a precomputed table, and
RMSNorm's reduction is a matmul. ``tests/engine/test_model.py`` checks that any chunking of a sequence yields
bitwise the same keys, values and logits. On CUDA the same code runs, but cuBLAS makes no such promise, so
there the guarantee is a tolerance, not bits.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F

from aiokv import InvalidArgumentError

__all__ = ["CTX_TILE", "ROW_TILE", "ModelConfig", "SeqChunk", "Transformer"]

ROW_TILE = 16
"""Matmul row counts are padded to a multiple of this (MKL picks other kernels below ~12 rows)."""

CTX_TILE = 256
"""Attention contexts are padded to a multiple of this many (masked, zero) positions, and the probability-value
product runs tile by tile: MKL blocks a matmul's inner dimension differently for different lengths, so a
fixed inner length followed by in-order accumulation is what keeps every position's sum order fixed."""


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Shape and seed of a :class:`Transformer`.

    ``hidden_size``, ``num_heads * head_dim``, ``num_kv_heads * head_dim`` and ``intermediate_size`` must be
    multiples of 16 so that no elementwise kernel runs a scalar tail (see the module docstring).
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

    @property
    def bytes_per_token(self) -> int:
        """KV-cache bytes one token occupies across all layers (keys and values)."""
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * itemsize

    @property
    def num_parameters(self) -> int:
        h, q, kv = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        per_layer = h * (q + 2 * kv) + q * h + 3 * h * self.intermediate_size + 2 * h
        return self.num_layers * per_layer + 2 * self.vocab_size * h + h


@dataclass(frozen=True, slots=True)
class SeqChunk:
    """One request's share of a forward: compute ``token_ids`` at positions ``start, start + 1, ...``.

    Positions ``[0, start)`` must already hold their keys/values in the blocks of ``block_table``, which must
    cover every position up to ``start + len(token_ids)``.
    """

    token_ids: Sequence[int]
    start: int
    block_table: Sequence[int]

    @property
    def end(self) -> int:
        return self.start + len(self.token_ids)


class _AttentionPlan(NamedTuple):
    """What one chunk's attention needs in every layer: computed once per forward."""

    n: int  # new tokens
    ctx: int  # context length after them
    padded: int  # ctx padded to the context tile
    rows: int  # query rows per kv head (group * n)
    padded_rows: int  # rows padded to ROW_TILE
    table: torch.Tensor  # the chunk's block table, cut to the blocks it covers
    mask: torch.Tensor  # (rows, padded): True where a query row must not see the position


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


class _Layer:
    __slots__ = ("attn_norm", "down_t", "gate_t", "mlp_norm", "o_t", "qkv_t", "up_t")

    def __init__(self, cfg: ModelConfig, gen: torch.Generator) -> None:
        h, q, kv, ffn = (
            cfg.hidden_size,
            cfg.num_heads * cfg.head_dim,
            cfg.num_kv_heads * cfg.head_dim,
            cfg.intermediate_size,
        )

        def weight(fan_in: int, fan_out: int) -> torch.Tensor:
            # Stored transposed (in, out) so the forward is ``x @ w``.
            return torch.randn(fan_in, fan_out, generator=gen, dtype=torch.float64) / math.sqrt(fan_in)

        def norm() -> torch.Tensor:
            return 1.0 + 0.1 * torch.randn(h, generator=gen, dtype=torch.float64)

        self.attn_norm = norm()
        self.qkv_t = weight(h, q + 2 * kv)
        self.o_t = weight(q, h)
        self.mlp_norm = norm()
        self.gate_t = weight(h, ffn)
        self.up_t = weight(h, ffn)
        self.down_t = weight(ffn, h)

    def to(self, device: torch.device, dtype: torch.dtype) -> _Layer:
        for name in self.__slots__:
            setattr(self, name, getattr(self, name).to(device=device, dtype=dtype).contiguous())
        return self


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
        self.layers = [_Layer(cfg, gen).to(self.device, dt) for _ in range(cfg.num_layers)]
        self.final_norm = torch.ones(cfg.hidden_size, dtype=dt, device=self.device)
        self.lm_head_t = (
            torch.randn(cfg.hidden_size, cfg.vocab_size, generator=gen, dtype=torch.float64)
            / math.sqrt(cfg.hidden_size)
        ).to(self.device, dt)
        # RoPE table, computed once in float64: positions index it, so no sin/cos runs per forward.
        inv_freq = 1.0 / (
            cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float64) / cfg.head_dim)
        )
        angles = torch.outer(torch.arange(cfg.max_position, dtype=torch.float64), inv_freq)
        self._cos = angles.cos().to(self.device, dt)
        self._sin = angles.sin().to(self.device, dt)
        # Sum of squares as a matmul against ones: a row-independent reduction (see the module docstring).
        self._ones = torch.ones(cfg.hidden_size, ROW_TILE, dtype=dt, device=self.device)

    def __repr__(self) -> str:
        c = self.config
        return (
            f"<Transformer layers={c.num_layers} hidden={c.hidden_size} heads={c.num_heads}/{c.num_kv_heads}"
            f" head_dim={c.head_dim} vocab={c.vocab_size} params={c.num_parameters / 1e6:.1f}M"
            f" device={self.device}>"
        )

    # -- shared pieces -------------------------------------------------------------------------------------

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ss = _mm(x * x, self._ones)[:, :1]
        return x * torch.rsqrt(ss / x.shape[-1] + self.config.rms_eps) * weight

    def _rope_table(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per position ``[cos, cos]`` and ``[-sin, sin]`` over the head dimension, shaped to broadcast over
        heads: one table for every layer of a forward."""
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

        ``kv_caches`` is the flat list ``[k0, v0, k1, v1, ...]`` of ``(num_blocks, block_size, kv_heads,
        head_dim)`` tensors; each chunk's keys/values are written into it through its block table. With
        ``all_logits`` the result is every position's logits, concatenated in chunk order.
        """
        c = self.config
        if not chunks:
            raise InvalidArgumentError("chunks must not be empty")
        block_size = kv_caches[0].shape[1]
        dev = self.device
        token_ids = torch.tensor([t for ch in chunks for t in ch.token_ids], dtype=torch.long, device=dev)
        positions = torch.cat([torch.arange(ch.start, ch.end, dtype=torch.long) for ch in chunks]).to(dev)
        if int(positions.max()) >= c.max_position:
            raise InvalidArgumentError(f"positions must be < max_position={c.max_position}")
        # Flat cache slot of every new token, and each chunk's attention plan (the same for every layer).
        slots, plans = [], []
        for ch in chunks:
            n_blocks = -(-ch.end // block_size)
            if len(ch.block_table) < n_blocks:
                raise InvalidArgumentError(
                    f"block_table must cover {ch.end} positions ({n_blocks} blocks), got {len(ch.block_table)}"
                )
            table = torch.tensor(list(ch.block_table[:n_blocks]), dtype=torch.long)
            pos = torch.arange(ch.start, ch.end, dtype=torch.long)
            slots.append(table[pos // block_size] * block_size + pos % block_size)
            plans.append(self._attention_plan(ch, table.to(dev), block_size))
        slot_idx = torch.cat(slots).to(dev)

        # Every token-parallel op runs on a row count padded to ROW_TILE (zero rows), so no kernel sees a
        # shape-dependent tail; pad rows never reach the cache or attention.
        n_tokens = token_ids.shape[0]
        n_padded = _round_up(n_tokens, ROW_TILE)
        x = F.pad(self.embed[token_ids], (0, 0, 0, n_padded - n_tokens))
        rope = self._rope_table(F.pad(positions, (0, n_padded - n_tokens)))
        for i, layer in enumerate(self.layers):
            k_cache, v_cache = kv_caches[2 * i], kv_caches[2 * i + 1]
            q, k, v = self._qkv(layer, x, rope)
            k_cache.view(-1, c.num_kv_heads, c.head_dim).index_copy_(0, slot_idx, k[:n_tokens])
            v_cache.view(-1, c.num_kv_heads, c.head_dim).index_copy_(0, slot_idx, v[:n_tokens])
            attn = x.new_zeros((n_padded, c.num_heads * c.head_dim))
            offset = 0
            for plan in plans:
                n = plan.n
                attn[offset : offset + n] = self._paged_attention(
                    q[offset : offset + n], plan, k_cache, v_cache
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

    def _attention_plan(self, chunk: SeqChunk, table: torch.Tensor, block_size: int) -> _AttentionPlan:
        c = self.config
        group = c.num_heads // c.num_kv_heads
        n, ctx = len(chunk.token_ids), chunk.end
        padded = _round_up(ctx, max(CTX_TILE, block_size))  # block sizes are powers of two
        rows = group * n
        # Query row r (of a kv head) is token r % n: it sees the positions up to its own.
        q_pos = torch.arange(chunk.start, ctx, device=table.device).repeat(group)
        mask = torch.arange(padded, device=table.device)[None, :] > q_pos[:, None]
        return _AttentionPlan(n, ctx, padded, rows, max(ROW_TILE, _round_up(rows, ROW_TILE)), table, mask)

    def _paged_attention(
        self, q: torch.Tensor, plan: _AttentionPlan, k_cache: torch.Tensor, v_cache: torch.Tensor
    ) -> torch.Tensor:
        c = self.config
        n, kvh, hd = plan.n, c.num_kv_heads, c.head_dim
        group = c.num_heads // kvh
        ctx, padded, rows = plan.ctx, plan.padded, plan.rows
        block_size = k_cache.shape[1]
        filled = plan.table.shape[0] * block_size
        # Gather the context through the block table straight into buffers padded to the context tile: no
        # intermediate copies (moving the context is most of a decode step's attention cost).
        k_ctx = k_cache.new_empty((padded, kvh, hd))
        v_ctx = v_cache.new_empty((padded, kvh, hd))
        torch.index_select(k_cache, 0, plan.table, out=k_ctx[:filled].view(-1, block_size, kvh, hd))
        torch.index_select(v_cache, 0, plan.table, out=v_ctx[:filled].view(-1, block_size, kvh, hd))
        k_ctx[filled:] = 0  # masked positions: any finite key would do
        v_ctx[ctx:] = 0  # stale slots of the last block must not leak through 0 * nan
        # (n, heads, hd) -> (kv_heads, group * n, hd): every query row of a kv head in one matmul. The rows are
        # padded to ROW_TILE once, here, for the matmuls below (what _mm does per call); a zero pad row scores
        # 0 everywhere and no real row depends on it.
        qg = q.new_zeros((kvh, plan.padded_rows, hd))
        qg[:, :rows] = (
            (q * (1.0 / math.sqrt(hd))).reshape(n, kvh, group, hd).permute(1, 2, 0, 3).reshape(kvh, rows, hd)
        )
        scores = qg @ k_ctx.permute(1, 2, 0)  # (kvh, padded_rows, padded)
        scores[:, :rows].masked_fill_(plan.mask, float("-inf"))
        if rows == plan.padded_rows:
            probs = torch.softmax(scores, dim=-1)
        else:  # only the real rows (a decode has 4 of 16): the pad rows keep finite scores nobody reads
            probs = scores
            probs[:, :rows] = torch.softmax(scores[:, :rows], dim=-1)
        v_t = v_ctx.permute(1, 0, 2)  # (kvh, padded, hd)
        out = probs[..., :CTX_TILE] @ v_t[:, :CTX_TILE]
        for start in range(CTX_TILE, padded, CTX_TILE):
            out = out + probs[..., start : start + CTX_TILE] @ v_t[:, start : start + CTX_TILE]
        return out[:, :rows].reshape(kvh, group, n, hd).permute(2, 0, 1, 3).reshape(n, c.num_heads * hd)

    # -- the dense reference ---------------------------------------------------------------------------------

    def forward_dense(self, token_ids: Sequence[int]) -> torch.Tensor:
        """Reference forward over one whole sequence without a cache; returns ``(len, vocab)`` logits.

        It shares nothing with :meth:`forward` but the weights: plain matmuls, a textbook RMSNorm and RoPE,
        and ``scaled_dot_product_attention`` with a causal mask. It agrees with the paged forward within
        float rounding, not bitwise.
        """
        c = self.config
        n = len(token_ids)
        ids = torch.tensor(list(token_ids), dtype=torch.long, device=self.device)
        pos = torch.arange(n, device=self.device)
        inv_freq = 1.0 / (c.rope_theta ** (torch.arange(0, c.head_dim, 2, dtype=torch.float64) / c.head_dim))
        ang = torch.outer(torch.arange(n, dtype=torch.float64), inv_freq).to(self.device)
        cos, sin = ang.cos().to(c.dtype)[:, None, :], ang.sin().to(c.dtype)[:, None, :]
        del pos

        def norm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + c.rms_eps) * w

        def rope(x: torch.Tensor) -> torch.Tensor:
            x1, x2 = x.chunk(2, dim=-1)
            return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)

        q_dim, kv_dim = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        x = self.embed[ids]
        for layer in self.layers:
            qkv = norm(x, layer.attn_norm) @ layer.qkv_t
            q = rope(qkv[:, :q_dim].view(n, c.num_heads, c.head_dim))
            k = rope(qkv[:, q_dim : q_dim + kv_dim].view(n, c.num_kv_heads, c.head_dim))
            v = qkv[:, q_dim + kv_dim :].view(n, c.num_kv_heads, c.head_dim)
            rep = c.num_heads // c.num_kv_heads
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
            attn = F.scaled_dot_product_attention(
                q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True
            )
            x = x + attn.transpose(0, 1).reshape(n, q_dim) @ layer.o_t
            h = norm(x, layer.mlp_norm)
            x = x + (F.silu(h @ layer.gate_t) * (h @ layer.up_t)) @ layer.down_t
        return norm(x, self.final_norm) @ self.lm_head_t
