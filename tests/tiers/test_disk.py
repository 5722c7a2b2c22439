"""DiskTier against the real filesystem: persistence, verification, recovery, locking, full disks."""

from __future__ import annotations

import asyncio
import errno
import hashlib
import os
import random
import subprocess
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from aiokv._errors import CapacityError, ClosedError, InvalidArgumentError, TierLockedError
from aiokv.tiers._base import TierSpec
from aiokv.tiers._format import HEADER_SIZE, TierHealth
from aiokv.tiers.disk import DiskTier
from aiokv.tiers.disk import _files as disk_files
from aiokv.tiers.disk import _tier as disk_tier
from aiokv.tiers.disk._files import LOCK_NAME, META_NAME

from . import _entries as entries
from ._entries import FP, RunPy

PB = 8192  # payload bytes: entries are 12288 bytes with 3968 bytes of padding
make_keys = entries.keys


def make_spec(payload_bytes: int = PB, fingerprint: bytes = FP) -> TierSpec:
    return entries.spec(payload_bytes, fingerprint)


def make_payloads(n: int, payload_bytes: int = PB, seed: int = 0) -> list[memoryview]:
    return entries.payloads(n, payload_bytes, seed)


def make_outs(n: int, payload_bytes: int = PB) -> list[memoryview]:
    return entries.outs(n, payload_bytes)


async def open_tier(
    path: Path, capacity_entries: int = 16, spec: TierSpec | None = None, **kw: object
) -> DiskTier:
    spec = spec or make_spec()
    entry = (HEADER_SIZE + spec.payload_bytes + 4095) // 4096 * 4096
    tier = DiskTier(path, capacity_entries * entry, **kw)  # type: ignore[arg-type]
    await tier.open(spec)
    return tier


def segment(path: Path, number: int = 0) -> Path:
    return path / f"seg-{number:05d}.akv"


def flip_byte(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x40]))


