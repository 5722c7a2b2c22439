"""Prometheus metrics for any server that embeds aiokv (``pip install 'aiokv[serve]'`` for prometheus_client).

:class:`AiokvCollector` reads ``stats()`` of an :class:`~aiokv.Offloader` (with its tiers) and of a reference
:class:`~aiokv.engine.Engine` **at scrape time**: nothing is instrumented on the hot path and nothing is counted
twice. Register one per offloader/engine::

    from prometheus_client import REGISTRY
    from aiokv.metrics import AiokvCollector

    REGISTRY.register(AiokvCollector(offloader=off, engine=engine, labels={"model_name": "llama-8b"}))

:class:`RequestMetrics` holds what only a server sees: time to first token, time per output token, end-to-end
latency and request outcomes, as histograms and counters the server observes when a request progresses.

Names follow vLLM's (``vllm:prefix_cache_queries`` -> ``aiokv:prefix_cache_queries``, ``vllm:kv_offload_store_bytes``,
``vllm:time_to_first_token_seconds``, ...) with the ``aiokv:`` prefix, so dashboards carry over; counters end in
``_total`` on the wire. docs/serving.md lists every metric with ready-to-paste queries.

Scraped from another thread (``prometheus_client.start_http_server``), the stats are read on the event loop
(one ``call_soon_threadsafe``, bounded by ``timeout``), so a scrape always sees a consistent snapshot.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ._errors import ClosedError
from .bridge import call_in_loop

if TYPE_CHECKING:
    from . import Offloader
    from .engine import Engine

__all__ = [
    "TIER_HEALTH_STATES",
    "TPOT_BUCKETS",
    "TTFT_BUCKETS",
    "AiokvCollector",
    "RequestMetrics",
]

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0)  # fmt: skip
"""Seconds; vLLM's TTFT buckets."""
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
                1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
"""Seconds; vLLM's time-per-output-token buckets, with finer steps below 10 ms (a CPU model decodes fast)."""
E2E_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
               60.0, 120.0, 240.0, 480.0, 960.0)  # fmt: skip
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)
TIER_HEALTH_STATES = ("up", "degraded", "down", "unknown")
"""Values of the ``state`` label of ``aiokv:tier_health`` (exactly one is 1 per tier)."""
_ENGINE_OUTCOMES = (
    ("finished", "stop", "finished_stop"),  # an eos token, or the caller's stop string (TokenStream.finish)
    ("finished", "length", "finished_length"),
    ("aborted", "cancelled", "aborted_cancelled"),  # the caller left: a disconnect, a deadline, a drain
    ("aborted", "shutdown", "aborted_shutdown"),  # the engine closed with it in flight
    ("failed", "error", "failed"),  # in flight when the engine failed
)
"""``(outcome, reason, EngineStats field)`` of each ``aiokv:engine_requests_total`` series."""


class _Families:
    """Builds metric families with the collector's prefix and constant labels."""

    def __init__(self, namespace: str, labels: Mapping[str, str]) -> None:
        self.prefix = f"{namespace}:" if namespace else ""
        self.names = list(labels)
        self.values = list(labels.values())
        self.out: list[Metric] = []
        self._by_name: dict[str, Metric] = {}

    def gauge(self, name: str, doc: str, value: float, **labels: str) -> None:
        self._add(GaugeMetricFamily, name, doc, value, labels)

    def counter(self, name: str, doc: str, value: float, **labels: str) -> None:
        self._add(CounterMetricFamily, name, doc, value, labels)

    def _add(self, cls: Any, name: str, doc: str, value: float, labels: Mapping[str, str]) -> None:
        full = self.prefix + name
        fam = next(
            (m for m in self.out if m.name == full.removesuffix("_total") and isinstance(m, cls)), None
        )
        if fam is None:
            fam = cls(full, doc, labels=[*self.names, *labels])
            self.out.append(fam)
        fam.add_metric([*self.values, *labels.values()], float(value))


