"""DiskTier.open on a filesystem without room starts degraded or down instead of raising, and recovers;
real misconfiguration still raises a clear OSError."""

from __future__ import annotations

import errno
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import aiokv
from aiokv._errors import ClosedError
from aiokv.testing import FakeClock as _FakeClock
from aiokv.tiers._base import TierSpec
from aiokv.tiers._format import TierHealth
from aiokv.tiers.disk import DiskTier
from aiokv.tiers.disk._files import LOCK_NAME, META_NAME

from . import _entries as entries
from .conftest import fill_blocks, fill_inodes

PB = 8192  # entries of 12288 bytes
ENTRY = 12288
make_keys = entries.keys

pytestmark = pytest.mark.asyncio


def make_spec() -> TierSpec:
    return entries.spec(PB)


def FakeClock() -> _FakeClock:
    """aiokv.testing.FakeClock, starting at 100.0 s."""
    return _FakeClock(100.0)


def disk_tier(path: Path, capacity_entries: int = 16) -> tuple[DiskTier, FakeClock]:
    tier = DiskTier(path, capacity_entries * ENTRY)
    clock = FakeClock()
    tier._clock = clock  # times the set-up retries of a tier that starts down
    return tier, clock


def messages(caplog: pytest.LogCaptureFixture, level: int) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "aiokv.tiers.disk" and r.levelno == level]


async def assert_round_trip(tier: DiskTier, n: int, tag: str) -> None:
    keys, data = make_keys(n, tag), entries.payloads(n, PB, seed=len(tag))
    assert await tier.write(keys, data) == n
    outs = entries.outs(n, PB)
    assert await tier.read_into(keys, outs) == n
    assert [bytes(o) for o in outs] == [bytes(d) for d in data]


# ------------------------------------------------------------- real filesystems


async def test_full_filesystem_at_open_starts_degraded_and_recovers_when_space_is_freed(
    mount_tmpfs: Callable[..., Path], caplog: pytest.LogCaptureFixture
) -> None:
    """Regression: on an already full filesystem, writing the layout file raised ENOSPC out of open() (and so
    out of Offloader.__aenter__). Now the tier starts degraded, drops stores while there is no room, and
    writes the layout file once a store succeeds, so a restart recovers what was stored after that."""
    caplog.set_level(logging.INFO, logger="aiokv")
    mnt = mount_tmpfs("1m")
    filler = fill_blocks(mnt)
    tier, _ = disk_tier(mnt / "tier")
    await tier.open(make_spec())
    stats = tier.stats()
    assert (stats.health, stats.preallocated) == (TierHealth.DEGRADED, False)
    assert "No space left on device" in (stats.last_error or "")
    assert sorted(p.name for p in (mnt / "tier").iterdir()) == [LOCK_NAME, "seg-00000.akv"]  # no layout file
    assert any(f"no room to write {META_NAME}" in m for m in messages(caplog, logging.WARNING))

    keys, data = make_keys(4), entries.payloads(4, PB)
    assert await tier.write(keys, data) == 0
    assert (tier.stats().dropped_io_error, await tier.lookup(keys)) == (4, 0)
    assert await tier.read_into(keys, entries.outs(4, PB)) == 0

    filler.unlink()
    assert await tier.write(keys, data) == 4
    stats = tier.stats()
    assert (stats.health, stats.stored_blocks) == (TierHealth.UP, 4)
    assert (mnt / "tier" / META_NAME).exists()
    assert any("is up again (was degraded)" in m for m in messages(caplog, logging.INFO))
    assert any(f"wrote {META_NAME}" in m for m in messages(caplog, logging.INFO))
    await tier.aclose()

    again, _ = disk_tier(mnt / "tier")
    await again.open(make_spec())
    assert (again.stats().recovered, again.stats().health) == (4, TierHealth.UP)
    outs = entries.outs(4, PB)
    assert await again.read_into(keys, outs) == 4
    assert [bytes(o) for o in outs] == [bytes(d) for d in data]
    await again.aclose()


