"""``aiokv replay`` with encoded tiers (``--tiers cpu=...,disk=SIZE:encoding=fp8``): a tier holds the blocks the
real tier holds in that encoding (checked against a real ``DiskTier`` and ``RedisTier`` opened with the same
layout), loads move encoded bytes, and encodings it cannot size are refused."""

from __future__ import annotations

import json
import socket
from pathlib import Path
from typing import Any

import pytest
import torch

import aiokv
from aiokv.cli import main
from aiokv.replay import (
    COST_PRESETS,
    CostModel,
    ModelPreset,
    TierConfig,
    capacity_for_hit_ratio,
    replay,
    synthetic_trace,
)
from aiokv.tiers._base import TierSpec
from aiokv.tiers._codec import segments_of
from aiokv.tiers.disk import DiskTier

BT = 16
TINY = ModelPreset("tiny", layers=3, kv_heads=4, head_dim=32, params=1e9)
COST = CostModel(TINY.prefill_tokens_per_s)
ENCODINGS = ("raw", "fp8", "int8")


def _layout(model: ModelPreset, *, joint: bool, dtype: torch.dtype = torch.bfloat16) -> aiokv.KVLayout:
    """A real layout of ``model``'s KV: vLLM's ``(2, blocks, block_size, heads, head_dim)`` per layer
    (``joint``), or separate K and V tensors ``(blocks, block_size, heads, head_dim)``."""
    shape = (BT, model.kv_heads, model.head_dim)
    if joint:
        tensors = [torch.zeros(2, 2, *shape, dtype=dtype) for _ in range(model.layers)]
        layout = aiokv.KVLayout(tensors, block_size=BT, block_dim=1)
    else:
        tensors = [torch.zeros(2, *shape, dtype=dtype) for _ in range(2 * model.layers)]
        layout = aiokv.KVLayout(tensors, block_size=BT, tensors_per_layer=2)
    assert layout.slot_bytes == BT * model.kv_bytes_per_token
    return layout


def _spec(layout: aiokv.KVLayout) -> TierSpec:
    return TierSpec(layout.slot_bytes, layout.fingerprint, BT, "replay encoding test", segments_of(layout))


def _trace(sessions: int = 30) -> aiokv.replay.Trace:
    return synthetic_trace(sessions=sessions, turns=4, block_tokens=BT, seed=1)


def _tier(result: aiokv.replay.ReplayResult, name: str) -> aiokv.replay.TierResult:
    return next(t for t in result.tiers if t.name == name)


# ---------------------------------------------------------------------------- the real tiers' arithmetic
@pytest.mark.asyncio
@pytest.mark.parametrize("encoding", ENCODINGS)
@pytest.mark.parametrize("joint", [True, False])
@pytest.mark.parametrize("dtype_bytes", [2, 4])
async def test_disk_blocks_are_what_a_real_disk_tier_holds(
    tmp_path: Path, encoding: str, joint: bool, dtype_bytes: int
) -> None:
    model = ModelPreset("m", layers=3, kv_heads=4, head_dim=32, params=1e9, dtype_bytes=dtype_bytes)
    dtype = torch.bfloat16 if dtype_bytes == 2 else torch.float32
    capacity = 5_000_000  # not a multiple of any entry: the rounding is the tier's
    r = replay(
        _trace(5),
        [TierConfig("cpu", None), TierConfig("disk", capacity, encoding=encoding)],
        model=model,
        cost=COST,
    )
    disk = _tier(r, "disk")
    real = DiskTier(tmp_path / "d", capacity, encoding=encoding, preallocate=False)
    await real.open(_spec(_layout(model, joint=joint, dtype=dtype)))
    try:
        stats = real.stats()
        assert (disk.capacity_blocks, disk.entry_bytes) == (stats.num_slots, stats.entry_bytes)
    finally:
        await real.aclose()
    assert disk.encoding == encoding
    if encoding == "raw":
        assert disk.payload_bytes == BT * model.kv_bytes_per_token
    else:  # one byte per element and a float32 scale per (layer, K or V, KV head)
        elements = BT * model.kv_bytes_per_token // dtype_bytes
        assert disk.payload_bytes == elements + 4 * model.layers * 2 * model.kv_heads


