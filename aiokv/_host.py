"""The narrow interface a :class:`~aiokv.Request` needs from the offloader that owns it.

``_offloader`` imports ``_request`` (it creates requests); ``_request`` depends only on this protocol, never on
the offloader module, so the two modules have no import cycle, and everything a request may touch on its
owner is listed here in one place.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from ._errors import WrongThreadError
    from ._layout import KVLayout
    from ._stats import Counters
    from .transfer._executor import TransferExecutor
    from .transfer._future import TransferFuture

__all__ = ["RequestHost"]


class RequestHost(Protocol):
    """What a request uses of its offloader: configuration, the loop, the data path and the counters."""

    layout: KVLayout
    block_size: int
    store_partial_last_block: bool
    _counters: Counters
    _device: Any
    _num_blocks: int
    _thread: int | None
    _deferred: list[Any]

    @property
    def loop(self) -> asyncio.AbstractEventLoop: ...

    @property
    def executor(self) -> TransferExecutor: ...

    # ---------------------------------------------------------------- threads and ordering
    def _wrong_thread(self, what: str) -> WrongThreadError: ...

    def _mark(self) -> Any: ...

    def _flush_deferred(self) -> None: ...

    # ---------------------------------------------------------------- the CPU tier's index
    async def _lookup_and_pin(
        self, keys: list[bytes], source: Any = None
    ) -> tuple[list[bytes], list[int]]: ...

    def _pin_ready(self, keys: Sequence[bytes]) -> list[int]: ...

    def _unpin(self, keys: Sequence[bytes]) -> None: ...

    def _retain(self, keys: Sequence[bytes], seconds: float) -> None: ...

    # ---------------------------------------------------------------- copies
    def _store_blocks(
        self,
        chain: list[bytes],
        start: int,
        end: int,
        blocks: list[int],
        mark: Any = None,
        source: Any = None,
    ) -> TransferFuture | None: ...

    def _store_one(
        self,
        key: bytes,
        parent: bytes | None,
        depth: int,
        block_id: int,
        mark: Any = None,
        source: Any = None,
        num_tokens: int | None = None,
    ) -> TransferFuture | None: ...

    def _load_blocks(
        self, keys: list[bytes], slots: list[int], block_ids: list[int], mark: Any = None
    ) -> TransferFuture: ...

    # ---------------------------------------------------------------- outcomes (counted and logged)
    def _store_not_submitted(self, request_id: str, exc: BaseException) -> None: ...

    def _load_not_submitted(self, request_id: str, num_blocks: int, exc: BaseException) -> None: ...

    def _load_poisoned(self, request_id: str, num_computed_tokens: int) -> None: ...

    def _request_ended(self, req: Any) -> None: ...
