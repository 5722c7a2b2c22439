"""aiokv: race-free asyncio KV-cache offloading for LLM inference engines.

The top level holds what an engine embedding aiokv writes every day, and nothing else:

- the offloader and its lifecycle: :class:`Offloader`, :class:`OffloaderState`, :class:`OffloaderStats`;
- requests: :class:`Request`, :class:`RequestState`, :class:`LoadCompletion` (what ``Request.load`` returns);
- the engine's KV memory: :class:`KVLayout`, and for hybrid models (sliding window, MLA latent, recurrent
  state: the vLLM connector builds these) :class:`KVGroup`, :class:`GroupKind`, :class:`GroupedLayout` (what
  ``KVLayout.from_groups`` returns) and :data:`NO_BLOCK` (an empty block-table entry);
- the tiers a deployment configures: :class:`CPUTier`, :class:`DiskTier`, :class:`RedisTier`;
- :func:`block_hashes` (the keys the cache is addressed by), :class:`AiokvError` (catches every aiokv error),
  ``__version__``.

Everything else lives one level down, in public modules: :mod:`aiokv.errors` (every exception class; each is
also importable from here, without a warning: ``except aiokv.ClosedError`` is everyday code too),
:mod:`aiokv.tiers` (tier interfaces, the block index, eviction policies, per-tier stats), :mod:`aiokv.transfer`
(the transfer executor, device bindings, the simulated device), :mod:`aiokv.bridge` (using aiokv from other
threads), :mod:`aiokv.rules` (the offloader's decisions as pure functions, hash roots) and :mod:`aiokv.testing`
(fault injection, an in-memory tier, a fake clock). The other names this module used to export still work
and emit a :class:`DeprecationWarning` naming their new place; they are removed in aiokv 0.3.0.

Names are imported on first use, so ``import aiokv`` (and the ``aiokv`` command line) does not import torch.
Nothing is defined here.
"""

import typing

from . import _lazy
from ._errors import AiokvError
from ._errors import BlockRangeError as BlockRangeError
from ._errors import CapacityError as CapacityError
from ._errors import ClosedError as ClosedError
from ._errors import DeviceError as DeviceError
from ._errors import DuplicateRequestError as DuplicateRequestError
from ._errors import EngineError as EngineError
from ._errors import InvalidArgumentError as InvalidArgumentError
from ._errors import InvalidLayoutError as InvalidLayoutError
from ._errors import InvalidTypeError as InvalidTypeError
from ._errors import MissingDependencyError as MissingDependencyError
from ._errors import RequestStateError as RequestStateError
from ._errors import TierLockedError as TierLockedError
from ._errors import TransferError as TransferError
from ._errors import WrongThreadError as WrongThreadError
from ._version import __version__

if typing.TYPE_CHECKING:
    from ._bridge import ThreadBridge as ThreadBridge
    from ._bridge import ThreadRequest as ThreadRequest
    from ._groups import NO_BLOCK, GroupedLayout, GroupKind, KVGroup
    from ._hashing import NONE_ROOT as NONE_ROOT
    from ._hashing import block_hashes
    from ._hashing import make_root as make_root
    from ._layout import KVLayout
    from ._offloader import Offloader, OffloaderState
    from ._request import LoadCompletion, Request, RequestState
    from ._request import RequestHandle as RequestHandle
    from ._stats import OffloaderStats
    from .tiers._base import BackingTier as BackingTier
    from .tiers._base import TierHealth as TierHealth
    from .tiers._base import TierSpec as TierSpec
    from .tiers._cpu import CPUTier
    from .tiers._cpu import CPUTierStats as CPUTierStats
    from .tiers._disk import DiskTier
    from .tiers._disk import DiskTierStats as DiskTierStats
    from .tiers._faulty import FaultyTier as FaultyTier
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
    from .transfer._future import TransferFuture as TransferFuture

