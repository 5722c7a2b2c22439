"""Multi-turn chat on the aiokv reference engine: recompute vs offload, side by side.

N concurrent sessions share a system prompt; every turn sends the whole conversation so far plus a new user
message. The workload runs twice on the same model and the same (deliberately small) engine block pool:
once recomputing every prompt, once with aiokv offloading full KV blocks to a CPU tier and restoring cached
prefixes. Then it prints TTFT, throughput, hit rate and transfer figures, and whether the two runs generated
exactly the same tokens.

    python examples/chat_demo.py                       # defaults: < 2 minutes on 2 CPU cores
    python examples/chat_demo.py --sessions 16 --turns 6 --system-tokens 1024
    python examples/chat_demo.py --model tiny --sessions 2 --turns 2   # a few seconds (the tests run this)
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

import aiokv
from aiokv.engine import Engine, EngineStats, GenerationResult, ModelConfig, PagedKVCache, Transformer

MODELS = {
    "default": ModelConfig(),
    "tiny": ModelConfig(
        num_layers=2,
        hidden_size=64,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        intermediate_size=128,
        vocab_size=256,
        max_position=8192,
    ),
}


@dataclass
class RunResult:
    name: str
    wall_s: float
    results: dict[str, GenerationResult]
    engine: EngineStats
    offload: aiokv.OffloaderStats | None


def _percentile(values: list[float], q: float) -> float:
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[round(q) - 1]


async def run_workload(
    name: str, model: Transformer, args: argparse.Namespace, progress: Progress, offload: bool
) -> RunResult:
    cache = PagedKVCache(model.config, args.num_blocks, block_size=args.block_size)
    vocab = model.config.vocab_size
    system = [random.Random(args.seed).randrange(vocab) for _ in range(args.system_tokens)]
    task = progress.add_task(name, total=args.sessions * args.turns)
    results: dict[str, GenerationResult] = {}

    async def session(engine: Engine, i: int) -> None:
        rng = random.Random(args.seed * 1000 + i)
        ctx = list(system)
        for turn in range(args.turns):
            ctx += [rng.randrange(vocab) for _ in range(rng.randint(args.user_tokens // 2, args.user_tokens))]
            res = await engine.generate(
                ctx,
                max_tokens=args.max_tokens,
                temperature=args.temperature,
                seed=args.seed * 7919 + i * 31 + turn,
                request_id=f"s{i}-t{turn}",
            )
            results[res.request_id] = res
            ctx += res.output_token_ids
            progress.advance(task)

    async def drive(engine: Engine) -> tuple[float, EngineStats]:
        t0 = time.perf_counter()
        await asyncio.gather(*(session(engine, i) for i in range(args.sessions)))
        wall = time.perf_counter() - t0
        await engine.wait_idle()
        return wall, engine.stats()

    engine_kwargs: dict[str, Any] = dict(
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens
    )
    if not offload:
        async with Engine(model, cache, **engine_kwargs) as engine:
            wall, stats = await drive(engine)
        return RunResult(name, wall, results, stats, None)
    tier = aiokv.CPUTier(capacity_bytes=args.cpu_tier_mib << 20)
    async with (
        aiokv.Offloader(cache.layout(), tiers=[tier], eviction="lru") as off,
        Engine(model, cache, offloader=off, **engine_kwargs) as engine,
    ):
        wall, stats = await drive(engine)
        return RunResult(name, wall, results, stats, off.stats())


def report(console: Console, runs: list[RunResult], args: argparse.Namespace) -> bool:
    table = Table(title=f"{args.sessions} sessions x {args.turns} turns, {args.num_blocks}-block engine pool")
    table.add_column("metric")
    for run in runs:
        table.add_column(run.name, justify="right")

    def row(label: str, *cells: str) -> None:
        table.add_row(label, *cells)

    ttfts = [sorted(r.ttft_s for r in run.results.values()) for run in runs]
    row("TTFT p50 (ms)", *(f"{_percentile(t, 50) * 1e3:.1f}" for t in ttfts))
    row("TTFT p95 (ms)", *(f"{_percentile(t, 95) * 1e3:.1f}" for t in ttfts))
    # Where the mean TTFT goes: waiting for blocks, aiokv's lookup + load, then a step and the prefill.
    for label, part in (("  queue", "queued_s"), ("  admission (lookup, load)", "admission_s"),
                        ("  prefill (step wait, compute)", "prefill_s")):  # fmt: skip
        row(
            f"{label} (ms, mean)",
            *(
                f"{sum(getattr(r, part) for r in run.results.values()) / len(run.results) * 1e3:.1f}"
                for run in runs
            ),
        )
    out_tokens = [sum(len(r.output_token_ids) for r in run.results.values()) for run in runs]
    row("output tokens/s", *(f"{n / run.wall_s:.1f}" for n, run in zip(out_tokens, runs, strict=True)))
    row("wall time (s)", *(f"{run.wall_s:.2f}" for run in runs))
    row(
        "prefill tokens computed",
        *(f"{run.engine.prefill_tokens:,} / {run.engine.admitted_tokens:,}" for run in runs),
    )
    row(
        "prefix hit rate (tokens)",
        *(f"{run.engine.cached_tokens / max(1, run.engine.admitted_tokens):.1%}" for run in runs),
    )
    row("preemptions", *(str(run.engine.preemptions) for run in runs))

    def off_cell(run: RunResult, fn: Any) -> str:
        return "-" if run.offload is None else fn(run.offload, run.engine)

    row("bytes stored", *(off_cell(r, lambda o, e: f"{o.bytes_stored / 2**20:.1f} MiB") for r in runs))
    row("bytes loaded", *(off_cell(r, lambda o, e: f"{o.bytes_loaded / 2**20:.1f} MiB") for r in runs))
    row(
        "restore GB/s (per load)",
        *(
            off_cell(r, lambda o, e: f"{o.bytes_loaded / e.load_s / 1e9:.2f}" if e.load_s else "-")
            for r in runs
        ),
    )
    console.print(table)

    base = runs[0].results
    mismatched = [
        rid for rid, res in runs[1].results.items() if res.output_token_ids != base[rid].output_token_ids
    ]
    if mismatched:
        console.print(
            f"[bold red]outputs differ[/] in {len(mismatched)} of {len(base)} requests: {mismatched[:5]}"
        )
        return False
    ttft_ratio = _percentile(ttfts[0], 50) / _percentile(ttfts[1], 50)
    console.print(
        f"[bold green]outputs matched[/]: all {len(base)} requests generated identical tokens "
        f"(TTFT p50 {ttft_ratio:.1f}x lower with offloading)"
    )
    return True


async def main_async(args: argparse.Namespace) -> bool:
    console = Console()
    model = Transformer(MODELS[args.model])
    console.print(f"model: {model!r}; event loop: {type(asyncio.get_running_loop()).__module__}")
    runs = []
    with Progress(
        TextColumn("{task.description:>10}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=False,
    ) as progress:
        runs.append(await run_workload("recompute", model, args, progress, offload=False))
        runs.append(await run_workload("offload", model, args, progress, offload=True))
    return report(console, runs, args)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=sorted(MODELS), default="default")
    p.add_argument("--sessions", type=int, default=8)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--system-tokens", type=int, default=1024)
    p.add_argument("--user-tokens", type=int, default=96, help="max new user tokens per turn (min is half)")
    p.add_argument("--max-tokens", type=int, default=24, help="tokens generated per turn")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--num-blocks", type=int, default=192, help="engine KV blocks (small: forces eviction)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--cpu-tier-mib", type=int, default=1024)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-uvloop", action="store_true", help="use the default asyncio event loop")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    loop_factory = None
    if not args.no_uvloop:
        try:
            import uvloop

            loop_factory = uvloop.new_event_loop
        except ImportError:
            pass
    if loop_factory is None:
        ok = asyncio.run(main_async(args))
    else:
        loop = loop_factory()
        try:
            ok = loop.run_until_complete(main_async(args))
        finally:
            loop.close()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
