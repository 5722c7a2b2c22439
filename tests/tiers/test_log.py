"""Logging: quiet by default, tier health transitions, corrupt entries and failed I/O, floods throttled."""

from __future__ import annotations

import asyncio
import errno
import logging
import os
from pathlib import Path
from typing import Any

import pytest

from aiokv import _log
from aiokv.testing import FakeClock as _FakeClock
from aiokv.tiers import FaultyTier
from aiokv.tiers._format import TierHealth
from aiokv.tiers.disk import DiskTier
from aiokv.tiers.redis import RedisTier

from . import _entries as entries
from ._entries import RunPy

PB = 4096


def make_spec() -> Any:
    return entries.spec(PB)


def FakeClock() -> _FakeClock:
    """aiokv.testing.FakeClock, starting at 1000.0 s."""
    return _FakeClock(1000.0)


def records(caplog: pytest.LogCaptureFixture, name: str, level: int | None = None) -> list[str]:
    return [
        r.getMessage() for r in caplog.records if r.name == name and (level is None or r.levelno == level)
    ]


def test_the_aiokv_logger_is_quiet_by_default_and_propagates() -> None:
    logger = logging.getLogger("aiokv")
    assert _log.logger is logger
    assert [type(h) for h in logger.handlers] == [logging.NullHandler]
    assert logger.propagate
    assert _log.get_logger("tiers.disk").name == "aiokv.tiers.disk"


def test_throttled_logs_the_first_event_then_counts(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="aiokv")
    clock = FakeClock()
    log = _log.get_logger("tests.throttle")
    throttle = _log.Throttled(log, logging.WARNING, "things went wrong", interval_s=60.0, clock=clock)
    assert throttle.event("thing %d went wrong", 1)
    for i in range(2, 6):
        clock.now += 10
        assert not throttle.event("thing %d went wrong", i)
    clock.now += 20  # 60 s after the first line
    assert throttle.event("thing %d went wrong", 6)
    assert not throttle.event("thing %d went wrong", 7)
    throttle.flush()
    throttle.flush()  # nothing left to report
    assert records(caplog, "aiokv.tests.throttle", logging.WARNING) == [
        "thing 1 went wrong",
        "thing 6 went wrong (and 4 more since the last report)",
        "things went wrong: 1 more not reported",
    ]
    assert (throttle.total, throttle.suppressed) == (7, 0)


_QUIET_PROBE = """
import asyncio, hashlib, sys
from aiokv.tiers import FaultyTier
from aiokv.tiers._base import TierSpec
from aiokv.tiers.disk import DiskTier

async def main():
    keys = [hashlib.sha256(b"k%d" % i).digest() for i in range(3)]
    data = [memoryview(bytearray(4096)) for _ in keys]
    tier = FaultyTier(DiskTier(sys.argv[1], 1 << 20), corrupt_rate=1.0)
    await tier.open(TierSpec(4096, hashlib.sha256(b"layout-a").digest(), 16, "test layout"))
    await tier.write(keys, data)
    print(await tier.read_into(keys, [memoryview(bytearray(4096)) for _ in keys]), tier.stats().inner.corrupt)
    await tier.aclose()

asyncio.run(main())
"""


@pytest.mark.asyncio
async def test_nothing_is_printed_when_the_application_configured_no_logging(
    tmp_path: Path, run_py: RunPy
) -> None:
    """A corrupt entry is a WARNING; without handlers, Python's last-resort handler would print it to stderr.
    aiokv's NullHandler keeps the library quiet."""
    result = await asyncio.to_thread(run_py, _QUIET_PROBE, str(tmp_path / "tier"))
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["0", "1"]
    assert result.stderr == ""


