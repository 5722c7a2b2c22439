"""The service behind the HTTP API: builds and owns the offloader and the engine, admits requests into a
bounded queue, runs each request's choices on the engine and drains on shutdown.

Lifetimes are structured with anyio:

* a **request** runs in one task group: a task per choice (an engine stream) sends text through a memory
  object stream to the task writing the response, and a watcher task listens for the client's disconnect;
  leaving the group in any way leaves every ``engine.stream()`` context, which aborts what is still running;
* the request's **cancel scope** is its handle for the service: a client disconnect, the request deadline
  (``fail_after``) and the shutdown deadline all cancel it, and the reason decides what the client is told;
* **shutdown** (:meth:`Service.drain`) stops admitting, waits for in-flight requests up to the drain
  deadline, cancels the rest, then :meth:`Service.aclose` closes the engine before the offloader.
"""

from __future__ import annotations

import contextlib
import enum
import itertools
import json
import logging
import secrets
import time
from collections.abc import Awaitable, Callable, Iterable, MutableMapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import anyio
from anyio.streams.memory import MemoryObjectSendStream
from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from .._errors import AiokvError, ClosedError, EngineError, InvalidArgumentError
from .._log import get_logger
from ..metrics import TTFT_BUCKETS, AiokvCollector, RequestMetrics
from ._config import ServeConfig
from ._schema import APIError, ChoiceResult, GenerationRequest, ResponseBuilder, usage
from ._tokenizer import ByteTokenizer, Detokenizer, StopMatcher

if TYPE_CHECKING:
    from .. import Offloader
    from ..engine import Engine, GenerationResult, TokenStream, Transformer

__all__ = ["Generation", "Service", "ServiceState", "ServiceStats"]

Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

FINAL_SEND_TIMEOUT = 2.0
"""Seconds the last message of an aborted request (its error) may take to reach a slow client."""
STREAM_BUFFER = 64

_log = get_logger("serve")


class ServiceState(enum.Enum):
    NEW = "new"
    STARTING = "starting"
    READY = "ready"  # admitting requests
    DRAINING = "draining"  # finishing in-flight requests, admitting none
    CLOSED = "closed"


@dataclass(frozen=True, slots=True)
class ServiceStats:
    """Request counts of a :class:`Service` (``stats()``); engine and offloader keep their own.

    Every admitted request ends once, as ``requests_completed`` (``completed_stop``: every choice stopped, at an
    eos token or a stop string; ``completed_length``: a choice reached ``max_tokens``), ``cancelled_by_client``,
    ``cancelled_by_shutdown``, ``timed_out`` or ``failed`` (``failed_engine``: answered 503
    ``engine_unhealthy``; ``failed_internal``: answered 500 ``internal_error``)."""

    state: ServiceState
    requests_in_flight: int  # HTTP generation requests being served
    choices_reserved: int  # admitted engine requests not queued in the engine yet
    choices_queued: int  # queued or prefilling in the engine: no token yet
    choices_decoding: int  # producing tokens
    requests_accepted: int
    requests_completed: int
    rejected_queue_full: int
    rejected_unavailable: int
    cancelled_by_client: int
    cancelled_by_shutdown: int
    timed_out: int
    failed: int
    completed_stop: int = 0
    completed_length: int = 0
    failed_engine: int = 0
    failed_internal: int = 0


class _Ticket:
    """One admitted request: its cancel scope (the handle shutdown and disconnects use) and why it ended."""

    __slots__ = ("reason", "reserved", "scope")

    def __init__(self, reserved: int) -> None:
        self.scope = anyio.CancelScope()
        self.reason: str | None = None  # "client", "shutdown", "timeout"
        self.reserved = reserved

    def cancel(self, reason: str) -> None:
        if self.reason is None:
            self.reason = reason
        self.scope.cancel()


