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

__all__ = ["GATHER_GROUP", "HAVE_NATIVE", "SCATTER_GROUP", "CPUStream", "copy_segments"]

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


# Interleaving for gathers (scattered sources, sequential destination) and for scatters; see _copy.c.
GATHER_GROUP = 6
SCATTER_GROUP = 1


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


_STOP = object()


class CPUStream:
    """A FIFO of copy jobs executed by one worker thread; completion is delivered on the loop.

    ``submit(job)`` enqueues immediately. The worker drains whatever is queued, runs ``run(job)`` for each in
    order (an exception becomes the job's ``_error``) and hands the finished batch to ``complete`` on the loop
    with a single ``call_soon_threadsafe``.
    """

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        name: str,
        run: Callable[[Any], None],
        complete: Callable[[list[Any]], None],
    ) -> None:
        self._loop = loop
        self._run_job = run
        self._complete = complete
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._work, name=f"aiokv-{name}", daemon=True)
        self._closed = False
        self._thread.start()

    def submit(self, job: Any) -> None:
        if self._closed:
            raise RuntimeError("stream is closed")
        self._queue.put(job)

    def _work(self) -> None:
        get = self._queue.get
        get_nowait = self._queue.get_nowait
        run = self._run_job
        stop = False
        while not stop:
            batch = [get()]
            while True:
                try:
                    batch.append(get_nowait())
                except queue.Empty:
                    break
            if batch[-1] is _STOP:
                batch.pop()
                stop = True
            for job in batch:
                try:
                    run(job)
                except BaseException as exc:
                    job._error = exc
            if batch:
                call_soon_threadsafe_guarded(self._loop, self._complete, batch)

    def close(self) -> None:
        """Stop after the queued jobs; joins the worker thread (bounded)."""
        if not self._closed:
            self._closed = True
            self._queue.put(_STOP)
        self._thread.join(timeout=30)
