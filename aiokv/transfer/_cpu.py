"""Ordered worker-thread "streams" for the CPU backend, and the native copy kernel (over checked buffers)."""

from __future__ import annotations

import asyncio
import os
import queue
import statistics
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from ._future import call_soon_threadsafe_guarded

__all__ = [
    "GATHER_GROUP",
    "GATHER_GROUPS",
    "HAVE_NATIVE",
    "SCATTER_GROUP",
    "CPUStream",
    "CopyPlanner",
    "CopyPool",
    "GroupTuner",
    "Segments",
    "copy_segments",
    "tensor_bytes",
]

try:
    from .._native._copy import CopyJob as _CopyJob
    from .._native._copy import copy_segments as _native_copy
    from .._native._copy import plan_blocks as _native_plan

    HAVE_NATIVE = True
except ImportError:  # pragma: no cover - exercised only without a C compiler
    _native_copy = None  # type: ignore[assignment]
    _CopyJob = None  # type: ignore[assignment,misc]
    _native_plan = None  # type: ignore[assignment]
    HAVE_NATIVE = False
if os.environ.get("AIOKV_NATIVE_COPY", "1") == "0":  # the checked Python copy (to compare, or to rule C out)
    _native_copy = None  # type: ignore[assignment]
    _CopyJob = None  # type: ignore[assignment,misc]
    _native_plan = None  # type: ignore[assignment]
    HAVE_NATIVE = False

Int64Array = npt.NDArray[np.int64]
_MAX_GROUP = 16  # the kernel's limit on interleaved runs (MAX_GROUP in _copy.c)


def tensor_bytes(t: torch.Tensor, start: int = 0, length: int | None = None) -> npt.NDArray[np.uint8]:
    """A writable uint8 array over bytes ``[start, start + length)`` of CPU tensor ``t``'s storage (no copy;
    default: the bytes ``t`` spans). The array holds the storage, so the memory outlives every copy that uses
    it; its length comes from the storage, so the copy kernel checks offsets against memory that is there."""
    if t.device.type != "cpu":
        raise ValueError(f"the copy kernel reads and writes CPU memory only, got a tensor on {t.device}")
    storage = t.untyped_storage()
    if length is None:
        start = int(t.storage_offset()) * t.element_size()
        length = _span(t)
    if start < 0 or length < 0 or start + length > storage.nbytes():
        raise ValueError(
            f"bytes [{start}, {start + length}) are outside the tensor's storage ({storage.nbytes()} bytes)"
        )
    view = torch.empty(0, dtype=torch.uint8).set_(storage, start, (length,), (1,))
    out: npt.NDArray[np.uint8] = view.numpy()
    return out


def _span(t: torch.Tensor) -> int:
    """Bytes from ``t``'s first element to the end of its last (strides are never negative in torch)."""
    if t.numel() == 0:
        return 0
    return (sum((n - 1) * st for n, st in zip(t.shape, t.stride(), strict=True)) + 1) * t.element_size()


class Segments:
    """One side of a segment copy, as the kernel takes it: ``buffers`` (writable uint8 arrays), which buffer
    each segment is in (``index``; ``None``: all in buffer 0) and each segment's byte offset in it. Slicing
    selects segments. The kernel checks every (offset, length) against its buffer before copying."""

    __slots__ = ("buffers", "index", "offsets")

    def __init__(
        self, buffers: tuple[Any, ...], offsets: Int64Array, index: Int64Array | None = None
    ) -> None:
        self.buffers = buffers
        self.offsets = offsets
        self.index = index

    def __len__(self) -> int:
        return len(self.offsets)

    def __getitem__(self, sl: slice) -> Segments:
        return Segments(self.buffers, self.offsets[sl], None if self.index is None else self.index[sl])


