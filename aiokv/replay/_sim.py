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
import os
import time
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from .._errors import CapacityError, InvalidArgumentError, InvalidTypeError
from ..tiers import (
    AdaptivePolicy,
    ARCPolicy,
    BlockIndex,
    EvictionPolicy,
    LRUPolicy,
    SessionPolicy,
    make_policy,
    policy_names,
)
from ._encoding import TierSizing, check_tier_encoding, tier_sizing
from ._groups import GroupPlan, KVGroups, group_rows
from ._model import DEFAULT_BANDWIDTHS, TTFT_FORMULA, CostModel, ModelPreset
from ._trace import Trace

__all__ = [
    "ReplayResult",
    "TierConfig",
    "TierResult",
    "auto_capacities",
    "capacity_for_hit_ratio",
    "replay",
    "sweep",
]

ProgressFn = Callable[[int], None]
"""Called with the number of block references processed since the previous call."""

try:  # _run on interned ids with the built-in policies in C (aiokv/_native/_replay.c); _run defines it
    from .._native import _replay as _native_replay
except ImportError:  # pragma: no cover - built without a C compiler
    _native_replay = None  # type: ignore[assignment]
if os.environ.get("AIOKV_NATIVE_REPLAY", "1") == "0":
    _native_replay = None  # type: ignore[assignment]

# A trace's interned keys (ids, offsets, input tokens, unique count), kept while the trace lives: a sweep
# interns once and replays every point from the same arrays.
_INTERNED: weakref.WeakKeyDictionary[Trace, tuple[bytes, bytes, bytes, int]] = weakref.WeakKeyDictionary()

_NATIVE_MAX_UNIQUE = 2**31 - 1
"""The most unique blocks a trace replayed in C may hold (``_replay.MAX_UNIQUE``: its ids are int32)."""


