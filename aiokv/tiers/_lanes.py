"""A thread pool with two lanes, so that a tier's reads (loads) never queue behind its writes (stores).

:class:`LanePool` runs ``threads`` worker threads over two FIFO queues. A free thread always takes the oldest
*read* job first; *write* jobs run only when no read is waiting, and on at most ``write_threads`` threads at
once (by default all threads but one), so a read submitted while writes are queued or running starts as soon
as one thread is free, at worst after the write jobs already running (a job on a thread cannot be recalled).
It is a :class:`concurrent.futures.Executor`: ``submit`` (what ``loop.run_in_executor`` calls) is the read
lane, :meth:`submit_write` the write lane.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Executor, Future
from typing import Any, TypeVar

__all__ = ["LanePool"]

T = TypeVar("T")

_Job = tuple["Future[Any]", Callable[..., Any], tuple[Any, ...]]


class LanePool(Executor):
    """``threads`` workers; read jobs first, write jobs on at most ``write_threads`` of them (see the module)."""

    def __init__(self, threads: int, *, write_threads: int | None = None, name: str = "aiokv-lanes") -> None:
        if threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        self.threads = threads
        self.write_threads = (
            write_threads if write_threads is not None else max(1, threads - 1)
        )  # one thread left free for reads when there are several
        if not 1 <= self.write_threads <= threads:
            raise ValueError(f"write_threads must be in [1, {threads}], got {write_threads}")
        self._cv = threading.Condition()
        self._reads: deque[_Job] = deque()
        self._writes: deque[_Job] = deque()
        self._writing = 0  # write jobs running now
        self._shutdown = False
        self.reads_started = 0
        self.writes_started = 0
        self.reads_ahead_of_writes = 0  # read jobs started while write jobs were waiting
        self._workers = [
            threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True) for i in range(threads)
        ]
        for t in self._workers:
            t.start()

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> Future[T]:
        """Run ``fn(*args)`` in the read lane."""
        return self._put(self._reads, fn, args, kwargs)

    def submit_write(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> Future[T]:
        """Run ``fn(*args)`` in the write lane (after every read waiting at the time a thread frees up)."""
        return self._put(self._writes, fn, args, kwargs)

    def _put(
        self, lane: deque[_Job], fn: Callable[..., T], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Future[T]:
        fut: Future[T] = Future()
        call: Callable[..., Any] = (lambda: fn(*args, **kwargs)) if kwargs else fn
        with self._cv:
            if self._shutdown:
                raise RuntimeError("cannot schedule new futures after shutdown")
            lane.append((fut, call, () if kwargs else args))
            self._cv.notify()
        return fut

    def _next(self) -> tuple[_Job, bool] | None:
        """The next job and whether it is a write; ``None`` once shut down and drained. Holds the lock."""
        while True:
            if self._reads:
                if self._writes:
                    self.reads_ahead_of_writes += 1
                self.reads_started += 1
                return self._reads.popleft(), False
            if self._writes and self._writing < self.write_threads:
                self._writing += 1
                self.writes_started += 1
                return self._writes.popleft(), True
            if self._shutdown and not self._writes:
                return None
            self._cv.wait()

    def _work(self) -> None:
        cv = self._cv
        while True:
            with cv:
                item = self._next()
            if item is None:
                return
            (fut, fn, args), write = item
            if fut.set_running_or_notify_cancel():
                try:
                    result = fn(*args)
                except BaseException as exc:
                    fut.set_exception(exc)
                else:
                    fut.set_result(result)
            del fut, fn, args
            if write:
                with cv:
                    self._writing -= 1
                    cv.notify_all()  # a write waiting for a write thread may go now (or all may stop)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Stop once the queued jobs ran (``cancel_futures``: cancel those not started instead)."""
        with self._cv:
            self._shutdown = True
            if cancel_futures:
                for lane in (self._reads, self._writes):
                    while lane:
                        lane.popleft()[0].cancel()
            self._cv.notify_all()
        if wait:
            for t in self._workers:
                t.join()
