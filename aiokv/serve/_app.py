"""The ASGI application: OpenAI-compatible routes, health, readiness and Prometheus metrics over a
:class:`~aiokv.serve.Service`."""

from __future__ import annotations

import json
import re
import secrets
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from ._config import ServeConfig
from ._schema import APIError, GenerationRequest, parse_chat_request, parse_completion_request
from ._service import Generation, Service

__all__ = ["create_app"]

MAX_BODY_BYTES = 32 << 20
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")


def create_app(config: ServeConfig | None = None, *, service: Service | None = None) -> Starlette:
    """The OpenAI-compatible ASGI app.

    With ``config`` (or neither argument: :meth:`ServeConfig.from_sources`, i.e. ``AIOKV_*`` variables) the
    app owns its :class:`Service`: the ASGI lifespan starts it and, on shutdown, drains and closes it. With
    ``service`` the caller owns it (``async with service:`` around serving) — the way to mount the app in
    another one, whose lifespan does not reach mounted apps::

        service = Service(ServeConfig(model="tiny"))

        @asynccontextmanager
        async def lifespan(app):
            async with service:
                yield

        app = Starlette(routes=[Mount("/llm", create_app(service=service))], lifespan=lifespan)

    The service is ``app.state.service``.
    """
    if service is not None and config is not None:
        raise ValueError("create_app takes a config or a service, not both")
    owned = service is None
    svc = (
        service
        if service is not None
        else Service(config if config is not None else ServeConfig.from_sources())
    )
    api = _API(svc)

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        if owned:
            async with svc:
                yield
        else:
            yield

    app = Starlette(
        routes=[
            Route("/v1/completions", api.completions, methods=["POST"]),
            Route("/v1/chat/completions", api.chat_completions, methods=["POST"]),
            Route("/v1/models", api.models, methods=["GET"]),
            Route("/v1/models/{model:path}", api.model, methods=["GET"]),
            Route("/health", api.health, methods=["GET"]),
            Route("/ready", api.ready, methods=["GET"]),
            Route("/metrics", api.metrics, methods=["GET"]),
        ],
        exception_handlers={APIError: _api_error, HTTPException: _http_error},  # type: ignore[dict-item]
        lifespan=lifespan,
    )
    app.state.service = svc
    return app


def error_response(err: APIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


async def _api_error(request: Request, exc: APIError) -> Response:
    return error_response(exc)


async def _http_error(request: Request, exc: HTTPException) -> Response:
    kind = {404: "not_found_error", 405: "invalid_request_error"}.get(
        exc.status_code, "invalid_request_error"
    )
    detail = exc.detail if exc.status_code != 404 else f"no route {request.method} {request.url.path}"
    err = APIError(exc.status_code, str(detail).lower(), type=kind)
    return JSONResponse(err.body(), status_code=exc.status_code, headers=dict(exc.headers or {}))


class _GenerationResponse(Response):
    """Streams (or answers) one generation, watching for the client's disconnect."""

    def __init__(self, generation: Generation) -> None:
        self.generation = generation
        self.background = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.generation.serve(receive, send)


class _API:
    def __init__(self, service: Service) -> None:
        self.service = service

    # ------------------------------------------------------------------ generation
    async def completions(self, request: Request) -> Response:
        return await self._generate(request, parse_completion_request)

    async def chat_completions(self, request: Request) -> Response:
        return await self._generate(request, parse_chat_request)

    async def _generate(self, request: Request, parse: Callable[[Any, Any], GenerationRequest]) -> Response:
        arrival = time.perf_counter()
        self._authorize(request)
        self.service.check_available()
        body = await _read_json(request)
        req = parse(body, self.service.tokenizer)
        rid = request.headers.get("x-request-id")
        if rid is not None and not _REQUEST_ID.fullmatch(rid):
            rid = None
        return _GenerationResponse(self.service.generation(req, request_id=rid, arrival=arrival))

    def _authorize(self, request: Request) -> None:
        key = self.service.config.api_key
        if key is None:
            return
        given = request.headers.get("authorization", "")
        scheme, _, token = given.partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(), key.encode()):
            raise APIError(401, "missing or wrong api key: send 'Authorization: Bearer KEY'",
                           type="authentication_error", code="invalid_api_key")  # fmt: skip

    # ------------------------------------------------------------------ models
    def _model_card(self) -> dict[str, Any]:
        svc = self.service
        return {
            "id": svc.model_name,
            "object": "model",
            "created": int(svc.started_at),
            "owned_by": "aiokv",
            "root": svc.model_name,
            "parent": None,
            "max_model_len": svc.context_len,
        }

    async def models(self, request: Request) -> Response:
        self._authorize(request)
        return JSONResponse({"object": "list", "data": [self._model_card()]})

    async def model(self, request: Request) -> Response:
        self._authorize(request)
        name = request.path_params["model"]
        if name != self.service.model_name:
            raise APIError(404, f"the model {name!r} does not exist; this server serves {self.service.model_name!r}",
                           param="model", code="model_not_found")  # fmt: skip
        return JSONResponse(self._model_card())

    # ------------------------------------------------------------------ operations
    async def health(self, request: Request) -> Response:
        alive, body = self.service.health()
        return JSONResponse(body, status_code=200 if alive else 503)

    async def ready(self, request: Request) -> Response:
        svc = self.service
        if svc.ready:
            return JSONResponse({"status": "ready"})
        state = svc.state.value if svc.state.value != "ready" else "unhealthy"
        return JSONResponse({"status": state}, status_code=503)

    async def metrics(self, request: Request) -> Response:
        return Response(generate_latest(self.service.registry), media_type=CONTENT_TYPE_LATEST)


async def _read_json(request: Request) -> Any:
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > MAX_BODY_BYTES:
        raise APIError(
            413,
            f"the request body must be at most {MAX_BODY_BYTES} bytes, got {length}",
            code="request_too_large",
        )
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise APIError(
                413, f"the request body must be at most {MAX_BODY_BYTES} bytes", code="request_too_large"
            )
        chunks.append(chunk)
    raw = b"".join(chunks)
    if not raw.strip():
        raise APIError(400, "the request body must be a JSON object, got an empty body")
    try:
        return json.loads(raw, parse_constant=_no_constant)
    except (ValueError, UnicodeDecodeError) as exc:
        raise APIError(400, f"the request body must be valid JSON: {exc}") from None


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")
