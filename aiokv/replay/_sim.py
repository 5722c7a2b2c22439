"""Trace replay through the real tier index: :class:`~aiokv.tiers._index.BlockIndex` and the registered
eviction policies, one index per tier, with data transfers replaced by a bandwidth model.

Semantics (docs/replay.md has the long form). Requests are processed one at a time in timestamp order; for
request ``r`` with block keys ``k[0..n)``:

1. Lookup, fastest tier first: tier 0 serves the READY run that ``k`` leads with, tier 1 the READY run that
   follows it, and so on. The request's hit is the sum, a leading run of ``k``; the rest is recomputed.
   A tier is only accessed for the keys that reach it (a CPU hit is not a disk access); hits are touched.
2. Staging: every tier inserts the hit keys that slower tiers served (as the offloader stages blocks read
   from disk into CPU slots), at once.
3. Store (write-allocate, write-through): the recomputed keys are inserted into every tier, after the next
   ``inflight`` requests have looked up (default 0: before the next request). Keys already present are
   touched. Inserting may evict, through the tier's policy.

So request ``r``'s blocks are visible to requests after ``r + inflight``, never to ``r`` itself, and timestamps
only order requests. Tiers are inclusive at store time; each evicts on its own, so a block can later live in a
slower tier only (and be staged up again on its next hit).
"""

from __future__ import annotations

import gc
import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from .._errors import CapacityError, InvalidArgumentError, InvalidTypeError
from ..tiers._index import BlockIndex
from ..tiers._policies import make_policy, policy_names
from ._model import DEFAULT_BANDWIDTHS, TTFT_FORMULA, CostModel
from ._trace import Trace

__all__ = ["ReplayResult", "TierConfig", "TierResult", "auto_capacities", "replay", "sweep"]

ProgressFn = Callable[[int], None]
"""Called with the number of block references processed since the previous call."""


@dataclass(frozen=True, slots=True)
class TierConfig:
    """One tier of the replayed hierarchy, fastest first. ``capacity_bytes=None`` is unlimited;
    ``bandwidth`` (bytes/s) defaults by name (cpu, disk, redis); ``policy`` overrides the run's policy."""

    name: str
    capacity_bytes: int | None
    bandwidth: float | None = None
    policy: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str):
            raise InvalidTypeError(f"tier name must be a string, got {type(self.name).__name__}")
        if not self.name:
            raise InvalidArgumentError("tier name must not be empty")
        cap = self.capacity_bytes
        if cap is not None:
            if isinstance(cap, bool) or not isinstance(cap, int):
                raise InvalidTypeError(
                    f"capacity of tier {self.name!r} must be an int or None, got {type(cap).__name__}"
                )
            if cap <= 0:
                raise InvalidArgumentError(f"capacity of tier {self.name!r} must be > 0, got {cap}")
        bw = self.bandwidth
        if bw is not None:
            if isinstance(bw, bool) or not isinstance(bw, (int, float)):
                raise InvalidTypeError(
                    f"bandwidth of tier {self.name!r} must be a number, got {type(bw).__name__}"
                )
            if not (math.isfinite(bw) and bw > 0):
                raise InvalidArgumentError(
                    f"bandwidth of tier {self.name!r} must be > 0 and finite, got {bw}"
                )
        if self.policy is not None and not isinstance(self.policy, str):
            raise InvalidTypeError(
                f"policy of tier {self.name!r} must be a string or None, got {type(self.policy).__name__}"
            )

    def resolved_bandwidth(self) -> float:
        if self.bandwidth is not None:
            return self.bandwidth
        try:
            return DEFAULT_BANDWIDTHS[self.name]
        except KeyError:
            raise InvalidArgumentError(
                f"bandwidth of tier {self.name!r} is unknown (defaults exist for {sorted(DEFAULT_BANDWIDTHS)}); "
                "give it explicitly"
            ) from None


