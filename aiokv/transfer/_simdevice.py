"""A simulated device with CUDA's stream and event semantics, on worker threads.

Every stream is a worker thread running the work enqueued on it later and in order; events mark points in a
stream; ``wait_event`` makes a stream's worker wait for another stream's point; the host can query or block
on an event. The simulator reproduces the traps of the real thing: work enqueued on a stream has not run when
the call returns (so a copy that is not ordered after the kernel writing its source reads stale bytes),
waiting on an event that was never recorded does nothing, an error during execution surfaces only when the
host synchronizes and breaks the stream for good, and copies to host memory that was not pinned are refused.
Per-operation delays and jitter are seeded; streams can be paused and resumed by tests to force a schedule.

Optionally (``copy_bytes_per_s``) the device models time on its host link: every copy between host memory and
device memory takes ``nbytes / copy_bytes_per_s`` on its stream, which benchmarks use to measure how copies
overlap with compute (see :class:`SimulatedDevice`).

"Device memory" is ordinary CPU memory: engine tensors are CPU tensors that the simulated kernels read and
write on their stream's worker, which is exactly what makes ordering bugs visible on a machine without a GPU.
"""

from __future__ import annotations

import contextlib
import math
import random
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from .._errors import DeviceError, InvalidArgumentError, InvalidTypeError
from ._binding import BlockCopier, DeviceBinding
from ._cpu import GATHER_GROUP, SCATTER_GROUP, CopyPlanner, copy_segments

if TYPE_CHECKING:
    from .._layout import KVLayout

__all__ = ["SimulatedDevice", "SimulatedDeviceError", "SimStream"]


class SimulatedDeviceError(DeviceError):
    """A fault injected into the simulated device (or a kernel that failed on it)."""


class _Point:
    """One recording of an event: reached when the stream's worker gets to it."""

    __slots__ = ("done", "error")

    def __init__(self) -> None:
        self.done = threading.Event()
        self.error: BaseException | None = None


class SimEvent:
    """A simulated event. Like a CUDA event it refers to its latest recording."""

    __slots__ = ("_point", "blocking")

    def __init__(self, blocking: bool) -> None:
        self.blocking = blocking
        self._point: _Point | None = None

    def __repr__(self) -> str:
        state = (
            "unrecorded" if self._point is None else ("reached" if self._point.done.is_set() else "pending")
        )
        return f"<SimEvent {state}>"


_RUN, _SET, _WAIT, _HOLD, _STOP = range(5)

# The modelled link's clock and sleep (module level, so a unit test can swap in a deterministic clock).
_clock = time.perf_counter
_sleep = time.sleep


