"""Interfaces of the tiers below the CPU tier.

The CPU tier is special: the engine's blocks are copied to and from its host buffer by the transfer executor.
Every lower tier (disk, Redis, ...) is a :class:`BackingTier`: it stores opaque, fixed-size *payloads* (one
CPU slot, i.e. one block of every KV tensor, :attr:`TierSpec.payload_bytes` long) under a block hash, and
never touches engine memory. The offloader writes blocks through to it after they land in the CPU tier and
stages them back into CPU slots on lookup.

Contract for implementations:
- ``write`` must have finished reading ``payloads`` when it returns (the CPU slot is unpinned then).
- ``read_into`` must verify each entry (header: magic, version, fingerprint, key, length; checksum over the
  payload) *before* the last byte is written to ``outs[i]``... and report failure for a corrupt, truncated or
  foreign entry, which then counts as a miss (and is dropped from the tier when possible). ``outs`` are
  scratch CPU slots that only become visible on success, so partially written data is harmless.
- No method raises for an unavailable backend (server down, disk full): it returns a miss / drops the write,
  counts it in ``stats()``, and returns within the tier's configured timeout.
"""

from __future__ import annotations

import asyncio
import enum
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from .._errors import InvalidArgumentError
from .._hashing import _canon

if TYPE_CHECKING:
    from ..events._emit import TierEvents

__all__ = ["BackingTier", "TierHealth", "TierSpec"]


class TierHealth(str, enum.Enum):
    """Health of a persistent tier, shown in its ``stats()`` (compares equal to its value string).

    - ``UP``: the last operation succeeded.
    - ``DEGRADED``: recent operations failed (I/O error, timeout), the tier keeps trying on every call.
    - ``DOWN``: the backend is considered gone; calls are answered locally (miss / dropped write) without
      touching it until a backoff interval has passed, then one call probes it.
    """

    UP = "up"
    DEGRADED = "degraded"
    DOWN = "down"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True, slots=True)
class TierSpec:
    """What a tier needs to know about the blocks it will hold."""

    payload_bytes: int  # bytes of one block across all KV tensors (one CPU slot)
    fingerprint: bytes  # 32 bytes: the layout fingerprint (block size, dtypes, per-block shapes) + model id
    block_size: int  # tokens per block
    description: str  # human readable layout summary, for error messages
    # The slot's tensors (aiokv.tiers._codec.SegmentSpec), for encodings other than "raw"; () when unknown
    # (a grouped layout, a spec built by hand): such a tier stores its blocks raw.
    segments: tuple[Any, ...] = ()


class BackingTier(ABC):
    """A tier below the CPU tier, holding fixed-size payloads keyed by 32-byte block hashes."""

    name: str = "backing"
    medium: str = "REMOTE"  # what KV events report this tier's blocks as ("DISK" for a local disk tier)
    kv_events: TierEvents | None = None  # the tier's event sink while an offloader with KV events uses it

    def attach_events(self, events: TierEvents | None) -> None:
        """Report content changes to ``events`` (called by the offloader before :meth:`open`; ``None``
        detaches). A tier reports a block *stored* once a lookup can find it, and *removed* when it evicts
        the block, drops it as corrupt or finds it gone; a wrapper forwards this to the tier it wraps."""
        self.kv_events = events

    @abstractmethod
    async def open(self, spec: TierSpec) -> None:
        """Bind to the layout and acquire resources (files, connections). Called once by the offloader."""

    @abstractmethod
    async def aclose(self) -> None:
        """Release resources. Idempotent and bounded in time."""

    @abstractmethod
    async def lookup(self, keys: Sequence[bytes]) -> int:
        """Number of leading ``keys`` this tier probably holds (one round trip). A later read may still miss."""

    @abstractmethod
    async def read_into(self, keys: Sequence[bytes], outs: Sequence[memoryview]) -> int:
        """Read and verify ``keys[i]`` into ``outs[i]`` (each ``payload_bytes`` long) in order; return how many
        leading keys were read and verified. Stops at the first miss."""

    @abstractmethod
    async def write(self, keys: Sequence[bytes], payloads: Sequence[memoryview]) -> int:
        """Store ``payloads[i]`` under ``keys[i]``; return how many were stored (the rest were dropped and
        counted). Existing keys may be skipped."""

    @abstractmethod
    def stats(self) -> Any:
        """A frozen dataclass of this tier's counters and health."""

    # Per-tenant quotas (optional; the defaults are a tier without them). The offloader asks
    # ``tenant_key(salt)`` at each ``open`` and writes through with ``write_tenants`` to a tier whose
    # ``has_tenant_quotas`` is true; every other tier only ever sees ``write``.
    @property
    def has_tenant_quotas(self) -> bool:
        """Whether this tier bounds the bytes each tenant's entries may hold (default ``False``)."""
        return False

    def tenant_key(self, salt: object) -> bytes:
        """The tenant a request with ``salt`` counts against: its canonical salt (a tier with a callable quota
        may ask it for that tenant's quota here)."""
        return _canon(salt)

    async def write_tenants(
        self, keys: Sequence[bytes], payloads: Sequence[memoryview], tenants: Sequence[bytes | None]
    ) -> int:
        """:meth:`write`, each key stored on behalf of ``tenants[i]`` (a :meth:`tenant_key`, ``None`` for no
        tenant). The default ignores the tenants."""
        return await self.write(keys, payloads)


def check_buffers(name: str, keys: Sequence[bytes], bufs: Sequence[memoryview], payload_bytes: int) -> None:
    """Raise :class:`InvalidArgumentError` unless ``bufs`` holds one C-contiguous ``payload_bytes``-long buffer
    per key (the argument checks shared by every backing tier's ``read_into`` and ``write``)."""
    if len(bufs) != len(keys):
        raise InvalidArgumentError(f"{name} must have one buffer per key ({len(keys)}), got {len(bufs)}")
    for i, buf in enumerate(bufs):
        if buf.nbytes != payload_bytes:
            raise InvalidArgumentError(
                f"{name}[{i}] must be payload_bytes={payload_bytes} bytes long, got {buf.nbytes}"
            )
        if not buf.c_contiguous:
            raise InvalidArgumentError(f"{name}[{i}] must be a C-contiguous buffer")


_T = TypeVar("_T")


async def wait_thread(fut: asyncio.Future[_T]) -> tuple[asyncio.Future[_T], bool]:
    """Wait for a worker-thread job even if the caller is cancelled meanwhile: the thread cannot be recalled
    and may still be reading or writing the caller's buffers. Returns the future and whether a cancellation
    arrived (the caller finishes its bookkeeping, then re-raises it). Used by the disk and Redis tiers."""
    cancelled = False
    while not fut.done():
        try:
            await asyncio.wait((fut,))
        except asyncio.CancelledError:
            cancelled = True
    return fut, cancelled
