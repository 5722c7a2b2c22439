"""Four engine processes on one machine share one cache: a DiskTier directory (``shared=True``) or a
SharedMemoryTier, each behind its own real Offloader (see ``_node_worker.py``). Every load is checked bit for bit
against a recomputation inside the processes; a process that sees wrong bytes exits non-zero.

Phases are driven by commands and replies over pipes: nothing here sleeps; every wait is bounded.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import os
import shutil
import signal
import uuid
from collections.abc import AsyncIterator, Iterator
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from . import _node_worker

REPLY_TIMEOUT_S = 60.0
BLOCKS = 6  # full blocks of one prompt (25 tokens, BLOCK 4)
TOKENS = 25

pytestmark = pytest.mark.asyncio(loop_factories=["asyncio"])


# Workers are forked by a forkserver that imported torch, aiokv and the worker once: starting one costs a fork,
# not seconds of imports. They are still separate processes, killed with SIGKILL by PID.
_FORKS = multiprocessing.get_context("forkserver")
_FORKS.set_forkserver_preload(["tests.tiers._node_worker"])


class Worker:
    """One engine process, driven message by message over a pipe."""

    def __init__(self, proc: BaseProcess, channel: Connection) -> None:
        self.proc = proc
        self.channel = channel
        self.pid = proc.pid

    @classmethod
    async def start(cls, kind: str, path: Path, entries: int) -> Worker:
        ours, theirs = _FORKS.Pipe()
        proc = _FORKS.Process(
            target=_node_worker.run_child, args=(kind, str(path), entries, theirs), daemon=True
        )
        try:
            await asyncio.to_thread(proc.start)
        finally:
            theirs.close()
        worker = cls(proc, ours)
        assert "ready" in await worker.read()
        return worker

    async def read(self) -> dict[str, Any]:
        if not await asyncio.to_thread(self.channel.poll, REPLY_TIMEOUT_S):
            raise AssertionError(f"worker {self.pid} did not answer within {REPLY_TIMEOUT_S} s")
        try:
            data = self.channel.recv_bytes()
        except EOFError:
            raise AssertionError(f"worker {self.pid} exited with {await self.wait()}") from None
        message: dict[str, Any] = json.loads(data)
        if "error" in message:
            raise AssertionError(f"worker {self.pid} failed: {message['error']}")
        return message

    async def send(self, command: dict[str, Any]) -> None:
        self.channel.send_bytes(json.dumps(command).encode())

    async def call(self, command: dict[str, Any]) -> dict[str, Any]:
        await self.send(command)
        return await self.read()

    async def serve(self, prompts: list[tuple[int, int, int]]) -> list[int]:
        hits: list[int] = (await self.call({"serve": prompts}))["hits"]
        return hits

    async def stats(self) -> dict[str, Any]:
        stats: dict[str, Any] = (await self.call({"stats": True}))["stats"]
        return stats

    async def wait(self) -> int | None:
        """The exit status once the process has ended (-SIGNAL when killed); a hang guard bounds the wait."""
        await asyncio.to_thread(self.proc.join, REPLY_TIMEOUT_S)
        return self.proc.exitcode

    async def close(self) -> None:
        """End of input: the process closes its offloader and must exit 0."""
        self.channel.close()
        assert await self.wait() == 0

    def kill(self) -> None:
        if self.proc.exitcode is None and self.pid is not None:
            os.kill(self.pid, signal.SIGKILL)


@pytest.fixture(params=["disk", "shm"])
def node_cache(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """Where the processes' shared tier lives: a disk directory, or a directory in /dev/shm (a tmpfs)."""
    if request.param == "disk":
        yield "disk", tmp_path / "cache"
        return
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm on this machine")
    directory = Path("/dev/shm") / f"aiokv-test-{uuid.uuid4().hex[:8]}"
    directory.mkdir()
    try:
        yield "shm", directory
    finally:
        shutil.rmtree(directory, ignore_errors=True)


@pytest_asyncio.fixture
async def start_workers() -> AsyncIterator[Any]:
    started: list[Worker] = []

    async def start(n: int, kind: str, path: Path, entries: int) -> list[Worker]:
        workers = list(await asyncio.gather(*(Worker.start(kind, path, entries) for _ in range(n))))
        started.extend(workers)
        return workers

    try:
        yield start
    finally:
        for worker in started:
            worker.kill()
            await worker.wait()
            worker.channel.close()
            worker.proc.close()


def prompts(seeds: range | list[int], extra: int = 0) -> list[tuple[int, int, int]]:
    return [(seed, TOKENS, extra) for seed in seeds]


