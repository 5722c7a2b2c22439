"""The ASGI app factory: the app on its own under an in-process uvicorn task (its lifespan owns the service),
and mounted in another Starlette app (whose lifespan owns it)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import anyio
import httpx
import openai
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse
from starlette.routing import Mount, Route

from aiokv.serve import Service, ServiceState, create_app
from aiokv.serve._runner import bind

from ._server import ServerThread, config


async def _serve_and(app: Starlette, check: Callable[[str], Awaitable[None]]) -> None:
    sock = bind("127.0.0.1", 0)
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    server = uvicorn.Server(uvicorn.Config(app, lifespan="on", log_level="warning"))
    async with anyio.create_task_group() as tg:
        tg.start_soon(server.serve, [sock])  # the socket listens already: clients connect at once
        await check(url)
        server.should_exit = True
    sock.close()


@pytest.mark.asyncio
async def test_the_app_owns_its_service_through_the_lifespan() -> None:
    app = create_app(config())
    service: Service = app.state.service

    async def check(url: str) -> None:
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            r = await http.post("/v1/completions", json={"prompt": "abc", "max_tokens": 2})
            assert r.status_code == 200
            assert r.json()["usage"]["completion_tokens"] <= 2

    await _serve_and(app, check)
    assert service.state is ServiceState.CLOSED


@pytest.mark.asyncio
async def test_the_app_mounts_in_another_app() -> None:
    service = Service(config())

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        async with service:
            yield

    async def hello(request: Request) -> PlainTextResponse:
        return PlainTextResponse("outer app")

    outer = Starlette(
        routes=[Route("/", hello), Mount("/llm", create_app(service=service))], lifespan=lifespan
    )

    async def check(url: str) -> None:
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            assert (await http.get("/")).text == "outer app"
            assert (await http.get("/llm/ready")).json() == {"status": "ready"}
        async with openai.AsyncOpenAI(base_url=url + "/llm/v1", api_key="-", max_retries=0) as client:
            out = await client.chat.completions.create(
                model="aiokv-tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=3
            )
            assert out.choices[0].finish_reason in ("stop", "length")

    await _serve_and(outer, check)
    assert service.state is ServiceState.CLOSED


def test_stop_sequences_end_the_choice(offload_server: ServerThread) -> None:
    with openai.OpenAI(base_url=offload_server.url + "/v1", api_key="-", max_retries=0) as client:
        body = {"model": "aiokv-tiny", "prompt": "stop here", "max_tokens": 24, "temperature": 0}
        full = client.completions.create(**body, extra_body={"ignore_eos": True}).choices[0].text  # type: ignore[call-overload]
        assert len(full) >= 3, full
        stop = full[2]
        cut = client.completions.create(**body, stop=[stop], extra_body={"ignore_eos": True})  # type: ignore[call-overload]
        streamed = client.completions.create(
            **body, stop=[stop], stream=True, extra_body={"ignore_eos": True}
        )  # type: ignore[call-overload]
        parts = [c.choices[0] for c in streamed if c.choices]
    assert cut.choices[0].text == full[: full.index(stop)]
    assert cut.choices[0].finish_reason == "stop"
    assert "".join(p.text for p in parts) == cut.choices[0].text
    assert parts[-1].finish_reason == "stop"
