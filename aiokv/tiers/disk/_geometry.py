"""Where entries live in a disk tier directory: the fixed entry size, the slots of each segment file, and
the runs of consecutive slots that one vectored ``pwritev`` / ``preadv`` call moves.

Every entry occupies ``entry_bytes = round_up(128 + payload_bytes, 4096)`` bytes (the header of
:mod:`aiokv.tiers._format`, the payload, zero padding); slot ``s`` is entry ``s % slots_per_segment`` of segment
file ``s // slots_per_segment``.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from .._format import HEADER_SIZE

__all__ = ["ALIGN", "_Geometry"]

ALIGN = 4096
_IOV_MAX = max(3, min(os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024, 1024))
# One pwritev/preadv call moves at most one entry or this much: the checksum of a run is computed right
# before it is written / right after it is read, while the run is still in the CPU caches.
_RUN_BYTES = 1 << 20


def _round_up(n: int, align: int) -> int:
    return (n + align - 1) // align * align


class _Geometry:
    __slots__ = ("entry_bytes", "num_segments", "num_slots", "pad", "payload_bytes", "slots_per_segment")

    def __init__(self, payload_bytes: int, capacity_bytes: int, segment_bytes: int) -> None:
        self.payload_bytes = payload_bytes
        self.entry_bytes = _round_up(HEADER_SIZE + payload_bytes, ALIGN)
        self.pad = self.entry_bytes - HEADER_SIZE - payload_bytes
        self.num_slots = capacity_bytes // self.entry_bytes
        self.slots_per_segment = max(1, segment_bytes // self.entry_bytes)
        self.num_segments = -(-self.num_slots // self.slots_per_segment)

    def segment_slots(self, seg: int) -> int:
        return min(self.slots_per_segment, self.num_slots - seg * self.slots_per_segment)

    def locate(self, slot: int) -> tuple[int, int]:
        seg, j = divmod(slot, self.slots_per_segment)
        return seg, j * self.entry_bytes

    def runs(self, slots: Sequence[int], order: Sequence[int]) -> list[list[int]]:
        """Split ``order`` (indices into ``slots``) into runs of consecutive slots of one segment, each small
        enough for one vectored call."""
        runs: list[list[int]] = []
        per_call = min(_IOV_MAX // 3, max(1, _RUN_BYTES // self.entry_bytes))
        run: list[int] = []
        prev = -2
        for i in order:
            slot = slots[i]
            if run and slot == prev + 1 and slot % self.slots_per_segment != 0 and len(run) < per_call:
                run.append(i)
            else:
                if run:
                    runs.append(run)
                run = [i]
            prev = slot
        if run:
            runs.append(run)
        return runs
