"""How much of a persistent tier one block takes, computed as the tiers compute it: for capacity planning
(``aiokv replay``) without opening a tier. Exported by :mod:`aiokv.tiers`; nothing heavy (torch) is imported
before a function is called."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from .._errors import InvalidArgumentError

if TYPE_CHECKING:
    from ._codec import SegmentSpec

__all__ = ["TIER_ENCODINGS", "encoded_payload_bytes", "tier_entry"]

TIER_ENCODINGS = ("raw", "fp8", "int8")
"""The encodings ``DiskTier(encoding=...)`` and ``RedisTier(encoding=...)`` accept."""

_DEFAULT_SEGMENT_BYTES = 1 << 30  # DiskTier's default (the slot count does not depend on it)


def encoded_payload_bytes(encoding: str, segments: Sequence[SegmentSpec], payload_bytes: int) -> int:
    """The bytes a tier stores for a block of ``payload_bytes`` made of ``segments``
    (:class:`aiokv.tiers._codec.SegmentSpec`) in ``encoding`` (``payload_bytes`` itself for ``raw``)."""
    from ._codec import make_codec

    codec = make_codec(encoding, segments, payload_bytes)
    return payload_bytes if codec is None else codec.encoded_bytes


def tier_entry(kind: str, payload_bytes: int, capacity_bytes: int | None = None) -> tuple[int, int | None]:
    """``(entry_bytes, blocks)`` of a ``kind`` tier (``"disk"``, ``"redis"``) storing payloads of
    ``payload_bytes``: the bytes one entry takes (a disk entry is page-aligned with its header; a Redis value
    is the header and the payload) and how many ``capacity_bytes`` hold (``None`` without a capacity)."""
    if not isinstance(payload_bytes, int) or payload_bytes <= 0:
        raise InvalidArgumentError(f"payload_bytes must be an int > 0, got {payload_bytes!r}")
    if capacity_bytes is not None and (not isinstance(capacity_bytes, int) or capacity_bytes < 0):
        raise InvalidArgumentError(f"capacity_bytes must be an int >= 0 or None, got {capacity_bytes!r}")
    if kind == "disk":
        from .disk._geometry import _Geometry  # aiokv.tiers.disk: torch; imported on use

        geo = _Geometry(payload_bytes, capacity_bytes or 0, _DEFAULT_SEGMENT_BYTES)
        return geo.entry_bytes, None if capacity_bytes is None else geo.num_slots
    if kind in ("redis", "redis-cluster"):
        from ._format import HEADER_SIZE

        entry = HEADER_SIZE + payload_bytes
        return entry, None if capacity_bytes is None else capacity_bytes // entry
    raise InvalidArgumentError(f"kind must be 'disk', 'redis' or 'redis-cluster', got {kind!r}")
