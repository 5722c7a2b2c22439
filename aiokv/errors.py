"""Every exception aiokv raises on purpose: one hierarchy under :class:`AiokvError`.

Errors about a bad argument also derive from :class:`ValueError` (:class:`InvalidArgumentError` and its
subclasses) or :class:`TypeError` (:class:`InvalidTypeError`); errors about state from :class:`RuntimeError`;
:class:`MissingDependencyError` from :class:`ImportError`. So generic callers can catch them idiomatically, and
``except aiokv.AiokvError`` catches all of them.

This module is their documented home. Each is also importable from the top level (``except aiokv.ClosedError``),
now and later, without a warning; only :class:`AiokvError` is listed in ``aiokv.__all__``.
"""

from ._errors import (
    AiokvError,
    BlockRangeError,
    CapacityError,
    ClosedError,
    DeviceError,
    DuplicateRequestError,
    EngineError,
    InvalidArgumentError,
    InvalidLayoutError,
    InvalidTypeError,
    MissingDependencyError,
    RequestStateError,
    TierLockedError,
    TransferError,
    WrongThreadError,
)

__all__ = [
    "AiokvError",
    "BlockRangeError",
    "CapacityError",
    "ClosedError",
    "DeviceError",
    "DuplicateRequestError",
    "EngineError",
    "InvalidArgumentError",
    "InvalidLayoutError",
    "InvalidTypeError",
    "MissingDependencyError",
    "RequestStateError",
    "TierLockedError",
    "TransferError",
    "WrongThreadError",
]