@pytest.mark.asyncio
async def test_a_flood_of_corrupt_disk_entries_logs_the_first_and_then_a_count(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="aiokv")
    keys, data = entries.keys(5), entries.payloads(5, PB)
    tier = FaultyTier(DiskTier(tmp_path, 1 << 20), corrupt_rate=1.0)
    await tier.open(make_spec())
    assert await tier.write(keys, data) == 5
    for key in keys:
        assert await tier.read_into([key], entries.outs(1, PB)) == 0
    warnings = records(caplog, "aiokv.tiers.disk", logging.WARNING)
    assert len(warnings) == 1
    assert f"entry {keys[0].hex()[:16]} failed verification" in warnings[0]
    assert str(tmp_path) in warnings[0]
    await tier.aclose()
    warnings = records(caplog, "aiokv.tiers.disk", logging.WARNING)
    assert warnings[1:] == [f"disk tier {str(tmp_path)!r}: corrupt entries dropped: 4 more not reported"]


@pytest.mark.asyncio
async def test_disk_health_changes_are_logged(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    caplog.set_level(logging.INFO, logger="aiokv")
    tier = DiskTier(tmp_path, 1 << 20)
    await tier.open(make_spec())
    keys, data = entries.keys(4), entries.payloads(4, PB)
    real_pwritev = os.pwritev
    failing = {"on": True}

    def pwritev(fd: int, bufs: Any, offset: int) -> int:
        if failing["on"]:
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return real_pwritev(fd, bufs, offset)

    monkeypatch.setattr(os, "pwritev", pwritev)
    assert await tier.write(keys[:2], data[:2]) == 0
    assert await tier.write(keys[2:], data[2:]) == 0  # still degraded: no new transition
    failing["on"] = False
    assert await tier.write(keys, data) == 4
    assert tier.stats().health == TierHealth.UP
    where = repr(str(tmp_path))
    assert records(caplog, "aiokv.tiers.disk", logging.WARNING) == [
        f"disk tier {where}: 2 of 2 stores dropped: OSError: [Errno 5] Input/output error",
        f"disk tier {where} degraded: OSError: [Errno 5] Input/output error; failed reads are misses and "
        "failed stores are dropped: check the disk, its free space and the directory's permissions (the tier "
        "keeps trying on every call)",
    ]
    assert records(caplog, "aiokv.tiers.disk", logging.INFO) == [
        f"disk tier {where} is up again (was degraded)"
    ]
    await tier.aclose()
    assert records(caplog, "aiokv.tiers.disk", logging.WARNING)[2:] == [
        f"disk tier {where}: failed I/O: 1 more not reported"
    ]


@pytest.mark.asyncio
async def test_redis_health_changes_are_logged(
    own_redis_server: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="aiokv")
    clock = FakeClock()
    tier = RedisTier(
        own_redis_server.url, namespace="logs", timeout_s=0.5, failures_to_down=2, backoff_s=5, clock=clock
    )
    await tier.open(make_spec())
    keys = entries.keys(1)
    own_redis_server.kill()
    assert await tier.lookup(keys) == 0
    assert tier.stats().health == TierHealth.DEGRADED
    assert await tier.lookup(keys) == 0
    assert tier.stats().health == TierHealth.DOWN
    own_redis_server.start()
    clock.now += 5
    assert await tier.lookup(keys) == 0  # the probe
    assert tier.stats().health == TierHealth.UP
    warnings = records(caplog, "aiokv.tiers.redis", logging.WARNING)
    assert any("round trip failed" in m for m in warnings)
    assert any("namespace 'logs' degraded:" in m for m in warnings)
    assert any("is down after 2 consecutive failures" in m and "probed again in 5.0 s" in m for m in warnings)
    assert records(caplog, "aiokv.tiers.redis", logging.INFO) == [
        f"redis tier {own_redis_server.url!r} namespace 'logs' is up again (was down)"
    ]
    await tier.aclose()


@pytest.mark.asyncio
async def test_corrupt_redis_values_are_logged_with_the_key(
    redis_server: Any, namespace: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="aiokv")
    keys, data = entries.keys(2), entries.payloads(2, PB)
    tier = FaultyTier(RedisTier(redis_server.url, namespace=namespace), corrupt_keys={keys[1]})
    await tier.open(make_spec())
    assert await tier.write(keys, data) == 2
    assert await tier.read_into(keys, entries.outs(2, PB)) == 1
    warnings = records(caplog, "aiokv.tiers.redis", logging.WARNING)
    assert len(warnings) == 1
    assert f"value of {keys[1].hex()[:16]} failed verification" in warnings[0]
    await tier.aclose()
