"""End to end: Offloaders with ``tiers=[CPUTier, DiskTier, RedisTier]`` over a real disk and redis-server.

The engine is a tiny CPU "model": the KV written for position ``p`` is a pure function of ``tokens[: p + 1]``
(exact in fp32), so every block loaded back is checked bit for bit against a recomputation, and freed blocks
are poisoned the moment the engine may reuse them.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

import aiokv
from aiokv import CPUTier, Offloader
from aiokv.testing import FakeClock as _FakeClock
from aiokv.tiers._format import TierHealth
from aiokv.tiers.disk import DiskTier
from aiokv.tiers.redis import RedisTier

pytestmark = pytest.mark.asyncio

_THIS_FILE = str(Path(__file__).resolve())
RunPy = Callable[..., subprocess.CompletedProcess[str]]
BLOCK = 4
GARBAGE = -7.0


def running_hashes(tokens: Sequence[int]) -> list[float]:
    out: list[float] = []
    h = 17
    for t in tokens:
        h = (h * 1000003 + int(t) + 1) % (1 << 23)
        out.append(float(h))
    return out


class Engine:
    """Paged KV tensors (2 tensors of (blocks, BLOCK, 8) fp32) and a block pool that poisons freed blocks."""

    def __init__(self, num_blocks: int = 64) -> None:
        self.tensors = [torch.full((num_blocks, BLOCK, 8), GARBAGE) for _ in range(2)]
        self.layout = aiokv.KVLayout(self.tensors, block_size=BLOCK, model_id="e2e-test-model")
        self.free = list(range(num_blocks))

    def alloc(self, n: int) -> list[int]:
        assert n <= len(self.free), "engine out of blocks"
        out, self.free = self.free[:n], self.free[n:]
        return out

    def release(self, blocks: Sequence[int]) -> None:
        for b in blocks:
            for i, t in enumerate(self.tensors):
                t[b].fill_(GARBAGE - i)
        self.free.extend(blocks)

    def compute(self, hashes: Sequence[float], blocks: Sequence[int], start: int, end: int) -> None:
        for p in range(start, end):
            for i, t in enumerate(self.tensors):
                t[blocks[p // BLOCK], p % BLOCK].fill_(hashes[p] + i)

    def check(self, hashes: Sequence[float], blocks: Sequence[int], num_tokens: int) -> None:
        for p in range(num_tokens):
            for i, t in enumerate(self.tensors):
                got = t[blocks[p // BLOCK], p % BLOCK]
                assert torch.all(got == hashes[p] + i), f"position {p} tensor {i}: {got}"


async def serve(eng: Engine, off: Offloader, rid: str, tokens: list[int]) -> int:
    """Prefill ``tokens`` after loading the cached prefix (checked bit for bit), finish; returns the hit."""
    req = off.open(rid, tokens)
    hit = await req.lookup()
    blocks = eng.alloc(hit // BLOCK)
    await req.load(blocks)
    hashes = running_hashes(tokens)
    eng.check(hashes, blocks, hit)
    new = eng.alloc(-(-len(tokens) // BLOCK) - len(blocks))
    blocks += new
    eng.compute(hashes, blocks, hit, len(tokens))
    req.step(len(tokens), new_token_ids=(1,), new_block_ids=new)
    await req.finish()
    eng.release(blocks)
    return hit


def prompt(seed: int, n: int) -> list[int]:
    return [(seed * 7919 + i * 31) % 50000 for i in range(n)]


def tiers(eng: Engine, cpu_blocks: int, disk: Path, url: str, namespace: str, **redis_kw: Any) -> list[Any]:
    slot = eng.layout.slot_bytes
    return [
        CPUTier(capacity_bytes=cpu_blocks * slot),
        DiskTier(disk, 64 * (slot + 4096 + 128), io_threads=2),
        RedisTier(url, namespace=namespace, **redis_kw),
    ]


async def writer_process(url: str, namespace: str, disk: str) -> None:
    """Process A: serves one long prompt and flushes it through to disk and Redis."""
    eng = Engine()
    async with Offloader(eng.layout, tiers=tiers(eng, 32, Path(disk), url, namespace)) as off:
        assert await serve(eng, off, "a", prompt(1, 4 * BLOCK * 5 + 3)) == 0
        await off.flush()
        stats = off.stats()
        print(stats.write_through_blocks, stats.tiers[2].stored_blocks, stats.tiers[1].stored_blocks)


_RUN_WRITER = """
import asyncio, importlib.util, sys
spec = importlib.util.spec_from_file_location("e2e", sys.argv[1])
mod = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mod)
asyncio.run(mod.writer_process(sys.argv[2], sys.argv[3], sys.argv[4]))
"""


async def test_two_processes_share_one_redis(
    redis_server: Any, namespace: str, tmp_path: Path, run_py: RunPy
) -> None:
    """A (another process) serves a prompt; B, with a fresh CPU tier and an empty disk tier of its own, gets
    A's whole prefix from Redis, byte-identical. Later, with Redis gone, a new process on A's disk directory
    gets the prefix from the disk tier (persistence across processes)."""
    result = await asyncio.to_thread(
        run_py, _RUN_WRITER, _THIS_FILE, redis_server.url, namespace, str(tmp_path / "a")
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["40", "20", "20"]  # 20 blocks written through to each lower tier

    tokens = [*prompt(1, 4 * BLOCK * 5 + 3), 9, 9]
    eng = Engine()
    async with Offloader(eng.layout, tiers=tiers(eng, 32, tmp_path / "b", redis_server.url, namespace)) as b:
        assert await serve(eng, b, "b", tokens) == 20 * BLOCK
        stats = b.stats()
        assert stats.staged_blocks == 20
        disk, redis = stats.tiers[1], stats.tiers[2]
        assert (disk.read_blocks, redis.read_blocks, redis.corrupt) == (0, 20, 0)

    eng = Engine()
    offline = tiers(eng, 32, tmp_path / "a", "redis://127.0.0.1:1/0", namespace, timeout_s=0.5)
    async with Offloader(eng.layout, tiers=offline) as b2:
        assert await serve(eng, b2, "b2", tokens) == 20 * BLOCK
        assert b2.stats().tiers[1].read_blocks == 20
        assert b2.stats().tiers[2].health != TierHealth.UP


def FakeClock() -> _FakeClock:
    """aiokv.testing.FakeClock, starting at 0.0 s."""
    return _FakeClock(0.0)


async def test_redis_outage_mid_workload_keeps_serving_and_recovers(
    own_redis_server: Any, tmp_path: Path
) -> None:
    """Concurrent requests run while redis-server is SIGKILLed: every request completes with correct KV,
    the lost writes are counted, health goes down; after a restart the tier comes back up and serves again."""
    clock = FakeClock()
    eng = Engine(num_blocks=256)
    kw = {"timeout_s": 0.5, "failures_to_down": 2, "backoff_s": 1.0, "clock": clock}
    lower = tiers(eng, 64, tmp_path / "disk", own_redis_server.url, "outage", **kw)
    redis_tier: RedisTier = lower[2]
    async with Offloader(eng.layout, tiers=lower) as off:
        # Wave 1: healthy.
        await asyncio.gather(*(serve(eng, off, f"w1-{i}", prompt(i, 13)) for i in range(4)))
        await off.flush()
        assert redis_tier.stats().stored_blocks == 12

        # Wave 2: the server dies after the second request of the wave has finished.
        finished = 0

        async def serve_and_maybe_kill(i: int) -> int:
            nonlocal finished
            hit = await serve(eng, off, f"w2-{i}", prompt(100 + i, 13 + 4 * i))
            finished += 1
            if finished == 2:
                own_redis_server.kill()
            return hit

        await asyncio.gather(*(serve_and_maybe_kill(i) for i in range(6)))
        await off.flush()
        for i in range(6):  # lookups after the kill: misses in Redis, still correct
            await serve(eng, off, f"w2b-{i}", prompt(200 + i, 9))
        await off.flush()
        down = redis_tier.stats()
        assert down.health == TierHealth.DOWN
        assert down.dropped > 0
        assert down.errors + down.timeouts >= 2
        assert off.stats().write_through_dropped == down.dropped  # counted by the offloader too
        assert off.stats().tiers[1].stored_blocks > 12  # the disk tier kept taking writes

        # Wave 3: restart; once the backoff has passed the next call probes and the tier is up again.
        own_redis_server.start()
        clock.now += 10
        stored_before = redis_tier.stats().stored_blocks
        await serve(eng, off, "w3-probe", prompt(299, 13))  # its lookup is the probe
        assert redis_tier.stats().health == TierHealth.UP
        await asyncio.gather(*(serve(eng, off, f"w3-{i}", prompt(300 + i, 13)) for i in range(3)))
        await off.flush()
        up = redis_tier.stats()
        assert up.health == TierHealth.UP
        assert up.reconnects == 1
        assert up.stored_blocks == stored_before + 12
        assert off.stats().requests_open == 0

    # The entries written after the restart are in Redis: a fresh process-like Offloader stages them.
    eng = Engine()
    fresh = tiers(eng, 8, tmp_path / "other-disk", own_redis_server.url, "outage", timeout_s=0.5)
    async with Offloader(eng.layout, tiers=fresh) as off2:
        assert await serve(eng, off2, "again", [*prompt(300, 13), 5]) == 12
        assert off2.stats().tiers[2].read_blocks == 3


if __name__ == "__main__":  # pragma: no cover - manual runs
    sys.exit(pytest.main([__file__, "-q"]))
