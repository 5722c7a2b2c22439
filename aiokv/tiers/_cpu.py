"""CPUTier: one preallocated host buffer of fixed-size slots plus a block index."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from .._errors import CapacityError, InvalidArgumentError, InvalidTypeError
from .._hashing import _canon
from ._index import BlockIndex
from ._policies import EvictionPolicy, make_policy
from ._quota import TenantQuotas

if TYPE_CHECKING:
    from .._layout import KVLayout
    from ..transfer._binding import DeviceBinding

__all__ = ["CPUTier", "CPUTierStats", "policy_name", "resolve_eviction"]


def resolve_eviction(
    tier: str | EvictionPolicy | None, offloader: str | EvictionPolicy | None
) -> str | EvictionPolicy:
    """The one eviction policy of a CPU tier, set on the tier or on the offloader (not both differently)."""
    if tier is None:
        return "lru" if offloader is None else offloader
    if offloader is None or offloader is tier or (isinstance(tier, str) and tier == offloader):
        return tier
    raise InvalidArgumentError(
        f"eviction must be set in one place, got {_name(offloader)} on the Offloader and "
        f"{_name(tier)} on its CPUTier"
    )


def policy_name(policy: object) -> str:
    """A name for an ``eviction=`` argument: the registered name, else the policy's own ``name``."""
    if isinstance(policy, str):
        return policy
    if isinstance(policy, EvictionPolicy):
        return policy.name
    return getattr(policy, "__name__", type(policy).__name__)


def _name(policy: object) -> str:
    return repr(policy) if isinstance(policy, str) else f"{policy_name(policy)!r} ({type(policy).__name__})"


@dataclass(frozen=True, slots=True)
class CPUTierStats:
    capacity_bytes: int
    slot_bytes: int
    num_slots: int
    used_slots: int
    ready: int
    pending: int
    pinned: int
    evictions: int
    rejected: int
    pinned_memory: bool
    eviction: str = ""  # the active eviction policy's name ("" before the tier is bound)


