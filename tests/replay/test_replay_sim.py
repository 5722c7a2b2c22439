"""Replay semantics on hand-computed tiny traces, and properties on the Mooncake slices in tests/data."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from aiokv._errors import CapacityError, InvalidArgumentError
from aiokv.replay import (
    CostModel,
    ReplayResult,
    TierConfig,
    Trace,
    TraceRequest,
    load_trace,
    replay,
    sweep,
    synthetic_trace,
)

DATA = Path(__file__).resolve().parent.parent / "data"
SLICES = ["mooncake_conversation_head400.jsonl", "mooncake_synthetic_tail400.jsonl"]
POLICIES = ["lru", "arc", "chain-lru", "session"]
KV = 1  # one byte per token: a block of B tokens is B bytes, so capacities below are in blocks * B
COST = CostModel(prefill_tokens_per_s=1000.0)


def make_trace(*requests: str, block_tokens: int = 1) -> Trace:
    """``make_trace("abc", "abd")``: one request per string, one block (key) per character."""
    reqs = [
        TraceRequest(float(i), tuple(ch.encode() for ch in keys), len(keys) * block_tokens)
        for i, keys in enumerate(requests)
    ]
    return Trace.from_requests("hand", block_tokens, reqs)


def run(trace: Trace, policy: str, *caps: int | None, inflight: int = 0) -> ReplayResult:
    names = ["cpu", "disk", "redis"]
    tiers = [TierConfig(names[i], cap) for i, cap in enumerate(caps)]
    return replay(trace, tiers, policy=policy, kv_bytes_per_token=KV, cost=COST, inflight=inflight)


# --------------------------------------------------------------------------------------- hand-computed
@pytest.mark.parametrize("policy", POLICIES)
def test_shared_prefix_hits_and_tail_first_eviction(policy: str) -> None:
    # capacity 3: R2 hits a,b and evicts c for d; R3 evicts d for x; R4 hits a,b and evicts x for c.
    r = run(make_trace("abc", "abd", "x", "abc"), policy, 3)
    assert (r.hit_blocks, r.block_refs) == (4, 10)
    [cpu] = r.tiers
    assert (cpu.hit_blocks, cpu.stored_blocks, cpu.evicted_blocks, cpu.staged_blocks) == (4, 6, 3, 0)
    assert r.block_hit_ratio == pytest.approx(0.4)


@pytest.mark.parametrize(("policy", "hits"), [("lru", 1), ("chain-lru", 1), ("arc", 2)])
def test_reused_block_survives_a_scan_only_under_arc(policy: str, hits: int) -> None:
    # capacity 2: a is reused (ARC: T1 -> T2), then b and c pass through once; LRU evicts a for c, ARC evicts b.
    r = run(make_trace("a", "a", "b", "c", "a"), policy, 2)
    assert r.hit_blocks == hits


@pytest.mark.parametrize("policy", POLICIES)
def test_a_request_never_hits_its_own_blocks(policy: str) -> None:
    r = run(make_trace("abcd", "abcd"), policy, None)
    assert r.hit_blocks == 4  # only the second request hits: the first stores after its lookup


@pytest.mark.parametrize("policy", POLICIES)
def test_inflight_delays_visibility(policy: str) -> None:
    trace = make_trace("a", "a", "a")
    assert run(trace, policy, None).hit_blocks == 2
    # R1's block is stored only after R2 looked up: R2 misses, R3 hits.
    assert run(trace, policy, None, inflight=1).hit_blocks == 1
    assert run(trace, policy, None, inflight=5).hit_blocks == 0


def test_two_tiers_serve_the_leading_run_fastest_first_and_stage_up() -> None:
    # cpu holds 1 block, disk 4. R1 stores a, b everywhere (cpu keeps b). R2: cpu misses a, disk serves a, b;
    # both are staged into cpu (each evicting the previous), then c is stored in both tiers.
    r = run(make_trace("ab", "abc"), "lru", 1, 4)
    cpu, disk = r.tiers
    assert (r.hit_blocks, cpu.hit_blocks, disk.hit_blocks) == (2, 0, 2)
    assert (cpu.staged_blocks, cpu.stored_blocks, cpu.evicted_blocks) == (2, 3, 4)
    assert (disk.staged_blocks, disk.stored_blocks, disk.evicted_blocks) == (0, 3, 0)


def test_a_cpu_hit_is_not_a_disk_access() -> None:
    # cpu 2 blocks, disk 3. R3 hits a in cpu, which does not refresh a in disk; R5 then evicts a from both
    # tiers (disk's LRU victim is a, not b), so R6 misses. Had R3 touched disk, R6 would be a disk hit.
    r = run(make_trace("a", "b", "a", "c", "d", "a"), "lru", 2, 3)
    cpu, disk = r.tiers
    assert (cpu.hit_blocks, disk.hit_blocks) == (1, 0)
    assert disk.evicted_blocks == 2  # a at R5, b at R6


def test_token_hits_cap_the_partial_last_block_and_ttft_follows_the_formula() -> None:
    reqs = [TraceRequest(0.0, (b"a", b"b"), 700), TraceRequest(1.0, (b"a", b"b"), 700)]
    trace = Trace.from_requests("partial", 512, reqs)
    r = replay(trace, [TierConfig("cpu", None, bandwidth=1e6)], kv_bytes_per_token=2, cost=CostModel(1000.0))
    assert r.hit_blocks == 2
    assert r.hit_tokens == 700  # not 1024: the second block covers 188 tokens
    assert r.token_hit_ratio == pytest.approx(0.5)
    loaded = 2 * 512 * 2
    assert r.tiers[0].loaded_bytes == loaded
    assert r.ttft_saved_s == pytest.approx(700 / 1000.0 - loaded / 1e6)
    assert r.baseline_prefill_s == pytest.approx(1.4)
    json.dumps(r.to_dict())


# ------------------------------------------------------------------------------------------ properties
@pytest.fixture(scope="module", params=SLICES)
def slice_trace(request: pytest.FixtureRequest) -> Trace:
    return load_trace(DATA / str(request.param))


def independent_max_reuse(trace: Trace) -> int:
    """The maximum prefix reuse, computed here with a set rather than with aiokv's helper."""
    seen: set[bytes] = set()
    total = 0
    for req in trace.requests:
        n = 0
        while n < len(req.keys) and req.keys[n] in seen:
            n += 1
        total += n
        seen |= set(req.keys)
    return total


