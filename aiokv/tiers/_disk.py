"""Compatibility module: the disk tier lives in the package :mod:`aiokv.tiers.disk` (``_geometry``,
``_files``, ``_setup``, ``_tier``). The names imported from here before it moved are re-exported.

Module-level settings (``_SPLIT_BYTES``, ``_REOPEN_BACKOFF_S``, the lock timeouts...) are deliberately not
re-exported: a copy here would not be what the tier reads. Patch them in :mod:`aiokv.tiers.disk._tier`.
"""

from __future__ import annotations

from .disk._files import CATALOG_NAME, LOCK_NAME, META_NAME, _Files
from .disk._tier import DiskTier, DiskTierStats

__all__ = ["CATALOG_NAME", "LOCK_NAME", "META_NAME", "DiskTier", "DiskTierStats", "_Files"]
