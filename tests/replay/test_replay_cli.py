"""``aiokv replay`` end to end through ``aiokv.cli.main``."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from aiokv.cli import main

DATA = Path(__file__).resolve().parent.parent / "data"
CONV = str(DATA / "mooncake_conversation_head400.jsonl")
SYNTH = str(DATA / "mooncake_synthetic_tail400.jsonl")


def run_json(capsys: pytest.CaptureFixture[str], *args: str) -> dict[str, Any]:
    assert main(["replay", *args, "--json", "--no-progress"]) == 0
    out: dict[str, Any] = json.loads(capsys.readouterr().out)
    return out


def test_json_output_has_one_run_per_policy(capsys: pytest.CaptureFixture[str]) -> None:
    out = run_json(capsys, SYNTH, "--tiers", "cpu=64GiB,disk=1TiB", "--policy", "lru,arc,chain-lru")
    assert [r["policy"] for r in out["runs"]] == ["lru", "arc", "chain-lru"]
    assert out["kv_bytes_per_token"] == 131072  # llama3-8b by default
    assert out["block_bytes"] == 512 * 131072
    assert out["trace"]["requests"] == 400
    run = out["runs"][0]
    assert [t["name"] for t in run["tiers"]] == ["cpu", "disk"]
    assert run["tiers"][0]["slots"] == 64 * 2**30 // (512 * 131072)
    assert 0 < run["block_hit_ratio"] <= out["trace"]["max_prefix_reuse_ratio"]
    assert "hit_tokens / prefill_tokens_per_s" in out["ttft_formula"]


def test_sweep_auto_spans_the_footprint(capsys: pytest.CaptureFixture[str]) -> None:
    out = run_json(capsys, CONV, "--sweep", "cpu=auto", "--policy", "lru,chain-lru", "--model", "qwen2-7b")
    runs = out["runs"]
    assert len(runs) == 18
    caps = [r["tiers"][0]["capacity_bytes"] for r in runs[:9]]
    assert caps == sorted(caps)
    assert runs[8]["block_hit_ratio"] == pytest.approx(out["trace"]["max_prefix_reuse_ratio"])
    assert out["kv_bytes_per_token"] == 28 * 4 * 128 * 4


def test_explicit_sweep_and_overrides(capsys: pytest.CaptureFixture[str]) -> None:
    out = run_json(
        capsys,
        CONV,
        "--tiers",
        "cpu=1GiB,redis=inf",
        "--sweep",
        "cpu=1MiB,4MiB",
        "--kv-bytes-per-token",
        "1024",
        "--prefill-tokens-per-s",
        "5000",
        "--bandwidth",
        "redis=1GB/s",
        "--inflight",
        "2",
        "--limit",
        "100",
    )
    assert [r["tiers"][0]["capacity_bytes"] for r in out["runs"]] == [2**20, 4 * 2**20]
    assert out["runs"][0]["tiers"][1]["bandwidth"] == 1e9
    assert out["prefill_tokens_per_s"] == 5000
    assert out["inflight"] == 2
    assert out["trace"]["requests"] == 100
    assert out["model"] is None


def test_synthetic_trace_spec(capsys: pytest.CaptureFixture[str]) -> None:
    out = run_json(capsys, "synthetic:sessions=20,turns=3,seed=5", "--tiers", "cpu=inf")
    assert out["trace"]["requests"] == 60
    assert out["runs"][0]["block_hit_ratio"] == pytest.approx(out["trace"]["max_prefix_reuse_ratio"])


def test_table_output(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("rich")
    assert main(["replay", SYNTH, "--policy", "lru,arc", "--no-progress"]) == 0
    out = capsys.readouterr().out
    for text in ("block hits", "token hits", "TTFT saved", "lru", "arc", "max prefix reuse", "block refs/s"):
        assert text in out


def test_single_run_shows_the_tier_table(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("rich")
    assert main(["replay", SYNTH, "--tiers", "cpu=100GiB,disk=2TiB", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "per tier" in out
    assert "staged" in out


def test_progress_bar_runs(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("rich")
    assert main(["replay", SYNTH, "--limit", "50"]) == 0


def test_plot_writes_a_png(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    png = tmp_path / "hit.png"
    run_json(capsys, CONV, "--sweep", "cpu=auto", "--policy", "lru,arc", "--plot", str(png))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_without_matplotlib_is_a_clear_error(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert main(["replay", CONV, "--plot", str(tmp_path / "x.png"), "--json", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "--plot needs matplotlib; install it with: pip install 'aiokv[plot]'" in err
    assert not (tmp_path / "x.png").exists()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--tiers", "cpu"], "tiers must look like name=value"),
        (["--tiers", "cpu=lots"], "capacity of tier 'cpu' must be a number of bytes"),
        (["--tiers", "nvme=1TiB"], "bandwidth of tier 'nvme' is unknown"),
        (["--policy", "mru"], "policy must be one of"),
        (["--sweep", "disk=auto"], "sweep tier must be one of the tiers ['cpu'], got 'disk'"),
        (["--bandwidth", "disk=1GB/s"], "bandwidth names tiers that are not in --tiers: ['disk']"),
        (["--tiers", "cpu=1KiB"], "capacity of tier 'cpu' must hold at least one block"),
        (["--limit", "0"], "limit must be >= 1, got 0"),
    ],
)
def test_bad_arguments_exit_2_with_a_message(
    capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    assert main(["replay", CONV, *args, "--json", "--no-progress"]) == 2
    assert message in capsys.readouterr().err


def test_bad_synthetic_option(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["replay", "synthetic:sesions=3", "--json", "--no-progress"]) == 2
    assert "synthetic trace option must be one of" in capsys.readouterr().err


def test_missing_trace_file(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert main(["replay", str(tmp_path / "none.jsonl"), "--json"]) == 2
    assert "trace must be a readable file" in capsys.readouterr().err


def test_help_lists_the_replay_subcommand(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    assert "replay" in capsys.readouterr().out


def test_load_policy_decide_recomputes_what_a_slow_tier_would_load(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """llama3-8b prefills ~24.7k tokens/s, 128 KiB of KV a token: a 1 GB/s tier loads slower than that."""
    args = (CONV, "--tiers", "cpu=4GiB,disk=1TiB", "--bandwidth", "disk=1GB/s")
    decide = run_json(capsys, *args)
    always = run_json(capsys, *args, "--load-policy", "always")
    assert (decide["load_policy"], always["load_policy"]) == ("decide", "always")
    d, a = decide["runs"][0], always["runs"][0]
    assert d["hit_blocks"] == a["hit_blocks"]
    assert d["tiers"][1]["skipped_blocks"] == d["tiers"][1]["hit_blocks"] > 0
    assert a["tiers"][1]["skipped_blocks"] == 0
    assert d["ttft_saved_s"] > a["ttft_saved_s"]