__getattr__, __dir__ = _lazy.attach(
    __name__,
    {
        "KVLayout": "._layout",
        "KVGroup": "._groups",
        "GroupKind": "._groups",
        "GroupedLayout": "._groups",
        "NO_BLOCK": "._groups",
        "Offloader": "._offloader",
        "OffloaderState": "._offloader",
        "OffloaderStats": "._stats",
        "LoadCompletion": "._request",
        "Request": "._request",
        "RequestState": "._request",
        "CPUTier": ".tiers._cpu",
        "DiskTier": ".tiers.disk",
        "RedisTier": ".tiers.redis",
        "block_hashes": "._hashing",
    },
    # exported here before: each still works, warns, and is the very object of its new place
    deprecated={
        "RequestHandle": _lazy.Moved("._request", "aiokv.Request", "0.3.0"),
        "ThreadBridge": _lazy.Moved("._bridge", "aiokv.bridge.ThreadBridge", "0.3.0"),
        "ThreadRequest": _lazy.Moved("._bridge", "aiokv.bridge.ThreadRequest", "0.3.0"),
        "NONE_ROOT": _lazy.Moved("._hashing", "aiokv.rules.NONE_ROOT", "0.3.0"),
        "make_root": _lazy.Moved("._hashing", "aiokv.rules.make_root", "0.3.0"),
        "FaultyTier": _lazy.Moved(".tiers._faulty", "aiokv.testing.FaultyTier", "0.3.0"),
        "FaultyTierStats": _lazy.Moved(".tiers._faulty", "aiokv.testing.FaultyTierStats", "0.3.0"),
        "TierHealth": _lazy.Moved(".tiers._base", "aiokv.tiers.TierHealth", "0.3.0"),
        "BackingTier": _lazy.Moved(".tiers._base", "aiokv.tiers.BackingTier", "0.3.0"),
        "TierSpec": _lazy.Moved(".tiers._base", "aiokv.tiers.TierSpec", "0.3.0"),
        "CPUTierStats": _lazy.Moved(".tiers._cpu", "aiokv.tiers.CPUTierStats", "0.3.0"),
        "DiskTierStats": _lazy.Moved(".tiers.disk", "aiokv.tiers.DiskTierStats", "0.3.0"),
        "RedisTierStats": _lazy.Moved(".tiers.redis", "aiokv.tiers.RedisTierStats", "0.3.0"),
        "BlockIndex": _lazy.Moved(".tiers._index", "aiokv.tiers.BlockIndex", "0.3.0"),
        "EntryState": _lazy.Moved(".tiers._index", "aiokv.tiers.EntryState", "0.3.0"),
        "ARCPolicy": _lazy.Moved(".tiers._policies", "aiokv.tiers.ARCPolicy", "0.3.0"),
        "ChainLRUPolicy": _lazy.Moved(".tiers._policies", "aiokv.tiers.ChainLRUPolicy", "0.3.0"),
        "EvictionPolicy": _lazy.Moved(".tiers._policies", "aiokv.tiers.EvictionPolicy", "0.3.0"),
        "LRUPolicy": _lazy.Moved(".tiers._policies", "aiokv.tiers.LRUPolicy", "0.3.0"),
        "make_policy": _lazy.Moved(".tiers._policies", "aiokv.tiers.make_policy", "0.3.0"),
        "policy_names": _lazy.Moved(".tiers._policies", "aiokv.tiers.policy_names", "0.3.0"),
        "register_policy": _lazy.Moved(".tiers._policies", "aiokv.tiers.register_policy", "0.3.0"),
        "ExecutorStats": _lazy.Moved(".transfer._executor", "aiokv.transfer.ExecutorStats", "0.3.0"),
        "TransferExecutor": _lazy.Moved(".transfer._executor", "aiokv.transfer.TransferExecutor", "0.3.0"),
        "TransferFuture": _lazy.Moved(".transfer._future", "aiokv.transfer.TransferFuture", "0.3.0"),
    },
)

__all__ = [
    "NO_BLOCK",
    "AiokvError",
    "CPUTier",
    "DiskTier",
    "GroupKind",
    "GroupedLayout",
    "KVGroup",
    "KVLayout",
    "LoadCompletion",
    "Offloader",
    "OffloaderState",
    "OffloaderStats",
    "RedisTier",
    "Request",
    "RequestState",
    "__version__",
    "block_hashes",
]
