"""Speed of ``aiokv replay``: block references per second through the real BlockIndex and each policy.

Traces, first found wins: paths given on the command line; ``$AIOKV_TRACE_DIR/{conversation,synthetic}_trace.jsonl``
(the Mooncake traces); otherwise the 400-request slices in tests/data (a quick smoke run).

Layouts per trace and policy (lru, arc, session, adaptive, chain-lru), 64 MiB blocks (llama3-8b, 512 tokens):

- ``cpu 200GiB``: one CPU tier of 3,200 blocks, the command of issue 13 (``--tiers cpu=200GiB``);
- ``cpu 1/256``: the smallest point of ``--sweep cpu=auto`` (nearly every store evicts);
- ``cpu 1/8``: one CPU tier at 1/8 of the trace's footprint;
- ``cpu 1/16 + disk 1/2``: a two-tier hierarchy (each reference goes through up to two indexes).

Every figure is the median of ``--repeat`` runs (default 5) with the min..max spread; the runs of all layouts
and policies are interleaved, so a slow patch of a shared machine spreads over all of them. Each replay starts
from a trace whose keys are not interned yet, so its figure includes interning them (a sweep interns once).
Baselines, in the same run: a bare ``OrderedDict`` LRU over the same keys and capacity (lookup the leading
run, then insert with eviction; the cost of the bookkeeping alone) for the single-tier layouts; the Python
replay loop over the Python policies (``AIOKV_NATIVE_REPLAY=0``: what ran before the C replay; one run per
figure in the first repeat, as it takes seconds), and, when ``--vllm DIR`` (or
``$AIOKV_VLLM_DIR``) names an unpacked vLLM wheel (the folder holding ``vllm/``), vLLM's own
``CPUOffloadingManager`` (``vllm/v1/kv_offload/cpu/manager.py``, policies lru and arc) driven the way its
scheduler drives it: per request ``on_new_request``, ``lookup`` per block until a miss, ``prepare_load`` and
``complete_load`` of the hits, ``prepare_store`` and ``complete_store`` of the rest, ``on_request_finished``.
It is imported straight from the wheel's files with vLLM's package ``__init__`` modules and three leaf modules
that the manager needs only for typing, logging and metrics replaced by stubs (no CUDA, no engine), and
nothing of vLLM is copied here. Get the wheel with ``pip download vllm==0.33.0 --no-deps`` and unzip it.

Run: ``python benchmarks/bench_replay.py [TRACE ...] [--repeat N] [--quick] [--vllm DIR]``.
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import statistics
import sys
import time
import types
from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from _common import ROOT, print_table, status, write_result

from aiokv.replay import CostModel, TierConfig, Trace, _sim, load_trace, replay

POLICIES = ["lru", "arc", "session", "adaptive", "chain-lru"]
VLLM_POLICIES = ["lru", "arc"]
KV = 131072  # llama3-8b: 64 MiB per 512-token block
BLOCK_BYTES = 512 * KV
COST = CostModel(prefill_tokens_per_s=24_725.0)
TARGET = 1_000_000  # issue 13: lru on the conversation trace at cpu=200GiB; issue 25: arc, session, adaptive


def replay_fresh(trace: Trace, tiers: list[TierConfig], policy: str, python: bool = False) -> Any:
    """One replay as a lone ``aiokv replay`` runs it: keys not interned yet. ``python``: the Python loop."""
    _sim._INTERNED.pop(trace, None)
    saved = _sim._native_replay
    if python:
        _sim._native_replay = None  # type: ignore[assignment]
    try:
        return replay(trace, tiers, policy=policy, kv_bytes_per_token=KV, cost=COST)
    finally:
        _sim._native_replay = saved


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


def layouts(trace: Trace) -> dict[str, list[TierConfig]]:
    footprint = trace.unique_blocks * BLOCK_BYTES
    return {
        "cpu 200GiB": [TierConfig("cpu", 200 << 30)],
        "cpu 1/256": [TierConfig("cpu", max(BLOCK_BYTES, (trace.unique_blocks >> 8) * BLOCK_BYTES))],
        "cpu 1/8": [TierConfig("cpu", footprint // 8)],
        "cpu 1/16 + disk 1/2": [TierConfig("cpu", footprint // 16), TierConfig("disk", footprint // 2)],
    }


def slots_of(trace: Trace, tier: TierConfig) -> int:
    """Blocks the tier holds, as replay() sizes it."""
    assert tier.capacity_bytes is not None
    return min(tier.capacity_bytes // BLOCK_BYTES, max(trace.unique_blocks, 1))


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


# ------------------------------------------------------------------------------------------ vLLM baseline
def load_vllm(root: Path) -> tuple[Any, Any]:
    """``(CPUOffloadingManager, vllm.v1.kv_offload.base)`` from an unpacked vLLM wheel, without running vLLM's
    package ``__init__`` modules (they import the engine). Stubs: ``vllm.logger`` (logging), ``vllm.v1.kv_hints``
    (a type name only; the real module needs msgspec) and the offloading connector's metrics module (used only
    by ``get_stats``)."""
    if not (root / "vllm" / "v1" / "kv_offload" / "cpu" / "manager.py").is_file():
        raise FileNotFoundError(f"{root} holds no vllm/v1/kv_offload/cpu/manager.py (unzip the wheel there)")
    packages = [
        "vllm",
        "vllm.v1",
        "vllm.utils",
        "vllm.v1.metrics",
        "vllm.v1.kv_offload",
        "vllm.v1.kv_offload.cpu",
        "vllm.v1.kv_offload.cpu.policies",
        "vllm.distributed",
        "vllm.distributed.kv_transfer",
        "vllm.distributed.kv_transfer.kv_connector",
        "vllm.distributed.kv_transfer.kv_connector.v1",
        "vllm.distributed.kv_transfer.kv_connector.v1.offloading",
    ]
    for name in packages:
        mod = types.ModuleType(name)
        mod.__path__ = [str(root.joinpath(*name.split(".")))]
        sys.modules.setdefault(name, mod)

    def stub(name: str, **attrs: Any) -> None:
        mod = types.ModuleType(name)
        mod.__dict__.update(attrs)
        sys.modules.setdefault(name, mod)

    stub("vllm.logger", init_logger=logging.getLogger)
    stub("vllm.v1.kv_hints", KvHintsEnvelope=type("KvHintsEnvelope", (), {}))
    stub(
        "vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics",
        OffloadingConnectorStats=type("OffloadingConnectorStats", (), {}),
    )
    from vllm.v1.kv_offload import base  # type: ignore[import-not-found]
    from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager  # type: ignore[import-not-found]

    return CPUOffloadingManager, base


def vllm_runner(root: Path, trace: Trace) -> Callable[[str, int], tuple[float, float]]:
    """A function ``(policy, slots) -> (seconds, block hit ratio)`` replaying ``trace`` through vLLM's manager
    with the same rules as ``aiokv replay`` (lookup then store, before the next request)."""
    manager_cls, base = load_vllm(root)
    hit = base.LookupResult.HIT
    bt = trace.block_tokens
    requests = [[base.make_offload_key(key, 0) for key in r.keys] for r in trace.requests]

    def run(policy: str, slots: int) -> tuple[float, float]:
        manager = manager_cls(num_chunks=slots, cache_policy=policy)
        hits = 0
        gc_was_enabled = gc.isenabled()
        gc.disable()  # as replay() does
        try:
            started = time.perf_counter()
            for i, keys in enumerate(requests):
                ctx = base.ReqContext(req_id=str(i))
                manager.on_new_request(ctx)
                for j, key in enumerate(keys):  # the scheduler records each key's end token
                    ctx.set_offload_key_position(key, (j + 1) * bt)
                n = 0
                for key in keys:
                    if manager.lookup(key, ctx) is not hit:
                        break
                    n += 1
                if n:
                    manager.prepare_load(keys[:n], ctx)
                    manager.complete_load(keys[:n], ctx)
                    hits += n
                if n < len(keys):
                    out = manager.prepare_store(keys[n:], ctx)
                    if out is not None and out.keys_to_store:
                        manager.complete_store(out.keys_to_store, ctx)
                manager.on_request_finished(ctx)
            elapsed = time.perf_counter() - started
        finally:
            if gc_was_enabled:
                gc.enable()
        return elapsed, hits / trace.block_refs if trace.block_refs else 0.0

    return run


# ------------------------------------------------------------------------------------------------- main
def label(path: Path) -> str:
    """A short name for the tables: conversation, synthetic, conversation_head400, ..."""
    return path.name.removesuffix(".jsonl").removesuffix("_trace").removeprefix("mooncake_")


def mega(v: float) -> str:
    return f"{v / 1e6:.2f}M"


def spread(samples: Sequence[float]) -> str:
    return f"{min(samples) / 1e6:.2f}-{max(samples) / 1e6:.2f}M"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("traces", nargs="*", help="JSONL traces (default: see above)")
    parser.add_argument("--repeat", type=int, default=5, help="runs per figure (default 5; at least 3)")
    parser.add_argument("--quick", action="store_true", help="3 runs per figure")
    parser.add_argument(
        "--vllm",
        type=Path,
        default=os.environ.get("AIOKV_VLLM_DIR") or None,
        help="an unpacked vLLM wheel: also replay through its CPUOffloadingManager (default: $AIOKV_VLLM_DIR)",
    )
    args = parser.parse_args()
    repeat = 3 if args.quick else max(3, args.repeat)

    rows: list[list[object]] = []
    vllm_rows: list[list[object]] = []
    records: list[dict[str, Any]] = []
    vllm_error: str | None = None
    headline: float | None = None
    for path in find_traces(args.traces):
        if not path.is_file():
            status(f"skipping {path}: not found")
            continue
        t0 = time.perf_counter()
        trace = load_trace(path)
        load_s = time.perf_counter() - t0
        status(f"{path.name}: {trace.block_refs:,} block refs, loaded in {load_s:.2f} s")
        lays = layouts(trace)
        vllm_run = None
        if args.vllm is not None and vllm_error is None:
            try:
                vllm_run = vllm_runner(Path(args.vllm), trace)
            except Exception as exc:  # a missing or different wheel: report it, keep the aiokv figures
                vllm_error = f"{type(exc).__name__}: {exc}"
                status(f"vLLM baseline skipped: {vllm_error}")
        # name -> samples (refs/s), interleaved over repeats
        speed: dict[tuple[str, str], list[float]] = {}
        hits: dict[tuple[str, str], float] = {}
        bare: dict[str, list[float]] = {}
        vspeed: dict[tuple[str, str], list[float]] = {}
        vhits: dict[tuple[str, str], float] = {}
        pyspeed: dict[tuple[str, str], float] = {}
        for rep in range(repeat):
            status(f"  run {rep + 1}/{repeat}")
            for layout, tiers in lays.items():
                single = len(tiers) == 1
                if single:
                    bare.setdefault(layout, []).append(
                        trace.block_refs / bare_lru(trace, slots_of(trace, tiers[0]))
                    )
                for policy in POLICIES:
                    r = replay_fresh(trace, tiers, policy)
                    speed.setdefault((layout, policy), []).append(r.refs_per_s)
                    hits[layout, policy] = r.block_hit_ratio
                    if rep == 0 and _sim._native_replay is not None:
                        py = replay_fresh(trace, tiers, policy, python=True)
                        pyspeed[layout, policy] = py.refs_per_s
                        if (py.hit_blocks, py.hit_tokens) != (
                            r.hit_blocks,
                            r.hit_tokens,
                        ):  # C must be the Python replay
                            raise SystemExit(f"{layout} {policy}: C and Python replays differ")
                    if single and vllm_run is not None and policy in VLLM_POLICIES:
                        seconds, ratio = vllm_run(policy, slots_of(trace, tiers[0]))
                        vspeed.setdefault((layout, policy), []).append(trace.block_refs / max(seconds, 1e-9))
                        vhits[layout, policy] = ratio
        for layout, tiers in lays.items():
            for policy in POLICIES:
                v = speed[layout, policy]
                med = statistics.median(v)
                base = bare.get(layout)
                ratio = med / statistics.median(base) if base else None
                rows.append(
                    [
                        label(path),
                        layout,
                        policy,
                        mega(med),
                        spread(v),
                        "-" if ratio is None else round(ratio, 2),
                        mega(pyspeed[layout, policy]) if (layout, policy) in pyspeed else "-",
                        f"{med / pyspeed[layout, policy]:.0f}x" if (layout, policy) in pyspeed else "-",
                        f"{100 * hits[layout, policy]:.2f}%",
                    ]
                )
                record: dict[str, Any] = {
                    "trace": path.name,
                    "block_refs": trace.block_refs,
                    "layout": layout,
                    "slots": [slots_of(trace, t) for t in tiers],
                    "policy": policy,
                    "refs_per_s": med,
                    "refs_per_s_samples": v,
                    "bare_lru_refs_per_s": statistics.median(base) if base else None,
                    "speed_vs_bare_lru": ratio,
                    "python_loop_refs_per_s": pyspeed.get((layout, policy)),
                    "speed_vs_python_loop": med / pyspeed[layout, policy]
                    if (layout, policy) in pyspeed
                    else None,
                    "block_hit_ratio": hits[layout, policy],
                    "load_s": load_s,
                }
                if (layout, policy) in vspeed:
                    vv = vspeed[layout, policy]
                    record["vllm_refs_per_s"] = statistics.median(vv)
                    record["vllm_refs_per_s_samples"] = vv
                    record["vllm_block_hit_ratio"] = vhits[layout, policy]
                    record["speed_vs_vllm"] = med / statistics.median(vv)
                    vllm_rows.append(
                        [
                            label(path),
                            layout,
                            policy,
                            mega(med),
                            mega(statistics.median(vv)),
                            spread(vv),
                            f"{med / statistics.median(vv):.1f}x",
                            f"{100 * hits[layout, policy]:.2f} / {100 * vhits[layout, policy]:.2f}%",
                        ]
                    )
                records.append(record)
                if path.name == "conversation_trace.jsonl" and layout == "cpu 200GiB" and policy == "lru":
                    headline = med
    print_table(
        f"aiokv replay: block references per second through BlockIndex (median of {repeat} runs)",
        [
            "trace",
            "tiers",
            "policy",
            "refs/s",
            "min-max",
            "vs bare LRU",
            "Python loop",
            "vs Python",
            "block hits",
        ],
        rows,
        note="vs bare LRU: the replay's speed over a plain OrderedDict LRU loop on the same trace and capacity "
        "(single tier only; 1.0 = no overhead); Python loop: the same replay with AIOKV_NATIVE_REPLAY=0 "
        "(one run)",
    )
    if vllm_rows:
        print_table(
            f"the same replay through vLLM's CPUOffloadingManager (median of {repeat} runs)",
            [
                "trace",
                "tiers",
                "policy",
                "aiokv refs/s",
                "vLLM refs/s",
                "vLLM min-max",
                "aiokv/vLLM",
                "hits aiokv / vLLM",
            ],
            vllm_rows,
            note="vLLM's policies are its own (its LRU orders a request's blocks like aiokv's; its ARC differs), "
            "so hit ratios may differ; the speed ratio compares the bookkeeping per block reference",
        )
    elif args.vllm is not None:
        status(f"no vLLM figures: {vllm_error or 'no single-tier layout'}")
    ratios = [r["speed_vs_bare_lru"] for r in records if isinstance(r["speed_vs_bare_lru"], float)]
    summary: dict[str, Any] = {
        "worst_ratio": min(ratios) if ratios else None,
        "repeat": repeat,
        "target_refs_per_s": TARGET,
        "lru_conversation_200GiB_refs_per_s": headline,
        "runs": records,
        "vllm": str(args.vllm) if args.vllm is not None else None,
        "vllm_error": vllm_error,
    }
    conv = [
        r["refs_per_s"]
        for r in records
        if r["trace"] == "conversation_trace.jsonl" and r["policy"] in ("arc", "session", "adaptive")
    ]
    if conv:
        summary["issue25_min_refs_per_s"] = min(conv)
        summary["issue25_met"] = min(conv) >= TARGET
        status(f"arc, session, adaptive, conversation trace, every layout: >= {min(conv):,.0f} refs/s")
    if headline is not None:
        summary["met"] = headline >= TARGET
        status(f"lru, conversation trace, cpu 200GiB: {headline:,.0f} refs/s (target {TARGET:,})")
    out = write_result("replay", summary)
    status(f"wrote {out}")


if __name__ == "__main__":
    main()
