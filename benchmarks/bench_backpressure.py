"""Load latency under a store flood to a slow lower tier, against idle, in the same run.

A cached prefix lives in a DiskTier (not in the CPU tier): each measured load is ``open`` + ``lookup`` (which
stages the prefix from the disk tier into the CPU tier) + ``load`` into engine blocks, then the prefix is
dropped from the CPU tier again. Measured idle, then while a background "engine" floods the offloader with
stores of new prefixes that are written through to the same disk tier, whose writes are throttled to
``--disk-mbps`` (a slow device: the I/O thread sleeps for the bytes' time at that rate, the GIL released).

Two configurations, each measured idle and flooded in the same process:

- ``priority``: aiokv as shipped: the disk tier's reads run in a lane ahead of its writes (one I/O thread
  that writes never take), and the write-through sheds what the tier cannot drain within
  ``write_through_max_delay_s``.
- ``fifo`` (the before-state): one FIFO queue for the disk tier's reads and writes (a plain
  ``ThreadPoolExecutor``, as before the read lane) and no delay limit (only ``write_through_max_bytes``).

Prints p50/p95 of each phase and the flooded/idle ratio of the p50 and p95 (target: <= 1.5x with priority),
per run and as median and min-max over ``--runs`` runs. Run: ``python benchmarks/bench_backpressure.py``
(``--quick``: fewer samples and runs).
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import contextlib

import _common as common

import aiokv
from aiokv.tiers.disk import _files as disk_files

BLOCK_SIZE = 16
PREFIX_BLOCKS = 8


class _FifoPool(concurrent.futures.ThreadPoolExecutor):
    """The before-state: reads and writes share one FIFO queue (what the disk tier used before LanePool)."""

    def __init__(self, threads: int) -> None:
        super().__init__(max_workers=threads, thread_name_prefix="bench-fifo")
        self.write_threads = threads
        self.reads_ahead_of_writes = 0

    def submit_write(self, fn: Any, /, *args: Any) -> concurrent.futures.Future[Any]:
        return self.submit(fn, *args)


def _throttle_disk_writes(mbps: float) -> None:
    """Every entry the disk tier writes costs its bytes' time at ``mbps`` on the I/O thread (a slow device)."""
    real = disk_files._Files.write

    def slow_write(self: Any, slots: Any, keys: Any, payloads: Any, *rest: Any) -> Any:
        nbytes = sum(len(p) for p in payloads)
        time.sleep(nbytes / (mbps * 1e6))
        return real(self, slots, keys, payloads, *rest)

    disk_files._Files.write = slow_write  # type: ignore[method-assign]


def _layout(num_blocks: int) -> aiokv.KVLayout:
    tensors = [torch.zeros(num_blocks, BLOCK_SIZE, 8, 2048, dtype=torch.float16) for _ in range(2)]
    return aiokv.KVLayout(tensors, block_size=BLOCK_SIZE)  # 1 MiB per block


def _tokens(rng: random.Random, blocks: int) -> list[int]:
    return [rng.randrange(1, 50_000) for _ in range(blocks * BLOCK_SIZE + 1)]