@pytest.mark.asyncio
@pytest.mark.parametrize("encoding", ENCODINGS)
async def test_redis_entry_is_what_a_real_redis_tier_sends(encoding: str) -> None:
    pytest.importorskip("redis")
    from aiokv.tiers.redis import RedisTier

    with socket.socket() as s:  # a port nothing listens on: the tier opens "down" and sizes its values
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    r = replay(
        _trace(5),
        [TierConfig("cpu", None), TierConfig("redis", 1 << 30, encoding=encoding)],
        model=TINY,
        cost=COST,
    )
    tier = _tier(r, "redis")
    real = RedisTier(f"redis://127.0.0.1:{port}/0", encoding=encoding, timeout_s=0.2)
    await real.open(_spec(_layout(TINY, joint=True)))
    try:
        assert tier.entry_bytes == real.stats().max_value_bytes  # header + payload, one value
    finally:
        await real.aclose()
    assert tier.capacity_blocks == (1 << 30) // tier.entry_bytes


def test_no_encoding_keeps_capacity_over_block_bytes() -> None:
    r = replay(_trace(5), [TierConfig("cpu", None), TierConfig("disk", 5_000_000)], model=TINY, cost=COST)
    disk = _tier(r, "disk")
    block = BT * TINY.kv_bytes_per_token
    assert (disk.encoding, disk.entry_bytes, disk.payload_bytes) == (None, block, block)
    assert disk.capacity_blocks == 5_000_000 // block


# ------------------------------------------------------------------------------- hits and bytes moved
def test_fp8_holds_about_twice_the_blocks_and_hits_more_when_raw_is_short() -> None:
    trace = _trace()
    block = BT * TINY.kv_bytes_per_token
    capacity = trace.unique_blocks * block // 4  # raw holds a quarter of the working set
    runs = {
        enc: replay(
            trace,
            [TierConfig("cpu", 8 * block), TierConfig("disk", capacity, encoding=enc)],
            model=TINY,
            cost=COST,
        )
        for enc in ENCODINGS
    }
    raw, fp8, int8 = (_tier(runs[e], "disk") for e in ENCODINGS)
    assert raw.capacity_blocks is not None
    assert fp8.capacity_blocks is not None
    assert raw.capacity_blocks < trace.unique_blocks
    assert fp8.capacity_blocks >= 1.7 * raw.capacity_blocks  # 4 KiB pages: a 24 KiB block gains less than 2x
    assert fp8.capacity_blocks == int8.capacity_blocks
    assert fp8.slots == min(fp8.capacity_blocks, trace.unique_blocks)
    assert runs["fp8"].block_hit_ratio > runs["raw"].block_hit_ratio
    assert runs["fp8"].token_hit_ratio > runs["raw"].token_hit_ratio
    assert fp8.hit_blocks > raw.hit_blocks


def test_loads_and_stores_move_the_encoded_payload() -> None:
    trace = _trace()
    tiers = [
        TierConfig("cpu", 4 * BT * TINY.kv_bytes_per_token),
        TierConfig("disk", None, 1e9, encoding="fp8"),
    ]
    r = replay(trace, tiers, model=TINY, cost=CostModel(COST.prefill_tokens_per_s, load_policy="always"))
    disk = _tier(r, "disk")
    assert disk.hit_blocks > 0
    assert disk.stored_blocks > 0
    assert disk.payload_bytes < disk.block_bytes
    assert disk.loaded_bytes == disk.hit_blocks * disk.payload_bytes
    assert disk.stored_bytes == disk.stored_blocks * disk.payload_bytes
    assert disk.load_s == pytest.approx(disk.hit_blocks * disk.payload_bytes / 1e9)
    saved = r.loaded_tokens / r.prefill_tokens_per_s - sum(t.load_s for t in r.tiers)
    assert r.ttft_saved_s == pytest.approx(saved)


