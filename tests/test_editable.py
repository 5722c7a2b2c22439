"""The development install (the Makefile's ``pip install -e``) is visible outside the repository: to Python,
C extensions included, and to a type checker run on a user's own code (setuptools' default editable mode, an
import hook, is invisible to mypy)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# Type-checking torch and numpy would take a minute from a cold cache and proves nothing about aiokv's install;
# aiokv's own type errors are `make lint`'s business (its types are still read: the revealed type shows them).
MYPY_INI = """\
[mypy]
strict = True
[mypy-torch.*,numpy.*,starlette.*,anyio.*,zmq.*,httpx.*]
follow_imports = skip
[mypy-aiokv.*]
follow_imports = silent
"""


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "MYPYPATH")}


def _outside(tmp_path: Path, code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=60
    )


@pytest.fixture
def installed_here(tmp_path: Path) -> None:
    """Skip unless this interpreter imports aiokv, from outside the repository, from this checkout."""
    proc = _outside(tmp_path, "import aiokv; print(aiokv.__file__)")
    if proc.returncode != 0:
        pytest.skip("aiokv is not installed in this interpreter (run the suite through make test)")
    if Path(proc.stdout.strip()).resolve() != ROOT / "aiokv" / "__init__.py":
        pytest.skip(
            f"aiokv is installed from elsewhere ({proc.stdout.strip()}), not editable from this checkout"
        )


@pytest.mark.usefixtures("installed_here")
def test_native_extensions_built_in_place_import_from_outside(tmp_path: Path) -> None:
    built = sorted(p.name.split(".")[0] for p in (ROOT / "aiokv" / "_native").glob("*.so"))
    if not built:
        pytest.skip("no C extension was built (no compiler): aiokv runs its Python fallbacks")
    code = "import importlib; " + "; ".join(f"importlib.import_module('aiokv._native.{m}')" for m in built)
    proc = _outside(tmp_path, code)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.usefixtures("installed_here")
def test_mypy_finds_the_editable_install_from_outside_the_repository(tmp_path: Path) -> None:
    if importlib.util.find_spec("mypy") is None:
        pytest.skip("mypy is not installed (the dev extra)")
    (tmp_path / "user.py").write_text("import aiokv\n\nreveal_type(aiokv.Offloader)\n")
    (tmp_path / "mypy.ini").write_text(MYPY_INI)
    proc = subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", "mypy.ini", "--cache-dir", "cache", "user.py"],
        cwd=tmp_path,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=110,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert 'Revealed type is "def (layout: aiokv._layout.KVLayout' in proc.stdout, proc.stdout
