"""TTFT of a fresh prompt vs the same prompt restored from aiokv's CPU tier, on the reference engine.

For each prompt length: a fresh prompt is prefilled from scratch (its full blocks are offloaded as they
complete); once its blocks are stored, the same prompt is submitted again and its prefix is restored with
``lookup``/``load``, leaving only the last partial block (at least one token) to compute. Each TTFT is the
time from ``generate()`` to the first sampled token. With ``--baseline`` the fresh prompt is also timed on
the engine without an offloader (to show what offloading costs a cold prompt).

    python benchmarks/bench_ttft.py                           # 1k / 4k / 16k tokens, default model
    python benchmarks/bench_ttft.py --quick                   # 1k / 4k, no baseline (a smoke run)
    python benchmarks/bench_ttft.py --lengths 1024,4096 --json ttft.json

Results go to ``benchmarks/results/ttft.json`` (like every benchmark, see ``run_all.py``) and, with
``--json PATH``, also to PATH.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as common

import aiokv
from aiokv.engine import Engine, ModelConfig, PagedKVCache, Transformer


async def _ttft(engine: Engine, prompt: list[int]) -> tuple[float, Any]:
    res = await engine.generate(prompt, max_tokens=1)
    await engine.wait_idle()  # every block stored and back in the pool before the next measurement
    return res.ttft_s, res


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    lengths = [int(x) for x in args.lengths.split(",")]
    cfg = ModelConfig(max_position=max(lengths) + 64)
    model = Transformer(cfg)
    num_blocks = -(-(max(lengths) + 1) // args.block_size) + 8
    rows: list[dict[str, Any]] = []
    rng = random.Random(args.seed)
    warmup = [rng.randrange(cfg.vocab_size) for _ in range(min(512, max(lengths)))]

    baseline: dict[int, float] = {}
    if args.baseline:
        recompute_cache = PagedKVCache(cfg, num_blocks, block_size=args.block_size)
        async with Engine(model, recompute_cache, torch_threads=args.torch_threads) as engine:
            await _ttft(engine, warmup)
            for n in lengths:
                common.status(f"  {n} tokens: fresh on the engine without an offloader")
                prompt = [rng.randrange(cfg.vocab_size) for _ in range(n)]
                baseline[n], _ = await _ttft(engine, prompt)

    cache = PagedKVCache(cfg, num_blocks, block_size=args.block_size)
    tier = aiokv.CPUTier(capacity_bytes=(2 * max(lengths) * cfg.bytes_per_token) + (64 << 20))
    async with (
        aiokv.Offloader(cache.layout(), tiers=[tier]) as off,
        Engine(model, cache, offloader=off) as engine,
    ):
        await _ttft(engine, warmup)
        await _ttft(engine, warmup)
        for n in lengths:
            common.status(f"  {n} tokens: fresh, then restored x{args.repeat}")
            prompt = [rng.randrange(cfg.vocab_size) for _ in range(n)]
            before = off.stats()
            fresh, fresh_res = await _ttft(engine, prompt)
            mid = off.stats()
            restored = []
            for _ in range(args.repeat):
                t, res = await _ttft(engine, prompt)
                restored.append(t)
            after = off.stats()
            restored_s = min(restored)
            assert fresh_res.cached_tokens == 0
            assert res.output_token_ids == fresh_res.output_token_ids
            rows.append(
                {
                    "prompt_tokens": n,
                    "fresh_ttft_s": fresh,
                    "recompute_ttft_s": baseline.get(n),
                    "restored_ttft_s": restored_s,
                    "speedup": fresh / restored_s,
                    "restored_tokens": res.cached_tokens,
                    "computed_tokens": res.computed_prefill_tokens,
                    "bytes_stored": mid.bytes_stored - before.bytes_stored,
                    "bytes_loaded_per_restore": (after.bytes_loaded - mid.bytes_loaded) // args.repeat,
                    "same_output": True,
                }
            )
    return {
        "benchmark": "bench_ttft",
        "model": repr(model),
        "model_config": {k: str(getattr(cfg, k)) for k in cfg.__slots__},
        "block_size": args.block_size,
        "torch_threads": torch.get_num_threads(),
        "lengths": lengths,
        "repeat": args.repeat,
        "rows": rows,
    }


def _ms(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    return f"{seconds * 1e3:.1f} ms" if seconds < 1 else f"{seconds:.2f} s"


def show(report: dict[str, Any], console: Console) -> None:
    table = Table(title=f"TTFT, fresh vs restored from the CPU tier\n{report['model']}")
    for col in ("tokens", "fresh", "no offload", "restored", "speedup", "restored tok", "loaded"):
        table.add_column(col, justify="right")
    for r in report["rows"]:
        table.add_row(
            f"{r['prompt_tokens']:,}",
            _ms(r["fresh_ttft_s"]),
            _ms(r["recompute_ttft_s"]),
            _ms(r["restored_ttft_s"]),
            f"{r['speedup']:,.0f}x",
            f"{r['restored_tokens']:,}",
            f"{r['bytes_loaded_per_restore'] / 2**20:,.1f} MiB",
        )
    console.print(table)
    console.print(
        "speedup = fresh / restored (best of --repeat); 'no offload' = fresh on an engine without aiokv"
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", default="1024,4096,16384", help="comma-separated prompt lengths in tokens")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--repeat", type=int, default=3, help="restored runs per length (best is reported)")
    p.add_argument("--baseline", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--torch-threads", type=int, default=1, help="intra-op threads (Engine(torch_threads=...))"
    )
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    p.add_argument("--quick", action="store_true", help="1k and 4k tokens, 2 repeats, no baseline")
    args = p.parse_args(argv)
    if args.quick:
        args.lengths, args.repeat, args.baseline = "1024,4096", 2, False
    t0 = time.perf_counter()
    report = asyncio.run(bench(args))
    report["wall_s"] = time.perf_counter() - t0
    console = Console()
    show(report, console)
    console.print(f"total {report['wall_s']:.1f} s; torch threads {report['torch_threads']}")
    path = common.write_result("ttft", report)
    console.print(f"wrote {path}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
