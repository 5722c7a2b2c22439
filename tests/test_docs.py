"""The README's example runs as written, examples run, the user guide's snippets run or say they are fragments,
and the generated reference is current."""

from __future__ import annotations

import ast
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


def _guide_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", (ROOT / "docs" / "guide.md").read_text(), flags=re.S)


def test_guide_ends_with_the_embed_engine_example() -> None:
    blocks = _guide_blocks()
    assert blocks, "docs/guide.md has no python snippet"
    assert blocks[-1] == (ROOT / "examples" / "embed_engine.py").read_text()


def test_embed_engine_example_prints_what_the_guide_shows() -> None:
    text = (ROOT / "docs" / "guide.md").read_text()
    shown = re.search(r"```python\n.*```\n\nIt prints:\n\n```text\n(.*?)```", text, flags=re.S)
    assert shown is not None, "docs/guide.md shows no output after its complete example"
    proc = _run(["examples/embed_engine.py"])
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == shown.group(1)


def test_guide_snippets_run_or_are_marked_fragments(tmp_path: Path) -> None:
    """A snippet that uses names of the surrounding engine says so on its first line (``# Fragment``) and must
    still compile; every other snippet runs as written (the last one is the example the tests above run)."""
    blocks = _guide_blocks()
    for i, block in enumerate(blocks[:-1]):
        if block.startswith("# Fragment"):
            compile(block, f"guide.md snippet {i}", "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
            continue
        script = tmp_path / f"guide_snippet_{i}.py"
        script.write_text(block)
        proc = _run([str(script)])
        assert proc.returncode == 0, f"guide.md snippet {i} (not marked # Fragment) fails:\n{proc.stderr}"


def test_reference_is_generated_from_current_docstrings() -> None:
    proc = _run(["tools/gen_reference.py", "--check"])
    assert proc.returncode == 0, proc.stderr