class AiokvCollector(Collector):
    """A ``prometheus_client`` collector over an offloader's and/or an engine's ``stats()``.

    ``labels`` are added to every sample (e.g. ``{"model_name": ...}``); ``namespace`` is the name prefix
    (``aiokv`` gives ``aiokv:...``). ``timeout`` bounds a scrape from another thread waiting for the loop."""

    def __init__(
        self,
        offloader: Offloader | None = None,
        engine: Engine | None = None,
        *,
        namespace: str = "aiokv",
        labels: Mapping[str, str] | None = None,
        timeout: float = 5.0,
    ) -> None:
        if offloader is None and engine is None:
            raise ValueError("AiokvCollector needs an offloader, an engine or both")
        self._off = offloader
        self._engine = engine
        self._namespace = namespace
        self._labels = dict(labels or {})
        self._timeout = timeout

    def describe(self) -> Iterable[Metric]:
        return []  # no names registered up front: the tiers are only known once the offloader runs

    def collect(self) -> Iterable[Metric]:
        off_stats, eng_stats = self._snapshot()
        f = _Families(self._namespace, self._labels)
        if off_stats is not None:
            assert self._off is not None
            _offloader_metrics(f, off_stats, self._off)
        if eng_stats is not None:
            _engine_metrics(f, eng_stats)
        return f.out

    def _read(self) -> tuple[Any, Any]:
        return (
            self._off.stats() if self._off is not None else None,
            self._engine.stats() if self._engine is not None else None,
        )

    def _snapshot(self) -> tuple[Any, Any]:
        loop = None
        if self._off is not None:
            try:
                loop = self._off.loop
            except ClosedError:  # not started: nothing runs on a loop yet
                loop = None
        if loop is None or loop.is_closed() or not loop.is_running() or _on_loop(loop):
            return self._read()
        return call_in_loop(loop, self._read).result(self._timeout)


def _on_loop(loop: asyncio.AbstractEventLoop) -> bool:
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:
        return False


# ---------------------------------------------------------------------------------------------- offloader
def _offloader_metrics(f: _Families, s: Any, off: Offloader) -> None:
    bs = off.block_size
    f.counter(
        "prefix_cache_queries", "Prompt tokens looked up in aiokv (whole blocks).", (s.hits + s.misses) * bs
    )
    f.counter("prefix_cache_hits", "Prompt tokens found in aiokv (loadable from a tier).", s.hit_tokens)
    f.counter("prefix_cache_lookups", "Lookups (one per admission of a request).", s.lookups)
    f.counter("kv_offload_store_bytes", "Bytes copied from engine blocks to the CPU tier.", s.bytes_stored)
    f.counter("kv_offload_load_bytes", "Bytes copied from the CPU tier into engine blocks.", s.bytes_loaded)
    f.counter("kv_offload_store_blocks", "Blocks copied from engine blocks to the CPU tier.", s.blocks_stored)
    f.counter(
        "kv_offload_load_blocks", "Blocks copied from the CPU tier into engine blocks.", s.blocks_loaded
    )
    skip = "Stores skipped, by reason."
    f.counter("kv_offload_store_skipped_blocks", skip, s.stores_deduplicated, reason="already_cached")
    f.counter("kv_offload_store_skipped_blocks", skip, s.stores_dropped, reason="no_room")
    f.gauge("kv_offload_in_flight_copies", "Copies submitted and not complete.", s.in_flight)
    f.gauge("kv_offload_in_flight_bytes", "Bytes of the copies in flight.", s.in_flight_bytes)
    f.counter("kv_offload_evictions", "Blocks evicted from the CPU tier.", s.evictions)
    err = "Failed operations, by kind (lower_tier: staging misses and write-through failures)."
    f.counter("kv_offload_errors", err, s.store_errors, op="store")
    f.counter("kv_offload_errors", err, s.load_errors, op="load")
    f.counter("kv_offload_errors", err, max(0, s.errors - s.store_errors - s.load_errors), op="lower_tier")
    f.counter(
        "kv_offload_staged_blocks", "Blocks brought up from lower tiers into the CPU tier.", s.staged_blocks
    )
    f.counter("kv_offload_write_through_blocks", "Blocks written to lower tiers.", s.write_through_blocks)
    f.counter("kv_offload_write_through_dropped_blocks", "Blocks not written to a lower tier (budget full).",
              s.write_through_dropped)  # fmt: skip
    f.gauge("kv_offload_write_through_in_flight_bytes", "Bytes queued or in flight towards lower tiers.",
            s.write_through_in_flight_bytes)  # fmt: skip
    f.counter("kv_offload_write_through_shed_blocks",
              "Blocks not written to a lower tier that could not keep up (write_through_max_delay_s).",
              s.write_through_dropped_slow)  # fmt: skip
    f.counter("kv_offload_lower_tier_deadline_misses",
              "Lower-tier lookups and reads abandoned at lower_tier_deadline_s (misses).",
              s.lower_tier_deadline_misses)  # fmt: skip
    skipped = "Hit blocks recomputed rather than loaded: restoring their run was predicted slower."
    f.counter("kv_offload_planner_skipped_blocks", skipped, s.planner_skipped_blocks)
    f.counter("kv_offload_planner_skipped_lookups", "Lower-tier lookups not made: no run it could hold would win.",
              s.planner_skipped_lookups)  # fmt: skip
    if s.prefill_tokens_per_s is not None:
        f.gauge("kv_offload_prefill_tokens_per_s", "Prefill speed the load planner compares loads with.",
                s.prefill_tokens_per_s)  # fmt: skip
    f.gauge("kv_offload_requests_open", "Requests open on the offloader.", s.requests_open)
    f.counter("kv_offload_requests", "Requests opened on the offloader.", s.requests_opened)
    tiers = [("cpu", off.cpu), *((t.name, t) for t in off.lower)]
    seen: dict[str, int] = {}
    for (name, _tier), ts in zip(tiers, s.tiers, strict=False):
        seen[name] = seen.get(name, 0) + 1
        label = name if seen[name] == 1 else f"{name}.{seen[name] - 1}"
        _tier_metrics(f, label, ts)


