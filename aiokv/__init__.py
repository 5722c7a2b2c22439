"""aiokv: race-free asyncio KV-cache offloading for LLM inference engines.

The public API is re-exported here; nothing is defined in this module.
"""

from ._errors import (
    AiokvError,
    BlockRangeError,
    CapacityError,
    ClosedError,
    DeviceError,
    DuplicateRequestError,
    InvalidArgumentError,
    InvalidLayoutError,
    InvalidTypeError,
    MissingDependencyError,
    RequestStateError,
    TierLockedError,
    TransferError,
)
from ._hashing import NONE_ROOT, block_hashes, make_root
from ._layout import KVLayout
from ._offloader import Offloader
from ._request import LoadCompletion, Request, RequestHandle, RequestState
from ._stats import OffloaderStats
from .tiers._base import BackingTier, TierHealth, TierSpec
from .tiers._cpu import CPUTier, CPUTierStats
from .tiers._disk import DiskTier, DiskTierStats
from .tiers._index import BlockIndex, EntryState
from .tiers._policies import (
    ARCPolicy,
    ChainLRUPolicy,
    EvictionPolicy,
    LRUPolicy,
    make_policy,
    policy_names,
    register_policy,
)
from .tiers._redis import RedisTier, RedisTierStats
from .transfer._executor import ExecutorStats, TransferExecutor
from .transfer._future import TransferFuture

__version__ = "0.1.0"

__all__ = [
    "NONE_ROOT",
    "ARCPolicy",
    "AiokvError",
    "BackingTier",
    "BlockIndex",
    "BlockRangeError",
    "CPUTier",
    "CPUTierStats",
    "CapacityError",
    "ChainLRUPolicy",
    "ClosedError",
    "DeviceError",
    "DiskTier",
    "DiskTierStats",
    "DuplicateRequestError",
    "EntryState",
    "EvictionPolicy",
    "ExecutorStats",
    "InvalidArgumentError",
    "InvalidLayoutError",
    "InvalidTypeError",
    "KVLayout",
    "LRUPolicy",
    "LoadCompletion",
    "MissingDependencyError",
    "Offloader",
    "OffloaderStats",
    "RedisTier",
    "RedisTierStats",
    "Request",
    "RequestHandle",
    "RequestState",
    "RequestStateError",
    "TierHealth",
    "TierLockedError",
    "TierSpec",
    "TransferError",
    "TransferExecutor",
    "TransferFuture",
    "__version__",
    "block_hashes",
    "make_policy",
    "make_root",
    "policy_names",
    "register_policy",
]