async def _serve(off: aiokv.Offloader, rid: str, tokens: list[int], blocks: list[int]) -> None:
    """Prefill ``tokens`` into ``blocks`` (nothing cached), sample one token, finish: the blocks are stored."""
    req = off.open(rid, tokens)
    await req.lookup()
    req.step(len(tokens), new_token_ids=[1], new_block_ids=blocks[: -(-len(tokens) // BLOCK_SIZE)])
    await req.finish()


async def _measure_one(
    off: aiokv.Offloader, rid: str, tokens: list[int], dst: list[int], lookups: list[float]
) -> float:
    t0 = time.perf_counter()
    req = off.open(rid, tokens)
    hit = await req.lookup()
    lookups.append(time.perf_counter() - t0)
    await req.load(dst[: hit // BLOCK_SIZE])
    dt = time.perf_counter() - t0
    if hit != PREFIX_BLOCKS * BLOCK_SIZE:
        raise RuntimeError(f"the prefix was not found in the disk tier (hit {hit} tokens)")
    await req.abort()
    index = off.cpu.index
    for key in aiokv.block_hashes(tokens, BLOCK_SIZE, root=off.layout.root)[:PREFIX_BLOCKS]:
        index.discard(key)  # next time it is staged from the disk tier again
    return dt


async def _flood(off: aiokv.Offloader, blocks: list[int], stop: asyncio.Event, interval_s: float) -> int:
    """Store a new prefix of len(blocks) blocks every ``interval_s`` until ``stop``; returns blocks stored."""
    rng = random.Random(7)
    n = 0
    while not stop.is_set():
        await _serve(off, f"flood-{n}", _tokens(rng, len(blocks) - 1), blocks)
        n += 1
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stop.wait(), interval_s)
    return n * len(blocks)


def _pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))]


async def _run(mode: str, args: argparse.Namespace, path: Path) -> dict[str, Any]:
    layout = _layout(64)
    slot = layout.slot_bytes
    disk = aiokv.DiskTier(path, 1024 * (slot + 8192), io_threads=args.io_threads, preallocate=False)
    kw: dict[str, Any] = {"write_through_max_delay_s": args.max_delay if mode == "priority" else None}
    off = aiokv.Offloader(layout, tiers=[aiokv.CPUTier(capacity_bytes=384 * slot), disk], **kw)
    rng = random.Random(1)
    prefixes = [_tokens(rng, PREFIX_BLOCKS) for _ in range(8)]
    dst = list(range(PREFIX_BLOCKS))
    # The before-state's flooded loads take ~0.4 s each: fewer of them keep the run short.
    samples = args.samples if mode == "priority" else min(args.samples, args.fifo_samples)
    async with off:
        if mode == "fifo":
            assert disk._pool is not None
            disk._pool.shutdown(wait=True)
            disk._pool = _FifoPool(args.io_threads)  # type: ignore[assignment]
        for i, p in enumerate(prefixes):  # published in the disk tier (throttled writes: done before timing)
            await _serve(off, f"publish-{i}", p, list(range(16, 17 + PREFIX_BLOCKS)))
            await off.flush()
        if off.stats().write_through_dropped:
            raise RuntimeError("publishing the prefixes dropped blocks")
        idle_lookups: list[float] = []
        flood_lookups: list[float] = []
        idle = []
        for i in range(args.samples):
            idle.append(await _measure_one(off, f"idle-{i}", prefixes[i % len(prefixes)], dst, idle_lookups))
            await asyncio.sleep(args.gap)
        stop = asyncio.Event()
        flood = asyncio.create_task(_flood(off, list(range(32, 33 + args.flood_blocks)), stop, args.interval))
        await asyncio.sleep(args.warmup)  # the write-through backlog builds up
        flooded = []
        for i in range(samples):
            flooded.append(
                await _measure_one(off, f"flood-load-{i}", prefixes[i % len(prefixes)], dst, flood_lookups)
            )
            await asyncio.sleep(args.gap)
        stop.set()
        stored = await flood
        s = off.stats()
        dstats = disk.stats()
    return {
        "mode": mode,
        "idle_p50_ms": statistics.median(idle) * 1e3,
        "idle_p95_ms": _pct(idle, 0.95) * 1e3,
        "flood_p50_ms": statistics.median(flooded) * 1e3,
        "flood_p95_ms": _pct(flooded, 0.95) * 1e3,
        "idle_lookup_p50_ms": statistics.median(idle_lookups) * 1e3,
        "flood_lookup_p50_ms": statistics.median(flood_lookups) * 1e3,
        "ratio_p50": statistics.median(flooded) / statistics.median(idle),
        "ratio_p95": _pct(flooded, 0.95) / _pct(idle, 0.95),
        "flood_blocks_stored": stored,
        "write_through_blocks": s.write_through_blocks,
        "write_through_dropped": s.write_through_dropped,
        "write_through_dropped_slow": s.write_through_dropped_slow,
        "reads_ahead_of_writes": dstats.reads_ahead_of_writes,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer samples and runs")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--samples", type=int, default=40, help="loads measured per phase")
    parser.add_argument("--fifo-samples", type=int, default=20, help="at most this many flooded loads (fifo)")
    parser.add_argument("--disk-mbps", type=float, default=40.0, help="throttled disk write rate (MB/s)")
    parser.add_argument("--io-threads", type=int, default=2)
    parser.add_argument("--flood-blocks", type=int, default=8, help="blocks per flood request")
    parser.add_argument("--interval", type=float, default=0.05, help="seconds between flood requests")
    parser.add_argument("--warmup", type=float, default=2.0, help="seconds of flood before measuring")
    parser.add_argument("--gap", type=float, default=0.02, help="seconds between measured loads")
    parser.add_argument("--max-delay", type=float, default=1.0, help="write_through_max_delay_s (priority)")
    parser.add_argument("--modes", default="priority,fifo")
    args = parser.parse_args()
    if args.quick:
        args.runs, args.samples = 3, 20
    _throttle_disk_writes(args.disk_mbps)
    modes = [m for m in args.modes.split(",") if m]
    runs: list[dict[str, Any]] = []
    for r in range(args.runs):
        for mode in modes:
            with tempfile.TemporaryDirectory(prefix="aiokv-bench-bp-") as tmp:
                res = asyncio.run(_run(mode, args, Path(tmp)))
            res["run"] = r
            runs.append(res)
            print(
                f"run {r} {mode:8s} idle p50 {res['idle_p50_ms']:7.2f} ms p95 {res['idle_p95_ms']:7.2f} ms | "
                f"flood p50 {res['flood_p50_ms']:7.2f} ms p95 {res['flood_p95_ms']:7.2f} ms | "
                f"ratio p50 {res['ratio_p50']:5.2f}x p95 {res['ratio_p95']:5.2f}x | lookup (staging) p50 idle "
                f"{res['idle_lookup_p50_ms']:.2f} flood {res['flood_lookup_p50_ms']:.2f} ms | "
                f"wt written {res['write_through_blocks']} dropped {res['write_through_dropped']} "
                f"(slow {res['write_through_dropped_slow']}) reads ahead {res['reads_ahead_of_writes']}",
                flush=True,
            )
    rows = []
    summary: dict[str, Any] = {}
    for mode in modes:
        mine = [x for x in runs if x["mode"] == mode]
        p50 = [x["ratio_p50"] for x in mine]
        p95 = [x["ratio_p95"] for x in mine]
        summary[mode] = {
            "ratio_p50_median": statistics.median(p50),
            "ratio_p50_min": min(p50),
            "ratio_p50_max": max(p50),
            "ratio_p95_median": statistics.median(p95),
            "ratio_p95_min": min(p95),
            "ratio_p95_max": max(p95),
            "runs_within_1_5x_p50": sum(v <= 1.5 for v in p50),
        }
        rows.append(
            [
                mode,
                f"{statistics.median(p50):.2f}x ({min(p50):.2f}-{max(p50):.2f})",
                f"{statistics.median(p95):.2f}x ({min(p95):.2f}-{max(p95):.2f})",
                f"{summary[mode]['runs_within_1_5x_p50']}/{len(mine)}",
            ]
        )
    common.print_table(
        f"load latency flooded / idle ({args.runs} runs, {args.samples} loads per phase (fifo flooded: "
        f"{min(args.samples, args.fifo_samples)}), disk writes at "
        f"{args.disk_mbps:g} MB/s)",
        ["mode", "p50 ratio median (min-max)", "p95 ratio median (min-max)", "runs p50 <= 1.5x"],
        rows,
        note="target: priority <= 1.5x; fifo is the before-state (one queue for disk reads and writes, no "
        "delay limit on the write-through)",
    )
    head: dict[str, Any] = {}
    if "priority" in summary:  # run_all's summary line: the worst run, and whether the median met the target
        head = {
            "worst_ratio": summary["priority"]["ratio_p50_max"],
            "met": summary["priority"]["ratio_p50_median"] <= 1.5,
        }
    path = common.write_result("backpressure", {**head, "args": vars(args), "runs": runs, "summary": summary})
    print(f"wrote {path.relative_to(common.ROOT)}")


if __name__ == "__main__":
    main()
