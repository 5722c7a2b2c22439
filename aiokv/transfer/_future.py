"""TransferFuture: the only handle on a copy; it exists only once the copy is accepted by its stream's queue."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Generator, Sequence
from typing import Any

from .._errors import InvalidArgumentError, RequestStateError

__all__ = ["LayeredTransfer", "TransferFuture", "call_soon_threadsafe_guarded", "resolve", "split_layers"]


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
        "group",
        "kind",
        "layer",
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
        layer: int | None = None,
    ) -> None:
        self._loop = loop
        self.layer = layer  # a layer-wise copy's layer (KVLayout.layers), None for whole blocks
        self.group: LayerGroup | None = None  # a layer-wise copy: the layers of its load (see LayerGroup)
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
        layer = "" if self.layer is None else f" layer {self.layer}"
        return f"<TransferFuture {self.kind}{layer} {self.num_blocks} blocks {self.nbytes} B {state}>"


class LayerGroup:
    """The layers of one layer-wise load, shared by their TransferFutures. Once one layer's copy
    failed, the later layers of the same load are not copied (they fail with :class:`LayerSkipped`): the load is
    a miss whatever they would write, and its engine blocks are recomputed, so copying them would only spend
    bandwidth and race the engine's recompute into those blocks. Read and written by the stream's worker only
    (the thread that runs the copies, in layer order)."""

    __slots__ = ("failed",)

    def __init__(self) -> None:
        self.failed = False


class LayerSkipped(RuntimeError):
    """A layer of a layer-wise load that was not copied because an earlier layer of that load failed."""


def skip_failed_layers(part: list[TransferFuture]) -> list[TransferFuture]:
    """Worker thread: the copies of ``part`` still to run. A layer whose load already lost an earlier layer is
    completed as failed (:class:`LayerSkipped`) without copying."""
    if part[0].layer is None:
        return part
    live = []
    for tf in part:
        group = tf.group
        if group is not None and group.failed:
            tf._error = LayerSkipped(f"layer {tf.layer} not copied: an earlier layer of this load failed")
        else:
            live.append(tf)
    return live


def fail_layers(part: list[TransferFuture]) -> None:
    """Worker thread: ``part``'s copy failed; the later layers of its loads will be skipped."""
    for tf in part:
        if tf.group is not None:
            tf.group.failed = True


class LayeredTransfer:
    """A copy of whole blocks made of one :class:`TransferFuture` per layer (:attr:`layers`, in the order of
    the layout's layers, which is the order they are copied in on the stream).

    It is what a layer-wise copy returns, and it answers like one TransferFuture for the whole: it is done
    when every layer is, its error is the first failed layer's, awaiting it waits for every layer, and its
    done callbacks run once, after the last layer's own. Nothing about it exists before its layers were
    accepted by the stream's queue (it is built from them), so nothing can wait on unsubmitted work here
    either."""

    __slots__ = ("_callbacks", "_fut", "_loop", "_remaining", "context", "kind", "layers")

    def __init__(self, loop: asyncio.AbstractEventLoop, layers: Sequence[TransferFuture]) -> None:
        if not layers:
            raise InvalidArgumentError("a layered transfer needs at least one layer")
        self._loop = loop
        self.layers: tuple[TransferFuture, ...] = tuple(layers)
        self.kind = self.layers[0].kind
        self.context: Any = None
        self._callbacks: list[Callable[[LayeredTransfer], None]] = []
        self._fut: asyncio.Future[None] | None = None
        self._remaining = sum(1 for tf in self.layers if not tf.done())
        for tf in self.layers:
            if not tf.done():
                tf.add_done_callback(self._layer_done)

    # The whole copy's figures (every layer copies the same blocks).
    @property
    def block_ids(self) -> Sequence[int]:
        return self.layers[0].block_ids

    @property
    def slot_ids(self) -> Sequence[int]:
        return self.layers[0].slot_ids

    @property
    def num_blocks(self) -> int:
        return self.layers[0].num_blocks

    @property
    def nbytes(self) -> int:
        return sum(tf.nbytes for tf in self.layers)

    @property
    def event(self) -> Any:
        """The last layer's completion event (device backends; ``None`` on the CPU backend)."""
        return self.layers[-1].event

    @property
    def submitted(self) -> bool:
        return all(tf.submitted for tf in self.layers)

    def done(self) -> bool:
        return self._remaining == 0

    def exception(self) -> BaseException | None:
        if not self.done():
            raise asyncio.InvalidStateError("transfer is not done")
        for tf in self.layers:
            err = tf.exception()
            if err is not None:
                return err
        return None

    def result(self) -> None:
        err = self.exception()
        if err is not None:
            raise err

    def add_done_callback(self, callback: Callable[[LayeredTransfer], None]) -> None:
        """Call ``callback(self)`` on the loop thread once every layer completed (soon, if all have)."""
        if self.done():
            self._loop.call_soon(callback, self)
        else:
            self._callbacks.append(callback)

    async def wait_submitted(self) -> None:
        """Resolve once every layer's copy is on its stream."""
        for tf in self.layers:
            await tf.wait_submitted()

    def order_before(self, stream: Any) -> None:
        """Make work enqueued on ``stream`` from now on wait for every layer (see
        :meth:`TransferFuture.order_before`; the layers complete in order, so this waits for the last)."""
        for tf in self.layers:
            tf.order_before(stream)

    def _layer_done(self, _tf: TransferFuture) -> None:
        self._remaining -= 1
        if self._remaining:
            return
        cbs, self._callbacks = self._callbacks, []
        for cb in cbs:
            try:
                cb(self)
            except Exception as exc:
                self._loop.call_exception_handler(
                    {"message": "exception in LayeredTransfer callback", "exception": exc, "future": self}
                )
        fut = self._fut
        if fut is not None:
            resolve(fut, self.exception())

    def __await__(self) -> Generator[Any, None, None]:
        if self.done():
            return self.result()
        if self._fut is None:
            self._fut = self._loop.create_future()
        return (yield from asyncio.shield(self._fut).__await__())

    def __repr__(self) -> str:
        done = sum(1 for tf in self.layers if tf.done())
        return (
            f"<LayeredTransfer {self.kind} {self.num_blocks} blocks, {done}/{len(self.layers)} layers done>"
        )


def split_layers(batch: list[TransferFuture]) -> list[list[TransferFuture]]:
    """A stream's batch in its parts: runs of consecutive copies of the same layer (whole-block copies are
    layer ``None``), each copied and completed on its own. Most batches are one part."""
    layer = batch[0].layer
    if layer is None and all(tf.layer is None for tf in batch):
        return [batch]
    parts: list[list[TransferFuture]] = [[batch[0]]]
    for tf in batch[1:]:
        if tf.layer == layer:
            parts[-1].append(tf)
        else:
            layer = tf.layer
            parts.append([tf])
    return parts
