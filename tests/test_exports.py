"""The public surface: ``aiokv.__all__`` is the everyday names and nothing else, ``aiokv/__init__.py`` only
re-exports, the public modules hold the rest, and the package ships ``py.typed``. (Deprecated names:
tests/test_deprecations.py.)"""

from __future__ import annotations

import ast
import importlib
import inspect
import re
import subprocess
import sys
import types
import warnings
from importlib import resources
from pathlib import Path

import pytest

import aiokv
import aiokv.errors

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


# The top level: what an engine embedding aiokv writes every day (aiokv/__init__.py says why each is there).
EVERYDAY = {
    "Offloader",
    "OffloaderState",
    "OffloaderStats",
    "Request",
    "RequestState",
    "LoadCompletion",
    "KVLayout",
    "KVGroup",
    "GroupKind",
    "GroupedLayout",
    "NO_BLOCK",
    "CPUTier",
    "DiskTier",
    "RedisTier",
    "block_hashes",
    "AiokvError",
    "__version__",
}

# Every exception class: documented in aiokv.errors, importable from the top level too, without a warning.
ERRORS = set(aiokv.errors.__all__)


def test_the_top_level_is_the_everyday_names() -> None:
    assert set(aiokv.__all__) == EVERYDAY
    assert len(aiokv.__all__) <= 17, "a surface a user can hold in mind"


def test_every_public_attribute_is_in_all_or_an_error_class() -> None:
    """The namespace holds ``__all__`` (once used) and the exception classes; ``dir()`` lists those and the
    submodules, never a deprecated name (tests/test_deprecations.py)."""
    public = {
        name
        for name, value in vars(aiokv).items()
        if not name.startswith("_") and not isinstance(value, types.ModuleType)
    }
    listed = {
        n
        for n in aiokv.__dir__()
        if not n.startswith("_") and not isinstance(getattr(aiokv, n), types.ModuleType)
    }
    assert public - set(aiokv.__all__) <= ERRORS
    assert listed == (set(aiokv.__all__) | ERRORS) - {"__version__"}


def test_every_error_class_is_importable_from_the_top_level_without_a_warning() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for name in ERRORS:
            assert getattr(aiokv, name) is getattr(aiokv.errors, name)
            assert issubclass(getattr(aiokv, name), aiokv.AiokvError)
    assert set(aiokv._errors.__all__) == ERRORS
    assert "AiokvError" in aiokv.__all__


def test_init_defines_nothing_itself() -> None:
    """Every exported object lives in a private module (or a subpackage); ``__init__`` only re-exports."""
    for name in aiokv.__all__:
        if name == "__version__":
            continue
        obj = getattr(aiokv, name)
        module = getattr(obj, "__module__", None)
        if module is None:  # constants: must be the very object of a private module
            home = {"NO_BLOCK": "aiokv._groups"}
            assert name in home
            assert obj is getattr(importlib.import_module(home[name]), name)
            continue
        assert module.startswith(ALLOWED_PREFIXES), f"{name} is defined in {module}"
        assert getattr(sys.modules[module], obj.__name__) is obj


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


@pytest.mark.parametrize(
    "package", ["aiokv", "aiokv.tiers", "aiokv.transfer", "aiokv.events", "aiokv.testing", "aiokv.replay"]
)
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


PUBLIC_MODULES = [
    "aiokv",
    "aiokv.errors",
    "aiokv.testing",
    "aiokv.bridge",
    "aiokv.rules",
    "aiokv.tiers",
    "aiokv.transfer",
    "aiokv.store",
    "aiokv.events",
    "aiokv.replay",
    "aiokv.engine",
    "aiokv.serve",
    "aiokv.metrics",
]
"""Every public module and package but aiokv.vllm (which needs vLLM): also what tests/test_deprecations.py
imports in a fresh interpreter."""


@pytest.mark.parametrize("module", PUBLIC_MODULES)
def test_each_public_module_lists_what_it_exports(module: str) -> None:
    mod = importlib.import_module(module)
    assert len(set(mod.__all__)) == len(mod.__all__), "duplicates in __all__"
    assert [n for n in mod.__all__ if not hasattr(mod, n)] == []
    assert inspect.getdoc(mod), f"{module} has no module documentation"


def test_the_testing_helpers_are_the_package_objects() -> None:
    import aiokv.testing
    import aiokv.tiers
    import aiokv.transfer

    assert aiokv.testing.FaultyTier is aiokv.tiers.FaultyTier
    assert aiokv.testing.FaultyTierStats is aiokv.tiers.FaultyTierStats
    assert aiokv.testing.SimulatedDevice is aiokv.transfer.SimulatedDevice
    assert issubclass(aiokv.testing.MemoryTier, aiokv.tiers.BackingTier)


def test_importing_aiokv_and_its_command_line_does_not_import_torch() -> None:
    code = (
        "import sys, aiokv, aiokv.cli, aiokv.replay, aiokv.errors, aiokv.testing, aiokv.rules, aiokv.bridge; "
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
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
