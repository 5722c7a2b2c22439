"""The public surface: ``aiokv.__all__`` is complete and accurate, ``aiokv/__init__.py`` only re-exports, and
the package ships ``py.typed``."""

from __future__ import annotations

import ast
import importlib
import inspect
import re
import subprocess
import sys
import types
from importlib import resources
from pathlib import Path

import pytest

import aiokv

PACKAGE_DIR = Path(aiokv.__file__).resolve().parent
REPO = PACKAGE_DIR.parent
ALLOWED_PREFIXES = ("aiokv._", "aiokv.tiers", "aiokv.transfer")


def test_every_name_in_all_exists() -> None:
    missing = [name for name in aiokv.__all__ if not hasattr(aiokv, name)]
    assert missing == []
    assert len(set(aiokv.__all__)) == len(aiokv.__all__), "duplicates in __all__"


def test_all_is_sorted_for_review() -> None:
    # ruff's RUF022 order: SCREAMING_CASE constants, then CamelCase classes, then the rest.
    assert aiokv.__all__ == sorted(aiokv.__all__, key=lambda n: (not n.isupper(), not n[:1].isupper(), n))


def test_every_public_attribute_is_in_all() -> None:
    """Public attributes are the exports, plus the names kept importable from 0.1.0 (cached once used)."""
    public = {
        name
        for name, value in vars(aiokv).items()
        if not name.startswith("_") and not isinstance(value, types.ModuleType)
    }
    lazy = {
        n
        for n in aiokv.__dir__()
        if not n.startswith("_") and not isinstance(getattr(aiokv, n), types.ModuleType)
    }
    assert public - set(aiokv.__all__) <= LEGACY_NAMES
    assert lazy - set(aiokv.__all__) == LEGACY_NAMES


LEGACY_NAMES = {
    "NONE_ROOT",
    "make_root",
    "BackingTier",
    "TierSpec",
    "CPUTierStats",
    "DiskTierStats",
    "RedisTierStats",
    "FaultyTierStats",
    "BlockIndex",
    "EntryState",
    "ARCPolicy",
    "ChainLRUPolicy",
    "EvictionPolicy",
    "LRUPolicy",
    "make_policy",
    "policy_names",
    "register_policy",
    "ExecutorStats",
    "TransferExecutor",
}


def test_init_defines_nothing_itself() -> None:
    """Every exported object lives in a private module (or a subpackage); ``__init__`` only re-exports."""
    for name in aiokv.__all__:
        if name == "__version__":
            continue
        obj = getattr(aiokv, name)
        module = getattr(obj, "__module__", None)
        if module is None:  # constants: must be the very object of a private module
            home = {"NONE_ROOT": "aiokv._hashing", "NO_BLOCK": "aiokv._groups"}
            assert name in home
            assert obj is getattr(importlib.import_module(home[name]), name)
            continue
        assert module.startswith(ALLOWED_PREFIXES), f"{name} is defined in {module}"
        assert getattr(sys.modules[module], obj.__name__) is obj
    assert aiokv.RequestHandle is aiokv.Request  # a documented alias, not a new class


def test_init_source_is_only_imports_and_metadata() -> None:
    """Docstring, imports from the package itself, type-checking imports, the lazy map, ``__all__``."""
    tree = ast.parse((PACKAGE_DIR / "__init__.py").read_text())
    for i, node in enumerate(tree.body):
        if i == 0 and isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            continue  # module docstring
        if isinstance(node, ast.Import):
            assert [a.name for a in node.names] == ["typing"]
            continue
        if isinstance(node, ast.ImportFrom):
            assert node.level == 1, "re-export from the package's own modules only"
            continue
        if isinstance(node, ast.If):  # if typing.TYPE_CHECKING: relative imports only
            assert ast.unparse(node.test) == "typing.TYPE_CHECKING"
            assert all(isinstance(n, ast.ImportFrom) and n.level == 1 for n in node.body)
            continue
        assert isinstance(node, ast.Assign), (
            f"unexpected statement at line {node.lineno}: {ast.dump(node)[:80]}"
        )
        targets = [ast.unparse(t) for t in node.targets]
        assert targets in (["__all__"], ["(__getattr__, __dir__)"]), f"line {node.lineno} defines {targets}"


