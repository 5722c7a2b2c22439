"""The session policy in the replay: the cold hint it gets, and its hit counts against LRU and ARC.

The hit counts are computed here, by the replay, on the Mooncake slices in tests/data; nothing is pinned to a
figure. The capacities are those of the slices' ``--sweep cpu=auto`` where the session policy is ahead of
both LRU and ARC (docs/policies.md lists every capacity, including the ones where it is not, on these short
slices, and the full traces).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from aiokv.replay import CostModel, TierConfig, Trace, TraceRequest, load_trace, replay
from aiokv.tiers import _policies
from aiokv.tiers._policies import SessionPolicy, register_policy

DATA = Path(__file__).resolve().parent.parent / "data"
B = 512  # the slices' block tokens; with one KV byte per token, a block is B bytes
COST = CostModel(prefill_tokens_per_s=1000.0)

# slice -> capacities (blocks) at which session must beat both LRU and ARC
AHEAD = {
    "mooncake_conversation_head400.jsonl": [4910],
    "mooncake_synthetic_tail400.jsonl": [43, 174, 348, 697, 1394],
}


def hits(trace: Trace, policy: str, blocks: int) -> int:
    r = replay(trace, [TierConfig("cpu", blocks * B)], policy=policy, kv_bytes_per_token=1, cost=COST)
    return r.hit_blocks


@pytest.mark.parametrize(
    ("name", "blocks"), [(name, blocks) for name, caps in AHEAD.items() for blocks in caps]
)
def test_session_beats_lru_and_arc_on_the_mooncake_slices(name: str, blocks: int) -> None:
    trace = load_trace(DATA / name)
    got = {policy: hits(trace, policy, blocks) for policy in ("lru", "arc", "session")}
    assert got["session"] > max(got["lru"], got["arc"]), got


def test_the_ahead_capacities_are_the_auto_sweep_of_each_slice() -> None:
    """Guard the guard: the chosen capacities are points of the default sweep, not tuned in between."""
    from aiokv.replay._sim import auto_capacities

    for name, caps in AHEAD.items():
        sweep = [c // B for c in auto_capacities(load_trace(DATA / name), B)]
        assert set(caps) <= set(sweep), (name, sweep)


def test_session_equals_the_trace_maximum_with_unlimited_capacity() -> None:
    trace = load_trace(DATA / "mooncake_synthetic_tail400.jsonl")
    assert hits(trace, "session", trace.unique_blocks) == hits(trace, "lru", trace.unique_blocks)


class _Recording(SessionPolicy):
    hinted: list[bytes]

    def hint_cold(self, key: bytes) -> None:
        self.hinted.append(key)
        super().hint_cold(key)


def test_the_replay_hints_only_a_partial_last_block_when_its_request_is_stored() -> None:
    """Request 1 ends inside its last block (700 tokens in two 512-token blocks): that block is hinted cold
    when request 1 is stored, not before. Request 2 fills its blocks exactly: no hint. Request 3 only hits:
    nothing is stored, no hint."""
    made: list[_Recording] = []

    def factory(capacity: int) -> SessionPolicy:
        p = _Recording(capacity)
        p.hinted = []
        made.append(p)
        return p

    reqs = [
        TraceRequest(0.0, (b"a", b"b"), 700),
        TraceRequest(1.0, (b"c", b"d"), 1024),
        TraceRequest(2.0, (b"a",), 512),
    ]
    trace = Trace.from_requests("hand", B, reqs)
    register_policy("test-session-recording", factory)
    try:
        replay(
            trace,
            [TierConfig("cpu", 8 * B)],
            policy="test-session-recording",
            kv_bytes_per_token=1,
            cost=COST,
        )
    finally:
        del _policies._REGISTRY["test-session-recording"]
    assert made[0].hinted == [b"b"]
    assert made[0].cold() == [b"b"]


def test_a_cold_block_goes_first_in_the_replay() -> None:
    """Capacity 3. x is stored, then a and its partial tail b (cold). Storing c needs a slot: LRU evicts the
    least recent x, the session policy the cold b. x comes back: a hit for the session policy only."""
    reqs = [
        TraceRequest(0.0, (b"x",), 512),
        TraceRequest(1.0, (b"a", b"b"), 700),
        TraceRequest(2.0, (b"c",), 512),
        TraceRequest(3.0, (b"x",), 512),
    ]
    trace = Trace.from_requests("hand", B, reqs)
    assert hits(trace, "session", 3) == 1
    assert hits(trace, "lru", 3) == 0