class CopyPlanner:
    """A layout's copy plans as :class:`Segments` over checked buffers: the engine side over the memory the
    layout's tensors span (one buffer per disjoint range of a storage), the host side over a host tensor.

    Why addresses still appear here: the layouts plan copies as addresses (``KVLayout.copy_plan``, and the
    grouped layouts' per-unit plans), the one definition of where a block's bytes are. This wrapper turns
    them into (buffer, offset) pairs by looking each address up among the buffers; the kernel then checks
    every offset and length against its buffer, so a wrong plan is a ValueError, never a stray write."""

    def __init__(self, layout: Any, host: torch.Tensor | None = None) -> None:
        self._layout = layout
        ranges: dict[int, list[tuple[int, int, torch.Tensor]]] = {}
        for t in layout.tensors:
            n = _span(t)
            if n:
                s = t.untyped_storage()
                lo = int(t.storage_offset()) * t.element_size()
                ranges.setdefault(s.data_ptr(), []).append((lo, lo + n, t))
        bufs: list[tuple[int, npt.NDArray[np.uint8]]] = []
        for base, rs in ranges.items():  # views of one storage may interleave: one buffer per merged range
            rs.sort(key=lambda r: r[0])
            lo, hi, t = rs[0]
            for a, b, u in [*rs[1:], (-1, -1, t)]:
                if a > hi or a < 0:
                    bufs.append((base + lo, tensor_bytes(t, lo, hi - lo)))
                    lo, hi, t = a, b, u
                else:
                    hi = max(hi, b)
        bufs.sort(key=lambda b: b[0])
        self._starts = np.asarray([b[0] for b in bufs], dtype=np.int64)
        self._engine = tuple(b[1] for b in bufs)
        self._host = None if host is None else self.host_side(host)
        # A plain KVLayout's plan (bases + block * stride, slot * slot_bytes + offset) is also computed in C,
        # sorted and all, by plan(slot_order=True): the store and load threads plan every tick's batch while
        # holding the GIL, and numpy's dozen small-array calls per plan cost the event loop ~50 us a tick.
        self._fast: tuple[Int64Array, Int64Array, Int64Array, Int64Array, int] | None = None
        self._fast_index: Int64Array | None = None
        self._layer_fast: dict[int, Any] = {}  # layer -> the fast plan's per-segment arrays, that layer's
        if _native_plan is not None and type(layout).copy_plan is _kv_copy_plan():
            bases, lens, offs = (np.asarray(a, dtype=np.int64) for a in layout._segments())
            strides = np.asarray(layout.block_strides(), dtype=np.int64)
            # Which engine buffer each segment of a block lies in (a tensor's blocks are all in the buffer
            # of its span), and its offset there: fixed per layout, so a plan needs no lookup per address.
            seg_buf = np.searchsorted(self._starts, bases, side="right") - 1
            if len(bases) and seg_buf.min() >= 0:
                rel = bases - self._starts[seg_buf]
                self._fast = (
                    np.ascontiguousarray(rel, dtype=np.int64),
                    np.ascontiguousarray(strides),
                    np.ascontiguousarray(lens),
                    np.ascontiguousarray(offs),
                    int(layout.slot_bytes),
                )
                self._fast_index = (
                    None if len(self._starts) == 1 else np.ascontiguousarray(seg_buf, dtype=np.int64)
                )

    @staticmethod
    def host_side(host: torch.Tensor) -> tuple[tuple[Any, ...], int]:
        """The buffer of a host tensor (the bytes it spans) and its base offset (0)."""
        return (tensor_bytes(host),), 0

    def plan(
        self,
        block_ids: Sequence[Any],
        slot_ids: Sequence[int],
        host: torch.Tensor | None = None,
        *,
        slot_order: bool = False,
        layer: int | None = None,
    ) -> tuple[Segments, Segments, Int64Array]:
        """``(engine, host, nbytes)`` for copying engine blocks ``block_ids[i]`` <-> slots ``slot_ids[i]`` of
        ``host`` (default: the planner's host tensor), in the layout's order (slot by slot). ``slot_order``:
        the pairs are copied sorted by (slot, block) instead of in the order given (one tick's merged batch:
        the host side sequential). ``layer``: only that layer's segments (:meth:`KVLayout.layer_segments`)
        of each block, at their places in the slot."""
        side = self._host if host is None else self.host_side(host)
        if side is None:
            raise ValueError("host must be given: this planner has no host tensor")
        if layer is not None:
            return self._plan_layer(block_ids, slot_ids, side, slot_order, layer)
        host_bufs, base = side
        starts = self._starts
        fast = self._fast
        if (
            fast is not None
            and type(block_ids) in (list, tuple)
            and type(slot_ids) in (list, tuple)
            and (slot_order or len(block_ids) <= 1)
        ):
            rel, strides, lens, offs, slot_bytes = fast
            e, h, nb, ix, _ = _native_plan(
                block_ids, slot_ids, rel, strides, lens, offs, slot_bytes, base, self._fast_index
            )
            index = None if ix is None else np.frombuffer(ix, dtype=np.int64)
            return (
                Segments(self._engine, np.frombuffer(e, dtype=np.int64), index),
                Segments(host_bufs, np.frombuffer(h, dtype=np.int64)),
                np.frombuffer(nb, dtype=np.int64),
            )
        else:
            if slot_order:
                pairs = sorted(zip(slot_ids, block_ids, strict=True))
                block_ids, slot_ids = [p[1] for p in pairs], [p[0] for p in pairs]
            addrs, host_offs, nbytes = self._layout.copy_plan(block_ids, slot_ids, base)
        if len(starts) == 1:
            return Segments(self._engine, addrs - starts[0]), Segments(host_bufs, host_offs), nbytes
        idx = np.searchsorted(starts, addrs, side="right") - 1
        np.maximum(idx, 0, out=idx)  # below every buffer: a negative offset, which the kernel refuses
        return Segments(self._engine, addrs - starts[idx], idx), Segments(host_bufs, host_offs), nbytes

    def _plan_layer(
        self,
        block_ids: Sequence[Any],
        slot_ids: Sequence[int],
        side: tuple[tuple[Any, ...], int],
        slot_order: bool,
        layer: int,
    ) -> tuple[Segments, Segments, Int64Array]:
        """:meth:`plan` restricted to one layer's segments of every block."""
        host_bufs, base = side
        fast = self._layer_fast.get(layer) if self._fast is not None else None
        if fast is None and self._fast is not None:
            a, b = self._layout.layer_segments(layer)
            rel, strides, lens, offs, slot_bytes = self._fast
            fast = self._layer_fast[layer] = (
                (rel[a:b].copy(), strides[a:b].copy(), lens[a:b].copy(), offs[a:b].copy(), slot_bytes),
                None if self._fast_index is None else self._fast_index[a:b].copy(),
            )
        if fast is not None and type(block_ids) in (list, tuple) and type(slot_ids) in (list, tuple):
            (rel, strides, lens, offs, slot_bytes), seg_index = fast
            if not slot_order:  # the C planner always sorts; the order given is kept by sorting nothing
                pairs = list(zip(slot_ids, block_ids, strict=True))
                if any(pairs[i] > pairs[i + 1] for i in range(len(pairs) - 1)):
                    return self._plan_layer_py(block_ids, slot_ids, side, False, layer)
            e, h, nb, ix, _ = _native_plan(
                block_ids, slot_ids, rel, strides, lens, offs, slot_bytes, base, seg_index
            )
            index = None if ix is None else np.frombuffer(ix, dtype=np.int64)
            return (
                Segments(self._engine, np.frombuffer(e, dtype=np.int64), index),
                Segments(host_bufs, np.frombuffer(h, dtype=np.int64)),
                np.frombuffer(nb, dtype=np.int64),
            )
        return self._plan_layer_py(block_ids, slot_ids, side, slot_order, layer)

    def _plan_layer_py(
        self,
        block_ids: Sequence[Any],
        slot_ids: Sequence[int],
        side: tuple[tuple[Any, ...], int],
        slot_order: bool,
        layer: int,
    ) -> tuple[Segments, Segments, Int64Array]:
        host_bufs, base = side
        if slot_order:
            pairs = sorted(zip(slot_ids, block_ids, strict=True))
            block_ids, slot_ids = [p[1] for p in pairs], [p[0] for p in pairs]
        a, b = self._layout.layer_segments(layer)
        addrs, host_offs, nbytes = self._layout.copy_plan(block_ids, slot_ids, base)
        per = len(nbytes) // max(1, len(block_ids))
        addrs = np.ascontiguousarray(addrs.reshape(-1, per)[:, a:b]).ravel()
        host_offs = np.ascontiguousarray(host_offs.reshape(-1, per)[:, a:b]).ravel()
        nbytes = np.ascontiguousarray(nbytes.reshape(-1, per)[:, a:b]).ravel()
        starts = self._starts
        if len(starts) == 1:
            return Segments(self._engine, addrs - starts[0]), Segments(host_bufs, host_offs), nbytes
        idx = np.searchsorted(starts, addrs, side="right") - 1
        np.maximum(idx, 0, out=idx)
        return Segments(self._engine, addrs - starts[idx], idx), Segments(host_bufs, host_offs), nbytes


