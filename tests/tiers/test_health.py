"""The health breaker shared by the disk and Redis tiers (aiokv/tiers/_health.py), tested synchronously."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from aiokv.testing import FakeClock as _FakeClock
from aiokv.tiers import TierHealth
from aiokv.tiers._health import Breaker

UP, DEGRADED, DOWN = TierHealth.UP, TierHealth.DEGRADED, TierHealth.DOWN


def Clock() -> _FakeClock:
    """aiokv.testing.FakeClock, starting at 100.0 s."""
    return _FakeClock(100.0)


def test_counting_down_probing_and_back_up() -> None:
    clock = Clock()
    b = Breaker(3, 1.0, 4.0, clock)
    assert (b.state, b.allow()) == (UP, False)
    b.failure(probe=False)
    b.failure(probe=False)
    assert b.state is DEGRADED
    b.failure(probe=False)
    assert (b.state, b.retry_at) == (DOWN, 101.0)
    assert b.allow() is None  # answered locally until the backoff has passed
    clock.now = 101.0
    assert b.allow() is True  # the probe
    assert b.allow() is None  # one at a time
    b.failure(probe=True)
    assert (b.state, b.backoff, b.retry_at, b.probing) == (DOWN, 2.0, 103.0, False)
    clock.now = 103.0
    assert b.allow() is True
    b.failure(probe=True)
    clock.now = 107.0
    assert b.allow() is True
    b.failure(probe=True)
    assert b.backoff == 4.0  # capped
    clock.now = 111.0
    assert b.allow() is True
    b.success(probe=True)
    assert (b.state, b.failures, b.backoff, b.reconnects, b.allow()) == (UP, 0, 1.0, 1, False)


def test_only_the_probe_brings_a_down_tier_back() -> None:
    """An answer to a call sent before the tier went down says nothing about the medium now."""
    clock = Clock()
    b = Breaker(1, 1.0, 8.0, clock)
    b.failure(probe=False)
    assert b.state is DOWN
    b.success(probe=False)
    assert (b.state, b.reconnects) == (DOWN, 0)
    b.failure(probe=False)  # a call in flight when it went down: no effect on the backoff
    assert (b.state, b.backoff, b.retry_at) == (DOWN, 1.0, 101.0)


def test_trip_goes_down_without_counting_and_none_never_counts_down() -> None:
    """The disk tier's shape: failed I/O only degrades; a set-up that fails takes it down at once."""
    clock = Clock()
    b = Breaker(None, 1.0, 60.0, clock)
    for _ in range(100):
        b.failure(probe=False)
    assert b.state is DEGRADED
    b.success(probe=False)
    assert b.state is UP
    b.trip()
    assert (b.state, b.retry_at, b.allow()) == (DOWN, 101.0, None)
    clock.now = 101.0
    assert b.allow() is True


def test_an_abandoned_probe_lets_the_next_call_probe() -> None:
    clock = Clock()
    b = Breaker(1, 1.0, 8.0, clock)
    b.trip()
    clock.now = 200.0
    assert b.allow() is True
    b.abandoned(probe=True)
    assert b.allow() is True
    b.abandoned(probe=False)  # not the probe: the probe still runs
    assert b.allow() is None


def test_failures_to_down_must_be_positive() -> None:
    with pytest.raises(ValueError, match="failures_to_down must be None or >= 1, got 0"):
        Breaker(0, 1.0, 2.0, Clock())


@given(
    st.lists(st.tuples(st.sampled_from(["call", "ok", "fail", "abandon", "tick", "trip"]), st.integers(0, 3)))
)
def test_random_schedules_keep_the_invariants(ops: list[tuple[str, int]]) -> None:
    """One probe at a time, never a probe before retry_at, the backoff within its bounds, up means no
    failures counted."""
    clock = Clock()
    b = Breaker(2, 0.5, 4.0, clock)
    probe: bool | None = None
    for op, n in ops:
        if op == "tick":
            clock.now += n
        elif op == "trip":
            b.trip()
            probe = None
        elif op == "call":
            if probe is None:
                allowed = b.allow()
                if allowed is True:
                    assert clock.now >= b.retry_at
                if allowed is not None:
                    probe = allowed
            # else: a call is outstanding; this schedule makes one call at a time
        elif probe is not None:
            {"ok": b.success, "fail": b.failure, "abandon": b.abandoned}[op](probe)
            probe = None
        assert 0.5 <= b.backoff <= 4.0
        assert b.state is not UP or b.failures == 0
        assert b.state is DOWN or not b.probing


def test_both_tiers_use_the_shared_breaker(tmp_path: object) -> None:
    from aiokv import DiskTier
    from aiokv.tiers.redis import RedisTier

    assert type(DiskTier(str(tmp_path), capacity_bytes=1 << 20)._breaker) is Breaker
    assert type(RedisTier("redis://127.0.0.1:1")._breaker) is Breaker