class SimStream:
    """One simulated stream: a FIFO of operations executed in order by its own worker thread."""

    def __init__(self, device: SimulatedDevice, name: str, seed: int) -> None:
        self.name = name
        self._device = device
        self._rng = random.Random(seed)
        self._cv = threading.Condition()
        self._ops: deque[tuple[int, Any]] = deque()
        self._paused = False
        self._busy = False
        self._waiting_on: threading.Event | None = None  # an event point or a hold
        self._error: BaseException | None = None  # sticky, like a CUDA error
        self.executed = 0
        # Modelled host link (copy_bytes_per_s): when the previous operation was a modelled copy, the end of
        # its modelled transfer; copies back to back are one continuous transfer on the link.
        self._link_end: float | None = None
        self._thread = threading.Thread(target=self._work, name=f"aiokv-sim-{name}", daemon=True)
        self._thread.start()

    # -------------------------------------------------------------- test controls
    def pause(self) -> None:
        """Hold the stream's worker before its next operation (work already running finishes)."""
        with self._cv:
            self._paused = True

    def resume(self) -> None:
        with self._cv:
            self._paused = False
            self._cv.notify_all()

    def hold(self) -> threading.Event:
        """Enqueue a point where the stream stops until the returned event is set: stream-ordered, like a
        long kernel on a GPU (unlike :meth:`pause`, work enqueued before it still runs)."""
        release = threading.Event()
        self._put(_HOLD, release)
        return release

    @property
    def pending(self) -> int:
        """Operations enqueued and not finished (including one running or waiting)."""
        with self._cv:
            return len(self._ops) + (1 if self._busy else 0)

    @property
    def blocked_on_event(self) -> bool:
        """True while the worker waits for another stream's point (``wait_event``) or a :meth:`hold`."""
        w = self._waiting_on
        return w is not None and not w.is_set()

    @property
    def error(self) -> BaseException | None:
        return self._error

    def _quiet(self) -> bool:
        """Nothing more will run without outside help: idle, paused, or waiting for an unreached point."""
        return self._paused or self.blocked_on_event or (not self._ops and not self._busy)

    def wait_quiet(self, timeout: float | None = None) -> bool:
        """Block the calling thread until :meth:`_quiet` (returns False on timeout)."""
        with self._cv:
            return self._cv.wait_for(self._quiet, timeout)

    def __repr__(self) -> str:
        return f"<SimStream {self.name} pending={self.pending}{' paused' if self._paused else ''}>"

    # -------------------------------------------------------------- internals
    def _put(self, kind: int, arg: Any) -> None:
        with self._cv:
            if kind != _STOP and self._device._closed:
                raise SimulatedDeviceError("simulated device is closed")
            self._ops.append((kind, arg))
            self._cv.notify_all()

    def _work(self) -> None:
        cv = self._cv
        while True:
            with cv:
                while not self._ops or self._paused:
                    cv.wait()
                kind, arg = self._ops.popleft()
                self._busy = True
            try:
                if kind == _STOP:
                    return
                if kind in (_WAIT, _HOLD):
                    self._link_end = None
                    gate = arg.done if kind == _WAIT else arg
                    with cv:
                        self._waiting_on = gate
                        cv.notify_all()
                    gate.wait()
                    with cv:
                        self._waiting_on = None
                        cv.notify_all()
                elif kind == _SET:
                    arg.error = self._error
                    arg.done.set()
                elif self._error is None:  # a broken stream executes nothing more
                    self._delay()
                    if not isinstance(arg, (_ModelledCopy, _MemoryOp)):
                        self._link_end = None  # a kernel: its own time, the link's clock starts afresh
                    try:
                        arg()
                    except BaseException as exc:
                        self._error = exc
                self.executed += 1
            finally:
                with cv:
                    self._busy = False
                    cv.notify_all()

    def _delay(self) -> None:
        dev = self._device
        d = dev.delay_s + (self._rng.random() * dev.jitter_s if dev.jitter_s else 0.0)
        if d > 0:
            time.sleep(d)


class _ModelledCopy:
    """A host <-> device copy that occupies its stream for ``nbytes / copy_bytes_per_s`` of device time.

    The stream's worker sleeps until the copy's modelled end before performing it: the copy starts when the
    stream reaches it or, right after another modelled copy, when that one's transfer ends (whichever is
    later than its enqueue), so runs of small copies cost their bytes' time on the link and not the
    simulator's per-operation overhead or the sleep's granularity, which would otherwise add up."""

    __slots__ = ("enqueued", "fn", "nbytes", "seconds", "stream")

    def __init__(self, stream: SimStream, nbytes: int, seconds: float, fn: Callable[[], Any]) -> None:
        self.stream = stream
        self.nbytes = nbytes
        self.seconds = seconds
        self.fn = fn
        self.enqueued = _clock()

    def __call__(self) -> None:
        s = self.stream
        now = _clock()
        start = now if s._link_end is None else max(s._link_end, self.enqueued)
        end = start + self.seconds
        s._device._count_copy(self.nbytes, self.seconds)
        if end > now:
            _sleep(end - now)
        s._link_end = end
        self.fn()


class _MemoryOp:
    """With a modelled host link: an operation in device memory only (a device-to-device copy, a gather or
    scatter of engine blocks). On a GPU it runs at memory speed, far above the link's, so it takes no
    modelled time: the simulator's own time running it is absorbed by the link's clock like its overhead
    between copies, instead of being added to the copies around it."""

    __slots__ = ("fn",)

    def __init__(self, fn: Callable[[], Any]) -> None:
        self.fn = fn

    def __call__(self) -> None:
        self.fn()


