"""aiokv: race-free asyncio KV-cache offloading for LLM inference engines.

The top level holds what an engine embedding aiokv writes every day; the rest lives one level down:
:mod:`aiokv.tiers` (tier interfaces, the block index, eviction policies, per-tier stats) and
:mod:`aiokv.transfer` (the transfer executor, device bindings, the simulated device). Names are imported on
first use, so ``import aiokv`` (and the ``aiokv`` command line) does not import torch. Nothing is defined here.
"""

import typing

from . import _lazy
from ._errors import (
    AiokvError,
    BlockRangeError,
    CapacityError,
    ClosedError,
    DeviceError,
    DuplicateRequestError,
    EngineError,
    InvalidArgumentError,
    InvalidLayoutError,
    InvalidTypeError,
    MissingDependencyError,
    RequestStateError,
    TierLockedError,
    TransferError,
    WrongThreadError,
)
from ._version import __version__

if typing.TYPE_CHECKING:
    from ._bridge import ThreadBridge, ThreadRequest
    from ._groups import NO_BLOCK, GroupedLayout, GroupKind, KVGroup
    from ._hashing import NONE_ROOT as NONE_ROOT
    from ._hashing import block_hashes
    from ._hashing import make_root as make_root
    from ._layout import KVLayout
    from ._offloader import Offloader
    from ._request import LoadCompletion, Request, RequestHandle, RequestState
    from ._stats import OffloaderStats
    from .tiers._base import BackingTier as BackingTier
    from .tiers._base import TierHealth
    from .tiers._base import TierSpec as TierSpec
    from .tiers._cpu import CPUTier
    from .tiers._cpu import CPUTierStats as CPUTierStats
    from .tiers._disk import DiskTier
    from .tiers._disk import DiskTierStats as DiskTierStats
    from .tiers._faulty import FaultyTier
    from .tiers._faulty import FaultyTierStats as FaultyTierStats
    from .tiers._index import BlockIndex as BlockIndex
    from .tiers._index import EntryState as EntryState
    from .tiers._policies import ARCPolicy as ARCPolicy
    from .tiers._policies import ChainLRUPolicy as ChainLRUPolicy
    from .tiers._policies import EvictionPolicy as EvictionPolicy
    from .tiers._policies import LRUPolicy as LRUPolicy
    from .tiers._policies import make_policy as make_policy
    from .tiers._policies import policy_names as policy_names
    from .tiers._policies import register_policy as register_policy
    from .tiers._redis import RedisTier
    from .tiers._redis import RedisTierStats as RedisTierStats
    from .transfer._executor import ExecutorStats as ExecutorStats
    from .transfer._executor import TransferExecutor as TransferExecutor
    from .transfer._future import TransferFuture

__getattr__, __dir__ = _lazy.attach(
    __name__,
    {
        # the everyday API
        "KVLayout": "._layout",
        "KVGroup": "._groups",
        "GroupKind": "._groups",
        "GroupedLayout": "._groups",
        "NO_BLOCK": "._groups",
        "Offloader": "._offloader",
        "OffloaderStats": "._stats",
        "LoadCompletion": "._request",
        "Request": "._request",
        "RequestHandle": "._request",
        "RequestState": "._request",
        "CPUTier": ".tiers._cpu",
        "DiskTier": ".tiers._disk",
        "RedisTier": ".tiers._redis",
        "FaultyTier": ".tiers._faulty",
        "TierHealth": ".tiers._base",
        "TransferFuture": ".transfer._future",
        "ThreadBridge": "._bridge",
        "ThreadRequest": "._bridge",
        "block_hashes": "._hashing",
        # documented here in 0.1.0, now in aiokv.tiers / aiokv.transfer: still importable from here
        "NONE_ROOT": "._hashing",
        "make_root": "._hashing",
        "BackingTier": ".tiers._base",
        "TierSpec": ".tiers._base",
        "CPUTierStats": ".tiers._cpu",
        "DiskTierStats": ".tiers._disk",
        "RedisTierStats": ".tiers._redis",
        "FaultyTierStats": ".tiers._faulty",
        "BlockIndex": ".tiers._index",
        "EntryState": ".tiers._index",
        "ARCPolicy": ".tiers._policies",
        "ChainLRUPolicy": ".tiers._policies",
        "EvictionPolicy": ".tiers._policies",
        "LRUPolicy": ".tiers._policies",
        "make_policy": ".tiers._policies",
        "policy_names": ".tiers._policies",
        "register_policy": ".tiers._policies",
        "ExecutorStats": ".transfer._executor",
        "TransferExecutor": ".transfer._executor",
    },
)

__all__ = [
    "NO_BLOCK",
    "AiokvError",
    "BlockRangeError",
    "CPUTier",
    "CapacityError",
    "ClosedError",
    "DeviceError",
    "DiskTier",
    "DuplicateRequestError",
    "EngineError",
    "FaultyTier",
    "GroupKind",
    "GroupedLayout",
    "InvalidArgumentError",
    "InvalidLayoutError",
    "InvalidTypeError",
    "KVGroup",
    "KVLayout",
    "LoadCompletion",
    "MissingDependencyError",
    "Offloader",
    "OffloaderStats",
    "RedisTier",
    "Request",
    "RequestHandle",
    "RequestState",
    "RequestStateError",
    "ThreadBridge",
    "ThreadRequest",
    "TierHealth",
    "TierLockedError",
    "TransferError",
    "TransferFuture",
    "WrongThreadError",
    "__version__",
    "block_hashes",
]
