"""Request lifecycles against a real uvicorn whose engine forwards are held at a gate: disconnects abort
and free every block, a full queue answers 429, deadlines answer 504, shutdown drains then aborts."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from typing import Any

import anyio
import httpx
import openai
import pytest

from aiokv.serve import ServiceStats

from ._server import Gate, GatedTransformer, ServerThread, config


@pytest.fixture
def gate() -> Iterator[Gate]:
    g = Gate()
    yield g
    g.open()  # whatever happened, let the engine finish so the server can close


def _start(gate: Gate, **changes: Any) -> ServerThread:
    return ServerThread(config(**changes), model=GatedTransformer(gate)).start()


def _wait(server: ServerThread, predicate: Any) -> ServiceStats:
    return server.call(lambda: server.service.wait_for(predicate))


def _assert_all_blocks_free(server: ServerThread, aborted: int) -> None:
    stats = server.engine_idle_stats()
    assert stats.free_blocks == stats.num_blocks
    assert stats.releasing_blocks == 0
    assert stats.aborted == aborted
    off = server.service.offloader
    if off is not None:
        assert server.call(off.stats).requests_open == 0


def _events(lines: Iterator[str]) -> Iterator[Any]:
    for line in lines:
        if line.startswith("data: "):
            yield line[6:] if line == "data: [DONE]" else json.loads(line[6:])


def test_disconnect_before_the_first_token_frees_every_block(gate: Gate) -> None:
    """A streaming client leaves while its prefill is held in the engine: the request is aborted."""
    server = _start(gate)
    try:
        body = {"prompt": "x" * 100, "max_tokens": 50, "stream": True, "ignore_eos": True}
        with (
            httpx.Client(timeout=30) as http,
            http.stream("POST", server.url + "/v1/completions", json=body) as r,
        ):
            assert r.status_code == 200
            gate.wait_blocked()
            assert _wait(server, lambda s: s.choices_queued == 1).choices_decoding == 0
        stats = _wait(server, lambda s: s.requests_in_flight == 0)
        assert stats.cancelled_by_client == 1
        gate.open()
        _assert_all_blocks_free(server, aborted=1)
    finally:
        gate.open()
        server.stop()
    assert server.leaked == []


def test_disconnect_after_the_first_token_frees_every_block(gate: Gate) -> None:
    server = _start(gate)
    try:
        gate.allow(1)  # the prefill: the first token, then the next forward waits
        body = {
            "messages": [{"role": "user", "content": "hi " * 40}],
            "max_tokens": 50,
            "stream": True,
            "ignore_eos": True,
        }
        with (
            httpx.Client(timeout=30) as http,
            http.stream("POST", server.url + "/v1/chat/completions", json=body) as r,
        ):
            first = next(_events(r.iter_lines()))
            assert first["choices"][0]["delta"]["role"] == "assistant"
            gate.wait_blocked()
        assert _wait(server, lambda s: s.requests_in_flight == 0).cancelled_by_client == 1
        gate.open()
        _assert_all_blocks_free(server, aborted=1)
    finally:
        gate.open()
        server.stop()


def test_disconnect_of_a_non_streaming_request_aborts_it(gate: Gate) -> None:
    """Regression: a non-streaming request kept running after its client went away."""
    server = _start(gate)
    try:
        host, port = server.url.removeprefix("http://").split(":")
        payload = json.dumps({"prompt": "y" * 64, "max_tokens": 200, "ignore_eos": True}).encode()
        with socket.create_connection((host, int(port)), timeout=30) as sock:
            sock.sendall(
                b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                + f"content-length: {len(payload)}\r\n\r\n".encode()
                + payload
            )
            gate.wait_blocked()
        assert _wait(server, lambda s: s.requests_in_flight == 0).cancelled_by_client == 1
        gate.open()
        _assert_all_blocks_free(server, aborted=1)
    finally:
        gate.open()
        server.stop()


def test_a_full_queue_answers_429(gate: Gate) -> None:
    server = _start(gate, max_num_seqs=1, max_queued_requests=1)
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="-", max_retries=0, timeout=30)
        running = client.completions.create(model="aiokv-tiny", prompt="a" * 20, max_tokens=3, stream=True)
        gate.wait_blocked()  # the first request is in a forward
        waiting = client.completions.create(model="aiokv-tiny", prompt="b" * 20, max_tokens=3, stream=True)
        _wait(server, lambda s: s.choices_queued == 2 and s.choices_reserved == 0)
        with pytest.raises(openai.RateLimitError, match="queue is full") as exc:
            client.completions.create(model="aiokv-tiny", prompt="c", max_tokens=1)
        assert exc.value.response.headers["retry-after"] == "1"
        assert exc.value.code == "queue_full"
        gate.open()
        assert len([c for c in running if c.choices]) >= 1
        assert len([c for c in waiting if c.choices]) >= 1
        assert server.call(server.service.stats).rejected_queue_full == 1
        _assert_all_blocks_free(server, aborted=0)
        client.close()
    finally:
        gate.open()
        server.stop()


def test_request_timeout_answers_504_and_aborts(gate: Gate) -> None:
    server = _start(gate, request_timeout=0.3)
    try:
        with httpx.Client(base_url=server.url, timeout=30) as http:
            r = http.post("/v1/completions", json={"prompt": "z", "max_tokens": 5})
            assert r.status_code == 504
            assert r.json()["error"]["code"] == "request_timeout"
            body = {"prompt": "z", "max_tokens": 5, "stream": True}
            with http.stream("POST", "/v1/completions", json=body) as s:
                events = list(_events(s.iter_lines()))
        assert events[-2]["error"]["code"] == "request_timeout"
        assert events[-1] == "[DONE]"
        assert server.call(server.service.stats).timed_out == 2
        gate.open()
        _assert_all_blocks_free(server, aborted=2)
    finally:
        gate.open()
        server.stop()


@pytest.mark.asyncio
async def test_shutdown_drains_then_aborts_within_its_deadline(gate: Gate) -> None:
    """Shutdown stops accepting, lets a short request finish, aborts a long one at the drain deadline, then
    closes the engine and the offloader: no task left, every block back."""
    grace = 3.0  # generous: the short request needs three forwards within it even on a loaded CI machine
    server = _start(gate, max_num_seqs=2, drain_timeout=grace)
    short: list[Any] = []
    long: list[Any] = []
    async with httpx.AsyncClient(base_url=server.url, timeout=30) as http:

        async def stream(body: dict[str, Any], out: list[Any]) -> None:
            async with http.stream("POST", "/v1/completions", json=body) as r:
                assert r.status_code == 200
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        out.append(line[6:] if line == "data: [DONE]" else json.loads(line[6:]))

        async with anyio.create_task_group() as tg:
            tg.start_soon(stream, {"prompt": "short", "max_tokens": 2, "stream": True}, short)
            tg.start_soon(
                stream, {"prompt": "long", "max_tokens": 2000, "stream": True, "ignore_eos": True}, long
            )
            await anyio.to_thread.run_sync(_wait, server, lambda s: s.choices_queued == 2)
            assert (await http.get("/ready")).status_code == 200  # leaves an idle kept-alive connection
            # Drain while both are in flight: three forwards finish the short one whichever request the first
            # forward held (one or both: a request is admitted as soon as it arrives), the long one is held.
            t0 = time.perf_counter()
            server.handle.shutdown()
            await anyio.to_thread.run_sync(_wait, server, lambda s: s.state.value == "draining")
            ready = await http.get("/ready")  # a kept-alive connection still answers, but not ready
            assert ready.status_code == 503
            assert ready.json() == {"status": "draining"}
            refused = await http.post("/v1/completions", json={"prompt": "late", "max_tokens": 1})
            assert refused.status_code == 503
            assert refused.json()["error"]["code"] == "shutting_down"
            with pytest.raises(httpx.ConnectError):  # the listening socket is closed
                async with httpx.AsyncClient(base_url=server.url) as fresh:
                    await fresh.get("/health")
            gate.allow(3)
        aborted_after = time.perf_counter() - t0
    assert short[-1] == "[DONE]"
    assert short[-2]["choices"][0]["finish_reason"] == "length"
    assert long[-2]["error"]["code"] == "shutdown"
    assert long[-1] == "[DONE]"
    assert grace <= aborted_after < grace + 5
    gate.open()  # the engine's held forward ends; then it closes
    await anyio.to_thread.run_sync(server.stop)
    assert time.perf_counter() - t0 < grace + 10
    assert server.leaked == []
    stats = server.service.stats()
    assert (stats.requests_completed, stats.cancelled_by_shutdown) == (1, 1)
    engine = server.service.engine
    assert engine is not None
    assert engine.stats().free_blocks == engine.stats().num_blocks


def test_engine_failure_makes_health_and_ready_fail(gate: Gate) -> None:
    class Boom(GatedTransformer):
        def forward(self, chunks: Any, kv: Any) -> Any:
            raise RuntimeError("boom")

    server = ServerThread(config(), model=Boom(gate)).start()
    try:
        with httpx.Client(base_url=server.url, timeout=30) as http:
            assert http.get("/health").status_code == 200
            r = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
            assert r.status_code in (500, 503)
            assert "boom" in r.json()["error"]["message"]
            health = http.get("/health")
            assert health.status_code == 503
            assert "boom" in health.json()["reason"]
            assert http.get("/ready").status_code == 503
            r = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
            assert r.status_code == 503
            assert r.json()["error"]["code"] == "engine_unhealthy"
    finally:
        server.stop()


def test_api_key_guards_the_v1_routes() -> None:
    server = ServerThread(config(api_key="s3cret")).start()
    try:
        with httpx.Client(base_url=server.url, timeout=30) as http:
            r = http.get("/v1/models")
            assert r.status_code == 401
            assert r.json()["error"]["code"] == "invalid_api_key"
            assert http.get("/health").status_code == 200  # probes need no key
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="s3cret", max_retries=0)
        assert client.models.list().data[0].id == "aiokv-tiny"
        client.close()
    finally:
        server.stop()