class CPUTier:
    """Host-memory tier: ``capacity_bytes // slot_bytes`` slots in one buffer allocated up front.

    For a device layout (CUDA, or a simulated device) the buffer is page-locked in place (``cudaHostRegister``
    of exactly the buffer: no rounding, released with the tier) so copies to and from it are asynchronous;
    ``pinned=False`` is refused there, because it would make every copy synchronous on the calling thread.
    A CPU layout's buffer is never pinned (the copy kernel gains nothing from it). ``stats().pinned_memory``
    reports what really happened. ``eviction`` is the tier's eviction policy; set it here or on the
    :class:`~aiokv.Offloader` (``eviction=``), not both: two different policies are refused rather than one
    silently winning. ``stats().eviction`` names the active one.
    """

    name = "cpu"

    def __init__(
        self,
        capacity_bytes: int,
        *,
        eviction: str | EvictionPolicy | None = None,
        pinned: bool | None = None,
        tenant_quota_bytes: Mapping[object, int] | Callable[[object], int | None] | None = None,
    ) -> None:
        if isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, int):
            raise InvalidTypeError(f"capacity_bytes must be an int, got {type(capacity_bytes).__name__}")
        if capacity_bytes <= 0:
            raise InvalidArgumentError(f"capacity_bytes must be > 0, got {capacity_bytes}")
        if pinned is not None and not isinstance(pinned, bool):
            raise InvalidTypeError(f"pinned must be a bool or None, got {type(pinned).__name__}")
        self.capacity_bytes = capacity_bytes
        self.eviction = eviction
        self.pinned = pinned
        # Tenant quotas: canonical salt -> bytes (a mapping, checked here), or a callable asked once per tenant.
        self.tenant_quota_bytes = tenant_quota_bytes
        self._quotas = TenantQuotas(tenant_quota_bytes) if tenant_quota_bytes is not None else None
        self._index: BlockIndex | None = None
        self._buffer: torch.Tensor | None = None
        self._device: DeviceBinding | None = None
        self._pinned_memory = False
        self._unpin_at_exit: weakref.finalize[Any, Any] | None = None
        self.slot_bytes = 0
        self._eviction_name = ""

    def bind(
        self,
        layout: KVLayout,
        default_eviction: str | EvictionPolicy | None = None,
        device: DeviceBinding | None = None,
    ) -> None:
        """Size the slots for ``layout`` and allocate the buffer (once); page-lock it for a ``device``.

        ``default_eviction`` is the offloader's ``eviction=``: used when the tier has none, refused when it
        names a different policy than the tier's own (``None``: the tier's, else ``"lru"``)."""
        if self._index is not None:
            raise InvalidArgumentError("a CPUTier can serve only one offloader")
        eviction = resolve_eviction(self.eviction, default_eviction)
        slot_bytes = layout.slot_bytes
        num_slots = self.capacity_bytes // slot_bytes
        if num_slots < 1:
            raise CapacityError(
                f"capacity_bytes must hold at least one block of {slot_bytes} bytes, got {self.capacity_bytes}"
            )
        if device is not None and self.pinned is False:
            raise InvalidArgumentError(
                f"pinned=False cannot serve a {device.kind} layout: copies from unpinned host memory are"
                " synchronous; leave pinned unset"
            )
        if device is None and self.pinned:
            raise InvalidArgumentError(
                "pinned=True needs a device layout (cuda or simulated); a cpu layout is copied by memcpy"
            )
        policy = make_policy(eviction, num_slots)
        self._eviction_name = eviction if isinstance(eviction, str) else policy.name
        buffer = torch.empty(num_slots * slot_bytes, dtype=torch.uint8)
        if device is not None:
            device.pin(buffer)  # raises DeviceError when the memory cannot be locked
            self._device = device
            self._pinned_memory = device.is_pinned(buffer)
            # An offloader that is never closed still unregisters the memory before it is freed.
            self._unpin_at_exit = weakref.finalize(self, device.unpin, buffer)
        self._buffer = buffer
        self._index = BlockIndex(num_slots, policy)
        self.slot_bytes = slot_bytes
        if self._quotas is not None:
            self._index.set_tenant_quota(self._quotas.slots(slot_bytes))

    @property
    def has_tenant_quotas(self) -> bool:
        return self.tenant_quota_bytes is not None

    def tenant_key(self, salt: object) -> bytes:
        """The tenant a request with ``salt`` counts against (its canonical salt). With a callable
        ``tenant_quota_bytes``, the first request of a tenant asks it for that tenant's quota."""
        if self._quotas is None:
            return _canon(salt)
        return self._quotas.key(salt)

    def tenant_bytes(self, salt: object) -> int:
        """Bytes of this tier's slots held by entries of the tenant with ``salt`` (0 without quotas)."""
        if self._index is None or not self.has_tenant_quotas:
            return 0
        return self._index.tenant_slots(_canon(salt)) * self.slot_bytes

    @property
    def index(self) -> BlockIndex:
        if self._index is None:
            raise InvalidArgumentError("CPUTier is not bound to a layout yet")
        return self._index

    @property
    def buffer(self) -> torch.Tensor:
        if self._buffer is None:
            raise InvalidArgumentError("CPUTier is not bound to a layout yet")
        return self._buffer

    def slot_view(self, slot: int) -> memoryview:
        """A writable memoryview of one slot (for lower tiers reading or staging payloads)."""
        buf = self.buffer
        start = slot * self.slot_bytes
        return buf[start : start + self.slot_bytes].numpy().data

    def slot_tensor(self, slot: int) -> torch.Tensor:
        start = slot * self.slot_bytes
        return self.buffer[start : start + self.slot_bytes]

    def release(self) -> None:
        """Drop the buffer (unpinning it). Only once nothing copies to or from it any more."""
        self._buffer = None
        if self._unpin_at_exit is not None:
            self._unpin_at_exit()  # unpins once
            self._unpin_at_exit = None
            self._pinned_memory = False

    def stats(self) -> CPUTierStats:
        if self._index is None:
            return CPUTierStats(self.capacity_bytes, 0, 0, 0, 0, 0, 0, 0, 0, False, "")
        s = self._index.stats()
        return CPUTierStats(
            capacity_bytes=self.capacity_bytes,
            slot_bytes=self.slot_bytes,
            num_slots=s.num_slots,
            used_slots=s.used_slots,
            ready=s.ready,
            pending=s.pending,
            pinned=s.pinned,
            evictions=s.evictions,
            rejected=s.rejected,
            pinned_memory=self._pinned_memory,
            eviction=self._eviction_name,
        )

    def __repr__(self) -> str:
        return f"CPUTier(capacity_bytes={self.capacity_bytes})"
