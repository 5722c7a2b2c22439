"""Import contracts of the package (docs/architecture.md, "Layers"), checked on the source (AST), no import.

1. **No lower layer imports a higher one.** The layers, lowest first, are :data:`LAYERS`; a module may import
   its own layer and those below (cycles inside a layer are allowed; the architecture page names the one left).
   Imports under ``if TYPE_CHECKING:`` count too: a type that names a higher layer is a design smell as well.
2. **``torch.cuda`` only in the CUDA binding** (``aiokv/transfer/_cuda.py``).
3. **Applications use public names only**: ``engine``, ``serve``, ``replay``, ``vllm``, ``metrics`` and the
   command line import aiokv through the top level, public modules and packages (``aiokv.tiers``,
   ``aiokv.store``, ``aiokv.rules``, ``aiokv.bridge``, ...), their own package's modules and the plumbing every
   module shares (:data:`PLUMBING`); never another package's private module or a private name. The command
   line, the front end of ``replay`` and ``serve``, may use their modules (not the core's).

Each rule is checked against a planted violation too, so a scanner that sees nothing cannot pass.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "aiokv"

# Lowest first. A name matches a module when it is the module or a package above it.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    (
        "plumbing",
        ("aiokv._version", "aiokv._errors", "aiokv._log", "aiokv._lazy", "aiokv._units", "aiokv._native"),
    ),
    (
        "rules",
        (
            "aiokv._hashing",
            "aiokv._grouprule",
            "aiokv._groups",
            "aiokv._layout",
            "aiokv._planner",
            "aiokv._stats",
            "aiokv.rules",
        ),
    ),
    ("transfer and events", ("aiokv.transfer", "aiokv.events")),
    ("tiers", ("aiokv.tiers",)),
    ("store", ("aiokv.store",)),
    (
        "offloader",
        (
            "aiokv._host",
            "aiokv._request",
            "aiokv._staging",
            "aiokv._writethrough",
            "aiokv._config",
            "aiokv._offloader",
            "aiokv._bridge",
            "aiokv.bridge",
            "aiokv._cuda",
        ),
    ),
    ("top level", ("aiokv",)),
    (
        "applications",
        ("aiokv.engine", "aiokv.replay", "aiokv.metrics", "aiokv.serve", "aiokv.vllm", "aiokv.testing"),
    ),
    ("command line", ("aiokv.cli", "aiokv.__main__")),
]

APPLICATIONS = ("aiokv.engine", "aiokv.replay", "aiokv.metrics", "aiokv.serve", "aiokv.vllm", "aiokv.cli")
# aiokv._native: the optional C helpers, each the twin of a Python definition (aiokv.replay runs its replay
# loop in aiokv._native._replay); a leaf of the lowest layer like the rest of the plumbing.
PLUMBING = ("aiokv._errors", "aiokv._log", "aiokv._lazy", "aiokv._native", "aiokv._units", "aiokv._version")
CUDA_MODULE = "aiokv.transfer._cuda"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _sources() -> dict[str, tuple[Path, ast.Module]]:
    out = {}
    for path in sorted(ROOT.rglob("*.py")):
        out[_module_name(path)] = (path, ast.parse(path.read_text(), str(path)))
    return out


SOURCES = _sources()
MODULES = set(SOURCES)


def _package(module: str) -> str:
    path = SOURCES[module][0] if module in SOURCES else None
    return module if path is not None and path.name == "__init__.py" else module.rpartition(".")[0]


def imports(module: str, tree: ast.Module) -> list[tuple[int, str, str | None]]:
    """``(line, imported module, imported name or None)`` for every aiokv import in ``tree``."""
    out: list[tuple[int, str, str | None]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name, None) for a in node.names if a.name.split(".")[0] == "aiokv"]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = _package(module).split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "aiokv":
                continue
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                if sub in MODULES:  # `from . import _lazy` imports a module
                    out.append((node.lineno, sub, None))
                else:
                    out.append((node.lineno, target, alias.name))
    return out


def layer_of(module: str) -> int:
    best, depth = -1, -1
    for i, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and p.count(".") > depth:
                best, depth = i, p.count(".")
    if best < 0:
        raise AssertionError(f"{module} is in no layer: add it to LAYERS in tests/test_layers.py")
    return best


def layer_violations(sources: dict[str, tuple[Path, ast.Module]]) -> list[str]:
    bad = []
    for module, (_, tree) in sources.items():
        mine = layer_of(module)
        for line, target, _name in imports(module, tree):
            theirs = layer_of(target)
            if theirs > mine:
                bad.append(
                    f"{module}:{line} imports {target} ({LAYERS[theirs][0]}) from below ({LAYERS[mine][0]})"
                )
    return bad


def cuda_violations(sources: dict[str, tuple[Path, ast.Module]]) -> list[str]:
    bad = []
    for module, (_, tree) in sources.items():
        if module == CUDA_MODULE:
            continue
        for node in ast.walk(tree):
            uses = (
                isinstance(node, ast.Attribute)
                and node.attr == "cuda"
                and isinstance(node.value, ast.Name)
                and node.value.id == "torch"
            )
            uses = uses or (
                isinstance(node, ast.Import) and any(a.name.startswith("torch.cuda") for a in node.names)
            )
            uses = uses or (
                isinstance(node, ast.ImportFrom)
                and not node.level
                and (
                    (node.module or "").startswith("torch.cuda")
                    or (node.module == "torch" and any(a.name == "cuda" for a in node.names))
                )
            )
            if uses:
                bad.append(f"{module}:{node.lineno} uses torch.cuda")
    return bad


def _is_private(dotted: str) -> bool:
    return any(part.startswith("_") and part != "__main__" for part in dotted.split(".")[1:])


def public_name_violations(sources: dict[str, tuple[Path, ast.Module]]) -> list[str]:
    bad = []
    for module, (_, tree) in sources.items():
        app = next((a for a in APPLICATIONS if module == a or module.startswith(a + ".")), None)
        if app is None:
            continue
        for line, target, name in imports(module, tree):
            own = target == app or target.startswith(app + ".")
            if (
                app == "aiokv.cli"
            ):  # the front end of replay and serve: it may use their modules, not the core's
                own = any(target == a or target.startswith(a + ".") for a in APPLICATIONS)
            if own or target in PLUMBING:
                continue
            if _is_private(target):
                if f"{module}:{line} imports the private module {target}" not in bad:
                    bad.append(f"{module}:{line} imports the private module {target}")
            elif name is not None and name.startswith("_"):
                bad.append(f"{module}:{line} imports the private name {target}.{name}")
    return bad


def test_every_module_is_in_a_layer() -> None:
    for module in SOURCES:
        layer_of(module)


def test_no_lower_layer_imports_a_higher_one() -> None:
    assert layer_violations(SOURCES) == []


def test_torch_cuda_only_in_the_cuda_binding() -> None:
    assert CUDA_MODULE in SOURCES
    assert cuda_violations(SOURCES) == []


def test_applications_use_public_names_only() -> None:
    assert public_name_violations(SOURCES) == []


def _planted(module: str, source: str) -> dict[str, tuple[Path, ast.Module]]:
    path = ROOT / (module.removeprefix("aiokv.").replace(".", "/") + ".py")
    return {module: (path, ast.parse(source))}


@pytest.mark.parametrize(
    ("check", "module", "source", "expected"),
    [
        (layer_violations, "aiokv.tiers._cpu", "from .._offloader import Offloader\n", "from below (tiers)"),
        (
            layer_violations,
            "aiokv._errors",
            "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .serve import ServeConfig\n",
            "aiokv.serve (applications)",
        ),
        (layer_violations, "aiokv.store", "import aiokv.vllm\n", "aiokv.vllm"),
        (
            cuda_violations,
            "aiokv.engine._model",
            "import torch\ntorch.cuda.synchronize()\n",
            "uses torch.cuda",
        ),
        (cuda_violations, "aiokv.transfer._device", "from torch import cuda\n", "uses torch.cuda"),
        (
            public_name_violations,
            "aiokv.vllm._worker",
            "from .._offloader import Offloader\n",
            "private module",
        ),
        (public_name_violations, "aiokv.serve._app", "from ..tiers import _disk\n", "private module"),
        (public_name_violations, "aiokv.replay._sim", "from ..tiers._index import BlockIndex\n", "private"),
        (public_name_violations, "aiokv.cli", "from ._offloader import Offloader\n", "private module"),
        (public_name_violations, "aiokv.serve._app", "from ..tiers import _make\n", "private name"),
    ],
)
def test_each_check_sees_a_planted_violation(check, module, source, expected) -> None:  # type: ignore[no-untyped-def]
    found = check(_planted(module, source))
    assert len(found) == 1, found
    assert expected in found[0], found


def test_allowed_imports_are_not_flagged() -> None:
    """Own package, plumbing, public packages and the top level pass."""
    ok = "from .._errors import InvalidArgumentError\nfrom ..tiers import BlockIndex\nfrom .. import Offloader\n"
    ok += "from ._block_table import vllm_groups\nfrom ..rules import window_blocks\n"
    assert public_name_violations(_planted("aiokv.vllm._worker", ok)) == []
    assert layer_violations(_planted("aiokv.vllm._worker", ok)) == []