@pytest.mark.parametrize("policy", POLICIES)
def test_unlimited_capacity_reaches_the_maximum_prefix_reuse(slice_trace: Trace, policy: str) -> None:
    r = run(slice_trace, policy, None)
    assert r.hit_blocks == independent_max_reuse(slice_trace) > 0
    assert r.tiers[0].evicted_blocks == 0
    two = run(slice_trace, policy, 64 * 512, None)
    assert two.hit_blocks == r.hit_blocks  # a bounded cpu tier above an unlimited disk tier loses nothing


def test_lru_hit_ratio_is_monotone_in_capacity(slice_trace: Trace) -> None:
    caps = [16, 64, 256, 1024, 2048, 4096, 8192, None]
    hits = [run(slice_trace, "lru", None if c is None else c * 512).hit_blocks for c in caps]
    assert hits == sorted(hits), hits
    assert hits[0] < hits[-1]


def test_results_account_for_every_block_reference(slice_trace: Trace) -> None:
    for policy in POLICIES:
        r = run(slice_trace, policy, 300 * 512, 3000 * 512)
        cpu, disk = r.tiers
        assert r.hit_blocks == cpu.hit_blocks + disk.hit_blocks <= r.block_refs
        assert cpu.slots == 300
        assert disk.stored_blocks + disk.evicted_blocks >= 0
        # every block in a tier was written there once per residency
        assert cpu.stored_blocks + cpu.staged_blocks - cpu.evicted_blocks <= cpu.slots
        assert disk.stored_blocks + disk.staged_blocks - disk.evicted_blocks <= disk.slots


def test_sweep_runs_every_policy_and_capacity() -> None:
    trace = synthetic_trace(sessions=40, turns=3, seed=1)
    results = sweep(
        trace,
        [TierConfig("cpu", None), TierConfig("disk", 10**6)],
        policies=["lru", "arc"],
        sweep_tier="cpu",
        capacities=[8 * 512, 32 * 512],
        kv_bytes_per_token=KV,
        cost=COST,
    )
    assert [(r.policy, r.tiers[0].capacity_bytes) for r in results] == [
        ("lru", 4096),
        ("lru", 16384),
        ("arc", 4096),
        ("arc", 16384),
    ]
    assert all(r.tiers[1].capacity_bytes == 10**6 for r in results)


