"""Generate docs/reference.md from the docstrings of the public API (``aiokv.__all__``).

Usage: ``python tools/gen_reference.py`` (writes the file) or ``--check`` (exit 1 when it is stale).
"""

from __future__ import annotations

import argparse
import inspect
import sys
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


def render() -> str:
    lines = [
        "# API reference",
        "",
        "Generated from docstrings by `python tools/gen_reference.py`; do not edit by hand.",
        "Everything listed here is importable from `aiokv` and covered by the compatibility promise.",
        "",
    ]
    for name in sorted(aiokv.__all__, key=str.lower):
        obj = getattr(aiokv, name)
        if name.startswith("__"):
            continue
        if inspect.isclass(obj):
            kind = "exception" if issubclass(obj, BaseException) else "class"
            lines += [f"## `{name}` ({kind})", ""]
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
                if inspect.isfunction(member) and _doc(member):
                    asyncness = "async " if inspect.iscoroutinefunction(member) else ""
                    lines += [f"### `{asyncness}{name}.{attr}{_sig(member)}`", "", _doc(member), ""]
            lines.append("")
        elif callable(obj):
            lines += [f"## `{name}{_sig(obj)}`", "", _doc(obj), ""]
        else:
            lines += [
                f"## `{name}`",
                "",
                f"Constant: `{obj!r}`" if not isinstance(obj, bytes) else "Constant (bytes).",
                "",
            ]
    return "\n".join(lines).rstrip() + "\n"


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