def _kv_copy_plan() -> Any:
    from .._layout import KVLayout

    return KVLayout.copy_plan


def _sides(
    dst: Segments, src: Segments
) -> tuple[tuple[Any, ...], Int64Array | None, Int64Array, tuple[Any, ...], Int64Array | None, Int64Array]:
    """The kernel's first six arguments: each side's buffers, segment buffer indexes and byte offsets."""
    return dst.buffers, dst.index, dst.offsets, src.buffers, src.index, src.offsets


def _python_copy(dst: Segments, src: Segments, nbytes: Int64Array) -> None:
    """The kernel's checks and copy, in Python (no C compiler at install time)."""
    n = len(nbytes)
    if len(dst) != n or len(src) != n:
        raise ValueError(
            "dst_offsets, src_offsets, nbytes (and dst_index, src_index) must have the same length"
        )
    sides = []
    for name, side, writable in (("dst", dst, True), ("src", src, False)):
        views = [memoryview(b).cast("B") for b in side.buffers]
        if writable:
            for k, v in enumerate(views):
                if v.readonly:
                    raise ValueError(f"{name}[{k}] is a read-only buffer: a copy cannot write into it")
        index = [0] * n if side.index is None else side.index.tolist()
        sides.append((name, views, index, side.offsets.tolist()))
    lens = nbytes.tolist()
    spans = []
    for i, ln in enumerate(lens):
        if ln < 0:
            raise ValueError(f"nbytes[{i}] must be >= 0, got {ln}")
        pair = []
        for name, views, index, offs in sides:
            k, off = index[i], offs[i]
            if not 0 <= k < len(views):
                raise ValueError(f"{name}_index[{i}] = {k} is not a buffer of {name} (it has {len(views)})")
            if off < 0 or off + ln > len(views[k]):
                raise ValueError(
                    f"{name}_offsets[{i}] = {off} with nbytes[{i}] = {ln} is out of bounds of {name}[{k}] "
                    f"({len(views[k])} bytes)"
                )
            pair.append(views[k][off : off + ln])
        spans.append(pair)
    for d, s in spans:
        d[:] = s


