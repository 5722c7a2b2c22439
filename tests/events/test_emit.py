"""TierEvents groups a tier's committed blocks into chains: one stored event per run of blocks that continue
each other under one tenant, with their token counts and (when every block's are known) token ids."""

from __future__ import annotations

from aiokv.events import BlockInfo, EventKind, KVEventLog, TierEvents


def key(i: int) -> bytes:
    return i.to_bytes(32, "big")


def test_consecutive_blocks_of_one_chain_and_tenant_are_one_event() -> None:
    log = KVEventLog()
    ev = TierEvents(log, "cpu", "CPU", 4)
    ev.stored(
        [key(1), key(2), key(3), key(9), key(10)],
        [
            (None, 4, "a", [1, 2, 3, 4]),
            (key(1), 4, "a", [5, 6, 7, 8]),
            (key(2), 2, "a", [9, 10]),
            (key(5), 4, "b", None),  # another chain: its parent is not the block before
            (key(9), 4, "c", [0, 0, 0, 0]),  # same chain, another tenant
        ],
    )
    events = log.events_since(0)
    assert events is not None
    assert [(e.block_hashes, e.parent_hash, e.tenant) for e in events] == [
        ((key(1), key(2), key(3)), None, "a"),
        ((key(9),), key(5), "b"),
        ((key(10),), key(9), "c"),
    ]
    assert events[0].token_counts == (4, 4, 2)
    assert events[0].token_ids == (1, 2, 3, 4, 5, 6, 7, 8, 9, 10)
    assert events[1].token_ids is None
    assert log.block("cpu", key(3)) == BlockInfo(key(2), 2, "a")


def test_blocks_stored_without_metadata_are_resolved_or_reported_as_full_blocks() -> None:
    log = KVEventLog()
    cpu = TierEvents(log, "cpu", "CPU", 4)
    cpu.stored([key(1), key(2)], [(None, 4, "t", None), (key(1), 3, "t", None)])
    disk = TierEvents(log, "disk", "DISK", 4, lambda k: log.block("cpu", k))
    disk.stored([key(1), key(2), key(7)])
    events = log.events_since(1)
    assert events is not None
    assert [(e.block_hashes, e.parent_hash, e.token_counts, e.tenant) for e in events] == [
        ((key(1), key(2)), None, (4, 3), "t"),
        ((key(7),), None, (4,), None),
    ]


def test_removals_of_blocks_never_reported_stored_are_ignored() -> None:
    log = KVEventLog()
    ev = TierEvents(log, "disk", "DISK", 4)
    ev.removed([key(1)])
    assert log.seq == 0
    ev.stored([key(1)])
    assert ev.holds(key(1))
    ev.removed([key(1), key(2)])
    ev.cleared()
    kinds = [(e.kind, e.block_hashes) for e in log.events_since(0) or []]
    assert kinds == [(EventKind.STORED, (key(1),)), (EventKind.REMOVED, (key(1),)), (EventKind.CLEARED, ())]
    assert log.snapshot().tiers == {"disk": {}}
