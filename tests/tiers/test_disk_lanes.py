"""DiskTier: staging reads (loads) never queue behind write-through writes on the tier's I/O threads."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import pytest

from aiokv.tiers._format import HEADER_SIZE
from aiokv.tiers.disk import DiskTier
from aiokv.tiers.disk import _files as disk_files

from . import _entries as entries

PB = 8192
GATE_TIMEOUT_S = 10.0  # a hang guard only: the test opens the gate long before this


async def _open(path: Path, io_threads: int) -> DiskTier:
    spec = entries.spec(PB, entries.FP)
    entry = (HEADER_SIZE + PB + 4095) // 4096 * 4096
    tier = DiskTier(path, 64 * entry, io_threads=io_threads)
    await tier.open(spec)
    return tier


@pytest.mark.asyncio
@pytest.mark.parametrize("io_threads", [2, 4])
async def test_a_read_completes_while_every_write_thread_is_stuck(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, io_threads: int
) -> None:
    """Writes are held on their I/O threads (a slow disk); a read of entries already stored runs on the
    thread writes may not take, completes with verified bytes, and is counted as having gone ahead."""
    tier = await _open(tmp_path, io_threads)
    keys = entries.keys(4)
    data = entries.payloads(4, PB)
    assert await tier.write(keys, data) == 4
    gate = threading.Event()
    stuck = threading.Semaphore(0)
    real_write = disk_files._Files.write

    def held_write(self: Any, *args: Any) -> Any:
        stuck.release()
        assert gate.wait(GATE_TIMEOUT_S), "write gate never opened"
        return real_write(self, *args)

    monkeypatch.setattr(disk_files._Files, "write", held_write)
    more = entries.keys(32, tag="later")
    writes = [
        asyncio.ensure_future(tier.write(more[i : i + 8], entries.payloads(8, PB, seed=i)))
        for i in range(0, 32, 8)
    ]
    try:
        for _ in range(io_threads - 1):  # every thread writes may take is now stuck in a write
            assert await asyncio.to_thread(stuck.acquire, True, GATE_TIMEOUT_S)
        outs = entries.outs(4, PB)
        assert await tier.read_into(keys, outs) == 4
        assert [bytes(o) for o in outs] == [bytes(d) for d in data]
        assert not any(w.done() for w in writes)
        assert tier.stats().reads_ahead_of_writes >= 1
    finally:
        gate.set()
        await asyncio.gather(*writes)
        await tier.aclose()