def test_load_decision_weighs_the_encoded_bytes() -> None:
    """A bandwidth at which a raw block loads slower than it recomputes but an fp8 one faster: the planner
    (load_policy decide) skips the raw tier's hits and loads the fp8 tier's."""
    trace = _trace()
    block = BT * TINY.kv_bytes_per_token
    # The bandwidth (bytes/s) at which loading a block takes as long as recomputing its tokens.
    recompute_bw = block * COST.prefill_tokens_per_s / BT
    runs = {
        enc: replay(
            trace,
            [TierConfig("cpu", 4 * block), TierConfig("disk", None, 0.7 * recompute_bw, encoding=enc)],
            model=TINY,
            cost=COST,
        )
        for enc in ("raw", "fp8")
    }
    raw, fp8 = _tier(runs["raw"], "disk"), _tier(runs["fp8"], "disk")
    assert raw.hit_blocks > 0
    assert raw.skipped_blocks == raw.hit_blocks
    assert raw.loaded_bytes == 0
    assert fp8.hit_blocks > 0
    assert fp8.skipped_blocks == 0
    assert fp8.loaded_bytes > 0


def test_capacity_for_hit_ratio_counts_entries_of_the_encoding() -> None:
    trace = _trace()
    target = 0.6 * replay(trace, [TierConfig("cpu", None)], model=TINY, cost=COST).token_hit_ratio
    found = {}
    for enc in ("raw", "fp8"):
        tiers = [TierConfig("disk", None, encoding=enc)]
        cap, r = capacity_for_hit_ratio(trace, tiers, target, model=TINY, cost=COST)
        assert cap is not None
        assert r.token_hit_ratio >= target
        entry = _tier(r, "disk").entry_bytes
        assert cap % entry == 0
        assert _tier(r, "disk").capacity_blocks == cap // entry
        found[enc] = cap
    assert found["fp8"] < 0.6 * found["raw"]


# ------------------------------------------------------------------------------------ what is refused
@pytest.mark.parametrize(
    ("tier", "kwargs", "message"),
    [
        (
            TierConfig("disk", 1 << 30, encoding="fp8"),
            {"kv_bytes_per_token": 1024},
            "without the model's KV shape",
        ),
        (TierConfig("disk", 1 << 30, encoding="int8"), {"groups": "gemma3-like"}, "with KV-cache groups"),
        (
            TierConfig("disk", 1 << 20, encoding="fp8"),
            {"model": TINY, "kv_bytes_per_token": 1},
            "must be model",
        ),
    ],
)
def test_python_api_refuses_what_it_cannot_size(
    tier: TierConfig, kwargs: dict[str, Any], message: str
) -> None:
    from aiokv.replay import GROUP_PRESETS

    if "groups" in kwargs:
        kwargs = {"groups": GROUP_PRESETS[kwargs["groups"]].kv_groups()}
    with pytest.raises(aiokv.InvalidArgumentError, match=message):
        replay(_trace(5), [TierConfig("cpu", None), tier], cost=COST, **kwargs)


@pytest.mark.parametrize(
    ("name", "encoding", "message"),
    [
        ("cpu", "fp8", "encoding of tier 'cpu' must not be set, got 'fp8'"),
        ("nvme", "raw", "encoding of tier 'nvme' must not be set"),
        ("disk", "fp4", r"encoding of tier 'disk' must be one of \['raw', 'fp8', 'int8'\]"),
    ],
)
def test_tier_config_checks_the_encoding(name: str, encoding: str, message: str) -> None:
    with pytest.raises(aiokv.InvalidArgumentError, match=message):
        TierConfig(name, None, encoding=encoding)


