"""``Offloader.config``: the options checked once, as one frozen object (issue 22)."""

from __future__ import annotations

import dataclasses

import pytest

from aiokv import CPUTier, Offloader
from aiokv._config import OffloaderConfig

from ._sim import SimEngine


def _off(**kw: object) -> Offloader:
    eng = SimEngine(block_size=4)
    return Offloader(eng.layout, tiers=[CPUTier(capacity_bytes=64 * eng.layout.slot_bytes)], **kw)  # type: ignore[arg-type]


def test_the_config_holds_the_checked_options_and_is_frozen() -> None:
    off = _off(write_through_max_bytes=1 << 20, lower_tier_deadline_s=2.5, load_policy="always")
    cfg = off.config
    assert isinstance(cfg, OffloaderConfig)
    assert (cfg.write_through_max_bytes, cfg.lower_tier_deadline_s, cfg.load_policy) == (
        1 << 20,
        2.5,
        "always",
    )
    assert cfg.device is None
    assert not cfg.events_on
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.close_timeout = 1.0  # type: ignore[misc]


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"write_through_max_bytes": -1}, "write_through_max_bytes must be an int >= 0"),
        ({"close_timeout": -1}, "close_timeout must be >= 0"),
        ({"lower_tier_deadline_s": 0}, "lower_tier_deadline_s must be > 0 seconds"),
        ({"kv_events": "yes"}, "kv_events must be a bool"),
        (
            {"kv_events_replay_endpoint": "tcp://127.0.0.1:1"},
            "kv_events_replay_endpoint needs kv_events_endpoint",
        ),
        ({"prefill_tokens_per_s": "fast"}, "prefill_tokens_per_s must be a number"),
    ],
)
def test_bad_options_name_the_parameter(kw: dict[str, object], match: str) -> None:
    with pytest.raises((TypeError, ValueError), match=match):
        _off(**kw)


def test_events_on_follows_kv_events() -> None:
    assert _off(kv_events=True).config.events_on
