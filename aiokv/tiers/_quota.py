"""Per-tenant byte quotas of a tier (``tenant_quota_bytes=``): the tenant is a request's canonical salt."""

from __future__ import annotations

from collections.abc import Callable, Mapping

from .._errors import InvalidArgumentError, InvalidTypeError
from .._hashing import _canon

__all__ = ["TenantQuotas", "check_quota"]


def check_quota(quota: object, salt: object) -> int | None:
    if quota is None:
        return None
    if isinstance(quota, bool) or not isinstance(quota, int):
        raise InvalidTypeError(
            f"tenant_quota_bytes for salt {salt!r} must be an int or None, got {type(quota).__name__}"
        )
    if quota < 0:
        raise InvalidArgumentError(f"tenant_quota_bytes for salt {salt!r} must be >= 0, got {quota}")
    return quota


class TenantQuotas:
    """A ``tenant_quota_bytes`` argument: a mapping of salt to bytes (checked here) or a callable
    ``salt -> bytes or None`` asked once per tenant, at :meth:`key`. ``None`` means no limit."""

    __slots__ = ("_bytes", "_fn")

    def __init__(self, spec: Mapping[object, int] | Callable[[object], int | None]) -> None:
        self._fn: Callable[[object], int | None] | None = None
        self._bytes: dict[bytes, int | None] = {}
        if isinstance(spec, Mapping):
            for salt, quota in spec.items():
                self._bytes[_canon(salt, "tenant_quota_bytes keys")] = check_quota(quota, salt)
        elif callable(spec):
            self._fn = spec
        else:
            raise InvalidTypeError(
                "tenant_quota_bytes must be a mapping of salt to bytes, a callable or None, got "
                f"{type(spec).__name__}"
            )

    def key(self, salt: object) -> bytes:
        """The tenant of ``salt`` (its canonical bytes); a callable is asked for a new tenant's quota."""
        key = _canon(salt)
        if self._fn is not None and key not in self._bytes:
            self._bytes[key] = check_quota(self._fn(salt), salt)
        return key

    def slots(self, unit_bytes: int) -> Callable[[bytes], int | None]:
        """``BlockIndex.set_tenant_quota``'s argument for slots of ``unit_bytes`` each."""
        quotas = self._bytes

        def quota_slots(tenant: bytes) -> int | None:
            q = quotas.get(tenant)
            return None if q is None else q // unit_bytes

        return quota_slots

    def limit_bytes(self, tenant: bytes) -> int | None:
        return self._bytes.get(tenant)
