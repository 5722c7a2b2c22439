"""Moved to :mod:`aiokv.transfer._cuda`, beside the device protocol it implements (issue 22).

A private alias kept for code outside the package that imported the old place; nothing in aiokv imports it,
and nothing here uses ``torch.cuda``.
"""

from .transfer._cuda import CudaDevice, check_device, cuda_available

__all__ = ["CudaDevice", "check_device", "cuda_available"]
