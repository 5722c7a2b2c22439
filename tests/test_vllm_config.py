"""``aiokv.vllm.ConnectorConfig``: the connector's options, checked without vLLM installed."""

from __future__ import annotations

import pytest

import aiokv
from aiokv.vllm import ConnectorConfig


def test_defaults_and_units() -> None:
    cfg = ConnectorConfig.from_extra_config(None)
    assert cfg.tiers == "cpu=4GiB"
    assert cfg.load_policy == "decide"
    sized = ConnectorConfig.from_extra_config(
        {"tiers": "cpu=1GiB,shm=engines:2GiB", "write_through_max_bytes": "64MiB"}
    )
    assert sized.write_through_max_bytes == 64 << 20


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (
            {"tierz": "cpu=1GiB", "x": 1},
            "kv_connector_extra_config has unknown key(s) 'tierz', 'x' for AiokvConnector",
        ),
        (
            {"tiers": "cpu=1GiB,redis=localhost:6379"},
            "kv_connector_extra_config['tiers']: redis tier must be a",
        ),
        (
            {"tiers": "cpu=1GiB,redis=redis://a:1/0,redis-cluster=redis://b:1/0"},
            "tiers must name each kind of tier at most once",
        ),
        ({"tiers": ""}, "kv_connector_extra_config['tiers'] must be a non-empty string"),
        ({"load_policy": "never"}, "kv_connector_extra_config['load_policy'] must be 'decide' or 'always'"),
        (
            {"lower_tier_deadline_s": 0},
            "kv_connector_extra_config['lower_tier_deadline_s'] must be a number of seconds > 0",
        ),
        (
            {"lookup_wait_s": float("nan")},
            "kv_connector_extra_config['lookup_wait_s'] must be a number of seconds >= 0",
        ),
        ({"copy_threads": 0}, "kv_connector_extra_config['copy_threads'] must be an int >= 1"),
        (
            {"prefill_tokens_per_s": True},
            "kv_connector_extra_config['prefill_tokens_per_s'] must be a number > 0",
        ),
        ({"salt": 7}, "kv_connector_extra_config['salt'] must be a non-empty string, got 7"),
    ],
)
def test_bad_options_name_the_key_and_the_constraint(extra: dict[str, object], message: str) -> None:
    with pytest.raises(aiokv.InvalidArgumentError) as info:
        ConnectorConfig.from_extra_config(extra)
    assert message in str(info.value)


def test_not_a_mapping_is_refused() -> None:
    with pytest.raises(aiokv.InvalidArgumentError, match="kv_connector_extra_config must be a mapping"):
        ConnectorConfig.from_extra_config(["tiers"])  # type: ignore[arg-type]
