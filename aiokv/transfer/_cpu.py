"""Ordered worker-thread "streams" for the CPU backend, and the native copy kernel."""

from __future__ import annotations

import asyncio
import ctypes
import queue
import statistics
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
    from .._native._copy import CopyJob as _CopyJob
    from .._native._copy import copy_segments as _native_copy

    HAVE_NATIVE = True
except ImportError:  # pragma: no cover - exercised only without a C compiler
    _native_copy = None  # type: ignore[assignment]
    _CopyJob = None  # type: ignore[assignment,misc]
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
    dst: npt.NDArray[np.int64],
    src: npt.NDArray[np.int64],
    nbytes: npt.NDArray[np.int64],
    group: int = 1,
    stream: bool | None = None,
) -> None:
    """memcpy every segment ``src[i] -> dst[i]`` (``nbytes[i]`` bytes), merging adjacent runs, GIL released.

    ``group`` > 1 interleaves that many runs (helps when the sources are scattered). ``stream``: streaming
    (non-temporal) stores, or plain memcpy; ``None`` chooses by size (streaming from 4 MiB). A piece of a
    larger batch passes the batch's choice, so it is copied (and timed) the way the batch is."""
    if _native_copy is not None:
        _native_copy(dst, src, nbytes, group, 512, -1 if stream is None else int(stream))
    else:  # pragma: no cover
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
        dst: npt.NDArray[np.int64],
        src: npt.NDArray[np.int64],
        nbytes: npt.NDArray[np.int64],
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
        job = _CopyJob(dst, src, nbytes, group, 512, self.PART_BYTES)
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
