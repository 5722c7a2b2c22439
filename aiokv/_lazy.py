"""Lazy re-exports (PEP 562), so that ``import aiokv`` and the command line do not import torch, and deprecated
names that keep working while they warn.

A package's ``__init__`` maps each public name to the private module defining it; the module is imported
the first time the name is used and the value is cached in the package namespace. Type checkers see the
names through the package's ``if TYPE_CHECKING:`` imports.

A *deprecated* name (:class:`Moved`) is an old name whose object now has another public place: every access
(``pkg.Old``, ``from pkg import Old``, ``getattr``, ``hasattr``) returns the very object of the new place and
emits a :class:`DeprecationWarning` naming that place and the release that removes the old name, attributed to
the line that used it. Deprecated names are never cached in the package namespace (the second access must warn
too), are not in ``__all__`` (``from pkg import *`` does not import them) and are left out of ``dir()``
(completion and ``inspect.getmembers`` should offer the names to use, and must not warn for looking).
"""

from __future__ import annotations

import importlib
import sys
import warnings
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

__all__ = ["Moved", "attach", "deprecation_message"]


class Moved(NamedTuple):
    """Where a deprecated name went: ``module`` (relative to the package, e.g. ``".tiers._index"``) defines the
    object under the last part of ``new``, the public place to use instead (``"aiokv.tiers.BlockIndex"``);
    ``removed_in`` is the release that drops the old name."""

    module: str
    new: str
    removed_in: str


def deprecation_message(old: str, new: str, removed_in: str) -> str:
    """``"aiokv.BlockIndex is deprecated and will be removed in aiokv 0.3.0: import it from aiokv.tiers
    (aiokv.tiers.BlockIndex)"``; a renamed object says ``use aiokv.Request instead``."""
    head = f"{old} is deprecated and will be removed in aiokv {removed_in}: "
    new_module, _, new_name = new.rpartition(".")
    if new_name == old.rpartition(".")[2]:
        return head + f"import it from {new_module} ({new})"
    return head + f"use {new} instead (the same object)"


def _probed_by_import() -> bool:
    """Whether the caller of ``__getattr__`` is the import system's ``hasattr`` probe of a ``from pkg import
    name`` (``importlib._bootstrap._handle_fromlist``), which the statement's own attribute access follows: that
    access warns, so the probe does not (one statement, one warning)."""
    try:
        frame = sys._getframe(2)
    except ValueError:  # pragma: no cover - no such frame
        return False
    return (
        frame.f_code.co_name == "_handle_fromlist"
        and frame.f_globals.get("__name__") == "importlib._bootstrap"
    )


def attach(
    package: str, names: Mapping[str, str], deprecated: Mapping[str, Moved] | None = None
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for ``package`` (a package, or a plain module such as ``aiokv.testing``),
    where ``names`` maps an attribute to its module, relative as in ``package``'s own imports (``"._layout"``),
    and ``deprecated`` maps an old attribute to where it went."""
    moved = dict(deprecated or {})
    both = set(names) & set(moved)
    if both:
        raise ValueError(f"{package}: names both current and deprecated: {sorted(both)}")

    def _import(module: str) -> Any:
        anchor = getattr(sys.modules[package], "__package__", None) or package  # a module's is its parent's
        return importlib.import_module(module, anchor)

    def __getattr__(name: str) -> Any:
        module = names.get(name)
        if module is not None:
            value = getattr(_import(module), name)
            setattr(sys.modules[package], name, value)
            return value
        entry = moved.get(name)
        if entry is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(_import(entry.module), entry.new.rpartition(".")[2])
        if not _probed_by_import():
            warnings.warn(
                deprecation_message(f"{package}.{name}", entry.new, entry.removed_in),
                DeprecationWarning,
                stacklevel=2,
            )
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(names))

    return __getattr__, __dir__
