"""``aiokv replay`` with KV-cache groups (issue 20): the key block's parts and units are the offloader's, the
simulator's hits are the real Offloader's request by request, and a sliding-window model stores and needs far
less than the same model counted as all-full."""

from __future__ import annotations

import itertools
import json
import random
from pathlib import Path

import pytest
import torch

import aiokv
import aiokv._offloader
from aiokv import CPUTier, KVGroup, KVLayout, Offloader
from aiokv._errors import CapacityError, InvalidArgumentError
from aiokv._groups import window_blocks
from aiokv.cli import main
from aiokv.replay import (
    GROUP_PRESETS,
    CostModel,
    GroupSpec,
    KVGroups,
    ReplayResult,
    TierConfig,
    Trace,
    TraceRequest,
    capacity_for_hit_ratio,
    load_trace,
    parse_kv_groups,
    replay,
)
from aiokv.replay._groups import _window_blocks

DATA = Path(__file__).resolve().parent.parent / "data"
CONV = DATA / "mooncake_conversation_head400.jsonl"
COST = CostModel(prefill_tokens_per_s=1000.0)
BS = 16

# One engine tensor per group, float32: bytes per token (or per snapshot) of each kind.
_SHAPES = {"full": (BS, 2, 4), "sliding_window": (BS, 2, 4), "latent": (BS, 12), "state": (3, 8)}
_BYTES = {"full": 32, "sliding_window": 32, "latent": 48, "state": 96}

LAYOUTS: dict[str, tuple[list[tuple[str, int | None]], int]] = {
    "full+sliding": ([("full", None), ("sliding_window", 40)], 4),
    "full+two-windows": ([("full", None), ("sliding_window", 20), ("sliding_window", 56)], 6),
    "sliding+state": ([("sliding_window", 20), ("state", None)], 4),
    "full+latent+sliding+state": (
        [("full", None), ("latent", None), ("sliding_window", 40), ("state", None)],
        5,
    ),
}


def _layout(kinds: list[tuple[str, int | None]], checkpoint: int, num_blocks: int = 8) -> KVLayout:
    groups = [
        KVGroup([torch.zeros(num_blocks, *_SHAPES[kind])], kind=kind, window=window) for kind, window in kinds
    ]
    return KVLayout.from_groups(groups, BS, checkpoint_blocks=checkpoint)


def _groups(kinds: list[tuple[str, int | None]], checkpoint: int | None) -> KVGroups:
    return KVGroups(tuple(GroupSpec(kind, 1, _BYTES[kind], window) for kind, window in kinds), checkpoint)


# ------------------------------------------------------------------------------------ the key block's plan
@pytest.mark.parametrize("name", sorted(LAYOUTS))
@pytest.mark.parametrize("checkpoint", [None, 7])
def test_plan_matches_the_grouped_layout(name: str, checkpoint: int | None) -> None:
    kinds, _ = LAYOUTS[name]
    lay = (
        _layout(kinds, checkpoint)
        if checkpoint
        else KVLayout.from_groups(
            [KVGroup([torch.zeros(8, *_SHAPES[k])], kind=k, window=w) for k, w in kinds], BS
        )
    )
    plan = _groups(kinds, checkpoint).plan(BS)
    assert plan.unit_bytes == lay.slot_bytes
    assert [(p.nbytes, p.units, p.first_unit, p.groups) for p in plan.parts] == [
        (p.nbytes, p.units, p.first_unit, p.groups) for p in lay.parts
    ]
    assert plan.units == len(lay.unit_parts)
    assert plan.padding_bytes == lay.padding_bytes
    assert plan.block_bytes == lay.block_bytes
    assert plan.checkpoint_blocks == lay.retention.checkpoint
    assert [(i, p.window_blocks) for i, p in enumerate(plan.parts) if p.cls == "window"] == list(lay.windows)


def test_window_blocks_mirror_agrees() -> None:
    for window in range(1, 200):
        for bt in (1, 2, 7, 16, 512):
            assert _window_blocks(window, bt) == window_blocks(window, bt)


