"""Helpers shared by the benchmarks: result files, tables, timing statistics and memory readings.

Every benchmark prints its figures as ratios against a baseline measured in the same run (absolute numbers
depend on the machine; ratios travel) and writes ``benchmarks/results/<name>.json`` via :func:`write_result`.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import re
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).resolve().parent / "results"

if str(ROOT) not in sys.path:  # run as `python benchmarks/bench_x.py` from anywhere, without installing
    sys.path.insert(0, str(ROOT))

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30


def machine() -> dict[str, Any]:
    """What the figures were measured on."""
    import numpy
    import torch

    info: dict[str, Any] = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "numpy": numpy.__version__,
    }
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    info["cpu"] = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    with contextlib.suppress(ValueError, OSError):
        info["mem_total_bytes"] = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return info


def write_result(name: str, data: dict[str, Any]) -> Path:
    """Write ``results/<name>.json`` with the machine description and a timestamp added."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    payload = {"benchmark": name, "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "machine": machine(), **data}
    path.write_text(json.dumps(payload, indent=2, sort_keys=False) + "\n")
    return path


def print_table(title: str, columns: Sequence[str], rows: Sequence[Sequence[object]], note: str = "") -> None:
    """A small table: rich when installed, plain text otherwise."""
    cells = [[_fmt(v) for v in row] for row in rows]
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        widths = [
            max(len(c), *(len(r[i]) for r in cells)) if cells else len(c) for i, c in enumerate(columns)
        ]
        print(f"\n{title}")
        print("  ".join(c.rjust(w) for c, w in zip(columns, widths, strict=True)))
        for r in cells:
            print("  ".join(v.rjust(w) for v, w in zip(r, widths, strict=True)))
        if note:
            print(note)
        return
    table = Table(title=title, caption=note or None, caption_justify="left")
    for c in columns:
        table.add_column(c, justify="right")
    for r in cells:
        table.add_row(*r)
    Console(width=max(100, sum(len(c) + 3 for c in columns))).print(table)


def _fmt(v: object) -> str:
    if isinstance(v, float):
        if v == 0 or 0.01 <= abs(v) < 100_000:
            return f"{v:.3g}" if abs(v) < 1 else f"{v:,.2f}"
        return f"{v:.3g}"
    return str(v)


def summarize(samples: Sequence[float]) -> dict[str, float]:
    """Median, min and max of repeated measurements (the median is the reported figure)."""
    return {"median": statistics.median(samples), "min": min(samples), "max": max(samples), "n": len(samples)}


def percentile(samples: Sequence[float], q: float) -> float:
    """Nearest-rank percentile, ``q`` in [0, 100]."""
    if not samples:
        return float("nan")
    ordered = sorted(samples)
    k = max(0, min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1))))
    return ordered[k]


def rss_bytes() -> int:
    """Current resident set size of this process."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss_bytes() -> int:
    """Peak resident set size of this process so far (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def status(msg: str) -> None:
    """Progress on stderr, so stdout holds only the results."""
    print(msg, file=sys.stderr, flush=True)


class ServeProcess:
    """``python -m aiokv serve --port 0 ARGS...`` in a subprocess (its own GIL; no ``AIOKV_*`` variable reaches
    it), found by the URL its ready line prints; :meth:`stop` sends SIGTERM and waits."""

    def __init__(self, *args: str) -> None:
        cmd = [sys.executable, "-m", "aiokv", "serve", "--port", "0", *args]
        env = {k: v for k, v in os.environ.items() if not k.startswith("AIOKV_")}
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        m = re.search(r"on (http://\S+) ", line)
        if m is None:
            self.proc.kill()
            raise SystemExit(f"the server did not start: {line!r}")
        self.url = m.group(1)
        host, port = self.url.removeprefix("http://").rsplit(":", 1)
        self.address = (host, int(port))

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(60)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
