"""The asyncio continuous-batching engine: admission, scheduling, preemption, and the aiokv calls.

Sync core, async shell: :meth:`Engine._schedule` and :meth:`Engine._apply` are plain methods that move
requests between queues and hand blocks out; the async parts are the loop that runs forwards (in one worker
thread, so the event loop keeps serving aiokv while the model computes), the per-request admission tasks
(``lookup`` → ``load``) and the release tasks (``finish``/``preempt``/``abort`` → blocks back to the pool).

The block-reuse rule: a block leaves a request only through a release task, and enters the free pool only
after the request's ``finish()``/``preempt()``/``abort()`` resolved, i.e. after aiokv finished every copy
touching it. Without an offloader the same engine frees blocks at once and recomputes everything.
"""

from __future__ import annotations

import asyncio
import bisect
import concurrent.futures
import contextlib
import enum
import itertools
import operator
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import TYPE_CHECKING, Any

import torch

from aiokv import (
    AiokvError,
    ClosedError,
    DeviceError,
    EngineError,
    InvalidArgumentError,
    InvalidTypeError,
)

from ._cache import BlockAllocator, PagedKVCache
from ._model import SeqChunk, Transformer

if TYPE_CHECKING:
    from aiokv import LoadCompletion, Offloader, Request

__all__ = ["BlockEvent", "Engine", "EngineState", "EngineStats", "GenerationResult", "TokenStream"]


class EngineState(enum.Enum):
    """Where an :class:`Engine` is in its lifecycle (``Engine.state``, shown in its ``repr``): ``NEW`` ->
    ``RUNNING`` (:meth:`~Engine.start`, or entering ``async with``) -> ``CLOSING`` (:meth:`~Engine.aclose` is
    finishing or aborting what runs) -> ``CLOSED``; one closed before it started goes from ``NEW`` to
    ``CLOSED``."""

    NEW = "new"
    RUNNING = "running"
    CLOSING = "closing"
    CLOSED = "closed"

    def __str__(self) -> str:
        return self.value


_NEW, _RUNNING, _CLOSING, _CLOSED = (
    EngineState.NEW,
    EngineState.RUNNING,
    EngineState.CLOSING,
    EngineState.CLOSED,
)


class Phase(enum.Enum):
    WAITING = "waiting"  # queued for admission (new, or preempted)
    ADMITTING = "admitting"  # holds blocks; lookup/load in flight
    RUNNING = "running"  # holds blocks; scheduled into forwards
    DONE = "done"  # finished or aborted (blocks may still be releasing)


