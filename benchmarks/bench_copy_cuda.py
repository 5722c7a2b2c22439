"""GPU copy path: scattered block stores/loads through the CUDA TransferExecutor vs one contiguous pinned copy.

Runs only where CUDA is available (prints a skip line and exits 0 elsewhere, so ``make bench`` stays green on
CPU machines). Layout: 32 layers x K,V tensors of ``(num_blocks, 16, heads, 128)`` fp16 on the GPU, so one
block of one tensor is 16 x heads x 128 x 2 bytes (heads 4/8/16/32 -> 16/32/64/128 KiB); 64 random engine
blocks per submission into random pinned host slots. Baselines in the same run: one contiguous
``cudaMemcpyAsync`` of the same number of bytes device->pinned host (stores) and pinned host->device (loads).

Run: ``python benchmarks/bench_copy_cuda.py [--quick]``.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time
from typing import Any

import _common as common
import torch

from aiokv import CPUTier, KVLayout, Offloader

LAYERS = 32
BLOCK = 16
HEAD_DIM = 128


async def measure(heads: int, batch: int, reps: int) -> dict[str, Any]:
    num_blocks = batch * 4
    kv = [
        torch.randn(num_blocks, BLOCK, heads, HEAD_DIM, device="cuda", dtype=torch.float16)
        for _ in range(2 * LAYERS)
    ]
    layout = KVLayout(kv, block_size=BLOCK)
    nbytes = batch * layout.slot_bytes
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    rng = random.Random(heads)

    def contiguous(d2h: bool) -> float:
        torch.cuda.synchronize()
        t = time.perf_counter()
        (host.copy_(dev, non_blocking=True) if d2h else dev.copy_(host, non_blocking=True))
        torch.cuda.synchronize()
        return time.perf_counter() - t

    async with Offloader(layout, tiers=[CPUTier(capacity_bytes=2 * batch * layout.slot_bytes)]) as off:
        ex = off.executor
        store_s: list[float] = []
        load_s: list[float] = []
        base_d2h: list[float] = []
        base_h2d: list[float] = []
        for _ in range(reps):
            blocks = rng.sample(range(num_blocks), batch)
            slots = rng.sample(range(2 * batch), batch)
            torch.cuda.synchronize()
            t = time.perf_counter()
            await ex.submit_store(blocks, slots)
            store_s.append(time.perf_counter() - t)
            t = time.perf_counter()
            await ex.submit_load(slots, rng.sample(range(num_blocks), batch))
            load_s.append(time.perf_counter() - t)
            base_d2h.append(contiguous(True))
            base_h2d.append(contiguous(False))
    med = statistics.median
    gb = nbytes / 1e9
    return {
        "segment_kib": BLOCK * heads * HEAD_DIM * 2 // 1024,
        "batch_bytes": nbytes,
        "gbps": {
            "store": gb / med(store_s),
            "load": gb / med(load_s),
            "d2h_contiguous": gb / med(base_d2h),
            "h2d_contiguous": gb / med(base_h2d),
        },
        "ratio": {"store": med(base_d2h) / med(store_s), "load": med(base_h2d) / med(load_s)},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_copy_cuda: skipped (no CUDA device)")
        return
    reps = 3 if args.quick else 9
    rows = []
    results = []
    for heads in (4, 8, 16, 32):
        r = asyncio.run(measure(heads, 64, reps))
        results.append(r)
        g, q = r["gbps"], r["ratio"]
        rows.append(
            [
                f"{r['segment_kib']} KiB",
                g["d2h_contiguous"],
                g["store"],
                q["store"],
                g["h2d_contiguous"],
                g["load"],
                q["load"],
            ]
        )
    common.print_table(
        f"bench_copy_cuda: {torch.cuda.get_device_name()} scattered blocks vs contiguous pinned copies (median of {reps})",
        ["segment", "D2H GB/s", "store GB/s", "store ratio", "H2D GB/s", "load GB/s", "load ratio"],
        rows,
    )
    common.write_result(
        "copy_cuda", {"benchmark": "copy_cuda", "machine": common.machine(), "sizes": results}
    )


if __name__ == "__main__":
    main()
