"""DiskTier(shared=True) and SharedMemoryTier: several tiers (here in one process; see test_many_processes.py
for real processes) on one directory, its catalog, and the exclusion rules between shared and exclusive use."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest

from aiokv._errors import InvalidArgumentError, TierLockedError
from aiokv.tiers import SharedMemoryTier
from aiokv.tiers._base import TierSpec
from aiokv.tiers._catalog import READY, WRITING, SharedCatalog
from aiokv.tiers._format import HEADER_SIZE, TierHealth
from aiokv.tiers.disk import DiskTier
from aiokv.tiers.disk import _files as disk_files
from aiokv.tiers.disk._files import CATALOG_NAME

from . import _entries as entries

PB = 8192  # entries of 12288 bytes
ENTRY = 12288
make_keys = entries.keys


def make_spec(payload_bytes: int = PB, fingerprint: bytes = entries.FP) -> TierSpec:
    return entries.spec(payload_bytes, fingerprint)


async def open_shared(
    path: Path, capacity_entries: int = 16, spec: TierSpec | None = None, **kw: Any
) -> DiskTier:
    tier = DiskTier(path, capacity_entries * ENTRY, shared=True, **kw)
    await tier.open(spec or make_spec())
    return tier


def segment(path: Path) -> Path:
    return path / "seg-00000.akv"


def flip_byte(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 1]))


def remove_tree(path: Path) -> None:
    for leftover in sorted(path.glob("*")):
        leftover.unlink()
    path.rmdir()


@pytest.mark.asyncio
async def test_an_entry_stored_by_one_tier_is_read_by_another(tmp_path: Path) -> None:
    a, b = await open_shared(tmp_path), await open_shared(tmp_path)
    keys, data = make_keys(6), entries.payloads(6, PB)
    assert await b.lookup(keys) == 0
    assert await a.write(keys, data) == 6
    assert await b.lookup(keys) == 6
    outs = entries.outs(6, PB)
    assert await b.read_into(keys, outs) == 6
    assert [bytes(o) for o in outs] == [bytes(d) for d in data]
    assert await b.write(keys[:3], data[:3]) == 3  # already held: skipped, counted as stored
    assert b.stats().skipped_existing == 3
    for tier in (a, b):
        stats = tier.stats()
        assert (stats.shared, stats.entries, stats.pending, stats.corrupt) == (True, 6, 0, 0)
    assert "shared" in repr(a)
    await a.aclose()
    await b.aclose()


@pytest.mark.asyncio
async def test_capacity_and_lru_eviction_hold_across_tiers(tmp_path: Path) -> None:
    """16 slots (one set): two tiers store 40 blocks in turns; at most 16 are held, the least recently used
    go first, and whatever is held reads back intact from either tier."""
    a, b = await open_shared(tmp_path), await open_shared(tmp_path)
    keys, data = make_keys(40), entries.payloads(40, PB)
    hot = keys[0]
    for i in range(1, 40):
        writer = a if i % 2 else b
        assert await writer.write([keys[i]], [data[i]]) == 1
        if i == 1:
            assert await a.write([hot], [data[0]]) == 1
        assert await (b if i % 2 else a).read_into([hot], entries.outs(1, PB)) == 1  # keeps it recent
    assert b.stats().entries == 16
    assert a.stats().evictions == 40 - 16
    assert await b.lookup([hot]) == 1
    held = [k for k in keys if await a.lookup([k])]
    assert len(held) == 16
    assert held[1:] == keys[40 - 15 :]  # the newest 15 plus the hot one
    for k in held:
        out = entries.outs(1, PB)
        assert await b.read_into([k], out) == 1
        assert bytes(out[0]) == bytes(data[keys.index(k)])
    assert segment(tmp_path).stat().st_size == 16 * ENTRY
    await a.aclose()
    await b.aclose()


@pytest.mark.asyncio
async def test_corrupt_entry_is_dropped_for_every_process(tmp_path: Path) -> None:
    a, b = await open_shared(tmp_path), await open_shared(tmp_path)
    keys, data = make_keys(3), entries.payloads(3, PB)
    assert await a.write(keys, data) == 3
    assert a._catalog is not None
    found = a._catalog.lookup(keys[1])
    assert found is not None
    flip_byte(segment(tmp_path), found[0] * ENTRY + HEADER_SIZE + 77)  # bit rot in entry 1's payload
    assert await b.read_into(keys, entries.outs(3, PB)) == 1
    assert (b.stats().corrupt, b.stats().raced) == (1, 0)
    assert await a.lookup(keys[1:2]) == 0  # dropped from the shared catalog
    assert a.stats().entries == 2
    await a.aclose()
    await b.aclose()


@pytest.mark.asyncio
async def test_an_entry_replaced_during_a_read_is_a_miss_not_corruption(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One slot. B finds K1 and starts reading; before its read reaches the file, A evicts K1 and stores K2 in
    that slot. B's verification sees another key: a miss counted as ``raced``; nothing is dropped."""
    a, b = await open_shared(tmp_path, capacity_entries=1), await open_shared(tmp_path, capacity_entries=1)
    k1, k2 = make_keys(2)
    d1, d2 = entries.payloads(2, PB)
    assert await a.write([k1], [d1]) == 1
    catalog_a = a._catalog
    files_a = a._files
    assert catalog_a is not None
    assert files_a is not None
    real_read = disk_files._Files.read

    def read_after_a_replaced_it(self: Any, slots: list[int], keys: list[bytes], outs: Any) -> Any:
        assert catalog_a.try_lock()
        _held, reservations, _ = catalog_a.reserve_locked([k2])
        ok, _err = files_a.write([r.slot for r in reservations], [k2], [d2], [1])
        assert catalog_a.commit_locked(reservations, ok) == [True]
        catalog_a.unlock()
        return real_read(self, slots, keys, outs)

    monkeypatch.setattr(disk_files._Files, "read", read_after_a_replaced_it)
    assert await b.read_into([k1], entries.outs(1, PB)) == 0
    monkeypatch.undo()
    stats = b.stats()
    assert (stats.raced, stats.corrupt) == (1, 0)
    out = entries.outs(1, PB)
    assert await b.read_into([k2], out) == 1
    assert bytes(out[0]) == bytes(d2)
    await a.aclose()
    await b.aclose()


