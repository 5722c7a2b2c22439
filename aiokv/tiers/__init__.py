"""Storage tiers: the CPU tier, lower (backing) tiers and their interface, the block index, eviction policies,
each tier's stats record, and the ``--tiers`` setting (``cpu=64GiB,disk=PATH:SIZE,redis=URL``: :func:`parse_tiers`
-> :class:`TierSetting`, which builds the tier). Names are imported on first use (the replay command line stays
torch-free)."""

import typing

from .. import _lazy

if typing.TYPE_CHECKING:
    from ._base import BackingTier, TierHealth, TierSpec
    from ._codec import SegmentSpec
    from ._cpu import CPUTier, CPUTierStats
    from ._faulty import FaultyTier, FaultyTierStats
    from ._index import BlockIndex, EntryState
    from ._policies import (
        AdaptivePolicy,
        ARCPolicy,
        ChainLRUPolicy,
        EvictionPolicy,
        LRUPolicy,
        SessionPolicy,
        make_policy,
        policy_names,
        register_policy,
    )
    from ._settings import TierSetting, check_tier_paths, parse_tiers
    from ._shm import SharedMemoryTier
    from ._sizing import TIER_ENCODINGS, encoded_payload_bytes, tier_entry
    from .disk import DiskTier, DiskTierStats
    from .redis import RedisTier, RedisTierStats

__getattr__, __dir__ = _lazy.attach(
    __name__,
    {
        "BackingTier": "._base",
        "TierHealth": "._base",
        "TierSpec": "._base",
        "CPUTier": "._cpu",
        "CPUTierStats": "._cpu",
        "DiskTier": ".disk",
        "DiskTierStats": ".disk",
        "FaultyTier": "._faulty",
        "FaultyTierStats": "._faulty",
        "RedisTier": ".redis",
        "RedisTierStats": ".redis",
        "SharedMemoryTier": "._shm",
        "SegmentSpec": "._codec",
        "TIER_ENCODINGS": "._sizing",
        "encoded_payload_bytes": "._sizing",
        "tier_entry": "._sizing",
        "TierSetting": "._settings",
        "check_tier_paths": "._settings",
        "parse_tiers": "._settings",
        "BlockIndex": "._index",
        "EntryState": "._index",
        "ARCPolicy": "._policies",
        "AdaptivePolicy": "._policies",
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
    "AdaptivePolicy",
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
    "SegmentSpec",
    "SessionPolicy",
    "SharedMemoryTier",
    "TIER_ENCODINGS",
    "TierHealth",
    "TierSetting",
    "TierSpec",
    "check_tier_paths",
    "encoded_payload_bytes",
    "make_policy",
    "parse_tiers",
    "policy_names",
    "register_policy",
    "tier_entry",
]
