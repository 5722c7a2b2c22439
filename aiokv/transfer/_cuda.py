"""Every use of ``torch.cuda`` in aiokv lives in this module: the CUDA binding of the device protocol.

The device data path (ordering, coalescing, staging, completion) is written once in
:mod:`aiokv.transfer._device` against :class:`~aiokv.transfer._binding.DeviceBinding`; this module maps that
protocol onto torch.cuda streams and events, registers host memory with ``cudaHostRegister`` and implements
the block gather/scatter with ``index_select``/``index_copy_``. The same logic runs on
:class:`~aiokv.transfer.SimulatedDevice` in CI; tests of this binding are marked ``gpu``.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import torch

from .._errors import DeviceError, InvalidArgumentError, InvalidLayoutError
from ._binding import BlockCopier, DeviceBinding

if TYPE_CHECKING:
    from collections.abc import Callable

    from .._layout import KVLayout

__all__ = ["CudaDevice", "check_device", "cuda_available"]


def cuda_available() -> bool:
    """Whether this torch build and this machine can use CUDA (no context is created)."""
    return torch.cuda.is_available()


def check_device(spec: str, *, what: str = "device") -> torch.device:
    """``"cuda:1"`` -> ``torch.device("cuda", 1)`` when this torch build and machine can use it; otherwise
    :class:`InvalidArgumentError` saying why, in one line (``device 'cuda' cannot be used: torch 2.5.1+cpu is
    built without CUDA``). Accepts ``cpu``, ``cuda``, ``cuda:N`` and ``mps``; nothing is allocated and no CUDA
    context is created (the device count comes from the driver)."""
    if not isinstance(spec, str):
        raise InvalidArgumentError(
            f"{what} must be a string such as cpu or cuda:0, got {type(spec).__name__}"
        )
    try:
        dev = torch.device(spec.strip())
    except (RuntimeError, ValueError):
        dev = None
    if dev is None or dev.type not in ("cpu", "cuda", "mps"):
        raise InvalidArgumentError(f"{what} must be cpu, cuda, cuda:N or mps, got {spec!r}")
    why = None
    if dev.type == "cuda":
        count = torch.cuda.device_count()
        if not torch.backends.cuda.is_built():  # type: ignore[no-untyped-call]
            why = f"torch {torch.__version__} is built without CUDA"
        elif count == 0:
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            why = "no CUDA device is visible" + (
                f" (CUDA_VISIBLE_DEVICES={visible!r})" if visible is not None else ""
            )
        elif dev.index is not None and dev.index >= count:
            why = f"{count} CUDA device{'s are' if count > 1 else ' is'} visible (cuda:0 to cuda:{count - 1})"
    elif dev.type == "mps" and not torch.backends.mps.is_available():
        why = "MPS is not available (it needs an Apple GPU and a torch built with MPS)"
    if why is not None:
        raise InvalidArgumentError(f"{what} {spec!r} cannot be used: {why}")
    return dev


class CudaDevice(DeviceBinding):
    """The CUDA binding: torch.cuda streams and events on one device."""

    kind = "cuda"

    def __init__(self, device: torch.device | str | int | None = None) -> None:
        dev = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
        if dev.type != "cuda":
            raise InvalidLayoutError(f"device must be a cuda device, got {dev}")
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        self.device = dev

    # ----------------------------------------------------------------- streams and events
    def current_stream(self) -> torch.cuda.Stream:
        return torch.cuda.current_stream(self.device)

    def new_stream(self, name: str) -> torch.cuda.Stream:
        # The load pipe's stream gets the device's highest priority (torch clamps -1 into the supported range):
        # its scatter kernels are scheduled ahead of the store pipe's gathers and of compute kernels when they
        # compete for the SMs. Copy engines are not prioritized by the driver; each direction has its own.
        priority = -1 if name == "load" else 0
        return torch.cuda.Stream(device=self.device, priority=priority)  # type: ignore[no-untyped-call]

    def new_event(self, *, blocking: bool = False) -> torch.cuda.Event:
        # blocking=True: a host wait sleeps in the driver (cudaEventBlockingSync) instead of spinning a core.
        return torch.cuda.Event(enable_timing=False, blocking=blocking)  # type: ignore[no-untyped-call]

    def record(self, event: torch.cuda.Event, stream: torch.cuda.Stream) -> None:
        event.record(stream)

    def wait_event(self, stream: torch.cuda.Stream, event: torch.cuda.Event) -> None:
        stream.wait_event(event)

    def synchronize(self, event: torch.cuda.Event) -> None:
        event.synchronize()

    def query(self, event: torch.cuda.Event) -> bool:
        return bool(event.query())  # type: ignore[no-untyped-call]

    def synchronize_stream(self, stream: torch.cuda.Stream) -> None:
        stream.synchronize()

    def is_capturing(self, stream: torch.cuda.Stream) -> bool:
        if stream == torch.cuda.current_stream(self.device):
            return bool(torch.cuda.is_current_stream_capturing())
        with torch.cuda.stream(stream):
            return bool(torch.cuda.is_current_stream_capturing())

    def enter_thread(self) -> None:
        torch.cuda.set_device(self.device)

    def launch(self, stream: Any, fn: Callable[[], Any]) -> None:
        with torch.cuda.stream(stream):
            fn()

    # ----------------------------------------------------------------- memory
    def alloc(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def alloc_index(self, n: int) -> torch.Tensor:
        return torch.zeros(n, dtype=torch.int64, device=self.device)

    def alloc_pinned_index(self, n: int) -> torch.Tensor:
        # Small: the caching host allocator's rounding does not matter here, and it never shares a page
        # with a buffer registered by pin().
        return torch.zeros(n, dtype=torch.int64, pin_memory=True)

    def pin(self, host: torch.Tensor) -> None:
        nbytes = host.numel() * host.element_size()
        cudart = torch.cuda.cudart()  # type: ignore[no-untyped-call]
        err = cudart.cudaHostRegister(host.data_ptr(), nbytes, 0)
        if int(err) != 0:
            raise DeviceError(
                f"cudaHostRegister of {nbytes} bytes failed: {cudart.cudaGetErrorString(err)}"
                " (is RLIMIT_MEMLOCK large enough? see docs/guide.md)"
            )

    def unpin(self, host: torch.Tensor) -> None:
        torch.cuda.cudart().cudaHostUnregister(host.data_ptr())  # type: ignore[no-untyped-call]

    def is_pinned(self, host: torch.Tensor) -> bool:
        return bool(host.is_pinned())

    # ----------------------------------------------------------------- copies
    def copy(self, stream: Any, dst: torch.Tensor, src: torch.Tensor) -> None:
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)

    def block_copier(self, layout: KVLayout) -> BlockCopier:
        return _CudaCopier(layout)

    def describe(self) -> str:
        return f"cuda:{self.device.index} ({torch.cuda.get_device_name(self.device)})"


_UNITS = ((8, torch.int64), (4, torch.int32), (2, torch.int16), (1, torch.uint8))


class _CudaCopier(BlockCopier):
    """One ``index_select`` (gather) or ``index_copy_`` (scatter) per engine tensor per chunk, reading and
    writing each tensor's byte range of the slot-shaped staging rows in place (no temporaries).

    Tensors are viewed as the widest integer type that divides every segment, slot offset and base address,
    so the kernels move 8 bytes per element rather than one."""

    def __init__(self, layout: KVLayout) -> None:
        widths = [spec.outer * spec.inner_bytes for spec in layout.specs]
        offsets = [spec.slot_offset for spec in layout.specs]
        inner = [spec.inner_bytes for spec in layout.specs]
        addrs = [t.data_ptr() for t in layout.tensors]
        strides = [spec.block_stride for spec in layout.specs]
        if any(t.dim() - 1 <= layout.block_dim for t in layout.tensors):
            raise InvalidLayoutError("cuda layouts need at least one dimension after block_dim")
        last = [int(t.shape[-1]) * t.element_size() for t in layout.tensors]
        every = (*widths, *offsets, *inner, *addrs, *strides, *last, layout.slot_bytes)
        unit, dtype = next((u, d) for u, d in _UNITS if all(x % u == 0 for x in every))
        self._unit_dtype = dtype
        self._layers = layout.layers
        self._views: list[tuple[torch.Tensor, int, int, tuple[int, ...]]] = []
        for t, spec, width in zip(layout.tensors, layout.specs, widths, strict=True):
            u = t.view(torch.uint8).view(dtype).movedim(layout.block_dim, 0)
            self._views.append((u, spec.slot_offset // unit, width // unit, tuple(u.shape[1:])))

    def _rows(self, rows: torch.Tensor) -> torch.Tensor:
        return rows.view(self._unit_dtype)

    def gather(self, stream: Any, index: torch.Tensor, rows: torch.Tensor) -> None:
        r = self._rows(rows)
        with torch.cuda.stream(stream):
            for u, off, width, rest in self._views:
                torch.index_select(u, 0, index, out=r[:, off : off + width].unflatten(1, rest))  # type: ignore[no-untyped-call]

    def scatter(
        self, stream: Any, index: torch.Tensor, rows: torch.Tensor, *, layer: int | None = None
    ) -> None:
        r = self._rows(rows)
        views = self._views if layer is None else [self._views[i] for i in self._layers[layer]]
        with torch.cuda.stream(stream):
            for u, off, width, rest in views:
                u.index_copy_(0, index, r[:, off : off + width].unflatten(1, rest))  # type: ignore[no-untyped-call]
