"""Load vs recompute: TTFT on the reference engine with a slow and a fast lower tier, decided and always.

A workload with prefix reuse: ``--docs`` documents of ``--prefix`` tokens, asked about in turn (round robin,
``--rounds`` times) with a fresh suffix of 16 to 48 tokens each time, one request at a time, one output token.
The CPU tier holds about one and a half documents, so each warm request finds its document's prefix only in
the lower tier (a :class:`~aiokv.DiskTier` in a temporary directory, page-cached: fast). Five configurations
serve the same requests in the same run:

- ``recompute``: the engine without an offloader;
- ``fast/decide``, ``fast/always``: offload, the disk tier as is;
- ``slow/decide``, ``slow/always``: offload, the disk tier behind a :class:`~aiokv.testing.FaultyTier` that delays
  every call (lookup, read, write) by ``--slow-factor`` times the recompute run's median prefix prefill, so
  restoring a prefix from it takes several times longer than recomputing it.

``decide`` is the offloader's default ``load_policy``, configured with nothing: the engine reports its
prefill speed and the offloader measures each tier's loads. Each TTFT is ``generate()`` to the first token;
the figures are p50 TTFT of the warm requests (those whose document was seen before) divided by the
recompute configuration's p50 over the same requests. The five configurations are open at once and serve
the requests interleaved (each request on every configuration in turn, in a fresh random order each time), so
that the machine's changing load (other processes) hits them alike. ``--runs`` repeats everything; the median and the spread of the
ratios over the runs are printed. Targets: slow/decide <= 1.05x recompute, fast/decide ~ fast/always.

    python benchmarks/bench_planner.py            # 3 runs
    python benchmarks/bench_planner.py --quick    # 1 run, fewer requests
    python benchmarks/bench_planner.py --plot docs/img/planner_ttft.png

Results go to ``benchmarks/results/planner.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as common

import aiokv
from aiokv.engine import Engine, ModelConfig, PagedKVCache, Transformer
from aiokv.testing import FaultyTier
from aiokv.tiers import BackingTier

RUN_ALL_TIMEOUT_S = 1800  # three full runs take 5-12 min (run_all.py's default limit is 5 min)
CONFIGS = ("recompute", "fast/decide", "fast/always", "slow/decide", "slow/always")


def workload(args: argparse.Namespace, vocab: int, seed: int) -> list[tuple[int, list[int]]]:
    """(document index, prompt) in serving order."""
    rng = random.Random(seed)
    docs = [[rng.randrange(vocab) for _ in range(args.prefix)] for _ in range(args.docs)]
    out = []
    for _ in range(args.rounds):
        for d, doc in enumerate(docs):
            out.append((d, doc + [rng.randrange(vocab) for _ in range(rng.randint(16, 48))]))
    return out


class Setup:
    """One configuration: its engine (and offloader), opened for the whole run."""

    def __init__(self, config: str, engine: Engine, off: aiokv.Offloader | None) -> None:
        self.config = config
        self.engine = engine
        self.off = off
        self.ttfts: list[float] = []
        self.admission: list[float] = []

    async def serve(self, prompt: list[int]) -> None:
        res = await self.engine.generate(prompt, max_tokens=1)
        await self.engine.wait_idle()
        if self.off is not None:
            await self.off.flush()  # the blocks are on the lower tier before the next request
        self.ttfts.append(res.ttft_s)
        self.admission.append(res.admission_s)

    def stats(self) -> dict[str, Any]:
        if self.off is None:
            return {}
        s = self.off.stats()
        return {
            "hits": s.hits,
            "misses": s.misses,
            "staged_blocks": s.staged_blocks,
            "planner_skipped_blocks": s.planner_skipped_blocks,
            "planner_skipped_lookups": s.planner_skipped_lookups,
            "prefill_tokens_per_s": s.prefill_tokens_per_s,
            "explored": s.planner.explored,
            "tiers": [list(t) for t in s.planner.tiers],
        }


async def open_setup(
    stack: contextlib.AsyncExitStack,
    model: Transformer,
    cfg: ModelConfig,
    args: argparse.Namespace,
    config: str,
    delay_s: float,
) -> Setup:
    num_blocks = -(-(args.prefix + 64) // args.block_size) + 8
    cache = PagedKVCache(cfg, num_blocks, block_size=args.block_size)
    if config == "recompute":
        return Setup(config, await stack.enter_async_context(Engine(model, cache)), None)
    tier_kind, policy = config.split("/")
    layout = cache.layout()
    doc_blocks = args.prefix // args.block_size
    tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="aiokv-bench-planner-"))
    disk = aiokv.DiskTier(tmp, capacity_bytes=4 * args.docs * doc_blocks * (layout.slot_bytes + 4096))
    lower: BackingTier = disk
    if tier_kind == "slow":
        lower = FaultyTier(disk, delay_s=delay_s)
    cpu = aiokv.CPUTier(capacity_bytes=(doc_blocks * 3 // 2) * layout.slot_bytes)
    off = await stack.enter_async_context(aiokv.Offloader(layout, tiers=[cpu, lower], load_policy=policy))
    engine = await stack.enter_async_context(Engine(model, cache, offloader=off))
    return Setup(config, engine, off)


async def calibrate(model: Transformer, cfg: ModelConfig, args: argparse.Namespace, seed: int) -> float:
    """Median TTFT of a few fresh prefix-sized prompts on the engine without an offloader."""
    rng = random.Random(seed)
    cache = PagedKVCache(cfg, -(-(args.prefix + 64) // args.block_size) + 8, block_size=args.block_size)
    times = []
    async with Engine(model, cache) as engine:
        for _ in range(5):
            res = await engine.generate(
                [rng.randrange(cfg.vocab_size) for _ in range(args.prefix + 32)], max_tokens=1
            )
            times.append(res.ttft_s)
    return statistics.median(times)


async def one_run(model: Transformer, cfg: ModelConfig, args: argparse.Namespace, run: int) -> dict[str, Any]:
    """Every configuration serves the same requests, interleaved (request i on each configuration in turn,
    in a random order), so that a change in the machine's load hits them all alike."""
    prompts = workload(args, cfg.vocab_size, args.seed + run)
    warm = [i for i in range(len(prompts)) if i >= args.docs]  # the document was seen before
    delay_s = args.slow_factor * await calibrate(model, cfg, args, args.seed + 1000 + run)
    async with contextlib.AsyncExitStack() as stack:
        setups = [await open_setup(stack, model, cfg, args, c, delay_s) for c in CONFIGS]
        # A fresh random order per request: a fixed cyclic order would always run the same configuration
        # right after slow/always's long waits (an idle machine, cold caches), which biases it.
        order = random.Random(args.seed + 2000 + run)
        for i, (_, prompt) in enumerate(prompts):
            if i % 8 == 0:
                common.status(f"run {run + 1}/{args.runs}: request {i + 1}/{len(prompts)}")
            for setup in order.sample(setups, len(setups)):
                await setup.serve(prompt)
        base = setups[0]
        base_p50 = statistics.median(base.ttfts[i] for i in warm)
        out: dict[str, Any] = {
            "recompute_p50_s": base_p50,
            "recompute_ttfts_s": base.ttfts,
            "slow_delay_s": delay_s,
            "configs": {},
        }
        for setup in setups[1:]:
            p50 = statistics.median(setup.ttfts[i] for i in warm)
            out["configs"][setup.config] = {
                "p50_s": p50,
                "ratio": p50 / base_p50,
                # the first request of each document: nothing to restore anywhere, so this is what offloading
                # itself (stores, write-through, a lookup) costs a cold prompt against recompute
                "cold_ratio": statistics.median(setup.ttfts[: args.docs])
                / statistics.median(base.ttfts[: args.docs]),
                "ttfts_s": setup.ttfts,
                "admission_p50_s": statistics.median(setup.admission[i] for i in warm),
                "stats": setup.stats(),
            }
    return out