class Service:
    """The reference engine (and, unless ``config.offload`` is false, an offloader with the configured tiers)
    serving OpenAI-style generation requests. Use as ``async with Service(config) as service:``.

    ``model`` replaces the model built from ``config.model`` (tests use it to hold forwards)."""

    def __init__(self, config: ServeConfig | None = None, *, model: Transformer | None = None) -> None:
        self.config = config if config is not None else ServeConfig()
        self._model = model
        model_config = model.config if model is not None else self.config.model_config()
        self.tokenizer = ByteTokenizer(model_config.vocab_size)
        self.context_len = self.config.context_len(model_config.max_position)
        self.model_name = self.config.model_name
        self.engine: Engine | None = None
        self.offloader: Offloader | None = None
        self.registry = CollectorRegistry()
        self.request_metrics = RequestMetrics(self.registry, labels={"model_name": self.model_name})
        # Where TTFT goes after the queue (aiokv:request_queue_time_seconds): the first admission's lookup and
        # load, then the wait for a step and the prefill of the uncached rest of the prompt.
        self._admission_time = Histogram(
            "aiokv:request_admission_time_seconds",
            "A request's first admission: aiokv lookup and load of its cached prefix (0 without offloading).",
            ["model_name"],
            buckets=TTFT_BUCKETS,
            registry=self.registry,
        ).labels(self.model_name)
        self._prefill_time = Histogram(
            "aiokv:request_prefill_time_seconds",
            "First admission done to first token: waiting for a step and computing the uncached prompt.",
            ["model_name"],
            buckets=TTFT_BUCKETS,
            registry=self.registry,
        ).labels(self.model_name)
        self._state = ServiceState.NEW
        self._stack: contextlib.AsyncExitStack | None = None
        self._tickets: set[_Ticket] = set()
        self._waiters: list[anyio.Event] = []
        self._ids = itertools.count()
        self._counts = dict.fromkeys(
            ("reserved", "queued", "decoding", "accepted", "completed", "rejected_queue_full",
             "rejected_unavailable", "client", "shutdown", "timeout", "failed", "completed_stop",
             "completed_length", "failed_engine", "failed_internal"),
            0,
        )  # fmt: skip
        self.started_at = 0.0
        self._drain_started: float | None = None  # monotonic time the drain began (logged once, with its end)
        self._drain_aborted = 0
        self._drain_reported = False

    # ------------------------------------------------------------------ lifetime
    async def __aenter__(self) -> Service:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def start(self) -> None:
        """Build the model, the KV cache, the offloader and the engine, and start them."""
        from ..engine import Engine, PagedKVCache, Transformer

        if self._state is not ServiceState.NEW:
            raise ClosedError(f"service cannot be started twice (it is {self._state.value})")
        self._state = ServiceState.STARTING
        cfg = self.config
        stack = contextlib.AsyncExitStack()
        try:
            model = self._model
            if model is None:
                try:
                    model = await anyio.to_thread.run_sync(
                        lambda: Transformer(cfg.model_config(), device=cfg.device)
                    )
                except RuntimeError as exc:  # torch: an unknown or unavailable device
                    raise InvalidArgumentError(f"device {cfg.device!r} cannot be used: {exc}") from None
            cache = PagedKVCache(model.config, cfg.num_blocks, block_size=cfg.block_size, device=model.device)
            if cfg.offload:
                from .. import Offloader

                tiers = [spec.build() for spec in cfg.tier_specs]
                self.offloader = await stack.enter_async_context(
                    Offloader(
                        cache.layout(),
                        tiers=tiers,
                        eviction=cfg.eviction,
                        load_policy=cfg.load_policy,
                        kv_events_endpoint=cfg.kv_events_endpoint,
                        kv_events_replay_endpoint=cfg.kv_events_replay_endpoint,
                    )
                )
            self.engine = await stack.enter_async_context(
                Engine(
                    model,
                    cache,
                    offloader=self.offloader,
                    max_num_seqs=cfg.max_num_seqs,
                    max_num_batched_tokens=cfg.max_num_batched_tokens,
                    torch_threads=cfg.torch_threads,
                )
            )
        except BaseException:
            with anyio.CancelScope(shield=True):
                await stack.aclose()
            self.engine = self.offloader = None
            self._state = ServiceState.CLOSED
            raise
        labels = {"model_name": self.model_name}
        self.registry.register(AiokvCollector(self.offloader, self.engine, labels=labels))
        self.registry.register(_ServiceCollector(self, labels))
        self._stack = stack
        self.started_at = time.time()
        self._state = ServiceState.READY

    async def drain(self, grace: float | None = None) -> None:
        """Stop admitting; give in-flight requests ``grace`` seconds (default: ``config.drain_timeout``) to
        finish, then abort the rest (their clients get a 503 error) and wait for them to leave. Returns once no
        request is in flight (or, should one not leave, a few seconds after the grace period)."""
        grace = self.config.drain_timeout if grace is None else grace
        if self._state in (ServiceState.READY, ServiceState.STARTING):
            self._state = ServiceState.DRAINING
            self._notify()
            self._drain_started = time.monotonic()
            _log.info(
                "draining: %d requests in flight get up to %g s to finish; new requests are refused (503)",
                len(self._tickets),
                grace,
            )
        with anyio.move_on_after(grace):
            await self.wait_for(lambda s: s.requests_in_flight == 0)
        aborted = list(self._tickets)
        for ticket in aborted:
            ticket.cancel("shutdown")
        if aborted:
            self._drain_aborted += len(aborted)
            _log.warning(
                "drain: aborted %d requests still in flight %.1f s after the drain began (their clients get a "
                "503 'shutdown' error): raise --drain-timeout (AIOKV_DRAIN_TIMEOUT, now %g s) to let them finish",
                len(aborted),
                time.monotonic() - (self._drain_started or time.monotonic()),
                self.config.drain_timeout,
            )
        with anyio.move_on_after(FINAL_SEND_TIMEOUT + 1.0):
            await self.wait_for(lambda s: s.requests_in_flight == 0)
        if self._drain_started is not None and not self._drain_reported:
            self._drain_reported = True
            left = len(self._tickets)
            _log.log(
                logging.WARNING if left else logging.INFO,
                "drain: done in %.1f s, %d requests aborted%s",
                time.monotonic() - self._drain_started,
                self._drain_aborted,
                f", {left} did not end and are abandoned" if left else "",
            )

    async def aclose(self) -> None:
        """Drain (bounded by ``config.drain_timeout``), then close the engine, then the offloader.
        Idempotent."""
        if self._state is ServiceState.CLOSED:
            return
        if self._state is ServiceState.NEW:
            self._state = ServiceState.CLOSED
            return
        with anyio.CancelScope(shield=True):
            try:
                await self.drain()
            finally:
                self._state = ServiceState.CLOSED
                self._notify()
                if self._stack is not None:
                    await self._stack.aclose()

    # ------------------------------------------------------------------ state
    @property
    def state(self) -> ServiceState:
        return self._state

    @property
    def ready(self) -> bool:
        """Admitting requests, with a healthy engine."""
        return self._state is ServiceState.READY and self.engine is not None and self.engine.healthy

    def health(self) -> tuple[bool, dict[str, Any]]:
        """``(alive, body)`` for ``/health``: alive while the engine can serve; lower tiers that are not up
        make the status "degraded" (still alive: requests are served, recomputing what the tier held)."""
        engine = self.engine
        if engine is None or self._state in (ServiceState.NEW, ServiceState.CLOSED):
            return False, {"status": "unhealthy", "reason": f"service is {self._state.value}"}
        failure = engine.failure
        if failure is not None:
            return False, {"status": "unhealthy", "reason": f"engine failed: {failure}"}
        tiers: dict[str, str] = {}
        if self.offloader is not None:
            for name, ts in zip(
                ["cpu", *(t.name for t in self.offloader.lower)], self.offloader.stats().tiers, strict=False
            ):
                tiers[name] = str(getattr(ts, "health", "up" if not isinstance(ts, str) else "unknown"))
        status = "ok" if all(h == "up" for h in tiers.values()) else "degraded"
        return True, {
            "status": status,
            "state": self._state.value,
            "offload": self.offloader is not None,
            "tiers": tiers,
        }

    def stats(self) -> ServiceStats:
        c = self._counts
        return ServiceStats(
            state=self._state,
            requests_in_flight=len(self._tickets),
            choices_reserved=c["reserved"],
            choices_queued=c["queued"],
            choices_decoding=c["decoding"],
            requests_accepted=c["accepted"],
            requests_completed=c["completed"],
            rejected_queue_full=c["rejected_queue_full"],
            rejected_unavailable=c["rejected_unavailable"],
            cancelled_by_client=c["client"],
            cancelled_by_shutdown=c["shutdown"],
            timed_out=c["timeout"],
            failed=c["failed"],
            completed_stop=c["completed_stop"],
            completed_length=c["completed_length"],
            failed_engine=c["failed_engine"],
            failed_internal=c["failed_internal"],
        )

    async def wait_for(self, predicate: Callable[[ServiceStats], bool]) -> ServiceStats:
        """Wait until ``predicate(stats())`` holds (checked at every change of the counts); for shutdown,
        tests and diagnostics."""
        while True:
            stats = self.stats()
            if predicate(stats):
                return stats
            ev = anyio.Event()
            self._waiters.append(ev)
            await ev.wait()

    def _notify(self) -> None:
        waiters, self._waiters = self._waiters, []
        for ev in waiters:
            ev.set()

    def _count(self, name: str, delta: int = 1) -> None:
        self._counts[name] += delta
        self._notify()

    def __repr__(self) -> str:
        return f"<Service {self._state.value} {self.model_name!r} in_flight={len(self._tickets)} engine={self.engine!r}>"

    # ------------------------------------------------------------------ requests
    def check_available(self) -> None:
        """Raise the 503 a request gets while the service is not admitting."""
        if self._state is not ServiceState.READY or self.engine is None:
            self._count("rejected_unavailable")
            what = (
                "shutting down" if self._state in (ServiceState.DRAINING, ServiceState.CLOSED) else "starting"
            )
            raise APIError(503, f"the server is {what}; retry on another instance", type="service_unavailable",
                           code=what.replace(" ", "_"), headers={"Retry-After": "1"})  # fmt: skip
        if not self.engine.healthy:
            self._count("rejected_unavailable")
            raise APIError(503, f"the engine cannot serve: {self.engine.failure}", type="service_unavailable",
                           code="engine_unhealthy")  # fmt: skip

    def generation(
        self, req: GenerationRequest, *, request_id: str | None = None, arrival: float | None = None
    ) -> Generation:
        """Validate ``req`` against the model and the queue and admit it: the returned :class:`Generation`
        holds a place in the queue until :meth:`Generation.serve` ends. Raises :class:`APIError`."""
        if req.model is not None and req.model != self.model_name:
            raise APIError(404, f"the model {req.model!r} does not exist; this server serves {self.model_name!r}",
                           param="model", code="model_not_found")  # fmt: skip
        self.check_available()
        assert self.engine is not None
        k = req.num_choices
        limit = self.config.max_queued_requests
        if k > limit:
            raise APIError(
                400,
                f"a request may start at most max_queued_requests={limit} generations, got {k}",
                param="n",
            )
        budgets = [self._max_tokens(req, len(p)) for p in req.prompts]
        rid = request_id or secrets.token_hex(12)
        seed = req.seed if req.seed is not None else secrets.randbits(62)
        eos: int | None = self.tokenizer.im_end_id if req.kind == "chat" else self.tokenizer.eos_token_id
        if req.ignore_eos:
            eos = None
        serial = next(self._ids)
        choices: list[_Choice] = []
        for i in range(k):
            p = i // req.n
            try:
                stream = self.engine.stream(
                    req.prompts[p],
                    max_tokens=budgets[p],
                    temperature=req.temperature,
                    seed=seed + i,
                    eos_token_id=eos,
                    request_id=f"{rid}.{serial}.{i}",
                )
            except AiokvError as exc:
                raise APIError(400, str(exc)) from exc
            choices.append(_Choice(i, p, req.prompts[p], stream, Detokenizer(self.tokenizer, skip_special_tokens=req.skip_special_tokens), StopMatcher(req.stop)))  # fmt: skip
        waiting = self.engine.stats().waiting + self._counts["reserved"]
        if waiting + k > limit:
            self._count("rejected_queue_full")
            raise APIError(429, f"the request queue is full ({waiting} of max_queued_requests={limit} waiting); retry later",
                           type="rate_limit_error", code="queue_full", headers={"Retry-After": "1"})  # fmt: skip
        ticket = _Ticket(k)
        self._tickets.add(ticket)
        self._counts["accepted"] += 1
        self._count("reserved", k)
        return Generation(
            self, req, ticket, choices, rid, arrival if arrival is not None else time.perf_counter()
        )

    def _max_tokens(self, req: GenerationRequest, prompt_len: int) -> int:
        ctx = self.context_len
        field = "messages" if req.kind == "chat" else "prompt"
        if prompt_len >= ctx:
            raise APIError(400, f"this model's maximum context length is {ctx} tokens; the prompt has {prompt_len} tokens",
                           param=field, code="context_length_exceeded")  # fmt: skip
        if req.max_tokens is None:
            default = self.config.default_max_tokens if req.kind == "chat" else 16
            return min(default, ctx - prompt_len)
        if prompt_len + req.max_tokens > ctx:
            raise APIError(
                400,
                f"this model's maximum context length is {ctx} tokens; you requested {prompt_len + req.max_tokens}"
                f" ({prompt_len} in the {field}, {req.max_tokens} for the completion): reduce the {field} or max_tokens",
                param="max_tokens",
                code="context_length_exceeded",
            )
        return req.max_tokens

    def _release(self, ticket: _Ticket, outcome: str, detail: str | None = None) -> None:
        """``ticket`` leaves; its request ended as ``outcome`` (a count's name), and ``detail`` (a count's
        name too: ``completed_<finish reason>``, ``failed_<kind>``) when the outcome has several."""
        self._tickets.discard(ticket)
        self._counts["reserved"] -= ticket.reserved
        ticket.reserved = 0
        if detail is not None:
            self._counts[detail] += 1
        self._count(outcome)


