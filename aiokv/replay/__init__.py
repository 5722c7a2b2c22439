"""Trace-driven capacity planning: replay request traces through aiokv's real tier index and eviction
policies, with transfers replaced by a bandwidth model. See docs/replay.md and ``aiokv replay --help``.

The public API is re-exported here; nothing is defined in this module.
"""

from ._model import (
    DEFAULT_BANDWIDTHS,
    MODEL_PRESETS,
    TTFT_FORMULA,
    CostModel,
    ModelPreset,
    format_size,
    parse_bandwidth,
    parse_size,
)
from ._sim import ReplayResult, TierConfig, TierResult, auto_capacities, replay, sweep
from ._trace import (
    MAX_HASH_IDS,
    MAX_LINE_BYTES,
    MAX_SYNTHETIC_REFS,
    Trace,
    TraceRequest,
    load_trace,
    max_prefix_reuse,
    synthetic_trace,
)

__all__ = [
    "DEFAULT_BANDWIDTHS",
    "MAX_HASH_IDS",
    "MAX_LINE_BYTES",
    "MAX_SYNTHETIC_REFS",
    "MODEL_PRESETS",
    "TTFT_FORMULA",
    "CostModel",
    "ModelPreset",
    "ReplayResult",
    "TierConfig",
    "TierResult",
    "Trace",
    "TraceRequest",
    "auto_capacities",
    "format_size",
    "load_trace",
    "max_prefix_reuse",
    "parse_bandwidth",
    "parse_size",
    "replay",
    "sweep",
    "synthetic_trace",
]
