"""CPU data path: scattered block stores and loads through the real TransferExecutor, against a contiguous
single-threaded copy of the same bytes (``numpy.copyto``) measured in the same run.

Layout: 32 layers x (K, V) = 64 tensors of shape ``(num_blocks, 16, heads, 128)`` fp16, so one block of one
tensor is 16, 32, 64 or 128 KiB (heads = 4, 8, 16, 32) and one CPU slot is 64 such segments (1 to 8 MiB).
Each measurement copies ``--batch-mib`` of blocks (default 512 MiB, well above the 32 MiB L3) with random
engine block ids and random slot ids, submitted the way the offloader does (one submit per 64-block request,
all awaited), i.e. including address planning on the worker thread and completion on the event loop. Every
buffer is filled with non-zero data before timing (untouched pages read as the shared zero page and would
inflate the figures). Figures: GB/s (1e9 B/s), median of ``--reps`` repetitions. The memory bandwidth of a
shared machine drifts, so baseline and aiokv samples alternate and each aiokv sample's ratio is taken against
the mean of the baseline samples just before and after it; the reported ratio is the median of those.
Target: ratio >= 0.85.

Run: ``python benchmarks/bench_copy.py [--quick]``.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import random
import time
from typing import Any

import _common as common
import numpy as np
import torch

from aiokv import KVLayout, TransferExecutor

LAYERS = 32
BLOCK_TOKENS = 16
HEAD_DIM = 128
SEGMENT_KIB = [16, 32, 64, 128]
SUBMIT_BLOCKS = 64  # blocks per submit: one request's prefill of 1024 tokens
TARGET = 0.85


def fill_nonzero(t: torch.Tensor, seed: int) -> None:
    """Touch every page with non-zero, non-constant bytes (a repeated random 1 MiB pattern: cheap to write)."""
    flat = t.view(-1).view(torch.uint8) if t.is_contiguous() else None
    assert flat is not None
    pattern = torch.randint(1, 256, (common.MiB,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
    n = flat.numel()
    full = n // pattern.numel()
    if full:
        flat[: full * pattern.numel()].view(full, -1).copy_(pattern.expand(full, -1))
    rest = n - full * pattern.numel()
    if rest:
        flat[full * pattern.numel() :].copy_(pattern[:rest])


async def run_size(seg_kib: int, batch_bytes: int, reps: int, seed: int) -> dict[str, Any]:
    heads = seg_kib * common.KiB // (BLOCK_TOKENS * HEAD_DIM * 2)
    seg_bytes = BLOCK_TOKENS * heads * HEAD_DIM * 2
    slot_bytes = 2 * LAYERS * seg_bytes
    batch_blocks = max(1, batch_bytes // slot_bytes)
    num_blocks = 2 * batch_blocks  # the batch is a random half of the engine's blocks: scattered
    num_slots = 2 * batch_blocks
    nbytes = batch_blocks * slot_bytes

    common.status(f"  {seg_kib} KiB segments: allocating {2 * num_blocks * slot_bytes / common.GiB:.1f} GiB")
    tensors = [torch.empty(num_blocks, BLOCK_TOKENS, heads, HEAD_DIM, dtype=torch.float16) for _ in range(2 * LAYERS)]
    for i, t in enumerate(tensors):
        fill_nonzero(t, seed + i)
    layout = KVLayout([(tensors[2 * i], tensors[2 * i + 1]) for i in range(LAYERS)], block_size=BLOCK_TOKENS)
    assert layout.slot_bytes == slot_bytes
    host = torch.empty(num_slots * slot_bytes, dtype=torch.uint8)
    fill_nonzero(host, seed + 1000)
    src = np.empty(nbytes, dtype=np.uint8)
    dst = np.empty(nbytes, dtype=np.uint8)
    fill_nonzero(torch.from_numpy(src), seed + 2000)
    fill_nonzero(torch.from_numpy(dst), seed + 3000)

    loop = asyncio.get_running_loop()
    ex = TransferExecutor(layout, host, loop)
    rng = random.Random(seed)

    async def timed(kind: str) -> float:
        blocks = rng.sample(range(num_blocks), batch_blocks)
        slots = rng.sample(range(num_slots), batch_blocks)
        t0 = time.perf_counter()
        futures = []
        for i in range(0, batch_blocks, SUBMIT_BLOCKS):
            b, s = blocks[i : i + SUBMIT_BLOCKS], slots[i : i + SUBMIT_BLOCKS]
            futures.append(ex.submit_store(b, s) if kind == "store" else ex.submit_load(s, b))
        for f in futures:
            await f
        return time.perf_counter() - t0

    def contiguous() -> float:
        t0 = time.perf_counter()
        np.copyto(dst, src)
        return time.perf_counter() - t0

    try:
        # Warm-up: one of each, untimed (first-touch of anything left, thread start-up).
        await timed("store")
        await timed("load")
        contiguous()
        # The machine's memory bandwidth drifts (shared host): measure C S L C S L ... C and compare each
        # aiokv sample with the mean of the contiguous samples right before and after it.
        seq: list[tuple[str, float]] = [("contiguous", contiguous())]
        for _ in range(reps):
            seq.append(("store", await timed("store")))
            seq.append(("load", await timed("load")))
            seq.append(("contiguous", contiguous()))
    finally:
        await ex.aclose()

    samples: dict[str, list[float]] = {"store": [], "load": [], "contiguous": []}
    ratios: dict[str, list[float]] = {"store": [], "load": []}
    last_c = 0
    for i, (kind, secs) in enumerate(seq):
        samples[kind].append(secs)
        if kind == "contiguous":
            last_c = i
            continue
        next_c = next(j for j in range(i + 1, len(seq)) if seq[j][0] == "contiguous")
        baseline = (seq[last_c][1] + seq[next_c][1]) / 2
        ratios[kind].append(baseline / secs)
    gbps = {k: nbytes / common.summarize(v)["median"] / 1e9 for k, v in samples.items()}
    return {
        "segment_kib": seg_kib,
        "heads": heads,
        "slot_bytes": slot_bytes,
        "batch_blocks": batch_blocks,
        "batch_bytes": nbytes,
        "segments_per_measurement": batch_blocks * 2 * LAYERS,
        "seconds": {k: common.summarize(v) for k, v in samples.items()},
        "gbps": gbps,
        "ratio": {k: common.summarize(v)["median"] for k, v in ratios.items()},
        "ratio_samples": ratios,
    }


async def main_async(args: argparse.Namespace) -> list[dict[str, Any]]:
    out = []
    for seg_kib in args.sizes:
        out.append(await run_size(seg_kib, args.batch_mib * common.MiB, args.reps, args.seed))
        gc.collect()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=SEGMENT_KIB, help="KiB per block per tensor")
    parser.add_argument("--batch-mib", type=int, default=512, help="bytes copied per measurement")
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="64 MiB batches, 3 reps (a smoke run)")
    args = parser.parse_args()
    if args.quick:
        args.batch_mib, args.reps = 64, 3
    torch.set_num_threads(1)
    common.status(f"bench_copy: {len(args.sizes)} sizes x {args.reps} reps of {args.batch_mib} MiB")
    results = asyncio.run(main_async(args))
    rows = [
        [
            f"{r['segment_kib']} KiB",
            f"{r['slot_bytes'] / common.MiB:g} MiB",
            r["gbps"]["contiguous"],
            r["gbps"]["store"],
            r["gbps"]["load"],
            r["ratio"]["store"],
            r["ratio"]["load"],
        ]
        for r in results
    ]
    worst = min(min(r["ratio"].values()) for r in results)
    common.print_table(
        f"bench_copy: scattered blocks via TransferExecutor vs contiguous numpy.copyto ({args.batch_mib} MiB, "
        f"median of {args.reps})",
        ["segment", "slot", "contig GB/s", "store GB/s", "load GB/s", "store ratio", "load ratio"],
        rows,
        note=f"target ratio >= {TARGET}; worst {worst:.2f} ({'met' if worst >= TARGET else 'MISSED'})",
    )
    path = common.write_result(
        "copy",
        {
            "config": {
                "layers": LAYERS,
                "tensors": 2 * LAYERS,
                "block_tokens": BLOCK_TOKENS,
                "dtype": "float16",
                "batch_mib": args.batch_mib,
                "reps": args.reps,
                "submit_blocks": SUBMIT_BLOCKS,
                "quick": args.quick,
            },
            "target_ratio": TARGET,
            "worst_ratio": worst,
            "met": worst >= TARGET,
            "sizes": results,
        },
    )
    common.status(f"wrote {path}")


if __name__ == "__main__":
    main()