@dataclass(frozen=True, slots=True)
class TierConfig:
    """One tier of the replayed hierarchy, fastest first. ``capacity_bytes=None`` is unlimited;
    ``bandwidth`` (bytes/s) defaults by name (cpu, disk, redis); ``policy`` overrides the run's policy.

    ``encoding`` (``"raw"``, ``"fp8"`` or ``"int8"``, for a tier named ``disk``, ``redis`` or ``redis-cluster``)
    sizes the tier as the real :class:`~aiokv.tiers.DiskTier` or Redis tier in that encoding sizes itself: its
    blocks are entries of the encoded payload plus the tier's header (and, on disk, padding to 4 KiB), and its
    loads move the encoded payload (see :mod:`aiokv.replay._encoding`). ``None`` (the default): capacity over
    the engine's block bytes, as before encodings were modelled."""

    name: str
    capacity_bytes: int | None
    bandwidth: float | None = None
    policy: str | None = None
    encoding: str | None = None

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
        check_tier_encoding(self.name, self.encoding)

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
    # A replay with KV-cache groups: the tier holds units of ``unit_bytes`` (= block_bytes), so ``slots``,
    # ``stored_blocks``, ``staged_blocks`` and ``evicted_blocks`` count units; ``hit_blocks`` counts key blocks
    # (each attributed to the slowest tier that served one of its units) and ``hit_units`` the units served.
    unit_bytes: int = 0  # 0: one uniform cache (no groups)
    hit_units: int = 0
    skipped_units: int = 0
    # How the tier stores a block (a unit, with groups): TierConfig.encoding (None: not modelled), the bytes of
    # its capacity one takes (entry_bytes: header and padding included) and the bytes it holds and a load
    # moves (payload_bytes: encoded); 0 stands for block_bytes. capacity_blocks: the blocks (units) its
    # capacity holds, not capped at the trace's footprint as ``slots`` is (None: unlimited).
    encoding: str | None = None
    entry_bytes: int = 0
    payload_bytes: int = 0
    capacity_blocks: int | None = None

    @property
    def moved_bytes(self) -> int:
        """Bytes a load of one block (unit) from this tier moves, and a store writes: its payload."""
        return self.payload_bytes or self.block_bytes

    @property
    def loaded_bytes(self) -> int:
        if self.unit_bytes:
            return (self.hit_units - self.skipped_units) * self.moved_bytes
        return (self.hit_blocks - self.skipped_blocks) * self.moved_bytes

    @property
    def stored_bytes(self) -> int:
        return self.stored_blocks * self.moved_bytes

    @property
    def staged_bytes(self) -> int:
        return self.staged_blocks * self.moved_bytes

    @property
    def evicted_bytes(self) -> int:
        return self.evicted_blocks * self.moved_bytes

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
    groups: GroupPlan | None = None  # the key block's parts and units, for a replay with KV-cache groups
    retention_saved_bytes: int = 0  # window and state parts the retention did not store (padded units)

    @property
    def unit_bytes(self) -> int:
        """The bytes of one stored entry: a unit with groups, else a block."""
        return self.groups.unit_bytes if self.groups is not None else self.block_bytes

    @property
    def stored_bytes(self) -> int:
        """Bytes written to the first tier by stores (staging left out): what the requests' KV costs."""
        return self.tiers[0].stored_bytes if self.tiers else 0

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
        grouped = out.pop("groups") is not None
        saved = out.pop("retention_saved_bytes")
        unit_fields = ("unit_bytes", "hit_units", "skipped_units")
        out["tiers"] = [
            {
                **{k: v for k, v in asdict(t).items() if grouped or k not in unit_fields},
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
        if self.groups is not None:
            plan = self.groups
            out["groups"] = {
                "unit_bytes": plan.unit_bytes,
                "units_per_block": plan.units,
                "padding_bytes_per_block": plan.padding_bytes,
                "checkpoint_blocks": plan.checkpoint_blocks,
                "groups": group_rows(plan),
            }
            out["retention_saved_bytes"] = saved
            out["stored_bytes"] = self.stored_bytes
        return out


def check_capacity(
    tier: TierConfig,
    *,
    block_tokens: int,
    kv_bytes_per_token: int | None = None,
    groups: KVGroups | None = None,
    model: ModelPreset | None = None,
) -> None:
    """Raise :class:`CapacityError` unless ``tier`` holds at least one block (with ``groups``: one key block
    with every part, in units; with an encoding: one entry of the tier, see :class:`TierConfig`), and
    :class:`InvalidArgumentError` for an encoding the replay cannot size (without ``model``'s KV shape, or with
    ``groups``) (checked by :func:`replay`; callers may check before loading a trace)."""
    if groups is not None:
        plan = groups.plan(block_tokens)
        need = plan.units * plan.unit_bytes
        sizing = tier_sizing(
            tier.name, tier.encoding, plan.unit_bytes, block_tokens=block_tokens, model=None, grouped=True
        )
        held = sizing.blocks(tier.capacity_bytes)
        if held is not None and held < plan.units:
            entries = (
                ""
                if sizing.encoding is None
                else f", entries of {sizing.entry_bytes} bytes in the tier (encoding {sizing.encoding!r})"
            )
            raise CapacityError(
                f"capacity of tier {tier.name!r} must hold at least one key block of {need} bytes "
                f"({plan.units} units of {plan.unit_bytes} bytes{entries}), got {tier.capacity_bytes}"
            )
        return
    assert kv_bytes_per_token is not None
    block_bytes = block_tokens * kv_bytes_per_token
    sizing = tier_sizing(
        tier.name, tier.encoding, block_bytes, block_tokens=block_tokens, model=model, grouped=False
    )
    if sizing.encoding is not None:
        held = sizing.blocks(tier.capacity_bytes)
        if held is not None and held < 1:
            raise CapacityError(
                f"capacity of tier {tier.name!r} must hold at least one entry of {sizing.entry_bytes} bytes "
                f"(a block of {block_tokens} tokens * {kv_bytes_per_token} bytes in encoding "
                f"{sizing.encoding!r}: {sizing.payload_bytes} bytes, with the tier's header and padding), got "
                f"{tier.capacity_bytes}"
            )
        return
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


_NATIVE_POLICIES = (LRUPolicy, ARCPolicy, SessionPolicy, AdaptivePolicy)
"""The policies the C replay implements; each gives its spec (``_native_replay_spec``, next to its code)."""


def _native_spec(policy: EvictionPolicy) -> tuple[Any, ...] | None:
    """The spec of a fresh built-in ``policy`` for :func:`aiokv._native._replay.run`, or None (not covered:
    the Python loop runs). Exact types only: a subclass may change any method."""
    if type(policy) not in _NATIVE_POLICIES:
        return None
    return policy._native_replay_spec()


def _run_native(
    trace: Trace, indexes: Sequence[BlockIndex], inflight: int, progress: ProgressFn | None
) -> tuple[list[int], list[int], list[int], list[int], list[int], int] | None:
    """:func:`_run` in C when every tier's policy is covered (see :func:`_native_spec`), else None. Returns
    the counts and each tier's evictions (the indexes themselves are left untouched)."""
    if _native_replay is None:
        return None
    specs: list[tuple[Any, ...]] = []
    for ix in indexes:
        spec = _native_spec(ix.policy)
        if spec is None or len(ix):
            return None
        specs.append(spec)
    ids, offsets, limits, unique = _interned(trace)
    counts, total_hit_tokens = _native_replay.run(
        ids,
        offsets,
        limits,
        unique,
        trace.block_tokens,
        [(ix.num_slots, spec) for ix, spec in zip(indexes, specs, strict=True)],
        inflight,
        progress,
    )
    hit_blocks, hit_tokens, stored, staged, evicted, _rejected = (list(c) for c in zip(*counts, strict=True))
    return hit_blocks, hit_tokens, stored, staged, evicted, total_hit_tokens


def _interned(trace: Trace) -> tuple[bytes, bytes, bytes, int]:
    """``trace``'s keys interned for the C replay, once per trace; :class:`InvalidArgumentError` when it holds
    more than :data:`_NATIVE_MAX_UNIQUE` unique blocks."""
    interned = _INTERNED.get(trace)
    if interned is None:
        got = _native_replay.intern(trace.requests, _NATIVE_MAX_UNIQUE)
        if got is None:
            raise InvalidArgumentError(
                f"trace {trace.name!r} must hold at most {_NATIVE_MAX_UNIQUE} unique blocks, got more"
            )
        interned = _INTERNED[trace] = got
    return interned


@dataclass(slots=True)
class _GroupedCounts:
    hit_blocks: list[int]
    hit_tokens: list[int]
    hit_units: list[int]
    stored: list[int]
    staged: list[int]
    total_hit_tokens: int = 0
    skipped_units: int = 0  # window and state units the retention did not store


def _run_grouped(
    trace: Trace, plan: GroupPlan, indexes: Sequence[BlockIndex], inflight: int, progress: ProgressFn | None
) -> _GroupedCounts:
    """The grouped replay: the offloader's store rule (:class:`aiokv._grouprule.Retention`) and hit rule
    (:func:`aiokv._grouprule.longest_hit`) over units, each unit an independent entry of every tier.

    Lookup: presence of every unit across the tiers gives ``N = longest_hit(...)``; the base units of the
    leading run are touched unit by unit (as the offloader pins them, past ``N`` too), then the state units
    at ``N`` and the window units before it from the latest block down (the order of
    ``GroupedLayout.needed_units``), each in the fastest tier holding it and staged into the faster ones.
    Store: the recomputed blocks ``[N, n)`` as ``_store_units`` stores them, every unit of a request reserved
    before any is committed (a store never evicts its own units). A replayed request ends at its prompt's
    end, which the fill-time rule already keeps, so the finish-time rule adds nothing here.
    """
    from ..rules import Retention, longest_hit, window_blocks

    m = len(indexes)
    bt = trace.block_tokens
    keep = Retention(plan.checkpoint_blocks)
    parts = plan.parts
    identity = parts[0].cls == "base"  # the first base unit's key is the block's key itself
    suffix = [b"/aiokv-unit/" + u.to_bytes(2, "little") for u in range(plan.units)]
    base_units = [u for p, part in enumerate(parts) if part.cls == "base" for u in plan.part_units(p)]
    windows: list[tuple[int, list[int]]] = []
    for p, part in enumerate(parts):
        if part.cls == "window":
            w = window_blocks(plan.groups[part.groups[0]].window or 1, bt)
            assert w == part.window_blocks, "the plan's window blocks must be aiokv._grouprule.window_blocks"
            windows.append((w, list(plan.part_units(p))))
    states = [list(plan.part_units(p)) for p, part in enumerate(parts) if part.cls == "state"]
    reach = max((w for w, _u in windows), default=0)
    c = _GroupedCounts([0] * m, [0] * m, [0] * m, [0] * m, [0] * m)
    pending: deque[tuple[tuple[bytes, ...], int]] = deque()
    step_refs = 0

    def ukey(key: bytes, u: int) -> bytes:
        return key if u == 0 and identity else key + suffix[u]

    def where(key: bytes) -> int:
        for t in range(m):
            if key in indexes[t]:
                return t
        return -1

    def have(key: bytes, units: Sequence[int]) -> bool:
        return all(where(ukey(key, u)) >= 0 for u in units)

    def serve(key: bytes, parent: bytes | None, depth: int) -> int:
        """Touch ``key`` in the fastest tier holding it and stage it into the faster ones; that tier."""
        t = where(key)
        indexes[t].touch(key)
        for s in range(t):
            if indexes[s].insert_ready(key, parent, depth) is not None:
                c.staged[s] += 1
        return t

    def store(keys: tuple[bytes, ...], start: int) -> None:
        n = len(keys)
        todo: list[tuple[bytes, bytes | None, int]] = []
        for j in range(start, n):
            key = keys[j]
            parent = keys[j - 1] if j else None
            todo.extend((ukey(key, u), parent, j) for u in base_units)
            for w, units in windows:
                if keep.keep_window_at_fill(j, w, n):
                    todo.extend((ukey(key, u), None, j) for u in units)
                else:
                    c.skipped_units += len(units)
            for units in states:
                if keep.keep_state_at_fill(j + 1, n):
                    todo.extend((ukey(key, u), None, j) for u in units)
                else:
                    c.skipped_units += len(units)
        for t, index in enumerate(indexes):
            reserved = [k for k, parent, depth in todo if index.reserve(k, parent, depth) is not None]
            for k in reserved:
                index.commit(k)
            c.stored[t] += len(reserved)

    for req in trace.requests:
        keys = req.keys
        n = len(keys)
        limit = req.input_tokens
        # 1. lookup: the longest N the hit rule allows over the units present in any tier
        base: list[bool] | None = None
        top = n
        if base_units:
            base = []
            for key in keys:
                base.append(have(key, base_units))
                if not base[-1]:
                    break
            top = len(base) - (0 if not base or base[-1] else 1)
        wins = [(w, [have(keys[j], units) for j in range(top)]) for w, units in windows]
        snaps = [[have(keys[j], units) for j in range(top)] for units in states]
        hit = longest_hit(n, base, wins, snaps)
        tier_of = [0] * hit
        for u in base_units:
            for i in range(top):
                t = serve(ukey(keys[i], u), keys[i - 1] if i else None, i)
                if i < hit:
                    c.hit_units[t] += 1
                    tier_of[i] = max(tier_of[i], t)
        if hit:
            for units in states:
                for u in units:
                    t = serve(ukey(keys[hit - 1], u), None, hit - 1)
                    c.hit_units[t] += 1
                    tier_of[hit - 1] = max(tier_of[hit - 1], t)
            for j in range(hit - 1, max(0, hit - reach) - 1, -1):
                for w, units in windows:
                    if j >= hit - w:
                        for u in units:
                            t = serve(ukey(keys[j], u), None, j)
                            c.hit_units[t] += 1
                            tier_of[j] = max(tier_of[j], t)
        for i, t in enumerate(tier_of):
            c.hit_blocks[t] += 1
            c.hit_tokens[t] += min((i + 1) * bt, limit) - min(i * bt, limit)
        c.total_hit_tokens += min(hit * bt, limit)
        # 2. store the recomputed blocks after ``inflight`` later lookups
        if hit < n:
            pending.append((keys, hit))
        while len(pending) > inflight:
            store(*pending.popleft())
        if progress is not None:
            step_refs += n
            if step_refs >= 65536:
                progress(step_refs)
                step_refs = 0
    while pending:
        store(*pending.popleft())
    if progress is not None and step_refs:
        progress(step_refs)
    return c


def _model_kv(model: ModelPreset | None, kv_bytes_per_token: int | None) -> int | None:
    """``kv_bytes_per_token``, or ``model``'s when it is left out; both given must agree."""
    if model is None:
        return kv_bytes_per_token
    if not isinstance(model, ModelPreset):
        raise InvalidTypeError(
            f"model must be an aiokv.replay.ModelPreset or None, got {type(model).__name__}"
        )
    if kv_bytes_per_token is None:
        return model.kv_bytes_per_token
    if kv_bytes_per_token != model.kv_bytes_per_token:
        raise InvalidArgumentError(
            f"kv_bytes_per_token must be model.kv_bytes_per_token ({model.kv_bytes_per_token}, {model.name}) "
            f"or None when model is given, got {kv_bytes_per_token!r}"
        )
    return kv_bytes_per_token


def _sizings(
    tiers: Sequence[TierConfig], slot_bytes: int, block_tokens: int, model: ModelPreset | None, grouped: bool
) -> list[TierSizing]:
    return [
        tier_sizing(t.name, t.encoding, slot_bytes, block_tokens=block_tokens, model=model, grouped=grouped)
        for t in tiers
    ]


def replay(
    trace: Trace,
    tiers: Sequence[TierConfig],
    *,
    policy: str = "lru",
    kv_bytes_per_token: int | None = None,
    cost: CostModel,
    inflight: int = 0,
    progress: ProgressFn | None = None,
    groups: KVGroups | None = None,
    model: ModelPreset | None = None,
) -> ReplayResult:
    """Replay ``trace`` through one :class:`BlockIndex` per tier (see the module docstring for the rules).

    ``inflight`` models concurrent prefills: a request's recomputed blocks are stored only after the next
    ``inflight`` requests have looked up (0: before the next request). Give either ``kv_bytes_per_token`` (one
    uniform cache), or ``model`` (its KV bytes per token and its KV shape, which a tier's ``encoding`` other
    than ``raw`` needs to size its blocks; ``kv_bytes_per_token`` may be given too and must then agree), or
    ``groups`` (the model's KV-cache groups: each key block is stored as the offloader stores a grouped
    layout's, in units, and hits follow the group rule; see :func:`_run_grouped`).
    """
    if isinstance(inflight, bool) or not isinstance(inflight, int) or inflight < 0:
        raise InvalidArgumentError(f"inflight must be an int >= 0, got {inflight!r}")
    if not tiers:
        raise InvalidArgumentError("tiers must name at least one tier")
    names = [t.name for t in tiers]
    if len(set(names)) != len(names):
        raise InvalidArgumentError(f"tier names must be unique, got {names}")
    bt = trace.block_tokens
    plan: GroupPlan | None = None
    if groups is not None:
        if not isinstance(groups, KVGroups):
            raise InvalidTypeError(f"groups must be an aiokv.replay.KVGroups, got {type(groups).__name__}")
        if kv_bytes_per_token is not None:
            raise InvalidArgumentError(
                "kv_bytes_per_token must be None when groups are given (they give the bytes)"
            )
        if model is not None:
            raise InvalidArgumentError("model must be None when groups are given (they give the bytes)")
        plan = groups.plan(bt)
        kv_bytes_per_token = plan.kv_bytes_per_token
        block_bytes = plan.block_bytes
        slot_bytes = plan.unit_bytes
        max_slots = max(trace.unique_blocks * plan.units, 1)
    else:
        kv_bytes_per_token = _model_kv(model, kv_bytes_per_token)
        if (
            isinstance(kv_bytes_per_token, bool)
            or not isinstance(kv_bytes_per_token, int)
            or kv_bytes_per_token <= 0
        ):
            raise InvalidArgumentError(
                f"kv_bytes_per_token must be a positive int, got {kv_bytes_per_token!r}"
            )
        block_bytes = slot_bytes = bt * kv_bytes_per_token
        max_slots = max(trace.unique_blocks, 1)
    policies = [t.policy or policy for t in tiers]
    for name in policies:
        _check_policy(name)
    bandwidths = [t.resolved_bandwidth() for t in tiers]
    for cfg in tiers:
        check_capacity(
            cfg, block_tokens=bt, kv_bytes_per_token=kv_bytes_per_token, groups=groups, model=model
        )
    sizings = _sizings(tiers, slot_bytes, bt, model, plan is not None)
    indexes: list[BlockIndex] = []
    for cfg, pol, sizing in zip(tiers, policies, sizings, strict=True):
        slots = max_slots
        held = sizing.blocks(cfg.capacity_bytes)
        if held is not None:
            slots = min(held, slots)
        indexes.append(BlockIndex(slots, make_policy(pol, slots)))

    gc_was_enabled = gc.isenabled()
    gc.disable()  # millions of small acyclic objects (entries, policy nodes): cyclic GC passes only cost time
    try:
        started = time.perf_counter()
        evictions: list[int] | None = None
        if plan is None:
            native = _run_native(trace, indexes, inflight, progress)
            if native is not None:
                hit_blocks, hit_tokens, stored, staged, evictions, total_hit_tokens = native
            else:
                hit_blocks, hit_tokens, stored, staged, total_hit_tokens = _run(
                    trace, indexes, inflight, progress
                )
            hit_units = [0] * len(tiers)
            skipped_units = 0
        else:
            counts = _run_grouped(trace, plan, indexes, inflight, progress)
            hit_blocks, hit_tokens, stored, staged = (
                counts.hit_blocks,
                counts.hit_tokens,
                counts.stored,
                counts.staged,
            )
            total_hit_tokens, hit_units, skipped_units = (
                counts.total_hit_tokens,
                counts.hit_units,
                counts.skipped_units,
            )
        elapsed = time.perf_counter() - started
    finally:
        if gc_was_enabled:
            gc.enable()

    # The planner weighs a tier's load of a hit block against recomputing it: with groups a hit block's
    # bytes are the run's average (every base unit, the window and state units near the boundary).
    decide_bytes = block_bytes
    if plan is not None:
        decide_bytes = plan.unit_bytes * max(
            1, round(sum(hit_units) / sum(hit_blocks)) if sum(hit_blocks) else plan.units
        )
    # An encoded tier moves its payload per block: to the planner, which weighs engine bytes, that is the
    # tier's bandwidth scaled by engine bytes per payload byte (the codec's time is not modelled).
    restored = cost.restored_tiers(
        [
            (t.name, bw * slot_bytes / sizing.payload_bytes)
            for t, bw, sizing in zip(tiers, bandwidths, sizings, strict=True)
        ],
        decide_bytes,
        bt,
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
            evicted_blocks=index.stats().evictions if evictions is None else evictions[t],
            block_bytes=slot_bytes,
            skipped_blocks=hit_blocks[t] if t >= restored else 0,
            skipped_tokens=hit_tokens[t] if t >= restored else 0,
            encoding=sizing.encoding,
            entry_bytes=sizing.entry_bytes,
            payload_bytes=sizing.payload_bytes,
            capacity_blocks=sizing.blocks(cfg.capacity_bytes),
            **(
                {}
                if plan is None
                else {
                    "unit_bytes": slot_bytes,
                    "hit_units": hit_units[t],
                    "skipped_units": hit_units[t] if t >= restored else 0,
                }
            ),
        )
        for t, (cfg, pol, bw, index, sizing) in enumerate(
            zip(tiers, policies, bandwidths, indexes, sizings, strict=True)
        )
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
        groups=plan,
        retention_saved_bytes=skipped_units * slot_bytes if plan is not None else 0,
    )


def auto_capacities(trace: Trace, block_bytes: int, points: int = 9, *, at_least: int = 0) -> list[int]:
    """Capacities from about 1/256 of the trace's footprint (unique blocks) up to all of it, doubling; any
    below ``at_least`` (what one block takes in an encoded tier: its entry) is raised to it."""
    top = max(trace.unique_blocks, 1)
    blocks = [max(1, top >> i) for i in range(points - 1, -1, -1)]
    return sorted({max(b * block_bytes, at_least) for b in blocks})


def sweep(
    trace: Trace,
    tiers: Sequence[TierConfig],
    *,
    policies: Sequence[str],
    sweep_tier: str,
    capacities: Sequence[int | None],
    kv_bytes_per_token: int | None = None,
    cost: CostModel,
    inflight: int = 0,
    progress: ProgressFn | None = None,
    on_result: Callable[[ReplayResult], None] | None = None,
    groups: KVGroups | None = None,
    model: ModelPreset | None = None,
) -> list[ReplayResult]:
    """One :func:`replay` per (policy, capacity of ``sweep_tier``), policies outermost (the swept tier keeps its
    bandwidth, policy and encoding)."""
    names = [t.name for t in tiers]
    if sweep_tier not in names:
        raise InvalidArgumentError(f"sweep tier must be one of the tiers {names}, got {sweep_tier!r}")
    for name in policies:
        _check_policy(name)
    results: list[ReplayResult] = []
    for pol in policies:
        for cap in capacities:
            run_tiers = [replace(t, capacity_bytes=cap) if t.name == sweep_tier else t for t in tiers]
            result = replay(
                trace,
                run_tiers,
                policy=pol,
                kv_bytes_per_token=kv_bytes_per_token,
                cost=cost,
                inflight=inflight,
                progress=progress,
                groups=groups,
                model=model,
            )
            results.append(result)
            if on_result is not None:
                on_result(result)
    return results


def capacity_for_hit_ratio(
    trace: Trace,
    tiers: Sequence[TierConfig],
    target: float,
    *,
    tier: str | None = None,
    policy: str = "lru",
    kv_bytes_per_token: int | None = None,
    groups: KVGroups | None = None,
    cost: CostModel,
    inflight: int = 0,
    model: ModelPreset | None = None,
) -> tuple[int | None, ReplayResult]:
    """The smallest capacity of ``tier`` (default: the first; the others as given) at which the replay's
    token hit ratio reaches ``target`` (0 < target <= 1), to one slot (a block, or a unit with ``groups``; an
    entry of the tier with an encoding), and the replay at that capacity. Bisection over the slot count: it
    assumes the hit ratio does not fall as the capacity grows (so for LRU on one tier; with other policies the
    answer is one capacity that reaches the target). ``(None, the unlimited replay)`` when even an unlimited
    tier falls short."""
    if isinstance(target, bool) or not isinstance(target, (int, float)) or not 0 < target <= 1:
        raise InvalidArgumentError(f"target hit ratio must be in (0, 1], got {target!r}")
    names = [t.name for t in tiers]
    name = names[0] if tier is None and names else tier
    if name not in names:
        raise InvalidArgumentError(f"tier must be one of the tiers {names}, got {name!r}")
    searched = tiers[names.index(name)]
    bt = trace.block_tokens
    if groups is not None:
        plan = groups.plan(bt)
        slot, lo, hi = plan.unit_bytes, plan.units, max(trace.unique_blocks * plan.units, plan.units)
    else:
        kv_bytes_per_token = _model_kv(model, kv_bytes_per_token)
        if kv_bytes_per_token is None:
            raise InvalidArgumentError("kv_bytes_per_token, model or groups must be given")
        slot, lo, hi = bt * kv_bytes_per_token, 1, max(trace.unique_blocks, 1)
    # The tier's slots are its entries: their bytes with an encoding (header, padding, encoded payload).
    slot = tier_sizing(
        name, searched.encoding, slot, block_tokens=bt, model=model, grouped=groups is not None
    ).entry_bytes

    def run(slots: int | None) -> ReplayResult:
        cap = None if slots is None else slots * slot
        return replay(
            trace,
            [replace(t, capacity_bytes=cap) if t.name == name else t for t in tiers],
            policy=policy,
            kv_bytes_per_token=kv_bytes_per_token,
            groups=groups,
            cost=cost,
            inflight=inflight,
            model=model,
        )

    best = run(None)
    if best.token_hit_ratio < target:
        return None, best
    found = hi  # the footprint: as good as unlimited
    while lo < hi:
        mid = (lo + hi) // 2
        r = run(mid)
        if r.token_hit_ratio >= target:
            found, best, hi = mid, r, mid
        else:
            lo = mid + 1
    if found == hi and best.tiers[names.index(name)].capacity_bytes is None:
        best = run(found)
    return found * slot, best
