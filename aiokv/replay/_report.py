"""Presenting replay results: a rich table, JSON and a hit-ratio-versus-capacity plot (matplotlib optional)."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .._errors import InvalidArgumentError, MissingDependencyError
from ._groups import GroupPlan, group_rows
from ._model import TTFT_FORMULA, format_size
from ._sim import ReplayResult, TierResult

__all__ = [
    "PLOT_FORMATS",
    "check_plot_path",
    "encodings_table",
    "groups_table",
    "require_matplotlib",
    "results_json",
    "results_table",
    "save_plot",
    "tier_table",
]

PLOT_FORMATS = ("png", "svg", "svgz", "pdf", "eps", "ps", "jpg", "jpeg", "tif", "tiff", "webp")
"""File types ``save_plot`` writes, taken from the path's suffix."""


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def _seconds(s: float) -> str:
    if abs(s) >= 3600:
        return f"{s / 3600:.2f} h"
    if abs(s) >= 60:
        return f"{s / 60:.1f} min"
    return f"{s:.2f} s"


def _tier_text(t: TierResult) -> str:
    """A tier's capacity, and its encoding when it has one: ``2 TiB`` or ``2 TiB:encoding=fp8``."""
    return format_size(t.capacity_bytes) + ("" if t.encoding is None else f":encoding={t.encoding}")


def _capacities(r: ReplayResult, names: Sequence[str] | None = None) -> str:
    return ", ".join(f"{t.name}={_tier_text(t)}" for t in r.tiers if names is None or t.name in names)


def _blocks(t: TierResult) -> str:
    """The blocks (units) a tier's capacity holds, ``inf`` when it is unlimited."""
    return "inf" if t.capacity_blocks is None else f"{t.capacity_blocks:,}"


def _varying(results: Sequence[ReplayResult], tier_names: Sequence[str]) -> list[str]:
    """The tiers whose capacity or encoding differs between ``results``."""
    return [
        name
        for name in tier_names
        if len({(t.capacity_bytes, t.encoding) for r in results for t in r.tiers if t.name == name}) > 1
    ]


def results_table(results: Sequence[ReplayResult], *, title: str | None = None) -> Any:
    """One row per run: policy, the capacities (and encodings) that differ between runs, the blocks each
    encoded tier holds, hit ratios (total and per tier), bytes loaded, written (stored + staged) and evicted
    over all tiers, and the TTFT saving."""
    from rich.table import Table

    tier_names = list(dict.fromkeys(t.name for r in results for t in r.tiers))
    varying = _varying(results, tier_names)
    encoded = [
        n for n in tier_names if any(t.encoding is not None for r in results for t in r.tiers if t.name == n)
    ]
    fixed = [name for name in tier_names if name not in varying]
    if title is None and results and fixed:
        title = "capacity " + _capacities(results[0], fixed)
    table = Table(title=title, caption=TTFT_FORMULA, caption_justify="left")
    table.add_column("policy", no_wrap=True)
    for name in varying:
        table.add_column(name, justify="right", no_wrap=True)
    for name in encoded:
        table.add_column(f"{name} blocks", justify="right", no_wrap=True)
    table.add_column("block hits", justify="right")
    table.add_column("token hits", justify="right")
    if len(tier_names) > 1:
        for name in tier_names:
            table.add_column(f"{name} hits", justify="right")
    for col in ("loaded", "written", "evicted", "TTFT saved", "saved"):
        table.add_column(col, justify="right", no_wrap=True)
    for r in results:
        per_tier = {t.name: t for t in r.tiers}
        cells = [r.policy]
        cells += [_tier_text(per_tier[name]) if name in per_tier else "-" for name in varying]
        cells += [_blocks(per_tier[name]) if name in per_tier else "-" for name in encoded]
        cells += [_pct(r.block_hit_ratio), _pct(r.token_hit_ratio)]
        if len(tier_names) > 1:
            for name in tier_names:
                t = per_tier.get(name)
                cells.append("-" if t is None else _pct(t.hit_blocks / r.block_refs if r.block_refs else 0.0))
        cells += [
            format_size(sum(t.loaded_bytes for t in r.tiers)),
            format_size(sum(t.stored_bytes + t.staged_bytes for t in r.tiers)),
            format_size(sum(t.evicted_bytes for t in r.tiers)),
            _seconds(r.ttft_saved_s),
            _pct(r.ttft_saved_ratio),
        ]
        table.add_row(*cells)
    return table


