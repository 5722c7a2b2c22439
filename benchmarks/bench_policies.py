"""Hit ratios of the eviction policies over workloads of several shapes: is `adaptive` within 0.3 points of
the better of LRU and ARC at every capacity of the default sweep (``--sweep cpu=auto``)?

Workloads (``--workloads``, comma-separated; default all):

- ``conversation``, ``mooncake-synthetic``: the Mooncake traces from ``$AIOKV_TRACE_DIR`` (skipped, with a
  note, when it is unset; the 400-request slices in tests/data are too short to rank policies);
- ``chat``: ``synthetic_trace(seed=1)`` (``aiokv replay synthetic:seed=1``);
- ``agentic``: coding-agent sessions at 64-token blocks (``aiokv.replay.agentic_trace``;
  ``synthetic:shape=agentic,sessions=40,seed=1 --block-tokens 64``): three shared tool prompts of 150
  blocks, 40 sessions of 5+ turns (exponential, mean 60), each turn re-sending the context plus a tool
  result (Pareto-sized, 1-60 blocks) then a model action (1-4 blocks), 3 s mean think time, sessions
  arriving every 20 s on average (many active at once), the context compacted to the prompt plus 40 fresh
  blocks past 3,000;
- ``retrieval``: 12 shared documents of 50-400 blocks (Zipf-popular) behind 4,000 one- or two-turn
  questions (``aiokv.replay.retrieval_trace``; ``synthetic:shape=retrieval,questions=4000,docs=12,seed=1``);
- ``mix``: chat for the first half of the time, then retrieval with fresh keys for as long again
  (``aiokv.replay.mix_trace``; ``synthetic:shape=mix,seed=1``): does a policy follow the shift?

The default sweep's nine capacities per workload, llama3-8b (128 KiB per token); block hit ratio in
percent. The replay is deterministic: one run gives the figures. Run:
``python benchmarks/bench_policies.py [--workloads agentic,chat] [--policies lru,arc,session,adaptive]``.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path

from _common import write_result

from aiokv.replay import CostModel, TierConfig, Trace, load_trace, replay, synthetic_trace
from aiokv.replay._sim import auto_capacities

KV = 131072
COST = CostModel(prefill_tokens_per_s=24_725.0)
TOLERANCE = 0.3  # points behind the better of lru and arc
SYNTHETIC = {  # the `synthetic:` shapes, as `aiokv replay synthetic:shape=...` makes them
    "agentic": {"shape": "agentic", "sessions": 40, "seed": 1, "block_tokens": 64},
    "chat": {"seed": 1},
    "retrieval": {"shape": "retrieval", "questions": 4000, "docs": 12, "seed": 1},
    "mix": {"shape": "mix", "seed": 1},
}


def workload(name: str) -> Trace | None:
    if name in ("conversation", "mooncake-synthetic"):
        env = os.environ.get("AIOKV_TRACE_DIR")
        file = "conversation_trace.jsonl" if name == "conversation" else "synthetic_trace.jsonl"
        if not env or not (Path(env) / file).is_file():
            print(f"bench_policies: {name}: set AIOKV_TRACE_DIR to the folder holding {file}; skipped")
            return None
        return load_trace(str(Path(env) / file), block_tokens=512)
    if name in SYNTHETIC:
        return synthetic_trace(**SYNTHETIC[name])
    raise SystemExit(f"bench_policies: unknown workload {name!r}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workloads", default="agentic,chat,retrieval,mix,conversation,mooncake-synthetic")
    ap.add_argument("--policies", default="lru,arc,session,adaptive")
    args = ap.parse_args()
    policies = args.policies.split(",")
    if "lru" not in policies or "arc" not in policies:
        raise SystemExit("bench_policies: --policies must include lru and arc (the baseline)")
    out: dict[str, list[dict[str, float]]] = {}
    worst = math.inf
    for name in args.workloads.split(","):
        trace = workload(name)
        if trace is None:
            continue
        bb = trace.block_tokens * KV
        print(
            f"\n{name}: {len(trace.requests)} requests, {trace.block_refs} block refs, {trace.unique_blocks} unique"
        )
        print("| blocks | " + " | ".join(policies) + " | adaptive - best(lru, arc) |")
        print("|---:|" + "---:|" * (len(policies) + 1))
        rows = []
        for cap in auto_capacities(trace, bb):
            started = time.perf_counter()
            ratio = {
                p: 100
                * replay(
                    trace, [TierConfig("cpu", cap)], policy=p, kv_bytes_per_token=KV, cost=COST
                ).block_hit_ratio
                for p in policies
            }
            gap = ratio.get("adaptive", math.nan) - max(ratio["lru"], ratio["arc"])
            worst = min(worst, gap)
            cells = " | ".join(f"{ratio[p]:.2f}" for p in policies)
            print(
                f"| {cap // bb:,} | {cells} | {gap:+.2f} |  ({time.perf_counter() - started:.0f} s)",
                flush=True,
            )
            rows.append({"blocks": cap // bb, **ratio})
        out[name] = rows
    if "adaptive" in policies and out:
        verdict = "met" if worst >= -TOLERANCE else "MISSED"
        print(
            f"\nTarget: adaptive >= best(lru, arc) - {TOLERANCE} points everywhere: worst {worst:+.2f} ({verdict})"
        )
    write_result("policies", {"workloads": out})
    return 0


if __name__ == "__main__":
    sys.exit(main())
