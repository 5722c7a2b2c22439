"""Fixtures for the engine tests: a tiny seeded model (fast on 2 CPU cores) and workload helpers."""

from __future__ import annotations

import pytest

from aiokv.engine import ModelConfig, Transformer

TINY = ModelConfig(
    num_layers=2,
    hidden_size=64,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    intermediate_size=128,
    vocab_size=256,
    max_position=4096,
    seed=7,
)


@pytest.fixture(scope="session")
def tiny_model() -> Transformer:
    return Transformer(TINY)
