"""Counters of an offloader, exposed as a frozen snapshot by :meth:`aiokv.Offloader.stats`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["Counters", "OffloaderStats"]


class Counters:
    """Mutable counters updated on the loop thread (plain ints: no locks, no instrumentation cost)."""

    __slots__ = (
        "blocks_loaded",
        "blocks_stored",
        "bytes_loaded",
        "bytes_stored",
        "hit_tokens",
        "hits",
        "load_errors",
        "lookups",
        "misses",
        "requests_finished",
        "requests_opened",
        "staged_blocks",
        "staging_misses",
        "store_errors",
        "stores_deduplicated",
        "stores_dropped",
        "write_through_blocks",
        "write_through_dropped",
        "write_through_errors",
    )

    def __init__(self) -> None:
        for name in self.__slots__:
            setattr(self, name, 0)


@dataclass(frozen=True, slots=True)
class OffloaderStats:
    """A consistent snapshot of an offloader's counters. Block counts are in blocks, sizes in bytes."""

    hits: int  # blocks found by lookups (all tiers)
    misses: int  # blocks looked up and not found
    hit_tokens: int
    lookups: int
    blocks_stored: int  # committed into the CPU tier
    bytes_stored: int
    blocks_loaded: int  # copied into engine blocks
    bytes_loaded: int
    stores_deduplicated: int  # store skipped: the block was already cached
    stores_dropped: int  # store skipped: no evictable slot
    in_flight: int  # copies submitted and not yet complete
    in_flight_bytes: int
    evictions: int
    errors: int  # failed copies + failed lower-tier operations
    store_errors: int
    load_errors: int
    staged_blocks: int  # blocks brought from lower tiers into the CPU tier
    write_through_blocks: int
    write_through_dropped: int
    write_through_in_flight_bytes: int
    requests_open: int
    requests_opened: int
    requests_finished: int
    backend: str
    tiers: tuple[Any, ...] = field(default=())

    @property
    def hit_rate(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 0.0
