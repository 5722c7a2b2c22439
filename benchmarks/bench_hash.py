"""Block hashing: cost per block of the chained sha256 on a request's token list, hashlib against native.

Three configurations hash the same tokens (random ids below 32,000, as in a vocabulary) the way a request
extends its chain, from an offset into its token list:

- ``python``: struct packs each block as little-endian int64 and hashlib chains sha256 over it, from a slice
  of the list (the path taken when the extension is not built); the baseline.
- ``native``: ``aiokv._native._sha`` through ``aiokv._hashing.chain_hashes_from``, reading the list in place,
  with the implementation it picks itself (SHA extensions when the CPU has them).
- ``native-portable``: the same, forced onto the portable C SHA-256 (what CPUs without SHA extensions run).

For block sizes 16 and 256, each call hashes 1 block (a decode step completing a block) or 32 (a prompt's
blocks at once). A sample is the best of three timings of a loop of calls, divided by the blocks hashed; in
each run the configurations are sampled in a fresh random order, and each run's ratio is the python sample
over the configuration's. The median and the range over ``--runs`` runs are printed.

Run: ``python benchmarks/bench_hash.py [--quick] [--runs N]``. Results go to ``benchmarks/results/hash.json``.
"""

from __future__ import annotations

import argparse
import gc
import random
import time
from collections.abc import Callable
from typing import Any

import _common as common

from aiokv import _hashing as hashing

try:
    from aiokv._native import _sha
except ImportError:  # pragma: no cover
    _sha = None

BLOCK_SIZES = [16, 256]
BLOCKS_PER_CALL = [1, 32]
CONFIGS = ["python", "native", "native-portable"]
TARGET_BLOCKS = 20_000  # blocks hashed per timing: a few milliseconds at the baseline's speed


def timed(fn: Callable[[], object], loops: int) -> float:
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(loops):
            fn()
        best = min(best, time.perf_counter() - t0)
    return best


def configurations(
    prev: bytes, tokens: list[int], start: int, bs: int, n: int
) -> dict[str, Callable[[], object]]:
    chain_py, chain_from = hashing._chain_py, hashing.chain_hashes_from
    end = start + n * bs
    configs: dict[str, Callable[[], object]] = {"python": lambda: chain_py(prev, tokens[start:end], bs, n)}
    if _sha is not None and hashing._native_chain is not None:
        configs["native"] = lambda: chain_from(prev, tokens, start, bs, n)
        configs["native-portable"] = configs["native"]
    return configs


def bench(args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(args.seed)
    prev = rng.randbytes(32)
    cases = [(bs, n) for bs in BLOCK_SIZES for n in BLOCKS_PER_CALL]
    samples: dict[tuple[int, int, str], list[float]] = {}
    ratios: dict[tuple[int, int, str], list[float]] = {}
    auto = _sha.impl() if _sha is not None else None
    for run in range(args.runs):
        common.status(f"run {run + 1}/{args.runs}")
        for bs, n in cases:
            # A long token list with the hashed range at an offset, as in a request well into its decode.
            tokens = [rng.randrange(32_000) for _ in range(bs * (n + 8))]
            start = bs * 7
            configs = configurations(prev, tokens, start, bs, n)
            loops = max(1, TARGET_BLOCKS // n // (bs // 16) // args.scale)
            per_block: dict[str, float] = {}
            order = list(configs)
            rng.shuffle(order)
            gc.disable()
            try:
                for name in order:
                    if _sha is not None:
                        _sha._set_impl("portable" if name == "native-portable" else "auto")
                    per_block[name] = timed(configs[name], loops) / (loops * n)
            finally:
                gc.enable()
                if _sha is not None:
                    _sha._set_impl("auto")
            for name, t in per_block.items():
                samples.setdefault((bs, n, name), []).append(t)
                ratios.setdefault((bs, n, name), []).append(per_block["python"] / t)
    rows = []
    for (bs, n, name), ts in sorted(
        samples.items(), key=lambda kv: (kv[0][0], kv[0][1], CONFIGS.index(kv[0][2]))
    ):
        rows.append(
            {
                "block_size": bs,
                "blocks_per_call": n,
                "config": name,
                "us_per_block": {k: v * 1e6 if k != "n" else v for k, v in common.summarize(ts).items()},
                "speedup": common.summarize(ratios[(bs, n, name)]),
            }
        )
    return {"runs": args.runs, "native_impl": auto, "rows": rows}


def show(report: dict[str, Any]) -> None:
    rows = []
    for r in report["rows"]:
        us, sp = r["us_per_block"], r["speedup"]
        rows.append(
            [
                r["block_size"],
                r["blocks_per_call"],
                r["config"],
                us["median"],
                f"{us['min']:.3g}-{us['max']:.3g}",
                sp["median"],
                f"{sp['min']:.3g}-{sp['max']:.3g}",
            ]
        )
    impl = report["native_impl"] or "not built"
    common.print_table(
        f"Chained block hashing, per block ({report['runs']} runs; native picks {impl})",
        ["block", "blocks/call", "config", "us/block", "range", "x python", "range"],
        rows,
        note="x python: each run's python time over the configuration's, same run; median and range over runs",
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=7)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="3 runs, shorter timings")
    args = p.parse_args(argv)
    args.scale = 1
    if args.quick:
        args.runs, args.scale = 3, 4
    report = bench(args)
    show(report)
    common.write_result("hash", report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
