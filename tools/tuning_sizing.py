"""Tier sizing from a trace: hit ratio and modelled TTFT saving against CPU capacity, with a disk tier behind it
or not, the capacities where the hit ratio reaches a share of its maximum, the write rate a write-through tier
must absorb, and the hit ratio a Redis TTL keeps. docs/tuning.md shows the output for the Mooncake traces.

    python tools/tuning_sizing.py conversation_trace.jsonl --plot docs/img/tuning_conversation.png
    python tools/tuning_sizing.py synthetic:sessions=300 --plot /tmp/sizing.png --policies lru,session

Every figure comes from aiokv.replay (the block index and eviction policies that serve requests, transfers
replaced by the bandwidth model of docs/replay.md) or from the trace's timestamps; nothing is timed, so the
output is the same on every machine.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from aiokv.replay import (
    COST_PRESETS,
    CostModel,
    ReplayResult,
    TierConfig,
    Trace,
    format_size,
    load_trace,
    max_prefix_reuse,
    replay,
    synthetic_trace,
)

SHARES = (0.5, 0.8, 0.9)
TTLS_S = (60, 300, 600, 1800, 3600)


def _load(spec: str, block_tokens: int) -> Trace:
    if spec == "synthetic" or spec.startswith("synthetic:"):
        opts: dict[str, float] = {}
        for part in filter(None, spec.partition(":")[2].split(",")):
            k, _, v = part.partition("=")
            opts[k] = float(v) if k in ("sessions_per_s", "think_s") else int(v)
        return synthetic_trace(**opts)  # type: ignore[arg-type]
    return load_trace(spec, block_tokens=block_tokens)


def _capacities(trace: Trace, block_bytes: int, points: int) -> list[int]:
    """``points`` capacities from 1/256 of the footprint to all of it, evenly spaced on a log scale (ratio
    sqrt(2) with the default 17 points), in whole blocks."""
    top = max(trace.unique_blocks, 1)
    blocks = sorted({max(1, round(top * 2.0 ** (-8 + 8 * i / (points - 1)))) for i in range(points)})
    return [b * block_bytes for b in blocks]


def _size(n: int) -> str:
    """Like format_size, without exponents: 1,010 GiB rather than 1.01e+03 GiB."""
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            x = n / scale
            return f"{x:.3g} {unit}" if x < 1000 else f"{x:,.0f} {unit}"
    return f"{n} B"


def knee(caps: Sequence[int], ratios: Sequence[float], target: float) -> int | None:
    """The smallest swept capacity whose hit ratio reaches ``target`` (None if none does)."""
    for cap, ratio in zip(caps, ratios, strict=True):
        if ratio >= target - 1e-12:
            return cap
    return None


def write_rate(
    trace: Trace, block_bytes: int, window_ms: float = 5000.0
) -> tuple[float, float, float, float]:
    """Bytes per second of blocks seen for the first time (what a write-through tier large enough to keep
    everything is sent), over windows of ``window_ms`` of trace time: mean, p50, p99, max."""
    seen: set[bytes] = set()
    per_window: dict[int, int] = {}
    for r in trace.requests:
        new = sum(1 for k in r.keys if k not in seen)
        seen.update(r.keys)
        w = int(r.timestamp_ms // window_ms)
        per_window[w] = per_window.get(w, 0) + new
    if not per_window:
        return 0.0, 0.0, 0.0, 0.0
    span = max(per_window) - min(per_window) + 1
    counts = sorted(per_window.get(min(per_window) + i, 0) for i in range(span))
    scale = block_bytes * 1000.0 / window_ms

    def pct(p: float) -> float:
        return counts[min(len(counts) - 1, int(p * len(counts)))] * scale

    return sum(counts) / span * scale, pct(0.5), pct(0.99), counts[-1] * scale


def ttl_hit_ratios(trace: Trace, ttls_s: Sequence[float]) -> list[float]:
    """Block hit ratio of one unlimited tier whose entries expire ``ttl`` seconds after their last use (a
    Redis tier with ``ttl_s``, refreshed on every read and write, read on every hit: an upper bound)."""
    out = []
    for ttl in ttls_s:
        ttl_ms = ttl * 1000.0
        last: dict[bytes, float] = {}
        hits = 0
        for r in trace.requests:
            now = r.timestamp_ms
            for k in r.keys:
                t = last.get(k)
                if t is None or now - t > ttl_ms:
                    break
                hits += 1
            for k in r.keys:
                last[k] = now
        out.append(hits / max(trace.block_refs, 1))
    return out


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    ap.add_argument("trace", help="a JSONL trace (aiokv replay's formats) or synthetic[:option=value,...]")
    ap.add_argument(
        "--policies", default="lru,session", help="CPU-only sweeps, one per policy (default lru,session)"
    )
    ap.add_argument(
        "--disk",
        type=float,
        default=0.25,
        help="disk tier behind the CPU tier, as a share of the trace's footprint (default 0.25; 0: none)",
    )
    ap.add_argument(
        "--disk-policy", default="session", help="policy of the CPU + disk sweep (default session)"
    )
    ap.add_argument("--model", default="llama3-8b", choices=sorted(COST_PRESETS))
    ap.add_argument("--block-tokens", type=int, default=512)
    ap.add_argument(
        "--points", type=int, default=17, help="capacities from 1/256 of the footprint to all of it"
    )
    ap.add_argument("--plot", help="write hit ratio and TTFT saving vs CPU capacity to this file")
    args = ap.parse_args(argv)

    trace = _load(args.trace, args.block_tokens)
    model = COST_PRESETS[args.model]
    kvb = model.kv_bytes_per_token
    block_bytes = trace.block_tokens * kvb
    cost = CostModel(model.prefill_tokens_per_s)
    footprint = trace.unique_blocks * block_bytes
    best = max_prefix_reuse(trace.requests) / max(trace.block_refs, 1)
    caps = _capacities(trace, block_bytes, args.points)
    print(
        f"# {trace.name}: {len(trace):,} requests, {trace.block_refs:,} block refs, {trace.unique_blocks:,} unique "
        f"blocks = {format_size(footprint)} at {args.model} ({format_size(block_bytes)}/block); "
        f"maximum prefix reuse {best:.2%}"
    )

    configs: list[tuple[str, list[TierConfig | None], str]] = [
        (f"{p}, CPU only", [None], p) for p in args.policies.split(",")
    ]
    disk_bytes = 0
    if args.disk > 0:
        disk_bytes = max(1, round(trace.unique_blocks * args.disk)) * block_bytes
        configs.append(
            (
                f"{args.disk_policy}, CPU + disk {format_size(disk_bytes)}",
                [None, TierConfig("disk", disk_bytes)],
                args.disk_policy,
            )
        )
    series: dict[str, list[ReplayResult]] = {}
    started = time.perf_counter()
    for label, tiers, pol in configs:
        runs = []
        for cap in caps:
            run_tiers = [TierConfig("cpu", cap) if t is None else t for t in tiers]
            runs.append(replay(trace, run_tiers, policy=pol, kv_bytes_per_token=kvb, cost=cost))
        series[label] = runs
    elapsed = time.perf_counter() - started

    labels = list(series)
    print(
        "\n| CPU capacity | share of footprint | "
        + " | ".join(f"{lb}: hit / TTFT saved" for lb in labels)
        + " |"
    )
    print("|---|---|" + "---|" * len(labels))
    for i, cap in enumerate(caps):
        cells = [
            f"{series[lb][i].block_hit_ratio:.2%} / {series[lb][i].ttft_saved_ratio:.1%}" for lb in labels
        ]
        print(
            f"| {_size(cap)} | 1/{trace.unique_blocks * block_bytes / cap:.3g} | " + " | ".join(cells) + " |"
        )

    print(f"\nsmallest swept CPU capacity reaching a share of the maximum prefix reuse ({best:.2%}):")
    for lb in labels:
        ratios = [r.block_hit_ratio for r in series[lb]]
        found = []
        for s in SHARES:
            cap = knee(caps, ratios, s * best)
            found.append(
                f"{s:.0%}: {_size(cap) if cap else 'not reached'}"
                + (f" (1/{footprint / cap:.3g})" if cap else "")
            )
        print(f"  {lb}: " + ", ".join(found))

    mean, p50, p99, peak = write_rate(trace, block_bytes)
    print(
        f"\nnew blocks (written through to a lower tier that keeps everything), per 5 s window of trace time: "
        f"mean {format_size(mean)}/s, p50 {format_size(p50)}/s, p99 {format_size(p99)}/s, max {format_size(peak)}/s"
    )
    ttl_ratios = ttl_hit_ratios(trace, TTLS_S)
    print(
        "hit ratio of an unlimited tier whose entries expire TTL after their last use: "
        + ", ".join(
            f"{t // 60} min {r:.2%} ({r / best:.0%} of max)" for t, r in zip(TTLS_S, ttl_ratios, strict=True)
        )
    )
    print(f"\n{len(caps) * len(configs)} replays in {elapsed:.1f} s")

    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.6))
        x = [c / 2**30 for c in caps]
        for lb in labels:
            ax1.plot(x, [100 * r.block_hit_ratio for r in series[lb]], marker="o", ms=3, label=lb)
            ax2.plot(x, [100 * r.ttft_saved_ratio for r in series[lb]], marker="o", ms=3, label=lb)
        ax1.axhline(100 * best, ls="--", color="grey", lw=1, label=f"maximum reuse {best:.1%}")
        ax1.axhline(90 * best, ls=":", color="grey", lw=1, label="90 % of maximum")
        for ax, ylabel in (
            (ax1, "block hit ratio (%)"),
            (ax2, "modelled TTFT saved (% of no-cache prefill)"),
        ):
            ax.set_xscale("log", base=2)
            ax.set_xlabel(f"CPU tier capacity (GiB, {args.model}, {format_size(block_bytes)} per block)")
            ax.set_ylabel(ylabel)
            ax.grid(True, which="both", alpha=0.3)
            ax.set_ylim(bottom=0)
        ax1.legend(fontsize=8)
        fig.suptitle(
            f"{trace.name}: {len(trace):,} requests, footprint {format_size(footprint)}", fontsize=10
        )
        fig.tight_layout()
        fig.savefig(args.plot, dpi=110)
        print(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