async def test_four_processes_share_one_cache(node_cache: tuple[str, Path], start_workers: Any) -> None:
    """Each process stores its own prompts; each then finds every block another process stored, complete
    and exact; then all four churn through more prompts than the cache holds, concurrently: capacity and
    eviction hold across the processes and nothing read is ever wrong."""
    kind, path = node_cache
    entries = 256
    workers: list[Worker] = await start_workers(4, kind, path, entries)
    own = [range(100 * i, 100 * i + 5) for i in range(4)]
    assert await asyncio.gather(*(w.serve(prompts(own[i])) for i, w in enumerate(workers))) == [[0] * 5] * 4
    await asyncio.gather(*(w.call({"flush": True}) for w in workers))
    others = await asyncio.gather(
        *(w.serve(prompts(own[(i + 1) % 4], extra=7)) for i, w in enumerate(workers))
    )
    assert others == [[BLOCKS * 4] * 5] * 4  # every block of every other process, loaded and checked

    pool = [seed for r in own for seed in r] + list(range(1000, 1050))  # 70 prompts: 420 blocks > 256
    churn = [[pool[(7 * i + 13 * j) % len(pool)] for j in range(25)] for i in range(4)]
    results = await asyncio.gather(*(w.serve(prompts(churn[i], extra=3)) for i, w in enumerate(workers)))
    assert sum(h > 0 for hits in results for h in hits) > 0
    await asyncio.gather(*(w.call({"flush": True}) for w in workers))
    stats = await asyncio.gather(*(w.stats() for w in workers))
    for s in stats:
        assert s["shared"]
        assert (s["corrupt"], s["read_errors"], s["dropped_io_error"]) == (0, 0, 0)
        assert s["num_slots"] == entries
    last = stats[-1]
    assert 0 < last["entries"] <= entries
    assert last["evictions"] > 0
    assert sum(s["read_blocks"] for s in stats) > 0
    tier_dir = path if kind == "disk" else path / "aiokv-many"
    assert sum(p.stat().st_size for p in tier_dir.glob("seg-*.akv")) == entries * stats[0]["entry_bytes"]
    for worker in workers:
        await worker.close()


async def test_writer_killed_mid_store_never_corrupts_what_the_others_see(
    tmp_path: Path, start_workers: Any
) -> None:
    """Process 0 is SIGKILLed while its store has left torn entries (headers and half payloads) in slots it
    reserved. The other three keep serving meanwhile and afterwards with exact KV; the dead writer's slots are
    invisible, then reclaimed by the processes that store those blocks themselves."""
    path = tmp_path / "cache"
    workers: list[Worker] = await start_workers(4, "disk", path, 64)
    victim, readers = workers[0], workers[1:]
    mine = [range(100 * i, 100 * i + 2) for i in range(1, 4)]
    await asyncio.gather(*(r.serve(prompts(mine[i])) for i, r in enumerate(readers)))
    await asyncio.gather(*(r.call({"flush": True}) for r in readers))

    assert await victim.call({"tear_next_store": True}) == {"armed": True}
    await victim.send({"serve": prompts(range(500, 503))})
    seen: dict[str, Any] = {}
    while "mid_store" not in seen or "hits" not in seen:
        seen.update(await victim.read())
    assert seen["hits"] == [0, 0, 0]
    # The victim is blocked inside its store: torn entries on disk, their slots reserved.
    during = await asyncio.gather(
        *(r.serve(prompts(mine[(i + 1) % 3], extra=5)) for i, r in enumerate(readers))
    )
    assert during == [[BLOCKS * 4] * 2] * 3
    victim.kill()
    assert await victim.wait() == -signal.SIGKILL
    pending = (await readers[0].stats())["pending"]
    assert pending >= seen["slots"]  # the dead writer's reservations, unread

    # The blocks the victim was storing: missed, stored again (reclaiming its slots), then found by all.
    await asyncio.gather(*(r.serve(prompts(range(500, 503))) for r in readers))
    await asyncio.gather(*(r.call({"flush": True}) for r in readers))
    found = await asyncio.gather(*(r.serve(prompts(range(500, 503), extra=9)) for r in readers))
    assert found == [[BLOCKS * 4] * 3] * 3
    stats = await asyncio.gather(*(r.stats() for r in readers))
    assert all(s["corrupt"] == 0 for s in stats)
    assert stats[0]["reclaimed"] >= seen["slots"]
    assert stats[0]["pending"] == 0
    for reader in readers:
        await reader.close()