def test_slots_of_a_dead_writer_are_reclaimed(tmp_path: Path) -> None:
    """A writer that died between reserving and committing left WRITING slots: nobody reads them, and the next
    writer needing room takes them over (its pid is gone) -- the same key or another."""
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    dead_pid = int(dead.stdout)
    fd = os.open(tmp_path / CATALOG_NAME, os.O_RDWR | os.O_CREAT)
    catalog, fresh = SharedCatalog.attach(fd, 2, ENTRY, entries.FP, ways=2, rebuild=False)
    assert fresh
    k1, k2, k3 = make_keys(3)
    assert catalog.try_lock()
    catalog._pid = dead_pid  # reserve as the dead process did
    _, (r1, r2), _ = catalog.reserve_locked([k1, k2])
    catalog._pid = os.getpid()
    assert catalog.lookup(k1) is None  # WRITING: invisible
    held, (again,), no_room = catalog.reserve_locked([k1])  # the same key: taken over
    assert (held, no_room, again.slot) == (0, 0, r1.slot)
    held, (other,), _ = catalog.reserve_locked([k3])  # another key: the dead writer's other slot
    assert other.slot == r2.slot
    assert catalog.commit_locked([r1], [True]) == [False]  # the dead writer's token no longer holds
    assert catalog.commit_locked([again, other], [True, True]) == [True, True]
    catalog.unlock()
    assert catalog.state(r1.slot) == catalog.state(r2.slot) == READY
    stats = catalog.stats()
    assert (stats.ready, stats.writing, stats.reclaimed) == (2, 0, 2)
    assert WRITING not in (catalog.state(0), catalog.state(1))
    catalog.close()


@pytest.mark.asyncio
async def test_catalog_is_rebuilt_from_the_segment_headers(tmp_path: Path) -> None:
    """Entries stored by an exclusive owner become visible to shared openers: the first shared opener makes the
    catalog from the headers (keeping the entries whose slot is in their set)."""
    keys, data = make_keys(8), entries.payloads(8, PB)
    owner = DiskTier(tmp_path, 16 * ENTRY)
    await owner.open(make_spec())
    assert await owner.write(keys, data) == 8
    await owner.aclose()
    a = await open_shared(tmp_path)  # one set of 16: every slot is in every key's set
    assert a.stats().recovered == 8
    outs = entries.outs(8, PB)
    assert await a.read_into(keys, outs) == 8
    assert [bytes(o) for o in outs] == [bytes(d) for d in data]
    await a.aclose()
    again = await open_shared(tmp_path)  # the catalog persists: found as it was
    assert again.stats().recovered == 8
    await again.aclose()