def test_grouped_replay_sizes_raw_units_as_entries() -> None:
    from aiokv.replay import GROUP_PRESETS

    groups = GROUP_PRESETS["gemma3-like"].kv_groups()
    unit = groups.plan(BT).unit_bytes
    r = replay(
        _trace(5),
        [TierConfig("cpu", None), TierConfig("disk", 1 << 30, encoding="raw")],
        groups=groups,
        cost=COST,
    )
    disk = _tier(r, "disk")
    assert disk.payload_bytes == unit < disk.entry_bytes  # the header, then padding to 4 KiB
    assert disk.entry_bytes % 4096 == 0
    assert disk.capacity_blocks == (1 << 30) // disk.entry_bytes


# ------------------------------------------------------------------------------------------ the command
def _run_json(capsys: pytest.CaptureFixture[str], *args: str) -> dict[str, Any]:
    assert main(["replay", *args, "--json", "--no-progress"]) == 0
    out: dict[str, Any] = json.loads(capsys.readouterr().out)
    return out


SYN = "synthetic:sessions=30,turns=4,seed=1"


@pytest.mark.asyncio
async def test_cli_blocks_match_a_disk_tier_of_the_model_preset(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = COST_PRESETS["llama3-8b"]
    out = _run_json(
        capsys,
        SYN,
        "--block-tokens",
        str(BT),
        "--tiers",
        "cpu=64MiB,disk=/var/cache/aiokv:300MiB:encoding=fp8",
    )
    disk = out["runs"][0]["tiers"][1]
    real = DiskTier(tmp_path / "d", 300 << 20, encoding="fp8", preallocate=False)
    await real.open(_spec(_layout(model, joint=True)))
    try:
        assert (disk["capacity_blocks"], disk["entry_bytes"]) == (
            real.stats().num_slots,
            real.stats().entry_bytes,
        )
    finally:
        await real.aclose()


def test_cli_json_fields_and_one_run_per_tiers(capsys: pytest.CaptureFixture[str]) -> None:
    tiers = [f"cpu=32MiB,disk=128MiB:encoding={enc}" for enc in ENCODINGS] + ["cpu=32MiB,disk=128MiB"]
    argv = [SYN, "--block-tokens", str(BT), "--policy", "lru,arc"]
    for t in tiers:
        argv += ["--tiers", t]
    out = _run_json(capsys, *argv)
    assert out["tiers"] == tiers
    runs = out["runs"]
    assert [(r["tiers"][1]["encoding"], r["policy"]) for r in runs] == [
        (enc, pol) for enc in (*ENCODINGS, None) for pol in ("lru", "arc")
    ]
    by = {r["tiers"][1]["encoding"]: r["tiers"][1] for r in runs if r["policy"] == "lru"}
    block = out["block_bytes"]
    assert by[None]["entry_bytes"] == by[None]["payload_bytes"] == block
    assert by["raw"]["payload_bytes"] == block < by["raw"]["entry_bytes"]
    assert by["fp8"]["payload_bytes"] == by["int8"]["payload_bytes"] < block // 2 + 4096
    for t in by.values():
        assert t["capacity_blocks"] == 128 * 2**20 // t["entry_bytes"]
        assert t["hit_ratio"] == pytest.approx(t["hit_blocks"] / runs[0]["block_refs"])
        assert t["loaded_bytes"] == (t["hit_blocks"] - t["skipped_blocks"]) * t["payload_bytes"]
    lru = {r["tiers"][1]["encoding"]: r for r in runs if r["policy"] == "lru"}
    assert lru["fp8"]["block_hit_ratio"] > lru["raw"]["block_hit_ratio"]


def test_cli_sweep_and_target_per_tiers(capsys: pytest.CaptureFixture[str]) -> None:
    argv = [SYN, "--block-tokens", str(BT), "--sweep", "disk=auto", "--target-hit-rate", "20%"]
    argv += ["--tiers", "cpu=8MiB,disk=1GiB:encoding=raw", "--tiers", "cpu=8MiB,disk=1GiB:encoding=fp8"]
    out = _run_json(capsys, *argv)
    caps = [r["tiers"][1]["capacity_bytes"] for r in out["runs"]]
    assert caps[: len(caps) // 2] == caps[len(caps) // 2 :]  # the same capacities for both encodings
    raw, fp8 = out["targets"]
    assert (raw["tiers"], fp8["tiers"]) == (
        "cpu=8MiB,disk=1GiB:encoding=raw",
        "cpu=8MiB,disk=1GiB:encoding=fp8",
    )
    assert fp8["capacity_bytes"] < raw["capacity_bytes"]


def test_cli_table_shows_the_encoded_tiers(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("rich")
    argv = ["replay", SYN, "--block-tokens", str(BT), "--no-progress"]
    assert main([*argv, "--tiers", "cpu=32MiB,disk=128MiB:encoding=fp8"]) == 0
    single = capsys.readouterr().out
    assert "encoding" in single
    assert "bytes/block" in single
    assert "fp8" in single
    assert (
        main(
            [
                *argv,
                "--tiers",
                "cpu=32MiB,disk=128MiB:encoding=raw",
                "--tiers",
                "cpu=32MiB,disk=128MiB:encoding=fp8",
            ]
        )
        == 0
    )
    both = capsys.readouterr().out
    assert "encoded tiers" in both
    assert "disk blocks" in both
    assert "128 MiB:encoding=raw" in both
    assert "128 MiB:encoding=fp8" in both


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--tiers", "cpu=1GiB,disk=8GiB:encoding=fp8", "--kv-bytes-per-token", "4096"],
            "encoding of tier 'disk' must be raw with --kv-bytes-per-token, got 'fp8': an encoded block's size "
            "depends on the model's layers, KV heads, head dim and dtype",
        ),
        (
            ["--tiers", "cpu=1TiB,disk=8TiB:encoding=int8", "--kv-groups", "gemma3-like"],
            "encoding of tier 'disk' must be raw with --kv-groups, got 'int8'",
        ),
        (["--tiers", "cpu=1GiB:encoding=fp8"], "encoding of tier 'cpu' must not be set, got 'fp8'"),
        (["--tiers", "cpu=1GiB,disk=8GiB:encoding=fp9"], "encoding of tier 'disk' must be one of"),
        (
            ["--tiers", "cpu=1GiB,disk=64MiB:encoding=raw"],
            "capacity of tier 'disk' must hold at least one entry of 67112960 bytes",
        ),
        (
            ["--tiers", "cpu=1GiB,disk=:8GiB"],
            "disk tier must look like disk=SIZE or disk=PATH:SIZE, got ':8GiB'",
        ),
        (
            ["--tiers", "cpu=1GiB,disk=8GiB", "--tiers", "cpu=1GiB,disk=8GiB"],
            "tiers must differ when given more than once, got 'cpu=1GiB,disk=8GiB' twice",
        ),
        (
            ["--tiers", "cpu=1GiB", "--tiers", "disk=1GiB"],
            "tiers must start with the same tier when given more than once, got 'cpu' and 'disk'",
        ),
        (
            ["--tiers", "cpu=1GiB,disk=1GiB", "--tiers", "cpu=1GiB", "--sweep", "disk=auto"],
            "sweep tier must be one of the tiers ['cpu'], got 'disk'",
        ),
    ],
)
def test_cli_errors(capsys: pytest.CaptureFixture[str], argv: list[str], message: str) -> None:
    assert main(["replay", "synthetic:sessions=5", "--no-progress", "--json", *argv]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("aiokv replay: error: ")
    assert message in captured.err
    assert len(captured.err.splitlines()) == 1


def test_cli_raw_is_allowed_without_a_shape(capsys: pytest.CaptureFixture[str]) -> None:
    out = _run_json(
        capsys, SYN, "--kv-bytes-per-token", "4096", "--tiers", "cpu=1GiB,redis=2GiB:encoding=raw"
    )
    redis = out["runs"][0]["tiers"][1]
    assert redis["payload_bytes"] == 512 * 4096
    assert redis["entry_bytes"] == 512 * 4096 + 128  # Redis: the header, no padding
