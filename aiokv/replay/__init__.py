"""Trace-driven capacity planning: replay request traces through aiokv's real tier index and eviction
policies, with transfers replaced by a bandwidth model. See docs/replay.md and ``aiokv replay --help``.

The public API is re-exported here; nothing is defined in this module. ``MODEL_PRESETS``, the old name of
:data:`COST_PRESETS` (it clashed with the reference engine's model sizes, now ``aiokv.serve.ENGINE_PRESETS``),
still works with a :class:`DeprecationWarning` until aiokv 0.3.0.
"""

from .. import _lazy
from ._groups import GROUP_KINDS, GROUP_PRESETS, GroupPlan, GroupPreset, GroupSpec, KVGroups, parse_kv_groups
from ._model import (
    COST_PRESETS,
    DEFAULT_BANDWIDTHS,
    TTFT_FORMULA,
    CostModel,
    ModelPreset,
    format_size,
    parse_bandwidth,
    parse_size,
)
from ._sim import (
    ReplayResult,
    TierConfig,
    TierResult,
    auto_capacities,
    capacity_for_hit_ratio,
    replay,
    sweep,
)
from ._trace import (
    MAX_HASH_IDS,
    MAX_LINE_BYTES,
    MAX_SYNTHETIC_REFS,
    SYNTHETIC_SHAPES,
    Trace,
    TraceRequest,
    agentic_trace,
    chat_trace,
    load_trace,
    max_prefix_reuse,
    mix_trace,
    retrieval_trace,
    synthetic_trace,
)

__getattr__, __dir__ = _lazy.attach(
    __name__, {}, deprecated={"MODEL_PRESETS": _lazy.Moved("._model", "aiokv.replay.COST_PRESETS", "0.3.0")}
)

__all__ = [
    "COST_PRESETS",
    "DEFAULT_BANDWIDTHS",
    "GROUP_KINDS",
    "GROUP_PRESETS",
    "MAX_HASH_IDS",
    "MAX_LINE_BYTES",
    "MAX_SYNTHETIC_REFS",
    "SYNTHETIC_SHAPES",
    "TTFT_FORMULA",
    "CostModel",
    "GroupPlan",
    "GroupPreset",
    "GroupSpec",
    "KVGroups",
    "ModelPreset",
    "ReplayResult",
    "TierConfig",
    "TierResult",
    "Trace",
    "TraceRequest",
    "agentic_trace",
    "auto_capacities",
    "capacity_for_hit_ratio",
    "chat_trace",
    "format_size",
    "load_trace",
    "max_prefix_reuse",
    "mix_trace",
    "parse_kv_groups",
    "parse_bandwidth",
    "parse_size",
    "replay",
    "retrieval_trace",
    "sweep",
    "synthetic_trace",
]