@dataclass(eq=False, slots=True)
class _Choice:
    index: int
    prompt_index: int
    prompt: tuple[int, ...]
    stream: TokenStream
    detok: Detokenizer
    stop: StopMatcher
    tokens: int = 0
    first_token_at: float | None = None
    last_token_at: float | None = None
    finish_reason: str | None = None
    cached_tokens: int = 0
    queued_s: float | None = None
    admission_s: float | None = None
    prefill_s: float | None = None
    error: BaseException | None = None


@dataclass(frozen=True, slots=True)
class _Event:
    choice: _Choice
    text: str
    first: bool = False
    end: bool = False


def _dumps(obj: Any) -> bytes:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode()


def _sse(obj: Any) -> Message:
    return {"type": "http.response.body", "body": b"data: " + _dumps(obj) + b"\n\n", "more_body": True}


SSE_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
]


class Generation:
    """One admitted request: its choices on the engine and the response written as they progress."""

    def __init__(
        self,
        service: Service,
        req: GenerationRequest,
        ticket: _Ticket,
        choices: list[_Choice],
        rid: str,
        arrival: float,
    ) -> None:
        self._service = service
        self.request = req
        self._ticket = ticket
        self.choices = choices
        self.request_id = rid
        self._arrival = arrival
        self._builder = ResponseBuilder(req.kind, rid, service.model_name)
        self._started = False  # http.response.start was sent

    async def serve(self, receive: Receive, send: Send) -> None:
        """Run the choices and write the response (SSE or JSON) with ASGI ``send``; ``receive`` is watched for
        the client's disconnect. Always leaves the queue, whatever happens."""
        svc = self._service
        ticket = self._ticket
        outcome = "failed"
        timeout = svc.config.request_timeout
        try:
            with ticket.scope:
                try:
                    with anyio.fail_after(timeout) if timeout > 0 else contextlib.nullcontext():
                        if self.request.stream:
                            self._started = True
                            await send(
                                {
                                    "type": "http.response.start",
                                    "status": 200,
                                    "headers": self._headers(SSE_HEADERS),
                                }
                            )
                        async with anyio.create_task_group() as tg:
                            tg.start_soon(self._watch_disconnect, receive)
                            await self._run(tg, send)
                            tg.cancel_scope.cancel()  # the watcher: the response is complete
                        if not any(c.error for c in self.choices):
                            await self._finish(send)
                            outcome = "completed"
                except TimeoutError:
                    ticket.reason = ticket.reason or "timeout"
            if ticket.reason is not None:
                outcome = ticket.reason
            if outcome != "completed" and outcome != "client":
                with anyio.move_on_after(FINAL_SEND_TIMEOUT), contextlib.suppress(OSError):
                    await self._send_error(send, self._error(outcome))
        finally:
            svc._release(ticket, outcome, self._detail(outcome))

    def _detail(self, outcome: str) -> str | None:
        """The count under ``outcome`` this request adds to: the finish reason of a completed request (``length``
        when a choice reached ``max_tokens``), the kind of error of a failed one."""
        if outcome == "completed":
            length = any(c.finish_reason == "length" for c in self.choices)
            return "completed_length" if length else "completed_stop"
        if outcome == "failed":
            exc = next((c.error for c in self.choices if c.error is not None), None)
            return "failed_engine" if isinstance(exc, (ClosedError, EngineError)) else "failed_internal"
        return None

    def _headers(self, extra: Iterable[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
        return [*extra, (b"x-request-id", self.request_id.encode())]

    async def _watch_disconnect(self, receive: Receive) -> None:
        while True:
            try:
                message = await receive()
            except OSError:
                message = {"type": "http.disconnect"}
            if message["type"] == "http.disconnect":
                self._ticket.cancel("client")
                return

    async def _run(self, tg: anyio.abc.TaskGroup, send: Send) -> None:
        tx, rx = anyio.create_memory_object_stream[_Event](STREAM_BUFFER)
        async with tx:
            for c in self.choices:
                tg.start_soon(self._produce, c, tx.clone())
        usage_chunks = self.request.include_usage
        async with rx:
            async for ev in rx:
                c = ev.choice
                if not self.request.stream or c.error is not None:
                    continue
                chunk = self._builder.chunk(
                    c.index,
                    ev.text,
                    c.finish_reason if ev.end else None,
                    first=ev.first,
                    with_usage=usage_chunks,
                )
                await self._send(send, _sse(chunk))

    async def _send(self, send: Send, message: Message) -> None:
        """``send``, where a failure to write means the client is gone (some servers raise instead of
        dropping the message)."""
        try:
            await send(message)
        except OSError:
            self._ticket.cancel("client")
            await anyio.lowlevel.checkpoint()

    async def _produce(self, c: _Choice, tx: MemoryObjectSendStream[_Event]) -> None:
        """One choice: an engine stream whose tokens become text events. Errors end the choice (recorded on it);
        cancellation leaves ``async with`` and so aborts the engine request."""
        svc = self._service
        async with tx:
            entered = False
            matched = False  # ended on a stop string (an eos token also has finish_reason "stop")
            text = ""
            first = False
            try:
                async with c.stream as tokens:
                    entered = True
                    self._unreserve()
                    svc._count("queued")
                    try:
                        async for token_id in tokens:
                            now = time.perf_counter()
                            first = c.tokens == 0
                            c.tokens += 1
                            c.last_token_at = now
                            if first:
                                c.first_token_at = now
                                svc._counts["queued"] -= 1
                                svc._count("decoding")
                                svc.request_metrics.observe_first_token(now - self._arrival)
                            text, stopped = c.stop.push(c.detok.push(token_id))
                            if stopped:
                                # A stop string is a normal end: the engine counts the request as finished
                                # (reason "stop", not aborted) and releases it as at an eos token.
                                c.finish_reason = "stop"
                                matched = True
                                tokens.finish()
                                try:
                                    result: GenerationResult | None = tokens.result
                                except Exception:  # it ended otherwise meanwhile (engine closed or failed)
                                    result = None
                                break
                            if text or first:
                                await tx.send(_Event(c, text, first=first))
                                text, first = "", False
                        else:
                            result = tokens.result
                            c.finish_reason = result.finish_reason
                        if result is not None:
                            c.cached_tokens = result.cached_tokens
                            c.queued_s = result.queued_s
                            c.admission_s = result.admission_s
                            c.prefill_s = result.prefill_s
                    finally:
                        svc._count("decoding" if c.tokens else "queued", -1)
                    if c.finish_reason == "stop" and c.tokens and c.cached_tokens == 0:
                        c.cached_tokens = int(getattr(tokens, "cached_tokens", 0) or 0)
                if not matched:  # ran to its end: what the detokenizer and the matcher held back
                    tail, _ = c.stop.push(c.detok.flush())
                    text += tail + c.stop.flush()
            except Exception as exc:
                c.error = exc
            finally:
                if not entered:
                    self._unreserve()
            if c.error is None:
                self._observe(c)
            await tx.send(_Event(c, text, first=first, end=True))

    def _unreserve(self) -> None:
        if self._ticket.reserved:
            self._ticket.reserved -= 1
            self._service._count("reserved", -1)

    def _observe(self, c: _Choice) -> None:
        assert c.finish_reason is not None
        end = c.last_token_at or time.perf_counter()
        self._service.request_metrics.observe_finished(
            finish_reason=c.finish_reason,
            prompt_tokens=len(c.prompt),
            generation_tokens=c.tokens,
            cached_tokens=c.cached_tokens,
            ttft_s=None if c.first_token_at is None else c.first_token_at - self._arrival,
            latency_s=end - self._arrival,
            queued_s=c.queued_s,
        )
        if c.admission_s is not None and c.prefill_s is not None:
            self._service._admission_time.observe(c.admission_s)
            self._service._prefill_time.observe(c.prefill_s)

    def _usage(self) -> dict[str, Any]:
        prompts = self.request.prompts
        cached = [
            min((c.cached_tokens for c in self.choices if c.prompt_index == p), default=0)
            for p in range(len(prompts))
        ]
        return usage(
            sum(len(p) for p in prompts),
            sum(c.tokens for c in self.choices),
            sum(min(x, len(p)) for x, p in zip(cached, prompts, strict=True)),
        )

    async def _finish(self, send: Send) -> None:
        if self.request.stream:
            if self.request.include_usage:
                await self._send(send, _sse(self._builder.usage_chunk(self._usage())))
            await self._send(
                send, {"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False}
            )
            return
        results = [
            ChoiceResult(
                c.index, c.stop.text, c.finish_reason or "stop", c.prompt_index, c.tokens, c.cached_tokens
            )
            for c in self.choices
        ]
        echo = self.request.prompt_texts if self.request.echo else None
        body = _dumps(self._builder.response(results, self._usage(), echo))
        self._started = True
        await send({"type": "http.response.start", "status": 200,
                    "headers": self._headers([(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())])})  # fmt: skip
        await send({"type": "http.response.body", "body": body, "more_body": False})

    def _error(self, outcome: str) -> APIError:
        if outcome == "shutdown":
            return APIError(503, "the server shut down before the request finished; it was aborted",
                            type="service_unavailable", code="shutdown")  # fmt: skip
        if outcome == "timeout":
            t = self._service.config.request_timeout
            return APIError(504, f"the request ran past the server's request_timeout of {t:g} s and was aborted",
                            type="timeout_error", code="request_timeout")  # fmt: skip
        exc = next((c.error for c in self.choices if c.error is not None), None)
        if isinstance(exc, (ClosedError, EngineError)):
            return APIError(
                503, f"the engine cannot serve: {exc}", type="service_unavailable", code="engine_unhealthy"
            )
        return APIError(
            500, f"internal error: {type(exc).__name__}: {exc}", type="internal_error", code="internal_error"
        )

    async def _send_error(self, send: Send, err: APIError) -> None:
        if self._started and self.request.stream:
            await send(_sse(err.body()))
            await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})
            return
        if self._started:  # a JSON answer was cut short: all that is left is to end it
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            return
        body = _dumps(err.body())
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        headers += [(k.lower().encode(), v.encode()) for k, v in err.headers.items()]
        await send({"type": "http.response.start", "status": err.status, "headers": self._headers(headers)})
        await send({"type": "http.response.body", "body": body, "more_body": False})


class _ServiceCollector(Collector):
    """The service's own counts as metrics, read from :meth:`Service.stats` at scrape time."""

    def __init__(self, service: Service, labels: dict[str, str]) -> None:
        self._service = service
        self._names = list(labels)
        self._values = list(labels.values())

    def describe(self) -> Iterable[Metric]:
        return []

    def collect(self) -> Iterable[Metric]:
        s = self._service.stats()
        names, values = self._names, self._values

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(f"aiokv:{name}", doc, labels=names)
            g.add_metric(values, value)
            return g

        yield gauge(
            "server_ready", "1 while the server admits requests.", 1.0 if self._service.ready else 0.0
        )
        yield gauge(
            "server_draining",
            "1 while the server drains for shutdown.",
            1.0 if s.state is ServiceState.DRAINING else 0.0,
        )
        yield gauge(
            "server_requests_in_flight", "HTTP generation requests being served.", s.requests_in_flight
        )
        phases = GaugeMetricFamily(
            "aiokv:server_choices",
            "Engine requests of in-flight HTTP requests, by phase.",
            labels=[*names, "phase"],
        )
        phases.add_metric([*values, "reserved"], s.choices_reserved)
        phases.add_metric([*values, "queued"], s.choices_queued)
        phases.add_metric([*values, "decoding"], s.choices_decoding)
        yield phases
        done = CounterMetricFamily(
            "aiokv:server_requests",
            "HTTP generation requests that ended, by outcome and reason (a finish reason or an error code).",
            labels=[*names, "outcome", "reason"],
        )
        for outcome, reason, v in (
            ("completed", "stop", s.completed_stop),
            ("completed", "length", s.completed_length),
            ("cancelled_by_client", "client_disconnect", s.cancelled_by_client),
            ("cancelled_by_shutdown", "shutdown", s.cancelled_by_shutdown),
            ("timed_out", "request_timeout", s.timed_out),
            ("failed", "engine_unhealthy", s.failed_engine),
            ("failed", "internal_error", s.failed_internal),
        ):
            done.add_metric([*values, outcome, reason], v)
        yield done
        rejected = CounterMetricFamily(
            "aiokv:server_requests_rejected",
            "Generation requests refused, by reason.",
            labels=[*names, "reason"],
        )
        rejected.add_metric([*values, "queue_full"], s.rejected_queue_full)
        rejected.add_metric([*values, "unavailable"], s.rejected_unavailable)
        yield rejected