def plot(report: dict[str, Any], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    configs = list(CONFIGS[1:])
    ratios = [[r["configs"][c]["ratio"] for r in report["runs"]] for c in configs]
    fig, ax = plt.subplots(figsize=(6.4, 3.4))
    for x, values in enumerate(ratios):
        ax.scatter([x] * len(values), values, color="tab:blue", alpha=0.6, zorder=3)
        ax.hlines(statistics.median(values), x - 0.25, x + 0.25, color="tab:red", zorder=4)
    ax.axhline(1.0, color="gray", lw=1, ls="--")
    ax.axhline(1.05, color="gray", lw=0.8, ls=":")
    ax.set_xticks(range(len(configs)), configs)
    ax.set_yscale("log")
    ax.set_ylabel("TTFT p50 / recompute p50")
    ax.set_title(
        f"load vs recompute ({report['prefix']}-token prefixes, {len(report['runs'])} runs; red: median)",
        fontsize=9,
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    cfg = ModelConfig(max_position=args.prefix + 128)
    model = Transformer(cfg)
    runs = [await one_run(model, cfg, args, run) for run in range(args.runs)]
    summary = {}
    for config in CONFIGS[1:]:
        ratios = [r["configs"][config]["ratio"] for r in runs]
        summary[config] = {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}
    return {
        "benchmark": "bench_planner",
        "model": repr(model),
        "prefix": args.prefix,
        "docs": args.docs,
        "rounds": args.rounds,
        "block_size": args.block_size,
        "slow_factor": args.slow_factor,
        "runs": runs,
        "summary": summary,
        "targets": {"slow/decide": "<= 1.05", "fast/decide": "<= 1.25 * fast/always (medians)"},
        "met": summary["slow/decide"]["median"] <= 1.05
        and summary["fast/decide"]["median"] <= 1.25 * summary["fast/always"]["median"],
    }


def show(report: dict[str, Any]) -> None:
    rows = []
    for config in CONFIGS[1:]:
        s = report["summary"][config]
        per_run = " ".join(f"{r['configs'][config]['ratio']:.3f}" for r in report["runs"])
        last = report["runs"][-1]["configs"][config]["stats"]
        rows.append(
            [
                config,
                f"{s['median']:.3f}x",
                f"{s['min']:.3f}-{s['max']:.3f}",
                per_run,
                str(last["staged_blocks"]),
                str(last["planner_skipped_lookups"] + last["planner_skipped_blocks"]),
            ]
        )
    common.print_table(
        f"TTFT p50 vs recompute, {report['prefix']}-token prefixes, {len(report['runs'])} runs",
        ["config", "median", "spread", "per run", "staged (last run)", "skips (last run)"],
        rows,
        note="ratio = p50 TTFT of warm requests / recompute p50 over the same requests (same run); "
        "skips = lookups not made + hit blocks left to recompute",
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prefix", type=int, default=1024, help="tokens of each document (the reused prefix)")
    p.add_argument("--docs", type=int, default=4)
    p.add_argument("--rounds", type=int, default=8, help="times each document is asked about")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--slow-factor", type=float, default=2.0, help="slow tier delay per call / recompute p50")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--plot", metavar="PNG", help="also plot the ratios of every run to PNG")
    p.add_argument("--quick", action="store_true", help="1 run, 4 rounds")
    args = p.parse_args(argv)
    if args.quick:
        args.runs, args.rounds = 1, 4
    report = asyncio.run(bench(args))
    show(report)
    common.write_result("planner", report)
    if args.plot and plot(report, Path(args.plot)):
        print(f"plot: {args.plot}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
