"""The demo and the benchmark are runnable files: run them with tiny settings."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _load(relpath: str) -> ModuleType:
    path = ROOT / relpath
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("loop", ["--no-uvloop", None])
def test_chat_demo_runs_and_outputs_match(loop: str | None, capsys: pytest.CaptureFixture[str]) -> None:
    demo = _load("examples/chat_demo.py")
    argv = ["--model", "tiny", "--sessions", "3", "--turns", "2", "--system-tokens", "40"]
    argv += ["--user-tokens", "20", "--max-tokens", "6", "--num-blocks", "16"]
    assert demo.main([*argv, loop] if loop else argv) == 0
    out = capsys.readouterr().out
    assert "outputs matched" in out
    assert "TTFT p95" in out


def test_bench_ttft_writes_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    bench = _load("benchmarks/bench_ttft.py")
    monkeypatch.setattr(bench.common, "RESULTS", tmp_path / "results")
    out = tmp_path / "ttft.json"
    assert bench.main(["--lengths", "200", "--repeat", "1", "--no-baseline", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    (row,) = report["rows"]
    assert row["prompt_tokens"] == 200
    assert row["restored_tokens"] == 192
    assert row["speedup"] > 0
    assert "speedup" in capsys.readouterr().out
    assert json.loads((tmp_path / "results" / "ttft.json").read_text())["rows"] == report["rows"]
