"""No request stalls the others: huge, malformed and slow requests sent alongside normal ones while a prober
measures ``/health``. Every huge or malformed request gets its 4xx, every normal one its 200, the slow ones
finish, and ``/health`` never waits a second (before the fix, one 23 MB body of token ids held the event loop
for 8-16 s; benchmarks/bench_serve_stall.py measures the latencies)."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

import anyio
import httpx
import pytest

from ._server import ServerThread, config

MiB = 1 << 20
LIMIT = 8 * MiB  # the default max_request_bytes
CTX = 4096


@dataclass
class Attack:
    """One bad request and what it must get."""

    name: str
    body: bytes
    status: int
    code: str | None = None
    chunked: bool = False
    path: str = "/v1/completions"


def _ids_body(total_bytes: int) -> bytes:
    n = total_bytes // 5  # "511, "
    return json.dumps({"prompt": [511] * n, "max_tokens": 4}).encode()


def attacks() -> list[Attack]:
    """Bounded: about 100 MB of bodies in all."""
    chat = {"messages": [{"role": "user", "content": "m" * 200}] * 2000}
    return [
        Attack("25 MB of token ids", _ids_body(25 * MiB), 413, "request_too_large"),
        Attack("25 MB of token ids, chunked", _ids_body(25 * MiB), 413, "request_too_large", chunked=True),
        Attack(
            "25 MB string prompt", json.dumps({"prompt": "a" * (25 * MiB)}).encode(), 413, "request_too_large"
        ),
        Attack("7 MB of token ids", _ids_body(7 * MiB), 400, "context_length_exceeded"),
        Attack(
            "7 MB string prompt",
            json.dumps({"prompt": "b" * (7 * MiB)}).encode(),
            400,
            "context_length_exceeded",
        ),
        Attack(
            "7 MB of non-ASCII",
            json.dumps({"prompt": "é" * (3 * MiB)}, ensure_ascii=False).encode(),
            400,
            "context_length_exceeded",
        ),
        Attack(
            "0.4 MB chat",
            json.dumps(chat).encode(),
            400,
            "context_length_exceeded",
            path="/v1/chat/completions",
        ),
        Attack(
            "6 MB of tiny messages",
            json.dumps({"messages": [{"role": "user", "content": ""}] * 200_000}).encode(),
            413,
            "request_too_large",
            path="/v1/chat/completions",
        ),
        Attack("4 MB of strings", json.dumps({"prompt": ["s"] * 800_000}).encode(), 413, "request_too_large"),
        Attack("bad JSON", b'{"prompt": [1, 2', 400),
        Attack("deep nesting", b"[" * (1 * MiB), 400),
        Attack("NaN", b'{"prompt": "x", "temperature": NaN}', 400),
        Attack("wrong type", b'{"prompt": {"text": "x"}}', 400),
        Attack("max_tokens 1e30", b'{"prompt": "x", "max_tokens": 1e30}', 400, "context_length_exceeded"),
        Attack("n 5.5", b'{"prompt": "x", "n": 5.5}', 400),
        Attack("lone surrogate", b'{"prompt": "\\ud800"}', 400),
        Attack("empty body", b"", 400),
    ]


@dataclass
class Run:
    health_s: list[float] = field(default_factory=list)
    attack_status: dict[str, tuple[int, str | None]] = field(default_factory=dict)
    normal_status: list[int] = field(default_factory=list)
    slow_body_status: int | None = None
    slow_reader_done: bool = False
    truncated_sent: int = 0


def _host_port(url: str) -> tuple[str, int]:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    return host, int(port)


def _request(body: bytes) -> bytes:
    head = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    return f"{head}Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode() + body


def _slow_body(url: str) -> int:
    """A valid request whose bytes arrive a few at a time (a blocking socket, in a worker thread)."""
    body = json.dumps({"prompt": "slowly", "max_tokens": 2, "temperature": 0}).encode()
    with socket.create_connection(_host_port(url), timeout=60) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        data = _request(body)
        for i in range(0, len(data), 4):
            sock.sendall(data[i : i + 4])
            time.sleep(0.002)  # the scenario itself: a client that writes slowly
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    return int(answer.split(b" ", 2)[1])


def _slow_reader(url: str, release: threading.Event) -> bool:
    """A stream nobody reads until ``release``: the server's writes back up, the others go on."""
    body = json.dumps(
        {"prompt": "read me later", "max_tokens": 1000, "ignore_eos": True, "stream": True}
    ).encode()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connecting: a small window
    sock.settimeout(120)
    with sock:
        sock.connect(_host_port(url))
        sock.sendall(_request(body))
        release.wait(120)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    return answer.startswith(b"HTTP/1.1 200 ") and b"data: [DONE]" in answer[-64:]


