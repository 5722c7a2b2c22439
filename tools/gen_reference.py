"""Generate docs/reference.md from the docstrings of the public API: ``aiokv.__all__``, then each public
subpackage's ``__all__`` (names already listed at the top level are not repeated).

Usage: ``python tools/gen_reference.py`` (writes the file) or ``--check`` (exit 1 when it is stale).
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import sys
import types
from pathlib import Path

import aiokv

OUT = Path(__file__).resolve().parent.parent / "docs" / "reference.md"


def _doc(obj: object) -> str:
    return inspect.cleandoc(obj.__doc__ or "").strip()


def _sig(obj: object) -> str:
    try:
        return str(inspect.signature(obj))  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return ""


SUBPACKAGES = (
    (
        "aiokv.errors",
        "Every exception aiokv raises (each is also importable from the top level, without a warning).",
    ),
    ("aiokv.engine", "The reference engine: `Engine.generate`, `Engine.stream`, their results and stats."),
    ("aiokv.store", "The store core: the CPU tier's index behind a synchronous, two-phase protocol."),
    ("aiokv.tiers", "Tiers, the block index and eviction policies."),
    ("aiokv.transfer", "The copy executor, transfer futures, device bindings and the simulated device."),
    ("aiokv.bridge", "Using aiokv from threads other than the offloader's event loop."),
    ("aiokv.rules", "The offloader's decisions as pure, synchronous functions; hash roots."),
    ("aiokv.events", "KV cache events (needs the `events` extra for the ZMQ publisher)."),
    ("aiokv.metrics", "Prometheus metrics (needs `prometheus_client`)."),
    (
        "aiokv.testing",
        "Test helpers: fault injection, an in-memory lower tier, a fake clock, the simulated device.",
    ),
)


def render() -> str:
    lines = [
        "# API reference",
        "",
        "Generated from docstrings by `python tools/gen_reference.py`; do not edit by hand.",
        "Everything listed here is covered by the compatibility promise: the top-level names are importable",
        "from `aiokv`, the others from the subpackage they are listed under.",
        "",
        "Contents: [aiokv](#aiokv) · "
        + " · ".join(f"[{mod}](#{mod.replace('.', '')})" for mod, _ in SUBPACKAGES)
        + " · [aiokv.vllm](#aiokvvllm)",
        "",
        "# aiokv",
        "",
    ]
    _render_module(lines, aiokv, aiokv.__all__, "")
    top = set(aiokv.__all__)
    for mod_name, blurb in SUBPACKAGES:
        mod = importlib.import_module(mod_name)
        names = [n for n in mod.__all__ if n not in top]
        lines += [f"# {mod_name}", "", blurb, ""]
        _render_module(lines, mod, names, mod_name + ".")
    # aiokv.vllm imports vLLM, which the main environment lacks: its configuration record has no such import.
    from aiokv.vllm._config import ConnectorConfig

    lines += [
        "# aiokv.vllm",
        "",
        "The vLLM connector (`import aiokv.vllm` imports vLLM): `AiokvConnector`, selected with",
        '`kv_connector="AiokvConnector", kv_connector_module_path="aiokv.vllm"`. The keys of',
        "`kv_connector_extra_config` are `ConnectorConfig`'s fields, described in [vllm.md](vllm.md).",
        "",
    ]
    _render_module(
        lines, types.SimpleNamespace(ConnectorConfig=ConnectorConfig), ["ConnectorConfig"], "aiokv.vllm."
    )
    return "\n".join(lines).rstrip() + "\n"


def _render_module(lines: list[str], module: object, names: list[str], prefix: str) -> None:
    for name in sorted(names, key=str.lower):
        obj = getattr(module, name)
        if name.startswith("__"):
            continue
        if inspect.isclass(obj):
            kind = "exception" if issubclass(obj, BaseException) else "class"
            lines += [f"## `{prefix}{name}` ({kind})", ""]
            if not issubclass(obj, BaseException):
                lines += ["```python", f"{name}{_sig(obj)}", "```", ""]
            else:
                bases = ", ".join(b.__name__ for b in obj.__bases__)
                lines += [f"Bases: {bases}", ""]
            if _doc(obj):
                lines += [_doc(obj), ""]
            for attr, member in sorted(vars(obj).items()):
                if attr.startswith("_") and attr not in ("__aenter__", "__await__"):
                    continue
                if isinstance(member, property):
                    if _doc(member):
                        lines += [f"- **`{attr}`** (property): {_doc(member).splitlines()[0]}"]
                    continue
                if inspect.isfunction(getattr(member, "__wrapped__", None)) and not inspect.isfunction(
                    member
                ):
                    member = (
                        member.__wrapped__
                    )  # a C-accelerated method (Request.step): document the Python one
                if inspect.isfunction(member) and _doc(member):
                    asyncness = "async " if inspect.iscoroutinefunction(member) else ""
                    lines += [f"### `{asyncness}{name}.{attr}{_sig(member)}`", "", _doc(member), ""]
            lines.append("")
        elif callable(obj):
            lines += [f"## `{prefix}{name}{_sig(obj)}`", "", _doc(obj), ""]
        else:
            lines += [
                f"## `{prefix}{name}`",
                "",
                f"Constant: `{obj!r}`" if not isinstance(obj, bytes) else "Constant (bytes).",
                "",
            ]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args()
    text = render()
    if args.check:
        if not OUT.exists() or OUT.read_text() != text:
            print(f"{OUT} is stale: run python tools/gen_reference.py", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text)
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
