"""``aiokv.engine``'s public surface: ``__all__`` is accurate and ``__init__.py`` only re-exports."""

from __future__ import annotations

import ast
import inspect
import types

import aiokv.engine


def test_all_names_exist_and_nothing_public_is_left_out() -> None:
    assert [n for n in aiokv.engine.__all__ if not hasattr(aiokv.engine, n)] == []
    public = {
        name
        for name, value in vars(aiokv.engine).items()
        if not name.startswith("_") and not isinstance(value, types.ModuleType)
    }
    assert public == set(aiokv.engine.__all__)


def test_init_only_reexports() -> None:
    tree = ast.parse(inspect.getsource(aiokv.engine))
    kinds = {type(node).__name__ for node in tree.body}
    assert kinds <= {"Expr", "ImportFrom", "Assign"}
