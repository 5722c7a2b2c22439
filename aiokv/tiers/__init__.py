"""Storage tiers: the CPU tier, lower (backing) tiers, the block index and eviction policies."""
