"""TransferFuture: the only handle on a copy, and it exists only once the copy is on its stream."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Generator, Sequence
from typing import Any

__all__ = ["TransferFuture", "call_soon_threadsafe_guarded", "resolve"]


def resolve(fut: asyncio.Future[None], error: BaseException | None) -> None:
    """Complete ``fut`` on its loop; a future somebody cancelled is left alone."""
    if fut.done():
        return
    if error is None:
        fut.set_result(None)
    else:
        fut.set_exception(error)


def call_soon_threadsafe_guarded(
    loop: asyncio.AbstractEventLoop, callback: Callable[..., Any], *args: Any
) -> bool:
    """The one path from worker threads back to the loop. Returns False when the loop is already closed."""
    try:
        loop.call_soon_threadsafe(callback, *args)
    except RuntimeError:  # loop closed: nobody is left to notify
        return False
    return True


_PENDING = 0
_DONE = 1


class TransferFuture:
    """Awaitable completion of one submitted batch of block copies.

    Created by :class:`~aiokv.TransferExecutor` only *after* the copy has been put on its stream, so nothing can
    wait on work that was never submitted. It is also the job the stream executes: one object per copy, no
    asyncio future unless somebody awaits it (the control path allocates as little as possible).

    Awaiting it never cancels the copy: cancelling the awaiting task abandons the result, while the blocks the
    copy touches stay guarded (by the request that submitted it) until the copy is actually done.

    ``kind`` is ``"store"`` (engine -> tier) or ``"load"`` (tier -> engine); ``event`` is the CUDA event
    recorded after the copy on GPU backends (``None`` on the CPU backend). ``context`` is free for the
    submitter (the offloader keeps the block keys there).
    """

    __slots__ = (
        "_callbacks",
        "_error",
        "_fut",
        "_loop",
        "_state",
        "block_ids",
        "context",
        "event",
        "kind",
        "nbytes",
        "num_blocks",
        "slot_ids",
    )

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        kind: str,
        block_ids: Sequence[int],
        slot_ids: Sequence[int],
        nbytes: int,
    ) -> None:
        self._loop = loop
        self.kind = kind
        self.block_ids = block_ids
        self.slot_ids = slot_ids
        self.num_blocks = len(block_ids)
        self.nbytes = nbytes
        self.event: Any = None
        self.context: Any = None
        self._state = _PENDING
        self._error: BaseException | None = None  # written by the worker before completion is delivered
        self._callbacks: Any = None  # None, one callable, or a list of them
        self._fut: asyncio.Future[None] | None = None

    def done(self) -> bool:
        return self._state == _DONE

    def result(self) -> None:
        """Raise the copy's error (a :class:`~aiokv.TransferError`), or ``InvalidStateError`` if not done."""
        if self._state != _DONE:
            raise asyncio.InvalidStateError("transfer is not done")
        if self._error is not None:
            raise self._error

    def exception(self) -> BaseException | None:
        if self._state != _DONE:
            raise asyncio.InvalidStateError("transfer is not done")
        return self._error

    def add_done_callback(self, callback: Callable[[TransferFuture], None]) -> None:
        """Call ``callback(self)`` on the loop thread when the copy completes (soon, if it already has)."""
        if self._state == _DONE:
            self._loop.call_soon(callback, self)
            return
        cbs = self._callbacks
        if cbs is None:
            self._callbacks = callback
        elif isinstance(cbs, list):
            cbs.append(callback)
        else:
            self._callbacks = [cbs, callback]

    def _complete(self) -> None:
        """Loop thread: mark done (``_error`` already set by the stream) and run callbacks in order."""
        if self._state == _DONE:
            return
        self._state = _DONE
        cbs = self._callbacks
        self._callbacks = None
        if cbs is not None:
            for cb in cbs if isinstance(cbs, list) else (cbs,):
                try:
                    cb(self)
                except Exception as exc:  # a callback's bug must not stop the others or the stream
                    self._loop.call_exception_handler(
                        {"message": "exception in TransferFuture callback", "exception": exc, "future": self}
                    )
        fut = self._fut
        if fut is not None:
            resolve(fut, self._error)

    def __await__(self) -> Generator[Any, None, None]:
        if self._state == _DONE:
            return self.result()
        if self._fut is None:
            self._fut = self._loop.create_future()
        return (yield from asyncio.shield(self._fut).__await__())

    def __repr__(self) -> str:
        state = "done" if self._state == _DONE else "pending"
        return f"<TransferFuture {self.kind} {self.num_blocks} blocks {self.nbytes} B {state}>"
