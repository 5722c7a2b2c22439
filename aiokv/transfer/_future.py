"""TransferFuture: the only handle on a copy; it exists only once the copy is accepted by its stream's queue."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Generator, Sequence
from typing import Any

from .._errors import InvalidArgumentError, RequestStateError

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

    Created by :class:`~aiokv.transfer.TransferExecutor` only once its copy has been accepted by its
    direction's queue, which hands everything accepted in one loop tick to the stream at the end of that
    tick, unconditionally: nothing can wait on work that is not going to run, and awaiting never returns
    before the copy is done. It is also the job the stream executes: one object per copy, no asyncio future
    unless somebody awaits it (the control path allocates as little as possible).

    Awaiting it never cancels the copy: cancelling the awaiting task abandons the result, while the blocks the
    copy touches stay guarded (by the request that submitted it) until the copy is actually done.

    ``kind`` is ``"store"`` (engine -> tier) or ``"load"`` (tier -> engine). On a device backend ``event`` is
    the device event recorded after the copy, valid once :attr:`submitted` is true (``None`` on the CPU
    backend); :meth:`order_before` makes a stream wait for the copy on the device, without a host round trip.
    ``context`` is free for the submitter (the offloader keeps the block keys there).
    """

    __slots__ = (
        "_callbacks",
        "_device",
        "_error",
        "_fut",
        "_loop",
        "_state",
        "_submitted",
        "_submitted_fut",
        "block_ids",
        "context",
        "event",
        "kind",
        "mark",
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
        *,
        device: Any = None,
        mark: Any = None,
    ) -> None:
        self._loop = loop
        self.kind = kind
        self.block_ids = block_ids
        self.slot_ids = slot_ids
        self.num_blocks = len(block_ids)
        self.nbytes = nbytes
        self.event: Any = None
        self.mark = mark  # device backends: the compute-stream point the copy is ordered after
        self.context: Any = None
        self._device = device
        self._state = _PENDING
        self._submitted = False
        self._submitted_fut: asyncio.Future[None] | None = None
        self._error: BaseException | None = None  # written by the worker before completion is delivered
        self._callbacks: Any = None  # None, one callable, or a list of them
        self._fut: asyncio.Future[None] | None = None

    def done(self) -> bool:
        return self._state == _DONE

    @property
    def submitted(self) -> bool:
        """True once the copy is on its stream (on a device: enqueued, with :attr:`event` recorded)."""
        return self._submitted

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

    async def wait_submitted(self) -> None:
        """Resolve once the copy is on its stream (it may still be running). Does not wait for the copy."""
        if self._submitted or self._state == _DONE:
            return
        if self._submitted_fut is None:
            self._submitted_fut = self._loop.create_future()
        await asyncio.shield(self._submitted_fut)

    def order_before(self, stream: Any) -> None:
        """Make work enqueued on the device ``stream`` from now on wait for this copy, on the device.

        Device backends only (CUDA or simulated), once :attr:`submitted` (``await wait_submitted()``). The
        host side of the copy (awaiting this future) is unaffected."""
        if self._device is None:
            raise InvalidArgumentError(
                "order_before() needs a device backend (cuda or simulated); on the cpu backend await the copy"
            )
        if self._state == _DONE:
            return  # complete: nothing left to order after
        if not self._submitted or self.event is None:
            raise RequestStateError("order_before() needs the copy submitted first: await wait_submitted()")
        self._device.wait_event(stream, self.event)

    def _set_submitted(self) -> None:
        """Loop thread: the copy is on its stream (device: ``event`` was recorded)."""
        self._submitted = True
        fut = self._submitted_fut
        if fut is not None:
            resolve(fut, None)

    def _complete(self) -> None:
        """Loop thread: mark done (``_error`` already set by the stream) and run callbacks in order."""
        if self._state == _DONE:
            return
        self._state = _DONE
        if not self._submitted:
            self._set_submitted()
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
        state = "done" if self._state == _DONE else ("submitted" if self._submitted else "queued")
        return f"<TransferFuture {self.kind} {self.num_blocks} blocks {self.nbytes} B {state}>"
