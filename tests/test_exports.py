"""The public surface: ``aiokv.__all__`` is complete and accurate, ``aiokv/__init__.py`` only re-exports, and
the package ships ``py.typed``."""

from __future__ import annotations

import ast
import importlib
import inspect
import re
import sys
import types
from importlib import resources
from pathlib import Path

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
    public = {
        name
        for name, value in vars(aiokv).items()
        if not name.startswith("_") and not isinstance(value, types.ModuleType)
    }
    assert public - set(aiokv.__all__) == set()


def test_init_defines_nothing_itself() -> None:
    """Every exported object lives in a private module (or a subpackage); ``__init__`` only re-exports."""
    for name in aiokv.__all__:
        if name == "__version__":
            continue
        obj = getattr(aiokv, name)
        module = getattr(obj, "__module__", None)
        if module is None:  # constants (bytes): must be the very object of a private module
            assert name == "NONE_ROOT"
            assert obj is importlib.import_module("aiokv._hashing").NONE_ROOT
            continue
        assert module.startswith(ALLOWED_PREFIXES), f"{name} is defined in {module}"
        assert getattr(sys.modules[module], obj.__name__) is obj
    assert aiokv.RequestHandle is aiokv.Request  # a documented alias, not a new class


def test_init_source_is_only_imports_and_metadata() -> None:
    tree = ast.parse((PACKAGE_DIR / "__init__.py").read_text())
    for i, node in enumerate(tree.body):
        if i == 0 and isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            continue  # module docstring
        if isinstance(node, ast.ImportFrom):
            assert node.level == 1, "re-export from the package's own modules only"
            continue
        assert isinstance(node, ast.Assign), (
            f"unexpected statement at line {node.lineno}: {ast.dump(node)[:80]}"
        )
        targets = [t.id for t in node.targets if isinstance(t, ast.Name)]
        assert targets in (["__all__"], ["__version__"]), f"line {node.lineno} defines {targets}"


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
