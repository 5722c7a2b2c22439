"""Throughput of the disk and Redis tiers against the plain operations they are built on, in the same run.

Disk: ``DiskTier.write`` / ``read_into`` of N blocks vs a plain sequential ``os.write`` / ``os.readv`` of the
same bytes into / from a plain file in the same directory. Reads are measured twice: page-cache warm, and
cold (both files are fsynced and dropped from the page cache with ``posix_fadvise(DONTNEED)``, which needs no
root and touches only these two files). Writes land in the page cache (no fsync), for both sides.

Redis: ``RedisTier.write`` / ``read_into`` vs raw pipelined ``SET`` / ``GET`` of values of the same size
through the same redis-py client, against a ``redis-server`` this script starts on a free loopback port.

Tier and baseline alternate ``--repeat`` times; prints the best GB/s (1e9 B/s) of each and the median of the
per-pair ratios (tier / baseline; 1.0 = no overhead), which is what to compare on a noisy machine. Run: ``python benchmarks/bench_tiers.py [--quick]``.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from aiokv.tiers._base import TierSpec
from aiokv.tiers._format import HEADER_SIZE
from aiokv.tiers.disk import DiskTier
from aiokv.tiers.redis import RedisTier

FP = hashlib.sha256(b"bench-layout").digest()


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


class Pair:
    """Alternating measurements of a tier operation and its baseline: best GB/s of each and the median of the
    per-pair ratios (robust against a noisy machine drifting between pairs)."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self.tier: list[float] = []
        self.base: list[float] = []

    def add(self, tier_s: float, base_s: float) -> None:
        self.tier.append(tier_s)
        self.base.append(base_s)

    @property
    def tier_gbps(self) -> float:
        return gbps(self.nbytes, min(self.tier))

    @property
    def base_gbps(self) -> float:
        return gbps(self.nbytes, min(self.base))

    @property
    def ratio(self) -> float:
        return float(statistics.median(b / t for t, b in zip(self.tier, self.base, strict=True)))

    def row(self, label: str) -> str:
        return f"  {label:10} {self.tier_gbps:10.2f} {self.base_gbps:11.2f} {self.ratio:7.2f}"


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
async def bench_disk(
    workdir: Path, n: int, payload_bytes: int, batch: int, repeat: int, io_threads: int
) -> dict[str, Pair]:
    keys, payloads, outs = make_blocks(n, payload_bytes)
    total = n * payload_bytes
    spec = TierSpec(payload_bytes, FP, 16, "bench")
    entry = (HEADER_SIZE + payload_bytes + 4095) // 4096 * 4096
    plain_path = workdir / "plain.bin"

    async def tier_store() -> float:
        tier_dir = workdir / "tier"
        shutil.rmtree(tier_dir, ignore_errors=True)
        tier = DiskTier(tier_dir, n * entry, segment_bytes=n * entry, io_threads=io_threads)
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

    store = Pair(total)
    for _ in range(repeat):
        store.add(await tier_store(), await plain_store())

    tier = DiskTier(workdir / "tier", n * entry, segment_bytes=n * entry, io_threads=io_threads)
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

    loads: dict[str, Pair] = {}
    for label, drop in (("warm", False), ("cold", True)):
        pair = loads[label] = Pair(total)
        for _ in range(repeat):
            if drop:
                drop_cache(workdir / "tier" / "seg-00000.akv")
            tier_s = await tier_load()
            if drop:
                drop_cache(plain_path)
            pair.add(tier_s, await plain_load())
    assert bytes(outs[-1]) == bytes(payloads[-1])
    await tier.aclose()
    return {"store": store, "load warm": loads["warm"], "load cold": loads["cold"]}


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


async def bench_redis(workdir: Path, n: int, payload_bytes: int, batch: int, repeat: int) -> dict[str, Pair]:
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

        store, load = Pair(total), Pair(total)
        for _ in range(repeat):
            store.add(await tier_store(), await raw_set())
            load.add(await tier_load(), await raw_get())
        assert bytes(outs[-1]) == bytes(payloads[-1])
        stats = tier.stats()
        assert stats.errors == stats.timeouts == stats.corrupt == 0, stats
        await tier.aclose()
        return {"store": store, "load": load}
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
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--io-threads", type=int, default=4, help="DiskTier io_threads")
    parser.add_argument("--dir", default=None, help="directory for the disk files (default: a temp dir)")
    parser.add_argument("--quick", action="store_true", help="small sizes (a smoke run)")
    parser.add_argument("--skip-redis", action="store_true")
    parser.add_argument("--uvloop", action="store_true", help="run on uvloop instead of the default loop")
    args = parser.parse_args()
    if args.quick:
        args.disk_mib, args.redis_mib, args.repeat = 128, 64, 2
    payload = args.block_kib * 1024
    print(
        f"block {args.block_kib} KiB, batch {args.batch}, disk {args.disk_mib} MiB/pass, "
        f"redis {args.redis_mib} MiB/pass, best of {args.repeat}; python {sys.version.split()[0]}, "
        f"{os.cpu_count()} cpus, disk io_threads {args.io_threads}, loop {'uvloop' if args.uvloop else 'asyncio'}"
    )
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="aiokv-bench-") as tmp:
        workdir = Path(tmp)
        disk = await bench_disk(
            workdir, args.disk_mib * 1024 // args.block_kib, payload, args.batch, args.repeat, args.io_threads
        )
        print(
            f"\ndisk ({workdir}; writes buffered in the page cache; 'cold': file pages dropped with fadvise)"
        )
        print(f"  {'':10} {'tier GB/s':>10} {'plain GB/s':>11} {'ratio':>7}")
        for label, pair in disk.items():
            print(pair.row(label))
        if not args.skip_redis and shutil.which("redis-server"):
            rworkdir = workdir / "redis"
            rworkdir.mkdir()
            red = await bench_redis(
                rworkdir, args.redis_mib * 1024 // args.block_kib, payload, args.batch, args.repeat
            )
            print("\nredis (loopback, same redis-py client for the tier and the raw pipelines)")
            print(f"  {'':10} {'tier GB/s':>10} {'raw GB/s':>11} {'ratio':>7}")
            for label, pair in red.items():
                print(pair.row(label))
        else:
            print("\nredis: skipped (no redis-server or --skip-redis)")


if __name__ == "__main__":
    if "--uvloop" in sys.argv:
        import uvloop

        uvloop.run(main())
    else:
        asyncio.run(main())
