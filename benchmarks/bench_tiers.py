"""Throughput of the disk and Redis tiers against the plain operations they are built on, in the same run.

Disk: ``DiskTier.write`` / ``read_into`` of N blocks vs a plain sequential ``os.write`` / ``os.readv`` of the
same bytes into / from a plain file in the same directory. Reads are measured twice: page-cache warm, and
cold (both files are fsynced and dropped from the page cache with ``posix_fadvise(DONTNEED)``, which needs no
root and touches only these two files). Writes land in the page cache (no fsync), for both sides.

Redis: ``RedisTier.write`` / ``read_into`` vs raw pipelined ``SET`` / ``GET`` of values of the same size
through the same redis-py client, against a ``redis-server`` this script starts on a free loopback port.

Every measurement is the best of ``--repeat`` runs, tier and baseline alternating. Prints GB/s (1e9 B/s) and
ratios (tier / baseline; 1.0 = no overhead). Run: ``python benchmarks/bench_tiers.py [--quick]``.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from aiokv.tiers._base import TierSpec  # noqa: E402
from aiokv.tiers._disk import DiskTier  # noqa: E402
from aiokv.tiers._format import HEADER_SIZE  # noqa: E402
from aiokv.tiers._redis import RedisTier  # noqa: E402

FP = hashlib.sha256(b"bench-layout").digest()


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


async def best_of(repeat: int, fn: Callable[[], Awaitable[float]]) -> float:
    return min([await fn() for _ in range(repeat)])


def make_blocks(n: int, payload_bytes: int) -> tuple[list[bytes], list[memoryview], list[memoryview]]:
    rng = np.random.default_rng(0)
    buf = rng.integers(0, 256, size=n * payload_bytes, dtype=np.uint8)
    outs = np.zeros_like(buf)
    mv, ov = memoryview(buf), memoryview(outs)
    keys = [hashlib.sha256(b"block-%d" % i).digest() for i in range(n)]
    payloads = [mv[i * payload_bytes : (i + 1) * payload_bytes] for i in range(n)]
    dests = [ov[i * payload_bytes : (i + 1) * payload_bytes] for i in range(n)]
    return keys, payloads, dests


def drop_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


# -------------------------------------------------------------------- disk
async def bench_disk(workdir: Path, n: int, payload_bytes: int, batch: int, repeat: int) -> dict[str, float]:
    keys, payloads, outs = make_blocks(n, payload_bytes)
    total = n * payload_bytes
    spec = TierSpec(payload_bytes, FP, 16, "bench")
    entry = (HEADER_SIZE + payload_bytes + 4095) // 4096 * 4096
    plain_path = workdir / "plain.bin"
    results: dict[str, float] = {}

    async def tier_store() -> float:
        tier_dir = workdir / "tier"
        shutil.rmtree(tier_dir, ignore_errors=True)
        tier = DiskTier(tier_dir, n * entry, segment_bytes=n * entry)
        await tier.open(spec)  # preallocation is not timed
        began = time.perf_counter()
        for i in range(0, n, batch):
            assert await tier.write(keys[i : i + batch], payloads[i : i + batch]) == len(keys[i : i + batch])
        took = time.perf_counter() - began
        await tier.aclose()
        return took

    def plain_store_sync() -> float:
        plain_path.unlink(missing_ok=True)
        fd = os.open(plain_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.posix_fallocate(fd, 0, total)  # same preallocated conditions as the tier, not timed
        began = time.perf_counter()
        for i in range(0, n, batch):
            os.writev(fd, payloads[i : i + batch])
        took = time.perf_counter() - began
        os.close(fd)
        return took

    async def plain_store() -> float:
        return await asyncio.to_thread(plain_store_sync)

    store_t: list[float] = []
    plain_t: list[float] = []
    for _ in range(repeat):
        store_t.append(await tier_store())
        plain_t.append(await plain_store())
    results["disk_store_gbps"] = gbps(total, min(store_t))
    results["plain_write_gbps"] = gbps(total, min(plain_t))

    tier = DiskTier(workdir / "tier", n * entry, segment_bytes=n * entry)
    await tier.open(spec)
    assert tier.stats().recovered == n

    async def tier_load() -> float:
        began = time.perf_counter()
        for i in range(0, n, batch):
            assert await tier.read_into(keys[i : i + batch], outs[i : i + batch]) == len(keys[i : i + batch])
        return time.perf_counter() - began

    def plain_load_sync() -> float:
        fd = os.open(plain_path, os.O_RDONLY)
        began = time.perf_counter()
        for i in range(0, n, batch):
            os.readv(fd, outs[i : i + batch])
        took = time.perf_counter() - began
        os.close(fd)
        return took

    async def plain_load() -> float:
        return await asyncio.to_thread(plain_load_sync)

    for label, drop in (("warm", False), ("cold", True)):
        load_t: list[float] = []
        plain_t = []
        for _ in range(repeat):
            if drop:
                drop_cache(workdir / "tier" / "seg-00000.akv")
            load_t.append(await tier_load())
            if drop:
                drop_cache(plain_path)
            plain_t.append(await plain_load())
        results[f"disk_load_{label}_gbps"] = gbps(total, min(load_t))
        results[f"plain_read_{label}_gbps"] = gbps(total, min(plain_t))
    assert bytes(outs[-1]) == bytes(payloads[-1])
    await tier.aclose()
    return results


# ------------------------------------------------------------------- redis
def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start_redis(workdir: Path) -> tuple[subprocess.Popen[bytes], int]:
    binary = shutil.which("redis-server")
    if binary is None:
        raise RuntimeError("redis-server not found")
    port = free_port()
    proc = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
         "--dir", str(workdir), "--logfile", str(workdir / "redis.log")],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
                s.sendall(b"PING\r\n")
                if s.recv(16).startswith(b"+PONG"):
                    return proc, port
        except OSError:
            time.sleep(0.01)
    proc.kill()
    raise RuntimeError("redis-server did not start")


async def bench_redis(workdir: Path, n: int, payload_bytes: int, batch: int, repeat: int) -> dict[str, float]:
    proc, port = start_redis(workdir)
    try:
        keys, payloads, outs = make_blocks(n, payload_bytes)
        total = n * payload_bytes
        tier = RedisTier(f"redis://127.0.0.1:{port}/0", namespace="bench", timeout_s=30)
        await tier.open(TierSpec(payload_bytes, FP, 16, "bench"))
        client = tier._client
        assert client is not None
        raw_keys = [b"raw:" + k.hex().encode() for k in keys]
        raw_values = [bytes(HEADER_SIZE) + bytes(p) for p in payloads]  # same size as the tier's values

        async def tier_store() -> float:
            began = time.perf_counter()
            for i in range(0, n, batch):
                assert await tier.write(keys[i : i + batch], payloads[i : i + batch]) == len(
                    keys[i : i + batch]
                )
            return time.perf_counter() - began

        async def raw_set() -> float:
            began = time.perf_counter()
            for i in range(0, n, batch):
                pipe = client.pipeline(transaction=False)
                for k, v in zip(raw_keys[i : i + batch], raw_values[i : i + batch], strict=True):
                    pipe.set(k, v)
                await pipe.execute()
            return time.perf_counter() - began

        async def tier_load() -> float:
            began = time.perf_counter()
            for i in range(0, n, batch):
                assert await tier.read_into(keys[i : i + batch], outs[i : i + batch]) == len(
                    keys[i : i + batch]
                )
            return time.perf_counter() - began

        async def raw_get() -> float:
            began = time.perf_counter()
            for i in range(0, n, batch):
                pipe = client.pipeline(transaction=False)
                for k in raw_keys[i : i + batch]:
                    pipe.get(k)
                await pipe.execute()
            return time.perf_counter() - began

        res: dict[str, list[float]] = {"store": [], "set": [], "load": [], "get": []}
        for _ in range(repeat):
            res["store"].append(await tier_store())
            res["set"].append(await raw_set())
            res["load"].append(await tier_load())
            res["get"].append(await raw_get())
        assert bytes(outs[-1]) == bytes(payloads[-1])
        stats = tier.stats()
        assert stats.errors == stats.timeouts == stats.corrupt == 0, stats
        await tier.aclose()
        return {
            "redis_store_gbps": gbps(total, min(res["store"])),
            "raw_set_gbps": gbps(total, min(res["set"])),
            "redis_load_gbps": gbps(total, min(res["load"])),
            "raw_get_gbps": gbps(total, min(res["get"])),
        }
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(10)


async def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--block-kib", type=int, default=2048, help="payload bytes per block (KiB)")
    parser.add_argument("--disk-mib", type=int, default=1024, help="bytes moved per disk pass (MiB)")
    parser.add_argument("--redis-mib", type=int, default=256, help="bytes moved per Redis pass (MiB)")
    parser.add_argument("--batch", type=int, default=16, help="blocks per call (one request's prefix)")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--dir", default=None, help="directory for the disk files (default: a temp dir)")
    parser.add_argument("--quick", action="store_true", help="small sizes (a smoke run)")
    parser.add_argument("--skip-redis", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.disk_mib, args.redis_mib, args.repeat = 128, 64, 2
    payload = args.block_kib * 1024
    print(
        f"block {args.block_kib} KiB, batch {args.batch}, disk {args.disk_mib} MiB/pass, "
        f"redis {args.redis_mib} MiB/pass, best of {args.repeat}; python {sys.version.split()[0]}, "
        f"{os.cpu_count()} cpus"
    )
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="aiokv-bench-") as tmp:
        workdir = Path(tmp)
        disk = await bench_disk(
            workdir, args.disk_mib * 1024 // args.block_kib, payload, args.batch, args.repeat
        )
        print(f"\ndisk ({workdir}, page cache: writes buffered, 'cold' = file pages dropped with fadvise)")
        rows = [
            ("store", "disk_store_gbps", "plain_write_gbps"),
            ("load warm", "disk_load_warm_gbps", "plain_read_warm_gbps"),
            ("load cold", "disk_load_cold_gbps", "plain_read_cold_gbps"),
        ]
        print(f"  {'':10} {'tier GB/s':>10} {'plain GB/s':>11} {'ratio':>7}")
        for label, t, p in rows:
            print(f"  {label:10} {disk[t]:10.2f} {disk[p]:11.2f} {disk[t] / disk[p]:7.2f}")
        if not args.skip_redis and shutil.which("redis-server"):
            rworkdir = workdir / "redis"
            rworkdir.mkdir()
            red = await bench_redis(
                rworkdir, args.redis_mib * 1024 // args.block_kib, payload, args.batch, args.repeat
            )
            print("\nredis (loopback, same redis-py client for tier and raw pipelines)")
            print(f"  {'':10} {'tier GB/s':>10} {'raw GB/s':>11} {'ratio':>7}")
            print(
                f"  {'store':10} {red['redis_store_gbps']:10.2f} {red['raw_set_gbps']:11.2f} "
                f"{red['redis_store_gbps'] / red['raw_set_gbps']:7.2f}"
            )
            print(
                f"  {'load':10} {red['redis_load_gbps']:10.2f} {red['raw_get_gbps']:11.2f} "
                f"{red['redis_load_gbps'] / red['raw_get_gbps']:7.2f}"
            )
        else:
            print("\nredis: skipped (no redis-server or --skip-redis)")


if __name__ == "__main__":
    asyncio.run(main())
