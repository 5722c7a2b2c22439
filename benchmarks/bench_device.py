"""Device data path through the public API: copy bandwidth, loop-thread CPU time per submission and block, and
staging memory, on CUDA (when present) and on the simulated device (always).

Layout: ``--layers`` layers x (K, V) tensors of ``(num_blocks, 16, heads, 128)`` fp16 on the device, so one
block of one tensor is 16, 32, 64 or 128 KiB (heads 4/8/16/32). A measurement moves ``--batch-mib`` through an
:class:`aiokv.Offloader` the way an asynchronously scheduling engine does: requests of 64 blocks ``step()``
(marking the compute stream) and ``finish()``; then the same prefixes are looked up and ``load()``-ed into
random engine blocks. Timed from the first call to the last completion.

Baseline in the same run: one contiguous copy of the same bytes between device memory and pinned host
memory (on CUDA a ``cudaMemcpyAsync`` device->host for stores, host->device for loads). Reported: GB/s and
the ratio aiokv/baseline (median and range over ``--reps``; target >= 0.9 on CUDA at every size), the event
loop thread's CPU time per stored block and per coalesced submission (``time.thread_time``), and the device
memory aiokv allocated (staging + indices, once, at start) against the peak seen during the transfers.

On the simulated device "device memory" is host memory and copies run on worker threads, so its bandwidth
says nothing about a GPU: the sim rows report the control-path costs (loop µs) and the staging bound, which
are the same code on both.

Run: ``python benchmarks/bench_device.py [--device auto|cuda|sim] [--quick]``.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import random
import time
from typing import Any

import _common as common
import torch

from aiokv import CPUTier, KVLayout, Offloader
from aiokv.transfer import SimulatedDevice

BLOCK_TOKENS = 16
HEAD_DIM = 128
REQUEST_BLOCKS = 64
TARGET = 0.9


class Device:
    """The binding under test (CUDA, or the simulated device with ``seed`` and ``jitter_s``), its compute
    stream, and its memory counters. ``tools/gpu_check.py`` builds its rig on this class."""

    def __init__(self, kind: str, *, seed: int = 0, jitter_s: float = 0.0) -> None:
        self.kind = kind
        if kind == "cuda":
            from aiokv.transfer._cuda import CudaDevice

            self.binding: Any = CudaDevice()
            self.compute: Any = torch.cuda.Stream()
            self.torch_device = torch.device("cuda")
        else:
            self.binding = SimulatedDevice(seed=seed, jitter_s=jitter_s)
            self.compute = self.binding.new_stream("compute")
            self.torch_device = torch.device("cpu")

    def synchronize(self) -> None:
        if self.kind == "cuda":
            torch.cuda.synchronize()
        else:
            self.binding.synchronize_all()

    def allocated(self) -> int:
        return torch.cuda.memory_allocated() if self.kind == "cuda" else int(self.binding.allocated_bytes)

    def peak(self) -> int:
        return torch.cuda.max_memory_allocated() if self.kind == "cuda" else int(self.binding.peak_bytes)

    def reset_peak(self) -> None:
        if self.kind == "cuda":
            torch.cuda.reset_peak_memory_stats()
        else:
            self.binding.reset_peak()

    def close(self) -> None:
        if self.kind == "sim":
            self.binding.close()


class Contiguous:
    """One contiguous copy of ``nbytes`` each way between device memory and pinned host memory."""

    def __init__(self, dev: Device, nbytes: int) -> None:
        b = dev.binding
        self._dev = dev
        self.device_buf = b.alloc(nbytes)
        self.host = torch.empty(nbytes, dtype=torch.uint8)
        self.host.fill_(1)
        b.pin(self.host)
        self.stream = b.new_stream("baseline")

    def measure(self) -> tuple[float, float]:
        """Seconds for the device->host and the host->device copy."""
        b = self._dev.binding
        out = []
        for dst, src in ((self.host, self.device_buf), (self.device_buf, self.host)):
            self._dev.synchronize()
            t0 = time.perf_counter()
            b.copy(self.stream, dst, src)
            b.synchronize_stream(self.stream)
            out.append(time.perf_counter() - t0)
        return out[0], out[1]

    def close(self) -> None:
        self._dev.binding.unpin(self.host)


async def run_size(
    dev: Device, seg_kib: int, layers: int, batch_bytes: int, reps: int, staging_bytes: int, seed: int
) -> dict[str, Any]:
    heads = seg_kib * common.KiB // (BLOCK_TOKENS * HEAD_DIM * 2)
    slot_bytes = 2 * layers * BLOCK_TOKENS * heads * HEAD_DIM * 2
    requests = max(1, batch_bytes // (slot_bytes * REQUEST_BLOCKS))
    batch_blocks = requests * REQUEST_BLOCKS
    num_blocks = 2 * batch_blocks
    nbytes = batch_blocks * slot_bytes
    common.status(
        f"  {dev.kind} {seg_kib} KiB: {requests} requests x {REQUEST_BLOCKS} blocks of {slot_bytes >> 10} KiB"
    )
    gen = torch.Generator().manual_seed(seed)
    kv = [
        torch.randn(num_blocks, BLOCK_TOKENS, heads, HEAD_DIM, generator=gen)
        .to(torch.float16)
        .to(dev.torch_device)
        for _ in range(2 * layers)
    ]
    layout = KVLayout(kv, block_size=BLOCK_TOKENS)
    rng = random.Random(seed)
    samples: dict[str, list[float]] = {"store": [], "load": [], "d2h": [], "h2d": []}
    loop_us_block: list[float] = []
    loop_us_submission: list[float] = []
    baseline = Contiguous(dev, nbytes)
    before = dev.allocated()
    async with Offloader(
        layout,
        [CPUTier(capacity_bytes=2 * batch_blocks * slot_bytes)],
        device=dev.binding,
        compute_stream=dev.compute,
        staging_bytes=staging_bytes,
    ) as off:
        held = dev.allocated() - before
        prompt_len = REQUEST_BLOCKS * BLOCK_TOKENS
        dev.reset_peak()
        peak_base = dev.allocated()

        async def store(tag: int) -> list[list[int]]:
            prompts = [[rng.randrange(1 << 30) for _ in range(prompt_len + 1)] for _ in range(requests)]
            reqs = [off.open(f"s{tag}-{i}", p) for i, p in enumerate(prompts)]
            for r in reqs:
                await r.lookup()
            picks = [rng.sample(range(num_blocks), REQUEST_BLOCKS + 1) for _ in reqs]
            batches0 = off.executor.stats().batches
            dev.synchronize()
            cpu0 = time.thread_time()
            t0 = time.perf_counter()
            for r, blocks in zip(reqs, picks, strict=True):
                r.step(prompt_len + 1, new_token_ids=[1], new_block_ids=blocks)
            for d in [r.finish() for r in reqs]:
                await d
            samples["store"].append(time.perf_counter() - t0)
            cpu = time.thread_time() - cpu0
            loop_us_block.append(cpu / batch_blocks * 1e6)
            loop_us_submission.append(cpu / max(1, off.executor.stats().batches - batches0) * 1e6)
            return prompts

        async def load(tag: int, prompts: list[list[int]]) -> None:
            reqs = [off.open(f"l{tag}-{i}", p) for i, p in enumerate(prompts)]
            for r in reqs:
                assert await r.lookup() == prompt_len
            picks = [rng.sample(range(num_blocks), REQUEST_BLOCKS) for _ in reqs]
            dev.synchronize()
            t0 = time.perf_counter()
            for p in [r.load(b) for r, b in zip(reqs, picks, strict=True)]:
                assert await p == prompt_len
            samples["load"].append(time.perf_counter() - t0)
            for r in reqs:
                await r.abort()

        await load(-1, await store(-1))  # warm-up
        samples["store"].clear()
        samples["load"].clear()
        loop_us_block.clear()
        loop_us_submission.clear()
        for rep in range(reps):
            d2h, h2d = baseline.measure()
            samples["d2h"].append(d2h)
            samples["h2d"].append(h2d)
            await load(rep, await store(rep))
        peak = dev.peak() - peak_base
        stats = off.executor.stats()
        assert off.stats().store_errors == 0
    baseline.close()
    assert stats.device is not None
    gbps = {k: [nbytes / s / 1e9 for s in v] for k, v in samples.items()}
    ratio = {
        "store": [a / b for a, b in zip(gbps["store"], gbps["d2h"], strict=True)],
        "load": [a / b for a, b in zip(gbps["load"], gbps["h2d"], strict=True)],
    }
    del kv
    gc.collect()
    return {
        "device": dev.kind,
        "segment_kib": seg_kib,
        "layers": layers,
        "slot_bytes": slot_bytes,
        "batch_bytes": nbytes,
        "gbps": {k: common.summarize(v) for k, v in gbps.items()},
        "ratio": {k: common.summarize(v) for k, v in ratio.items()},
        "loop_us_per_block": common.summarize(loop_us_block),
        "loop_us_per_submission": common.summarize(loop_us_submission),
        "staging_bytes": stats.device.staging_bytes,
        "device_bytes_held": held,
        "device_peak_extra_bytes": peak,
        "chunk_blocks": stats.device.chunk_blocks,
        "chunks": stats.device.chunks,
        "batches": stats.batches,
    }


def _r(s: dict[str, float]) -> str:
    return f"{s['median']:.2f} [{s['min']:.2f}-{s['max']:.2f}]"


async def main_async(args: argparse.Namespace, kinds: list[str]) -> list[dict[str, Any]]:
    out = []
    for kind in kinds:
        dev = Device(kind)
        try:
            sizes = args.sizes if kind == "cuda" else args.sizes[:2]
            layers = args.layers if kind == "cuda" else min(args.layers, 8)
            batch = args.batch_mib if kind == "cuda" else min(args.batch_mib, 64)
            for seg in sizes:
                out.append(
                    await run_size(
                        dev,
                        seg,
                        layers,
                        batch * common.MiB,
                        args.reps,
                        args.staging_mib * common.MiB,
                        args.seed,
                    )
                )
        finally:
            dev.close()
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("auto", "cuda", "sim"), default="auto")
    parser.add_argument(
        "--sizes", type=int, nargs="+", default=[16, 32, 64, 128], help="KiB per block per tensor"
    )
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--batch-mib", type=int, default=1024)
    parser.add_argument("--staging-mib", type=int, default=256)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="fewer reps, smaller batches")
    args = parser.parse_args()
    if args.quick:
        args.reps, args.batch_mib = 2, min(args.batch_mib, 256)
    cuda = torch.cuda.is_available()
    if args.device == "cuda" and not cuda:
        print("bench_device: no CUDA device")
        return 1
    kinds = {"auto": (["cuda"] if cuda else []) + ["sim"], "cuda": ["cuda"], "sim": ["sim"]}[args.device]
    common.status(f"bench_device: {', '.join(kinds)}")
    results = asyncio.run(main_async(args, kinds))
    rows = [
        [
            r["device"],
            f"{r['segment_kib']} KiB x {2 * r['layers']}",
            r["gbps"]["d2h"]["median"],
            r["gbps"]["store"]["median"],
            _r(r["ratio"]["store"]),
            r["gbps"]["h2d"]["median"],
            r["gbps"]["load"]["median"],
            _r(r["ratio"]["load"]),
            r["loop_us_per_block"]["median"],
            r["loop_us_per_submission"]["median"],
            f"{r['staging_bytes'] / common.MiB:.0f} / {r['device_peak_extra_bytes'] / common.MiB:.0f}",
        ]
        for r in results
    ]
    cuda_rows = [r for r in results if r["device"] == "cuda"]
    worst = min(
        (min(r["ratio"]["store"]["median"], r["ratio"]["load"]["median"]) for r in cuda_rows), default=None
    )
    note = "sim bandwidth is host memcpy on worker threads (not a GPU figure); "
    if worst is not None:
        note += f"CUDA worst ratio {worst:.2f} (target >= {TARGET}: {'met' if worst >= TARGET else 'MISSED'})"
    else:
        note += "no CUDA device: bandwidth target not measured"
    common.print_table(
        f"bench_device: stores/loads through the Offloader on a device vs one contiguous pinned copy ({args.reps} reps)",
        [
            "device",
            "block x tensors",
            "D2H GB/s",
            "store GB/s",
            "store ratio",
            "H2D GB/s",
            "load GB/s",
            "load ratio",
            "loop µs/block",
            "loop µs/submission",
            "staging / peak MiB",
        ],
        rows,
        note=note,
    )
    path = common.write_result(
        "device",
        {"config": vars(args), "target_ratio": TARGET, "worst_cuda_ratio": worst, "sizes": results},
    )
    common.status(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
