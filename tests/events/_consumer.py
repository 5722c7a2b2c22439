"""A consumer of an offloader's event stream: the per-tier state a router would keep, rebuilt from events."""

from __future__ import annotations

import asyncio
from typing import Any

from aiokv import Offloader
from aiokv.events import BlockInfo, EventKind, KVEvent, KVEventStream, KVSnapshot
from aiokv.tiers import DiskTier


class Consumer:
    """Applies a :class:`KVEventStream` to tier -> {block hash: BlockInfo}, checking each event's order."""

    def __init__(self, stream: KVEventStream) -> None:
        self.stream = stream
        self.state: dict[str, dict[bytes, BlockInfo]] = {}
        self.media: dict[str, str] = {}
        self.seq = 0
        self.snapshots = 0
        self.events: list[KVEvent] = []
        self.progress = asyncio.Event()
        self.ended = False

    def apply(self, item: KVEvent | KVSnapshot) -> None:
        if isinstance(item, KVSnapshot):
            self.snapshots += 1
            assert item.seq >= self.seq
            self.state = {t: dict(b) for t, b in item.tiers.items()}
            self.media = dict(item.media)
            self.seq = item.seq
            return
        assert item.seq == self.seq + 1, f"event {item.seq} after {self.seq}: out of order or lost"
        self.seq = item.seq
        self.events.append(item)
        blocks = self.state.setdefault(item.tier, {})
        self.media[item.tier] = item.medium
        if item.kind is EventKind.STORED:
            parent = item.parent_hash
            for key, n in zip(item.block_hashes, item.token_counts, strict=True):
                blocks[key] = BlockInfo(parent, n, item.tenant)
                parent = key
        elif item.kind is EventKind.REMOVED:
            for key in item.block_hashes:
                assert key in blocks, "a removed event for a block never reported stored"
                del blocks[key]
        else:
            blocks.clear()

    async def run(self, pause: asyncio.Event | None = None) -> None:
        async for item in self.stream:
            if pause is not None:
                await pause.wait()
            self.apply(item)
            self.progress.set()
        self.ended = True
        self.progress.set()

    async def caught_up(self, seq: int) -> None:
        while self.seq < seq and not self.ended:
            self.progress.clear()
            await self.progress.wait()

    def blocks(self) -> dict[str, set[bytes]]:
        return {t: set(b) for t, b in self.state.items()}


def tier_contents(off: Offloader, disk: DiskTier | None = None, name: str = "disk") -> dict[str, set[bytes]]:
    """What the tiers really hold (READY entries: what a lookup finds)."""
    out = {"cpu": set(off.cpu.index.ready_keys())}
    if disk is not None:
        out[name] = set(disk._local().ready_keys())
    return out


def meta(off: Offloader, prompts: list[tuple[Any, list[int]]]) -> dict[bytes, tuple[bytes | None, Any]]:
    """block hash -> (parent hash, tenant) of every full block of ``prompts`` ((salt, tokens) pairs)."""
    import aiokv

    out: dict[bytes, tuple[bytes | None, Any]] = {}
    for salt, tokens in prompts:
        hashes = aiokv.block_hashes(tokens, off.block_size, salt=salt, root=off.layout.root)
        for i, h in enumerate(hashes):
            out[h] = (hashes[i - 1] if i else None, salt)
    return out