@dataclass(frozen=True, slots=True, eq=False)
class GenerationResult:
    """What :meth:`Engine.generate` returns. Times are seconds (``time.perf_counter`` based)."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    output_token_ids: tuple[int, ...]
    finish_reason: str  # "stop" (eos) or "length" (max_tokens)
    ttft_s: float  # submit -> first token sampled
    latency_s: float  # submit -> last token sampled
    queued_s: float  # submit -> first admission started
    cached_tokens: int  # prompt tokens restored by aiokv when the request was first admitted (OpenAI's
    # usage.prompt_tokens_details.cached_tokens): never more than the prompt
    computed_prefill_tokens: int  # prefill tokens run through the model, summed over admissions
    num_preemptions: int
    last_logits: torch.Tensor | None = None  # logits that sampled the last token (``return_logits=True``)
    restored_tokens: int = 0  # tokens restored by aiokv, summed over every admission (re-admissions after
    # preemption restore prompt and generated tokens again, so this may exceed the prompt)
    admission_s: float = 0.0  # first admission started -> its lookup and load done (0 without an offloader)

    @property
    def prefill_s(self) -> float:
        """Seconds from the first admission's end to the first token (``ttft_s - queued_s - admission_s``).

        That is waiting for a step and computing the uncached rest of the prompt (and whatever a preemption
        before the first token cost), so ``ttft_s == queued_s + admission_s + prefill_s``."""
        return max(0.0, self.ttft_s - self.queued_s - self.admission_s)

    @property
    def tokens_per_s(self) -> float:
        decode = self.latency_s - self.ttft_s
        return (len(self.output_token_ids) - 1) / decode if decode > 0 else 0.0


@dataclass(frozen=True, slots=True)
class BlockEvent:
    """Passed to ``Engine(on_blocks=...)``, synchronously on the loop thread, at the two moments a request's
    engine blocks hold settled KV for ``token_ids`` (the first ``len(token_ids)`` positions of the request):

    * ``"loaded"``: aiokv's ``load`` resolved; the blocks hold the restored prefix, before any forward;
    * ``"releasing"``: the request gives its blocks up (finish, preempt or abort); nothing writes them now.

    Meant for tests and debugging: read the KV with :meth:`PagedKVCache.read_positions` inside the callback.
    """

    kind: str
    request_id: str
    block_ids: tuple[int, ...]
    token_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class EngineStats:
    """Counters and queue sizes of an :class:`Engine`.

    Accounting identity (exact once the engine is idle): ``admitted_tokens == cached_tokens + prefill_tokens +
    abandoned_prefill_tokens``, where an admission's prefill is every known-but-not-restored token and a
    preemption abandons the part of a prefill not computed yet.

    Every request that left the engine is counted once, by outcome: ``finished`` (``finished_stop``: an eos
    token, or its caller's :meth:`TokenStream.finish` on a stop string; ``finished_length``: ``max_tokens``),
    ``aborted`` (``aborted_cancelled``: its caller left, i.e. a cancelled :meth:`Engine.generate` or a stream
    closed early; ``aborted_shutdown``: :meth:`Engine.aclose` with it in flight) or ``failed`` (in flight when
    the engine failed). ``finished == finished_stop + finished_length`` and ``aborted == aborted_cancelled +
    aborted_shutdown``.
    """

    steps: int
    forward_tokens: int  # every token position run through the model
    prefill_tokens: int  # positions computed that were known at admission
    decode_tokens: int  # positions of tokens sampled after admission
    admitted_tokens: int  # known tokens at each admission, summed
    cached_tokens: int  # tokens restored by lookup/load, summed
    abandoned_prefill_tokens: int
    preemptions: int
    finished: int
    aborted: int
    release_errors: int
    waiting: int
    admitting: int
    running: int
    free_blocks: int
    releasing_blocks: int
    num_blocks: int
    forward_s: float  # time spent in forwards (worker thread)
    load_s: float  # time spent awaiting aiokv loads, summed over requests (loads may overlap)
    finished_stop: int = 0  # eos token, or the caller's finish() (a stop string)
    finished_length: int = 0  # max_tokens reached
    aborted_cancelled: int = 0  # the caller left (generate() cancelled, stream closed before its end)
    aborted_shutdown: int = 0  # in flight when the engine closed
    failed: int = 0  # in flight when the engine failed (``Engine.failure``)


@dataclass(eq=False, slots=True)
class _Seq:
    request_id: str
    order: int
    prompt: tuple[int, ...]
    tokens: list[int]  # prompt + output; the last sampled token's KV is not computed yet
    max_tokens: int
    temperature: float
    seed: int
    eos_token_id: int | None
    return_logits: bool
    arrival: float
    phase: Phase = Phase.WAITING
    handle: Request | None = None
    blocks: list[int] = field(default_factory=list)
    reported: int = 0  # blocks already given to aiokv (load or step)
    reported_tokens: int = 0  # tokens aiokv knows (prompt at open, then each step's new tokens)
    num_computed: int = 0
    prefill_target: int = 0  # known tokens at the latest admission
    releasing: bool = False  # a preempt is returning the blocks; not admissible until it resolves
    abort_requested: bool = False  # its end was requested (an abort, or a finish when finish_reason is set)
    abort_reason: str = "cancelled"  # "cancelled" (the caller left) or "shutdown" (the engine closed)
    outcome: str | None = None  # "finished", "aborted" or "failed" once counted in the stats
    admitted_at: float | None = None
    running_at: float | None = None  # the first admission's lookup and load are done
    first_token_at: float | None = None
    last_token_at: float | None = None
    cached_tokens: int | None = None  # restored at the first admission (None until admitted)
    restored_tokens: int = 0
    computed_prefill: int = 0
    layer_load: LoadCompletion | None = None  # a layer-wise load its next forward waits for, layer by layer
    preemptions: int = 0
    last_logits: torch.Tensor | None = None
    finish_reason: str | None = None
    done: asyncio.Future[GenerationResult] | None = None
    progress: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def num_output(self) -> int:
        return len(self.tokens) - len(self.prompt)

    def result(self) -> GenerationResult:
        assert self.finish_reason is not None
        assert self.first_token_at is not None
        assert self.last_token_at is not None
        return GenerationResult(
            request_id=self.request_id,
            prompt_token_ids=self.prompt,
            output_token_ids=tuple(self.tokens[len(self.prompt) :]),
            finish_reason=self.finish_reason,
            ttft_s=self.first_token_at - self.arrival,
            latency_s=self.last_token_at - self.arrival,
            queued_s=(self.admitted_at or self.arrival) - self.arrival,
            cached_tokens=min(self.cached_tokens or 0, len(self.prompt)),
            restored_tokens=self.restored_tokens,
            computed_prefill_tokens=self.computed_prefill,
            num_preemptions=self.preemptions,
            last_logits=self.last_logits,
            admission_s=(self.running_at or self.arrival) - (self.admitted_at or self.arrival),
        )


class Engine:
    """A continuous-batching inference engine over a :class:`Transformer` and a :class:`PagedKVCache`.

    ``offloader`` is an open :class:`aiokv.Offloader` built on ``cache.layout()``, or ``None`` for a plain
    recompute engine that runs the very same forwards. The engine does not own the offloader::

        cache = PagedKVCache(model.config, num_blocks=256)
        async with aiokv.Offloader(cache.layout(), tiers=[aiokv.CPUTier(capacity_bytes=1 << 30)]) as off:
            async with Engine(model, cache, offloader=off) as engine:
                result = await engine.generate(prompt_ids, max_tokens=32)

    Scheduling (one step): requests are served oldest first; each running request gets the tokens it has
    not computed yet (its whole remaining prefill, chunked to ``max_num_batched_tokens``, or its one decode
    token) and the blocks those need. When the pool is empty the newest running request is preempted.
    Waiting requests are admitted in arrival order as soon as blocks for their known context are free (when
    blocks come back or a request arrives, not only between steps), so their lookup and load overlap the
    forward in flight.
    """

    def __init__(
        self,
        model: Transformer,
        cache: PagedKVCache,
        *,
        offloader: Offloader | None = None,
        max_num_seqs: int = 16,
        max_num_batched_tokens: int = 512,
        torch_threads: int | None = 1,
        on_blocks: Callable[[BlockEvent], None] | None = None,
        layerwise_loads: bool = False,
    ) -> None:
        if not isinstance(layerwise_loads, bool):
            raise InvalidArgumentError(
                f"layerwise_loads must be a bool, got {type(layerwise_loads).__name__}"
            )
        if cache.config != model.config:
            raise InvalidArgumentError("cache must be built for the model's config")
        if cache.device != model.device:
            raise InvalidArgumentError(
                f"cache must be on the model's device {model.device}, got {cache.device}"
            )
        if max_num_seqs <= 0:
            raise InvalidArgumentError(f"max_num_seqs must be > 0, got {max_num_seqs}")
        if max_num_batched_tokens <= 0:
            raise InvalidArgumentError(f"max_num_batched_tokens must be > 0, got {max_num_batched_tokens}")
        if offloader is not None:
            layout = offloader.layout
            if layout.block_size != cache.block_size or sorted(map(id, layout.tensors)) != sorted(
                map(id, cache.tensors)
            ):
                raise InvalidArgumentError("offloader must be built on cache.layout()")
        if torch_threads is not None:
            # Process-wide. Measured on 2 cores: 1 intra-op thread is ~10x faster for decode-sized ops
            # and no slower for 512-token prefill chunks (docs/engine.md).
            torch.set_num_threads(torch_threads)
        self.model = model
        self.cache = cache
        self.offloader = offloader
        # A device data path (CUDA or simulated): forwards are launched on the compute stream and steps are
        # reported before they complete (asynchronous scheduling).
        self._device = getattr(offloader, "device", None)
        # The load planner's prefill measurements (an offloader-like object without them gets none).
        self._record_prefill: Callable[[int, float], None] | None = getattr(offloader, "record_prefill", None)
        self.block_size = cache.block_size
        # A grouped layout (sliding-window, latent or state layers) takes block ids per group: the engine's one
        # block table serves every group (each group's tensors are indexed by the same block ids).
        self._group_count = len(getattr(offloader.layout, "groups", ())) if offloader is not None else 0
        if layerwise_loads and (offloader is None or self._group_count):
            raise InvalidArgumentError(
                "layerwise_loads needs an offloader on a plain (ungrouped) layout: a model with sliding-window,"
                " latent or state layers loads whole"
            )
        # Restores copied layer by layer: on a device the first forward over a restored prefix runs each
        # layer right after that layer's copy (Transformer.forward_layers); on the CPU the engine still
        # awaits the whole load before the forward (its forward runs in one worker-thread call).
        self.layerwise_loads = layerwise_loads
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self._on_blocks = on_blocks
        self._allocator = BlockAllocator(cache.num_blocks)
        self._waiting: list[_Seq] = []  # sorted by order
        self._running: list[_Seq] = []  # sorted by order
        self._admitting = 0
        self._seqs: dict[str, _Seq] = {}
        self._order = itertools.count()
        self._ids = itertools.count()
        self._tasks: set[asyncio.Task[None]] = set()
        self._wakeup = asyncio.Event()
        self._releasing_blocks = 0
        self._starved = False  # last schedule left an old request without blocks: admit nothing new
        self._idle_waiters: list[asyncio.Event] = []
        self._loop_task: asyncio.Task[None] | None = None
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._state = _NEW
        self._failure: BaseException | None = None
        self._counts = dict.fromkeys(
            (
                "steps",
                "forward_tokens",
                "prefill_tokens",
                "decode_tokens",
                "admitted_tokens",
                "cached_tokens",
                "abandoned_prefill_tokens",
                "preemptions",
                "finished",
                "aborted",
                "release_errors",
                "finished_stop",
                "finished_length",
                "aborted_cancelled",
                "aborted_shutdown",
                "failed",
            ),
            0,
        )
        self._forward_s = 0.0
        self._load_s = 0.0

    # ------------------------------------------------------------------ lifetime

    async def __aenter__(self) -> Engine:
        await self.start()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    async def start(self) -> None:
        if self._state is not _NEW:
            raise ClosedError(f"engine cannot be started twice (it is {self._state})")
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="aiokv-engine-forward")
        self._loop_task = asyncio.get_running_loop().create_task(self._run(), name="aiokv-engine-loop")
        self._state = _RUNNING

    async def aclose(self) -> None:
        """Abort every request, wait for aiokv to release their blocks, stop the loop. Idempotent."""
        if self._state in (_CLOSING, _CLOSED):
            return
        if self._state is _NEW:
            self._state = _CLOSED
            return
        self._state = _CLOSING
        try:
            for seq in list(self._seqs.values()):
                self._request_abort(seq, ClosedError("engine closed"), reason="shutdown")
            self._wakeup.set()
            assert self._loop_task is not None
            # The loop may have ended with an error or been cancelled by a failure: that is the engine's
            # failure (reported through `failure`), not this close's. Only our own cancellation propagates.
            await asyncio.wait([self._loop_task])
            if not self._loop_task.cancelled():
                self._loop_task.exception()  # retrieved
            while self._tasks:
                await asyncio.gather(*self._tasks, return_exceptions=True)
        finally:
            if self._executor is not None:
                self._executor.shutdown(wait=False)
            self._state = _CLOSED

    # ------------------------------------------------------------------ public API

    async def generate(
        self,
        prompt_token_ids: Sequence[int],
        *,
        max_tokens: int = 16,
        temperature: float = 0.0,
        seed: int = 0,
        eos_token_id: int | None = None,
        request_id: str | None = None,
        return_logits: bool = False,
    ) -> GenerationResult:
        """Generate up to ``max_tokens`` tokens after ``prompt_token_ids``.

        ``temperature == 0`` is greedy; otherwise tokens are sampled with a generator seeded from ``seed`` and
        the token's index, so a given request samples the same tokens however it is batched or preempted.
        Cancelling the call aborts the request.
        """
        seq = self._submit(
            prompt_token_ids, max_tokens, temperature, seed, eos_token_id, request_id, return_logits
        )
        assert seq.done is not None
        try:
            return await asyncio.shield(seq.done)
        except asyncio.CancelledError:
            self._request_abort(seq, None)
            raise

    def stream(
        self,
        prompt_token_ids: Sequence[int],
        *,
        max_tokens: int = 16,
        temperature: float = 0.0,
        seed: int = 0,
        eos_token_id: int | None = None,
        request_id: str | None = None,
    ) -> TokenStream:
        """Like :meth:`generate` but yields token ids as they are sampled::

            async with engine.stream(prompt, max_tokens=64) as tokens:
                async for token_id in tokens:
                    ...
            tokens.result  # the GenerationResult

        The arguments are checked at once; the request is queued when the stream is entered (or first
        iterated), so a stream that is never used costs nothing. Leaving the block (or ``aclose()``) before
        the end aborts the request.
        """
        seq = self._new_seq(prompt_token_ids, max_tokens, temperature, seed, eos_token_id, request_id, False)
        return TokenStream(self, seq)

    def stats(self) -> EngineStats:
        return EngineStats(
            **self._counts,
            waiting=len(self._waiting),
            admitting=self._admitting,
            running=len(self._running),
            free_blocks=self._allocator.num_free,
            releasing_blocks=self._releasing_blocks,
            num_blocks=self._allocator.num_blocks,
            forward_s=self._forward_s,
            load_s=self._load_s,
        )

    @property
    def healthy(self) -> bool:
        """True while the engine can serve new requests: started, not failed, its offloader open."""
        return self._state is _RUNNING and self._check_health() is None

    @property
    def failure(self) -> BaseException | None:
        """Why the engine stopped serving (``None`` while it is healthy)."""
        return self._check_health()

    def _check_health(self) -> BaseException | None:
        if (
            self._failure is None
            and self.offloader is not None
            and not getattr(self.offloader, "running", True)
        ):
            self._fail(ClosedError("the offloader was closed under the engine"))
        return self._failure

    async def wait_idle(self) -> None:
        """Wait until no request is queued or running and every block is back in the free pool."""
        while self._seqs or self._tasks:
            if self._failure is not None:
                raise self._failure
            ev = asyncio.Event()
            self._idle_waiters.append(ev)
            await ev.wait()

    @property
    def state(self) -> EngineState:
        """The lifecycle state (:class:`EngineState`)."""
        return self._state

    def __repr__(self) -> str:
        mode = "offload" if self.offloader is not None else "recompute"
        return (
            f"<Engine {self._state.name} {mode} waiting={len(self._waiting)} admitting={self._admitting}"
            f" running={len(self._running)} free_blocks={self._allocator.num_free}/{self._allocator.num_blocks}>"
        )

    # ------------------------------------------------------------------ submission / abort

    def _submit(
        self,
        prompt_token_ids: Sequence[int],
        max_tokens: int,
        temperature: float,
        seed: int,
        eos_token_id: int | None,
        request_id: str | None,
        return_logits: bool,
    ) -> _Seq:
        seq = self._new_seq(
            prompt_token_ids, max_tokens, temperature, seed, eos_token_id, request_id, return_logits
        )
        self._enqueue(seq)
        return seq

    def _new_seq(
        self,
        prompt_token_ids: Sequence[int],
        max_tokens: int,
        temperature: float,
        seed: int,
        eos_token_id: int | None,
        request_id: str | None,
        return_logits: bool,
    ) -> _Seq:
        """Validate a request's arguments; the request is not queued yet."""
        self._check_accepting()
        cfg = self.model.config
        if isinstance(prompt_token_ids, (str, bytes)):
            raise InvalidTypeError(
                f"prompt_token_ids must be a sequence of ints, got {type(prompt_token_ids).__name__}"
            )
        try:
            prompt = tuple(_token(t) for t in prompt_token_ids)
        except TypeError:
            raise InvalidTypeError("prompt_token_ids must contain ints") from None
        if not prompt:
            raise InvalidArgumentError("prompt_token_ids must not be empty")
        if min(prompt) < 0 or max(prompt) >= cfg.vocab_size:
            raise InvalidArgumentError(
                f"prompt_token_ids must be in [0, {cfg.vocab_size}), got {min(prompt)}..{max(prompt)}"
            )
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int):
            raise InvalidTypeError(f"max_tokens must be an int, got {type(max_tokens).__name__}")
        if max_tokens <= 0:
            raise InvalidArgumentError(f"max_tokens must be > 0, got {max_tokens}")
        if isinstance(temperature, bool) or not isinstance(temperature, (int, float)):
            raise InvalidTypeError(f"temperature must be a number, got {type(temperature).__name__}")
        if not 0 <= temperature < float("inf"):
            raise InvalidArgumentError(f"temperature must be a finite number >= 0, got {temperature}")
        if eos_token_id is not None and (
            isinstance(eos_token_id, bool)
            or not isinstance(eos_token_id, int)
            or not 0 <= eos_token_id < cfg.vocab_size
        ):
            raise InvalidArgumentError(
                f"eos_token_id must be None or in [0, {cfg.vocab_size}), got {eos_token_id!r}"
            )
        total = len(prompt) + max_tokens
        if total > cfg.max_position:
            raise InvalidArgumentError(
                f"prompt length + max_tokens must be <= max_position={cfg.max_position}, got {total}"
            )
        if -(-total // self.block_size) > self._allocator.num_blocks:
            raise InvalidArgumentError(
                f"prompt length + max_tokens must fit in the cache's {self._allocator.num_blocks} blocks"
                f" of {self.block_size} tokens, got {total} tokens"
            )
        if request_id is not None and not isinstance(request_id, str):
            raise InvalidTypeError(f"request_id must be a str or None, got {type(request_id).__name__}")
        return _Seq(
            request_id=request_id if request_id is not None else f"engine-{next(self._ids)}",
            order=-1,
            prompt=prompt,
            tokens=list(prompt),
            max_tokens=max_tokens,
            temperature=float(temperature),
            seed=int(seed),
            eos_token_id=eos_token_id,
            return_logits=return_logits,
            arrival=0.0,
        )

    def _check_accepting(self) -> None:
        if self._state is not _RUNNING:
            raise ClosedError(
                "engine is not started; use 'async with Engine(...)'"
                if self._state is _NEW
                else f"engine is {self._state}"
            )
        cause = self._check_health()
        if cause is not None:
            raise EngineError(f"engine is unhealthy and accepts no requests: {cause}") from cause

    def _enqueue(self, seq: _Seq) -> None:
        """Queue a validated request for admission (it starts competing for blocks now)."""
        self._check_accepting()
        if seq.request_id in self._seqs:
            raise InvalidArgumentError(f"request_id {seq.request_id!r} is already running")
        seq.order = next(self._order)
        seq.arrival = time.perf_counter()
        seq.done = asyncio.get_running_loop().create_future()
        self._seqs[seq.request_id] = seq
        self._waiting.append(seq)  # orders only grow: stays sorted
        self._admit()  # blocks free now: start its lookup/load now, not after the forward in flight
        self._wakeup.set()

    def _request_abort(self, seq: _Seq, exc: BaseException | None, reason: str = "cancelled") -> None:
        """Mark ``seq`` for abort (the loop does the work); fail its waiters with ``exc`` or cancel them.
        ``reason`` is what the stats count it under (``aborted_<reason>``)."""
        if seq.phase is Phase.DONE or seq.abort_requested:
            return
        seq.abort_requested = True
        seq.abort_reason = reason
        assert seq.done is not None
        if not seq.done.done():
            if exc is None:
                seq.done.cancel()
            else:
                seq.done.set_exception(exc)
                seq.done.exception()  # retrieved: a caller that already left must not trigger a warning
        seq.progress.set()
        self._wakeup.set()

    def _request_finish(self, seq: _Seq) -> None:
        """End ``seq`` as finished with ``finish_reason="stop"`` (its caller matched a stop string): the loop
        ends it at the next step boundary, as an eos token would. Before its first token it is an abort."""
        if seq.phase is Phase.DONE or seq.abort_requested:
            return
        if seq.first_token_at is None:
            self._request_abort(seq, None)
            return
        seq.abort_requested = True  # nothing more is sampled or reported for it
        seq.finish_reason = "stop"
        assert seq.done is not None
        if not seq.done.done():
            seq.done.set_result(seq.result())
        seq.progress.set()
        self._wakeup.set()

    # ------------------------------------------------------------------ the loop

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while True:
                self._wakeup.clear()
                self._process_aborts()
                if self._state is _CLOSING and not self._seqs:
                    return
                was_starved = self._starved
                self._admit()
                plan = self._schedule()
                if not plan:
                    if was_starved and not self._starved:
                        continue  # admission held back for a request that has since left: retry it now
                    self._notify_idle()
                    await self._wakeup.wait()
                    continue
                chunks = [
                    SeqChunk(s.tokens[s.num_computed : s.num_computed + n], s.num_computed, tuple(s.blocks))
                    for s, n in plan
                ]
                samplers = [
                    (s.temperature, s.seed, s.num_output, s.return_logits)
                    if s.num_computed + n == len(s.tokens)
                    else None
                    for s, n in plan
                ]
                assert self._executor is not None
                fut: asyncio.Future[tuple[list[tuple[int, torch.Tensor | None] | None], float]]
                if self._device is not None:
                    fut = asyncio.ensure_future(self._forward_on_device(plan, chunks, samplers))
                else:
                    fut = loop.run_in_executor(self._executor, self._forward, chunks, samplers)
                try:
                    sampled, elapsed = await asyncio.shield(fut)
                except asyncio.CancelledError:
                    # The forward writes into blocks the plan holds: it must end before anyone frees them.
                    with contextlib.suppress(BaseException):
                        await fut
                    raise
                self._forward_s += elapsed
                if self._record_prefill is not None:
                    self._report_prefill(plan, elapsed)
                self._apply(plan, sampled)
        except BaseException as exc:
            if not isinstance(exc, asyncio.CancelledError):
                self._fail(exc)
            raise

    def _fail(self, exc: BaseException) -> None:
        self._failure = exc
        for seq in self._seqs.values():
            # Counted now: the loop that would end them is gone. One whose end was requested counts as that.
            self._count_end(seq, failed=not seq.abort_requested)
            if seq.done is not None and not seq.done.done():
                seq.done.set_exception(exc)
                seq.done.exception()
            seq.progress.set()
        self._notify_idle()

    def _notify_idle(self) -> None:
        if (not self._seqs and not self._tasks) or self._failure is not None:
            for ev in self._idle_waiters:
                ev.set()
            self._idle_waiters.clear()

    def _forward(
        self, chunks: list[SeqChunk], samplers: list[tuple[float, int, int, bool] | None]
    ) -> tuple[list[tuple[int, torch.Tensor | None] | None], float]:
        """Runs in the worker thread: one forward and the sampling of every request that completed."""
        t0 = time.perf_counter()
        with torch.inference_mode():
            # ``.cpu()`` also waits for the device: the KV writes are complete before ``step()`` reports them.
            logits = self.model.forward(chunks, self.cache.tensors).cpu()
        return _sample_rows(logits, samplers), time.perf_counter() - t0

    async def _forward_on_device(
        self,
        plan: list[tuple[_Seq, int]],
        chunks: list[SeqChunk],
        samplers: list[tuple[float, int, int, bool] | None],
    ) -> tuple[list[tuple[int, torch.Tensor | None] | None], float]:
        """Asynchronous scheduling on a device: launch the forward on the compute stream, report the step to
        aiokv at once (its KV is not written yet: aiokv's stores wait for this point on the device), then wait
        for the logits and sample. A simulated device runs the forward on its stream's worker, so the KV
        writes really land after ``step()`` returned."""
        device = self._device
        assert device is not None
        assert self._executor is not None
        assert self.offloader is not None
        loop = asyncio.get_running_loop()
        stream = self.offloader.executor.compute_stream
        out: list[torch.Tensor] = []
        waits = [seq.layer_load for seq, _ in plan if seq.layer_load is not None]
        for seq, _ in plan:
            seq.layer_load = None  # from this forward on, the stream is ordered after every layer's copy

        def forward() -> None:
            with torch.inference_mode():
                out.append(self.model.forward(chunks, self.cache.tensors))

        def forward_layer_by_layer() -> None:
            # The forward as one kernel per stage, each ordered after its layer's copy of every restore in
            # the batch: layer i computes while the copies of the later layers are still running.
            stages = self.model.forward_layers(chunks, self.cache.tensors)

            def advance() -> None:
                with torch.inference_mode():
                    try:
                        next(stages)
                    except StopIteration as end:
                        out.append(end.value)

            device.launch(stream, advance)  # up to layer 0
            for i in range(self.model.config.num_layers):
                for pending in waits:
                    pending.order_layer_before(i, stream)
                device.launch(stream, advance)  # layer i, up to layer i + 1 (the last: the logits)

        t0 = time.perf_counter()
        if waits:
            await loop.run_in_executor(self._executor, forward_layer_by_layer)
        else:
            await loop.run_in_executor(self._executor, device.launch, stream, forward)
        done = device.new_event(blocking=True)
        device.record(done, stream)
        for seq, n in plan:
            self._report_step(seq, seq.num_computed + n)
        await loop.run_in_executor(self._executor, device.synchronize, done)
        logits = out[0].cpu()
        return _sample_rows(logits, samplers), time.perf_counter() - t0

    def _report_prefill(self, plan: list[tuple[_Seq, int]], elapsed: float) -> None:
        """Tell the offloader's load planner how fast this forward computed, when it was mostly prefill: the
        rate a recompute of a cached prefix would run at (``load_policy="decide"`` compares loads with it)."""
        assert self._record_prefill is not None
        tokens = 0
        prefill = 0
        for seq, n in plan:
            tokens += n
            prefill += max(0, min(seq.num_computed + n, seq.prefill_target) - seq.num_computed)
        if prefill * 2 >= tokens > 0:
            self._record_prefill(tokens, elapsed)

    def _report_step(self, seq: _Seq, end: int) -> None:
        """Tell aiokv that ``seq`` has (or, on a device, will have) the KV of its first ``end`` tokens."""
        if seq.handle is None or seq.abort_requested:
            return
        new_blocks = seq.blocks[seq.reported :]
        seq.reported = len(seq.blocks)
        new_tokens = seq.tokens[seq.reported_tokens :]
        seq.reported_tokens = len(seq.tokens)
        seq.handle.step(end, new_token_ids=new_tokens, new_block_ids=self._aiokv_ids(new_blocks))

    def _aiokv_ids(self, blocks: list[int]) -> Any:
        """Block ids as aiokv takes them: the list, or one (shared) list per group of a grouped layout."""
        return (blocks,) * self._group_count if self._group_count else blocks

    # ------------------------------------------------------------------ sync core

    def _process_aborts(self) -> None:
        for seq in [s for s in self._seqs.values() if s.abort_requested]:
            if seq.phase is Phase.ADMITTING:
                continue  # the admission task ends first, then this runs again
            if seq.phase is Phase.RUNNING:
                self._running.remove(seq)
            elif seq.phase is Phase.WAITING:
                self._waiting.remove(seq)
            # A finish the caller asked for (a stop string) releases as an eos finish would (aiokv stores its
            # computed blocks); one that holds no blocks of a running request (preempted, waiting) aborts.
            finish = seq.finish_reason is not None and seq.phase is Phase.RUNNING
            self._end(seq, "finish" if finish else "abort")

    def _admit(self) -> None:
        """Start admissions in arrival order while blocks for the whole known context are free.

        Runs at every step boundary and also whenever blocks come back or a request arrives (synchronous, on
        the loop thread: never in the middle of :meth:`_schedule`), so admissions overlap the forward in
        flight."""
        while self._waiting and self._state is _RUNNING and self._failure is None:
            if len(self._running) + self._admitting >= self.max_num_seqs:
                return
            seq = self._waiting[0]
            if seq.releasing or self._starved or seq.abort_requested:
                return  # strict FCFS; running requests come before new ones; the loop ends aborted ones
            need = -(-len(seq.tokens) // self.block_size)
            blocks = self._allocator.allocate(need)
            if blocks is None:
                return
            self._waiting.pop(0)
            seq.blocks = blocks
            seq.reported = 0
            seq.num_computed = 0
            seq.prefill_target = len(seq.tokens)
            seq.phase = Phase.ADMITTING
            if seq.admitted_at is None:
                seq.admitted_at = time.perf_counter()
            self._counts["admitted_tokens"] += len(seq.tokens)
            self._admitting += 1
            self._spawn(self._admission(seq), f"aiokv-engine-admit-{seq.request_id}")

    async def _admission(self, seq: _Seq) -> None:
        hit = 0
        try:
            if self.offloader is not None:
                if seq.handle is None:
                    # aiokv ids are unique per engine: a caller may reuse a request_id whose finish is pending.
                    seq.handle = self.offloader.open(f"{seq.request_id}#{seq.order}", seq.tokens)
                    seq.reported_tokens = len(seq.tokens)
                hit = await seq.handle.lookup()
                n_hit = hit // self.block_size
                hit = n_hit * self.block_size
                if n_hit:
                    blocks = seq.blocks[:n_hit]
                    t0 = time.perf_counter()
                    ids = self._aiokv_ids(blocks)
                    # (Only a layer-wise engine passes the keyword: stand-ins for Request keep working.)
                    pending = (
                        seq.handle.load(ids, layerwise=True) if self.layerwise_loads else seq.handle.load(ids)
                    )
                    seq.reported = n_hit  # the blocks are in aiokv's table whatever the copy does
                    if self._device is not None:
                        # No host round trip: the forwards of this request wait for the copy on the device
                        # (layer-wise: its next forward waits for each layer right before computing it).
                        hit = await pending.wait_submitted()
                        if self.layerwise_loads:
                            seq.layer_load = pending
                        else:
                            pending.order_before()
                        self._spawn(
                            self._loaded_on_device(seq, pending, hit, blocks, t0),
                            f"aiokv-engine-loaded-{seq.request_id}",
                        )
                    else:
                        try:
                            hit = await pending
                        except AiokvError:
                            hit = 0  # the copy failed: aiokv counts nothing computed; recompute it all
                        self._load_s += time.perf_counter() - t0
                        self._loaded(seq, blocks, hit)
        finally:
            self._admitting -= 1
            self._wakeup.set()
        seq.num_computed = hit
        if seq.cached_tokens is None:
            seq.cached_tokens = hit
        seq.restored_tokens += hit
        self._counts["cached_tokens"] += hit
        if seq.running_at is None:  # no lookup or load without an offloader: no admission time
            seq.running_at = time.perf_counter() if self.offloader is not None else seq.admitted_at
        seq.phase = Phase.RUNNING
        bisect.insort(self._running, seq, key=lambda s: s.order)

    def _loaded(self, seq: _Seq, blocks: list[int], hit: int) -> None:
        if hit and self._on_blocks is not None and seq.blocks[: len(blocks)] == blocks:
            n = -(-hit // self.block_size)
            self._on_blocks(BlockEvent("loaded", seq.request_id, tuple(blocks[:n]), tuple(seq.tokens[:hit])))

    async def _loaded_on_device(
        self, seq: _Seq, pending: LoadCompletion, expected: int, blocks: list[int], t0: float
    ) -> None:
        """Host side of a load whose consumers were ordered after it on the device."""
        try:
            restored = await pending
        except AiokvError:
            restored = 0
        self._load_s += time.perf_counter() - t0
        if restored != expected:
            # Forwards already read these blocks on the device, ordered after a copy that failed: their
            # results cannot be trusted, and there is no way to take them back.
            raise DeviceError(
                f"a load for request {seq.request_id!r} failed on the device after its consumers were launched"
            )
        self._loaded(seq, blocks, restored)

    def _schedule(self) -> list[tuple[_Seq, int]]:
        """Pick this step's chunks, oldest request first; allocate their blocks, preempting the newest."""
        plan: list[tuple[_Seq, int]] = []
        budget = self.max_num_batched_tokens
        blocked = False  # an older request waits for blocks: newer ones must not take any
        running = self._running
        i = 0
        while i < len(running) and budget > 0 and len(plan) < self.max_num_seqs:
            seq = running[i]
            n = min(len(seq.tokens) - seq.num_computed, budget)
            need = -(-(seq.num_computed + n) // self.block_size) - len(seq.blocks)
            if need > 0:
                got = None if blocked else self._allocator.allocate(need)
                while got is None and not blocked:
                    if self._releasing_blocks >= need:
                        blocked = True  # blocks are on their way back: wait rather than preempt more
                    elif running[-1] is not seq:
                        self._preempt(running[-1])
                        got = self._allocator.allocate(need)
                    else:
                        if len(running) > 1 or plan:
                            self._preempt(seq)  # it is the newest: give its blocks to the older ones
                        blocked = True
                if got is None:
                    if seq.phase is not Phase.RUNNING:
                        continue  # preempted itself: running[i] is now the next request
                    i += 1
                    continue
                seq.blocks.extend(got)
            plan.append((seq, n))
            budget -= n
            i += 1
        self._starved = blocked
        return plan

    def _preempt(self, seq: _Seq) -> None:
        self._running.remove(seq)
        if seq.num_computed < seq.prefill_target:
            self._counts["abandoned_prefill_tokens"] += seq.prefill_target - seq.num_computed
        seq.preemptions += 1
        self._counts["preemptions"] += 1
        seq.phase = Phase.WAITING
        seq.layer_load = None
        bisect.insort(self._waiting, seq, key=lambda s: s.order)
        self._release(seq, "preempt")
        seq.num_computed = 0

    def _apply(
        self, plan: list[tuple[_Seq, int]], sampled: list[tuple[int, torch.Tensor | None] | None]
    ) -> None:
        now = time.perf_counter()
        self._counts["steps"] += 1
        for (seq, n), sample in zip(plan, sampled, strict=True):
            start = seq.num_computed
            end = start + n
            prefill = max(0, min(end, seq.prefill_target) - start)
            seq.computed_prefill += prefill
            self._counts["prefill_tokens"] += prefill
            self._counts["decode_tokens"] += n - prefill
            self._counts["forward_tokens"] += n
            seq.num_computed = end
            token = -1
            # Nothing is sampled for a request that is ending (aborted, or finished early by its caller).
            if sample is not None and not seq.abort_requested:
                token, logits = sample
                seq.tokens.append(token)
                seq.last_logits = logits
                seq.last_token_at = now
                if seq.first_token_at is None:
                    seq.first_token_at = now
                seq.progress.set()
            if self._device is None:
                self._report_step(seq, end)  # on a device the step was reported when the forward launched
            if sample is not None and not seq.abort_requested:
                if seq.eos_token_id is not None and token == seq.eos_token_id:
                    seq.finish_reason = "stop"
                elif seq.num_output >= seq.max_tokens:
                    seq.finish_reason = "length"
                if seq.finish_reason is not None:
                    self._running.remove(seq)
                    assert seq.done is not None
                    if not seq.done.done():
                        seq.done.set_result(seq.result())
                    self._end(seq, "finish")

    def _end(self, seq: _Seq, how: str) -> None:
        self._count_end(seq)
        seq.phase = Phase.DONE
        del self._seqs[seq.request_id]
        seq.progress.set()
        self._release(seq, how)

    def _count_end(self, seq: _Seq, *, failed: bool = False) -> None:
        """Count ``seq`` once in the stats: finished (by finish reason), aborted (by reason) or failed."""
        if seq.outcome is not None:
            return
        if failed:
            seq.outcome = "failed"
            self._counts["failed"] += 1
        elif seq.finish_reason is not None:
            seq.outcome = "finished"
            self._counts["finished"] += 1
            self._counts[f"finished_{seq.finish_reason}"] += 1
        else:
            seq.outcome = "aborted"
            self._counts["aborted"] += 1
            self._counts[f"aborted_{seq.abort_reason}"] += 1

    def _release(self, seq: _Seq, how: str) -> None:
        """Give ``seq``'s blocks back to the pool once aiokv says they may be reused."""
        blocks, seq.blocks, seq.reported = seq.blocks, [], 0
        if blocks and self._on_blocks is not None:
            self._on_blocks(
                BlockEvent("releasing", seq.request_id, tuple(blocks), tuple(seq.tokens[: seq.num_computed]))
            )
        handle = seq.handle
        if handle is None:
            self._allocator.free(blocks)
            return
        self._releasing_blocks += len(blocks)
        if how == "preempt":
            seq.releasing = True
        self._spawn(self._release_task(seq, handle, how, blocks), f"aiokv-engine-{how}-{seq.request_id}")

    async def _release_task(self, seq: _Seq, handle: Request, how: str, blocks: list[int]) -> None:
        try:
            await (
                handle.finish()
                if how == "finish"
                else handle.preempt()
                if how == "preempt"
                else handle.abort()
            )
        except AiokvError:
            # aiokv resolves these only after its copies ended, failed or not: the blocks are free to reuse.
            self._counts["release_errors"] += 1
        self._releasing_blocks -= len(blocks)
        self._allocator.free(blocks)
        if how == "preempt":
            seq.releasing = False
        # The blocks are reusable now: a waiting request starts its admission (lookup, load) at once, while
        # the forward in flight runs, instead of at the next step boundary; it joins the next step.
        self._admit()
        self._wakeup.set()

    def _spawn(self, coro: Any, name: str) -> None:
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)

        def done(t: asyncio.Task[None]) -> None:
            self._tasks.discard(t)
            if not t.cancelled() and t.exception() is not None and self._failure is None:
                self._fail(t.exception())  # type: ignore[arg-type]
                if self._loop_task is not None:
                    self._loop_task.cancel()
            self._notify_idle()

        task.add_done_callback(done)


def _token(t: Any) -> int:
    if isinstance(t, bool):
        raise TypeError("bool is not a token id")
    return operator.index(t)  # ints and int-like values (numpy ints), never floats or strings


def _sample_rows(
    logits: torch.Tensor, samplers: list[tuple[float, int, int, bool] | None]
) -> list[tuple[int, torch.Tensor | None] | None]:
    """Sample a token for every row that has a sampler (the requests whose prompt is fully computed)."""
    out: list[tuple[int, torch.Tensor | None] | None] = []
    for row, sampler in zip(logits, samplers, strict=True):
        if sampler is None:
            out.append(None)
            continue
        temperature, seed, index, keep = sampler
        out.append((_sample(row, temperature, seed, index), row.clone() if keep else None))
    return out


def _sample(logits: torch.Tensor, temperature: float, seed: int, index: int) -> int:
    if temperature == 0.0:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits.double() / temperature, dim=-1)
    gen = torch.Generator().manual_seed((seed * 1_000_003 + index) & 0x7FFF_FFFF_FFFF_FFFF)
    return int(torch.multinomial(probs, 1, generator=gen))


class TokenStream:
    """Async iterator over one request's token ids (see :meth:`Engine.stream`)."""

    def __init__(self, engine: Engine, seq: _Seq) -> None:
        self._engine = engine
        self._seq = seq
        self._next = 0
        self._started = False

    def _start(self) -> None:
        if not self._started:
            self._engine._enqueue(self._seq)
            self._started = True

    def __aiter__(self) -> AsyncIterator[int]:
        return self

    async def __anext__(self) -> int:
        self._start()
        seq = self._seq
        while True:
            if self._next < seq.num_output:
                token = seq.tokens[len(seq.prompt) + self._next]
                self._next += 1
                return token
            assert seq.done is not None
            if seq.done.done():
                if seq.done.cancelled():
                    raise StopAsyncIteration
                exc = seq.done.exception()
                if exc is not None:
                    raise exc
                raise StopAsyncIteration
            seq.progress.clear()
            await seq.progress.wait()

    @property
    def cached_tokens(self) -> int | None:
        """Prompt tokens aiokv restored when the request was first admitted (``None`` until admitted)."""
        c = self._seq.cached_tokens
        return None if c is None else min(c, len(self._seq.prompt))

    @property
    def result(self) -> GenerationResult:
        """The request's result; valid once iteration ended normally."""
        if self._seq.done is None or not self._seq.done.done():
            raise InvalidArgumentError("result is available once the stream has been iterated to its end")
        return self._seq.done.result()

    def finish(self) -> None:
        """End the request now as finished with ``finish_reason="stop"``, for a caller that matched a stop
        string in the text: it counts as finished (not aborted) in :meth:`Engine.stats`, its blocks are released
        as an eos token would release them, and :attr:`result` holds the tokens sampled so far. Iteration ends
        after the tokens already sampled. Before the first token it aborts the request; after the request ended
        it does nothing."""
        if self._started:
            self._engine._request_finish(self._seq)

    async def aclose(self) -> None:
        """Abort the request unless it has finished (a stream never started has nothing to abort)."""
        if self._started:
            self._engine._request_abort(self._seq, None)

    async def __aenter__(self) -> TokenStream:
        self._start()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()
