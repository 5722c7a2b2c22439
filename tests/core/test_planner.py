"""Load or recompute: the cost fits and the decision (pure, deterministic)."""

from __future__ import annotations

import math

import pytest

from aiokv import InvalidArgumentError, InvalidTypeError
from aiokv._planner import CostFit, LoadPlanner, PrefillMeter, TierRun

MiB = 1 << 20


def test_a_cost_fit_separates_latency_from_bandwidth() -> None:
    fit = CostFit()
    for n in (1, 4, 16, 64, 2, 8):  # a tier with 5 ms per call and 1 GB/s
        fit.record(n * MiB, 0.005 + n * MiB / 1e9)
    latency, per_byte = fit.coefficients()
    assert latency == pytest.approx(0.005, rel=1e-6)
    assert 1 / per_byte == pytest.approx(1e9, rel=1e-6)
    assert fit.predict(32 * MiB) == pytest.approx(0.005 + 32 * MiB / 1e9, rel=1e-6)


def test_a_cost_fit_with_one_size_predicts_through_the_origin() -> None:
    fit = CostFit()
    for _ in range(5):
        fit.record(8 * MiB, 0.016)
    assert fit.latency_s == 0.0
    assert fit.predict(8 * MiB) == pytest.approx(0.016)
    assert fit.bytes_per_s == pytest.approx(8 * MiB / 0.016)


def test_a_cost_fit_follows_a_tier_that_slows_down() -> None:
    fit = CostFit(half_life=4)
    for n in (1, 2, 4, 8) * 4:
        fit.record(n * MiB, n * MiB / 10e9)
    for n in (1, 2, 4, 8) * 8:  # the same tier, now ten times slower
        fit.record(n * MiB, n * MiB / 1e9)
    assert fit.bytes_per_s == pytest.approx(1e9, rel=0.05)


def test_broken_measurements_are_ignored() -> None:
    fit = CostFit()
    for nbytes, secs in ((0, 1.0), (MiB, -1.0), (math.inf, 1.0), (MiB, math.nan)):
        fit.record(nbytes, secs)
    assert fit.samples == 0
    assert fit.coefficients() == (0.0, 0.0)


def test_the_prefill_meter_uses_the_given_rate_else_the_measured_one() -> None:
    assert PrefillMeter(5000.0).tokens_per_s == 5000.0
    meter = PrefillMeter()
    assert meter.tokens_per_s is None
    meter.record(1000, 0.5)
    meter.record(3000, 1.5)
    assert meter.tokens_per_s == pytest.approx(2000.0)
    with pytest.raises(InvalidArgumentError, match=r"prefill_tokens_per_s must be a finite number > 0"):
        PrefillMeter(0.0)


def _planner(**kwargs: object) -> LoadPlanner:
    planner = LoadPlanner(block_bytes=MiB, block_tokens=16, prefill_tokens_per_s=16_000.0, **kwargs)  # type: ignore[arg-type]
    for n in (1, 2, 4, 8):  # the copy into the engine: 20 GB/s, no latency
        planner.record_transfer("load", n * MiB, n * MiB / 20e9)
    return planner


def test_a_fast_tier_is_restored_and_a_slow_one_is_recomputed() -> None:
    """Recomputing 16 tokens takes 1 ms here. The CPU tier restores a 1 MiB block in ~0.05 ms, a disk at
    2 GB/s in ~0.5 ms (restore), a remote tier at 100 MB/s in ~10 ms (recompute: stop there)."""
    planner = _planner()
    for n in (1, 2, 4, 8):
        planner.record_transfer("disk", n * MiB, n * MiB / 2e9)
        planner.record_transfer("redis", n * MiB, 0.002 + n * MiB / 100e6)
    runs = [TierRun("cpu", 4), TierRun("disk", 6), TierRun("redis", 10)]
    assert planner.plan(runs) == 10
    assert planner.stats().skipped_blocks == 10
    # ...and behind the losing tier nothing is restored, even a fast one (a prefix is all or nothing).
    assert planner.plan([TierRun("cpu", 2), TierRun("redis", 3), TierRun("disk", 5)]) == 2


def test_a_slow_tier_is_restored_now_and_then_to_measure_it_again() -> None:
    planner = _planner(explore_every=4)
    for n in (1, 2, 4, 8):
        planner.record_transfer("redis", n * MiB, n * MiB / 100e6)
    decisions = [planner.plan([TierRun("cpu", 1), TierRun("redis", 4)]) for _ in range(8)]
    assert decisions.count(5) == 2  # explored
    assert decisions.count(1) == 6
    assert planner.stats().explored == 2


def test_a_tier_without_measurements_is_trusted_until_measured() -> None:
    planner = _planner()
    assert planner.plan([TierRun("cpu", 1), TierRun("disk", 3)]) == 4
    planner = LoadPlanner(block_bytes=MiB, block_tokens=16)  # no prefill rate known yet
    assert planner.plan([TierRun("redis", 3)]) == 3


def test_always_restores_everything() -> None:
    planner = _planner(mode="always")
    for n in (1, 2, 4, 8):
        planner.record_transfer("redis", n * MiB, n * MiB / 1e6)
    assert planner.plan([TierRun("cpu", 1), TierRun("redis", 7)]) == 8


def test_bad_modes_are_clear_errors() -> None:
    with pytest.raises(
        InvalidArgumentError, match=r"load_policy must be one of \['always', 'decide'\], got 'x'"
    ):
        LoadPlanner(MiB, 16, mode="x")
    with pytest.raises(InvalidTypeError, match="load_policy must be a str"):
        LoadPlanner(MiB, 16, mode=1)  # type: ignore[arg-type]