def overwrite(path: Path, offset: int, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def segment_names(path: Path) -> list[str]:
    return sorted(p.name for p in path.glob("seg-*"))


@pytest.mark.asyncio
@pytest.mark.parametrize("payload_bytes", [PB, 4096 - HEADER_SIZE, 1000])
async def test_write_lookup_read_round_trip_is_byte_identical(tmp_path: Path, payload_bytes: int) -> None:
    tier = await open_tier(tmp_path, spec=make_spec(payload_bytes))
    keys, data = make_keys(6), make_payloads(6, payload_bytes)
    assert await tier.write(keys, data) == 6
    assert await tier.lookup(keys) == 6
    assert await tier.lookup([*keys[:3], b"x" * 32, keys[4]]) == 3
    outs = make_outs(6, payload_bytes)
    assert await tier.read_into(keys, outs) == 6
    assert [bytes(o) for o in outs] == [bytes(d) for d in data]
    stats = tier.stats()
    assert (stats.stored_blocks, stats.read_blocks, stats.corrupt, stats.health) == (6, 6, 0, TierHealth.UP)
    assert stats.entries == 6
    await tier.aclose()


@pytest.mark.asyncio
async def test_existing_keys_are_skipped_and_count_as_stored(tmp_path: Path) -> None:
    tier = await open_tier(tmp_path)
    keys, data = make_keys(3), make_payloads(3)
    assert await tier.write(keys[:2], data[:2]) == 2
    assert await tier.write(keys, data) == 3
    stats = tier.stats()
    assert (stats.stored_blocks, stats.skipped_existing) == (3, 2)
    await tier.aclose()


@pytest.mark.asyncio
async def test_eviction_keeps_the_most_recent_entries(tmp_path: Path) -> None:
    tier = await open_tier(tmp_path, capacity_entries=4)
    keys, data = make_keys(6), make_payloads(6)
    assert await tier.write(keys[:4], data[:4]) == 4
    assert await tier.read_into(keys[:1], make_outs(1)) == 1  # keys[0] is now the most recent
    assert await tier.write(keys[4:], data[4:]) == 2
    assert await tier.lookup(keys[:1]) == 1
    assert await tier.lookup(keys[1:2]) == 0
    assert await tier.lookup(keys[2:3]) == 0
    assert await tier.lookup(keys[3:]) == 3
    outs = make_outs(3)
    assert await tier.read_into(keys[3:], outs) == 3
    assert [bytes(o) for o in outs] == [bytes(d) for d in data[3:]]
    assert tier.stats().evictions == 2
    await tier.aclose()


@pytest.mark.asyncio
async def test_restart_serves_previous_entries_byte_identical(tmp_path: Path) -> None:
    keys, data = make_keys(10), make_payloads(10)
    tier = await open_tier(tmp_path)
    assert await tier.write(keys[:6], data[:6]) == 6
    assert await tier.write(keys[6:], data[6:]) == 4
    await tier.aclose()

    tier = await open_tier(tmp_path)
    assert tier.stats().recovered == 10
    assert await tier.lookup(keys) == 10
    outs = make_outs(10)
    assert await tier.read_into(keys, outs) == 10
    assert [bytes(o) for o in outs] == [bytes(d) for d in data]
    # New writes after a restart do not clobber recovered entries.
    more_keys, more = make_keys(4, "b"), make_payloads(4, seed=1)
    assert await tier.write(more_keys, more) == 4
    assert await tier.read_into(keys, make_outs(10)) == 10
    await tier.aclose()


@pytest.mark.asyncio
async def test_recovery_evicts_oldest_writes_first(tmp_path: Path) -> None:
    keys, data = make_keys(4), make_payloads(4)
    tier = await open_tier(tmp_path, capacity_entries=4)
    for k, d in zip(keys, data, strict=True):
        assert await tier.write([k], [d]) == 1
    await tier.aclose()
    tier = await open_tier(tmp_path, capacity_entries=4)
    assert await tier.write(make_keys(1, "new"), make_payloads(1, seed=5)) == 1
    assert await tier.lookup(keys[:1]) == 0
    assert await tier.lookup(keys[1:]) == 3
    await tier.aclose()


@pytest.mark.asyncio
async def test_corrupt_payload_byte_misses_only_that_entry(tmp_path: Path) -> None:
    """A byte of entry 2's payload is flipped on disk behind the tier's back (bit rot, a torn rewrite)."""
    keys, data = make_keys(5), make_payloads(5)
    tier = await open_tier(tmp_path)
    assert await tier.write(keys, data) == 5
    entry = tier.stats().entry_bytes
    flip_byte(segment(tmp_path), 2 * entry + HEADER_SIZE + 1234)

    outs = make_outs(5)
    assert await tier.read_into(keys, outs) == 2  # stops at the corrupt entry
    assert [bytes(o) for o in outs[:2]] == [bytes(d) for d in data[:2]]
    assert tier.stats().corrupt == 1
    assert await tier.lookup(keys[2:3]) == 0  # dropped
    outs = make_outs(2)
    assert await tier.read_into(keys[3:], outs) == 2
    assert [bytes(o) for o in outs] == [bytes(d) for d in data[3:]]
    await tier.aclose()

    tier = await open_tier(tmp_path)  # the corrupt entry was erased on disk, not resurrected
    assert tier.stats().recovered == 4
    assert await tier.lookup(keys) == 2
    await tier.aclose()


@pytest.mark.asyncio
async def test_multi_run_reads_verify_in_order_while_reading_ahead(tmp_path: Path) -> None:
    """Keys in reverse slot order make every entry its own run, so checksums run on the verifier thread
    while the next run is read; the result must still stop exactly at the corrupt entry."""
    keys, data = make_keys(6), make_payloads(6)
    tier = await open_tier(tmp_path)
    assert await tier.write(keys, data) == 6
    rev_keys, rev_data = keys[::-1], data[::-1]
    outs = make_outs(6)
    assert await tier.read_into(rev_keys, outs) == 6
    assert [bytes(o) for o in outs] == [bytes(d) for d in rev_data]

    flip_byte(segment(tmp_path), 2 * tier.stats().entry_bytes + HEADER_SIZE + 7)
    outs = make_outs(6)
    assert await tier.read_into(rev_keys, outs) == 3  # entries 5, 4, 3 pass; entry 2 is corrupt
    assert [bytes(o) for o in outs[:3]] == [bytes(d) for d in rev_data[:3]]
    assert tier.stats().corrupt == 1
    assert await tier.lookup(keys[2:3]) == 0
    assert await tier.lookup(keys[:2]) == 2
    await tier.aclose()


@pytest.mark.asyncio
async def test_warm_reads_split_over_io_threads_keep_prefix_semantics(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Entries in the page cache are read by several I/O threads at once; the result is still the verified
    leading run, and a corrupt entry in a later part stops the count exactly there."""
    monkeypatch.setattr(disk_tier, "_SPLIT_BYTES", 2 * PB)  # split even these small reads
    calls: list[int] = []
    real_read = disk_files._Files.read

    def spy(self: Any, slots: list[int], keys: list[bytes], outs: Any) -> Any:
        calls.append(len(slots))
        return real_read(self, slots, keys, outs)

    monkeypatch.setattr(disk_files._Files, "read", spy)
    keys, data = make_keys(8), make_payloads(8)
    tier = await open_tier(tmp_path)
    assert await tier.write(keys, data) == 8  # just written: in the page cache
    if not tier._files.resident(tier._index.slot(keys[0])):  # type: ignore[union-attr]
        await tier.aclose()
        pytest.skip("this filesystem cannot probe the page cache (RWF_NOWAIT); reads are never split")
    outs = make_outs(8)
    assert await tier.read_into(keys, outs) == 8
    assert [bytes(o) for o in outs] == [bytes(d) for d in data]
    assert len(calls) > 1  # the read really was split
    calls.clear()
    flip_byte(segment(tmp_path), 5 * tier.stats().entry_bytes + HEADER_SIZE + 99)
    outs = make_outs(8)
    assert await tier.read_into(keys, outs) == 5
    assert [bytes(o) for o in outs[:5]] == [bytes(d) for d in data[:5]]
    assert len(calls) > 1
    assert tier.stats().corrupt == 1
    assert await tier.lookup(keys) == 5
    await tier.aclose()


@pytest.mark.asyncio
async def test_corrupt_header_is_dropped_at_recovery(tmp_path: Path) -> None:
    keys, data = make_keys(3), make_payloads(3)
    tier = await open_tier(tmp_path)
    assert await tier.write(keys, data) == 3
    entry = tier.stats().entry_bytes
    await tier.aclose()
    flip_byte(segment(tmp_path), entry + 80)  # inside entry 1's key field
    tier = await open_tier(tmp_path)
    stats = tier.stats()
    assert (stats.recovered, stats.recovery_dropped) == (2, 1)
    assert await tier.lookup(keys) == 1
    assert await tier.lookup(keys[2:]) == 1
    await tier.aclose()


@pytest.mark.asyncio
async def test_truncated_segment_drops_only_the_torn_entry(tmp_path: Path) -> None:
    """The process died while entry 4 was being written: the file ends in the middle of its payload."""
    keys, data = make_keys(5), make_payloads(5)
    tier = await open_tier(tmp_path)
    assert await tier.write(keys, data) == 5
    entry = tier.stats().entry_bytes
    await tier.aclose()
    os.truncate(segment(tmp_path), 4 * entry + HEADER_SIZE + 100)

    tier = await open_tier(tmp_path)
    stats = tier.stats()
    assert (stats.recovered, stats.recovery_dropped) == (4, 1)
    assert await tier.lookup(keys) == 4
    outs = make_outs(4)
    assert await tier.read_into(keys[:4], outs) == 4
    assert [bytes(o) for o in outs] == [bytes(d) for d in data[:4]]
    assert segment(tmp_path).stat().st_size == 16 * entry  # re-extended
    assert await tier.write(keys[4:], data[4:]) == 1
    assert await tier.read_into(keys[4:], make_outs(1)) == 1
    await tier.aclose()


@pytest.mark.asyncio
async def test_torn_write_leaves_a_header_whose_payload_misses(tmp_path: Path) -> None:
    """A crash after the header but before the whole payload reached the file (hole of zeros)."""
    keys, data = make_keys(2), make_payloads(2)
    tier = await open_tier(tmp_path)
    assert await tier.write(keys, data) == 2
    entry = tier.stats().entry_bytes
    await tier.aclose()
    overwrite(segment(tmp_path), entry + HEADER_SIZE + PB // 2, bytes(PB // 2))
    tier = await open_tier(tmp_path)
    assert tier.stats().recovered == 2  # headers are fine; the payload is checked on read
    assert await tier.read_into(keys, make_outs(2)) == 1
    assert tier.stats().corrupt == 1
    await tier.aclose()


@pytest.mark.asyncio
async def test_other_layout_starts_fresh(tmp_path: Path) -> None:
    keys, data = make_keys(3), make_payloads(3)
    tier = await open_tier(tmp_path)
    assert await tier.write(keys, data) == 3
    await tier.aclose()

    other = make_spec(fingerprint=hashlib.sha256(b"layout-b").digest())
    tier = await open_tier(tmp_path, spec=other)
    assert tier.stats().reset
    assert (tier.stats().recovered, await tier.lookup(keys)) == (0, 0)
    await tier.aclose()

    tier = await open_tier(tmp_path, spec=make_spec(payload_bytes=PB * 2))
    assert tier.stats().reset
    assert await tier.lookup(keys) == 0
    await tier.aclose()
    assert '"payload_bytes": 16384' in (tmp_path / META_NAME).read_text()


@pytest.mark.asyncio
async def test_smaller_capacity_keeps_entries_that_still_fit(tmp_path: Path) -> None:
    keys, data = make_keys(6), make_payloads(6)
    tier = await open_tier(tmp_path, capacity_entries=8, segment_bytes=3 * 12288)
    assert await tier.write(keys, data) == 6
    await tier.aclose()
    assert segment_names(tmp_path) == ["seg-00000.akv", "seg-00001.akv", "seg-00002.akv"]
    tier = await open_tier(tmp_path, capacity_entries=4, segment_bytes=3 * 12288)
    assert segment_names(tmp_path) == ["seg-00000.akv", "seg-00001.akv"]
    assert await tier.lookup(keys) == 4
    outs = make_outs(4)
    assert await tier.read_into(keys[:4], outs) == 4
    assert [bytes(o) for o in outs] == [bytes(d) for d in data[:4]]
    await tier.aclose()


@pytest.mark.asyncio
async def test_second_opener_in_this_process_fails_with_tier_locked(tmp_path: Path) -> None:
    tier = await open_tier(tmp_path)
    with pytest.raises(TierLockedError, match="is already opened by another process or DiskTier"):
        await open_tier(tmp_path)
    await tier.aclose()
    again = await open_tier(tmp_path)  # released on close
    await again.aclose()


_LOCK_PROBE = """
import asyncio, hashlib, sys
from aiokv._errors import TierLockedError
from aiokv.tiers._base import TierSpec
from aiokv.tiers.disk import DiskTier

async def main():
    tier = DiskTier(sys.argv[1], 16 * 12288)
    try:
        await tier.open(TierSpec(8192, hashlib.sha256(b"layout-a").digest(), 16, "test layout"))
    except TierLockedError as exc:
        print("locked:", exc)
        return
    print("opened")
    await tier.aclose()

asyncio.run(main())
"""


@pytest.mark.asyncio
async def test_second_process_fails_with_tier_locked(tmp_path: Path, run_py: RunPy) -> None:
    tier = await open_tier(tmp_path)
    assert (tmp_path / LOCK_NAME).read_text().strip() == str(os.getpid())
    result = await asyncio.to_thread(run_py, _LOCK_PROBE, str(tmp_path))
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("locked: disk tier directory"), result.stdout
    await tier.aclose()  # release on close: see test_second_opener_in_this_process_fails_with_tier_locked


@pytest.mark.asyncio
async def test_capacity_below_one_entry_is_rejected(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, 5000)
    with pytest.raises(
        CapacityError, match="capacity_bytes must hold at least one entry of 12288 bytes, got 5000"
    ):
        await tier.open(make_spec())


def test_bad_arguments_are_rejected(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgumentError, match="capacity_bytes must be > 0, got 0"):
        DiskTier(tmp_path, 0)
    with pytest.raises(TypeError, match="io_threads must be an int, got float"):
        DiskTier(tmp_path, 1 << 20, io_threads=1.5)  # type: ignore[arg-type]


@pytest.mark.asyncio
async def test_wrong_buffer_sizes_are_rejected(tmp_path: Path) -> None:
    tier = await open_tier(tmp_path)
    with pytest.raises(
        InvalidArgumentError, match=r"payloads\[1\] must be payload_bytes=8192 bytes long, got 10"
    ):
        await tier.write(make_keys(2), [make_payloads(1)[0], memoryview(bytearray(10))])
    with pytest.raises(InvalidArgumentError, match=r"outs must have one buffer per key \(2\), got 1"):
        await tier.read_into(make_keys(2), make_outs(1))
    with pytest.raises(InvalidArgumentError, match=r"outs\[0\] must be a C-contiguous buffer"):
        await tier.read_into(make_keys(1), [memoryview(bytearray(2 * PB))[::2]])
    assert tier.stats().pending == 0
    await tier.aclose()


@pytest.mark.asyncio
async def test_closed_tier_raises_closed_and_aclose_is_idempotent(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, 1 << 20)
    with pytest.raises(ClosedError, match="disk tier is not open"):
        await tier.lookup(make_keys(1))
    await tier.open(make_spec())
    await tier.aclose()
    await tier.aclose()
    with pytest.raises(ClosedError, match="disk tier is closed"):
        await tier.write(make_keys(1), make_payloads(1))
    with pytest.raises(ClosedError, match="can be opened once"):
        await tier.open(make_spec())


# ------------------------------------------------------------------ failures


@pytest.fixture
def failing_io(monkeypatch: pytest.MonkeyPatch) -> dict[str, int | None]:
    """Make os.pwritev / os.preadv fail with the errno put in the returned dict (None: behave normally)."""
    fail: dict[str, int | None] = {"write": None, "read": None}
    real_pwritev, real_preadv = os.pwritev, os.preadv

    def pwritev(fd: int, bufs: list[object], offset: int) -> int:
        if fail["write"] is not None:
            raise OSError(fail["write"], os.strerror(fail["write"]))
        return real_pwritev(fd, bufs, offset)  # type: ignore[arg-type]

    def preadv(fd: int, bufs: list[object], offset: int, *flags: int) -> int:
        if fail["read"] is not None:
            raise OSError(fail["read"], os.strerror(fail["read"]))
        return real_preadv(fd, bufs, offset, *flags)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "pwritev", pwritev)
    monkeypatch.setattr(os, "preadv", preadv)
    return fail


@pytest.mark.asyncio
async def test_eio_on_write_drops_and_degrades_then_recovers(
    tmp_path: Path, failing_io: dict[str, int | None]
) -> None:
    tier = await open_tier(tmp_path)
    keys, data = make_keys(4), make_payloads(4)
    failing_io["write"] = errno.EIO
    assert await tier.write(keys[:2], data[:2]) == 0
    stats = tier.stats()
    assert (stats.dropped_io_error, stats.health, stats.entries, stats.pending) == (
        2,
        TierHealth.DEGRADED,
        0,
        0,
    )
    assert "Input/output error" in (stats.last_error or "")
    failing_io["write"] = None
    assert await tier.write(keys, data) == 4
    assert tier.stats().health == TierHealth.UP
    failing_io["read"] = errno.EIO
    assert await tier.read_into(keys, make_outs(4)) == 0
    assert (tier.stats().read_errors, await tier.lookup(keys)) == (1, 0)  # the unreadable entry was dropped
    await tier.aclose()


@pytest.mark.asyncio
async def test_cancelled_write_waits_for_its_thread_and_keeps_the_index_consistent(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A write is cancelled while its thread is inside pwritev: the payload may still be read, so the
    cancellation is delivered only after the thread is done, and the finished entries are committed."""
    tier = await open_tier(tmp_path)
    entered, release = threading.Event(), threading.Event()
    real_pwritev = os.pwritev

    def slow_pwritev(fd: int, bufs: list[object], offset: int) -> int:
        entered.set()
        release.wait(30)
        return real_pwritev(fd, bufs, offset)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "pwritev", slow_pwritev)
    keys, data = make_keys(2), make_payloads(2)
    task = asyncio.create_task(tier.write(keys, data))
    assert await asyncio.to_thread(entered.wait, 30)
    task.cancel()
    await asyncio.sleep(0)  # deliver the cancellation while the thread is still blocked
    assert not task.done()
    release.set()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert tier.stats().pending == 0
    assert tier._index is not None
    tier._index.check_invariants()
    assert await tier.lookup(keys) == 2
    await tier.aclose()


_FSIZE_PROBE = """
import asyncio, hashlib, resource, signal, sys
from aiokv.tiers._base import TierSpec
from aiokv.tiers.disk import DiskTier

signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
limit = 10 * 12288
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

async def main():
    tier = DiskTier(sys.argv[1], 64 * 12288)
    await tier.open(TierSpec(8192, hashlib.sha256(b"layout-a").digest(), 16, "test layout"))
    keys = [hashlib.sha256(b"k%d" % i).digest() for i in range(40)]
    data = [memoryview(bytearray([i % 251]) * 8192) for i in range(40)]
    stored = 0
    for i in range(0, 40, 4):
        stored += await tier.write(keys[i:i + 4], data[i:i + 4])
    s = tier.stats()
    outs = [memoryview(bytearray(8192)) for _ in range(stored)]
    read = await tier.read_into(keys[:stored], outs)
    same = all(bytes(o) == bytes(d) for o, d in zip(outs, data))
    print(stored, s.dropped_io_error, s.health.value, s.preallocated, read, same)
    await tier.aclose()

asyncio.run(main())
"""


@pytest.mark.asyncio
async def test_file_size_limit_drops_writes_without_crashing(tmp_path: Path, run_py: RunPy) -> None:
    """RLIMIT_FSIZE in a child process: preallocation fails (EFBIG), the segment stays sparse and every store
    beyond the limit fails; those are dropped and counted, the rest stay readable."""
    result = await asyncio.to_thread(run_py, _FSIZE_PROBE, str(tmp_path / "tier"))
    assert result.returncode == 0, result.stderr
    stored, dropped, health, preallocated, read, same = result.stdout.split()
    assert (int(stored), int(dropped), health, preallocated) == (10, 30, "degraded", "False")
    assert (int(read), same) == (10, "True")


@pytest.fixture
def tiny_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A 1 MiB tmpfs mounted for this test (needs root and a kernel that allows it)."""
    mnt = tmp_path / f"tmpfs-{uuid.uuid4().hex[:8]}"
    mnt.mkdir()
    proc = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)],
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.strip() or proc.returncode}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True, check=False)


@pytest.mark.asyncio
async def test_full_filesystem_drops_writes_without_crashing(tiny_tmpfs: Path) -> None:
    tier = await open_tier(tiny_tmpfs / "tier", capacity_entries=200)  # 2.4 MB on a 1 MiB filesystem
    stats = tier.stats()
    assert not stats.preallocated
    keys, data = make_keys(120), make_payloads(120)
    stored = 0
    for i in range(0, 120, 8):
        stored += await tier.write(keys[i : i + 8], data[i : i + 8])
    stats = tier.stats()
    assert 0 < stored < 120
    assert stats.dropped_io_error == 120 - stored
    assert stats.health == TierHealth.DEGRADED
    assert "No space left on device" in (stats.last_error or "")
    hits = await tier.lookup(keys)
    outs = make_outs(hits)
    assert await tier.read_into(keys[:hits], outs) == hits
    assert [bytes(o) for o in outs] == [bytes(d) for d in data[:hits]]
    await tier.aclose()


@pytest.fixture(params=["one-part", "split"])
def split_batches(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> bool:
    """Run a test with stored batches written by one thread, then spread over several I/O threads."""
    if request.param == "split":
        monkeypatch.setattr(disk_tier, "_SPLIT_BYTES", 1)
        return True
    return False


@pytest.mark.asyncio
@pytest.mark.parametrize("seed", [1, 2])
async def test_concurrent_random_workload_never_returns_wrong_bytes(
    tmp_path: Path, seed: int, split_batches: bool
) -> None:
    """Seeded concurrent writers/readers on a tier much smaller than the key set: eviction, pins and slot
    reuse never let a read return bytes of another key, and the index stays consistent."""
    tier = await open_tier(tmp_path, capacity_entries=8, io_threads=3)
    universe = make_keys(24)
    payload_for = {k: hashlib.sha256(k).digest() * (PB // 32) for k in universe}

    async def worker(worker_seed: int) -> None:
        rng = random.Random(worker_seed)
        for _ in range(40):
            start = rng.randrange(len(universe))
            keys = universe[start : start + rng.randint(1, 4)]
            roll = rng.random()
            if roll < 0.5:
                await tier.write(keys, [memoryview(bytearray(payload_for[k])) for k in keys])
            elif roll < 0.85:
                outs = make_outs(len(keys))
                got = await tier.read_into(keys, outs)
                for key, out in zip(keys[:got], outs, strict=False):
                    assert bytes(out) == payload_for[key]
            else:
                await tier.lookup(keys)

    await asyncio.gather(*(worker(seed * 100 + w) for w in range(6)))
    stats = tier.stats()
    assert (stats.pending, stats.pinned, stats.corrupt, stats.dropped_io_error) == (0, 0, 0, 0)
    assert stats.read_blocks > 0
    assert tier._index is not None
    tier._index.check_invariants()
    await tier.aclose()
    tier = await open_tier(tmp_path, capacity_entries=8)
    hits = [k for k in universe if await tier.lookup([k])]
    for key in hits:  # whatever survived the restart is intact
        out = make_outs(1)
        assert await tier.read_into([key], out) == 1
        assert bytes(out[0]) == payload_for[key]
    await tier.aclose()