# Interleaving for gathers (scattered sources, sequential destination) and for scatters; see _copy.c. The
# best gather interleaving depends on the machine (measured: 6 on an AMD EPYC VM, where it lifted 16 KiB
# gathers from 0.62 to 0.9 of a contiguous copy; 1 on an Intel Xeon VM, where 6 halves the throughput), so the
# executor picks between GATHER_GROUPS at run time (GroupTuner); GATHER_GROUP is the start and the fallback.
GATHER_GROUP = 1
GATHER_GROUPS = (1, 6)
SCATTER_GROUP = 1


class GroupTuner:
    """Chooses the interleaving of large gathers from paired measurements on the copies themselves.

    A large copy (at least ``2 * sample_bytes``) may carry a trial: two consecutive prefixes of about
    ``sample_bytes``, one copied with a candidate group and one with the current best (which of them goes
    first alternates: the first starts cold), timed on the calling thread while the helpers copy the rest,
    the conditions the choice is for. A trial yields one paired ratio, the candidate's cost per byte over the
    best's in the same copy (pairing cancels the machine's drift between copies; a median ignores a prefix
    that lost its core); a candidate becomes the best once the median of its last ``window`` ratios, at least
    ``warmup`` of them, is below 1. Each candidate is tried on every large copy until it has ``warmup``
    ratios against the current best, then on one large copy in ``explore_every``, so a trial costs a few MiB
    of a copy and conditions that change are noticed. Used by one worker thread only."""

    __slots__ = (
        "_explore_every",
        "_large",
        "_ratios",
        "_warmup",
        "_window",
        "best",
        "candidates",
        "sample_bytes",
        "trials",
    )

    def __init__(
        self,
        candidates: tuple[int, ...] = GATHER_GROUPS,
        *,
        sample_bytes: int = 4 << 20,
        warmup: int = 3,
        window: int = 5,
        explore_every: int = 16,
    ) -> None:
        self.candidates = candidates
        self.best = candidates[0]
        self.sample_bytes = sample_bytes
        self._warmup = warmup
        self._window = max(window, warmup)
        self._explore_every = explore_every
        self._ratios: dict[int, list[float]] = {c: [] for c in candidates}
        self._large = 0
        self.trials = 0  # trials handed out so far

    def trial(self, nbytes: int) -> int | None:
        """The candidate to try on a prefix of a copy of ``nbytes``, or None."""
        if nbytes < 2 * self.sample_bytes or len(self.candidates) < 2:
            return None
        self._large += 1
        others = [c for c in self.candidates if c != self.best]
        for c in others:
            if len(self._ratios[c]) < self._warmup:
                self.trials += 1
                return c
        if self._large % self._explore_every == 0:
            self.trials += 1
            return others[(self._large // self._explore_every) % len(others)]
        return None

    def record(self, candidate: int, candidate_cost: float, best_cost: float) -> None:
        """One trial's costs per byte: ``candidate`` and the current best, measured in the same copy."""
        if candidate == self.best or best_cost <= 0:
            return
        ratios = self._ratios[candidate]
        ratios.append(candidate_cost / best_cost)
        del ratios[: -self._window]
        if len(ratios) >= self._warmup and statistics.median(ratios) < 1.0:
            self.best = candidate
            for r in self._ratios.values():  # they compared against the previous best
                r.clear()


def copy_segments(
    dst: Segments,
    src: Segments,
    nbytes: Int64Array,
    group: int = 1,
    stream: bool | None = None,
) -> None:
    """memcpy every segment ``src[i] -> dst[i]`` (``nbytes[i]`` bytes), merging adjacent runs, GIL released;
    every segment is checked against its buffers first (a ValueError naming the argument, nothing copied).

    ``group`` > 1 interleaves that many runs (helps when the sources are scattered). ``stream``: streaming
    (non-temporal) stores, or plain memcpy; ``None`` chooses by size (streaming from 4 MiB). A piece of a
    larger batch passes the batch's choice, so it is copied (and timed) the way the batch is."""
    if _native_copy is not None:
        _native_copy(*_sides(dst, src), nbytes, group, 512, -1 if stream is None else int(stream))
    else:  # no C compiler at install, or AIOKV_NATIVE_COPY=0
        if not 1 <= group <= _MAX_GROUP:
            raise ValueError(f"group must be in [1, {_MAX_GROUP}], got {group}")
        _python_copy(dst, src, nbytes)


class CopyPool:
    """Shares one large segment copy among ``threads`` threads (the caller's and ``threads - 1`` helpers).

    The copy is cut at segment boundaries into parts of about :attr:`PART_BYTES` (a native ``CopyJob``); every
    thread takes the next part from a shared counter until none is left, so a helper that wakes late (a few
    ms on a busy or virtual machine) or runs slower (sharing its core) copies fewer parts instead of holding
    the whole copy back, and the caller never waits for a helper that has not started: it copies what is left
    itself and then waits only for parts already being copied. The plan is validated before any byte moves.
    Batches under :attr:`MIN_SPLIT_BYTES` are copied by the caller alone (waking a helper costs more than it
    saves), and so is every copy without the native kernel (the Python fallback holds the GIL anyway). Several
    callers (the store and the load stream) may share the pool: each helper serves their jobs in turn."""

    MIN_SPLIT_BYTES = 2 << 20
    PART_BYTES = 1 << 20

    def __init__(self, threads: int) -> None:
        self.threads = threads
        self._queues: list[queue.SimpleQueue[Any]] = []
        self._threads: list[threading.Thread] = []
        for i in range(threads - 1):
            q: queue.SimpleQueue[Any] = queue.SimpleQueue()
            t = threading.Thread(target=self._work, args=(q,), name=f"aiokv-copy-{i}", daemon=True)
            t.start()
            self._queues.append(q)
            self._threads.append(t)

    @staticmethod
    def _work(q: queue.SimpleQueue[Any]) -> None:
        while True:
            job = q.get()
            if job is None:
                return
            job.run()  # never raises once built (the plan was validated); a finished job returns at once

    def copy(
        self,
        dst: Segments,
        src: Segments,
        nbytes: Int64Array,
        group: int = 1,
        first: Callable[[], None] | None = None,
    ) -> None:
        """Copy the segments; ``first`` (other work of the caller, e.g. a measured prefix of the same batch)
        runs on the caller while the helpers have already started on this copy. Returns (or raises what
        ``first`` raised) only once every part is copied."""
        n = len(nbytes)
        if _CopyJob is None or not self._queues or n < 2 or int(nbytes.sum()) < self.MIN_SPLIT_BYTES:
            if first is not None:
                first()
            copy_segments(dst, src, nbytes, group)
            return
        job = _CopyJob(*_sides(dst, src), nbytes, group, 512, self.PART_BYTES)
        for q in self._queues:
            q.put(job)
        try:
            if first is not None:
                first()
        finally:  # never return while a helper may still be copying a part
            job.run()
            job.wait()

    def close(self) -> None:
        for q in self._queues:
            q.put(None)
        for t in self._threads:
            t.join(timeout=30)


_STOP = object()


class CPUStream:
    """A FIFO of copy batches executed by one worker thread; completion is delivered on the loop.

    ``submit(jobs)`` enqueues a batch (a list of TransferFutures). The worker takes whatever batches are
    queued, merged into one, runs ``run(batch)`` (an exception becomes every job's ``_error``) and hands the
    finished batch to ``complete`` on the loop with a single ``call_soon_threadsafe``. With ``split`` the
    merged batch is cut into parts (in order), each run and completed on its own: a layer-wise load's layers.
    """

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        name: str,
        run: Callable[[list[Any]], None],
        complete: Callable[[list[Any]], None],
        *,
        split: Callable[[list[Any]], list[list[Any]]] | None = None,
    ) -> None:
        self._loop = loop
        self._split = split
        self._run_batch = run
        self._complete = complete
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._work, name=f"aiokv-{name}", daemon=True)
        self._closed = False
        self._thread.start()

    def submit(self, jobs: list[Any]) -> None:
        if self._closed:
            raise RuntimeError("stream is closed")
        self._queue.put(jobs)

    def _work(self) -> None:
        get = self._queue.get
        get_nowait = self._queue.get_nowait
        run = self._run_batch
        stop = False
        while not stop:
            item = get()
            batch: list[Any] = []
            while True:
                if item is _STOP:
                    stop = True
                    break
                batch.extend(item)
                try:
                    item = get_nowait()
                except queue.Empty:
                    break
            if not batch:
                continue
            for part in [batch] if self._split is None else self._split(batch):
                try:
                    run(part)
                except BaseException as exc:
                    for job in part:
                        job._error = exc
                call_soon_threadsafe_guarded(self._loop, self._complete, part)

    def close(self) -> None:
        """Stop after the queued jobs; joins the worker thread (bounded)."""
        if not self._closed:
            self._closed = True
            self._queue.put(_STOP)
        self._thread.join(timeout=30)