def _tier_metrics(f: _Families, tier: str, ts: Any) -> None:
    fields = (
        {fl.name: getattr(ts, fl.name) for fl in dataclasses.fields(ts)}
        if dataclasses.is_dataclass(ts)
        else {}
    )
    health = str(fields.get("health", "up" if fields else "unknown"))
    if health not in TIER_HEALTH_STATES:
        health = "unknown"
    for state in TIER_HEALTH_STATES:
        f.gauge("tier_health", "1 for the tier's current health state (up, degraded, down; unknown: stats failed).",
                1.0 if state == health else 0.0, tier=tier, state=state)  # fmt: skip
    if not fields:
        return
    capacity: float | None = None
    used_bytes = 0.0
    if "num_slots" in fields and "used_slots" in fields:  # the CPU tier
        used = fields["used_slots"] / fields["num_slots"] if fields["num_slots"] else 0.0
        f.gauge(
            "kv_offload_cpu_cache_usage_perc", "Fraction of the CPU tier's slots holding blocks (0-1).", used
        )
        capacity = fields["num_slots"] * fields["slot_bytes"]
        used_bytes = fields["used_slots"] * fields["slot_bytes"]
    elif "num_slots" in fields and "entry_bytes" in fields:  # disk
        capacity = fields["num_slots"] * fields["entry_bytes"]
        used_bytes = fields["entries"] * fields["entry_bytes"]
    if capacity is not None:
        f.gauge("tier_capacity_bytes", "Bytes a tier can hold.", capacity, tier=tier)
        f.gauge("tier_used_bytes", "Bytes of blocks a tier holds.", used_bytes, tier=tier)
    counters: tuple[tuple[str, str, Callable[[Mapping[str, Any]], float]], ...] = (
        ("tier_evictions", "Blocks evicted from a tier.", lambda x: x.get("evictions", 0)),
        ("tier_lookups", "Lookups answered by a lower tier.", lambda x: x.get("lookups", 0)),
        ("tier_lookup_hit_blocks", "Blocks a lower tier reported present.", lambda x: x.get("lookup_hits", 0)),
        ("tier_read_bytes", "Bytes read (and verified) from a lower tier.", lambda x: x.get("read_bytes", 0)),
        ("tier_write_bytes", "Bytes written to a lower tier.", lambda x: x.get("stored_bytes", 0)),
        ("tier_corrupt_blocks", "Entries that failed verification (dropped).", lambda x: x.get("corrupt", 0)),
        ("tier_errors", "Failed lower-tier operations (I/O errors, round trips, timeouts).",
         lambda x: x.get("read_errors", 0) + x.get("dropped_io_error", 0) + x.get("errors", 0) + x.get("timeouts", 0)),
        ("tier_dropped_blocks", "Blocks a lower tier did not store.",
         lambda x: x.get("dropped", 0) + x.get("dropped_no_room", 0) + x.get("dropped_io_error", 0) + x.get("dropped_down", 0)),
    )  # fmt: skip
    for name, doc, get in counters:
        if name == "tier_evictions" or "lookups" in fields:
            f.counter(name, doc, get(fields), tier=tier)


