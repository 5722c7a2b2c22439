"""``aiokv replay`` in C (aiokv/_native/_replay.c) held to the Python replay loop over the Python policies.

The definition is ``_sim._run`` over ``BlockIndex`` and the policies of aiokv/tiers/_policies.py, run here with
every native path hidden (the C replay, the LRU and ARC index loops). Hypothesis draws traces of three kinds:
prefix trees (chains that share heads, as real traces do), chains whose partial last block the next turn
continues (the cold hints of ``session`` and ``adaptive``), and key sequences whose parents disagree between
requests (a key seen with two different predecessors, so the per-list parents matter); tier stacks of one to
three tiers with any mix of lru, arc, session and adaptive (also adaptive over other expert sets and
parameters, and session without ghosts), capacities from one slot, and ``inflight`` from 0 to 4. Each replay
must give the same result in both worlds: every tier's hits, hit tokens, stores, stages and evictions.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aiokv.replay import CostModel, TierConfig, Trace, TraceRequest, _sim, replay, sweep, synthetic_trace
from aiokv.tiers import _index, _policies
from aiokv.tiers._policies import AdaptivePolicy, LRUPolicy, SessionPolicy

pytestmark = pytest.mark.skipif(
    _sim._native_replay is None, reason="the native replay is off or not built (AIOKV_NATIVE_REPLAY=0)"
)

COST = CostModel(prefill_tokens_per_s=10_000.0)
KV = 16  # bytes per token: one block of 4 tokens is 64 bytes
BT = 4


def short_epochs(capacity: int, refs: int, **kwargs: Any) -> AdaptivePolicy:
    """An adaptive policy whose epochs last ``refs`` accesses (the default, ``max(capacity, 256)``, is longer
    than the traces drawn here): its leadership changes many times per trace."""
    policy = AdaptivePolicy(capacity, **kwargs)
    policy._epoch_refs = refs
    return policy


# Policies registered for this module only: the built-ins with non-default parameters.
EXTRA = {
    "t-adaptive-fast": lambda c: short_epochs(c, 5, starts=1),
    "t-adaptive-fast-tie": lambda c: short_epochs(c, 3, experts=("lru", "arc"), decay=0.0, starts=1),
    "t-adaptive-fast-ls": lambda c: short_epochs(c, 7, experts=("session", "lru"), decay=0.5, starts=2),
    "t-adaptive-arc-lru": lambda c: AdaptivePolicy(c, experts=("arc", "lru"), decay=0.5, starts=1),
    "t-adaptive-session": lambda c: AdaptivePolicy(c, experts=("session",), decay=0.0, starts=3),
    "t-adaptive-lsa": lambda c: AdaptivePolicy(c, experts=("lru", "session", "arc"), starts=2),
    "t-session-noghost": lambda c: SessionPolicy(c, ghost=0),
    "t-session-step": lambda c: SessionPolicy(c, ghost=1, step=0.75),
}
POLICIES = ["lru", "arc", "session", "adaptive", *EXTRA]


@pytest.fixture(autouse=True, scope="module")
def _extra_policies() -> Iterator[None]:
    for name, factory in EXTRA.items():
        _policies.register_policy(name, factory)
    yield
    for name in EXTRA:
        _policies._REGISTRY.pop(name, None)


@contextmanager
def python_only() -> Iterator[None]:
    """Hide every native path: the replay runs the Python definition."""
    saved = _sim._native_replay, _index._native_lru, _index._FAST_PATHS
    _sim._native_replay = None  # type: ignore[assignment]
    _index._native_lru = None  # type: ignore[assignment]
    _index._FAST_PATHS = {}
    try:
        yield
    finally:
        _sim._native_replay, _index._native_lru, _index._FAST_PATHS = saved


def key(i: int) -> bytes:
    return b"k" + i.to_bytes(4, "little")


def tree_trace(rng: random.Random, requests: int, width: int) -> Trace:
    """Chains in a prefix tree: each request extends a random earlier request's prefix with new or old keys."""
    seen: list[tuple[bytes, ...]] = [()]
    nxt = 0
    out = []
    for r in range(requests):
        base = rng.choice(seen)
        cut = rng.randint(0, len(base))
        keys = list(base[:cut])
        for _ in range(rng.randint(0 if keys else 1, width)):
            keys.append(key(nxt))
            nxt += 1
        seen.append(tuple(keys))
        partial = rng.random() < 0.4
        tokens = len(keys) * BT - (rng.randint(1, BT - 1) if partial else 0)
        out.append(TraceRequest(float(r), tuple(keys), tokens))
    return Trace.from_requests("tree", BT, out)


def turn_trace(rng: random.Random, sessions: int, turns: int) -> Trace:
    """Conversations: each turn re-sends the history, which continues inside the previous last block."""
    out = []
    nxt = 0
    t = 0.0
    for _ in range(sessions):
        hist: list[bytes] = []
        for _ in range(turns):
            if hist and rng.random() < 0.7:
                hist.pop()  # the partial last block's key changes
            for _ in range(rng.randint(1, 3)):
                hist.append(key(nxt))
                nxt += 1
            t += rng.random()
            out.append(TraceRequest(t, tuple(hist), len(hist) * BT - rng.randint(0, BT - 1)))
    rng.shuffle(out)  # interleave sessions (from_requests sorts by timestamp)
    return Trace.from_requests("turns", BT, out)