# --------------------------------------------------------------------- agreement with the real Offloader
def _prompts(seed: int, n: int) -> list[list[int]]:
    """Multi-turn sessions sharing system prompts; every prompt ends inside a block (its length mod 16 in
    1..14), so the offloader's lookup covers every full block, the replay's unit, and the one decoded token
    does not complete another."""
    rng = random.Random(seed)
    systems = [[rng.randrange(1, 30000) for _ in range(rng.randrange(2, 5) * BS)] for _ in range(2)]
    sessions: list[list[int]] = []
    out: list[list[int]] = []
    for _ in range(n):
        if not sessions or rng.random() < 0.35:
            sessions.append(list(rng.choice(systems)))
        s = rng.choice(sessions)
        s += [rng.randrange(1, 30000) for _ in range(rng.randrange(1, 5 * BS))]
        # 30%: a prompt cut short, sharing a prefix that ends anywhere
        prompt = s[: rng.randrange(1, len(s) + 1)] if rng.random() < 0.3 else list(s)
        k = len(prompt) % BS
        if k == 0 or k == BS - 1:
            prompt = prompt + [5] * (3 if k == 0 else 2)
        out.append(prompt)
    return out


async def _offloader_hits(lay: KVLayout, prompts: list[list[int]], capacity_units: int) -> list[int]:
    """Serve ``prompts`` one at a time through a real Offloader: lookup, load the hit, prefill the rest,
    decode one token, finish. Returns each request's hit tokens."""
    hits: list[int] = []
    ngroups = len(lay.groups)  # type: ignore[attr-defined]
    async with Offloader(lay, tiers=[CPUTier(capacity_bytes=capacity_units * lay.slot_bytes)]) as off:
        for r, tokens in enumerate(prompts):
            req = off.open(f"r{r}", tokens)
            hit = await req.lookup()
            hits.append(hit)
            nblocks = -(-(len(tokens) + 1) // BS)
            ids = list(range(nblocks))
            if hit:
                got = await req.load(tuple(ids[: hit // BS] for _ in range(ngroups)))
                assert got == hit
            rest = ids[hit // BS :]
            req.step(len(tokens), [7], tuple(rest for _ in range(ngroups)))
            await req.finish()
    return hits


def _replay_hits(groups: KVGroups, prompts: list[list[int]], capacity_units: int) -> tuple[list[int], int]:
    """Each request's hit tokens in the replay: the difference of the totals of consecutive prefixes of the
    trace (with nothing in flight, a prefix replays exactly as the start of the whole trace), and the units
    the whole trace evicted."""
    reqs = [TraceRequest(float(i), tuple(aiokv.block_hashes(p, BS)), len(p)) for i, p in enumerate(prompts)]
    unit = groups.plan(BS).unit_bytes
    totals = [0]
    for i in range(1, len(reqs) + 1):
        trace = Trace.from_requests("t", BS, reqs[:i])
        r = replay(trace, [TierConfig("cpu", capacity_units * unit)], groups=groups, cost=COST)
        totals.append(r.hit_tokens)
    return [b - a for a, b in itertools.pairwise(totals)], r.tiers[0].evicted_blocks


@pytest.mark.asyncio
@pytest.mark.parametrize("name", sorted(LAYOUTS))
@pytest.mark.parametrize(("seed", "capacity_units"), [(1, 4096), (2, 4096), (3, 40), (4, 25)])
async def test_hits_match_the_real_offloader(
    name: str, seed: int, capacity_units: int
) -> None:
    """Same requests, same order: the replay's hit tokens are the real Offloader's, request by request, with
    room for everything (4096 units) and under eviction (40 and 25 units of an LRU CPU tier). The offloader's
    CPU-tier lookup follows :func:`aiokv._grouprule.longest_hit` exactly (seed 1, ``sliding+state``,
    request 33 once found 0 where the rule finds 13 blocks, when the lookup gave up after 8 back-offs)."""
    kinds, checkpoint = LAYOUTS[name]
    prompts = _prompts(seed, 40)
    lay = _layout(kinds, checkpoint, num_blocks=max(-(-(len(p) + 1) // BS) for p in prompts))
    groups = _groups(kinds, checkpoint)
    want = await _offloader_hits(lay, prompts, capacity_units)
    got, evicted = _replay_hits(groups, prompts, capacity_units)
    assert got == want
    assert (evicted > 0) == (capacity_units < 4096)
    assert sum(want) > 0  # the trace does reuse prefixes


# ------------------------------------------------------------------- what the groups save on a real trace
@pytest.fixture(scope="module")
def conversation() -> Trace:
    return load_trace(CONV)


def test_sliding_window_model_stores_and_needs_far_less_than_all_full(conversation: Trace) -> None:
    """Same trace, Gemma-3-like groups against the same 62 layers counted as all-full: the retention stores
    about a third of the bytes, and the CPU capacity reaching the same token hit ratio is far smaller."""
    gemma = GROUP_PRESETS["gemma3-like"].kv_groups()
    full = gemma.as_full()
    unlimited = [TierConfig("cpu", None)]
    g = replay(conversation, unlimited, groups=gemma, cost=COST)
    f = replay(conversation, unlimited, groups=full, cost=COST)
    assert f.stored_bytes > 2.5 * g.stored_bytes
    assert g.retention_saved_bytes > g.stored_bytes
    assert f.retention_saved_bytes == 0
    assert 0 < g.token_hit_ratio <= f.token_hit_ratio  # hits only at kept boundaries
    target = 0.8 * g.token_hit_ratio
    cap_g, at_g = capacity_for_hit_ratio(conversation, unlimited, target, groups=gemma, cost=COST)
    cap_f, at_f = capacity_for_hit_ratio(conversation, unlimited, target, groups=full, cost=COST)
    assert cap_g is not None
    assert cap_f is not None
    assert cap_f > 2 * cap_g
    assert at_g.token_hit_ratio >= target
    assert at_f.token_hit_ratio >= target
    # the smallest: one unit less falls short
    unit = gemma.plan(conversation.block_tokens).unit_bytes
    short = replay(conversation, [TierConfig("cpu", cap_g - unit)], groups=gemma, cost=COST)
    assert short.token_hit_ratio < target


def test_all_full_groups_replay_as_the_uniform_cache(conversation: Trace) -> None:
    """Groups that are all full attention store every block as one unit: the replay is the one-group one."""
    groups = KVGroups((GroupSpec("full", 4, 64), GroupSpec("full", 2, 64)))
    kv = 6 * 64
    for cap in (None, 3000 * conversation.block_tokens * kv):
        tiers = [TierConfig("cpu", cap)]
        g = replay(conversation, tiers, groups=groups, cost=COST)
        u = replay(conversation, tiers, kv_bytes_per_token=kv, cost=COST)
        assert (g.hit_blocks, g.hit_tokens, g.stored_bytes) == (u.hit_blocks, u.hit_tokens, u.stored_bytes)
        assert g.tiers[0].evicted_blocks == u.tiers[0].evicted_blocks
        assert g.tiers[0].loaded_bytes == u.tiers[0].loaded_bytes


def test_state_and_latent_presets_replay(conversation: Trace) -> None:
    for name in ("gpt-oss-like", "mla-like", "hybrid-state"):
        r = replay(
            conversation, [TierConfig("cpu", 1 << 40)], groups=GROUP_PRESETS[name].kv_groups(), cost=COST
        )
        assert 0 < r.hit_blocks <= r.block_refs
        assert (r.retention_saved_bytes > 0) == (name != "mla-like")
        d = r.to_dict()
        assert d["groups"]["unit_bytes"] == r.unit_bytes
        assert d["stored_bytes"] == r.stored_bytes


# ----------------------------------------------------------------------------------------- the grammar
def test_kv_groups_grammar() -> None:
    g = parse_kv_groups("full:layers=4,sliding_window:layers=20:window=1024:name=local", default_bytes=4096)
    assert [(s.kind, s.layers, s.bytes, s.window, s.name) for s in g.groups] == [
        ("full", 4, 4096, None, "full0"),
        ("sliding_window", 20, 4096, 1024, "local"),
    ]
    g = parse_kv_groups("latent:layers=61:bytes=1152, state:layers=2:bytes=1MiB", checkpoint_blocks=8)
    assert [s.bytes for s in g.groups] == [1152, 1 << 20]
    assert g.checkpoint_blocks == 8
    assert parse_kv_groups("gemma3-like").name == "gemma3-like"


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (
            "mamba:layers=2",
            r"kv-groups group 1 \('mamba:layers=2'\): kind must be one of full, sliding_window",
        ),
        ("gemma3", r"kind must be one of full, sliding_window, latent, state or a preset \(gemma3-like"),
        (
            "full:layers=4,sliding_window:layers=2",
            r"group 2 .*: window must be given for a sliding_window group",
        ),
        ("full:window=8", r"window is only for sliding_window groups"),
        ("latent:layers=2", r"bytes must be given for a latent group \(per token and layer\)"),
        ("state", r"bytes must be given for a state group \(per state snapshot and layer\)"),
        ("full:layers=0", r"layers must be in \[1, 4096\], got 0"),
        ("full:layers=x", r"layers must be an int, got 'x'"),
        ("full:heads=8", r"option must be one of layers, bytes, window, name, got 'heads'"),
        ("full:layers", r"options must look like key=value, got 'layers'"),
        ("full:bytes=4Gb", r"bytes must be in bytes"),
        ("full:name=a,full:name=a", r"groups\[1\].name must be unique"),
        ("", r"kv-groups must look like KIND:layers=N:bytes=SIZE"),
    ],
)
def test_kv_groups_errors_name_the_flag_and_the_constraint(spec: str, message: str) -> None:
    with pytest.raises(InvalidArgumentError, match=message):
        parse_kv_groups(spec, default_bytes=4096)


def test_api_errors() -> None:
    trace = Trace.from_requests("t", 4, [TraceRequest(0.0, (b"a", b"b"), 8)])
    groups = KVGroups((GroupSpec("full", 1, 8), GroupSpec("sliding_window", 1, 8, window=4)))
    with pytest.raises(InvalidArgumentError, match="kv_bytes_per_token must be None when groups are given"):
        replay(trace, [TierConfig("cpu", None)], groups=groups, kv_bytes_per_token=8, cost=COST)
    with pytest.raises(
        CapacityError, match=r"must hold at least one key block of 64 bytes \(2 units of 32 bytes\)"
    ):
        replay(trace, [TierConfig("cpu", 63)], groups=groups, cost=COST)
    with pytest.raises(InvalidArgumentError, match=r"groups\[0\].window must be None for a full group"):
        KVGroups((GroupSpec("full", 1, 8, window=4),))
    with pytest.raises(InvalidArgumentError, match="target hit ratio must be in"):
        capacity_for_hit_ratio(trace, [TierConfig("cpu", None)], 1.5, groups=groups, cost=COST)


def test_uniform_results_carry_no_group_fields() -> None:
    trace = Trace.from_requests("t", 4, [TraceRequest(0.0, (b"a", b"b"), 8), TraceRequest(1.0, (b"a",), 4)])
    d = replay(trace, [TierConfig("cpu", None)], kv_bytes_per_token=1, cost=COST).to_dict()
    assert "groups" not in d
    assert "retention_saved_bytes" not in d
    assert "stored_bytes" not in d
    assert "unit_bytes" not in d["tiers"][0]
    assert isinstance(replay(trace, [TierConfig("cpu", None)], kv_bytes_per_token=1, cost=COST), ReplayResult)


# ------------------------------------------------------------------------------------------ the command
def test_cli_json_with_groups_and_target(capsys: pytest.CaptureFixture[str]) -> None:
    argv = [
        "replay",
        str(CONV),
        "--kv-groups",
        "gemma3-like",
        "--tiers",
        "cpu=1TiB",
        "--target-hit-rate",
        "8%",
    ]
    assert main([*argv, "--json", "--no-progress"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["kv_groups"] == "gemma3-like"
    run, full = out["runs"][0], out["as_full_runs"][0]
    assert run["groups"]["units_per_block"] == 7
    assert run["groups"]["checkpoint_blocks"] == 16
    assert full["stored_bytes"] > 2.5 * run["stored_bytes"]
    (target,) = out["targets"]
    assert target["target"] == 0.08
    assert target["as_full"]["capacity_bytes"] > 2 * target["capacity_bytes"]


def test_cli_table_with_custom_groups(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("rich")
    spec = "full:layers=8,sliding_window:layers=24:window=1024"
    assert main(["replay", str(CONV), "--kv-groups", spec, "--checkpoint-blocks", "8", "--no-progress"]) == 0
    text = " ".join(capsys.readouterr().out.split())  # the table's caption wraps
    assert "KV-cache groups" in text
    assert "sliding_window" in text
    assert "every 8 blocks" in text
    assert "as all-full: stored" in text


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--checkpoint-blocks", "8"], "checkpoint-blocks needs --kv-groups"),
        (["--kv-groups", "gemma3-like", "--kv-bytes-per-token", "8"], "kv-bytes-per-token must not be given"),
        (["--kv-groups", "gemma3-like", "--checkpoint-blocks", "0"], "checkpoint-blocks must be in"),
        (
            ["--kv-groups", "full:layers=2,swa:layers=2"],
            "kv-groups group 2 ('swa:layers=2'): kind must be one of",
        ),
        (["--target-hit-rate", "150%"], "target-hit-rate must be a ratio in (0, 1] or a percentage"),
        (["--kv-groups", "gemma3-like", "--tiers", "cpu=100MiB"], "must hold at least one key block"),
    ],
)
def test_cli_refuses_bad_group_flags(
    capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    assert main(["replay", str(CONV), *argv, "--json", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("aiokv replay: error: ")
    assert message in err
    assert err.count("\n") == 1