def tier_table(result: ReplayResult) -> Any:
    """Per-tier detail of one run: capacity, encoding, bytes a block takes in the tier, the blocks its capacity
    holds, hits, bytes moved; a tier's TTFT saving is its hit tokens' prefill time minus its load time."""
    from rich.table import Table

    table = Table(title=f"{result.policy}: per tier")
    slots = "blocks" if result.groups is None else "units"  # with groups a tier holds units
    per = slots[:-1]
    cols = (
        "tier",
        "capacity",
        "encoding",
        f"bytes/{per}",
        slots,
        "hits",
        "hit tokens",
        "loaded",
        "load time",
    )
    for col in (*cols, "TTFT saved", "stored", "staged", "evicted"):
        table.add_column(col, justify="left" if col in ("tier", "encoding") else "right")
    for t in result.tiers:
        table.add_row(
            t.name,
            format_size(t.capacity_bytes),
            t.encoding or "-",
            f"{t.entry_bytes or t.block_bytes:,}",
            _blocks(t),
            _pct(t.hit_blocks / result.block_refs if result.block_refs else 0.0),
            f"{t.hit_tokens:,}",
            format_size(t.loaded_bytes),
            _seconds(t.load_s),
            _seconds((t.hit_tokens - t.skipped_tokens) / result.prefill_tokens_per_s - t.load_s),
            format_size(t.stored_bytes),
            format_size(t.staged_bytes),
            format_size(t.evicted_bytes),
        )
    return table


def encodings_table(results: Sequence[ReplayResult]) -> Any:
    """The encoded tiers of ``results``, once per capacity and encoding: the bytes a block holds in the tier
    (its payload, what a load moves) and takes of its capacity (the entry), and the blocks the capacity holds
    (``None`` when no tier has an encoding)."""
    from rich.table import Table

    rows: dict[tuple[str, int | None, str], TierResult] = {}
    for r in results:
        for t in r.tiers:
            if t.encoding is not None:
                rows.setdefault((t.name, t.capacity_bytes, t.encoding), t)
    if not rows:
        return None
    grouped = any(r.groups is not None for r in results)
    per = "unit" if grouped else "block"
    table = Table(
        title="encoded tiers",
        caption=f"payload: bytes a load moves per {per} (encoded); entry: bytes of capacity per {per} (header, "
        "padding)",
        caption_justify="left",
    )
    for col in ("tier", "capacity", "encoding", f"payload/{per}", f"entry/{per}", f"{per}s"):
        table.add_column(col, justify="left" if col in ("tier", "encoding") else "right")
    for t in rows.values():
        table.add_row(
            t.name,
            format_size(t.capacity_bytes),
            t.encoding,
            f"{t.moved_bytes:,}",
            f"{t.entry_bytes:,}",
            _blocks(t),
        )
    return table


def groups_table(plan: GroupPlan, *, title: str | None = None) -> Any:
    """The key block by group: kind, layers, window, bytes per block, and the part it is stored in (units of
    the plan's unit, padding, and which blocks are kept)."""
    from rich.table import Table

    table = Table(
        title=title,
        caption=(
            f"a {plan.block_tokens}-token key block: {plan.units} units of {format_size(plan.unit_bytes)} "
            f"({format_size(plan.units * plan.unit_bytes)} with every part, "
            f"{format_size(plan.padding_bytes)} of it padding); sliding-window and state parts are kept only "
            f"every {plan.checkpoint_blocks} blocks and at each prompt's end"
        ),
        caption_justify="left",
    )
    for col in ("group", "kind", "layers", "window", "bytes/token/layer", "bytes/block", "units", "kept"):
        table.add_column(col, justify="left" if col in ("group", "kind", "kept") else "right")
    for row in group_rows(plan):
        kind = row["kind"]
        if kind in ("full", "latent"):
            kept = "every block"
        elif kind == "state":
            kept = "the snapshot at a kept boundary"
        else:
            kept = f"the {row['window_blocks']} block(s) before a kept boundary"
        table.add_row(
            row["name"],
            kind,
            str(row["layers"]),
            "-" if row["window"] is None else f"{row['window']:,}",
            f"{row['bytes_per_layer']:,}" + (" /snapshot" if kind == "state" else ""),
            format_size(row["block_bytes"]),
            f"{row['part_units']} (part {row['part']})",
            kept,
        )
    return table


