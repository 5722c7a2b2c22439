"""Compatibility module: the Redis tier lives in the package :mod:`aiokv.tiers.redis` (``_connection``,
``_replies``, ``_values``, ``_tier``). The names imported from here before it moved are re-exported.
"""

from __future__ import annotations

from ._health import Breaker
from .redis._tier import RedisTier, RedisTierStats
from .redis._values import DEFAULT_MAX_VALUE_BYTES

__all__ = ["DEFAULT_MAX_VALUE_BYTES", "RedisTier", "RedisTierStats", "_Breaker"]

# The breaker is shared with the disk tier (aiokv/tiers/_health.py); the old private name stays for importers.
_Breaker = Breaker
