"""An offloader's events on the wire: a real ZMQ SUB socket on loopback (plus a DEALER for the replay socket,
as vLLM's example subscriber does) rebuilds the CPU and disk tiers' contents from the vLLM-format messages,
also after a range of messages is lost (healed from the replay buffer) and when it joins late (full state)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import zmq
import zmq.asyncio

from aiokv import CPUTier, Offloader
from aiokv.events import ZmqEventPublisher

from ..core._sim import SimEngine
from ._consumer import tier_contents
from .test_offloader_events import BS, HANG_GUARD_S, make_disk, serve
from .test_zmq import Subscriber

pytestmark = pytest.mark.asyncio

MEDIA = {"cpu": "CPU", "disk": "DISK"}


def by_medium(contents: dict[str, set[bytes]]) -> dict[str, set[bytes]]:
    return {MEDIA[t]: keys for t, keys in contents.items() if keys}


def rebuilt(sub: Subscriber) -> dict[str, set[bytes]]:
    return {medium: set(blocks) for medium, blocks in sub.state.items() if blocks}


async def run_requests(eng: SimEngine, off: Offloader, first: int, count: int) -> None:
    for n in range(first, first + count):
        # Prompts share a 2-block stem in pairs: chains continue cached prefixes; the small tiers evict.
        tokens = [n // 2] * 8 + [1000 + n] * 5
        await serve(eng, off, f"r{n}", tokens, salt="t")
        await off.flush()


async def caught_up(pub: ZmqEventPublisher, sub: Subscriber) -> None:
    await asyncio.wait_for(pub.wait_published(), HANG_GUARD_S)
    await asyncio.wait_for(sub.caught_up(pub.seq), HANG_GUARD_S)


async def test_a_zmq_subscriber_rebuilds_the_tiers_and_heals_a_gap_from_the_replay_buffer(
    tmp_path: Path,
) -> None:
    eng = SimEngine(num_blocks=64, block_size=BS)
    disk = make_disk(tmp_path, 10)
    ctx = zmq.asyncio.Context()
    tasks: list[asyncio.Task[Any]] = []
    subs: list[Subscriber] = []
    try:
        async with Offloader(
            eng.layout,
            tiers=[CPUTier(capacity_bytes=6 * eng.layout.slot_bytes), disk],
            kv_events_endpoint="tcp://127.0.0.1:*",
            kv_events_replay_endpoint="tcp://127.0.0.1:*",
        ) as off:
            pub = off.kv_events_publisher
            assert pub is not None
            assert pub.replay_endpoint is not None
            # Messages 3..6 are lost on the way: the subscriber notices the gap at 7 and asks the replay socket.
            sub = Subscriber(ctx, pub.endpoint, pub.replay_endpoint, drop={3, 4, 5, 6})
            subs.append(sub)
            tasks.append(asyncio.create_task(sub.run()))
            await run_requests(eng, off, 0, 12)
            await caught_up(pub, sub)
            assert sub.replays >= 1
            assert pub.seq > 6
            assert rebuilt(sub) == by_medium(tier_contents(off, disk))
            # A subscriber joining now gets every message so far from the replay buffer.
            late = Subscriber(ctx, pub.endpoint, pub.replay_endpoint)
            subs.append(late)
            tasks.append(asyncio.create_task(late.run()))
            await caught_up(pub, late)
            assert rebuilt(late) == by_medium(tier_contents(off, disk))
            await run_requests(eng, off, 12, 6)
            await caught_up(pub, sub)
            await caught_up(pub, late)
            assert rebuilt(sub) == rebuilt(late) == by_medium(tier_contents(off, disk))
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for s in subs:
            s.close()
        ctx.term()


async def test_a_late_subscriber_behind_the_replay_buffer_gets_the_full_state(tmp_path: Path) -> None:
    """The documented way to run a publisher of one's own (here with a 3-message buffer): a subscriber that
    joins after the buffer moved on gets one message holding every tier's blocks, then the live tail."""
    eng = SimEngine(num_blocks=64, block_size=BS)
    disk = make_disk(tmp_path, 10)
    ctx = zmq.asyncio.Context()
    tasks: list[asyncio.Task[Any]] = []
    subs: list[Subscriber] = []
    try:
        async with Offloader(
            eng.layout, tiers=[CPUTier(capacity_bytes=6 * eng.layout.slot_bytes), disk], kv_events=True
        ) as off:
            assert off.event_log is not None
            async with ZmqEventPublisher(
                off.event_log, "tcp://127.0.0.1:*", "tcp://127.0.0.1:*", buffer=3
            ) as pub:
                await run_requests(eng, off, 0, 8)
                await asyncio.wait_for(pub.wait_published(), HANG_GUARD_S)
                assert pub.seq > 3
                assert pub.replay_endpoint is not None
                late = Subscriber(ctx, pub.endpoint, pub.replay_endpoint)
                subs.append(late)
                tasks.append(asyncio.create_task(late.run()))
                await caught_up(pub, late)
                assert late.resyncs == 1  # one AllBlocksCleared: the full state
                assert rebuilt(late) == by_medium(tier_contents(off, disk))
                await run_requests(eng, off, 8, 6)
                await caught_up(pub, late)
                assert rebuilt(late) == by_medium(tier_contents(off, disk))
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for s in subs:
            s.close()
        ctx.term()