class _SimCopier(BlockCopier):
    """Gather/scatter of engine blocks with the CPU copy kernel, executed on the stream's worker."""

    def __init__(self, device: SimulatedDevice, layout: KVLayout) -> None:
        self._device = device
        self._layout = layout
        self._planner = CopyPlanner(layout)

    def _run(self, index: torch.Tensor, rows: torch.Tensor, gather: bool, layer: int | None = None) -> None:
        n = int(rows.shape[0])
        ids = index[:n].tolist()  # read on the device, when the kernel runs, like a real kernel
        num_blocks = self._layout.num_blocks
        if any(b < 0 or b >= num_blocks for b in ids):
            raise SimulatedDeviceError(f"illegal memory access: block index out of [0, {num_blocks})")
        engine, staging, nbytes = self._planner.plan(ids, range(n), rows, layer=layer)
        if gather:
            copy_segments(staging, engine, nbytes, GATHER_GROUP)
        else:
            copy_segments(engine, staging, nbytes, SCATTER_GROUP)

    def gather(self, stream: Any, index: torch.Tensor, rows: torch.Tensor) -> None:
        self._device._enqueue(stream, "gather", self._device._memory_op(lambda: self._run(index, rows, True)))

    def scatter(
        self, stream: Any, index: torch.Tensor, rows: torch.Tensor, *, layer: int | None = None
    ) -> None:
        self._device._enqueue(
            stream, "scatter", self._device._memory_op(lambda: self._run(index, rows, False, layer))
        )