@pytest.mark.parametrize("package", ["aiokv", "aiokv.tiers", "aiokv.transfer", "aiokv.events"])
def test_every_lazy_name_imports_from_its_module(package: str) -> None:
    pkg = importlib.import_module(package)
    for name in pkg.__dir__():
        if name.startswith("_") or isinstance(getattr(pkg, name), types.ModuleType):
            continue
        assert getattr(pkg, name) is not None
    for name in pkg.__all__:
        assert name in pkg.__dir__()


def test_the_events_package_exports_the_log_the_stream_and_the_publisher() -> None:
    import aiokv.events

    assert aiokv.events.__all__ == sorted(aiokv.events.__all__, key=lambda n: (not n[:1].isupper(), n))
    assert {"KVEventLog", "KVEventStream", "KVSnapshot", "TierEvents", "ZmqEventPublisher"} <= set(
        aiokv.events.__all__
    )
    assert aiokv.events.TierEvents.__module__ == "aiokv.events._emit"


def test_names_moved_below_the_top_level_stay_importable_from_it() -> None:
    """0.1.0 documented these at the top level; they now live in aiokv.tiers / aiokv.transfer."""
    from aiokv import BlockIndex, ExecutorStats, TransferExecutor, make_root, policy_names
    from aiokv.tiers import BlockIndex as TierBlockIndex
    from aiokv.transfer import TransferExecutor as Executor

    assert BlockIndex is TierBlockIndex
    assert TransferExecutor is Executor
    assert callable(make_root)
    assert callable(policy_names)
    assert ExecutorStats is not None


def test_the_top_level_is_what_an_embedding_engine_needs() -> None:
    internals = {
        "BlockIndex",
        "EntryState",
        "TransferExecutor",
        "make_root",
        "register_policy",
        "CPUTierStats",
    }
    assert internals.isdisjoint(aiokv.__all__)


def test_importing_aiokv_and_its_command_line_does_not_import_torch() -> None:
    code = "import sys, aiokv, aiokv.cli, aiokv.replay; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


PYPROJECT = (REPO / "pyproject.toml").read_text()  # read with re: tomllib is 3.11+, the package supports 3.10


def test_version_matches_pyproject() -> None:
    match = re.search(r'^version = "([^"]+)"', PYPROJECT, re.MULTILINE)
    assert match is not None
    assert aiokv.__version__ == match.group(1)


def test_exported_classes_and_functions_are_documented() -> None:
    undocumented = [
        name
        for name in aiokv.__all__
        if (inspect.isclass(getattr(aiokv, name)) or inspect.isfunction(getattr(aiokv, name)))
        and not inspect.getdoc(getattr(aiokv, name))
    ]
    assert undocumented == []


def test_py_typed_ships() -> None:
    marker = resources.files("aiokv") / "py.typed"
    assert marker.is_file()
    package_data = re.search(
        r"^\[tool\.setuptools\.package-data\]\n(.*?)(?:\n\[|\Z)", PYPROJECT, re.MULTILINE | re.DOTALL
    )
    assert package_data is not None
    assert re.search(r'^aiokv = \[.*"py\.typed".*\]', package_data.group(1), re.MULTILINE)


def _imported_modules(path: Path) -> set[str]:
    """Every module a source file imports, at run time or for type checking (relative names resolved)."""
    tree = ast.parse(path.read_text())
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = "aiokv" if node.level == 1 else ""
            found.add(f"{base}.{node.module}" if base and node.module else (node.module or ""))
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return found


def test_request_depends_on_a_narrow_interface_not_on_the_offloader() -> None:
    """``_offloader`` creates requests; ``_request`` sees its owner only through ``_host.RequestHost``, so the two
    modules form no import cycle (not even one hidden behind ``TYPE_CHECKING``)."""
    request_imports = _imported_modules(REPO / "aiokv" / "_request.py")
    assert "aiokv._host" in request_imports
    assert "aiokv._offloader" not in request_imports
    assert "aiokv._request" in _imported_modules(REPO / "aiokv" / "_offloader.py")
