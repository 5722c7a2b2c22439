"""The connector's Prometheus series (``vllm:aiokv_<counter>_total``) are the ones docs/vllm.md names, and
each reads a real ``OffloaderStats`` field (a misspelt one would read 0 for ever)."""

from __future__ import annotations

import dataclasses
import functools
import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm")

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

import aiokv
from aiokv.vllm import AiokvConnector

DOCS = Path(__file__).resolve().parents[2] / "docs"


def _documented() -> set[str]:
    """The counters docs/vllm.md lists after "``vllm:aiokv_<counter>_total`` (...)"."""
    text = " ".join((DOCS / "vllm.md").read_text().split())
    listed = re.search(r"`vllm:aiokv_<counter>_total` \(([^)]*)\)", text)
    assert listed is not None, "docs/vllm.md no longer lists the connector's counters"
    return set(re.findall(r"`([a-z_]+)`", listed.group(1)))


def _registered(registry: CollectorRegistry) -> dict[type[Any], Any]:
    """vLLM's ``metric_types``: the prometheus_client classes, bound to ``registry``."""
    return {cls: functools.partial(cls, registry=registry) for cls in (Gauge, Counter, Histogram)}


def test_connector_series_are_the_documented_counters_of_real_stats_fields() -> None:
    registry = CollectorRegistry()
    prom = AiokvConnector.build_prom_metrics(
        SimpleNamespace(kv_transfer_config=None),  # type: ignore[arg-type]
        _registered(registry),
        ["model_name", "engine"],
        {0: ["m", "0"]},
    )
    assert prom is not None
    prom.observe({"hits": 3, "blocks_loaded": 2}, engine_idx=0)
    served: dict[str, set[str]] = {}
    for fam in text_string_to_metric_families(generate_latest(registry).decode()):
        if fam.type == "counter":
            served[fam.name + "_total"] = {k for s in fam.samples for k in s.labels}
    counters = {n.removeprefix("vllm:aiokv_").removesuffix("_total") for n in served}
    assert all(n.startswith("vllm:aiokv_") for n in served)
    assert counters == _documented()
    assert all(labels == {"model_name", "engine"} for labels in served.values())
    fields = {f.name for f in dataclasses.fields(aiokv.OffloaderStats)}
    assert counters <= fields, f"not OffloaderStats fields: {sorted(counters - fields)}"
    values = {
        s.name: s.value
        for fam in text_string_to_metric_families(generate_latest(registry).decode())
        for s in fam.samples
        if fam.type == "counter"
    }
    assert values["vllm:aiokv_hits_total"] == 3.0
    assert values["vllm:aiokv_blocks_loaded_total"] == 2.0
