"""A block as Redis values: the size limits, how an entry (header + payload) is cut into parts of at most
one value each (:class:`_Split`, one Redis key per part), and how the parts read back are verified and
assembled into the caller's buffer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .._base import TierSpec
from .._format import HEADER_SIZE, Verdict, check_entry, check_header

__all__ = ["DEFAULT_MAX_VALUE_BYTES", "_Split", "_as_bytes", "_assemble"]

DEFAULT_MAX_VALUE_BYTES = 512 << 20
"""The largest value Redis and Valkey accept by default (their ``proto-max-bulk-len``)."""
_MIN_VALUE_BYTES = 4096
_SMALLEST_SERVER_LIMIT = 1 << 20  # proto-max-bulk-len cannot be set lower


@dataclass(frozen=True, slots=True)
class _Split:
    """How a block's entry (header + payload) is cut into values of at most ``part_bytes``."""

    entry_bytes: int
    part_bytes: int

    @classmethod
    def of(cls, entry_bytes: int, max_value_bytes: int) -> _Split:
        return cls(entry_bytes, min(entry_bytes, max_value_bytes))

    @property
    def parts(self) -> int:
        return -(-self.entry_bytes // self.part_bytes)

    def bounds(self) -> list[tuple[int, int]]:
        """``(start, end)`` of each part in the entry."""
        step = self.part_bytes
        return [(j, min(j + step, self.entry_bytes)) for j in range(0, self.entry_bytes, step)]


def _assemble(
    key: bytes, values: Sequence[Any], out: memoryview, spec: TierSpec, split: _Split
) -> Verdict | None:
    """Verify block ``key`` from its values and copy its payload into ``out``. None: a miss (a value is
    absent or could not be read); else the verdict (anything but OK means the entry is corrupt or foreign).
    ``out`` is scratch: it may hold partial data when the verdict is not OK."""
    for value in values:
        if value is None:
            return None
        if isinstance(value, BaseException):  # WRONGTYPE: a value of another kind under our key
            return Verdict.BAD_HEADER if str(value).startswith("WRONGTYPE") else None
    fingerprint, payload_len = spec.fingerprint, spec.payload_bytes
    dst = _as_bytes(out)
    if len(values) == 1:
        entry = memoryview(values[0])
        verdict = check_entry(
            entry[:HEADER_SIZE],
            entry[HEADER_SIZE:],
            fingerprint=fingerprint,
            key=key,
            payload_len=payload_len,
        )
        if verdict is Verdict.OK:
            dst[:] = entry[HEADER_SIZE:]
        return verdict
    bounds = split.bounds()
    if any(len(v) != end - start for v, (start, end) in zip(values, bounds, strict=True)):
        return Verdict.WRONG_LENGTH
    head = check_header(values[0], fingerprint=fingerprint, payload_len=payload_len, key=key)
    if isinstance(head, Verdict):
        return head
    for value, (start, end) in zip(values, bounds, strict=True):
        lo = max(start, HEADER_SIZE)
        dst[lo - HEADER_SIZE : end - HEADER_SIZE] = memoryview(value)[lo - start :]
    return check_entry(
        values[0][:HEADER_SIZE], dst, fingerprint=fingerprint, key=key, payload_len=payload_len
    )


def _as_bytes(buf: memoryview) -> memoryview:
    return buf if buf.format == "B" and buf.ndim == 1 else buf.cast("B")
