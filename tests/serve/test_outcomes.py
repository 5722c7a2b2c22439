"""How requests end, as /metrics tells it: ``aiokv:engine_requests_total{outcome,reason}`` (the engine) and
``aiokv:server_requests_total{outcome,reason}`` (HTTP) against a real uvicorn. A stop string is a normal
finish, not an abort; disconnects, deadlines and shutdown are aborts with their reason; errors are failures."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from prometheus_client import generate_latest

from ._metrics import Samples, delta, outcomes, parse, value
from ._server import Gate, GatedTransformer, ServerThread, config

ENGINE = "aiokv:engine_requests"
HTTP = "aiokv:server_requests"


@pytest.fixture
def gate() -> Iterator[Gate]:
    g = Gate()
    yield g
    g.open()  # whatever happened, let the engine finish so the server can close


def _scrape(server: ServerThread) -> Samples:
    with httpx.Client(base_url=server.url, timeout=30) as http:
        r = http.get("/metrics")
    assert r.status_code == 200
    return parse(r.text)


def _moved(before: Samples, after: Samples) -> tuple[dict[Any, float], dict[Any, float]]:
    """The engine's and the server's outcome series that moved between two scrapes."""
    engine = delta(outcomes(after, ENGINE), outcomes(before, ENGINE))
    return engine, delta(outcomes(after, HTTP), outcomes(before, HTTP))


def _wait_in_flight(server: ServerThread, n: int) -> None:
    server.call(lambda: server.service.wait_for(lambda s: s.requests_in_flight == n))


def test_a_stop_string_counts_as_finished_with_reason_stop(offload_server: ServerThread) -> None:
    """Regression: a chat request that ended on a stop string (``finish_reason: "stop"``) was counted as
    ``engine_requests_total{outcome="aborted"}``, the label of a client disconnect."""
    body: dict[str, Any] = {
        "messages": [{"role": "user", "content": "tell me"}],
        "max_tokens": 24,
        "temperature": 0,
        "ignore_eos": True,
    }
    with httpx.Client(base_url=offload_server.url, timeout=30) as http:
        text = http.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]["content"]
        assert len(text) >= 6
        offload_server.engine_idle_stats()
        before = _scrape(offload_server)
        r = http.post("/v1/chat/completions", json={**body, "stop": [text[3:6]]})
        assert r.json()["choices"][0]["finish_reason"] == "stop"
        assert r.json()["usage"]["completion_tokens"] < 24
        offload_server.engine_idle_stats()
        after = _scrape(offload_server)
    engine, server = _moved(before, after)
    assert engine == {("finished", "stop"): 1}
    assert server == {("completed", "stop"): 1}
    stop = {"finished_reason": "stop"}
    assert value(after, "counter", "aiokv:request_success", **stop) == (
        value(before, "counter", "aiokv:request_success", **stop) + 1
    )
    # The choice's engine timings are known now (they were not recorded for a stop string before).
    for name in ("aiokv:request_queue_time_seconds", "aiokv:request_admission_time_seconds"):
        assert value(after, "histogram", name) == value(before, "histogram", name) + 1, name


def test_max_tokens_counts_as_finished_with_reason_length(offload_server: ServerThread) -> None:
    before = _scrape(offload_server)
    with httpx.Client(base_url=offload_server.url, timeout=30) as http:
        r = http.post("/v1/completions", json={"prompt": "abc", "max_tokens": 4, "n": 2, "ignore_eos": True})
        assert [c["finish_reason"] for c in r.json()["choices"]] == ["length", "length"]
    offload_server.engine_idle_stats()
    engine, server = _moved(before, _scrape(offload_server))
    assert engine == {("finished", "length"): 2}  # one per choice
    assert server == {("completed", "length"): 1}  # one per HTTP request


def test_a_client_disconnect_counts_as_aborted(gate: Gate) -> None:
    server = ServerThread(config(), model=GatedTransformer(gate)).start()
    try:
        before = _scrape(server)  # a scrape runs no forward
        gate.allow(1)  # the prefill: the first token, then the next forward waits
        body = {"prompt": "x" * 40, "max_tokens": 50, "stream": True, "ignore_eos": True}
        with (
            httpx.Client(timeout=30) as http,
            http.stream("POST", server.url + "/v1/completions", json=body) as r,
        ):
            next(line for line in r.iter_lines() if line.startswith("data: "))  # the first token
            gate.wait_blocked()
        _wait_in_flight(server, 0)
        gate.open()
        server.engine_idle_stats()
        engine, http_moved = _moved(before, _scrape(server))
    finally:
        gate.open()
        server.stop()
    assert engine == {("aborted", "cancelled"): 1}
    assert http_moved == {("cancelled_by_client", "client_disconnect"): 1}


def test_a_request_timeout_counts_as_aborted(gate: Gate) -> None:
    server = ServerThread(config(request_timeout=0.3), model=GatedTransformer(gate)).start()
    try:
        before = _scrape(server)  # every forward is held from now on: the request runs past its deadline
        with httpx.Client(base_url=server.url, timeout=30) as http:
            r = http.post("/v1/completions", json={"prompt": "z", "max_tokens": 5})
        assert r.json()["error"]["code"] == "request_timeout"
        gate.open()
        server.engine_idle_stats()
        engine, http_moved = _moved(before, _scrape(server))
    finally:
        gate.open()
        server.stop()
    assert engine == {("aborted", "cancelled"): 1}
    assert http_moved == {("timed_out", "request_timeout"): 1}


def test_a_shutdown_counts_requests_in_flight_as_aborted(gate: Gate) -> None:
    server = ServerThread(config(), model=GatedTransformer(gate)).start()
    try:
        body = {"prompt": "long", "max_tokens": 500, "stream": True, "ignore_eos": True}
        with (
            httpx.Client(timeout=30) as http,
            http.stream("POST", server.url + "/v1/completions", json=body) as r,
        ):
            gate.wait_blocked()  # its prefill is held
            server.handle.shutdown(hurry=True)  # no grace: abort what is in flight
            events = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: {")]
        assert events[-1]["error"]["code"] == "shutdown"
        gate.open()
    finally:
        gate.open()
        server.stop()
    after = parse(generate_latest(server.service.registry).decode())  # what the last scrape would have read
    assert outcomes(after, ENGINE) == {
        **dict.fromkeys(outcomes(after, ENGINE), 0.0),
        ("aborted", "cancelled"): 1,
    }
    assert outcomes(after, HTTP) == {
        **dict.fromkeys(outcomes(after, HTTP), 0.0),
        ("cancelled_by_shutdown", "shutdown"): 1,
    }


def test_an_engine_failure_counts_as_failed(gate: Gate) -> None:
    class Boom(GatedTransformer):
        def forward(self, chunks: Any, kv: Any) -> Any:
            raise RuntimeError("boom")

    server = ServerThread(config(), model=Boom(gate)).start()
    try:
        before = _scrape(server)
        with httpx.Client(base_url=server.url, timeout=30) as http:
            r = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert "boom" in r.json()["error"]["message"]
        engine, http_moved = _moved(before, _scrape(server))
    finally:
        server.stop()
    assert engine == {("failed", "error"): 1}
    reason = {500: "internal_error", 503: "engine_unhealthy"}[r.status_code]
    assert r.json()["error"]["code"] == reason
    assert http_moved == {("failed", reason): 1}