async def test_no_inode_left_at_open_starts_down_and_a_store_after_the_backoff_sets_it_up(
    mount_tmpfs: Callable[..., Path], caplog: pytest.LogCaptureFixture
) -> None:
    """Not even the directory can be created: the tier is down (lookups and reads miss, stores are dropped
    and counted); stores retry the set-up once per backoff interval (1 s, then doubling)."""
    caplog.set_level(logging.INFO, logger="aiokv")
    mnt = mount_tmpfs("1m", nr_inodes=8)
    fillers = fill_inodes(mnt)
    tier, clock = disk_tier(mnt / "tier")
    await tier.open(make_spec())
    stats = tier.stats()
    assert stats.health == TierHealth.DOWN
    assert "No space left on device" in (stats.last_error or "")
    assert any("is down: cannot set up the directory" in m for m in messages(caplog, logging.WARNING))
    keys, data = make_keys(3), entries.payloads(3, PB)
    assert await tier.lookup(keys) == 0
    assert await tier.read_into(keys, entries.outs(3, PB)) == 0
    assert await tier.write(keys, data) == 0  # before the backoff: answered locally
    stats = tier.stats()
    assert (stats.dropped_down, stats.read_misses, stats.lookups, stats.writes) == (3, 1, 1, 1)

    clock.now += 1.0
    assert await tier.write(keys, data) == 0  # the retry fails too: still no inode
    assert tier.stats().health == TierHealth.DOWN
    assert any("is still down" in m and "next retry in 2 s" in m for m in messages(caplog, logging.WARNING))

    for path in fillers:
        path.unlink()
    clock.now += 1.0
    assert await tier.write(keys, data) == 0  # the doubled backoff has not passed yet
    assert tier.stats().dropped_down == 9
    clock.now += 1.0
    assert await tier.write(keys, data) == 3  # set up, then stored
    stats = tier.stats()
    assert (stats.health, stats.stored_blocks, stats.dropped_down) == (TierHealth.UP, 3, 9)
    assert any("is up again (was down)" in m for m in messages(caplog, logging.INFO))
    outs = entries.outs(3, PB)
    assert await tier.read_into(keys, outs) == 3
    assert [bytes(o) for o in outs] == [bytes(d) for d in data]
    await tier.aclose()


async def test_offloader_enters_with_a_disk_tier_on_a_full_filesystem(
    mount_tmpfs: Callable[..., Path],
) -> None:
    """Regression (reported at this level): Offloader.__aenter__ raised OSError for a DiskTier on a full disk."""
    mnt = mount_tmpfs("1m")
    fill_blocks(mnt)
    tensors = [torch.zeros((8, 4, 8)) for _ in range(2)]
    layout = aiokv.KVLayout(tensors, block_size=4, model_id="full-disk-test")
    disk = DiskTier(mnt / "tier", 1 << 20)
    cpu = aiokv.CPUTier(capacity_bytes=16 * layout.slot_bytes)
    async with aiokv.Offloader(layout, tiers=[cpu, disk]) as off:
        assert disk.stats().health == TierHealth.DEGRADED
        assert off is not None
    assert disk.stats().health == TierHealth.DEGRADED


# ------------------------------------------------------- every step, every errno


STEPS_DOWN = ("mkdir", "lock", "segment")
STEPS_DEGRADED = ("meta", "fallocate")


