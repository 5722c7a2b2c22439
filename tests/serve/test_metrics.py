"""/metrics parses with prometheus_client's parser, types are right, and the counters move."""

from __future__ import annotations

import threading

import anyio
import httpx
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

import aiokv
from aiokv.engine import Engine, PagedKVCache, Transformer
from aiokv.metrics import AiokvCollector, RequestMetrics

from ._server import TINY, ServerThread

COUNTERS = {
    "aiokv:prefix_cache_queries",
    "aiokv:prefix_cache_hits",
    "aiokv:kv_offload_store_bytes",
    "aiokv:kv_offload_load_bytes",
    "aiokv:kv_offload_planner_skipped_blocks",
    "aiokv:kv_offload_planner_skipped_lookups",
    "aiokv:num_preemptions",
    "aiokv:prompt_tokens_by_source",
    "aiokv:request_success",
    "aiokv:generation_tokens",
    "aiokv:prompt_tokens_cached",
    "aiokv:server_requests",
}
GAUGES = {
    "aiokv:num_requests_running",
    "aiokv:num_requests_waiting",
    "aiokv:kv_cache_usage_perc",
    "aiokv:kv_offload_cpu_cache_usage_perc",
    "aiokv:tier_health",
    "aiokv:server_requests_in_flight",
    "aiokv:server_ready",
}
HISTOGRAMS = {
    "aiokv:time_to_first_token_seconds",
    "aiokv:time_per_output_token_seconds",
    "aiokv:e2e_request_latency_seconds",
    "aiokv:request_queue_time_seconds",
    "aiokv:request_admission_time_seconds",
    "aiokv:request_prefill_time_seconds",
}


def _scrape(http: httpx.Client) -> dict[str, dict[tuple[str, tuple[tuple[str, str], ...]], float]]:
    r = http.get("/metrics")
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/plain")
    out: dict[str, dict[tuple[str, tuple[tuple[str, str], ...]], float]] = {}
    for fam in text_string_to_metric_families(r.text):
        samples = out.setdefault(f"{fam.type}:{fam.name}", {})
        for s in fam.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def _value(
    metrics: dict[str, dict[tuple[str, tuple[tuple[str, str], ...]], float]],
    kind: str,
    name: str,
    **labels: str,
) -> float:
    samples = metrics[f"{kind}:{name}"]
    want = {"model_name": "aiokv-tiny", **labels}
    suffix = {"counter": "_total", "gauge": "", "histogram": "_count"}[kind]
    return sum(
        v
        for (n, ls), v in samples.items()
        if n == name + suffix and all(dict(ls).get(k) == x for k, x in want.items())
    )


def test_metrics_parse_and_counters_move(offload_server: ServerThread) -> None:
    with httpx.Client(base_url=offload_server.url, timeout=30) as http:
        before = _scrape(http)
        for kind, names in (("counter", COUNTERS), ("gauge", GAUGES), ("histogram", HISTOGRAMS)):
            missing = {n for n in names if f"{kind}:{n}" not in before}
            assert not missing, f"{kind}s missing: {missing}"
        prompt = "metrics " * 40
        for _ in range(2):
            r = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 3, "temperature": 0})
            assert r.status_code == 200
            offload_server.engine_idle_stats()  # stores complete before the next request looks up
        offload_server.engine_idle_stats()
        after = _scrape(http)
    for name in ("aiokv:prefix_cache_queries", "aiokv:prefix_cache_hits", "aiokv:kv_offload_store_bytes",
                 "aiokv:kv_offload_load_bytes", "aiokv:generation_tokens", "aiokv:prompt_tokens_cached"):  # fmt: skip
        assert _value(after, "counter", name) > _value(before, "counter", name), name
    assert (
        _value(after, "counter", "aiokv:request_success", finished_reason="length")
        >= _value(before, "counter", "aiokv:request_success", finished_reason="length") + 2
    )
    assert _value(after, "counter", "aiokv:server_requests", outcome="completed") >= 2
    for name in HISTOGRAMS:
        assert _value(after, "histogram", name) >= _value(before, "histogram", name) + 2
    assert _value(after, "gauge", "aiokv:tier_health", tier="cpu", state="up") == 1.0
    assert _value(after, "gauge", "aiokv:tier_health", tier="cpu", state="down") == 0.0
    assert _value(after, "gauge", "aiokv:server_ready") == 1.0
    assert _value(after, "gauge", "aiokv:num_requests_running") == 0.0
    assert 0.0 < _value(after, "gauge", "aiokv:kv_offload_cpu_cache_usage_perc") <= 1.0


@pytest.mark.asyncio
async def test_collector_works_for_any_embedding_server_and_from_another_thread(tmp_path: object) -> None:
    """AiokvCollector on a plain offloader and engine (no aiokv server), scraped from a thread as
    prometheus_client.start_http_server would: stats are read on the loop."""
    model = Transformer(TINY)
    cache = PagedKVCache(TINY, 32)
    tiers = [aiokv.CPUTier(capacity_bytes=4 << 20), aiokv.DiskTier(str(tmp_path), 4 << 20)]
    async with (
        aiokv.Offloader(cache.layout(), tiers=tiers) as off,
        Engine(model, cache, offloader=off) as engine,
    ):
        registry = CollectorRegistry()
        registry.register(AiokvCollector(off, engine, labels={"engine": "0"}))
        requests = RequestMetrics(registry, labels={"engine": "0"})
        requests.observe_first_token(0.01)
        await engine.generate(list(range(40)), max_tokens=2)
        await engine.wait_idle()  # its finish resolved: the stores are complete before the next lookup
        await engine.generate(list(range(40)), max_tokens=2)
        await engine.wait_idle()
        text: list[str] = []
        t = threading.Thread(target=lambda: text.append(generate_latest(registry).decode()))
        t.start()
        await anyio.to_thread.run_sync(t.join)  # the scrape thread needs this loop free to answer it
        fams = {f.name: f for f in text_string_to_metric_families(text[0])}
        stats = off.stats()
    assert fams["aiokv:prefix_cache_hits"].type == "counter"
    assert fams["aiokv:prefix_cache_hits"].samples[0].value == 32.0
    health = {(s.labels["tier"], s.labels["state"]): s.value for s in fams["aiokv:tier_health"].samples}
    assert health[("disk", "up")] == 1.0
    assert health[("disk", "down")] == 0.0
    capacity = {s.labels["tier"]: s.value for s in fams["aiokv:tier_capacity_bytes"].samples}
    used = {s.labels["tier"]: s.value for s in fams["aiokv:tier_used_bytes"].samples}
    cpu_stats, disk_stats = stats.tiers
    assert capacity == {
        "cpu": cpu_stats.num_slots * cpu_stats.slot_bytes,
        "disk": disk_stats.num_slots * disk_stats.entry_bytes,
    }
    assert used == {
        "cpu": cpu_stats.used_slots * cpu_stats.slot_bytes,
        "disk": disk_stats.entries * disk_stats.entry_bytes,
    }
    assert 0 < used["cpu"] <= capacity["cpu"] <= 4 << 20
    assert fams["aiokv:tier_write_bytes"].type == "counter"
    assert fams["aiokv:time_to_first_token_seconds"].type == "histogram"