def test_progress_reports_every_reference() -> None:
    trace = synthetic_trace(sessions=200, turns=5, seed=2)
    seen: list[int] = []
    replay(trace, [TierConfig("cpu", 10**5)], kv_bytes_per_token=KV, cost=COST, progress=seen.append)
    assert sum(seen) == trace.block_refs


# ---------------------------------------------------------------------------------------------- errors
def test_capacity_below_one_block_is_rejected() -> None:
    trace = make_trace("ab", block_tokens=512)
    with pytest.raises(
        CapacityError, match=r"capacity of tier 'cpu' must hold at least one block of 1024 bytes"
    ):
        replay(trace, [TierConfig("cpu", 1000)], kv_bytes_per_token=2, cost=COST)


def test_bad_arguments_are_rejected() -> None:
    trace = make_trace("ab")
    with pytest.raises(InvalidArgumentError, match=r"policy must be one of \["):
        replay(trace, [TierConfig("cpu", None)], policy="mru", kv_bytes_per_token=KV, cost=COST)
    with pytest.raises(InvalidArgumentError, match="tier names must be unique"):
        replay(trace, [TierConfig("cpu", None), TierConfig("cpu", None)], kv_bytes_per_token=KV, cost=COST)
    with pytest.raises(InvalidArgumentError, match="bandwidth of tier 'nvme' is unknown"):
        replay(trace, [TierConfig("nvme", None)], kv_bytes_per_token=KV, cost=COST)
    with pytest.raises(InvalidArgumentError, match="inflight must be an int >= 0, got -1"):
        replay(trace, [TierConfig("cpu", None)], kv_bytes_per_token=KV, cost=COST, inflight=-1)
    with pytest.raises(InvalidArgumentError, match="tiers must name at least one tier"):
        replay(trace, [], kv_bytes_per_token=KV, cost=COST)
    with pytest.raises(InvalidArgumentError, match="capacity of tier 'cpu' must be > 0, got 0"):
        TierConfig("cpu", 0)
    with pytest.raises(InvalidArgumentError, match="prefill_tokens_per_s must be > 0"):
        CostModel(0.0)


# ----------------------------------------------------------------------------------------- load policy
def _two_tier_run(load_policy: str, disk_bandwidth: float) -> ReplayResult:
    # cpu holds 1 block, disk 8: R3 finds a,b in disk only (cpu holds c). 1 byte a token, 1000 tokens/s:
    # recomputing a block of 4 tokens takes 4 ms, loading it from a 100 B/s disk 40 ms, from 10 kB/s 0.4 ms.
    tiers = [TierConfig("cpu", 4, bandwidth=1e9), TierConfig("disk", 32, bandwidth=disk_bandwidth)]
    cost = CostModel(1000.0, load_policy=load_policy)
    return replay(make_trace("ab", "c", "abd", block_tokens=4), tiers, kv_bytes_per_token=KV, cost=cost)


def test_decide_recomputes_the_hits_of_a_tier_slower_than_prefill_with_the_same_hit_counts() -> None:
    always = _two_tier_run("always", 100.0)
    decide = _two_tier_run("decide", 100.0)
    assert (always.hit_blocks, decide.hit_blocks) == (2, 2)  # the cache behaves the same
    assert [t.hit_blocks for t in decide.tiers] == [t.hit_blocks for t in always.tiers] == [0, 2]
    assert always.ttft_saved_s == pytest.approx(8 / 1000 - 8 / 100)  # loading lost: a negative saving
    assert decide.skipped_tokens == 8
    assert decide.tiers[1].skipped_blocks == 2
    assert decide.tiers[1].loaded_bytes == 0
    assert decide.ttft_saved_s == 0.0
    assert decide.load_policy == "decide"
    assert decide.to_dict()["skipped_tokens"] == 8


def test_decide_loads_from_a_tier_faster_than_prefill() -> None:
    decide = _two_tier_run("decide", 10e3)
    assert decide.skipped_tokens == 0
    assert decide.ttft_saved_s == pytest.approx(_two_tier_run("always", 10e3).ttft_saved_s)
    assert decide.ttft_saved_s == pytest.approx(8 / 1000 - 8 / 10e3)


def test_a_bad_load_policy_is_a_clear_error() -> None:
    with pytest.raises(
        InvalidArgumentError, match=r"load_policy must be one of \['always', 'decide'\], got 'x'"
    ):
        CostModel(1000.0, load_policy="x")