@pytest.fixture
def fail_step(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """Make one step of setting up a directory fail: ``plan["step"]`` in mkdir / lock / meta / segment /
    fallocate, with ``plan["errno"]``; ``plan["step"] = None`` lets everything through again."""
    plan: dict[str, Any] = {"step": None, "errno": errno.ENOSPC, "hits": 0}
    real_mkdir, real_write_text, real_open = Path.mkdir, Path.write_text, os.open
    real_fallocate = os.posix_fallocate

    def hit(step: str, name: str = "") -> None:
        if plan["step"] == step:
            plan["hits"] += 1
            raise OSError(plan["errno"], os.strerror(plan["errno"]), name or None)

    def mkdir(self: Path, *args: Any, **kwargs: Any) -> None:
        if self.name == "tier":
            hit("mkdir", str(self))
        real_mkdir(self, *args, **kwargs)

    def write_text(self: Path, *args: Any, **kwargs: Any) -> int:
        if self.name == META_NAME + ".tmp":
            hit("meta", str(self))
        return real_write_text(self, *args, **kwargs)

    def open_(path: Any, flags: int, mode: int = 0o777, **kwargs: Any) -> int:
        name = os.path.basename(os.fspath(path))
        if name == LOCK_NAME:
            hit("lock", str(path))
        if name.startswith("seg-"):
            hit("segment", str(path))
        return real_open(path, flags, mode, **kwargs)

    def posix_fallocate(fd: int, offset: int, length: int) -> None:
        hit("fallocate")
        real_fallocate(fd, offset, length)

    monkeypatch.setattr(Path, "mkdir", mkdir)
    monkeypatch.setattr(Path, "write_text", write_text)
    monkeypatch.setattr(os, "open", open_)
    monkeypatch.setattr(os, "posix_fallocate", posix_fallocate)
    return plan


@pytest.mark.parametrize(
    ("step", "err"),
    [
        *((step, errno.ENOSPC) for step in STEPS_DOWN + STEPS_DEGRADED),
        ("segment", errno.EDQUOT),
        ("segment", errno.EFBIG),
        ("meta", errno.EDQUOT),
        ("meta", errno.EFBIG),
    ],
)
async def test_no_room_at_any_step_of_open_degrades_instead_of_raising(
    tmp_path: Path, fail_step: dict[str, Any], step: str, err: int
) -> None:
    fail_step.update(step=step, errno=err)
    tier, clock = disk_tier(tmp_path / "tier")
    await tier.open(make_spec())
    assert fail_step["hits"] >= 1
    expected = TierHealth.DOWN if step in STEPS_DOWN else TierHealth.DEGRADED
    stats = tier.stats()
    assert stats.health == expected
    assert os.strerror(err) in (stats.last_error or "")
    fail_step["step"] = None  # space was freed
    clock.now += 1.0
    await assert_round_trip(tier, 2, "after")
    assert tier.stats().health == TierHealth.UP
    await tier.aclose()
    assert (tmp_path / "tier" / META_NAME).exists()  # written at the retry or after the first store


async def test_a_tier_closed_while_down_releases_everything(
    tmp_path: Path, fail_step: dict[str, Any]
) -> None:
    fail_step["step"] = "lock"
    tier, _ = disk_tier(tmp_path / "tier")
    await tier.open(make_spec())
    assert tier.stats().health == TierHealth.DOWN
    await tier.aclose()
    await tier.aclose()
    with pytest.raises(ClosedError, match="disk tier is closed"):
        await tier.write(make_keys(1), entries.payloads(1, PB))
    fail_step["step"] = None
    again, _ = disk_tier(tmp_path / "tier")  # nothing was left locked
    await again.open(make_spec())
    assert again.stats().health == TierHealth.UP
    await again.aclose()


# ---------------------------------------------------------- misconfiguration


async def test_path_that_is_a_file_raises_not_a_directory(tmp_path: Path) -> None:
    path = tmp_path / "tier"
    path.write_text("not a directory")
    tier, _ = disk_tier(path)
    with pytest.raises(NotADirectoryError, match=r"disk tier path '.*/tier' exists and is not a directory"):
        await tier.open(make_spec())
    with pytest.raises(ClosedError, match="can be opened once"):
        await tier.open(make_spec())


async def test_path_below_a_file_raises_not_a_directory(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    tier, _ = disk_tier(tmp_path / "file" / "tier")
    with pytest.raises(NotADirectoryError, match=r"cannot use '.*/file/tier' as a disk tier directory"):
        await tier.open(make_spec())


@pytest.mark.parametrize(
    ("step", "err", "exc_type", "reason"),
    [
        ("lock", errno.EACCES, PermissionError, "Permission denied"),
        ("mkdir", errno.EACCES, PermissionError, "Permission denied"),
        ("segment", errno.EROFS, OSError, "Read-only file system"),
        ("meta", errno.EIO, OSError, "Input/output error"),
    ],
)
async def test_configuration_errors_still_raise_with_the_directory_named(
    tmp_path: Path,
    fail_step: dict[str, Any],
    step: str,
    err: int,
    exc_type: type[OSError],
    reason: str,
) -> None:
    """Permissions, a read-only filesystem or a failing device would not go away by themselves: they raise
    (the same OSError subclass and errno), naming the directory."""
    fail_step.update(step=step, errno=err)
    tier, _ = disk_tier(tmp_path / "tier")
    with pytest.raises(exc_type, match=rf"cannot use '.*/tier' as a disk tier directory: {reason}") as info:
        await tier.open(make_spec())
    assert info.value.errno == err
    fail_step["step"] = None
    again, _ = disk_tier(tmp_path / "tier")  # the failed open released the directory
    await again.open(make_spec())
    await again.aclose()
