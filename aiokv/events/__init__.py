"""KV events: an ordered, replayable record of every tier's blocks (see docs/events.md), and a publisher in
vLLM's KV-events wire format for KV-aware routers. Names are imported on first use."""

import typing

from .. import _lazy

if typing.TYPE_CHECKING:
    from ._emit import TierEvents
    from ._log import BlockInfo, EventKind, KVEvent, KVEventLog, KVEventStream, KVSnapshot
    from ._zmq import ZmqEventPublisher, encode_batch

__getattr__, __dir__ = _lazy.attach(
    __name__,
    {
        "BlockInfo": "._log",
        "EventKind": "._log",
        "KVEvent": "._log",
        "KVEventLog": "._log",
        "KVEventStream": "._log",
        "KVSnapshot": "._log",
        "TierEvents": "._emit",
        "ZmqEventPublisher": "._zmq",
        "encode_batch": "._zmq",
    },
)

__all__ = [
    "BlockInfo",
    "EventKind",
    "KVEvent",
    "KVEventLog",
    "KVEventStream",
    "KVSnapshot",
    "TierEvents",
    "ZmqEventPublisher",
    "encode_batch",
]