@pytest.mark.asyncio
async def test_shared_and_exclusive_openers_exclude_each_other(tmp_path: Path) -> None:
    owner = DiskTier(tmp_path, 16 * ENTRY)
    await owner.open(make_spec())
    with pytest.raises(TierLockedError, match="opened by a process that does not share it"):
        await open_shared(tmp_path)
    await owner.aclose()
    shared = await open_shared(tmp_path)
    with pytest.raises(TierLockedError, match="is already opened by another process or DiskTier"):
        await DiskTier(tmp_path, 16 * ENTRY).open(make_spec())
    await shared.aclose()


@pytest.mark.asyncio
async def test_sharers_must_agree_on_layout_and_capacity(tmp_path: Path) -> None:
    first = await open_shared(tmp_path)
    keys, data = make_keys(2), entries.payloads(2, PB)
    assert await first.write(keys, data) == 2
    other_layout = make_spec(fingerprint=entries.keys(1, "other-layout")[0])
    with pytest.raises(TierLockedError, match="shared by processes using another layout"):
        await open_shared(tmp_path, spec=other_layout)
    with pytest.raises(
        InvalidArgumentError, match=r"capacity_bytes must match the processes sharing .* got 393216"
    ):
        await open_shared(tmp_path, capacity_entries=32)
    assert await first.lookup(keys) == 2  # untouched
    await first.aclose()
    alone = await open_shared(tmp_path, capacity_entries=32)  # nobody else: resized
    assert alone.stats().num_slots == 32
    kept = [k for k in keys if await alone.lookup([k])]  # those whose slot is still in their set
    assert alone.stats().recovered == len(kept)
    for k in kept:
        out = entries.outs(1, PB)
        assert await alone.read_into([k], out) == 1
        assert bytes(out[0]) == bytes(data[keys.index(k)])
    await alone.aclose()


def test_shared_tiers_evict_by_lru_only(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgumentError, match="eviction must be 'lru' when shared=True"):
        DiskTier(tmp_path, 16 * ENTRY, shared=True, eviction="arc")
    with pytest.raises(TypeError, match="shared must be a bool, got int"):
        DiskTier(tmp_path, 16 * ENTRY, shared=1)  # type: ignore[arg-type]


@pytest.mark.asyncio
async def test_shared_memory_tier_round_trip(tmp_path: Path) -> None:
    a = SharedMemoryTier("test", 16 * ENTRY, directory=tmp_path)
    b = SharedMemoryTier("test", 16 * ENTRY, directory=tmp_path)
    await a.open(make_spec())
    await b.open(make_spec())
    assert a.path == tmp_path / "aiokv-test"
    keys, data = make_keys(4), entries.payloads(4, PB)
    assert await a.write(keys, data) == 4
    outs = entries.outs(4, PB)
    assert await b.read_into(keys, outs) == 4
    assert [bytes(o) for o in outs] == [bytes(d) for d in data]
    stats = b.stats()
    assert (stats.shared, stats.health, stats.preallocated) == (True, TierHealth.UP, True)
    assert b.name == "shm"
    await a.aclose()
    await b.aclose()


HAS_DEV_SHM = os.path.isdir("/dev/shm")


@pytest.mark.skipif(not HAS_DEV_SHM, reason="no /dev/shm on this machine")
@pytest.mark.asyncio
async def test_shared_memory_tier_in_dev_shm() -> None:
    name = f"test-{uuid.uuid4().hex[:8]}"
    tier = SharedMemoryTier(name, 4 * ENTRY)
    try:
        await tier.open(make_spec())
        keys, data = make_keys(2), entries.payloads(2, PB)
        assert await tier.write(keys, data) == 2
        assert await tier.read_into(keys, entries.outs(2, PB)) == 2
        await tier.aclose()
    finally:
        remove_tree(tier.path)


def test_shared_memory_tier_names_are_checked() -> None:
    with pytest.raises(InvalidArgumentError, match="name must be 1-64 letters, digits"):
        SharedMemoryTier("../etc", 1 << 20)
    with pytest.raises(TypeError, match="name must be a str, got int"):
        SharedMemoryTier(3, 1 << 20)  # type: ignore[arg-type]
