"""The stream/event protocol the device data path is written against, once, for every device.

A :class:`DeviceBinding` offers CUDA's execution model in a handful of calls: *streams* run the work
enqueued on them later and in order; an *event* recorded on a stream marks a point in it; ``wait_event``
makes a stream wait on the device (not the host) for such a point; the host can query or block on an event.
Waiting on an event that was never recorded does nothing, as in CUDA; recording an event again moves its
point for waits issued afterwards only.

Two bindings implement it: :class:`aiokv.transfer._cuda.CudaDevice` (torch.cuda) and
:class:`aiokv.transfer.SimulatedDevice` (worker threads with CUDA's semantics, seeded delays, pausable
streams and fault injection), so the ordering, coalescing, staging and completion logic of
:mod:`aiokv.transfer._device` is tested on every machine.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .._errors import InvalidArgumentError

if TYPE_CHECKING:
    import torch

    from .._layout import KVLayout

__all__ = ["BlockCopier", "DeviceBinding"]


class BlockCopier(ABC):
    """Gathers engine blocks into staging rows and scatters them back, on a stream.

    Staging rows are laid out exactly like the CPU tier's slots (:attr:`KVLayout.slot_bytes` each), so a
    run of consecutive slots is one contiguous copy between staging and host memory.
    """

    @abstractmethod
    def gather(self, stream: Any, index: torch.Tensor, rows: torch.Tensor) -> None:
        """Enqueue ``rows[i] <- engine block index[i]`` for every i (``index`` lives in device memory)."""

    @abstractmethod
    def scatter(
        self, stream: Any, index: torch.Tensor, rows: torch.Tensor, *, layer: int | None = None
    ) -> None:
        """Enqueue ``engine block index[i] <- rows[i]`` for every i; with ``layer``, only that layer's tensors
        (:attr:`KVLayout.layers`), read from their bytes of the rows."""


class DeviceBinding(ABC):
    """One device's streams, events, memory and copies. Only the loop thread and aiokv's own worker threads
    call it; every method that takes a stream enqueues work and returns without waiting for it."""

    #: "cuda" or "sim"; shown in stats.
    kind: str = "device"

    # ----------------------------------------------------------------- streams and events
    @abstractmethod
    def current_stream(self) -> Any:
        """The calling thread's current stream (the engine's compute stream unless told otherwise)."""

    @abstractmethod
    def new_stream(self, name: str) -> Any:
        """A new stream, independent of every other."""

    @abstractmethod
    def new_event(self, *, blocking: bool = False) -> Any:
        """A new event. ``blocking=True``: host waits sleep instead of spinning."""

    @abstractmethod
    def record(self, event: Any, stream: Any) -> None:
        """Mark the current end of ``stream``'s work in ``event``."""

    @abstractmethod
    def wait_event(self, stream: Any, event: Any) -> None:
        """Make work enqueued on ``stream`` from now on wait for ``event``'s point (no host wait)."""

    @abstractmethod
    def synchronize(self, event: Any) -> None:
        """Block the calling thread until ``event``'s point is reached; raises a device error that occurred
        on the way. Must not spin a core."""

    @abstractmethod
    def query(self, event: Any) -> bool:
        """True once ``event``'s point is reached (or if it was never recorded)."""

    @abstractmethod
    def synchronize_stream(self, stream: Any) -> None:
        """Block until everything enqueued on ``stream`` so far is done. The last resort after a failure
        that left no event to wait for."""

    @abstractmethod
    def is_capturing(self, stream: Any) -> bool:
        """True while ``stream`` is being captured into a graph: work cannot be ordered after it then."""

    def enter_thread(self) -> None:  # noqa: B027 - optional hook
        """Called first by every aiokv worker thread that uses the device (selects it)."""

    def launch(self, stream: Any, fn: Callable[[], Any]) -> None:
        """Run ``fn`` as ``stream``'s work: CUDA runs it now with ``stream`` current, so the kernels it
        launches are queued there; the simulated device runs it later on the stream's worker. For engines
        (the reference engine launches its forward this way)."""
        raise NotImplementedError

    # ----------------------------------------------------------------- memory
    @abstractmethod
    def alloc(self, nbytes: int) -> torch.Tensor:
        """``nbytes`` of device memory as a 1-d uint8 tensor (allocated once, up front)."""

    @abstractmethod
    def alloc_index(self, n: int) -> torch.Tensor:
        """A 1-d int64 device tensor of ``n`` elements."""

    @abstractmethod
    def alloc_pinned_index(self, n: int) -> torch.Tensor:
        """A 1-d int64 page-locked host tensor of ``n`` elements."""

    @abstractmethod
    def pin(self, host: torch.Tensor) -> None:
        """Page-lock an existing host buffer in place (no copy, no rounding). Raises on failure."""

    @abstractmethod
    def unpin(self, host: torch.Tensor) -> None:
        """Undo :meth:`pin`."""

    @abstractmethod
    def is_pinned(self, host: torch.Tensor) -> bool:
        """True when ``host`` is page-locked (asynchronous copies to and from it are truly asynchronous)."""

    # ----------------------------------------------------------------- copies
    @abstractmethod
    def copy(self, stream: Any, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Enqueue a copy between two contiguous tensors of equal size (host <-> device or device <-> device).
        The host side must be pinned."""

    def copy_rows(self, stream: Any, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Enqueue a copy between two 2-d views of equal shape whose rows are contiguous but not adjacent (a
        layer's bytes of consecutive slots). This default enqueues one :meth:`copy` per row; a binding with a
        strided copy (``cudaMemcpy2DAsync``) can do it in one."""
        if dst.dim() != 2 or src.dim() != 2 or dst.shape != src.shape:
            raise InvalidArgumentError("copy_rows needs two 2-d tensors of the same shape")
        for i in range(int(dst.shape[0])):
            self.copy(stream, dst[i], src[i])

    @abstractmethod
    def block_copier(self, layout: KVLayout) -> BlockCopier:
        """The gather/scatter kernels for ``layout``'s engine tensors."""

    # ----------------------------------------------------------------- description
    def describe(self) -> str:
        return self.kind
