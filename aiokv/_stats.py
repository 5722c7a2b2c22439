"""Counters of an offloader, exposed as a frozen snapshot by :meth:`aiokv.Offloader.stats`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["Counters", "OffloaderStats", "WriteThroughStats"]


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
        "lower_tier_deadline_misses",
        "misses",
        "requests_finished",
        "requests_opened",
        "retention_units_late",
        "retention_units_skipped",
        "staged_blocks",
        "staging_misses",
        "store_errors",
        "stores_deduplicated",
        "stores_dropped",
        "stores_invalidated",
    )

    def __init__(self) -> None:
        self.blocks_loaded = 0
        self.blocks_stored = 0
        self.bytes_loaded = 0
        self.bytes_stored = 0
        self.hit_tokens = 0
        self.hits = 0
        self.load_errors = 0
        self.lookups = 0
        self.lower_tier_deadline_misses = 0
        self.misses = 0
        self.requests_finished = 0
        self.requests_opened = 0
        self.retention_units_late = 0  # grouped layouts: window/state units stored at a final boundary
        self.retention_units_skipped = (
            0  # grouped layouts: window/state units not stored when their block filled
        )
        self.staged_blocks = 0
        self.staging_misses = 0
        self.store_errors = 0
        self.stores_deduplicated = 0
        self.stores_dropped = 0
        self.stores_invalidated = 0


@dataclass(frozen=True, slots=True)
class WriteThroughStats:
    """The write-through towards one lower tier: its queue, its measured rate and what it shed."""

    tier: str  # the tier's name
    queued_blocks: int  # waiting for a write (pinned in the CPU tier)
    in_flight_bytes: int  # queued or being written
    written: int  # blocks the tier reported stored
    dropped: int  # blocks not written (budget full, shed as too slow, failed, closing)
    dropped_slow: int  # of ``dropped``: shed by the back-pressure (write_through_max_delay_s)
    errors: int  # writes that raised
    rate_bytes_per_s: float  # EWMA of the achieved write rate (0.0: nothing measured yet)
    expected_delay_s: float  # what is queued or being written, over the estimated rate
    oldest_queued_s: float  # age of the oldest queued block


@dataclass(frozen=True, slots=True)
class OffloaderStats:
    """A consistent snapshot of an offloader's counters. Block counts are in blocks, sizes in bytes.

    The load planner's fields (docs/tuning.md): ``load_policy``; ``prefill_tokens_per_s``, the rate a
    recompute is compared with (given, or measured from :meth:`Offloader.record_prefill`; ``None`` while
    unknown); ``planner_skipped_blocks``, hits left to recompute because restoring their run was predicted
    slower (they also count as misses); ``planner_skipped_lookups``, lower-tier lookups not made because no
    run that tier could hold would win; ``planner``, a ``PlannerStats`` with each tier's fitted
    ``(name, latency_s, bytes_per_s, samples)`` (``"cpu"`` is the copy into the engine), the decisions made
    and the losing runs restored anyway to measure their tier again (``explored``)."""

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
    errors: int  # failed copies (and copy submissions) + failed lower-tier operations
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
    eviction: str = ""  # the CPU tier's active eviction policy
    stores_invalidated: int = 0  # store skipped: the block's KV was computed over a load whose copy failed
    write_through_dropped_slow: int = 0  # of write_through_dropped: shed because a tier did not keep up
    lower_tier_deadline_misses: int = 0  # lower-tier lookups/reads abandoned at lower_tier_deadline_s
    write_through: tuple[WriteThroughStats, ...] = field(default=())  # one per lower tier
    load_policy: str = "always"  # the offloader's load_policy: "decide" or "always"
    prefill_tokens_per_s: float | None = (
        None  # the prefill rate the planner compares with (None: unknown yet)
    )
    planner_skipped_blocks: int = 0  # hits left to recompute: restoring their run was predicted to be slower
    planner_skipped_lookups: int = 0  # lower-tier lookups not made: no run that tier could hold would win
    planner: Any = None  # the load planner's PlannerStats: per-tier fitted latency_s, bytes_per_s, samples
    # Grouped layouts (KVLayout.from_groups): bytes of sliding-window and state parts never stored because no
    # kept boundary could use them (whole units, as the tiers would have held them).
    retention_bytes_saved: int = 0

    @property
    def hit_rate(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 0.0
