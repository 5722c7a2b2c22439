"""TransferFuture: the only handle on a copy, and it exists only once the copy is on its stream."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Generator
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


class TransferFuture:
    """Awaitable completion of one submitted batch of block copies.

    Awaiting it never cancels the copy: cancelling the awaiting task abandons the result, while the blocks the
    copy touches stay guarded (by the request that submitted it) until the copy is actually done.

    ``kind`` is ``"store"`` (engine -> tier) or ``"load"`` (tier -> engine); ``event`` is the CUDA event
    recorded after the copy on GPU backends (``None`` on the CPU backend).
    """

    __slots__ = ("_fut", "event", "kind", "nbytes", "num_blocks")

    def __init__(
        self, fut: asyncio.Future[None], kind: str, num_blocks: int, nbytes: int, event: Any = None
    ) -> None:
        self._fut = fut
        self.kind = kind
        self.num_blocks = num_blocks
        self.nbytes = nbytes
        self.event = event

    def done(self) -> bool:
        return self._fut.done()

    def result(self) -> None:
        """Raise the copy's error (a :class:`~aiokv.TransferError`), or ``InvalidStateError`` if not done."""
        return self._fut.result()

    def exception(self) -> BaseException | None:
        return self._fut.exception()

    def add_done_callback(self, callback: Callable[[TransferFuture], None]) -> None:
        self._fut.add_done_callback(lambda _f: callback(self))

    def __await__(self) -> Generator[Any, None, None]:
        if self._fut.done():
            return self._fut.result()
        return (yield from asyncio.shield(self._fut).__await__())

    def __repr__(self) -> str:
        state = "done" if self._fut.done() else "pending"
        return f"<TransferFuture {self.kind} {self.num_blocks} blocks {self.nbytes} B {state}>"
