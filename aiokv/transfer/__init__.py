"""The transfer layer: copies between an engine's KV blocks and host slots.

- :class:`TransferExecutor` and :class:`TransferFuture`: ordered copy streams per direction, futures for
  accepted copies, coalescing of one loop tick's copies into one submission.
- The device data path (``aiokv/transfer/_device.py``), written once against :class:`DeviceBinding`, with two
  bindings: CUDA (:class:`CudaDevice`, in ``aiokv/transfer/_cuda.py``, the one module that uses ``torch.cuda``;
  :func:`check_device` and :func:`cuda_available` are its checks) and :class:`SimulatedDevice` (CUDA's stream
  semantics on worker threads, for tests and benchmarks on machines without a GPU). See docs/devices.md.

Names are imported on first use.
"""

import typing

from .. import _lazy

if typing.TYPE_CHECKING:
    from ._binding import BlockCopier, DeviceBinding
    from ._cuda import CudaDevice, check_device, cuda_available
    from ._device import DeviceStats, Mark
    from ._executor import DEFAULT_STAGING_BYTES, ExecutorStats, TransferExecutor
    from ._future import TransferFuture
    from ._simdevice import SimStream, SimulatedDevice, SimulatedDeviceError

__getattr__, __dir__ = _lazy.attach(
    __name__,
    {
        "BlockCopier": "._binding",
        "DeviceBinding": "._binding",
        "CudaDevice": "._cuda",
        "check_device": "._cuda",
        "cuda_available": "._cuda",
        "DeviceStats": "._device",
        "Mark": "._device",
        "DEFAULT_STAGING_BYTES": "._executor",
        "ExecutorStats": "._executor",
        "TransferExecutor": "._executor",
        "TransferFuture": "._future",
        "SimStream": "._simdevice",
        "SimulatedDevice": "._simdevice",
        "SimulatedDeviceError": "._simdevice",
    },
)

__all__ = [
    "DEFAULT_STAGING_BYTES",
    "BlockCopier",
    "CudaDevice",
    "DeviceBinding",
    "DeviceStats",
    "ExecutorStats",
    "Mark",
    "SimStream",
    "SimulatedDevice",
    "SimulatedDeviceError",
    "TransferExecutor",
    "TransferFuture",
    "check_device",
    "cuda_available",
]