# ------------------------------------------------------------------------------------------------- engine
def _engine_metrics(f: _Families, s: Any) -> None:
    f.gauge("num_requests_running", "Requests in the engine's running batch.", s.running)
    f.gauge("num_requests_waiting", "Requests queued for admission (new or preempted).", s.waiting)
    f.gauge("num_requests_admitting", "Requests holding blocks while aiokv looks up and loads their prefix.",
            s.admitting)  # fmt: skip
    used = 1.0 - s.free_blocks / s.num_blocks if s.num_blocks else 0.0
    f.gauge("kv_cache_usage_perc", "Fraction of the engine's KV blocks in use or being released (0-1).", used)
    f.gauge("kv_cache_free_blocks", "Engine KV blocks in the free pool.", s.free_blocks)
    f.gauge("kv_cache_releasing_blocks", "Engine KV blocks waiting for aiokv before they may be reused.",
            s.releasing_blocks)  # fmt: skip
    f.gauge("kv_cache_num_blocks", "Engine KV blocks in all.", s.num_blocks)
    f.counter("num_preemptions", "Requests preempted for lack of blocks.", s.preemptions)
    src = "Prompt tokens at admission, by source (computed by the model or restored by aiokv)."
    f.counter("prompt_tokens_by_source", src, s.prefill_tokens, source="local_compute")
    f.counter("prompt_tokens_by_source", src, s.cached_tokens, source="external_kv_transfer")
    f.counter("engine_steps", "Forwards run.", s.steps)
    f.counter("engine_forward_tokens", "Token positions run through the model.", s.forward_tokens)
    f.counter("engine_forward_seconds", "Seconds spent in forwards.", s.forward_s)
    f.counter("engine_load_wait_seconds", "Seconds requests spent awaiting aiokv loads (summed).", s.load_s)
    done = "Requests that left the engine, by outcome (finished, aborted, failed) and reason."
    for outcome, reason, stat in _ENGINE_OUTCOMES:
        f.counter("engine_requests", done, getattr(s, stat), outcome=outcome, reason=reason)
    f.counter("engine_release_errors", "Finish/preempt/abort calls that reported an error.", s.release_errors)


# ------------------------------------------------------------------------------------------------ requests
class RequestMetrics:
    """Histograms and counters a server observes per request (TTFT, time per output token, latency).

    ``registry`` defaults to a new :class:`~prometheus_client.CollectorRegistry` (several servers in one
    process, e.g. tests, do not collide); ``labels`` names constant label values, e.g. the model name."""

    def __init__(
        self,
        registry: CollectorRegistry | None = None,
        *,
        namespace: str = "aiokv",
        labels: Mapping[str, str] | None = None,
    ) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        p = f"{namespace}:" if namespace else ""
        self._labels = dict(labels or {})
        names: Sequence[str] = list(self._labels)
        reg = self.registry

        def hist(name: str, doc: str, buckets: Sequence[float]) -> Histogram:
            return Histogram(p + name, doc, names, buckets=buckets, registry=reg)

        self.ttft = hist("time_to_first_token_seconds", "Request arrival to its first token.", TTFT_BUCKETS)
        self.tpot = hist(
            "time_per_output_token_seconds", "Mean time between output tokens of a request.", TPOT_BUCKETS
        )
        self.e2e = hist("e2e_request_latency_seconds", "Request arrival to its last token.", E2E_BUCKETS)
        self.queue = hist(
            "request_queue_time_seconds", "Time a request waited before its first admission.", E2E_BUCKETS
        )
        self.prompt_len = hist("request_prompt_tokens", "Prompt tokens per request.", TOKEN_BUCKETS)
        self.gen_len = hist("request_generation_tokens", "Generated tokens per request.", TOKEN_BUCKETS)
        self.prompt_tokens = Counter(
            p + "prompt_tokens", "Prompt tokens of finished requests.", names, registry=reg
        )
        self.cached_tokens = Counter(p + "prompt_tokens_cached", "Prompt tokens restored by aiokv (usage.prompt_tokens_details.cached_tokens).", names, registry=reg)  # fmt: skip
        self.generation_tokens = Counter(p + "generation_tokens", "Tokens generated.", names, registry=reg)
        self.success = Counter(p + "request_success", "Requests finished, by finish reason.", [*names, "finished_reason"], registry=reg)  # fmt: skip
        self._values = list(self._labels.values())

    def observe_first_token(self, ttft_s: float) -> None:
        self.ttft.labels(*self._values).observe(ttft_s)

    def observe_finished(
        self,
        *,
        finish_reason: str,
        prompt_tokens: int,
        generation_tokens: int,
        cached_tokens: int,
        ttft_s: float | None,
        latency_s: float,
        queued_s: float | None = None,
    ) -> None:
        """One request (one choice of an OpenAI request) that ended normally."""
        v = self._values
        self.success.labels(*v, finish_reason).inc()
        self.prompt_len.labels(*v).observe(prompt_tokens)
        self.gen_len.labels(*v).observe(generation_tokens)
        self.prompt_tokens.labels(*v).inc(prompt_tokens)
        self.cached_tokens.labels(*v).inc(min(cached_tokens, prompt_tokens))
        self.generation_tokens.labels(*v).inc(generation_tokens)
        self.e2e.labels(*v).observe(latency_s)
        if queued_s is not None:
            self.queue.labels(*v).observe(queued_s)
        if ttft_s is not None and generation_tokens > 1:
            self.tpot.labels(*v).observe((latency_s - ttft_s) / (generation_tokens - 1))
