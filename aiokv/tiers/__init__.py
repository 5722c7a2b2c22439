"""Storage tiers: the CPU tier, lower (backing) tiers and their interface, the block index, eviction policies
and each tier's stats record. Names are imported on first use (the replay command line stays torch-free)."""

import typing

from .. import _lazy

if typing.TYPE_CHECKING:
    from ._base import BackingTier, TierHealth, TierSpec
    from ._cpu import CPUTier, CPUTierStats
    from ._disk import DiskTier, DiskTierStats
    from ._faulty import FaultyTier, FaultyTierStats
    from ._index import BlockIndex, EntryState
    from ._policies import (
        ARCPolicy,
        ChainLRUPolicy,
        EvictionPolicy,
        LRUPolicy,
        SessionPolicy,
        make_policy,
        policy_names,
        register_policy,
    )
    from ._redis import RedisTier, RedisTierStats
    from ._shm import SharedMemoryTier

__getattr__, __dir__ = _lazy.attach(
    __name__,
    {
        "BackingTier": "._base",
        "TierHealth": "._base",
        "TierSpec": "._base",
        "CPUTier": "._cpu",
        "CPUTierStats": "._cpu",
        "DiskTier": "._disk",
        "DiskTierStats": "._disk",
        "FaultyTier": "._faulty",
        "FaultyTierStats": "._faulty",
        "RedisTier": "._redis",
        "RedisTierStats": "._redis",
        "SharedMemoryTier": "._shm",
        "BlockIndex": "._index",
        "EntryState": "._index",
        "ARCPolicy": "._policies",
        "ChainLRUPolicy": "._policies",
        "EvictionPolicy": "._policies",
        "LRUPolicy": "._policies",
        "SessionPolicy": "._policies",
        "make_policy": "._policies",
        "policy_names": "._policies",
        "register_policy": "._policies",
    },
)

__all__ = [
    "ARCPolicy",
    "BackingTier",
    "BlockIndex",
    "CPUTier",
    "CPUTierStats",
    "ChainLRUPolicy",
    "DiskTier",
    "DiskTierStats",
    "EntryState",
    "EvictionPolicy",
    "FaultyTier",
    "FaultyTierStats",
    "LRUPolicy",
    "RedisTier",
    "RedisTierStats",
    "SessionPolicy",
    "SharedMemoryTier",
    "TierHealth",
    "TierSpec",
    "make_policy",
    "policy_names",
    "register_policy",
]
