"""The one-shot device check: every claim about the device data path, measured, with a non-zero exit status if
any check fails. Run on a machine with a GPU (``bash tools/gpu_check.sh``); ``--device sim`` runs the same
checks on the simulated device (CI runs that, so this script cannot rot between GPU sessions).

Checks (each prints PASS/FAIL and its figures; all figures go to ``$OUT/gpu_check.json``):

- ``gpu-tests``: ``pytest -m gpu`` (the CUDA tests and the device-path tests on CUDA: a non-default compute
  stream, step-before-sync, loads awaited on the device, staging, failures); none may fail or be skipped.
- ``step-before-sync``: the engine's "forward" is still queued behind a long kernel when ``step()`` is
  called; the stored block holds what the forward wrote.
- ``loop-lag``: while the compute stream is busy for ~1 s and 64 requests step, finish and load, the event
  loop stays responsive (the worst lateness of a 1 ms ticker stays under 20 ms; on the simulated device, which
  shares a test machine's CPU, under a quarter of the busy second: never blocked by the device).
- ``waiters-sleep``: during that busy second aiokv's completion waiter threads use < 5% of a core (blocking
  events: they sleep in the driver instead of spinning).
- ``staging-bound``: a transfer 16x larger than the staging area goes through in chunks, and device memory
  never grows during it beyond what aiokv allocated at start.
- ``many-requests``: 256 concurrent requests store and restore scattered blocks; every byte restored is
  bitwise what was stored.
- ``bandwidth`` (CUDA only): ``benchmarks/bench_device.py``; stores and loads through the public API reach
  >= 0.9 of one contiguous pinned ``cudaMemcpyAsync`` of the same bytes at 16, 32, 64 and 128 KiB per block
  per layer (32 layers); also reports loop-thread µs per submitted block and staging memory.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))  # the Device of bench_device.py

import torch  # noqa: E402
from bench_device import Device  # noqa: E402

import aiokv  # noqa: E402

BS = 16
LAG_LIMIT_S = 0.020
WAITER_CPU_LIMIT = 0.05


class Rig(Device):
    """The device under test (see ``benchmarks/bench_device.py``'s ``Device``), with tensors and a way to keep
    the compute stream busy."""

    def __init__(self, kind: str) -> None:
        super().__init__(kind, seed=1, jitter_s=0.00005)

    def tensors(self, num_blocks: int, n: int = 8, heads: int = 8, head_dim: int = 64) -> list[torch.Tensor]:
        gen = torch.Generator().manual_seed(3)
        return [
            torch.randn(num_blocks, BS, heads, head_dim, generator=gen).to(self.torch_device)
            for _ in range(n)
        ]

    def busy(self, seconds: float) -> None:
        """Keep the compute stream busy for about ``seconds`` from now (work queued after waits for it)."""
        if self.kind == "cuda":
            with torch.cuda.stream(self.compute):
                torch.cuda._sleep(int(seconds * self._cycles_per_s()))
        else:
            release = self.compute.hold()
            threading.Timer(seconds, release.set).start()

    _rate: float | None = None

    def _cycles_per_s(self) -> float:
        """Clock cycles per second of ``torch.cuda._sleep``, measured once with timing events."""
        if self._rate is None:
            start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            stream = torch.cuda.Stream()
            with torch.cuda.stream(stream):
                start.record()
                torch.cuda._sleep(100_000_000)
                end.record()
            end.synchronize()
            self._rate = 1e8 / (start.elapsed_time(end) / 1e3)
        return self._rate

    def launch(self, fn: Callable[[], Any]) -> None:
        self.binding.launch(self.compute, fn)

    def offloader(self, layout: aiokv.KVLayout, slots: int, **kwargs: Any) -> aiokv.Offloader:
        return aiokv.Offloader(
            layout,
            [aiokv.CPUTier(capacity_bytes=slots * layout.slot_bytes)],
            device=self.binding,
            compute_stream=self.compute,
            **kwargs,
        )


def _slot(off: aiokv.Offloader, tokens: list[int], index: int) -> torch.Tensor:
    key = aiokv.block_hashes(tokens, BS, root=off.layout.root)[index]
    return off.cpu.slot_tensor(off.cpu.index.slot(key))


async def check_step_before_sync(rig: Rig, quick: bool) -> dict[str, Any]:
    kv = rig.tensors(64)
    layout = aiokv.KVLayout(kv, block_size=BS)
    async with rig.offloader(layout, 64) as off:
        prompt = list(range(4 * BS + 1))
        req = off.open("a", prompt)
        await req.lookup()
        rig.busy(0.3)

        def forward() -> None:
            for t in kv:
                t[[3, 9, 27, 40]] = 7.0

        rig.launch(forward)  # queued behind the busy kernel: not written when step() is called
        req.step(len(prompt), new_token_ids=[1], new_block_ids=[3, 9, 27, 40, 41])
        await req.finish()
        ok = all(bool(torch.all(_slot(off, prompt, i).view(torch.float32) == 7.0)) for i in range(4))
    return {"ok": ok}


async def check_loop_lag(rig: Rig, quick: bool) -> dict[str, Any]:
    """The loop stays responsive and the waiter threads sleep while the device is busy."""
    kv = rig.tensors(512)
    layout = aiokv.KVLayout(kv, block_size=BS)
    busy_s = 1.0
    async with rig.offloader(layout, 1024) as off:
        rng = random.Random(0)
        prompts = [[rng.randrange(1 << 20) for _ in range(4 * BS + 1)] for _ in range(64)]
        # Cache half of them first, to have loads in the busy period too.
        for i, p in enumerate(prompts[:32]):
            r = off.open(f"seed{i}", p)
            await r.lookup()
            r.step(len(p), new_token_ids=[1], new_block_ids=rng.sample(range(512), 5))
            await r.finish()
        waiters = [
            t for t in threading.enumerate() if t.name.startswith("aiokv-") and t.name.endswith("-wait")
        ]
        cpu0 = {t.name: _thread_cpu(t) for t in waiters}
        lags: list[float] = []
        stop = asyncio.Event()

        async def ticker() -> None:
            while not stop.is_set():
                t0 = time.perf_counter()
                await asyncio.sleep(0.001)
                lags.append(time.perf_counter() - t0 - 0.001)

        tick = asyncio.ensure_future(ticker())
        t0 = time.perf_counter()
        rig.busy(busy_s)
        reqs = []
        for i, p in enumerate(prompts[32:]):
            r = off.open(f"busy{i}", p)
            await r.lookup()
            r.step(len(p), new_token_ids=[1], new_block_ids=rng.sample(range(512), 5))
            reqs.append(r.finish())
        loads = []
        for i, p in enumerate(prompts[:32]):
            r = off.open(f"load{i}", p)
            await r.lookup()
            loads.append((r, r.load(rng.sample(range(512), 4))))
        for f in reqs:
            await f
        for r, pending in loads:
            await pending
            await r.abort()
        wall = time.perf_counter() - t0
        stop.set()
        await tick
        waiter_cpu = {t.name: _thread_cpu(t) - cpu0[t.name] for t in waiters}
    worst = max(lags) if lags else float("inf")
    share = max(waiter_cpu.values(), default=0.0) / wall
    # On CUDA the claim is a responsive loop (20 ms). The simulated device runs on the CPU the test machine
    # shares with everything else, where only the functional claim can be judged: the loop is never blocked
    # for the busy period (a synchronous wait on the device would show a lag near busy_s).
    limit = LAG_LIMIT_S if rig.kind == "cuda" else busy_s / 4
    return {
        "ok": worst < limit and wall >= busy_s * 0.9,
        "busy_wall_s": wall,
        "ticks": len(lags),
        "worst_lag_ms": worst * 1e3,
        "lag_limit_ms": limit * 1e3,
        "waiters_ok": share < WAITER_CPU_LIMIT,
        "waiter_cpu_share": share,
        "waiter_cpu_s": waiter_cpu,
    }


def _thread_cpu(t: threading.Thread) -> float:
    assert t.ident is not None
    return time.clock_gettime(time.pthread_getcpuclockid(t.ident))


async def check_staging_bound(rig: Rig, quick: bool) -> dict[str, Any]:
    kv = rig.tensors(512 if quick else 2048)
    layout = aiokv.KVLayout(kv, block_size=BS)
    rows = 8
    staging = 2 * rows * layout.slot_bytes
    n_blocks = 16 * rows
    before = rig.allocated()
    async with rig.offloader(layout, 2 * n_blocks, staging_bytes=staging) as off:
        held = rig.allocated() - before
        rig.reset_peak()
        base = rig.allocated()
        prompt = list(range(n_blocks * BS + 1))
        blocks = random.Random(1).sample(range(len(kv[0])), n_blocks + 1)
        req = off.open("big", prompt)
        await req.lookup()
        req.step(len(prompt), new_token_ids=[1], new_block_ids=blocks)
        await req.finish()
        growth = rig.peak() - base
        rig.synchronize()
        expect = [t[blocks[:n_blocks]].clone() for t in kv]  # before the window measured below
        dst = random.Random(2).sample(range(len(kv[0])), n_blocks)
        rig.reset_peak()
        base = rig.allocated()
        req = off.open("back", prompt)
        assert await req.lookup() == n_blocks * BS
        assert await req.load(dst) == n_blocks * BS
        rig.synchronize()
        growth = max(growth, rig.peak() - base)
        same = all(bool(torch.equal(t[dst], e)) for t, e in zip(kv, expect, strict=True))
        await req.abort()
        dev = off.executor.stats().device
        assert dev is not None
    return {
        "ok": same and growth <= 0 and dev.chunks >= 2 * 16 and held <= dev.staging_bytes + (1 << 20),
        "transfer_bytes": n_blocks * layout.slot_bytes,
        "staging_bytes": dev.staging_bytes,
        "held_at_start_bytes": held,
        "growth_during_transfers_bytes": growth,
        "chunks": dev.chunks,
        "bitwise": same,
    }


async def check_many_requests(rig: Rig, quick: bool) -> dict[str, Any]:
    n = 64 if quick else 256
    kv = rig.tensors(8 * n, n=4, heads=4, head_dim=32)
    layout = aiokv.KVLayout(kv, block_size=BS)
    rng = random.Random(5)
    async with rig.offloader(layout, 4 * n) as off:
        prompts = [[rng.randrange(1 << 20) for _ in range(2 * BS + 1)] for _ in range(n)]
        pool = rng.sample(range(8 * n), 3 * n)
        reqs, blocks = [], []
        for i, p in enumerate(prompts):
            r = off.open(f"r{i}", p)
            await r.lookup()
            reqs.append(r)
            blocks.append(pool[3 * i : 3 * i + 3])
        for r, p, b in zip(reqs, prompts, blocks, strict=True):
            r.step(len(p), new_token_ids=[1], new_block_ids=b)
        await asyncio.gather(*(r.finish() for r in reqs))
        rig.synchronize()
        expect = [[t[b[:2]].clone() for t in kv] for b in blocks]
        loads = []
        free = [b for b in range(8 * n) if b not in set(pool)]
        for i, p in enumerate(prompts):
            r = off.open(f"l{i}", p)
            await r.lookup()
            dst = free[2 * i : 2 * i + 2]
            loads.append((r, dst, r.load(dst)))
        ok = True
        for _r, _dst, pending in loads:
            ok &= await pending == 2 * BS
        rig.synchronize()
        for (r, dst, _), e in zip(loads, expect, strict=True):
            ok &= all(bool(torch.equal(t[dst], x)) for t, x in zip(kv, e, strict=True))
            await r.abort()
        stats = off.stats()
    return {"ok": ok and stats.store_errors == 0 and stats.load_errors == 0, "requests": n}


def check_gpu_tests(rig: Rig, out: Path) -> dict[str, Any]:
    log = out / "gpu_tests.log"
    proc = subprocess.run(
        # The CUDA tests and the device-path tests' CUDA variants (tests/core/_device.py's harness), layer-wise
        # loads included. (tests/core alone holds none since the redesign moved them to tests/transfer.)
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu", "-rs", "tests/transfer"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=480,
    )
    log.write_text(proc.stdout + proc.stderr)
    last = (proc.stdout.strip().splitlines() or [""])[-1]
    return {"ok": proc.returncode == 0 and "skipped" not in last and "passed" in last, "summary": last}


def check_bandwidth(rig: Rig, out: Path, quick: bool) -> dict[str, Any]:
    cmd = [sys.executable, "benchmarks/bench_device.py", "--device", "cuda"] + (["--quick"] if quick else [])
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=480)
    (out / "bench_device.log").write_text(proc.stdout + proc.stderr)
    path = ROOT / "benchmarks" / "results" / "device.json"
    if proc.returncode != 0 or not path.exists():
        return {"ok": False, "error": (proc.stdout + proc.stderr)[-2000:]}
    data = json.loads(path.read_text())
    rows = [r for r in data["sizes"] if r["device"] == "cuda"]
    figures = {
        f"{r['segment_kib']}KiB": {
            "store_ratio": r["ratio"]["store"]["median"],
            "load_ratio": r["ratio"]["load"]["median"],
            "store_gbps": r["gbps"]["store"]["median"],
            "load_gbps": r["gbps"]["load"]["median"],
            "loop_us_per_block": r["loop_us_per_block"]["median"],
            "staging_mib": r["staging_bytes"] / (1 << 20),
        }
        for r in rows
    }
    ok = bool(rows) and all(min(f["store_ratio"], f["load_ratio"]) >= 0.9 for f in figures.values())
    return {"ok": ok, "sizes": figures}


CHECKS: list[tuple[str, Callable[[Rig, bool], Coroutine[Any, Any, dict[str, Any]]]]] = [
    ("step-before-sync", check_step_before_sync),
    ("loop-lag", check_loop_lag),
    ("staging-bound", check_staging_bound),
    ("many-requests", check_many_requests),
]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("auto", "cuda", "sim"), default="auto")
    parser.add_argument("--quick", action="store_true", help="smaller transfers and benchmarks")
    args = parser.parse_args()
    kind = args.device
    if kind == "auto":
        kind = "cuda" if torch.cuda.is_available() else "sim"
    if kind == "cuda" and not torch.cuda.is_available():
        print("gpu_check: FAIL no CUDA device is available", flush=True)
        return 1
    out = Path(os.environ.get("OUT") or ROOT / "gpu-out")
    out.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {"device": kind}
    rig = Rig(kind)
    if kind == "cuda":
        results["gpu"] = torch.cuda.get_device_name()
    failed: list[str] = []

    def report(name: str, res: dict[str, Any]) -> None:
        results[name] = res
        ok = bool(res.get("ok"))
        if not ok:
            failed.append(name)
        detail = {k: v for k, v in res.items() if k != "ok"}
        print(f"{'PASS' if ok else 'FAIL'} {name}: {json.dumps(detail, default=str)}", flush=True)

    try:
        if kind == "cuda":
            report("gpu-tests", check_gpu_tests(rig, out))
        for name, check in CHECKS:
            try:
                res = asyncio.run(check(rig, args.quick))
            except Exception as exc:  # a check that crashes is a failed check, and the others still run
                res = {"ok": False, "error": repr(exc)}
            report(name, res)
            if name == "loop-lag":
                report(
                    "waiters-sleep",
                    {"ok": res.get("waiters_ok", False), "share": res.get("waiter_cpu_share")},
                )
        if kind == "cuda":
            report("bandwidth", check_bandwidth(rig, out, args.quick))
    finally:
        rig.close()
    results["failed"] = failed
    (out / "gpu_check.json").write_text(json.dumps(results, indent=2, default=str) + "\n")
    print(f"gpu_check on {kind}: {'all checks passed' if not failed else 'FAILED: ' + ', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
