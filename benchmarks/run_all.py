"""Run every ``benchmarks/bench_*.py`` as a subprocess, keep going past failures, print a summary and write
``benchmarks/results/latest.json`` (each benchmark's exit status, wall time and its own results file).

Usage: ``python benchmarks/run_all.py [--only NAME ...] [--quick] [--timeout SECONDS]``; with ``--only`` the
entries of the other benchmarks in ``latest.json`` are kept. ``NAME`` may be
``copy``, ``bench_copy`` or ``bench_copy.py``. ``--quick`` is passed on to every benchmark that has the option.
Exit status: 0 when every benchmark that ran exited 0, 1 otherwise.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import _common as common  # noqa: E402


def discover() -> list[Path]:
    return sorted(HERE.glob("bench_*.py"))


def short(path: Path) -> str:
    return path.stem.removeprefix("bench_")


def select(benches: list[Path], only: list[str] | None) -> list[Path]:
    if not only:
        return benches
    wanted = {name.removesuffix(".py").removeprefix("bench_") for name in only}
    unknown = wanted - {short(b) for b in benches}
    if unknown:
        names = ", ".join(short(b) for b in benches)
        raise SystemExit(f"--only: unknown benchmark(s) {', '.join(sorted(unknown))}; available: {names}")
    return [b for b in benches if short(b) in wanted]


def fresh_result(bench: Path, since: float) -> tuple[str | None, Any]:
    """The results file this benchmark wrote during this run, under either naming convention."""
    for name in (short(bench), bench.stem):
        path = common.RESULTS / f"{name}.json"
        if path.exists() and path.stat().st_mtime >= since:
            try:
                return str(path.relative_to(common.ROOT)), json.loads(path.read_text())
            except (OSError, ValueError) as exc:
                return str(path), {"error": f"unreadable results file: {exc}"}
    return None, None


def own_timeout(bench: Path, default: float, quick: bool) -> float:
    """A benchmark that needs longer than the default in a full run says so in a line
    ``RUN_ALL_TIMEOUT_S = <seconds>``; the longer of the two applies (not with --quick)."""
    if not quick:
        m = re.search(r"^RUN_ALL_TIMEOUT_S = ([0-9.]+)", bench.read_text(), re.MULTILINE)
        if m:
            return max(default, float(m.group(1)))
    return default


def run_one(bench: Path, extra: list[str], timeout: float) -> dict[str, Any]:
    started = time.time()
    t0 = time.perf_counter()
    print(f"\n=== {bench.name} {' '.join(extra)}".rstrip(), flush=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    try:
        # Output streams straight to the terminal; the results come back through the JSON file.
        proc = subprocess.run([sys.executable, str(bench), *extra], cwd=common.ROOT, env=env, timeout=timeout)
        rc: int | None = proc.returncode
        error = None if rc == 0 else f"exit status {rc}"
    except subprocess.TimeoutExpired:
        rc, error = None, f"timed out after {timeout:.0f} s"
    wall = time.perf_counter() - t0
    path, result = fresh_result(bench, started)
    warning = (
        "wrote no results file" if rc == 0 and result is None else None
    )  # its figures are only in the log
    return {"name": short(bench), "script": bench.name, "ok": error is None, "returncode": rc, "error": error,
            "warning": warning, "wall_s": wall, "results_file": path, "result": result}  # fmt: skip


def headline(result: Any) -> str:
    """A one-line figure for the summary, from the usual keys of a results file."""
    if not isinstance(result, dict):
        return ""
    parts = []
    for key in ("worst_ratio", "worst_us", "met"):
        if key in result:
            v = result[key]
            parts.append(f"{key}={v:.3g}" if isinstance(v, float) else f"{key}={v}")
    if (
        "index" in result
        and isinstance(result["index"], dict)
        and "traced_bytes_per_entry" in result["index"]
    ):
        parts.append(f"index={result['index']['traced_bytes_per_entry']:.0f} B/entry")
    return " ".join(parts)


def status(run: dict[str, Any]) -> str:
    if not run["ok"]:
        return f"FAILED ({run['error']})"
    return f"ok ({run['warning']})" if run["warning"] else "ok"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--only", action="append", metavar="NAME", help="run only this benchmark (repeatable)"
    )
    parser.add_argument("--quick", action="store_true", help="pass --quick to every benchmark")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per benchmark (default 300)")
    args = parser.parse_args()
    benches = select(discover(), args.only)
    extra = ["--quick"] if args.quick else []
    t0 = time.perf_counter()
    # A benchmark without a --quick option runs in full rather than failing on the unknown flag.
    runs = [
        run_one(b, extra if "--quick" in b.read_text() else [], own_timeout(b, args.timeout, args.quick))
        for b in benches
    ]
    total = time.perf_counter() - t0

    common.print_table(
        f"run_all: {len(runs)} benchmarks in {total:.0f} s",
        ["benchmark", "status", "wall s", "headline"],
        [[r["name"], status(r), r["wall_s"], headline(r["result"])] for r in runs],
    )
    common.RESULTS.mkdir(parents=True, exist_ok=True)
    latest = common.RESULTS / "latest.json"
    merged: dict[str, Any] = {}
    if args.only and latest.exists():  # a partial run updates its benchmarks' entries, keeping the others
        with contextlib.suppress(OSError, ValueError, AttributeError):
            merged = dict(json.loads(latest.read_text()).get("benchmarks", {}))
    merged.update({r["name"]: r for r in runs})
    latest.write_text(
        json.dumps(
            {
                "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                "machine": common.machine(),
                "quick": args.quick,
                "wall_s": total,
                "ok": all(r["ok"] for r in merged.values()),
                "benchmarks": merged,
            },
            indent=2,
        )
        + "\n"
    )
    print(f"wrote {latest.relative_to(common.ROOT)}")
    return 0 if all(r["ok"] for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
