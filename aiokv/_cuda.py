"""Every use of ``torch.cuda`` in aiokv lives in this module.

Keeping CUDA in one place makes the CPU path importable and testable on machines without a GPU, and makes
the stream/event discipline reviewable in one file. Tests of this module are marked ``gpu``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch

__all__ = [
    "CudaCopyStream",
    "alloc_host_buffer",
    "cuda_available",
]


def cuda_available() -> bool:
    return torch.cuda.is_available()


def alloc_host_buffer(num_bytes: int, *, pinned: bool) -> torch.Tensor:
    """One uint8 host buffer; page-locked when ``pinned`` (needed for async D2H/H2D copies)."""
    if pinned and torch.cuda.is_available():
        return torch.empty(num_bytes, dtype=torch.uint8, pin_memory=True)
    return torch.empty(num_bytes, dtype=torch.uint8)


class CudaCopyStream:
    """A dedicated CUDA stream for one direction of copies, with completion delivered off the loop thread.

    ``enqueue(work, after_compute)`` runs ``work()`` (which issues async copies/kernels) on this stream,
    optionally ordered after everything already queued on the engine's current compute stream, records an
    event, and returns it. A single waiter thread synchronizes events in FIFO order and calls ``on_done``;
    the event loop never blocks on the GPU.
    """

    def __init__(self, device: torch.device, name: str, compute_stream: Any = None) -> None:
        self.device = device
        self._compute = compute_stream  # None: the current stream of the submitting thread
        self.stream = torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]
        self._name = name
        self._cv = threading.Condition()
        self._queue: list[tuple[torch.cuda.Event, Callable[[BaseException | None], None]]] = []
        self._closed = False
        self._thread = threading.Thread(target=self._wait_loop, name=f"aiokv-cuda-{name}", daemon=True)
        self._thread.start()

    def enqueue(
        self,
        work: Callable[[torch.cuda.Stream], Any],
        on_done: Callable[[BaseException | None], None],
        *,
        after_compute: bool,
    ) -> torch.cuda.Event:
        compute = self._compute if self._compute is not None else torch.cuda.current_stream(self.device)
        with torch.cuda.stream(self.stream):
            if after_compute:
                # Stores read blocks the engine just wrote: order them after its queued kernels.
                self.stream.wait_stream(compute)
            work(self.stream)
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record(self.stream)
        with self._cv:
            self._queue.append((event, on_done))
            self._cv.notify()
        return event

    def _wait_loop(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._closed:
                    self._cv.wait()
                if not self._queue:
                    return
                event, on_done = self._queue.pop(0)
            error: BaseException | None = None
            try:
                event.synchronize()
            except BaseException as exc:  # pragma: no cover - device errors
                error = exc
            on_done(error)

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify()
        self._thread.join(timeout=30)


def record_stream(tensor: torch.Tensor, stream: torch.cuda.Stream) -> None:
    """Tell the caching allocator that ``tensor`` is used on ``stream`` (keeps temporaries alive)."""
    tensor.record_stream(stream)


class CudaTransferBackend:
    """Block copies between a CUDA engine cache and a pinned host buffer, one stream per direction.

    A store gathers the engine blocks into a device staging buffer laid out slot by slot (``index_select`` per
    tensor, a device-bandwidth kernel), then copies runs of consecutive slots to the host with one
    ``cudaMemcpyAsync`` each. A load is the mirror image (host runs -> staging -> ``index_copy_``).
    """

    def __init__(self, layout: Any, host: torch.Tensor, compute_stream: Any = None) -> None:
        self._layout = layout
        self._device = layout.device
        slot_bytes = layout.slot_bytes
        self._host2d = host.view(-1, slot_bytes)
        # Per tensor: a uint8 view indexed by block on dim 0, and its byte range within a slot.
        self._views: list[tuple[torch.Tensor, int, int, tuple[int, ...]]] = []
        for t, spec in zip(layout.tensors, layout.specs):
            u8 = t.view(torch.uint8).movedim(layout.block_dim, 0)
            width = spec.outer * spec.inner_bytes
            self._views.append((u8, spec.slot_offset, width, tuple(u8.shape[1:])))
        self._store = CudaCopyStream(self._device, "store", compute_stream)
        self._load = CudaCopyStream(self._device, "load", compute_stream)

    @staticmethod
    def _runs(block_ids: list[int], slot_ids: list[int]) -> list[tuple[int, int, int]]:
        """(first index, first slot, length) for each run of consecutive slots."""
        runs: list[tuple[int, int, int]] = []
        i = 0
        n = len(slot_ids)
        while i < n:
            j = i + 1
            while j < n and slot_ids[j] == slot_ids[j - 1] + 1:
                j += 1
            runs.append((i, slot_ids[i], j - i))
            i = j
        return runs

    def enqueue(
        self,
        store: bool,
        block_ids: list[int],
        slot_ids: list[int],
        on_done: Callable[[BaseException | None], None],
    ) -> torch.cuda.Event:
        n = len(block_ids)
        slot_bytes = self._layout.slot_bytes
        runs = self._runs(block_ids, slot_ids)

        def work(stream: torch.cuda.Stream) -> None:
            idx = torch.tensor(block_ids, dtype=torch.long, device="cpu").to(self._device, non_blocking=True)
            staging = torch.empty((n, slot_bytes), dtype=torch.uint8, device=self._device)
            if store:
                for u8, off, width, rest in self._views:
                    staging[:, off : off + width].unflatten(1, rest).copy_(u8.index_select(0, idx))  # type: ignore[no-untyped-call]
                for i, s, k in runs:
                    self._host2d[s : s + k].copy_(staging[i : i + k], non_blocking=True)
            else:
                for i, s, k in runs:
                    staging[i : i + k].copy_(self._host2d[s : s + k], non_blocking=True)
                for u8, off, width, rest in self._views:
                    u8.index_copy_(0, idx, staging[:, off : off + width].unflatten(1, rest))  # type: ignore[no-untyped-call]
            staging.record_stream(stream)
            idx.record_stream(stream)

        target = self._store if store else self._load
        # Both directions wait for the compute stream: stores read blocks it just wrote, loads overwrite blocks
        # whose previous owner's kernels may still be queued there.
        return target.enqueue(work, on_done, after_compute=True)

    def close(self) -> None:
        self._store.close()
        self._load.close()
