"""What a :class:`~aiokv.Request` may use of the offloader that owns it, in one object with public names only.

``_offloader`` imports ``_request`` (it creates requests); a request holds a :class:`RequestHost`, never the
offloader, so the two modules have no import cycle, a request cannot reach into its owner's internals, and
everything it may touch is listed here (``tests/core/test_host.py`` checks both: no private name here, and
none used by ``_request.py`` on its host).

The offloader builds one host when it is made and fills in ``loop``, ``executor`` and ``thread`` when it
starts (requests exist only while it runs). Operations are the offloader's bound methods stored as attributes:
calling one costs what calling the method costs, with no forwarding frame on the per-step path.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._errors import WrongThreadError
    from ._layout import KVLayout
    from ._stats import Counters
    from .transfer._executor import TransferExecutor
    from .transfer._future import LayeredTransfer, TransferFuture

__all__ = ["RequestHost"]


class RequestHost:
    """The owner of a request, as the request sees it: configuration, the loop, the data path, the counters."""

    __slots__ = (
        "block_size",
        "counters",
        "deferred",
        "device",
        "executor",
        "flush_deferred",
        "grouped",
        "grouped_lookup",
        "layout",
        "load_blocks",
        "load_not_submitted",
        "load_poisoned",
        "lookup_and_pin",
        "loop",
        "mark",
        "num_blocks",
        "pin_ready",
        "request_ended",
        "retain",
        "store_blocks",
        "store_not_submitted",
        "store_one",
        "store_partial_last_block",
        "store_units",
        "thread",
        "unpin",
        "wrong_thread",
    )

    # ------------------------------------------------------------------ configuration (fixed)
    layout: KVLayout
    block_size: int
    num_blocks: int
    store_partial_last_block: bool
    grouped: Any  # the GroupedLayout, or None
    device: Any  # the DeviceBinding, or None
    counters: Counters
    # ------------------------------------------------------------------ set when the offloader starts
    loop: asyncio.AbstractEventLoop
    executor: TransferExecutor
    thread: int | None
    # Stores completed by fast-path steps of this tick, submitted together by ``flush_deferred``.
    deferred: list[Any]
    # ------------------------------------------------------------------ threads and ordering
    wrong_thread: Callable[[str], WrongThreadError]
    mark: Callable[[], Any]
    flush_deferred: Callable[[], None]
    # ------------------------------------------------------------------ the CPU tier's index (aiokv.store)
    lookup_and_pin: Callable[..., Awaitable[tuple[list[bytes], list[int]]]]
    grouped_lookup: Callable[..., Awaitable[Any]]
    pin_ready: Callable[[Sequence[bytes]], list[int]]
    unpin: Callable[[Sequence[bytes]], None]
    retain: Callable[[Sequence[bytes], float], None]
    # ------------------------------------------------------------------ copies
    store_blocks: Callable[..., TransferFuture | None]
    store_units: Callable[..., TransferFuture | None]
    store_one: Callable[..., TransferFuture | None]
    load_blocks: Callable[..., TransferFuture | LayeredTransfer]
    # ------------------------------------------------------------------ outcomes (counted and logged)
    store_not_submitted: Callable[[str, BaseException], None]
    load_not_submitted: Callable[[str, int, BaseException], None]
    load_poisoned: Callable[[str, int], None]
    request_ended: Callable[[Any], None]

    def __init__(self, **members: Any) -> None:
        missing = set(self.__slots__) - set(members) - {"loop", "executor", "thread", "deferred"}
        unknown = set(members) - set(self.__slots__)
        if missing or unknown:
            raise TypeError(f"RequestHost: missing {sorted(missing)}, unknown {sorted(unknown)}")
        self.thread = None
        self.deferred = []
        for name, value in members.items():
            setattr(self, name, value)

    def __repr__(self) -> str:
        return f"<RequestHost {self.layout.describe()} thread={self.thread}>"
