"""One engine process of the many-processes tests: forked by a multiprocessing forkserver that imported this
module once (:func:`run_child`, commands and replies over a pipe), or ``python -m tests.tiers._node_worker KIND
PATH ENTRIES`` (over stdin and stdout).

A real Offloader over ``[CPUTier, shared tier]`` (KIND ``disk``: ``DiskTier(PATH, shared=True)``; ``shm``:
``SharedMemoryTier("many", directory=PATH)``; ENTRIES entries) serving the e2e test engine, whose KV is a pure
function of the prefix and is checked bit for bit on every load. It is driven by JSON commands, one per line on
stdin (one message on the pipe), and answers one JSON line each on stdout (one message):

- ``{"serve": [[seed, tokens, extra], ...]}``: serves those prompts concurrently; replies ``{"hits": [...]}``;
- ``{"flush": true}``: waits until every block was written through;
- ``{"stats": true}``: the shared tier's stats;
- ``{"tear_next_store": true}``: from now on, a store writes each entry's header and half of its payload (what a
  process killed in the middle of ``pwritev`` leaves), prints ``{"mid_store": pid}`` and blocks until the process
  is killed.

End of input closes the offloader and exits 0; a failed check raises (exit status 1, traceback on stderr; a
forked worker also sends it as ``{"error": ...}``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import sys
import threading
import traceback
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from aiokv import CPUTier, Offloader
from aiokv.tiers import DiskTier, SharedMemoryTier
from aiokv.tiers._format import HEADER_SIZE, pack_header
from aiokv.tiers.disk import _files as disk_files

from .test_hierarchy_e2e import Engine, prompt, serve

CPU_SLOTS = 64  # room to stage every block of the concurrent requests of one command


_channel: Connection | None = None  # a forked worker's pipe to the test
_send_lock = threading.Lock()


def reply(message: dict[str, Any]) -> None:
    line = json.dumps(message) + "\n"
    with _send_lock:  # replies come from the loop and from an I/O thread (mid_store): never interleaved
        if _channel is not None:
            _channel.send_bytes(line.encode())
        else:
            sys.stdout.write(line)
            sys.stdout.flush()


def next_command() -> str:
    """The next command line; "" at end of input."""
    if _channel is None:
        return sys.stdin.readline()
    try:
        return _channel.recv_bytes().decode()
    except EOFError:
        return ""


def run_child(kind: str, path: str, entries: int, channel: Connection) -> None:
    """Entry point of a worker forked by a forkserver: serve the commands arriving on ``channel``."""
    global _channel
    _channel = channel
    try:
        asyncio.run(main(kind, Path(path), entries))
    except BaseException:
        with _send_lock:
            channel.send_bytes(json.dumps({"error": traceback.format_exc()[-3000:]}).encode())
        raise SystemExit(1) from None


def tear_stores() -> None:
    def torn_write(self: Any, slots: list[int], keys: list[bytes], payloads: list[memoryview], seqs: list[int],
                   damage: Any = None) -> Any:  # fmt: skip
        for slot, key, payload, seq in zip(slots, keys, payloads, seqs, strict=True):
            seg, offset = self.geo.locate(slot)
            body = memoryview(payload).cast("B")
            os.pwrite(
                self.fds[seg], pack_header(key, self.fingerprint, body, seq) + body[: len(body) // 2], offset
            )
        reply({"mid_store": os.getpid(), "slots": len(slots)})
        threading.Event().wait()  # blocked in the store until SIGKILL

    disk_files._Files.write = torn_write  # type: ignore[method-assign]


def make_tier(kind: str, path: Path, capacity_bytes: int) -> DiskTier:
    if kind == "disk":
        return DiskTier(path, capacity_bytes, shared=True, io_threads=2)
    return SharedMemoryTier("many", capacity_bytes, directory=path)


async def main(kind: str, path: Path, entries: int) -> None:
    eng = Engine(num_blocks=1024)
    slot = eng.layout.slot_bytes
    entry_bytes = (HEADER_SIZE + slot + 4095) // 4096 * 4096
    shared = make_tier(kind, path, entries * entry_bytes)
    async with Offloader(eng.layout, tiers=[CPUTier(capacity_bytes=CPU_SLOTS * slot), shared]) as off:
        reply({"ready": os.getpid()})
        while line := await asyncio.to_thread(next_command):
            command = json.loads(line)
            if "serve" in command:
                requests = [
                    serve(
                        eng,
                        off,
                        f"{os.getpid()}-{i}-{seed}",
                        [*prompt(seed, n), *([extra] * 2 if extra else [])],
                    )
                    for i, (seed, n, extra) in enumerate(command["serve"])
                ]
                reply({"hits": list(await asyncio.gather(*requests))})
            elif "flush" in command:
                await off.flush()
                reply({"flushed": True})
            elif "stats" in command:
                stats = dataclasses.asdict(shared.stats())
                reply({"stats": {k: v for k, v in stats.items() if isinstance(v, (int, bool))}})
            elif "tear_next_store" in command:
                tear_stores()
                reply({"armed": True})
            else:
                raise ValueError(f"unknown command {command!r}")


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])))
