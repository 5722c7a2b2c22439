"""The README's example runs as written, examples run, and the generated reference is current."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _run(args: list[str], timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def test_readme_example_runs_as_written(tmp_path: Path) -> None:
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert blocks, "README has no python example"
    script = tmp_path / "readme_example.py"
    script.write_text(blocks[0])
    assert len(blocks[0].splitlines()) <= 25
    proc = _run([str(script)])
    assert proc.returncode == 0, proc.stderr
    assert "restored 32 tokens" in proc.stdout


def test_quickstart_example_runs() -> None:
    proc = _run(["examples/quickstart.py"])
    assert proc.returncode == 0, proc.stderr


def test_kv_events_example_runs() -> None:
    proc = _run(["examples/kv_events.py"])
    assert proc.returncode == 0, proc.stderr
    assert "closed: the router sees {'cpu': 0}" in proc.stdout


def test_reference_is_generated_from_current_docstrings() -> None:
    proc = _run(["tools/gen_reference.py", "--check"])
    assert proc.returncode == 0, proc.stderr
