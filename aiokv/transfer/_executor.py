"""The transfer executor: engine blocks <-> host slots, on ordered streams, returning TransferFutures."""

from __future__ import annotations

import asyncio
import contextlib
import operator
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .._errors import BlockRangeError, ClosedError, InvalidArgumentError, InvalidTypeError, TransferError
from .._layout import KVLayout
from ._binding import DeviceBinding
from ._cpu import SCATTER_GROUP, CopyPlanner, CopyPool, CPUStream, GroupTuner, copy_segments
from ._device import DeviceBackend, DeviceStats, Mark
from ._future import (
    LayeredTransfer,
    LayerGroup,
    LayerSkipped,
    TransferFuture,
    fail_layers,
    skip_failed_layers,
    split_layers,
)

__all__ = ["DEFAULT_STAGING_BYTES", "ExecutorStats", "TransferExecutor"]

DEFAULT_STAGING_BYTES = 256 << 20


@dataclass(frozen=True, slots=True)
class ExecutorStats:
    backend: str  # "cpu", "cuda" or "sim"
    in_flight: int
    in_flight_bytes: int
    submitted: int  # TransferFutures created
    failed: int
    batches: int = 0  # coalesced submissions handed to the streams (one per direction per loop tick at most)
    copy_threads: int = 1  # CPU backend: threads one large copy is split over
    device: DeviceStats | None = None  # device backends: staging memory, chunks, marks


def _default_copy_threads() -> int:
    return max(
        1, min(4, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)
    )


