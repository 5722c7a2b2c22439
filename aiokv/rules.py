"""The offloader's decisions as pure, synchronous code, for the programs that must decide the same way.

:mod:`aiokv.replay` simulates a hierarchy with these very functions, so a replayed trace and a served one
follow one definition; an engine that plans its own copies (with :mod:`aiokv.store`) can call them too.

- :func:`window_blocks`, :func:`longest_hit`, :class:`Retention`: what a KV-cache group needs kept and what a
  prefix hit is across several groups (sliding window, recurrent state; docs/guide.md, "Several KV-cache
  groups").
- :class:`LoadPlanner`, :class:`TierRun`, :class:`CostFit`, :class:`PrefillMeter`, :class:`PlannerStats`,
  :data:`LOAD_MODES`: whether loading a cached prefix from a tier beats recomputing it (docs/architecture.md,
  "Load or recompute").
- :func:`check_token_ids`: the token-id check every API entry point applies (a wrong token silently changes
  every later block hash, so bools, floats and out-of-range ints are refused rather than coerced).
- :func:`block_hashes` (also :func:`aiokv.block_hashes`): the chained key of every full block of a prefix.
- :func:`make_root`, :data:`NONE_ROOT`: the root of a hash chain (what :func:`block_hashes` chains from):
  a layout fingerprint and a model id make one; ``NONE_ROOT`` is the root of neither (``aiokv.make_root`` and
  ``aiokv.NONE_ROOT`` still work, with a :class:`DeprecationWarning`, until aiokv 0.3.0).
"""

from ._grouprule import Retention, longest_hit, window_blocks
from ._hashing import NONE_ROOT, block_hashes, check_token_ids, make_root
from ._planner import MODES as LOAD_MODES
from ._planner import CostFit, LoadPlanner, PlannerStats, PrefillMeter, TierRun

__all__ = [
    "LOAD_MODES",
    "NONE_ROOT",
    "CostFit",
    "LoadPlanner",
    "PlannerStats",
    "PrefillMeter",
    "Retention",
    "TierRun",
    "block_hashes",
    "check_token_ids",
    "longest_hit",
    "make_root",
    "window_blocks",
]
