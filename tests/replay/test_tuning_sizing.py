"""tools/tuning_sizing.py (the sweeps of docs/tuning.md) runs on the trace slice and its helpers are right."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))

import pytest  # noqa: E402
import tuning_sizing  # noqa: E402

from aiokv.replay import Trace, TraceRequest  # noqa: E402


def _trace(rows: list[tuple[float, list[int]]]) -> Trace:
    reqs = [TraceRequest(ts, tuple(k.to_bytes(8, "big") for k in keys), 512 * len(keys)) for ts, keys in rows]
    return Trace.from_requests("t", 512, reqs)


def test_knee_is_the_smallest_capacity_reaching_the_target() -> None:
    assert tuning_sizing.knee([1, 2, 4], [0.1, 0.5, 0.6], 0.5) == 2
    assert tuning_sizing.knee([1, 2, 4], [0.1, 0.2, 0.3], 0.5) is None


def test_ttl_hit_ratio_counts_prefix_hits_within_the_ttl() -> None:
    # at 30 s block 1 is 30 s old: a hit under both TTLs; at 150 s block 1 is 120 s old and block 2 150 s:
    # both expired under 60 s (nothing after the first miss counts), both hits under 300 s
    t = _trace([(0, [1, 2]), (30_000, [1]), (150_000, [1, 2])])
    assert tuning_sizing.ttl_hit_ratios(t, [60, 300]) == [1 / 5, 3 / 5]


def test_write_rate_counts_first_seen_blocks() -> None:
    t = _trace([(0, [1, 2]), (1000, [1, 3]), (6000, [4])])
    mean, _, _, peak = tuning_sizing.write_rate(t, block_bytes=5)
    assert peak == 3 * 5 / 5  # 3 new blocks in the first 5 s window
    assert mean == 4 * 5 / 10  # 4 new blocks over 2 windows of 5 s


def test_script_runs_on_the_trace_slice(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    out = tmp_path / "sizing.png"
    proc = subprocess.run(
        [sys.executable, "tools/tuning_sizing.py", "tests/data/mooncake_conversation_head400.jsonl", "--points", "3",
         "--plot", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "maximum prefix reuse 13.46%" in proc.stdout
    assert out.stat().st_size > 0
