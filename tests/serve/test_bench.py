"""benchmarks/bench_serve.py runs (tiny settings) and writes its results and plot."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_bench_serve_quick_writes_results(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = ROOT / "benchmarks" / "bench_serve.py"
    spec = importlib.util.spec_from_file_location("bench_serve", path)
    assert spec is not None
    assert spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "bench_serve", bench)
    spec.loader.exec_module(bench)
    monkeypatch.setattr(bench.common, "RESULTS", tmp_path)
    assert bench.main(["--quick", "--sessions", "2", "--system-bytes", "256", "--num-blocks", "64"]) == 0
    result = json.loads((tmp_path / "serve.json").read_text())
    assert result["outputs_matched"]
    assert result["offload"]["hit_rate"] > 0
    assert result["recompute"]["hit_rate"] == 0
    assert result["offload"]["requests"] == result["recompute"]["requests"] == 4
    # The server's TTFT breakdown: no lookup/load without offloading; parts that add up to a positive TTFT.
    rec, off = result["recompute"]["server_ttft_breakdown"], result["offload"]["server_ttft_breakdown"]
    assert rec["admission_mean_s"] == 0.0
    assert off["admission_mean_s"] > 0.0
    for b in (rec, off):
        assert min(b.values()) >= 0.0
        assert b["queue_mean_s"] + b["admission_mean_s"] + b["prefill_mean_s"] > 0.0
    assert (tmp_path / "serve.png").stat().st_size > 0
