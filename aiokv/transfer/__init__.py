"""The transfer layer: copies between an engine's KV blocks and host slots.

- :class:`TransferExecutor` and :class:`TransferFuture`: ordered copy streams per direction, futures for
  accepted copies, coalescing of one loop tick's copies into one submission.
- Device data path (:mod:`._device`) written once against :class:`DeviceBinding`, with two bindings: CUDA
  (``aiokv._cuda.CudaDevice``) and :class:`SimulatedDevice` (CUDA's stream semantics on worker threads).
"""

from ._binding import BlockCopier, DeviceBinding
from ._device import DeviceStats, Mark
from ._executor import DEFAULT_STAGING_BYTES, ExecutorStats, TransferExecutor
from ._future import TransferFuture
from ._simdevice import SimStream, SimulatedDevice, SimulatedDeviceError

__all__ = [
    "DEFAULT_STAGING_BYTES",
    "BlockCopier",
    "DeviceBinding",
    "DeviceStats",
    "ExecutorStats",
    "Mark",
    "SimStream",
    "SimulatedDevice",
    "SimulatedDeviceError",
    "TransferExecutor",
    "TransferFuture",
]
