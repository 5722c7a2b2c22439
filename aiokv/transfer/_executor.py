"""The transfer executor: engine blocks <-> host slots, on ordered streams, returning TransferFutures."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .._errors import ClosedError, TransferError
from .._layout import KVLayout
from ._cpu import GATHER_GROUP, SCATTER_GROUP, CPUStream, copy_segments
from ._future import TransferFuture, call_soon_threadsafe_guarded, resolve

__all__ = ["ExecutorStats", "TransferExecutor"]


@dataclass(frozen=True, slots=True)
class ExecutorStats:
    backend: str
    in_flight: int
    in_flight_bytes: int
    submitted: int
    failed: int


class TransferExecutor:
    """Copies between the engine's KV tensors and a host buffer of ``slot_bytes``-sized slots.

    Two FIFO streams, one per direction (stores: engine -> host, loads: host -> engine). ``submit_*`` puts the
    copy on its stream *before* creating the :class:`TransferFuture` it returns, so a future always stands for
    submitted work. On CUDA the streams are ``torch.cuda.Stream`` objects (stores ordered after the engine's
    compute stream); on CPU they are worker threads running a GIL-free memcpy kernel.
    """

    def __init__(self, layout: KVLayout, host: torch.Tensor, loop: asyncio.AbstractEventLoop) -> None:
        if host.dtype != torch.uint8 or host.dim() != 1 or not host.is_contiguous():
            raise ValueError("host buffer must be a contiguous 1-d uint8 tensor")
        self._layout = layout
        self._host = host
        self._host_addr = host.data_ptr()
        self._loop = loop
        self._closed = False
        self._in_flight: set[asyncio.Future[None]] = set()
        self._in_flight_bytes = 0
        self._submitted = 0
        self._failed = 0
        self.backend = "cuda" if layout.is_cuda else "cpu"
        if layout.is_cuda:
            from .._cuda import CudaTransferBackend

            self._cuda: CudaTransferBackend | None = CudaTransferBackend(layout, host)
            self._streams: tuple[CPUStream, CPUStream] | None = None
        else:
            self._cuda = None
            self._streams = (CPUStream(loop, "store"), CPUStream(loop, "load"))

    # ------------------------------------------------------------------ copies
    def _copy_store(self, block_ids: Sequence[int], slot_ids: Sequence[int]) -> None:
        """Runs on the store worker thread (CPU backend)."""
        engine, host, nbytes = self._layout.copy_plan(block_ids, slot_ids, self._host_addr)
        copy_segments(host, engine, nbytes, GATHER_GROUP)

    def _copy_load(self, slot_ids: Sequence[int], block_ids: Sequence[int]) -> None:
        """Runs on the load worker thread (CPU backend)."""
        engine, host, nbytes = self._layout.copy_plan(block_ids, slot_ids, self._host_addr)
        copy_segments(engine, host, nbytes, SCATTER_GROUP)

    def _submit(self, kind: str, block_ids: Sequence[int], slot_ids: Sequence[int]) -> TransferFuture:
        if self._closed:
            raise ClosedError("transfer executor is closed")
        loop = self._loop
        fut: asyncio.Future[None] = loop.create_future()
        nbytes = len(block_ids) * self._layout.slot_bytes
        store = kind == "store"
        event = None
        if self._cuda is not None:

            def on_done(error: BaseException | None) -> None:
                call_soon_threadsafe_guarded(loop, resolve, fut, _wrap(kind, error))

            event = self._cuda.enqueue(store, list(block_ids), list(slot_ids), on_done)
        else:
            assert self._streams is not None
            if store:
                job = lambda: self._wrapped(kind, self._copy_store, block_ids, slot_ids)  # noqa: E731
                self._streams[0].submit(job, fut)
            else:
                job = lambda: self._wrapped(kind, self._copy_load, slot_ids, block_ids)  # noqa: E731
                self._streams[1].submit(job, fut)
        self._submitted += 1
        self._in_flight.add(fut)
        self._in_flight_bytes += nbytes
        fut.add_done_callback(lambda f: self._on_done(f, nbytes))
        return TransferFuture(fut, kind, len(block_ids), nbytes, event)

    @staticmethod
    def _wrapped(kind: str, fn: object, a: Sequence[int], b: Sequence[int]) -> None:
        try:
            fn(a, b)  # type: ignore[operator]
        except TransferError:
            raise
        except BaseException as exc:
            raise TransferError(f"{kind} copy failed: {exc!r}") from exc

    def _on_done(self, fut: asyncio.Future[None], nbytes: int) -> None:
        self._in_flight.discard(fut)
        self._in_flight_bytes -= nbytes
        if not fut.cancelled() and fut.exception() is not None:
            self._failed += 1

    def submit_store(self, block_ids: Sequence[int], slot_ids: Sequence[int]) -> TransferFuture:
        """Copy engine blocks ``block_ids[i]`` into host slots ``slot_ids[i]``."""
        return self._submit("store", block_ids, slot_ids)

    def submit_load(self, slot_ids: Sequence[int], block_ids: Sequence[int]) -> TransferFuture:
        """Copy host slots ``slot_ids[i]`` into engine blocks ``block_ids[i]``."""
        return self._submit("load", block_ids, slot_ids)

    # --------------------------------------------------------------- lifecycle
    async def drain(self) -> None:
        """Wait until every submitted copy has completed (successfully or not)."""
        while self._in_flight:
            await asyncio.wait(list(self._in_flight))

    async def aclose(self) -> None:
        """Drain, then stop the streams. Idempotent."""
        self._closed = True
        await self.drain()
        if self._streams is not None:
            for s in self._streams:
                await asyncio.to_thread(s.close)
            self._streams = None
        if self._cuda is not None:
            await asyncio.to_thread(self._cuda.close)
            self._cuda = None

    def stats(self) -> ExecutorStats:
        return ExecutorStats(
            backend=self.backend,
            in_flight=len(self._in_flight),
            in_flight_bytes=self._in_flight_bytes,
            submitted=self._submitted,
            failed=self._failed,
        )


def _wrap(kind: str, error: BaseException | None) -> BaseException | None:
    if error is None or isinstance(error, TransferError):
        return error
    wrapped = TransferError(f"{kind} copy failed: {error!r}")
    wrapped.__cause__ = error
    return wrapped
