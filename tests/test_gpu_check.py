"""tools/gpu_check.py runs its checks on the simulated device in CI, so the GPU session's script cannot rot."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_check_passes_on_the_simulated_device(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "tools/gpu_check.py", "--device", "sim", "--quick"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={"OUT": str(tmp_path), "PATH": "/usr/bin:/bin"},
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["failed"] == []
    for name in ("step-before-sync", "loop-lag", "waiters-sleep", "staging-bound", "many-requests"):
        assert report[name]["ok"], name
