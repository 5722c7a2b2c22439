"""Ordered worker-thread "streams" for the CPU backend, and the native copy kernel."""

from __future__ import annotations

import asyncio
import ctypes
import queue
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt

from ._future import call_soon_threadsafe_guarded

__all__ = [
    "GATHER_GROUP",
    "GATHER_GROUPS",
    "HAVE_NATIVE",
    "SCATTER_GROUP",
    "CPUStream",
    "CopyPool",
    "GroupTuner",
    "copy_segments",
]

try:
    from .._native._copy import copy_segments as _native_copy

    HAVE_NATIVE = True
except ImportError:  # pragma: no cover - exercised only without a C compiler
    _native_copy = None  # type: ignore[assignment]
    HAVE_NATIVE = False


def _python_copy(
    dst: npt.NDArray[np.int64], src: npt.NDArray[np.int64], nbytes: npt.NDArray[np.int64]
) -> None:
    memmove = ctypes.memmove
    for d, s, n in zip(dst.tolist(), src.tolist(), nbytes.tolist()):
        memmove(d, s, n)


# Interleaving for gathers (scattered sources, sequential destination) and for scatters; see _copy.c. The
# best gather interleaving depends on the machine (measured: 6 on an AMD EPYC VM, where it lifted 16 KiB
# gathers from 0.62 to 0.9 of a contiguous copy; 1 on an Intel Xeon VM, where 6 halves the throughput), so the
# executor picks between GATHER_GROUPS at run time (GroupTuner); GATHER_GROUP is the start and the fallback.
GATHER_GROUP = 1
GATHER_GROUPS = (1, 6)
SCATTER_GROUP = 1


class GroupTuner:
    """Chooses the interleaving of large gathers from throughput measured on the copies themselves.

    A large copy (at least ``2 * sample_bytes``) may carry a trial: its first ``sample_bytes`` are copied with
    a candidate group and the next ``sample_bytes`` with the current best, both on the calling thread, and both
    costs feed per-group moving averages; the rest of the copy uses the best group as usual. Each candidate
    is tried on every large copy until it has ``warmup`` samples, then on one large copy in ``explore_every``,
    so a trial costs at most a few MiB of a copy and conditions that change are noticed. Used by one worker
    thread only."""

    __slots__ = (
        "_cost",
        "_count",
        "_explore_every",
        "_large",
        "_warmup",
        "best",
        "candidates",
        "sample_bytes",
    )

    def __init__(
        self,
        candidates: tuple[int, ...] = GATHER_GROUPS,
        *,
        sample_bytes: int = 2 << 20,
        warmup: int = 3,
        explore_every: int = 16,
    ) -> None:
        self.candidates = candidates
        self.best = candidates[0]
        self.sample_bytes = sample_bytes
        self._warmup = warmup
        self._explore_every = explore_every
        self._cost: dict[int, float] = {}
        self._count = dict.fromkeys(candidates, 0)
        self._large = 0

    def trial(self, nbytes: int) -> int | None:
        """The candidate to try on a prefix of a copy of ``nbytes``, or None."""
        if nbytes < 2 * self.sample_bytes or len(self.candidates) < 2:
            return None
        self._large += 1
        others = [c for c in self.candidates if c != self.best]
        for c in others:
            if self._count[c] < self._warmup:
                return c
        if self._large % self._explore_every == 0:
            return others[(self._large // self._explore_every) % len(others)]
        return None

    def record(self, group: int, nbytes: int, seconds: float) -> None:
        cost = seconds / nbytes
        prev = self._cost.get(group)
        self._cost[group] = cost if prev is None else 0.7 * prev + 0.3 * cost
        self._count[group] += 1
        self.best = min(self._cost, key=self._cost.__getitem__)


def copy_segments(
    dst: npt.NDArray[np.int64],
    src: npt.NDArray[np.int64],
    nbytes: npt.NDArray[np.int64],
    group: int = 1,
) -> None:
    """memcpy every segment ``src[i] -> dst[i]`` (``nbytes[i]`` bytes), merging adjacent runs, GIL released.

    ``group`` > 1 interleaves that many runs (helps when the sources are scattered)."""
    if _native_copy is not None:
        _native_copy(dst, src, nbytes, group)
    else:  # pragma: no cover
        _python_copy(dst, src, nbytes)


class CopyPool:
    """Splits one large segment copy over ``threads`` threads (the caller's and ``threads - 1`` helpers).

    Parts are cut at segment boundaries, of about equal bytes; batches under :attr:`MIN_SPLIT_BYTES` are
    copied by the caller alone (waking a helper costs more than it saves)."""

    MIN_SPLIT_BYTES = 2 << 20

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
        self._lock = threading.Lock()  # one split copy at a time: two streams must not interleave parts

    @staticmethod
    def _work(q: queue.SimpleQueue[Any]) -> None:
        while True:
            item = q.get()
            if item is None:
                return
            args, done, errors = item
            try:
                copy_segments(*args)
            except BaseException as exc:
                errors.append(exc)
            done.set()

    def copy(
        self,
        dst: npt.NDArray[np.int64],
        src: npt.NDArray[np.int64],
        nbytes: npt.NDArray[np.int64],
        group: int = 1,
    ) -> None:
        n = len(nbytes)
        total = int(nbytes.sum()) if n else 0
        if total < self.MIN_SPLIT_BYTES or n < 2 or not self._lock.acquire(blocking=False):
            copy_segments(dst, src, nbytes, group)
            return
        try:
            parts = min(self.threads, n)
            cuts = np.searchsorted(
                np.cumsum(nbytes), [total * k // parts for k in range(1, parts)], side="right"
            )
            bounds = [0, *(int(c) for c in cuts), n]
            errors: list[BaseException] = []
            waits: list[threading.Event] = []
            for k in range(1, parts):
                a, b = bounds[k], bounds[k + 1]
                if a >= b:
                    continue
                done = threading.Event()
                self._queues[k - 1].put(((dst[a:b], src[a:b], nbytes[a:b], group), done, errors))
                waits.append(done)
            a, b = bounds[0], bounds[1]
            try:
                if a < b:
                    copy_segments(dst[a:b], src[a:b], nbytes[a:b], group)
            finally:
                for done in waits:
                    done.wait()
            if errors:
                raise errors[0]
        finally:
            self._lock.release()

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
    finished batch to ``complete`` on the loop with a single ``call_soon_threadsafe``.
    """

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        name: str,
        run: Callable[[list[Any]], None],
        complete: Callable[[list[Any]], None],
    ) -> None:
        self._loop = loop
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
            try:
                run(batch)
            except BaseException as exc:
                for job in batch:
                    job._error = exc
            call_soon_threadsafe_guarded(self._loop, self._complete, batch)

    def close(self) -> None:
        """Stop after the queued jobs; joins the worker thread (bounded)."""
        if not self._closed:
            self._closed = True
            self._queue.put(_STOP)
        self._thread.join(timeout=30)
