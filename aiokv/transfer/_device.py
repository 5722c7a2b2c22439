"""The device data path, written once against the stream/event protocol of :mod:`._binding`.

Per direction (stores: engine -> host, loads: host -> engine) a :class:`_Pipe` owns one copy stream, a
preallocated staging area of ``rows`` slot-shaped rows in device memory, a device index buffer and a small
ring of pinned host index buffers, and two threads: a *submitter* that turns each coalesced batch into
device work, and a *waiter* that blocks (without spinning) on the batch's completion event and delivers
completion to the event loop. The loop thread only records ordering marks and hands batches over.

Ordering:

- A *mark* is an event recorded on the engine's compute stream at the moment ``step()`` (or ``load()``) is
  called, on the calling thread. A batch waits, on the device, for the newest mark of each compute stream
  among its jobs (a later mark on a stream covers every earlier one), so a store reads exactly the KV that
  was queued before its ``step()``, and a load writes blocks only after the kernels queued before it.
- Everything else on a pipe is ordered by its own stream: the index upload, the gather or scatter, and the
  host copies of chunk *k* all precede those of chunk *k + 1*. The single staging area and device index
  buffer are therefore reused without any host synchronization. Only the pinned host index buffers are
  written by the host; each has an event, and the submitter waits for it before writing the buffer again.

Layer-wise loads: a batch holding them is cut into parts, one per run of copies of the same layer (whole
blocks are one part), each enqueued after the previous one and followed by its own completion event, which
the waiter delivers on its own: layer *i*'s event can be waited on by the compute stream while layer *i + 1*
is still being copied. A layer's part copies that layer's bytes of each slot and scatters only its tensors.

Bounds: a batch of any size is cut into chunks of at most ``rows`` blocks (runs of consecutive slots are one
host copy each, slots sorted); device memory is allocated once, at start, and never grows.

Failures: if enqueuing fails part-way, the submitter still records the completion event after whatever was
queued (or, failing that, the waiter synchronizes the whole stream) and every job of the batch completes with
the error only after that point — nothing that was queued goes untracked.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from .._errors import DeviceError, InvalidArgumentError
from ._binding import DeviceBinding
from ._future import (
    TransferFuture,
    call_soon_threadsafe_guarded,
    fail_layers,
    skip_failed_layers,
    split_layers,
)

if TYPE_CHECKING:
    from .._layout import KVLayout

__all__ = ["DeviceBackend", "DeviceStats", "Mark"]

_RING_MIN, _RING_MAX = 4, 64  # pinned host index buffers per direction
_RING_BYTES = 1 << 20  # ... holding at most about this much (each is `rows` int64s)
_WINDOW = 1 << 16  # blocks of a layer-wise batch whose index is uploaded once for all its layers
_ANNOUNCE_S = 200e-6  # a layer-wise submission tells the loop what is queued at least this often


def _ring_size(rows: int) -> int:
    """How many chunks the submitter may run ahead of the device: each chunk's block index is written into
    its own pinned buffer, reused only once the device has read it. Many small chunks (a layer-wise load is
    one chunk per layer at least) need a deep ring, or submission waits for the copies it is queueing."""
    return max(_RING_MIN, min(_RING_MAX, _RING_BYTES // (8 * rows)))


_STOP = object()


class Mark:
    """A point in a compute stream: everything queued there before the mark was taken."""

    __slots__ = ("event", "seq", "stream")

    def __init__(self, event: Any, stream: Any, seq: int) -> None:
        self.event = event
        self.stream = stream
        self.seq = seq

    def __repr__(self) -> str:
        return f"<Mark {self.seq} on {self.stream!r}>"


@dataclass(frozen=True, slots=True)
class DeviceStats:
    """Counters of the device data path (both directions)."""

    device: str
    staging_bytes: int  # device memory held for staging and indices, allocated once
    chunk_blocks: int  # blocks per chunk (staging rows per direction)
    batches: int  # coalesced submissions handed to the streams
    chunks: int
    host_copies: int  # host <-> device copies (one per run of consecutive slots per chunk)
    marks: int  # compute-stream points recorded


def _runs(slots: Sequence[int]) -> list[tuple[int, int, int]]:
    """(first row, first slot, length) of each run of consecutive slots (``slots`` sorted)."""
    runs: list[tuple[int, int, int]] = []
    n = len(slots)
    i = 0
    while i < n:
        j = i + 1
        while j < n and slots[j] == slots[j - 1] + 1:
            j += 1
        runs.append((i, slots[i], j - i))
        i = j
    return runs


class _Pipe:
    """One direction of the device data path: a stream, its staging and its two threads."""

    def __init__(self, backend: DeviceBackend, store: bool, rows: int) -> None:
        b = backend.binding
        self._backend = backend
        self._binding = b
        self._store = store
        self._rows = rows
        name = "store" if store else "load"
        slot_bytes = backend.slot_bytes
        self.stream = b.new_stream(name)
        self._staging = b.alloc(rows * slot_bytes).view(rows, slot_bytes)
        self._index = b.alloc_index(rows)
        ring = _ring_size(rows)
        self._host_index = [b.alloc_pinned_index(rows) for _ in range(ring)]
        self._host_index_np = [t.numpy() for t in self._host_index]
        self._ring_events: list[Any] = [None] * ring
        self._ring_pos = 0
        # Jobs whose copies are queued but whose submission the loop has not heard of yet: delivered in one
        # call, at the end of a submission or before the submitter blocks (one loop wakeup, not one per part).
        self._unannounced: list[TransferFuture] = []
        self.device_bytes = rows * slot_bytes + rows * 8
        # Layer-wise loads copy the same blocks once per layer: their whole block index is uploaded once per
        # run of layers (into this window), not once per layer and chunk.
        self._window = 0
        if not store:
            # At most an eighth of the staging rows' bytes (and 64 Ki blocks): the bound stays staging_bytes.
            self._window = max(rows, min(_WINDOW, rows * slot_bytes // 64))
            self._win_index = b.alloc_index(self._window)
            self._win_host = b.alloc_pinned_index(self._window)
            self._win_np = self._win_host.numpy()
            self._win_event: Any = None
            self._win_pairs: list[tuple[int, int]] | None = None  # what the window holds now
            self.device_bytes += self._window * 8
        self.batches = 0
        self.chunks = 0
        self.host_copies = 0
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._waits: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._submitter = threading.Thread(target=self._submit_loop, name=f"aiokv-{name}-submit", daemon=True)
        self._waiter = threading.Thread(target=self._wait_loop, name=f"aiokv-{name}-wait", daemon=True)
        self._submitter.start()
        self._waiter.start()

    def put(self, jobs: list[TransferFuture]) -> None:
        self._queue.put(jobs)

    # ------------------------------------------------------------------ submitter thread
    def _submit_loop(self) -> None:
        self._binding.enter_thread()
        get = self._queue.get
        get_nowait = self._queue.get_nowait
        while True:
            jobs = get()
            stop = jobs is _STOP
            if not stop:
                # Whatever else is already queued joins this submission.
                while True:
                    try:
                        more = get_nowait()
                    except queue.Empty:
                        break
                    if more is _STOP:
                        stop = True
                        break
                    jobs = jobs + more
                self._submit(jobs)
            if stop:
                self._waits.put(_STOP)
                return

    def _submit(self, jobs: list[TransferFuture]) -> None:
        marks_error: BaseException | None = None
        try:
            self._order_after_marks(jobs)
        except BaseException as exc:  # nothing of this batch may run unordered: every part fails
            marks_error = exc
        # Whole-block copies are one part; a layer-wise load is one part per layer, in layer order, each with
        # its own completion event, so the engine's compute stream can wait for one layer at a time.
        try:
            parts = split_layers(jobs)
            last = time.perf_counter()
            for k, part in enumerate(parts):
                self._submit_part(part, marks_error)
                # The first layer at once (an engine orders its first layer after it); the rest in one call,
                # unless submitting takes long enough for a wakeup per part not to matter.
                if (k == 0 and len(parts) > 1) or time.perf_counter() - last >= _ANNOUNCE_S:
                    self._announce()
                    last = time.perf_counter()
        finally:
            self._announce()

    def _announce(self) -> None:
        jobs, self._unannounced = self._unannounced, []
        if jobs:
            call_soon_threadsafe_guarded(self._backend.loop, _set_submitted, jobs)

    def _submit_part(self, jobs: list[TransferFuture], error: BaseException | None) -> None:
        b = self._binding
        live = skip_failed_layers(jobs)  # the later layers of a load that lost one are not copied
        if error is None and live:
            try:
                pairs = sorted(
                    (s, blk) for job in live for s, blk in zip(job.slot_ids, job.block_ids, strict=True)
                )
                layer = jobs[0].layer
                window = layer is not None and len(pairs) <= self._window
                if window:
                    self._load_window(pairs)
                for start in range(0, len(pairs), self._rows):
                    chunk = pairs[start : start + self._rows]
                    self._chunk(chunk, layer, self._win_index[start : start + len(chunk)] if window else None)
            except BaseException as exc:
                error = exc
        if error is not None:
            fail_layers(live)
        done: Any = None
        try:
            done = b.new_event(blocking=True)
            b.record(done, self.stream)
        except BaseException as exc:
            done = None
            error = error or exc
        self.batches += 1
        for job in jobs:
            job.event = done
        if done is not None:
            self._unannounced.extend(jobs)
        self._waits.put((done, jobs, error))

    def _order_after_marks(self, jobs: list[TransferFuture]) -> None:
        newest: dict[int, Mark] = {}
        for job in jobs:
            m = job.mark
            if m is not None:
                key = id(m.stream)
                cur = newest.get(key)
                if cur is None or m.seq > cur.seq:
                    newest[key] = m
        for m in newest.values():
            self._binding.wait_event(self.stream, m.event)

    def _load_window(self, pairs: list[tuple[int, int]]) -> None:
        """Make the window hold ``pairs``' block ids (already there for the next layer of the same blocks)."""
        if pairs == self._win_pairs:
            return
        b = self._binding
        ev = self._win_event
        if ev is not None:
            if self._unannounced and not b.query(ev):
                self._announce()
            b.synchronize(ev)  # the device has read the window's previous contents
        else:
            ev = self._win_event = b.new_event(blocking=True)
        n = len(pairs)
        self._win_pairs = None  # until the upload below is queued
        self._win_np[:n] = [p[1] for p in pairs]
        b.copy(self.stream, self._win_index[:n], self._win_host[:n])
        b.record(ev, self.stream)
        self._win_pairs = pairs

    def _chunk(self, pairs: list[tuple[int, int]], layer: int | None = None, index: Any = None) -> None:
        b = self._binding
        n = len(pairs)
        slots = [p[0] for p in pairs]
        if index is not None:  # a layer-wise chunk: its block index is in the window already
            self._copy_layer(pairs, slots, layer, index)
            return
        pos = self._ring_pos
        self._ring_pos = (pos + 1) % len(self._host_index)
        ev = self._ring_events[pos]
        if ev is not None:
            if self._unannounced and not b.query(ev):
                self._announce()  # about to wait for the device: let the loop order work after what is queued
            b.synchronize(ev)  # the device has read this buffer's previous contents
        else:
            ev = self._ring_events[pos] = b.new_event(blocking=True)
        self._host_index_np[pos][:n] = [p[1] for p in pairs]
        index = self._index[:n]
        b.copy(self.stream, index, self._host_index[pos][:n])
        b.record(ev, self.stream)
        rows = self._staging[:n]
        host = self._backend.host2d
        if layer is not None:
            self._copy_layer(pairs, slots, layer, index)
            return
        runs = _runs(slots)
        if self._store:
            self._backend.copier.gather(self.stream, index, rows)
            for i, s, k in runs:
                b.copy(self.stream, host[s : s + k], rows[i : i + k])
        else:
            for i, s, k in runs:
                b.copy(self.stream, rows[i : i + k], host[s : s + k])
            self._backend.copier.scatter(self.stream, index, rows)
        self.chunks += 1
        self.host_copies += len(runs)

    def _copy_layer(
        self, pairs: list[tuple[int, int]], slots: list[int], layer: int | None, index: Any
    ) -> None:
        """One layer of each block: that layer's bytes of each run of consecutive slots (one strided copy per
        run: a layer of consecutive slots is not contiguous in the host buffer), then that layer's tensors
        scattered from the staging rows."""
        if self._store or layer is None:
            raise InvalidArgumentError("layer-wise copies are loads of one layer")
        b = self._binding
        rows = self._staging[: len(pairs)]
        host = self._backend.host2d
        lo, hi = self._backend.layout.layer_span(layer)
        runs = _runs(slots)
        for i, s, k in runs:
            b.copy_rows(self.stream, rows[i : i + k, lo:hi], host[s : s + k, lo:hi])
        self._backend.copier.scatter(self.stream, index, rows, layer=layer)
        self.chunks += 1
        self.host_copies += len(runs)

    # ------------------------------------------------------------------ waiter thread
    def _wait_loop(self) -> None:
        b = self._binding
        b.enter_thread()
        complete = self._backend.complete
        loop = self._backend.loop
        get, get_nowait = self._waits.get, self._waits.get_nowait
        item = get()
        while True:
            if item is _STOP:
                return
            # This part's completion, and those of the parts queued after it that have already completed by
            # then (the later layers of a fast copy): delivered to the loop in one call.
            finished: list[TransferFuture] = []
            while True:
                done, jobs, error = item
                try:
                    if done is not None:
                        b.synchronize(done)
                    else:  # nothing marks the end of what was queued: wait for the whole stream
                        b.synchronize_stream(self.stream)
                except BaseException as exc:
                    error = error or exc
                if error is not None:
                    for job in jobs:
                        if job._error is None:  # a skipped layer keeps its own reason
                            job._error = error
                finished.extend(jobs)
                try:
                    item = get_nowait()
                except queue.Empty:
                    item = None
                    break
                if item is _STOP or item[0] is None or not _query(b, item[0]):
                    break
            call_soon_threadsafe_guarded(loop, complete, finished)
            if item is None:
                item = get()

    def close(self) -> None:
        self._queue.put(_STOP)
        self._submitter.join(timeout=30)
        self._waiter.join(timeout=30)


