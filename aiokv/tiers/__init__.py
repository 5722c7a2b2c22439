"""Storage tiers: the CPU tier, lower (backing) tiers, the block index and eviction policies."""

from ._faulty import FaultyTier, FaultyTierStats

__all__ = ["FaultyTier", "FaultyTierStats"]