class TransferExecutor:
    """Copies between the engine's KV tensors and a host buffer of ``slot_bytes``-sized slots.

    Two FIFO streams, one per direction (stores: engine -> host, loads: host -> engine). ``submit_*`` accepts
    a copy and returns its :class:`TransferFuture`; everything accepted in one loop tick in one direction is
    handed to its stream as one submission at the end of the tick.

    Backends: a CPU layout without a device copies with a GIL-free C kernel on a worker thread per direction
    (large batches split over ``copy_threads``). A device layout (CUDA, or any layout with ``device=`` a
    :class:`~aiokv.transfer.SimulatedDevice`) goes through :class:`~aiokv.transfer._device.DeviceBackend`:
    per-direction streams ordered after compute-stream *marks*, a fixed staging area of ``staging_bytes``,
    blocking completion events.
    """

    def __init__(
        self,
        layout: KVLayout,
        host: torch.Tensor,
        loop: asyncio.AbstractEventLoop,
        *,
        device: DeviceBinding | None = None,
        compute_stream: Any = None,
        staging_bytes: int = DEFAULT_STAGING_BYTES,
        copy_threads: int | None = None,
    ) -> None:
        if host.dtype != torch.uint8 or host.dim() != 1 or not host.is_contiguous():
            raise InvalidArgumentError("host buffer must be a contiguous 1-d uint8 tensor")
        slot_bytes = layout.slot_bytes
        if host.numel() < slot_bytes:
            raise InvalidArgumentError(f"host buffer must hold at least one slot of {slot_bytes} bytes")
        if isinstance(staging_bytes, bool) or not isinstance(staging_bytes, int):
            raise InvalidTypeError(f"staging_bytes must be an int, got {type(staging_bytes).__name__}")
        if copy_threads is not None and (
            isinstance(copy_threads, bool) or not isinstance(copy_threads, int) or copy_threads < 1
        ):
            raise InvalidArgumentError(f"copy_threads must be an int >= 1, got {copy_threads!r}")
        if device is None and layout.is_cuda:
            from ._cuda import CudaDevice

            device = CudaDevice(layout.device)
        self._layout = layout
        self._host = host
        self._host_addr = host.data_ptr()
        self._num_slots = host.numel() // slot_bytes
        self._loop = loop
        self._closed = False
        self._in_flight: set[TransferFuture] = set()
        self._in_flight_bytes = 0
        self._submitted = 0
        self._failed = 0
        self._batches = 0
        self._pending: tuple[list[TransferFuture], list[TransferFuture]] = ([], [])
        self._flush_scheduled = False
        self._before_flush: list[Callable[[], None]] = []  # see before_flush()
        self._device: DeviceBinding | None = device
        self._dev: DeviceBackend | None = None
        self._streams: tuple[CPUStream, CPUStream] | None = None
        self._pool: CopyPool | None = None
        self._copy_threads = 1
        if device is not None:
            self.backend = device.kind
            self._dev = DeviceBackend(
                device,
                layout,
                host,
                loop,
                self._complete_batch,
                staging_bytes=staging_bytes,
                compute_stream=compute_stream,
            )
        else:
            self.backend = "cpu"
            self._copy_threads = copy_threads if copy_threads is not None else _default_copy_threads()
            self._pool = CopyPool(self._copy_threads) if self._copy_threads > 1 else None
            self._planner = CopyPlanner(layout, host)  # checked buffers + offsets for the copy kernel
            self._gather_tuner = GroupTuner()
            self._streams = (
                CPUStream(loop, "store", self._run_store, self._complete_batch),
                CPUStream(loop, "load", self._run_load, self._complete_batch, split=split_layers),
            )

    @property
    def device(self) -> DeviceBinding | None:
        """The device binding (CUDA or simulated), ``None`` on the CPU backend."""
        return self._device

    @property
    def compute_stream(self) -> Any:
        """The stream marks are taken on by default (device backends)."""
        return self._dev.compute_stream if self._dev is not None else None

    # ------------------------------------------------------------------ ordering marks
    def mark(self, stream: Any = None) -> Mark | None:
        """Device backends: record the compute stream's current point; copies submitted with ``after=`` that
        mark wait for it on the device. ``None`` on the CPU backend (the host already ordered everything)."""
        if self._dev is None:
            return None
        return self._dev.mark(stream)

    # ------------------------------------------------------------------ CPU copies
    def _copy_store(self, block_ids: Sequence[int], slot_ids: Sequence[int]) -> None:
        """Runs on the store worker thread (CPU backend). The pairs in any order: copied in slot order."""
        engine, host, nbytes = self._planner.plan(block_ids, slot_ids, slot_order=True)
        tuner = self._gather_tuner
        best = tuner.best
        trial = tuner.trial(len(block_ids) * self._layout.slot_bytes)
        if trial is None:
            self._copy(host, engine, nbytes, best)
            return
        # Two equal prefixes on this thread, one with the candidate and one with the best group, copied the
        # way the whole batch is (streaming stores) while the helpers copy the rest: the conditions the
        # choice is for. (Timing a lone, non-streaming 2 MiB memcpy ranked the groups at random.)
        cuts = np.searchsorted(np.cumsum(nbytes), [tuner.sample_bytes, 2 * tuner.sample_bytes])
        a, b = int(cuts[0]) + 1, int(cuts[1]) + 1

        # The first prefix starts cold (the helpers start at the same moment): alternate which group goes first.
        order = (trial, best) if tuner.trials % 2 else (best, trial)

        def measure() -> None:
            cost = {}
            for group, lo, hi in ((order[0], 0, a), (order[1], a, b)):
                t0 = time.perf_counter()
                copy_segments(host[lo:hi], engine[lo:hi], nbytes[lo:hi], group, stream=True)
                cost[group] = (time.perf_counter() - t0) / max(1, int(nbytes[lo:hi].sum()))
            tuner.record(trial, cost[trial], cost[best])

        if len(nbytes) <= b:
            measure()
        elif self._pool is not None:
            self._pool.copy(host[b:], engine[b:], nbytes[b:], best, first=measure)
        else:
            measure()
            copy_segments(host[b:], engine[b:], nbytes[b:], best)

    def _copy_load(self, slot_ids: Sequence[int], block_ids: Sequence[int], layer: int | None = None) -> None:
        """Runs on the load worker thread (CPU backend). The pairs in any order: copied in slot order.
        ``layer``: only that layer of each block (a layer-wise load)."""
        engine, host, nbytes = self._planner.plan(block_ids, slot_ids, slot_order=True, layer=layer)
        self._copy(engine, host, nbytes, SCATTER_GROUP)

    def _copy(self, dst: Any, src: Any, nbytes: Any, group: int) -> None:
        if self._pool is not None:
            self._pool.copy(dst, src, nbytes, group)
        else:
            copy_segments(dst, src, nbytes, group)

    @staticmethod
    def _merged(batch: list[TransferFuture]) -> tuple[Sequence[int], Sequence[int]]:
        """The whole batch's (block ids, slot ids), in submission order: one copy, planned in slot order (the
        host side sequential) by the copy planner (``slot_order=True``)."""
        if len(batch) == 1:
            tf = batch[0]
            return tf.block_ids, tf.slot_ids
        blocks: list[int] = []
        slots: list[int] = []
        for tf in batch:
            blocks.extend(tf.block_ids)
            slots.extend(tf.slot_ids)
        return blocks, slots

    def _run_store(self, batch: list[TransferFuture]) -> None:
        try:
            blocks, slots = self._merged(batch)
            self._copy_store(blocks, slots)
        except BaseException as exc:
            raise _transfer_error("store", exc) from exc

    def _run_load(self, batch: list[TransferFuture]) -> None:
        # One layer of layer-wise loads, or whole blocks: the stream splits its batches that way
        # (split_layers), so each part completes as soon as its own copy is done. The later layers of a load
        # that lost a layer are not copied (skip_failed_layers): their futures fail without a copy.
        live = skip_failed_layers(batch)
        if not live:
            return
        try:
            blocks, slots = self._merged(live)
            layer = live[0].layer
            if layer is None:
                self._copy_load(slots, blocks)
            else:
                self._copy_load(slots, blocks, layer)
        except BaseException as exc:
            fail_layers(live)
            error = _transfer_error("load", exc)
            for tf in live:  # not the skipped ones: they keep their own reason
                tf._error = error

    # ------------------------------------------------------------------ completion
    def _complete_batch(self, batch: list[TransferFuture]) -> None:
        """Loop thread: account for finished copies, then complete their futures (callbacks run in order)."""
        in_flight = self._in_flight
        for tf in batch:
            in_flight.discard(tf)
            self._in_flight_bytes -= tf.nbytes
            if tf._error is not None:
                if not isinstance(tf._error, LayerSkipped):  # counted once, as the layer that failed
                    self._failed += 1
                tf._error = _transfer_error(tf.kind, tf._error)
            tf._complete()

    # ------------------------------------------------------------------ submission
    def _submit(
        self,
        kind: str,
        block_ids: list[int],
        slot_ids: list[int],
        mark: Mark | None = None,
        *,
        join: TransferFuture | None = None,
    ) -> TransferFuture:
        """Accept a copy (arguments already validated, lists the executor may keep). Loop thread only.

        ``join``: a copy returned earlier by this method; when it is still waiting for this tick's flush (same
        kind, same mark), the blocks are added to it and it is returned, so a tick's stores from many requests
        complete as one future (they are one copy on the stream anyway, and share its outcome)."""
        if self._closed:
            raise ClosedError("transfer executor is closed")
        if join is not None and join.mark is mark:
            pending = self._pending[0 if kind == "store" else 1]
            if pending and pending[-1] is join:
                n = len(block_ids)
                nbytes = n * self._layout.slot_bytes
                join.block_ids.extend(block_ids)  # type: ignore[attr-defined]
                join.slot_ids.extend(slot_ids)  # type: ignore[attr-defined]
                join.num_blocks += n
                join.nbytes += nbytes
                self._in_flight_bytes += nbytes
                self._submitted += 1
                return join
        tf = TransferFuture(
            self._loop,
            kind,
            block_ids,
            slot_ids,
            len(block_ids) * self._layout.slot_bytes,
            device=self._device,
            mark=mark,
        )
        self._pending[0 if kind == "store" else 1].append(tf)
        if not self._flush_scheduled:
            self._flush_scheduled = True
            self._loop.call_soon(self._flush)
        self._submitted += 1
        self._in_flight.add(tf)
        self._in_flight_bytes += tf.nbytes
        return tf

    def _submit_layers(
        self, block_ids: list[int], slot_ids: list[int], mark: Mark | None = None
    ) -> LayeredTransfer:
        """Accept a layer-wise load: one copy per layer of the layout (:attr:`KVLayout.layers`), queued in
        layer order, each completing on its own. Loop thread only; arguments already validated."""
        layout = self._layout
        if not layout.layers:
            raise InvalidArgumentError(
                "layer-wise loads need a plain KVLayout (a grouped layout's units are not split by layer)"
            )
        if self._closed:
            raise ClosedError("transfer executor is closed")
        n = len(block_ids)
        jobs = []
        group = LayerGroup()
        for layer in range(layout.num_layers):
            lo, hi = layout.layer_span(layer)
            jobs.append(
                TransferFuture(
                    self._loop,
                    "load",
                    block_ids,
                    slot_ids,
                    n * (hi - lo),
                    device=self._device,
                    mark=mark,
                    layer=layer,
                )
            )
        for tf in jobs:
            tf.group = group
        pending = self._pending[1]
        pending.extend(jobs)
        if not self._flush_scheduled:
            self._flush_scheduled = True
            self._loop.call_soon(self._flush)
        self._submitted += 1
        for tf in jobs:
            self._in_flight.add(tf)
            self._in_flight_bytes += tf.nbytes
        return LayeredTransfer(self._loop, jobs)

    def before_flush(self, hook: Callable[[], None]) -> None:
        """Register ``hook``, called on the loop thread at the start of every tick's flush and of
        :meth:`drain`: a producer that gathers work during a tick (the offloader's decode stores) submits it
        there, so it joins the tick's submission and nothing can drain before it is submitted. Loop thread."""
        self._before_flush.append(hook)

    def schedule_flush(self) -> None:
        """Make sure this tick ends with a flush (which runs the :meth:`before_flush` hooks). Loop thread."""
        if not self._flush_scheduled:
            self._flush_scheduled = True
            self._loop.call_soon(self._flush)

    def _run_hooks(self) -> None:
        # A failing hook must not stop the flush (the tick's copies would never be submitted, and every later
        # one would wait behind a flush that never comes): it is reported like any loop callback's error.
        for hook in self._before_flush:
            try:
                hook()
            except Exception as exc:
                self._loop.call_exception_handler(
                    {"message": f"aiokv: transfer executor flush hook {hook!r} failed", "exception": exc}
                )

    def _flush(self) -> None:
        """End of the tick: hand each direction's accepted copies to its stream as one submission."""
        # Hooks first, while _flush_scheduled is still set: what they submit joins this flush.
        self._run_hooks()
        self._flush_scheduled = False
        stores, loads = self._pending
        self._pending = ([], [])
        if loads and any(tf.layer is not None for tf in loads):
            # Layer-wise loads of several requests: every request's layer 0 first, then layer 1, ... (whole
            # loads ahead of them), so the engine's forward, which waits layer by layer for the whole batch,
            # gets each layer as early as it can. Loads of one tick write disjoint engine blocks.
            loads.sort(key=_layer_key)
        for store, jobs in ((True, stores), (False, loads)):
            if not jobs:
                continue
            self._batches += 1
            try:
                if self._dev is not None:
                    self._dev.submit(store, jobs)
                else:
                    assert self._streams is not None
                    self._streams[0 if store else 1].submit(jobs)
                    for tf in jobs:
                        tf._set_submitted()
            except BaseException as exc:  # nothing of this batch reached a stream: report it failed now
                for tf in jobs:
                    tf._error = exc
                self._complete_batch(jobs)

    def submit_store(
        self, block_ids: Sequence[int], slot_ids: Sequence[int], *, after: Mark | None = None
    ) -> TransferFuture:
        """Copy engine blocks ``block_ids[i]`` into host slots ``slot_ids[i]``.

        On a device backend the copy waits for ``after`` (a :meth:`mark`), or for the compute stream's point
        at this call when ``after`` is ``None``."""
        ids, slots = self._check(block_ids, slot_ids)
        return self._submit("store", ids, slots, after if after is not None else self.mark())

    def submit_load(
        self, slot_ids: Sequence[int], block_ids: Sequence[int], *, after: Mark | None = None
    ) -> TransferFuture:
        """Copy host slots ``slot_ids[i]`` into engine blocks ``block_ids[i]`` (ordered like submit_store)."""
        ids, slots = self._check(block_ids, slot_ids)
        return self._submit("load", ids, slots, after if after is not None else self.mark())

    def submit_load_layers(
        self, slot_ids: Sequence[int], block_ids: Sequence[int], *, after: Mark | None = None
    ) -> LayeredTransfer:
        """:meth:`submit_load`, layer by layer: one :class:`TransferFuture` per layer of the layout
        (``result.layers[i]``), copied in layer order on the load stream, each completing (and, on a device,
        recording its event) as soon as its own copy is done, so an engine can start a layer's attention
        while the later layers are still being copied."""
        ids, slots = self._check(block_ids, slot_ids)
        return self._submit_layers(ids, slots, after if after is not None else self.mark())

    def _check(self, block_ids: Sequence[int], slot_ids: Sequence[int]) -> tuple[list[int], list[int]]:
        if self._closed:
            raise ClosedError("transfer executor is closed")
        ids = self._layout.check_block_ids(block_ids, "block_ids")
        if isinstance(slot_ids, (str, bytes)):
            raise InvalidTypeError(f"slot_ids must be a sequence of ints, got {type(slot_ids).__name__}")
        slots: list[int] = []
        for raw in slot_ids:
            try:
                if isinstance(raw, bool):
                    raise TypeError
                s = operator.index(raw)
            except TypeError:
                raise InvalidTypeError(f"slot_ids must contain ints, got {raw!r}") from None
            if s < 0 or s >= self._num_slots:
                raise BlockRangeError(f"slot_ids must be in [0, {self._num_slots}), got {s}")
            slots.append(s)
        if len(slots) != len(ids):
            raise InvalidArgumentError(
                f"slot_ids must have one slot per block, got {len(slots)} slots for {len(ids)} blocks"
            )
        if not ids:
            raise InvalidArgumentError("block_ids must not be empty")
        if len(set(slots)) != len(slots):
            raise InvalidArgumentError(f"slot_ids must not contain duplicates, got {slots}")
        return ids, slots

    # --------------------------------------------------------------- lifecycle
    async def wait_submitted(self) -> None:
        """Wait until every copy accepted so far is on its stream (not necessarily complete)."""
        for tf in list(self._in_flight):
            await tf.wait_submitted()

    async def drain(self) -> None:
        """Wait until every submitted copy has completed (successfully or not); work a :meth:`before_flush`
        hook holds is submitted first."""
        self._run_hooks()
        while self._in_flight:
            tf = next(iter(self._in_flight))
            with contextlib.suppress(TransferError):
                await tf

    async def aclose(self) -> None:
        """Drain, then stop the streams. Idempotent; a cancelled close can be retried."""
        self._closed = True
        await self.drain()
        if self._streams is not None:
            for s in self._streams:
                await asyncio.to_thread(s.close)
            self._streams = None
        if self._pool is not None:
            await asyncio.to_thread(self._pool.close)
            self._pool = None
        if self._dev is not None:
            await asyncio.to_thread(self._dev.close)
            self._dev = None

    def stats(self) -> ExecutorStats:
        return ExecutorStats(
            backend=self.backend,
            in_flight=len(self._in_flight),
            in_flight_bytes=self._in_flight_bytes,
            submitted=self._submitted,
            failed=self._failed,
            batches=self._batches,
            copy_threads=self._copy_threads,
            device=self._dev.stats() if self._dev is not None else None,
        )

    def __repr__(self) -> str:
        return f"<TransferExecutor {self.backend} in_flight={len(self._in_flight)}>"


def _layer_key(tf: TransferFuture) -> int:
    return -1 if tf.layer is None else tf.layer


def _transfer_error(kind: str, error: BaseException) -> TransferError:
    if isinstance(error, TransferError):
        return error
    wrapped = TransferError(f"{kind} copy failed: {error!r}")
    wrapped.__cause__ = error
    return wrapped
