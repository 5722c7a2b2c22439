"""The ASGI application: OpenAI-compatible routes, health, readiness and Prometheus metrics over a
:class:`~aiokv.serve.Service`."""

from __future__ import annotations

import re
import secrets
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, nullcontext
from typing import Any, Protocol

import anyio
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from . import _json
from ._config import ServeConfig
from ._schema import APIError, GenerationRequest, parse_chat_request, parse_completion_request
from ._service import Generation, Service
from ._tokenizer import ByteTokenizer

__all__ = ["create_app"]

INLINE_BYTES = 16 << 10
"""A generation request's body up to this size is parsed on the event loop (a few ms at worst); a larger one
in a worker thread, where parsing gives way to the loop (:mod:`._json`)."""
PARSE_THREADS = 1
"""Large bodies parsed at once at most; the others wait their turn. Parsing holds the GIL, so a second thread
would not parse faster, only take the GIL from the event loop more often."""
VALUES_PER_TOKEN = 4
EXTRA_VALUES = 1024
"""A body may hold ``VALUES_PER_TOKEN * context_len + EXTRA_VALUES`` JSON values (a list of token ids counts
as one): a chat needs about 3 per message (a message has at least 8 tokens) or per content part, so this is
room for any request that fits the context while bounding the work and memory of one that cannot."""
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


class _Parse(Protocol):
    def __call__(
        self, body: Any, tok: ByteTokenizer, *, context_len: int | None = None
    ) -> GenerationRequest: ...


class _API:
    def __init__(self, service: Service) -> None:
        self.service = service
        self._parse_limiter: anyio.CapacityLimiter | None = None

    # ------------------------------------------------------------------ generation
    async def completions(self, request: Request) -> Response:
        return await self._generate(request, parse_completion_request)

    async def chat_completions(self, request: Request) -> Response:
        return await self._generate(request, parse_chat_request)

    async def _generate(self, request: Request, parse: _Parse) -> Response:
        """Sizes first, then work: the body's size is checked as it arrives, the prompt's length right after
        parsing (before any token is read), and a large body is parsed off the event loop."""
        arrival = time.perf_counter()
        self._authorize(request)
        svc = self.service
        svc.check_available()
        raw = await _read_body(request, svc.config)
        if len(raw) <= INLINE_BYTES:
            req = _parse_request(raw, parse, svc.tokenizer, svc.context_len)
        else:
            if self._parse_limiter is None:
                self._parse_limiter = anyio.CapacityLimiter(PARSE_THREADS)
            req = await anyio.to_thread.run_sync(
                _parse_request, raw, parse, svc.tokenizer, svc.context_len, limiter=self._parse_limiter
            )
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


async def _read_body(request: Request, config: ServeConfig) -> bytes:
    """The body, refused with 413 once it is known to exceed ``max_request_bytes`` (from ``Content-Length``,
    before reading, or as it arrives) and with 408 when it has not arrived within ``request_timeout``."""
    limit, timeout = config.max_request_bytes, config.request_timeout
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise _too_large(limit, f", got {length}")
    chunks: list[bytes] = []
    size = 0
    try:
        with anyio.fail_after(timeout) if timeout > 0 else nullcontext():
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise _too_large(limit, ", got more")
                chunks.append(chunk)
    except ClientDisconnect:  # nobody to answer: end the request without a traceback in the log
        raise APIError(400, "the client closed the connection before the whole body arrived") from None
    except TimeoutError:
        raise APIError(408, f"the request body did not arrive within request_timeout={timeout:g} s",
                       type="timeout_error", code="request_timeout") from None  # fmt: skip
    return b"".join(chunks)


def _too_large(limit: int, got: str) -> APIError:
    return APIError(413, f"the request body must be at most max_request_bytes={limit} bytes{got}",
                    code="request_too_large")  # fmt: skip


def _parse_request(raw: bytes, parse: _Parse, tok: ByteTokenizer, context_len: int) -> GenerationRequest:
    """JSON, then the OpenAI request (no per-token work before its sizes are checked); thread-safe."""
    if not raw or raw.isspace():
        raise APIError(400, "the request body must be a JSON object, got an empty body")
    limit = VALUES_PER_TOKEN * context_len + EXTRA_VALUES
    try:
        body = _json.loads(raw, max_values=limit)
    except _json.TooManyValues:
        raise APIError(413, f"the request body must hold at most {limit} JSON values ({VALUES_PER_TOKEN} per token"
                       f" of the {context_len}-token context, plus {EXTRA_VALUES}; a list of token ids counts as one),"
                       " got more", code="request_too_large") from None  # fmt: skip
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, NaN, an int of over 4300 digits
        raise APIError(400, f"the request body must be valid JSON: {exc}") from None
    return parse(body, tok, context_len=context_len)
