"""Sizes, model presets and the TTFT cost model of ``aiokv replay``.

The cost model is deliberately simple and stated in full wherever its numbers are shown:

    prefill time of a request  = input_tokens / prefill_tokens_per_s
    with the cache             = (input_tokens - hit_tokens) / prefill_tokens_per_s
                                 + sum over tiers t of loaded_blocks_t * block_bytes_t / bandwidth_t
    TTFT saving                = hit_tokens / prefill_tokens_per_s - sum_t loaded_bytes_t / bandwidth_t

``block_bytes_t`` is the block's bytes, or in a tier with an encoding (``TierConfig.encoding``) the encoded
payload that tier's reads move; decoding is not modelled (see docs/replay.md, "Encoded tiers").

Prefill cost is linear in tokens (attention's quadratic term, batching and queueing are ignored) and loads are
not overlapped with compute. Summed over requests the saving is exact under this model, so it is computed from
totals.

Which hits are loaded follows ``load_policy``, with the offloader's own decision code
(:class:`aiokv._planner.LoadPlanner`, given each tier's modelled bandwidth and the prefill speed):
``"decide"`` (the default, as in :class:`aiokv.Offloader`) loads a tier's run only when that is faster than
recomputing its tokens and stops at the first tier that loses, whose hits and those of every slower tier are
then recomputed (counted as skipped, excluded from the saving); ``"always"`` loads every hit. The decision
only changes the TTFT accounting: hit counts and the tiers' contents evolve the same either way (a recomputed
block is stored back into the tiers, as a restored one is staged into them).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from .._errors import InvalidArgumentError, InvalidTypeError
from .._units import format_size, parse_bandwidth, parse_size  # one grammar (docs/serving.md); re-exported

__all__ = [
    "COST_PRESETS",
    "DEFAULT_BANDWIDTHS",
    "TTFT_FORMULA",
    "CostModel",
    "ModelPreset",
    "format_size",
    "parse_bandwidth",
    "parse_size",
]

TTFT_FORMULA = (
    "ttft saving = hit_tokens / prefill_tokens_per_s - sum over tiers of loaded_bytes / tier_bandwidth "
    "(linear prefill, loads not overlapped with compute; with load_policy=decide, hits of a tier slower than "
    "recomputing, and of every tier after it, are recomputed instead)"
)


# Peak dense bf16 throughput of one H100 SXM and the model-FLOPs utilisation assumed for prefill.
_GPU_FLOPS = 989e12
_PREFILL_MFU = 0.4


@dataclass(frozen=True, slots=True)
class ModelPreset:
    """The KV footprint and a rough prefill speed of a model.

    ``kv_bytes_per_token = layers * kv_heads * head_dim * 2 (K and V) * dtype_bytes``; ``prefill_tokens_per_s
    = gpus * 989e12 * 0.4 / (2 * params)``: 40% of one H100's dense bf16 peak per GPU over the 2 * params FLOPs
    a token costs (attention ignored). Both are estimates to compare tiers and policies, not predictions.
    """

    name: str
    layers: int
    kv_heads: int
    head_dim: int
    params: float
    gpus: int = 1
    dtype_bytes: int = 2

    @property
    def kv_bytes_per_token(self) -> int:
        return self.layers * self.kv_heads * self.head_dim * 2 * self.dtype_bytes

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.gpus * _GPU_FLOPS * _PREFILL_MFU / (2 * self.params)


# The cost-model presets of real models, by name (``aiokv replay --model``). Not the reference engine's model
# sizes (``aiokv serve --model``): those are aiokv.serve.ENGINE_PRESETS.
COST_PRESETS: dict[str, ModelPreset] = {
    p.name: p
    for p in (
        ModelPreset("llama3-8b", layers=32, kv_heads=8, head_dim=128, params=8.0e9),
        ModelPreset("llama3-70b", layers=80, kv_heads=8, head_dim=128, params=70.6e9, gpus=8),
        ModelPreset("mistral-7b", layers=32, kv_heads=8, head_dim=128, params=7.2e9),
        ModelPreset("qwen2-7b", layers=28, kv_heads=4, head_dim=128, params=7.6e9),
        ModelPreset("qwen2-72b", layers=80, kv_heads=8, head_dim=128, params=72.7e9, gpus=8),
    )
}

# Assumed read bandwidth into GPU memory per tier: PCIe 5.0 x16 from pinned host memory, one NVMe SSD,
# Redis over 10 GbE.
DEFAULT_BANDWIDTHS: dict[str, float] = {"cpu": 25e9, "disk": 6e9, "redis": 1.25e9}


@dataclass(frozen=True, slots=True)
class CostModel:
    """Inputs of the TTFT estimate (see the module docstring)."""

    prefill_tokens_per_s: float
    load_policy: str = "decide"  # "decide" or "always", as Offloader(load_policy=...)

    def __post_init__(self) -> None:
        from ..rules import LOAD_MODES as MODES

        if not isinstance(self.load_policy, str):
            raise InvalidTypeError(f"load_policy must be a str, got {type(self.load_policy).__name__}")
        if self.load_policy not in MODES:
            raise InvalidArgumentError(f"load_policy must be one of {list(MODES)}, got {self.load_policy!r}")
        speed = self.prefill_tokens_per_s
        if isinstance(speed, bool) or not isinstance(speed, (int, float)):
            raise InvalidTypeError(f"prefill_tokens_per_s must be a number, got {type(speed).__name__}")
        if not (math.isfinite(speed) and speed > 0):
            raise InvalidArgumentError(f"prefill_tokens_per_s must be > 0 and finite, got {speed!r}")

    def restored_tiers(self, tiers: Sequence[tuple[str, float]], block_bytes: int, block_tokens: int) -> int:
        """How many of ``tiers`` (``(name, bandwidth)``, fastest first) have their hits loaded: all of them
        with ``"always"``; with ``"decide"``, those before the first whose load is slower than recomputing,
        as the offloader's :class:`~aiokv._planner.LoadPlanner` decides it. A modelled load has no latency,
        so the decision does not depend on the run's length and is made once per tier."""
        from ..rules import LoadPlanner, TierRun

        planner = LoadPlanner(
            block_bytes,
            block_tokens,
            mode=self.load_policy,
            prefill_tokens_per_s=self.prefill_tokens_per_s,
            load_tier="",  # each tier's bandwidth is its whole path into the engine: no separate copy
        )
        for name, bandwidth in tiers:
            planner.assume(name, 0.0, bandwidth)
        restored = planner.plan([TierRun(name, 1) for name, _ in tiers])
        return restored
