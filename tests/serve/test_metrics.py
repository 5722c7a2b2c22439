"""/metrics parses with prometheus_client's parser, types are right, the counters move, and every series
served is documented in docs/serving.md (and every documented one served)."""

from __future__ import annotations

import re
import threading
from collections.abc import Iterator
from pathlib import Path

import anyio
import httpx
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

import aiokv
from aiokv.engine import Engine, PagedKVCache, Transformer
from aiokv.metrics import AiokvCollector, RequestMetrics

from ._metrics import Samples, parse
from ._metrics import value as _value
from ._server import TINY, ServerThread, config

DOCS = Path(__file__).resolve().parents[2] / "docs"

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


def _scrape(http: httpx.Client) -> Samples:
    r = http.get("/metrics")
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/plain")
    return parse(r.text)


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
        await off.flush()  # the write-through to the disk tier is done: the scrape and stats() agree
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


# ------------------------------------------------------------------------------- docs/serving.md vs /metrics
_SERIES = re.compile(r"`((?:aiokv|vllm):[a-z0-9_]+)(?:\{([a-z_,]*)\})?`")


def documented_series(doc: str, section: str, prefix: str) -> dict[str, frozenset[str]]:
    """``{wire name: label names}`` of the series named in the first column of the tables of ``doc``'s
    ``section`` (``## <section>`` up to the next ``## ``), e.g. ``aiokv:tier_health{tier,state}``."""
    text = (DOCS / doc).read_text()
    body = text.split(f"\n## {section}\n", 1)[1].split("\n## ", 1)[0]
    out: dict[str, frozenset[str]] = {}
    for line in body.splitlines():
        if not line.startswith("| `"):
            continue
        for name, labels in _SERIES.findall(line.split(" | ", 1)[0]):
            if name.startswith(prefix):
                assert name not in out, f"{name} is listed twice in {doc}"
                out[name] = frozenset(filter(None, (labels or "").split(",")))
    return out


def exported_series(text: str, constant: frozenset[str]) -> dict[str, tuple[str, frozenset[str]]]:
    """``{wire name: (type, label names)}`` of an exposition; counters by their ``_total`` name, histograms by
    their base name (``le`` dropped). Every sample must carry the ``constant`` labels, which are left out."""
    out: dict[str, tuple[str, frozenset[str]]] = {}
    for fam in text_string_to_metric_families(text):
        name = fam.name + "_total" if fam.type == "counter" else fam.name
        labels: set[str] = set()
        for s in fam.samples:
            assert constant <= s.labels.keys(), f"{s.name}{s.labels} lacks {set(constant)}"
            labels |= s.labels.keys() - constant - {"le"}
        out[name] = (fam.type, frozenset(labels))
    return out


@pytest.fixture(scope="module")
def full_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    """A server with a CPU and a disk tier, so that every tier series has a tier to report."""
    disk = tmp_path_factory.mktemp("disk")
    server = ServerThread(config(tiers=f"cpu=64MiB,disk={disk}:64MiB")).start()
    yield server
    server.stop()


def test_every_served_series_is_documented_and_every_documented_one_served(full_server: ServerThread) -> None:
    """The series /metrics serves (name and label names), once traffic made every one appear, are exactly
    those docs/serving.md's Metrics table lists: a new series must be documented, a documented one served."""
    with httpx.Client(base_url=full_server.url, timeout=30) as http:
        prompt = "every series " * 20
        for _ in range(2):  # the second finds the first's prefix: loads, lower-tier lookups, cached tokens
            r = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 3, "temperature": 0})
            assert r.status_code == 200
            full_server.engine_idle_stats()
        text = http.get("/metrics").text
    exported = exported_series(text, frozenset({"model_name"}))
    # prometheus_client's creation timestamps of the server's own counters and histograms (documented once).
    created = {
        n
        for n, (kind, _) in exported.items()
        if kind == "gauge"
        and n.endswith("_created")
        and (
            exported.get(n.removesuffix("_created") + "_total", ("",))[0] == "counter"
            or exported.get(n.removesuffix("_created"), ("",))[0] == "histogram"
        )
    }
    served = {n: labels for n, (_, labels) in exported.items() if n not in created}
    documented = documented_series("serving.md", "Metrics", "aiokv:")
    undocumented = {n: sorted(ls) for n, ls in served.items() if n not in documented}
    never_served = sorted(n for n in documented if n not in served)
    wrong_labels = {
        n: {"served": sorted(served[n]), "documented": sorted(ls)}
        for n, ls in documented.items()
        if n in served and served[n] != ls
    }
    assert undocumented == {}, "served but not in docs/serving.md's Metrics table"
    assert never_served == [], "documented but not served"
    assert wrong_labels == {}, "label names differ"
    assert "`<name>_created`" in (DOCS / "serving.md").read_text()