@dataclass(frozen=True, slots=True)
class TierResult:
    name: str
    policy: str
    capacity_bytes: int | None
    slots: int  # blocks the tier can hold (capped at the trace's unique blocks)
    bandwidth: float  # bytes/s
    hit_blocks: int  # blocks served (loaded) from this tier
    hit_tokens: int
    stored_blocks: int  # recomputed blocks written to this tier
    staged_blocks: int  # blocks served by a slower tier and copied into this one
    evicted_blocks: int
    block_bytes: int
    skipped_blocks: int = 0  # hits recomputed instead (load_policy="decide": loading them was slower)
    skipped_tokens: int = 0

    @property
    def loaded_bytes(self) -> int:
        return (self.hit_blocks - self.skipped_blocks) * self.block_bytes

    @property
    def stored_bytes(self) -> int:
        return self.stored_blocks * self.block_bytes

    @property
    def staged_bytes(self) -> int:
        return self.staged_blocks * self.block_bytes

    @property
    def evicted_bytes(self) -> int:
        return self.evicted_blocks * self.block_bytes

    @property
    def load_s(self) -> float:
        return self.loaded_bytes / self.bandwidth


@dataclass(frozen=True, slots=True)
class ReplayResult:
    trace: str
    policy: str
    block_tokens: int
    kv_bytes_per_token: int
    block_bytes: int
    requests: int
    block_refs: int
    unique_blocks: int
    input_tokens: int
    hit_blocks: int
    hit_tokens: int
    prefill_tokens_per_s: float
    inflight: int
    tiers: tuple[TierResult, ...]
    elapsed_s: float = field(compare=False)
    load_policy: str = "always"

    @property
    def skipped_tokens(self) -> int:
        """Hit tokens recomputed rather than loaded (``load_policy="decide"``)."""
        return sum(t.skipped_tokens for t in self.tiers)

    @property
    def loaded_tokens(self) -> int:
        return self.hit_tokens - self.skipped_tokens

    @property
    def block_hit_ratio(self) -> float:
        return self.hit_blocks / self.block_refs if self.block_refs else 0.0

    @property
    def token_hit_ratio(self) -> float:
        return self.hit_tokens / self.input_tokens if self.input_tokens else 0.0

    @property
    def baseline_prefill_s(self) -> float:
        """Total prefill time without any cache."""
        return self.input_tokens / self.prefill_tokens_per_s

    @property
    def ttft_saved_s(self) -> float:
        """Total TTFT saved over all requests (see ``TTFT_FORMULA``); negative when loads cost more."""
        return self.loaded_tokens / self.prefill_tokens_per_s - sum(t.load_s for t in self.tiers)

    @property
    def ttft_saved_ratio(self) -> float:
        base = self.baseline_prefill_s
        return self.ttft_saved_s / base if base else 0.0

    @property
    def refs_per_s(self) -> float:
        """Replay speed; the elapsed time is floored at 1 ns so the figure stays finite (and JSON-valid)."""
        return self.block_refs / max(self.elapsed_s, 1e-9)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: the fields plus the derived ratios and byte counts."""
        out = asdict(self)
        out["tiers"] = [
            {
                **asdict(t),
                "hit_ratio": t.hit_blocks / self.block_refs if self.block_refs else 0.0,
                "loaded_bytes": t.loaded_bytes,
                "stored_bytes": t.stored_bytes,
                "staged_bytes": t.staged_bytes,
                "evicted_bytes": t.evicted_bytes,
                "load_s": t.load_s,
            }
            for t in self.tiers
        ]
        out.update(
            block_hit_ratio=self.block_hit_ratio,
            token_hit_ratio=self.token_hit_ratio,
            baseline_prefill_s=self.baseline_prefill_s,
            ttft_saved_s=self.ttft_saved_s,
            ttft_saved_ratio=self.ttft_saved_ratio,
            ttft_formula=TTFT_FORMULA,
            refs_per_s=self.refs_per_s,
            skipped_tokens=self.skipped_tokens,
        )
        return out


def check_capacity(tier: TierConfig, *, block_tokens: int, kv_bytes_per_token: int) -> None:
    """Raise :class:`CapacityError` unless ``tier`` holds at least one block (checked by :func:`replay`; callers
    may check before loading a trace)."""
    block_bytes = block_tokens * kv_bytes_per_token
    if tier.capacity_bytes is not None and tier.capacity_bytes < block_bytes:
        raise CapacityError(
            f"capacity of tier {tier.name!r} must hold at least one block of {block_bytes} bytes "
            f"({block_tokens} tokens * {kv_bytes_per_token} bytes), got {tier.capacity_bytes}"
        )


def _check_policy(name: str) -> None:
    if name not in policy_names():
        raise InvalidArgumentError(f"policy must be one of {policy_names()}, got {name!r}")


def _run(
    trace: Trace, indexes: Sequence[BlockIndex], inflight: int, progress: ProgressFn | None
) -> tuple[list[int], list[int], list[int], list[int], int]:
    m = len(indexes)
    bt = trace.block_tokens
    hit_blocks = [0] * m
    hit_tokens = [0] * m
    stored = [0] * m
    staged = [0] * m
    total_hit_tokens = 0
    step_refs = 0
    pending: deque[tuple[tuple[bytes, ...], int, bool]] = deque()
    # Policies that take hints (SessionPolicy) learn that a prompt's last block is partial: the next turn
    # continues the prompt inside it, so that key will not come back. Known when the request is stored.
    hint_cold = [getattr(ix.policy, "hint_cold", None) for ix in indexes]
    hinted = [t for t in range(m) if hint_cold[t] is not None]
    for req in trace.requests:
        keys = req.keys
        n = len(keys)
        limit = req.input_tokens
        # 1. lookup, fastest tier first; bounds[t] = keys served by tiers < t
        pos = 0
        bounds = [0]
        for t in range(m):
            if pos < n:
                h = indexes[t].touch_prefix(keys, pos)
                if h:
                    hit_blocks[t] += h
                    hit_tokens[t] += min((pos + h) * bt, limit) - min(pos * bt, limit)
                    pos += h
            bounds.append(pos)
        total_hit_tokens += min(pos * bt, limit)
        # 2. stage what slower tiers served into every faster tier, at once (it is read through them)
        if pos and m > 1:
            head = keys[:pos]
            for t in range(m - 1):
                start = bounds[t + 1]
                if start < pos:
                    staged[t] += indexes[t].insert_chain(head, start)
        # 3. store the recomputed blocks in every tier, after ``inflight`` later requests have looked up
        if pos < n:
            pending.append((keys, pos, limit < n * bt))
        while len(pending) > inflight:
            done_keys, done_pos, partial = pending.popleft()
            if partial:
                for t in hinted:
                    hint_cold[t](done_keys[-1])  # type: ignore[misc]
            for t in range(m):
                stored[t] += indexes[t].insert_chain(done_keys, done_pos)
        if progress is not None:
            step_refs += n
            if step_refs >= 65536:
                progress(step_refs)
                step_refs = 0
    while pending:  # requests still in flight at the end of the trace
        done_keys, done_pos, partial = pending.popleft()
        if partial:
            for t in hinted:
                hint_cold[t](done_keys[-1])  # type: ignore[misc]
        for t in range(m):
            stored[t] += indexes[t].insert_chain(done_keys, done_pos)
    if progress is not None and step_refs:
        progress(step_refs)

    return hit_blocks, hit_tokens, stored, staged, total_hit_tokens


def replay(
    trace: Trace,
    tiers: Sequence[TierConfig],
    *,
    policy: str = "lru",
    kv_bytes_per_token: int,
    cost: CostModel,
    inflight: int = 0,
    progress: ProgressFn | None = None,
) -> ReplayResult:
    """Replay ``trace`` through one :class:`BlockIndex` per tier (see the module docstring for the rules).

    ``inflight`` models concurrent prefills: a request's recomputed blocks are stored only after the next
    ``inflight`` requests have looked up (0: before the next request).
    """
    if isinstance(inflight, bool) or not isinstance(inflight, int) or inflight < 0:
        raise InvalidArgumentError(f"inflight must be an int >= 0, got {inflight!r}")
    if not tiers:
        raise InvalidArgumentError("tiers must name at least one tier")
    names = [t.name for t in tiers]
    if len(set(names)) != len(names):
        raise InvalidArgumentError(f"tier names must be unique, got {names}")
    if (
        isinstance(kv_bytes_per_token, bool)
        or not isinstance(kv_bytes_per_token, int)
        or kv_bytes_per_token <= 0
    ):
        raise InvalidArgumentError(f"kv_bytes_per_token must be a positive int, got {kv_bytes_per_token!r}")
    bt = trace.block_tokens
    block_bytes = bt * kv_bytes_per_token
    policies = [t.policy or policy for t in tiers]
    for name in policies:
        _check_policy(name)
    bandwidths = [t.resolved_bandwidth() for t in tiers]
    for cfg in tiers:
        check_capacity(cfg, block_tokens=bt, kv_bytes_per_token=kv_bytes_per_token)
    indexes: list[BlockIndex] = []
    for cfg, pol in zip(tiers, policies, strict=True):
        slots = max(trace.unique_blocks, 1)
        if cfg.capacity_bytes is not None:
            slots = min(cfg.capacity_bytes // block_bytes, slots)
        indexes.append(BlockIndex(slots, make_policy(pol, slots)))

    gc_was_enabled = gc.isenabled()
    gc.disable()  # millions of small acyclic objects (entries, policy nodes): cyclic GC passes only cost time
    try:
        started = time.perf_counter()
        hit_blocks, hit_tokens, stored, staged, total_hit_tokens = _run(trace, indexes, inflight, progress)
        elapsed = time.perf_counter() - started
    finally:
        if gc_was_enabled:
            gc.enable()

    restored = cost.restored_tiers(
        [(t.name, bw) for t, bw in zip(tiers, bandwidths, strict=True)], block_bytes, bt
    )
    results = tuple(
        TierResult(
            name=cfg.name,
            policy=pol,
            capacity_bytes=cfg.capacity_bytes,
            slots=index.num_slots,
            bandwidth=bw,
            hit_blocks=hit_blocks[t],
            hit_tokens=hit_tokens[t],
            stored_blocks=stored[t],
            staged_blocks=staged[t],
            evicted_blocks=index.stats().evictions,
            block_bytes=block_bytes,
            skipped_blocks=hit_blocks[t] if t >= restored else 0,
            skipped_tokens=hit_tokens[t] if t >= restored else 0,
        )
        for t, (cfg, pol, bw, index) in enumerate(zip(tiers, policies, bandwidths, indexes, strict=True))
    )
    return ReplayResult(
        trace=trace.name,
        policy=policy if len(set(policies)) == 1 else "/".join(policies),
        block_tokens=bt,
        kv_bytes_per_token=kv_bytes_per_token,
        block_bytes=block_bytes,
        requests=len(trace.requests),
        block_refs=trace.block_refs,
        unique_blocks=trace.unique_blocks,
        input_tokens=trace.input_tokens,
        hit_blocks=sum(hit_blocks),
        hit_tokens=total_hit_tokens,
        prefill_tokens_per_s=cost.prefill_tokens_per_s,
        inflight=inflight,
        tiers=results,
        elapsed_s=elapsed,
        load_policy=cost.load_policy,
    )


def auto_capacities(trace: Trace, block_bytes: int, points: int = 9) -> list[int]:
    """Capacities from about 1/256 of the trace's footprint (unique blocks) up to all of it, doubling."""
    top = max(trace.unique_blocks, 1)
    blocks = [max(1, top >> i) for i in range(points - 1, -1, -1)]
    return sorted({b * block_bytes for b in blocks})


def sweep(
    trace: Trace,
    tiers: Sequence[TierConfig],
    *,
    policies: Sequence[str],
    sweep_tier: str,
    capacities: Sequence[int | None],
    kv_bytes_per_token: int,
    cost: CostModel,
    inflight: int = 0,
    progress: ProgressFn | None = None,
    on_result: Callable[[ReplayResult], None] | None = None,
) -> list[ReplayResult]:
    """One :func:`replay` per (policy, capacity of ``sweep_tier``), policies outermost."""
    names = [t.name for t in tiers]
    if sweep_tier not in names:
        raise InvalidArgumentError(f"sweep tier must be one of the tiers {names}, got {sweep_tier!r}")
    for name in policies:
        _check_policy(name)
    results: list[ReplayResult] = []
    for pol in policies:
        for cap in capacities:
            run_tiers = [
                TierConfig(t.name, cap, t.bandwidth, t.policy) if t.name == sweep_tier else t for t in tiers
            ]
            result = replay(
                trace,
                run_tiers,
                policy=pol,
                kv_bytes_per_token=kv_bytes_per_token,
                cost=cost,
                inflight=inflight,
                progress=progress,
            )
            results.append(result)
            if on_result is not None:
                on_result(result)
    return results
