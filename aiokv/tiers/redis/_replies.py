"""What the server answered: the marker of a round trip that failed (:data:`_FAILED`), and the reading of a
reply or an error -- a refusal of the credentials or permissions (a configuration error, raised at open),
a server or cluster node that cannot serve now (a failure of the round trip), a timeout.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

# redis-py, imported absolutely: the top-level ``redis`` package, never this package (aiokv.tiers.redis).
try:  # redis is an optional extra (aiokv[redis]): importing aiokv must work without it
    from redis.exceptions import (
        AskError,
        AuthenticationError,
        AuthorizationError,
        ClusterDownError,
        NoPermissionError,
        ReadOnlyError,
        ResponseError,
        TryAgainError,
    )

    _IMPORT_ERROR: ImportError | None = None
except ImportError as exc:  # pragma: no cover - exercised only without the extra (RedisTier() raises then)
    _IMPORT_ERROR = exc

__all__ = ["_FAILED", "_Failed", "_first_unavailable", "_is_timeout", "_refusal", "_unavailable"]

_REFUSED_PREFIXES = ("NOAUTH", "WRONGPASS", "NOPERM")
_UNAVAILABLE_PREFIXES = ("LOADING", "MASTERDOWN", "CLUSTERDOWN", "TRYAGAIN", "READONLY", *_REFUSED_PREFIXES)


class _Failed:
    """Marker result of a round trip that did not happen or failed."""


_FAILED = _Failed()


def _is_timeout(exc: BaseException) -> bool:
    return isinstance(exc, TimeoutError) or "Timeout" in type(exc).__name__  # redis' is no builtin subclass


def _refusal(reply: object) -> BaseException | None:
    """The error in ``reply``'s chain (when it is an exception) saying the server refused the credentials or
    the user's permissions."""
    exc = reply if isinstance(reply, BaseException) else None
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, (AuthenticationError, AuthorizationError, NoPermissionError)):
            return exc
        if isinstance(exc, ResponseError) and str(exc).startswith(_REFUSED_PREFIXES):
            return exc
        exc = exc.__cause__ or exc.__context__
    return None


def _unavailable(reply: object) -> BaseException | None:
    """``reply`` when it says the server (or the node of its slot) cannot serve now; None for a value, and for
    a refusal of this one command (``WRONGTYPE`` of a foreign value, ``OOM`` under ``noeviction``...)."""
    if not isinstance(reply, BaseException):
        return None
    if not isinstance(reply, ResponseError):  # connection errors, timeouts, BusyLoadingError
        return reply
    if isinstance(reply, (ClusterDownError, TryAgainError, AskError, ReadOnlyError, NoPermissionError)):
        return reply
    return reply if str(reply).startswith(_UNAVAILABLE_PREFIXES) else None


def _first_unavailable(replies: Sequence[Any]) -> BaseException | None:
    for reply in replies:
        problem = _unavailable(reply)
        if problem is not None:
            return problem
    return None
