"""Follow which blocks every tier holds: a consumer of ``Offloader.events()`` keeps a router's index."""

import asyncio

import torch

import aiokv
from aiokv.events import EventKind, KVEvent, KVSnapshot


class RouterIndex:
    """tier -> block hashes, kept current from the event stream (what a KV-aware router keeps per instance)."""

    def __init__(self) -> None:
        self.tiers: dict[str, set[bytes]] = {}
        self.seq = 0
        self.progress = asyncio.Event()

    def apply(self, item: KVEvent | KVSnapshot) -> None:
        if isinstance(item, KVSnapshot):  # first item, and again after falling behind the replay buffer
            self.tiers = {tier: set(blocks) for tier, blocks in item.tiers.items()}
        elif item.kind is EventKind.STORED:
            self.tiers.setdefault(item.tier, set()).update(item.block_hashes)
        elif item.kind is EventKind.REMOVED:
            self.tiers[item.tier].difference_update(item.block_hashes)
        else:  # CLEARED
            self.tiers[item.tier].clear()
        self.seq = item.seq
        self.progress.set()

    async def wait_seq(self, seq: int) -> None:
        """Wait until the index includes event ``seq``."""
        while self.seq < seq:
            self.progress.clear()
            await self.progress.wait()


async def main() -> None:
    kv = [torch.randn(64, 16, 8, 64) for _ in range(2 * 4)]
    layout = aiokv.KVLayout(kv, block_size=16)
    cpu = aiokv.CPUTier(capacity_bytes=4 * layout.slot_bytes)  # room for 4 blocks: evictions will happen
    index = RouterIndex()
    async with aiokv.Offloader(layout, tiers=[cpu], kv_events=True) as off:

        async def follow() -> None:
            async for item in off.events():  # ends after the offloader closes
                index.apply(item)

        consumer = asyncio.create_task(follow())
        for n in range(3):
            req = off.open(f"req-{n}", [100 * n + t for t in range(40)], salt="tenant-a")
            await req.lookup()
            req.step(40, new_token_ids=[7], new_block_ids=[0, 1, 2])  # two full blocks stored
            await req.finish()
        log = off.event_log
        assert log is not None
        await index.wait_seq(log.seq)  # let the consumer catch up
        assert index.tiers["cpu"] == set(off.kv_snapshot().tiers["cpu"])
        print(f"after {log.seq} events the router sees {len(index.tiers['cpu'])} blocks in the CPU tier")
    await consumer
    print("closed: the router sees", {tier: len(blocks) for tier, blocks in index.tiers.items()})


asyncio.run(main())
