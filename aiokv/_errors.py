"""The single exception hierarchy of aiokv.

Every error aiokv raises on purpose derives from :class:`AiokvError`. Errors about bad arguments also derive
from :class:`ValueError` or :class:`TypeError` so generic callers can catch them idiomatically. Messages are
lower case and name the parameter and the constraint that was violated.
"""

from __future__ import annotations

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


class AiokvError(Exception):
    """Base class of every error raised by aiokv."""


class InvalidArgumentError(AiokvError, ValueError):
    """An argument has the right type but a value outside its constraint."""


class InvalidTypeError(AiokvError, TypeError):
    """An argument has the wrong type."""


class InvalidLayoutError(InvalidArgumentError):
    """The engine's KV tensors do not form a valid paged layout (shapes, dtypes, devices)."""


class BlockRangeError(InvalidArgumentError):
    """An engine block id is outside ``[0, num_blocks)``."""


class CapacityError(InvalidArgumentError):
    """A tier's capacity cannot hold even one block."""


class DuplicateRequestError(InvalidArgumentError):
    """A request id is already open on this offloader."""


class RequestStateError(AiokvError, RuntimeError):
    """A request method was called in a state that does not allow it (e.g. ``step`` after ``finish``)."""


class ClosedError(AiokvError, RuntimeError):
    """The offloader (or executor, or tier) is closed."""


class TransferError(AiokvError, RuntimeError):
    """A copy between the engine and a tier failed; the affected entries were dropped."""


class WrongThreadError(AiokvError, RuntimeError):
    """An offloader or request method was called from a thread other than the one running the offloader's
    event loop. aiokv's state is mutated on that thread only; hand calls over with
    ``loop.call_soon_threadsafe`` (or ``asyncio.run_coroutine_threadsafe``)."""


class TierLockedError(AiokvError, RuntimeError):
    """A persistent tier's directory is already opened by another process."""


class MissingDependencyError(AiokvError, ImportError):
    """An optional dependency (an extra such as ``aiokv[plot]``) is not installed."""


class DeviceError(AiokvError, RuntimeError):
    """The device refused an operation: a stream being captured into a graph, host memory that cannot be
    page-locked, a copy that failed on the device."""


class EngineError(AiokvError, RuntimeError):
    """The reference engine cannot serve: it failed (the cause is chained) or its offloader was closed."""
