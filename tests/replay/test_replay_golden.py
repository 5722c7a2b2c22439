"""Replay results pinned to the figures of the per-block implementation.

The index and the policies have fast paths for replay (whole-chain inserts, O(1) victim pops, the LRU policy
inlined into the index). They must not change a single eviction, so these figures, produced by the plain
per-block implementation (aiokv before the fast paths, commit a431de8) on the Mooncake slices in tests/data,
must stay exactly as they are: total hit blocks and hit tokens, then per tier (hits, stored, staged, evicted).
tests/tiers/test_index_fastpath.py compares the fast paths with a reference step by step.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from aiokv.replay import CostModel, TierConfig, Trace, load_trace, replay

DATA = Path(__file__).resolve().parent.parent / "data"
SLICES = {
    "conversation": "mooncake_conversation_head400.jsonl",
    "synthetic": "mooncake_synthetic_tail400.jsonl",
}
B = 512  # the slices' block tokens; with one KV byte per token, a block is B bytes
# name -> ([(tier, capacity in blocks, policy override)], inflight)
LAYOUTS: dict[str, tuple[list[tuple[str, int, str | None]], int]] = {
    "cpu16": ([("cpu", 16, None)], 0),
    "cpu64": ([("cpu", 64, None)], 0),
    "cpu256": ([("cpu", 256, None)], 0),
    "cpu1024": ([("cpu", 1024, None)], 0),
    "cpu256-inflight3": ([("cpu", 256, None)], 3),
    "cpu64+disk1024": ([("cpu", 64, None), ("disk", 1024, None)], 0),
    "cpu16+disk128+redis512-inflight2": ([("cpu", 16, None), ("disk", 128, None), ("redis", 512, None)], 2),
    "cpu64arc+disk512chain": ([("cpu", 64, "arc"), ("disk", 512, "chain-lru")], 1),
}

GOLDEN: dict[tuple[str, str, str], tuple[int, int, tuple[tuple[int, int, int, int], ...]]] = {
    ("conversation", "cpu16", "lru"): (399, 204288, ((399, 10950, 0, 10934),)),
    ("conversation", "cpu16", "arc"): (399, 204288, ((399, 10950, 0, 10934),)),
    ("conversation", "cpu16", "chain-lru"): (399, 204288, ((399, 10950, 0, 10934),)),
    ("conversation", "cpu64", "lru"): (399, 204288, ((399, 10950, 0, 10886),)),
    ("conversation", "cpu64", "arc"): (399, 204288, ((399, 10950, 0, 10886),)),
    ("conversation", "cpu64", "chain-lru"): (399, 204288, ((399, 10950, 0, 10886),)),
    ("conversation", "cpu256", "lru"): (399, 204288, ((399, 10950, 0, 10694),)),
    ("conversation", "cpu256", "arc"): (399, 204288, ((399, 10950, 0, 10694),)),
    ("conversation", "cpu256", "chain-lru"): (399, 204288, ((399, 10950, 0, 10694),)),
    ("conversation", "cpu1024", "lru"): (399, 204288, ((399, 10950, 0, 9926),)),
    ("conversation", "cpu1024", "arc"): (399, 204288, ((399, 10950, 0, 9926),)),
    ("conversation", "cpu1024", "chain-lru"): (399, 204288, ((399, 10950, 0, 9926),)),
    ("conversation", "cpu256-inflight3", "lru"): (396, 202752, ((396, 10950, 0, 10694),)),
    ("conversation", "cpu256-inflight3", "arc"): (396, 202752, ((396, 10950, 0, 10694),)),
    ("conversation", "cpu256-inflight3", "chain-lru"): (396, 202752, ((396, 10950, 0, 10694),)),
    ("conversation", "cpu64+disk1024", "lru"): (399, 204288, ((399, 10950, 0, 10886), (0, 10950, 0, 9926))),
    ("conversation", "cpu64+disk1024", "arc"): (399, 204288, ((399, 10950, 0, 10886), (0, 10950, 0, 9926))),
    ("conversation", "cpu64+disk1024", "chain-lru"): (
        399,
        204288,
        ((399, 10950, 0, 10886), (0, 10950, 0, 9926)),
    ),
    ("conversation", "cpu16+disk128+redis512-inflight2", "lru"): (
        397,
        203264,
        ((397, 10950, 0, 10934), (0, 10950, 0, 10822), (0, 10950, 0, 10438)),
    ),
    ("conversation", "cpu16+disk128+redis512-inflight2", "arc"): (
        397,
        203264,
        ((397, 10950, 0, 10934), (0, 10950, 0, 10822), (0, 10950, 0, 10438)),
    ),
    ("conversation", "cpu16+disk128+redis512-inflight2", "chain-lru"): (
        397,
        203264,
        ((397, 10950, 0, 10934), (0, 10950, 0, 10822), (0, 10950, 0, 10438)),
    ),
    ("conversation", "cpu64arc+disk512chain", "lru"): (
        398,
        203776,
        ((398, 10950, 0, 10886), (0, 10950, 0, 10438)),
    ),
    ("synthetic", "cpu16", "lru"): (98, 50176, ((98, 17564, 0, 17548),)),
    ("synthetic", "cpu16", "arc"): (132, 67584, ((132, 17530, 0, 17514),)),
    ("synthetic", "cpu16", "chain-lru"): (98, 50176, ((98, 17564, 0, 17548),)),
    ("synthetic", "cpu64", "lru"): (361, 184832, ((361, 17301, 0, 17237),)),
    ("synthetic", "cpu64", "arc"): (335, 171520, ((335, 17327, 0, 17263),)),
    ("synthetic", "cpu64", "chain-lru"): (361, 184832, ((361, 17301, 0, 17237),)),
    ("synthetic", "cpu256", "lru"): (1575, 806200, ((1575, 16087, 0, 15831),)),
    ("synthetic", "cpu256", "arc"): (1465, 749880, ((1465, 16197, 0, 15941),)),
    ("synthetic", "cpu256", "chain-lru"): (1575, 806200, ((1575, 16087, 0, 15831),)),
    ("synthetic", "cpu1024", "lru"): (5897, 3017979, ((5897, 11765, 0, 10741),)),
    ("synthetic", "cpu1024", "arc"): (6154, 3149563, ((6154, 11508, 0, 10484),)),
    ("synthetic", "cpu1024", "chain-lru"): (5897, 3017979, ((5897, 11765, 0, 10741),)),
    ("synthetic", "cpu256-inflight3", "lru"): (1585, 811520, ((1585, 15516, 0, 15260),)),
    ("synthetic", "cpu256-inflight3", "arc"): (1409, 721408, ((1409, 15796, 0, 15540),)),
    ("synthetic", "cpu256-inflight3", "chain-lru"): (1609, 823808, ((1609, 15492, 0, 15236),)),
    ("synthetic", "cpu64+disk1024", "lru"): (
        5897,
        3017979,
        ((361, 11765, 5536, 17237), (5536, 11765, 0, 10741)),
    ),
    ("synthetic", "cpu64+disk1024", "arc"): (
        6102,
        3123733,
        ((335, 11560, 5767, 17263), (5767, 11560, 0, 10536)),
    ),
    ("synthetic", "cpu64+disk1024", "chain-lru"): (
        5897,
        3017979,
        ((361, 11765, 5536, 17237), (5536, 11765, 0, 10741)),
    ),
    ("synthetic", "cpu16+disk128+redis512-inflight2", "lru"): (
        3215,
        1646080,
        ((55, 14375, 3160, 17519), (400, 14059, 2689, 16620), (2760, 13987, 0, 13475)),
    ),
    ("synthetic", "cpu16+disk128+redis512-inflight2", "arc"): (
        3295,
        1687040,
        ((84, 14331, 3211, 17526), (456, 14119, 2755, 16746), (2755, 13910, 0, 13398)),
    ),
    ("synthetic", "cpu16+disk128+redis512-inflight2", "chain-lru"): (
        3433,
        1757696,
        ((55, 14169, 3378, 17531), (487, 13821, 2891, 16584), (2891, 13764, 0, 13252)),
    ),
    ("synthetic", "cpu64arc+disk512chain", "lru"): (
        3426,
        1753912,
        ((126, 14026, 3299, 17261), (3300, 14022, 0, 13510)),
    ),
}


@pytest.fixture(scope="module", params=sorted(SLICES))
def named_trace(request: pytest.FixtureRequest) -> tuple[str, Trace]:
    name = str(request.param)
    return name, load_trace(DATA / SLICES[name])


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_replay_matches_the_per_block_figures(named_trace: tuple[str, Trace], layout: str) -> None:
    name, trace = named_trace
    tiers, inflight = LAYOUTS[layout]
    cases = [(pol, want) for (sl, lay, pol), want in GOLDEN.items() if sl == name and lay == layout]
    assert cases
    for policy, want in cases:
        r = replay(
            trace,
            [TierConfig(tier, blocks * B, None, pol) for tier, blocks, pol in tiers],
            policy=policy,
            kv_bytes_per_token=1,
            cost=CostModel(prefill_tokens_per_s=1000.0),
            inflight=inflight,
        )
        got = (
            r.hit_blocks,
            r.hit_tokens,
            tuple((t.hit_blocks, t.stored_blocks, t.staged_blocks, t.evicted_blocks) for t in r.tiers),
        )
        assert got == want, (name, layout, policy)


def test_the_figures_tell_the_policies_apart() -> None:
    """Guard the guard: on the synthetic slice the three policies differ, so a policy swap would show."""
    hits = {pol: GOLDEN["synthetic", "cpu256", pol][0] for pol in ("lru", "arc", "chain-lru")}
    assert hits["arc"] != hits["lru"]
    assert (
        GOLDEN["synthetic", "cpu16+disk128+redis512-inflight2", "chain-lru"]
        != GOLDEN["synthetic", "cpu16+disk128+redis512-inflight2", "lru"]
    )
