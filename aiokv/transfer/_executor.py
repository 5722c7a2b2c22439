"""The transfer executor: engine blocks <-> host slots, on ordered streams, returning TransferFutures."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .._errors import ClosedError, TransferError
from .._layout import KVLayout
from ._cpu import GATHER_GROUP, SCATTER_GROUP, CPUStream, copy_segments
from ._future import TransferFuture, call_soon_threadsafe_guarded

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

    def __init__(
        self,
        layout: KVLayout,
        host: torch.Tensor,
        loop: asyncio.AbstractEventLoop,
        *,
        compute_stream: Any = None,
    ) -> None:
        if host.dtype != torch.uint8 or host.dim() != 1 or not host.is_contiguous():
            raise ValueError("host buffer must be a contiguous 1-d uint8 tensor")
        self._layout = layout
        self._host = host
        self._host_addr = host.data_ptr()
        self._loop = loop
        self._closed = False
        self._in_flight: set[TransferFuture] = set()
        self._in_flight_bytes = 0
        self._submitted = 0
        self._failed = 0
        self.backend = "cuda" if layout.is_cuda else "cpu"
        if layout.is_cuda:
            from .._cuda import CudaTransferBackend

            self._cuda: CudaTransferBackend | None = CudaTransferBackend(layout, host, compute_stream)
            self._streams: tuple[CPUStream, CPUStream] | None = None
        else:
            self._cuda = None
            self._streams = (
                CPUStream(loop, "store", self._run_store, self._complete_batch),
                CPUStream(loop, "load", self._run_load, self._complete_batch),
            )

    # ------------------------------------------------------------------ copies
    def _copy_store(self, block_ids: Sequence[int], slot_ids: Sequence[int]) -> None:
        """Runs on the store worker thread (CPU backend)."""
        engine, host, nbytes = self._layout.copy_plan(block_ids, slot_ids, self._host_addr)
        copy_segments(host, engine, nbytes, GATHER_GROUP)

    def _copy_load(self, slot_ids: Sequence[int], block_ids: Sequence[int]) -> None:
        """Runs on the load worker thread (CPU backend)."""
        engine, host, nbytes = self._layout.copy_plan(block_ids, slot_ids, self._host_addr)
        copy_segments(engine, host, nbytes, SCATTER_GROUP)

    def _run_store(self, job: _Job) -> None:
        try:
            self._copy_store(job.block_ids, job.slot_ids)
        except BaseException as exc:
            raise _transfer_error("store", exc) from exc

    def _run_load(self, job: _Job) -> None:
        try:
            self._copy_load(job.slot_ids, job.block_ids)
        except BaseException as exc:
            raise _transfer_error("load", exc) from exc

    def _complete_batch(self, batch: list[_Job]) -> None:
        """Loop thread: account for finished copies, then complete their futures (callbacks run in order)."""
        in_flight = self._in_flight
        for job in batch:
            tf = job.future
            assert tf is not None, "a job completed before its future was attached"
            in_flight.discard(tf)
            self._in_flight_bytes -= tf.nbytes
            if job._error is not None:
                tf._error = _transfer_error(tf.kind, job._error)
                self._failed += 1
            tf._complete()

    def _submit(self, kind: str, block_ids: Sequence[int], slot_ids: Sequence[int]) -> TransferFuture:
        if self._closed:
            raise ClosedError("transfer executor is closed")
        job = _Job(block_ids, slot_ids)
        event = None
        if self._cuda is not None:
            loop = self._loop

            def on_done(error: BaseException | None) -> None:  # CUDA waiter thread
                job._error = error
                call_soon_threadsafe_guarded(loop, self._complete_batch, [job])

            event = self._cuda.enqueue(kind == "store", list(block_ids), list(slot_ids), on_done)
        else:
            assert self._streams is not None
            self._streams[0 if kind == "store" else 1].submit(job)
        # The copy is on its stream: only now does its future exist. Completion is delivered through the loop,
        # which cannot run before this method returns, so attaching the future here cannot race.
        tf = TransferFuture(self._loop, kind, block_ids, slot_ids, len(block_ids) * self._layout.slot_bytes)
        tf.event = event
        job.future = tf
        self._submitted += 1
        self._in_flight.add(tf)
        self._in_flight_bytes += tf.nbytes
        return tf

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
            tf = next(iter(self._in_flight))
            with contextlib.suppress(TransferError):
                await tf

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


class _Job:
    """What a stream executes; its TransferFuture is attached once the job is queued."""

    __slots__ = ("_error", "block_ids", "future", "slot_ids")

    def __init__(self, block_ids: Sequence[int], slot_ids: Sequence[int]) -> None:
        self.block_ids = block_ids
        self.slot_ids = slot_ids
        self.future: TransferFuture | None = None
        self._error: BaseException | None = None  # set by the worker thread


def _transfer_error(kind: str, error: BaseException) -> TransferError:
    if isinstance(error, TransferError):
        return error
    wrapped = TransferError(f"{kind} copy failed: {error!r}")
    wrapped.__cause__ = error
    return wrapped