class SimulatedDevice(DeviceBinding):
    """A CPU simulation of a GPU's streams and events, to test device ordering without a GPU.

    Parameters:
        seed: seeds every stream's delay generator.
        delay_s: time every kernel or copy takes (added before it runs).
        jitter_s: a further uniform random delay in ``[0, jitter_s)`` per operation.
        copy_bytes_per_s: model the host link's bandwidth: every copy between host memory and device memory
            (the :meth:`copy` operation with one side allocated by :meth:`alloc` or :meth:`alloc_index`)
            occupies its stream for ``nbytes / copy_bytes_per_s`` seconds before it completes. ``None``
            (the default): copies take only the time the simulator needs. Device-to-device copies and the
            block copier's gather and scatter take no modelled time: on a GPU they run at memory (HBM)
            speed, well over an order of magnitude above the host link. Copies back to back on a stream are
            one continuous transfer (the simulator's per-operation overhead and the sleep's granularity do
            not add up over many small copies); after a kernel or a wait, the link's clock starts afresh.
            :attr:`modelled_copy_s` and :attr:`modelled_copy_bytes` count the modelled copies.

    Use it as ``Offloader(layout, tiers, device=SimulatedDevice(...))`` with CPU tensors as the engine's
    "device" memory, and run the engine's KV writes as stream work (:meth:`launch`) so that they land after
    the engine's ``step()`` call, as they do on a GPU. Tests may :meth:`SimStream.pause` a stream to hold
    its work back, inject faults (:meth:`fail_next`, :meth:`fail_next_enqueue`) and pretend a stream is
    being captured into a graph (:meth:`capturing`).
    """

    kind = "sim"

    def __init__(
        self,
        *,
        seed: int = 0,
        delay_s: float = 0.0,
        jitter_s: float = 0.0,
        copy_bytes_per_s: float | None = None,
    ) -> None:
        for name, v in (("delay_s", delay_s), ("jitter_s", jitter_s)):
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise InvalidTypeError(f"{name} must be a number, got {type(v).__name__}")
            if not v >= 0:
                raise InvalidArgumentError(f"{name} must be >= 0, got {v!r}")
        if copy_bytes_per_s is not None:
            if isinstance(copy_bytes_per_s, bool) or not isinstance(copy_bytes_per_s, (int, float)):
                raise InvalidTypeError(
                    f"copy_bytes_per_s must be a number or None, got {type(copy_bytes_per_s).__name__}"
                )
            if not (copy_bytes_per_s > 0 and math.isfinite(copy_bytes_per_s)):
                raise InvalidArgumentError(
                    f"copy_bytes_per_s must be a positive finite number of bytes per second, got"
                    f" {copy_bytes_per_s!r}"
                )
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise InvalidTypeError(f"seed must be an int, got {type(seed).__name__}")
        self.seed = seed
        self.delay_s = float(delay_s)
        self.jitter_s = float(jitter_s)
        self.copy_bytes_per_s = None if copy_bytes_per_s is None else float(copy_bytes_per_s)
        self.modelled_copy_s = 0.0  # device time of the modelled host <-> device copies executed so far
        self.modelled_copy_bytes = 0
        self._closed = False
        self._lock = threading.RLock()  # re-entrant: a GC finalizer (_untrack) may run while it is held
        self._streams: list[SimStream] = []
        self._local = threading.local()
        self._pinned: dict[int, int] = {}  # address -> bytes
        self._device_mem: dict[int, int] = {}
        self._capturing: set[int] = set()
        self._fail_ops: dict[str, int] = {}  # kind -> operations left before one fails
        self._fail_enqueue = -1
        self.allocated_bytes = 0  # simulated device memory alive now
        self.peak_bytes = 0
        self._host_cv = threading.Condition()
        self._host_waiters = 0
        self.default_stream = self.new_stream("default")

    # ----------------------------------------------------------------- streams and events
    def current_stream(self) -> SimStream:
        s: SimStream | None = getattr(self._local, "stream", None)
        return s if s is not None else self.default_stream

    @contextlib.contextmanager
    def stream(self, stream: SimStream) -> Iterator[SimStream]:
        """Make ``stream`` the calling thread's current stream (like ``torch.cuda.stream``)."""
        prev = getattr(self._local, "stream", None)
        self._local.stream = stream
        try:
            yield stream
        finally:
            self._local.stream = prev

    def new_stream(self, name: str = "stream") -> SimStream:
        with self._lock:
            s = SimStream(self, f"{name}-{len(self._streams)}", self.seed * 1_000_003 + len(self._streams))
            self._streams.append(s)
        return s

    def new_event(self, *, blocking: bool = False) -> SimEvent:
        return SimEvent(blocking)

    def record(self, event: SimEvent, stream: SimStream) -> None:
        point = _Point()
        stream._put(_SET, point)
        event._point = point

    def wait_event(self, stream: SimStream, event: SimEvent) -> None:
        point = event._point
        if point is None:  # never recorded: nothing to wait for (CUDA semantics)
            return
        stream._put(_WAIT, point)

    def synchronize(self, event: SimEvent) -> None:
        point = event._point
        if point is None:
            return
        if not point.done.is_set():
            with self._host_cv:
                self._host_waiters += 1
                self._host_cv.notify_all()
            try:
                point.done.wait()
            finally:
                with self._host_cv:
                    self._host_waiters -= 1
        if point.error is not None:
            raise SimulatedDeviceError(f"device error: {point.error!r}") from point.error

    def query(self, event: SimEvent) -> bool:
        point = event._point
        return point is None or point.done.is_set()

    def synchronize_stream(self, stream: SimStream) -> None:
        ev = self.new_event(blocking=True)
        self.record(ev, stream)
        self.synchronize(ev)

    def is_capturing(self, stream: Any) -> bool:
        return id(stream) in self._capturing

    @contextlib.contextmanager
    def capturing(self, stream: SimStream) -> Iterator[None]:
        """Pretend ``stream`` is being captured into a graph while the block runs."""
        self._capturing.add(id(stream))
        try:
            yield
        finally:
            self._capturing.discard(id(stream))

    def launch(self, stream: Any, fn: Callable[[], Any]) -> None:
        self._enqueue(stream, "kernel", fn)

    def wait_host_waiters(self, n: int, timeout: float) -> bool:
        """Block until at least ``n`` host threads are blocked in :meth:`synchronize` on an unreached point;
        False if that did not happen within ``timeout`` seconds (a hang guard for tests)."""
        with self._host_cv:
            return self._host_cv.wait_for(lambda: self._host_waiters >= n, timeout)

    def wait_quiescent(self, timeout: float = 30.0) -> None:
        """Block the calling thread until no stream can make progress on its own: each is idle, paused, or
        waiting for a point that another stream has not reached (tests: "everything that could run has")."""
        deadline = time.monotonic() + timeout
        while True:
            streams = list(self._streams)
            for s in streams:
                if not s.wait_quiet(max(0.0, deadline - time.monotonic())):
                    raise TimeoutError(f"simulated device did not settle within {timeout} s: {s!r}")
            # A stream that was waiting may have been released meanwhile: settle only on a stable pass.
            if all(s._quiet() for s in streams):
                return

    def synchronize_all(self) -> None:
        """Block until every stream is idle (tests)."""
        for s in list(self._streams):
            self.synchronize_stream(s)

    # ----------------------------------------------------------------- faults
    def fail_next(self, kind: str = "copy", *, after: int = 0) -> None:
        """Make the ``after + 1``-th operation of ``kind`` ("copy", "gather", "scatter", "kernel") enqueued
        from now on fail when it executes; its stream is broken from then on (a sticky device error)."""
        if kind not in ("copy", "gather", "scatter", "kernel"):
            raise InvalidArgumentError(f"kind must be one of copy, gather, scatter, kernel, got {kind!r}")
        self._fail_ops[kind] = after

    def fail_next_enqueue(self, *, after: int = 0) -> None:
        """Make the ``after + 1``-th enqueue call from now on raise at once (a submission failing part-way)."""
        self._fail_enqueue = after

    # ----------------------------------------------------------------- memory
    def alloc(self, nbytes: int) -> torch.Tensor:
        t = torch.empty(nbytes, dtype=torch.uint8)
        self._track(t)
        return t

    def alloc_index(self, n: int) -> torch.Tensor:
        t = torch.zeros(n, dtype=torch.int64)
        self._track(t)
        return t

    def alloc_pinned_index(self, n: int) -> torch.Tensor:
        t = torch.zeros(n, dtype=torch.int64)
        self.pin(t)
        return t

    def _track(self, t: torch.Tensor) -> None:
        nbytes = t.numel() * t.element_size()
        ptr = t.data_ptr()
        with self._lock:
            self._device_mem[ptr] = nbytes
            self.allocated_bytes += nbytes
            self.peak_bytes = max(self.peak_bytes, self.allocated_bytes)
        weakref.finalize(t, self._untrack, ptr, nbytes)

    def _untrack(self, ptr: int, nbytes: int) -> None:
        with self._lock:
            if self._device_mem.pop(ptr, None) is not None:
                self.allocated_bytes -= nbytes

    def reset_peak(self) -> None:
        """Start :attr:`peak_bytes` over from the memory allocated now."""
        with self._lock:
            self.peak_bytes = self.allocated_bytes

    def pin(self, host: torch.Tensor) -> None:
        self._pinned[host.data_ptr()] = host.numel() * host.element_size()

    def unpin(self, host: torch.Tensor) -> None:
        self._pinned.pop(host.data_ptr(), None)

    def is_pinned(self, host: torch.Tensor) -> bool:
        return self._contains(self._pinned, host)

    @staticmethod
    def _contains(regions: dict[int, int], t: torch.Tensor) -> bool:
        start = t.data_ptr()
        end = start + t.numel() * t.element_size()
        return any(base <= start and end <= base + n for base, n in regions.items())

    # ----------------------------------------------------------------- copies
    def copy(self, stream: Any, dst: torch.Tensor, src: torch.Tensor) -> None:
        if dst.numel() * dst.element_size() != src.numel() * src.element_size():
            raise InvalidArgumentError("copy needs tensors of equal size")
        if not (dst.is_contiguous() and src.is_contiguous()):
            raise InvalidArgumentError("copy needs contiguous tensors")
        on_device: list[bool] = []
        for side in (dst, src):
            on_device.append(self._contains(self._device_mem, side))
            if not on_device[-1] and not self.is_pinned(side):
                raise InvalidArgumentError(
                    "host memory of an asynchronous copy must be pinned (it would make the copy synchronous)"
                )
        d = dst.view(-1).view(torch.uint8).numpy()
        s = src.view(-1).view(torch.uint8).numpy()
        fn: Callable[[], Any] = lambda: np.copyto(d, s)  # noqa: E731
        rate = self.copy_bytes_per_s
        if rate is not None and on_device[0] != on_device[1]:  # host <-> device: over the host link
            nbytes = int(d.nbytes)
            fn = _ModelledCopy(stream, nbytes, nbytes / rate, fn)
        elif on_device[0] and on_device[1]:
            fn = self._memory_op(fn)
        self._enqueue(stream, "copy", fn)

    def copy_rows(self, stream: Any, dst: torch.Tensor, src: torch.Tensor) -> None:
        """One strided copy (as ``cudaMemcpy2DAsync``): rows of two 2-d views, each row contiguous."""
        if dst.dim() != 2 or src.dim() != 2 or dst.shape != src.shape or dst.dtype != src.dtype:
            raise InvalidArgumentError("copy_rows needs two 2-d tensors of the same shape and dtype")
        if dst.stride(1) != 1 or src.stride(1) != 1:
            raise InvalidArgumentError("copy_rows needs contiguous rows")
        if dst.shape[0] == 0:
            return
        on_device: list[bool] = []
        for side in (dst, src):
            first, last = side[0], side[-1]  # the region from the first row to the end of the last
            start = first.data_ptr()
            end = last.data_ptr() + last.numel() * last.element_size()
            inside = any(base <= start and end <= base + n for base, n in self._device_mem.items())
            on_device.append(inside)
            pinned = any(base <= start and end <= base + n for base, n in self._pinned.items())
            if not inside and not pinned:
                raise InvalidArgumentError(
                    "host memory of an asynchronous copy must be pinned (it would make the copy synchronous)"
                )
        d = dst.view(torch.uint8).numpy()
        s = src.view(torch.uint8).numpy()
        fn: Callable[[], Any] = lambda: np.copyto(d, s)  # noqa: E731
        rate = self.copy_bytes_per_s
        if rate is not None and on_device[0] != on_device[1]:
            nbytes = int(d.nbytes)
            fn = _ModelledCopy(stream, nbytes, nbytes / rate, fn)
        elif on_device[0] and on_device[1]:
            fn = self._memory_op(fn)
        self._enqueue(stream, "copy", fn)

    def _memory_op(self, fn: Callable[[], Any]) -> Callable[[], Any]:
        return fn if self.copy_bytes_per_s is None else _MemoryOp(fn)

    def _count_copy(self, nbytes: int, seconds: float) -> None:
        with self._lock:
            self.modelled_copy_s += seconds
            self.modelled_copy_bytes += nbytes

    def block_copier(self, layout: KVLayout) -> BlockCopier:
        return _SimCopier(self, layout)

    def _enqueue(self, stream: SimStream, kind: str, fn: Callable[[], Any]) -> None:
        if self._fail_enqueue >= 0:
            self._fail_enqueue -= 1
            if self._fail_enqueue < 0:
                raise SimulatedDeviceError(f"injected failure enqueuing a {kind}")
        left = self._fail_ops.get(kind)
        if left is not None:
            if left == 0:
                del self._fail_ops[kind]

                def fail() -> None:
                    raise SimulatedDeviceError(f"injected {kind} failure")

                stream._put(_RUN, fail)
                return
            self._fail_ops[kind] = left - 1
        stream._put(_RUN, fn)

    # ----------------------------------------------------------------- lifetime
    def close(self) -> None:
        """Let every stream finish its queued work, then stop the workers. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            streams = list(self._streams)
        for s in streams:
            s.resume()
            s._put(_STOP, None)
        for s in streams:
            s._thread.join(timeout=30)

    def describe(self) -> str:
        link = "" if self.copy_bytes_per_s is None else f", copy_bytes_per_s={self.copy_bytes_per_s:g}"
        return f"sim(seed={self.seed}, delay_s={self.delay_s}, jitter_s={self.jitter_s}{link})"

    def __repr__(self) -> str:
        return f"SimulatedDevice({self.describe()})"
