"""Speed of ``aiokv replay``: block references per second through the real BlockIndex and each policy.

Traces, first found wins: paths given on the command line; ``$AIOKV_TRACE_DIR/{conversation,synthetic}_trace.jsonl``
(the Mooncake traces); otherwise the 400-request slices in tests/data (a quick smoke run).

For each trace and policy it replays one CPU tier at 1/8 of the trace's footprint (so eviction runs on most
stores) and a CPU + disk hierarchy (1/16 and 1/2 of the footprint). Baseline, in the same run: a bare
``OrderedDict`` LRU over the same keys and capacity (lookup the leading run, then insert with eviction), i.e.
the cost of the bookkeeping alone; the ratio says what the real index and policy cost on top. Best of
``--repeat`` runs. Run: ``python benchmarks/bench_replay.py [TRACE ...] [--repeat N] [--quick]``.
"""

from __future__ import annotations

import argparse
import os
import time
from collections import OrderedDict
from pathlib import Path

from _common import ROOT, print_table, status, write_result

from aiokv.replay import CostModel, TierConfig, Trace, load_trace, replay

POLICIES = ["lru", "arc", "chain-lru"]
KV = 131072  # llama3-8b: 64 MiB per 512-token block
BLOCK_BYTES = 512 * KV
COST = CostModel(prefill_tokens_per_s=24_725.0)


def find_traces(paths: list[str]) -> list[Path]:
    if paths:
        return [Path(p) for p in paths]
    env = os.environ.get("AIOKV_TRACE_DIR")
    if env:
        found = [Path(env) / n for n in ("conversation_trace.jsonl", "synthetic_trace.jsonl")]
        found = [p for p in found if p.is_file()]
        if found:
            return found
        status(f"AIOKV_TRACE_DIR={env} holds no Mooncake traces; using the slices in tests/data")
    else:
        status("no trace given and AIOKV_TRACE_DIR unset; using the 400-request slices in tests/data")
    data = ROOT / "tests" / "data"
    return [data / "mooncake_conversation_head400.jsonl", data / "mooncake_synthetic_tail400.jsonl"]


def bare_lru(trace: Trace, slots: int) -> float:
    """The baseline: the same lookup/insert/evict loop over a plain OrderedDict. Returns seconds."""
    cache: OrderedDict[bytes, None] = OrderedDict()
    started = time.perf_counter()
    for req in trace.requests:
        keys = req.keys
        n = 0
        for key in keys:
            if key not in cache:
                break
            cache.move_to_end(key)
            n += 1
        for key in keys[n:]:
            if key in cache:
                cache.move_to_end(key)
                continue
            if len(cache) >= slots:
                cache.popitem(last=False)
            cache[key] = None
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("traces", nargs="*", help="JSONL traces (default: see above)")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="one repeat")
    args = parser.parse_args()
    if args.quick:
        args.repeat = 1

    rows: list[list[object]] = []
    records: list[dict[str, object]] = []
    for path in find_traces(args.traces):
        if not path.is_file():
            status(f"skipping {path}: not found")
            continue
        t0 = time.perf_counter()
        trace = load_trace(path)
        load_s = time.perf_counter() - t0
        status(f"{path.name}: {trace.block_refs:,} block refs, loaded in {load_s:.2f} s")
        footprint = trace.unique_blocks * BLOCK_BYTES
        base_s = min(bare_lru(trace, max(1, trace.unique_blocks // 8)) for _ in range(args.repeat))
        layouts = {
            "cpu 1/8": [TierConfig("cpu", footprint // 8)],
            "cpu 1/16 + disk 1/2": [TierConfig("cpu", footprint // 16), TierConfig("disk", footprint // 2)],
        }
        for layout, tiers in layouts.items():
            for policy in POLICIES:
                best = None
                for _ in range(args.repeat):
                    r = replay(trace, tiers, policy=policy, kv_bytes_per_token=KV, cost=COST)
                    if best is None or r.elapsed_s < best.elapsed_s:
                        best = r
                assert best is not None
                ratio = base_s / best.elapsed_s if layout == "cpu 1/8" else None
                rows.append(
                    [
                        path.name,
                        layout,
                        policy,
                        f"{best.refs_per_s:,.0f}",
                        round(best.elapsed_s, 3),
                        "-" if ratio is None else round(ratio, 2),
                        f"{100 * best.block_hit_ratio:.1f}%",
                    ]
                )
                records.append(
                    {
                        "trace": path.name,
                        "block_refs": trace.block_refs,
                        "layout": layout,
                        "policy": policy,
                        "refs_per_s": best.refs_per_s,
                        "elapsed_s": best.elapsed_s,
                        "baseline_s": base_s if ratio is not None else None,
                        "speed_vs_bare_lru": ratio,
                        "block_hit_ratio": best.block_hit_ratio,
                        "load_s": load_s,
                    }
                )
    print_table(
        "aiokv replay: block references per second through BlockIndex",
        ["trace", "tiers", "policy", "refs/s", "seconds", "vs bare LRU", "block hits"],
        rows,
        note="vs bare LRU: the speed of the real index + policy relative to a plain OrderedDict LRU loop "
        "(single tier only; 1.0 = no overhead)",
    )
    ratios = [r["speed_vs_bare_lru"] for r in records if isinstance(r["speed_vs_bare_lru"], float)]
    summary = {"worst_ratio": min(ratios) if ratios else None, "runs": records, "repeat": args.repeat}
    out = write_result("replay", summary)
    status(f"wrote {out}")


if __name__ == "__main__":
    main()
