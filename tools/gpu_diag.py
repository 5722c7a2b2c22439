"""Where the device data path's bandwidth goes (a diagnosis, not a pass/fail check): run on a CUDA machine
after ``tools/gpu_check.py`` reports a bandwidth shortfall.

    python3 tools/gpu_diag.py [--device cuda|sim] [--quick]

Prints, each a median over reps, in GB/s of the same 1 GiB:

- ``copy``: one contiguous copy each way, host buffer registered in place (what aiokv and bench_device use)
  and allocated pinned by torch; the same bytes as 8 copies of 128 MiB and as 1024 copies of 1 MiB (the
  submitting thread's CPU time per copy too).
- ``staged``: aiokv's store shape done by hand in torch, no aiokv: 1024 scattered blocks of 64 tensors
  gathered into 128 MiB of device staging, then copied to the host, one stream (serial) and two streams
  with two staging halves (the gather of chunk i+1 overlapping the copy of chunk i).
- ``aiokv``: a store shaped like bench_device's through the public API, with a timeline from the first
  step(): steps done, first submission, last chunk queued, the device's span and busy time (CUDA events
  around every chunk) and the wall until every finish() resolved (wall minus the device span's end is the
  hand-back to the loop); also with the GIL switch interval at 0.5 ms instead of 5 ms.
Results also go to ``$OUT/gpu_diag.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import torch  # noqa: E402
from bench_device import BLOCK_TOKENS, HEAD_DIM, REQUEST_BLOCKS, Device  # noqa: E402

from aiokv import CPUTier, KVLayout, Offloader  # noqa: E402
from aiokv.transfer import _device as device_mod  # noqa: E402

GiB = 1 << 30
MiB = 1 << 20
RESULTS: dict[str, Any] = {}


def med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def timed(fn: Any, reps: int) -> tuple[float, float]:
    """(median wall seconds, median submitting-thread CPU seconds) of ``fn`` followed by a device sync."""
    walls, cpus = [], []
    for _ in range(reps):
        torch.cuda.synchronize()
        c0 = time.thread_time()
        t0 = time.perf_counter()
        fn()
        c1 = time.thread_time()
        torch.cuda.synchronize()
        walls.append(time.perf_counter() - t0)
        cpus.append(c1 - c0)
    return med(walls), med(cpus)


def section(name: str, fn: Any, *args: Any) -> None:
    try:
        RESULTS[name] = fn(*args)
    except Exception as exc:  # one failed section must not hide the others
        RESULTS[name] = {"error": repr(exc)}
    print(name, json.dumps(RESULTS[name], default=str), flush=True)


def copies(reps: int) -> dict[str, Any]:
    from aiokv.transfer._cuda import CudaDevice

    b = CudaDevice()
    n = GiB
    dev = torch.empty(n, dtype=torch.uint8, device="cuda")
    reg = torch.empty(n, dtype=torch.uint8)
    reg.fill_(1)
    b.pin(reg)
    alloc = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    s = torch.cuda.Stream()
    out: dict[str, Any] = {}

    def one(dst: torch.Tensor, src: torch.Tensor, piece: int) -> Any:
        def go() -> None:
            with torch.cuda.stream(s):
                for o in range(0, n, piece):
                    dst[o : o + piece].copy_(src[o : o + piece], non_blocking=True)

        return go

    for host_name, host in (("registered", reg), ("torch_pinned", alloc)):
        for piece_name, piece in (("1GiB", n), ("128MiB", 128 * MiB), ("1MiB", MiB)):
            for d, (dst, src) in (("d2h", (host, dev)), ("h2d", (dev, host))):
                if host_name == "torch_pinned" and piece != n:
                    continue
                wall, cpu = timed(one(dst, src, piece), reps)
                out[f"{d} {host_name} {piece_name}"] = {
                    "gbps": round(n / wall / 1e9, 2),
                    "cpu_us_per_copy": round(cpu / (n // piece) * 1e6, 2),
                }
    b.unpin(reg)
    return out


def staged(reps: int, seg_kib: int) -> dict[str, Any]:
    from aiokv.transfer._cuda import CudaDevice

    b = CudaDevice()
    layers = 32
    heads = seg_kib * 1024 // (BLOCK_TOKENS * HEAD_DIM * 2)
    slot_bytes = 2 * layers * BLOCK_TOKENS * heads * HEAD_DIM * 2
    nblocks = GiB // slot_bytes
    kv = [
        torch.empty(2 * nblocks, BLOCK_TOKENS, heads, HEAD_DIM, dtype=torch.float16, device="cuda")
        for _ in range(2 * layers)
    ]
    views = [t.view(2 * nblocks, -1).view(torch.int64) for t in kv]
    seg = views[0].shape[1]
    host = torch.empty(nblocks * slot_bytes, dtype=torch.uint8)
    host.fill_(1)
    b.pin(host)
    host_rows = host.view(nblocks, slot_bytes)
    rows_per_chunk = (128 * MiB) // slot_bytes
    staging = torch.empty(2, rows_per_chunk, slot_bytes // 8, dtype=torch.int64, device="cuda")
    ids = torch.tensor(random.Random(0).sample(range(2 * nblocks), nblocks), device="cuda")
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()

    def gather(buf: torch.Tensor, idx: torch.Tensor) -> None:
        for k, v in enumerate(views):
            torch.index_select(v, 0, idx, out=buf[: len(idx), k * seg : (k + 1) * seg])

    def serial() -> None:
        with torch.cuda.stream(s1):
            for start in range(0, nblocks, rows_per_chunk):
                idx = ids[start : start + rows_per_chunk]
                buf = staging[0]
                gather(buf, idx)
                host_rows[start : start + len(idx)].copy_(
                    buf[: len(idx)].view(torch.uint8).view(len(idx), slot_bytes), non_blocking=True
                )

    def overlapped() -> None:
        done = [torch.cuda.Event(), torch.cuda.Event()]
        gathered = [torch.cuda.Event(), torch.cuda.Event()]
        for c, start in enumerate(range(0, nblocks, rows_per_chunk)):
            k = c % 2
            idx = ids[start : start + rows_per_chunk]
            buf = staging[k]
            with torch.cuda.stream(s1):
                if c >= 2:
                    s1.wait_event(done[k])
                gather(buf, idx)
                gathered[k].record(s1)
            with torch.cuda.stream(s2):
                s2.wait_event(gathered[k])
                host_rows[start : start + len(idx)].copy_(
                    buf[: len(idx)].view(torch.uint8).view(len(idx), slot_bytes), non_blocking=True
                )
                done[k].record(s2)

    def gather_only() -> None:
        with torch.cuda.stream(s1):
            for start in range(0, nblocks, rows_per_chunk):
                gather(staging[0], ids[start : start + rows_per_chunk])

    out = {}
    nbytes = nblocks * slot_bytes
    for name, fn in (("gather_only", gather_only), ("serial", serial), ("overlapped", overlapped)):
        wall, cpu = timed(fn, reps)
        out[name] = {"gbps": round(nbytes / wall / 1e9, 2), "submit_cpu_ms": round(cpu * 1e3, 2)}
    b.unpin(host)
    return out


async def aiokv_timeline(kind: str, seg_kib: int, reps: int, switch: float) -> dict[str, Any]:
    sys.setswitchinterval(switch)
    dev = Device(kind)
    cuda = kind == "cuda"
    layers = 32 if cuda else 8
    heads = seg_kib * 1024 // (BLOCK_TOKENS * HEAD_DIM * 2)
    slot_bytes = 2 * layers * BLOCK_TOKENS * heads * HEAD_DIM * 2
    batch = GiB if cuda else 64 * MiB
    requests = max(1, batch // (slot_bytes * REQUEST_BLOCKS))
    batch_blocks = requests * REQUEST_BLOCKS
    num_blocks = 2 * batch_blocks
    nbytes = batch_blocks * slot_bytes
    kv = [
        torch.zeros(num_blocks, BLOCK_TOKENS, heads, HEAD_DIM, dtype=torch.float16, device=dev.torch_device)
        for _ in range(2 * layers)
    ]
    layout = KVLayout(kv, block_size=BLOCK_TOKENS)
    rng = random.Random(0)
    marks: list[tuple[str, float, Any]] = []
    pipe = device_mod._Pipe
    orig_chunk, orig_submit = pipe._chunk, pipe._submit

    def chunk(self: Any, *a: Any, **k: Any) -> Any:
        ev0 = ev1 = None
        if cuda and self._store:
            ev0 = torch.cuda.Event(enable_timing=True)
            ev0.record(self.stream)
        t = time.perf_counter()
        r = orig_chunk(self, *a, **k)
        if cuda and self._store:
            ev1 = torch.cuda.Event(enable_timing=True)
            ev1.record(self.stream)
        marks.append(("chunk", t, (ev0, ev1, time.perf_counter())))
        return r

    def submit(self: Any, jobs: Any) -> Any:
        marks.append(("submit", time.perf_counter(), len(jobs)))
        return orig_submit(self, jobs)

    pipe._chunk, pipe._submit = chunk, submit  # type: ignore[method-assign]
    rows: list[dict[str, float]] = []
    try:
        async with Offloader(
            layout,
            [CPUTier(capacity_bytes=2 * batch_blocks * slot_bytes)],
            device=dev.binding,
            compute_stream=dev.compute,
            staging_bytes=256 * MiB,
        ) as off:
            for rep in range(reps + 1):
                prompts = [
                    [rng.randrange(1 << 30) for _ in range(REQUEST_BLOCKS * BLOCK_TOKENS + 1)]
                    for _ in range(requests)
                ]
                reqs = [off.open(f"s{rep}-{i}", p) for i, p in enumerate(prompts)]
                for r in reqs:
                    await r.lookup()
                picks = [rng.sample(range(num_blocks), REQUEST_BLOCKS + 1) for _ in reqs]
                dev.synchronize()
                marks.clear()
                t0 = time.perf_counter()
                for r, blocks in zip(reqs, picks, strict=True):
                    r.step(REQUEST_BLOCKS * BLOCK_TOKENS + 1, new_token_ids=[1], new_block_ids=blocks)
                t_steps = time.perf_counter()
                for d in [r.finish() for r in reqs]:
                    await d
                t_end = time.perf_counter()
                for r in reqs:
                    await r.abort()
                chunks = [m for m in marks if m[0] == "chunk"]
                subs = [m for m in marks if m[0] == "submit"]
                row = {
                    "wall_ms": (t_end - t0) * 1e3,
                    "gbps": nbytes / (t_end - t0) / 1e9,
                    "steps_ms": (t_steps - t0) * 1e3,
                    "first_submit_ms": (subs[0][1] - t0) * 1e3 if subs else -1,
                    "submissions": len(subs),
                    "chunks": len(chunks),
                    "last_chunk_queued_ms": (chunks[-1][2][2] - t0) * 1e3 if chunks else -1,
                }
                if cuda and chunks:
                    torch.cuda.synchronize()
                    first, last = chunks[0][2][0], chunks[-1][2][1]
                    row["device_span_ms"] = first.elapsed_time(last)
                    row["device_busy_ms"] = sum(c[2][0].elapsed_time(c[2][1]) for c in chunks)
                if rep:
                    rows.append(row)
    finally:
        pipe._chunk, pipe._submit = orig_chunk, orig_submit  # type: ignore[method-assign]
        sys.setswitchinterval(0.005)
        dev.close()
    return {
        "seg_kib": seg_kib,
        "switch_ms": switch * 1e3,
        "nbytes": nbytes,
        **{k: round(med([r[k] for r in rows]), 3) for k in rows[0]},
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cuda", "sim"), default="cuda")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    reps = 2 if args.quick else 5
    if args.device == "cuda":
        section("copy", copies, reps)
        for seg in (16, 128):
            section(f"staged {seg}KiB", staged, reps, seg)
    for seg in (16, 128):
        for switch in (0.005, 0.0005):
            section(
                f"aiokv {seg}KiB switch={switch * 1e3:g}ms",
                lambda s=seg, w=switch: asyncio.run(aiokv_timeline(args.device, s, reps, w)),
            )
    out = Path(os.environ.get("OUT") or ROOT / "gpu-out")
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_diag.json").write_text(json.dumps(RESULTS, indent=2, default=str) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