def jumble_trace(rng: random.Random, requests: int, alphabet: int) -> Trace:
    """Key sequences over a small alphabet: the same key follows different keys in different requests."""
    out = []
    for r in range(requests):
        keys = tuple(key(rng.randrange(alphabet)) for _ in range(rng.randint(1, 6)))
        out.append(TraceRequest(float(r), keys, len(keys) * BT - rng.randint(0, BT - 1)))
    return Trace.from_requests("jumble", BT, out)


def comparable(result: Any) -> dict[str, Any]:
    d = result.to_dict()
    for name in ("elapsed_s", "refs_per_s"):
        d.pop(name, None)
    return d  # type: ignore[no-any-return]


def both(trace: Trace, tiers: list[TierConfig], policy: str, inflight: int) -> tuple[dict, dict]:
    native = replay(trace, tiers, policy=policy, kv_bytes_per_token=KV, cost=COST, inflight=inflight)
    with python_only():
        python = replay(trace, tiers, policy=policy, kv_bytes_per_token=KV, cost=COST, inflight=inflight)
    return comparable(native), comparable(python)


traces = st.one_of(
    st.builds(tree_trace, st.randoms(use_true_random=False), st.integers(1, 60), st.integers(1, 6)),
    st.builds(turn_trace, st.randoms(use_true_random=False), st.integers(1, 8), st.integers(1, 8)),
    st.builds(jumble_trace, st.randoms(use_true_random=False), st.integers(1, 60), st.integers(1, 12)),
)
stacks = st.lists(st.tuples(st.sampled_from(POLICIES), st.integers(1, 24)), min_size=1, max_size=3)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(trace=traces, stack=stacks, inflight=st.integers(0, 4))
def test_native_replay_is_the_python_replay(
    trace: Trace, stack: list[tuple[str, int]], inflight: int
) -> None:
    tiers = [
        TierConfig(f"t{i}", slots * BT * KV, bandwidth=1e9 / (i + 1), policy=pol)
        for i, (pol, slots) in enumerate(stack)
    ]
    native, python = both(trace, tiers, stack[0][0], inflight)
    assert native == python


@pytest.mark.parametrize("policy", ["lru", "arc", "session", "adaptive"])
@pytest.mark.parametrize("blocks", [3, 40, 400])
def test_synthetic_chat_matches(policy: str, blocks: int) -> None:
    """A larger workload than hypothesis draws: long conversations, thousands of evictions."""
    trace = synthetic_trace(sessions=60, turns=5, seed=3, block_tokens=BT)
    tiers = [TierConfig("cpu", blocks * BT * KV)]
    native, python = both(trace, tiers, policy, 1)
    assert native == python
    assert native["tiers"][0]["hit_blocks"] > 0


def test_native_path_is_taken_and_interns_once(monkeypatch: pytest.MonkeyPatch) -> None:
    trace = synthetic_trace(sessions=10, turns=3, seed=1, block_tokens=BT)
    calls: list[int] = []
    real = _sim._native_replay.intern

    def counting(requests: Any, *limit: int) -> Any:
        calls.append(len(requests))
        return real(requests, *limit)

    monkeypatch.setattr(_sim._native_replay, "intern", counting, raising=False)
    # (a C module's attribute can be replaced; _run_native looks it up on each call)
    monkeypatch.setattr(_sim, "_run", lambda *a: pytest.fail("the Python loop ran"))
    results = sweep(
        trace,
        [TierConfig("cpu", None)],
        policies=["lru", "arc", "session", "adaptive"],
        sweep_tier="cpu",
        capacities=[BT * KV, 8 * BT * KV, None],
        kv_bytes_per_token=KV,
        cost=COST,
    )
    assert len(results) == 12
    assert calls == [len(trace.requests)]  # one intern for the 12 replays of the sweep


def test_other_policies_take_the_python_loop() -> None:
    """chain-lru, a subclass of a built-in and a custom factory are not covered: the Python loop runs them."""

    class Mine(LRUPolicy):
        pass

    _policies.register_policy("t-mine", lambda c: Mine())
    try:
        trace = synthetic_trace(sessions=5, turns=2, seed=2, block_tokens=BT)
        for pol in ("chain-lru", "t-mine"):
            index = _index.BlockIndex(4, _policies.make_policy(pol, 4))
            assert _sim._run_native(trace, [index], 0, None) is None
        index = _index.BlockIndex(4, _policies.make_policy("lru", 4))
        index.insert_chain([b"x"])  # not a fresh index
        assert _sim._run_native(trace, [index], 0, None) is None
    finally:
        _policies._REGISTRY.pop("t-mine", None)


def test_progress_counts_every_reference_and_its_error_propagates() -> None:
    trace = synthetic_trace(sessions=1200, turns=6, seed=5, block_tokens=BT)

    def run(policy: str, progress: _sim.ProgressFn) -> None:
        replay(
            trace,
            [TierConfig("cpu", 50 * BT * KV)],
            policy=policy,
            kv_bytes_per_token=KV,
            cost=COST,
            progress=progress,
        )

    seen: list[int] = []
    run("adaptive", seen.append)
    assert sum(seen) == trace.block_refs
    assert len(seen) > 1

    def boom(n: int) -> None:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run("session", boom)


def test_intern_ids_follow_first_appearance() -> None:
    import array

    reqs = [TraceRequest(0.0, (b"a", b"b"), 8), TraceRequest(1.0, (b"b", b"c", b"a"), 10)]
    ids, offsets, limits, unique = _sim._native_replay.intern(reqs)
    assert array.array("i", ids).tolist() == [0, 1, 1, 2, 0]
    assert array.array("q", offsets).tolist() == [0, 2, 5]
    assert array.array("q", limits).tolist() == [8, 10]
    assert unique == 3
