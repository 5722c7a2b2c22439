"""The KV event log: ordered events, replay from a sequence number, snapshots for consumers that fall behind."""

from __future__ import annotations

import asyncio
import random

import pytest

from aiokv import InvalidArgumentError
from aiokv.events import EventKind, KVEvent, KVEventLog, KVSnapshot

pytestmark = pytest.mark.asyncio


def key(i: int) -> bytes:
    return i.to_bytes(32, "big")


def apply(state: dict[str, dict[bytes, bytes | None]], item: KVEvent | KVSnapshot) -> None:
    """What a consumer does: replace its state with a snapshot, or apply one event."""
    if isinstance(item, KVSnapshot):
        state.clear()
        for tier, blocks in item.tiers.items():
            state[tier] = {k: info.parent_hash for k, info in blocks.items()}
        return
    blocks = state.setdefault(item.tier, {})
    if item.kind is EventKind.STORED:
        parent = item.parent_hash
        for k in item.block_hashes:
            blocks[k] = parent
            parent = k
    elif item.kind is EventKind.REMOVED:
        for k in item.block_hashes:
            del blocks[k]
    else:
        blocks.clear()


def truth(log: KVEventLog) -> dict[str, dict[bytes, bytes | None]]:
    return {t: {k: i.parent_hash for k, i in b.items()} for t, b in log.snapshot().tiers.items()}


async def test_events_are_numbered_in_order_and_carry_what_a_router_needs() -> None:
    log = KVEventLog()
    log.stored("cpu", "CPU", [key(1), key(2)], None, 16, token_ids=list(range(32)), tenant="acme")
    log.stored("disk", "DISK", [key(1)], None, 16)
    log.removed("cpu", "CPU", [key(2), key(99)])  # unknown keys are not removals
    log.cleared("disk", "DISK")
    events = log.events_since(0)
    assert events is not None
    assert [e.seq for e in events] == [1, 2, 3, 4]
    assert [e.kind for e in events] == [
        EventKind.STORED,
        EventKind.STORED,
        EventKind.REMOVED,
        EventKind.CLEARED,
    ]
    first = events[0]
    assert (first.tier, first.medium, first.parent_hash, first.block_size) == ("cpu", "CPU", None, 16)
    assert first.token_counts == (16, 16)
    assert first.tenant == "acme"
    assert first.token_ids is not None
    assert len(first.token_ids) == 32
    assert events[2].block_hashes == (key(2),)
    assert log.events_since(2) == events[2:]
    snap = log.snapshot()
    assert snap.seq == 4
    assert set(snap.tiers["cpu"]) == {key(1)}
    assert snap.tiers["disk"] == {}


async def test_a_consumer_behind_the_buffer_gets_a_snapshot() -> None:
    log = KVEventLog(buffer=4)
    for i in range(10):
        log.stored("cpu", "CPU", [key(i)], None, 16)
    assert log.events_since(3) is None  # events 4..6 have left the buffer
    assert log.events_since(6) is not None
    stream = log.subscribe(from_seq=3)
    first = await stream.__anext__()
    assert isinstance(first, KVSnapshot)
    assert first.seq == 10


@pytest.mark.parametrize("seed", range(5))
async def test_a_subscriber_rebuilds_the_tiers_whatever_it_misses(seed: int) -> None:
    """Random stores, removals and clears, and a consumer that is slow at random: whatever it receives
    (events, or a snapshot when it fell behind the buffer), its state equals the tiers' at the end."""
    rng = random.Random(seed)
    log = KVEventLog(buffer=rng.choice([3, 10, 1000]))
    state: dict[str, dict[bytes, bytes | None]] = {}
    got: list[KVEvent | KVSnapshot] = []
    done = asyncio.Event()

    async def consume() -> None:
        async for item in log.subscribe():
            apply(state, item)
            got.append(item)
            if rng.random() < 0.3:
                await asyncio.sleep(0)  # a slow consumer: lets the producer run ahead
        done.set()

    task = asyncio.create_task(consume())
    resident: dict[str, list[bytes]] = {"cpu": [], "disk": []}
    n = 0
    for _ in range(300):
        tier = rng.choice(["cpu", "disk"])
        r = rng.random()
        if r < 0.55:
            chain = [key(n + j) for j in range(rng.randint(1, 4))]
            n += len(chain)
            log.stored(tier, tier.upper(), chain, rng.choice([None, *resident[tier][-3:]]), 16)
            resident[tier].extend(chain)
        elif r < 0.95 and resident[tier]:
            gone = rng.sample(resident[tier], rng.randint(1, min(3, len(resident[tier]))))
            log.removed(tier, tier.upper(), gone)
            resident[tier] = [k for k in resident[tier] if k not in gone]
        elif r >= 0.95:
            log.cleared(tier, tier.upper())
            resident[tier] = []
        if rng.random() < 0.2:
            await asyncio.sleep(0)
    log.close()
    await done.wait()
    await task
    assert state == truth(log)
    assert any(isinstance(i, KVSnapshot) for i in got)


async def test_closing_ends_subscriptions_after_what_is_buffered() -> None:
    log = KVEventLog()
    stream = log.subscribe(from_seq=0)
    log.stored("cpu", "CPU", [key(1)], None, 16)
    log.close()
    items = [i async for i in stream]
    assert [type(i) for i in items] == [KVEvent]


async def test_bad_buffer_is_a_clear_error() -> None:
    with pytest.raises(InvalidArgumentError, match="buffer must be an int >= 1, got 0"):
        KVEventLog(buffer=0)