def results_json(results: Sequence[ReplayResult], **meta: Any) -> str:
    """Strict JSON: a NaN or an infinity raises ``ValueError`` rather than printing ``NaN``/``Infinity``."""
    return json.dumps({**meta, "runs": [r.to_dict() for r in results]}, indent=2, allow_nan=False)


def require_matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise MissingDependencyError(
            "--plot needs matplotlib; install it with: pip install 'aiokv[plot]'"
        ) from None


def check_plot_path(path: str | Path) -> None:
    """Refuse, before any work, a plot path that :func:`save_plot` could not write: an unknown suffix, a
    directory, a missing parent directory, or a place this process may not create or overwrite a file."""
    path = Path(path)
    shown = repr(str(path))
    if path.suffix.lower().lstrip(".") not in PLOT_FORMATS:
        raise InvalidArgumentError(
            f"plot must be a file name ending in .{', .'.join(PLOT_FORMATS)}, got {shown}"
        )
    try:
        reason = _why_unwritable(path)
    except (OSError, ValueError) as exc:  # permission, read-only file system, name too long, embedded NUL
        reason = (getattr(exc, "strerror", None) or str(exc)).lower()
    if reason is not None:
        raise InvalidArgumentError(f"plot must be a writable file path, got {shown} ({reason})")


def _why_unwritable(path: Path) -> str | None:
    """Open ``path`` for append, or create and remove it: ``None`` when that works, else why not."""
    if path.is_dir():
        return "a directory"
    if not path.parent.is_dir():
        return f"no directory {str(path.parent)!r}"
    if path.exists():
        with path.open("ab"):  # opening for append changes nothing
            pass
    else:
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
        path.unlink()
    return None


def save_plot(
    results: Sequence[ReplayResult],
    path: str | Path,
    *,
    sweep_tier: str,
    max_reuse: float | None = None,
    title: str | None = None,
) -> None:
    """Block hit ratio against the capacity of ``sweep_tier``, one line per policy (log-scaled capacity), and
    per tier configuration when the runs' other tiers or the swept tier's encoding differ."""
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=100)
    by_policy: dict[str, list[tuple[float, float]]] = {}
    # Runs of several tier configurations (--tiers given more than once): one line per policy and configuration.
    names = list(dict.fromkeys(t.name for r in results for t in r.tiers))
    others = _varying(results, [n for n in names if n != sweep_tier])
    encodings = {t.encoding for r in results for t in r.tiers if t.name == sweep_tier}
    for r in results:
        tier = next(t for t in r.tiers if t.name == sweep_tier)
        cap = tier.capacity_bytes if tier.capacity_bytes is not None else r.unique_blocks * r.block_bytes
        label = r.policy
        if len(encodings) > 1:
            label += f", {sweep_tier} {tier.encoding or 'not encoded'}"
        if others:
            label += ", " + _capacities(r, others)
        by_policy.setdefault(label, []).append((cap / 2**30, 100 * r.block_hit_ratio))
    styles = [("-", "o"), ("--", "s"), (":", "^"), ("-.", "d")]  # identical curves stay visible
    for i, (policy, points) in enumerate(by_policy.items()):
        points.sort()
        line, marker = styles[i % len(styles)]
        ax.plot(
            [p[0] for p in points],
            [p[1] for p in points],
            linestyle=line,
            marker=marker,
            markersize=4,
            markerfacecolor="none",
            label=policy,
        )
    if max_reuse is not None:
        ax.axhline(100 * max_reuse, color="grey", linestyle="--", linewidth=1, label="unlimited capacity")
    ax.set_xscale("log", base=2)
    ax.set_xlabel(f"{sweep_tier} capacity (GiB)")
    ax.set_ylabel("block hit ratio (%)")
    ax.set_ylim(bottom=0)
    ax.grid(True, which="major", alpha=0.3)
    ax.legend()
    if title:
        ax.set_title(title, fontsize=10)
    fig.tight_layout()
    try:
        fig.savefig(path, format=Path(path).suffix.lower().lstrip(".") or None)
    finally:
        plt.close(fig)