def _truncated(url: str) -> int:
    """Headers promising a body that never fully comes: the client leaves mid-body."""
    with socket.create_connection(_host_port(url), timeout=60) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n\r\n" + b'{"prompt": [1,'
        )
    return 1


async def scenario(url: str, cases: list[Attack]) -> Run:
    run = Run()
    release = threading.Event()
    idle = anyio.Event()
    stop = anyio.Event()
    answered = anyio.Event()  # every attack, every normal request and the slow body
    waiting = [len(cases) + 2]

    def one_answered() -> None:
        waiting[0] -= 1
        if waiting[0] == 0:
            answered.set()

    async def probe() -> None:
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            while not stop.is_set():
                t0 = time.perf_counter()
                r = await client.get("/health")
                run.health_s.append(time.perf_counter() - t0)
                assert r.status_code == 200
                if len(run.health_s) == 5:
                    idle.set()
                await anyio.sleep(0.005)  # pacing: a probe every few milliseconds

    async def attack(client: httpx.AsyncClient, case: Attack) -> None:
        content: Any = case.body
        if case.chunked:

            async def pieces() -> AsyncIterator[bytes]:
                for i in range(0, len(case.body), 1 << 16):
                    yield case.body[i : i + (1 << 16)]

            content = pieces()
        r = await client.post(case.path, content=content, headers={"content-type": "application/json"})
        code = r.json()["error"]["code"] if r.status_code >= 400 else None
        run.attack_status[case.name] = (r.status_code, code)
        one_answered()

    async def normal(client: httpx.AsyncClient, i: int) -> None:
        if i % 3 == 0:
            body: dict[str, Any] = {"messages": [{"role": "user", "content": f"hello {i}"}], "max_tokens": 4}
            r = await client.post("/v1/chat/completions", json=body)
        else:
            r = await client.post(
                "/v1/completions", json={"prompt": f"normal {i}", "max_tokens": 4, "stream": i % 2 == 0}
            )
        run.normal_status.append(r.status_code)

    async def normals(client: httpx.AsyncClient) -> None:
        for i in range(12):
            await normal(client, i)
        one_answered()

    async with anyio.create_task_group() as tg:
        tg.start_soon(probe)
        await idle.wait()
        async with httpx.AsyncClient(base_url=url, timeout=120) as client, anyio.create_task_group() as load:
            for case in cases:
                load.start_soon(attack, client, case)
            load.start_soon(normals, client)

            async def slow_body() -> None:
                run.slow_body_status = await anyio.to_thread.run_sync(_slow_body, url)
                one_answered()

            async def slow_reader() -> None:
                run.slow_reader_done = await anyio.to_thread.run_sync(_slow_reader, url, release)

            async def truncated() -> None:
                run.truncated_sent = await anyio.to_thread.run_sync(_truncated, url)

            load.start_soon(slow_body)
            load.start_soon(slow_reader)
            load.start_soon(truncated)
            with anyio.fail_after(120):
                await answered.wait()
            release.set()  # now read the stream that was left waiting
        stop.set()
    return run


@pytest.fixture(scope="module", params=["asyncio", "uvloop"])
def stall_server(request: pytest.FixtureRequest) -> Iterator[ServerThread]:
    server = ServerThread(config(), loop=request.param).start()
    yield server
    server.stop()
    assert server.leaked == []


def test_no_request_stalls_the_others(stall_server: ServerThread) -> None:
    assert stall_server.service.context_len == CTX
    assert stall_server.config.max_request_bytes == LIMIT
    cases = attacks()
    run = anyio.run(scenario, stall_server.url, cases)
    want = {c.name: (c.status, c.code) for c in cases}
    got = {k: (s, c if want[k][1] is not None else None) for k, (s, c) in run.attack_status.items()}
    assert got == want
    assert run.normal_status == [200] * 12
    assert run.slow_body_status == 200
    assert run.slow_reader_done
    assert run.truncated_sent == 1
    worst = max(run.health_s)
    assert worst < 1.0, f"/health took {worst:.3f} s at worst ({len(run.health_s)} probes)"
    stats = stall_server.engine_idle_stats()
    assert stats.free_blocks == stats.num_blocks
    svc = stall_server.service
    assert stall_server.call(lambda: svc.stats().requests_in_flight) == 0