def _query(b: DeviceBinding, event: Any) -> bool:
    try:
        return bool(b.query(event))
    except BaseException:
        return False  # the blocking synchronize reports it


def _set_submitted(jobs: list[TransferFuture]) -> None:
    for job in jobs:
        job._set_submitted()


class DeviceBackend:
    """Copies between a device layout's engine blocks and pinned host slots (see the module docstring)."""

    def __init__(
        self,
        binding: DeviceBinding,
        layout: KVLayout,
        host: torch.Tensor,
        loop: asyncio.AbstractEventLoop,
        complete: Callable[[list[TransferFuture]], None],
        *,
        staging_bytes: int,
        compute_stream: Any = None,
    ) -> None:
        slot_bytes = layout.slot_bytes
        rows = staging_bytes // (2 * slot_bytes)
        if rows < 1:
            raise InvalidArgumentError(
                f"staging_bytes must hold at least one block per direction (2 x {slot_bytes} bytes),"
                f" got {staging_bytes}"
            )
        if not binding.is_pinned(host):
            raise InvalidArgumentError(
                "the host buffer of a device layout must be pinned: an unpinned buffer makes every"
                " asynchronous copy synchronous on the calling thread"
            )
        self.binding = binding
        self.layout = layout
        self.loop = loop
        self.complete = complete
        self.slot_bytes = slot_bytes
        self.host2d = host.view(-1, slot_bytes)
        self.copier = binding.block_copier(layout)
        self._compute = compute_stream
        self._seq = 0
        self.rows = rows
        self._pipes = (_Pipe(self, True, rows), _Pipe(self, False, rows))

    # ------------------------------------------------------------------ loop thread
    def mark(self, stream: Any = None) -> Mark:
        """Record the current point of the compute stream (``stream``, else the configured compute stream,
        else the calling thread's current stream). Refused while that stream is being captured."""
        b = self.binding
        s = stream if stream is not None else self._compute
        if s is None:
            s = b.current_stream()
        if b.is_capturing(s):
            raise DeviceError(
                "the compute stream is being captured into a graph: call step()/load()/finish() after the"
                " capture ends (after launching the graph's replay), never during capture"
            )
        ev = b.new_event()
        b.record(ev, s)
        self._seq += 1
        return Mark(ev, s, self._seq)

    @property
    def compute_stream(self) -> Any:
        return self._compute if self._compute is not None else self.binding.current_stream()

    def submit(self, store: bool, jobs: list[TransferFuture]) -> None:
        self._pipes[0 if store else 1].put(jobs)

    def close(self) -> None:
        for p in self._pipes:
            p.close()

    def stats(self) -> DeviceStats:
        return DeviceStats(
            device=self.binding.describe(),
            staging_bytes=sum(p.device_bytes for p in self._pipes),
            chunk_blocks=self.rows,
            batches=sum(p.batches for p in self._pipes),
            chunks=sum(p.chunks for p in self._pipes),
            host_copies=sum(p.host_copies for p in self._pipes),
            marks=self._seq,
        )
