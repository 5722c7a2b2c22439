"""The vLLM-format publisher, consumed by a real ZMQ subscriber on loopback (SUB + a replay request, as vLLM's
example subscriber does): the state rebuilt from the messages equals the tiers', also after gaps healed from
the replay buffer and after falling behind it (full-state resync)."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import msgpack
import pytest
import zmq
import zmq.asyncio

from aiokv.events import KVEventLog, ZmqEventPublisher

pytestmark = pytest.mark.asyncio
HANG_GUARD_S = 30.0


def key(i: int) -> bytes:
    return i.to_bytes(32, "big")


class Subscriber:
    """A router's view: medium -> {block hash: parent}, kept current from the PUB stream and the replay."""

    def __init__(
        self, ctx: zmq.asyncio.Context, pub: str, replay: str, *, drop: set[int] | None = None
    ) -> None:
        self.sub = ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.connect(pub)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"kv-events")
        self.req = ctx.socket(zmq.DEALER)  # one request, many reply messages: a DEALER, not a strict REQ
        self.req.setsockopt(zmq.LINGER, 0)
        self.req.connect(replay)
        self.state: dict[str, dict[bytes, bytes | None]] = {}
        self.last_seq = 0
        self.drop = drop or set()  # live messages to ignore, as if lost
        self.replays = 0
        self.resyncs = 0
        self.progress = asyncio.Event()

    def apply(self, payload: bytes) -> None:
        batch = msgpack.unpackb(payload, raw=False)
        _ts, events = batch[0], batch[1]
        for ev in events:
            tag = ev[0]
            if tag == "BlockStored":
                hashes, parent, medium = ev[1], ev[2], ev[6]
                blocks = self.state.setdefault(medium, {})
                for h in hashes:
                    blocks[h] = parent
                    parent = h
            elif tag == "BlockRemoved":
                blocks = self.state.setdefault(ev[2], {})
                for h in ev[1]:
                    blocks.pop(h, None)
            elif tag == "AllBlocksCleared":
                self.state.clear()
                self.resyncs += 1
            else:  # pragma: no cover
                raise AssertionError(f"unknown event {tag}")

    async def replay_from(self, start: int) -> None:
        self.replays += 1
        await self.req.send_multipart([b"", start.to_bytes(8, "big")])
        while True:
            _empty, seq_bytes, payload = await self.req.recv_multipart()
            if not payload:
                return
            seq = int.from_bytes(seq_bytes, "big", signed=True)
            if seq > self.last_seq:
                self.apply(payload)
                self.last_seq = seq

    async def run(self) -> None:
        while True:
            if await self.sub.poll(50):
                _topic, seq_bytes, payload = await self.sub.recv_multipart()
                seq = int.from_bytes(seq_bytes, "big")
                if seq in self.drop:
                    self.drop.discard(seq)
                    continue
                if seq > self.last_seq + 1:
                    await self.replay_from(self.last_seq + 1)
                if seq > self.last_seq:
                    self.apply(payload)
                    self.last_seq = seq
            else:
                await self.replay_from(self.last_seq + 1)  # quiet: catch up on anything missed (late join)
            self.progress.set()

    async def caught_up(self, seq: int) -> None:
        while self.last_seq < seq:
            self.progress.clear()
            await self.progress.wait()

    def close(self) -> None:
        self.sub.close(0)
        self.req.close(0)


def truth(log: KVEventLog) -> dict[str, dict[bytes, bytes | None]]:
    snap = log.snapshot()
    return {snap.media[t]: {k: i.parent_hash for k, i in b.items()} for t, b in snap.tiers.items() if b}


def drive(
    log: KVEventLog, rng: random.Random, steps: int, resident: dict[str, list[bytes]], n: list[int]
) -> None:
    for _ in range(steps):
        tier = rng.choice(["cpu", "disk"])
        if rng.random() < 0.6 or not resident[tier]:
            chain = [key(n[0] + j) for j in range(rng.randint(1, 3))]
            n[0] += len(chain)
            log.stored(tier, tier.upper(), chain, None, 16, token_ids=list(range(16 * len(chain))))
            resident[tier].extend(chain)
        else:
            gone = rng.sample(resident[tier], 1)
            log.removed(tier, tier.upper(), gone)
            resident[tier].remove(gone[0])


async def run_scenario(seed: int, buffer: int, drop: set[int]) -> Subscriber:
    rng = random.Random(seed)
    log = KVEventLog()
    ctx = zmq.asyncio.Context()
    pub = ZmqEventPublisher(log, "tcp://127.0.0.1:*", "tcp://127.0.0.1:*", buffer=buffer)
    sub = Subscriber(ctx, pub.endpoint, pub.replay_endpoint or "", drop=drop)
    task: asyncio.Task[Any] | None = None
    try:
        async with pub:
            task = asyncio.create_task(sub.run())
            resident: dict[str, list[bytes]] = {"cpu": [], "disk": []}
            n = [0]
            for _ in range(40):  # 40 loop ticks of events: 40 messages
                drive(log, rng, rng.randint(1, 5), resident, n)
                await asyncio.sleep(0)
                await asyncio.sleep(0)
            await asyncio.wait_for(pub.wait_published(), HANG_GUARD_S)
            await asyncio.wait_for(sub.caught_up(pub.seq), HANG_GUARD_S)
            assert sub.state == truth(log)
            assert pub.published_events >= log.seq
    finally:
        if task is not None:
            task.cancel()
        sub.close()
        ctx.term()
    return sub


async def test_a_subscriber_rebuilds_every_tier_from_the_messages() -> None:
    sub = await run_scenario(0, buffer=10_000, drop=set())
    assert sub.last_seq > 0


async def test_gaps_heal_from_the_replay_buffer() -> None:
    sub = await run_scenario(1, buffer=10_000, drop={5, 6, 17})
    assert sub.replays >= 1


async def test_a_subscriber_behind_the_buffer_resynchronizes_from_the_full_state() -> None:
    sub = await run_scenario(2, buffer=3, drop={5, 6, 7, 8, 9, 10, 11})
    assert sub.resyncs >= 1  # an AllBlocksCleared + every block, then the tail
