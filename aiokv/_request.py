"""The per-request state machine.

Each request is a coroutine (one asyncio task) that consumes the request's events in order: block-full stores
(from :meth:`Request.step`), lookup, load, finish, preempt and abort. The public methods validate their
arguments synchronously, update the request's bookkeeping (token list, block table) and enqueue an event;
the awaitable ones resolve when the task has processed that event *and every earlier one*.

The guarantee engines rely on: ``finish()``, ``preempt()`` and ``abort()`` resolve only after every copy that
reads or writes this request's engine blocks has completed. Copies are represented by
:class:`~aiokv.TransferFuture` objects that exist only once the copy is on its stream, and the task awaits all
of them, so an engine that returns blocks to its free pool when these calls resolve cannot reuse a block
under a copy.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
from collections import deque
from collections.abc import Generator, Sequence
from typing import TYPE_CHECKING, Any

from ._errors import InvalidArgumentError, InvalidTypeError, RequestStateError, TransferError
from ._hashing import block_hashes, chain_seed, check_token_ids, partial_block_hash
from .transfer._future import TransferFuture, resolve

if TYPE_CHECKING:
    from ._offloader import Offloader

__all__ = ["LoadCompletion", "Request", "RequestHandle", "RequestState"]


class RequestState(enum.Enum):
    WAITING = "waiting"  # opened (or resumed after preemption), holds no blocks yet
    LOADING = "loading"  # a load into its first blocks is in flight
    RUNNING = "running"  # holds blocks; steps store full blocks
    PREEMPTED = "preempted"  # holds no blocks; may lookup/load again
    FINISHING = "finishing"  # finish() called; draining stores
    FINISHED = "finished"
    ABORTED = "aborted"


_EMPTY: list[int] = []
_ENDED = (RequestState.FINISHING, RequestState.FINISHED, RequestState.ABORTED)


class _Ev(enum.Enum):
    STORE = 1
    LOOKUP = 2
    LOAD = 3
    PREEMPT = 4
    FINISH = 5
    ABORT = 6
    BARRIER = 7


class _Completion:
    """Awaitable result of an event; awaiting it and being cancelled withdraws a not-yet-processed event."""

    __slots__ = ("_fut",)

    def __init__(self, fut: asyncio.Future[Any]) -> None:
        self._fut = fut

    def __await__(self) -> Generator[Any, None, Any]:
        return self._fut.__await__()

    def done(self) -> bool:
        return self._fut.done()


class LoadCompletion(_Completion):
    """What :meth:`Request.load` returns. Awaiting it resolves, on the host, once the KV is in the engine
    blocks, to the number of tokens restored.

    On a device backend an engine need not wait for the host: ``await wait_submitted()`` resolves as soon as
    the copy is queued on aiokv's load stream, and ``order_before(stream)`` then makes work enqueued on the
    engine's compute stream wait for the copy on the device::

        pending = req.load(blocks)
        restored = await pending.wait_submitted()   # tokens the load restores; the copy may be running
        pending.order_before()                      # the forward enqueued next waits for it on the GPU
        launch_forward(...)
    """

    __slots__ = ("_off", "_ticket", "_tokens")

    def __init__(
        self,
        fut: asyncio.Future[Any],
        ticket: asyncio.Future[TransferFuture | None],
        tokens: int,
        off: Offloader,
    ) -> None:
        super().__init__(fut)
        self._ticket = ticket
        self._tokens = tokens
        self._off = off

    async def wait_submitted(self) -> int:
        """Resolve once the load's copy is on its stream; return the tokens it restores when it completes.

        Cancelling this wait does not withdraw the load."""
        tf = await asyncio.shield(self._ticket)
        if tf is not None:
            await tf.wait_submitted()
        return self._tokens

    def order_before(self, stream: Any = None) -> None:
        """Make work enqueued on ``stream`` (default: the offloader's compute stream, else the calling
        thread's current stream) from now on wait for this load on the device. Device backends only; call it
        after :meth:`wait_submitted`."""
        if self._off.executor.device is None:
            raise InvalidArgumentError(
                "order_before() needs a device backend (cuda or simulated); on the cpu backend await the load"
            )
        if not self._ticket.done():
            raise RequestStateError("order_before() needs the load submitted first: await wait_submitted()")
        tf = self._ticket.result()
        if tf is None:
            return  # nothing was loaded
        tf.order_before(stream if stream is not None else self._off.executor.compute_stream)


class Request:
    """Handle on one request's offloading (returned by :meth:`aiokv.Offloader.open`)."""

    __slots__ = (
        "_abort_requested",
        "_block_set",
        "_blocks",
        "_events",
        "_hashes",
        "_hit_blocks",
        "_in_flight",
        "_off",
        "_partial",
        "_pinned",
        "_pinned_slots",
        "_stored_upto",
        "_task",
        "_waiter",
        "extra_keys",
        "num_computed_tokens",
        "request_id",
        "salt",
        "state",
        "token_ids",
    )

    def __init__(
        self,
        off: Offloader,
        request_id: str,
        token_ids: list[int],
        salt: object,
        extra_keys: tuple[object, ...],
    ) -> None:
        self._off = off
        self.request_id = request_id
        self.token_ids = token_ids
        self.salt = salt
        self.extra_keys = extra_keys
        self.state = RequestState.WAITING
        self.num_computed_tokens = 0
        self._blocks: list[int] = []
        self._block_set: set[int] = set()  # membership for new_block_ids validation, O(1) per id
        self._stored_upto = 0  # leading blocks already handed to the store path
        self._hashes: list[bytes] = []
        self._events: deque[tuple[_Ev, Any, asyncio.Future[Any] | None]] = deque()
        self._waiter: asyncio.Future[None] | None = None
        self._in_flight: set[TransferFuture] = set()
        self._pinned: list[bytes] = []  # CPU entries pinned by the last lookup
        self._pinned_slots: list[int] = []
        self._hit_blocks: int | None = None  # result of the last completed lookup, until load/end
        self._partial = 0  # tokens of a partially filled last block matched by the last lookup
        self._abort_requested = False
        self._task: asyncio.Task[None] | None = None

    # ------------------------------------------------------------------ public
    @property
    def block_ids(self) -> tuple[int, ...]:
        """The request's engine block table as aiokv knows it."""
        return tuple(self._blocks)

    @property
    def done(self) -> bool:
        return self.state in (RequestState.FINISHED, RequestState.ABORTED)

    def lookup(self) -> _Completion:
        """Find the longest cached prefix of the request's known tokens; resolves to a token count.

        The count is a multiple of ``block_size`` and smaller than the number of known tokens (the last token
        is always recomputed to produce logits). Blocks held in lower tiers are staged into the CPU tier first,
        so every counted block is loadable. The matched entries stay pinned until :meth:`load`, another
        lookup, or the end of the request.
        """
        self._check_alive("lookup")
        if self.state not in (RequestState.WAITING, RequestState.PREEMPTED):
            raise RequestStateError(
                f"lookup() needs a request holding no blocks (waiting or preempted), request {self.request_id!r} is {self.state.value}"
            )
        return self._post(_Ev.LOOKUP, None)

    def load(self, block_ids: Sequence[int]) -> LoadCompletion:
        """Copy the cached prefix found by :meth:`lookup` into ``block_ids``, which become the request's first
        blocks. Resolves when the KV is in the engine blocks.

        Cancelling the awaiting task before the copy is submitted withdraws the load (nothing is copied and
        the pins are released). Once submitted a copy cannot be recalled: the blocks stay guarded until it
        completes, so the engine must still ``abort()``/``preempt()`` before reusing them.
        """
        self._check_alive("load")
        if self.state not in (RequestState.WAITING, RequestState.PREEMPTED) or self._blocks:
            raise RequestStateError(
                f"load() needs a request holding no blocks, request {self.request_id!r} is {self.state.value}"
            )
        if self._hit_blocks is None:
            raise RequestStateError("load() needs a completed lookup() first")
        ids = self._off.layout.check_block_ids(block_ids, "block_ids")
        if len(ids) > self._hit_blocks:
            raise InvalidArgumentError(
                f"block_ids must have at most {self._hit_blocks} blocks (the last lookup's hit), got {len(ids)}"
            )
        partial = self._partial if len(ids) == self._hit_blocks else 0
        # The copy must not write the blocks before the kernels already queued on the compute stream (their
        # previous owner's) are done: take that point now, before anything changes (it may be refused).
        mark = self._off._mark() if ids else None
        self._hit_blocks = None
        # The block table and counters change now, synchronously, so that step() right after is validated
        # against them; the copy itself is submitted by the task in order.
        self._blocks = list(ids)
        self._block_set = set(ids)
        bs = self._off.block_size
        if partial:  # the last block is only partially filled: it is not a stored full block yet
            self.num_computed_tokens = (len(ids) - 1) * bs + partial
            self._stored_upto = len(ids) - 1
        else:
            self.num_computed_tokens = len(ids) * bs
            self._stored_upto = len(ids)
        self.state = RequestState.LOADING if ids else self.state
        fut: asyncio.Future[Any] = self._off.loop.create_future()
        ticket: asyncio.Future[TransferFuture | None] = self._off.loop.create_future()
        self._post_nowait(_Ev.LOAD, (ids, mark, ticket), fut)
        return LoadCompletion(fut, ticket, self.num_computed_tokens, self._off)

    def step(
        self,
        num_computed_tokens: int,
        new_token_ids: Sequence[int] = (),
        new_block_ids: Sequence[int] = (),
    ) -> None:
        """Report an engine step: ``new_block_ids`` are appended to the block table, ``new_token_ids`` to the
        known tokens, and ``num_computed_tokens`` (absolute) tokens now have their KV written.

        Synchronous and O(1) amortized: it never blocks or awaits. Every block whose tokens are all known and
        computed is queued for storing, in one batch per step.
        """
        state = self.state
        if state in _ENDED or self._abort_requested:
            raise RequestStateError(
                f"step() after the request ended: request {self.request_id!r} is {state.value}"
            )
        if isinstance(num_computed_tokens, bool) or not isinstance(num_computed_tokens, int):
            raise InvalidTypeError(
                f"num_computed_tokens must be an int, got {type(num_computed_tokens).__name__}"
            )
        off = self._off
        blocks = self._blocks
        # Validate everything before changing anything: a rejected step leaves the request as it was.
        ids: list[int] = []
        if len(new_block_ids):
            ids = off.layout.check_block_ids(new_block_ids, "new_block_ids")
            held = self._block_set
            for b in ids:
                if b in held:
                    raise InvalidArgumentError(
                        f"new_block_ids must not repeat a block the request holds, got {b}"
                    )
        toks = check_token_ids(new_token_ids, "new_token_ids") if len(new_token_ids) else _EMPTY
        n = num_computed_tokens
        if n < self.num_computed_tokens:
            raise InvalidArgumentError(
                f"num_computed_tokens must not decrease, got {n} after {self.num_computed_tokens}"
            )
        known = len(self.token_ids) + len(toks)
        if n > known:
            raise InvalidArgumentError(f"num_computed_tokens must be <= known tokens ({known}), got {n}")
        bs = off.block_size
        nblocks = len(blocks) + len(ids)
        if n > nblocks * bs:
            raise InvalidArgumentError(
                f"num_computed_tokens must fit in the request's {nblocks} blocks of {bs} tokens, got {n}"
            )
        full = n // bs
        # The KV of this step may still be queued on the compute stream: the store waits for this point.
        mark = self._off._mark() if full > self._stored_upto else None
        if ids:
            blocks.extend(ids)
            self._block_set.update(ids)
        if toks:
            self.token_ids.extend(toks)
        if self._hit_blocks is not None:
            # Stepping without load(): the lookup's pins are no longer needed (a LOAD of nothing releases them).
            self._hit_blocks = None
            self._post_nowait(_Ev.LOAD, (_EMPTY, None, None))
        self.num_computed_tokens = n
        if state is not RequestState.LOADING:
            self.state = RequestState.RUNNING
        if full > self._stored_upto:
            start = self._stored_upto
            self._stored_upto = full
            # The block list is only ever appended to (preempt/load replace it), so positions < full are stable.
            self._post_nowait(_Ev.STORE, (start, full, blocks, mark))

    def wait_processed(self) -> _Completion:
        """Resolve once the request's task has processed every event posted before this call (stores of
        earlier steps are then submitted, though not necessarily complete). For tests and diagnostics."""
        self._check_alive("wait_processed")
        return self._post(_Ev.BARRIER, None)

    def finish(self) -> _Completion:
        """End the request. Every full, computed block is stored (including the one completed by the last
        step); resolves once every engine block of this request may be reused."""
        self._check_alive("finish")
        tail = self._partial_tail()
        self.state = RequestState.FINISHING
        return self._post(_Ev.FINISH, tail)

    def preempt(self) -> _Completion:
        """Give up the request's blocks but keep it open. Resolves once they may be reused; afterwards
        :meth:`lookup` / :meth:`load` / :meth:`step` rebuild the block table as for a new request."""
        self._check_alive("preempt")
        tail = self._partial_tail()
        self._blocks = []
        self._block_set = set()
        self.num_computed_tokens = 0
        self._stored_upto = 0
        self._hit_blocks = None
        self.state = RequestState.PREEMPTED
        return self._post(_Ev.PREEMPT, tail)

    def abort(self) -> _Completion:
        """Cancel the request: stores not yet submitted are dropped, copies in flight (loads included) are
        waited for. Resolves once every engine block may be reused. Idempotent."""
        if self._abort_requested or self.state in _ENDED:
            # Already ending: resolve when the request task is done (its copies are then complete).
            fut = self._off.loop.create_future()
            if self._task is not None and not self._task.done():
                self._task.add_done_callback(lambda _t: resolve(fut, None))
            else:
                fut.set_result(None)
            return _Completion(fut)
        self._abort_requested = True
        return self._post(_Ev.ABORT, None)

    def __repr__(self) -> str:
        return (
            f"<Request {self.request_id!r} {self.state.name} tokens={len(self.token_ids)} "
            f"computed={self.num_computed_tokens} blocks={len(self._blocks)} in_flight={len(self._in_flight)}>"
        )

    # ---------------------------------------------------------------- internals
    def _partial_tail(self) -> tuple[int, int, int, Any] | None:
        """(block index, engine block, tokens) of a partially computed last block, when configured to store it."""
        if not self._off.store_partial_last_block:
            return None
        bs = self._off.block_size
        full, k = divmod(self.num_computed_tokens, bs)
        if k == 0 or full >= len(self._blocks):
            return None
        return full, self._blocks[full], k, self._off._mark()

    def _check_alive(self, what: str) -> None:
        if self.state in _ENDED or self._abort_requested:
            raise RequestStateError(
                f"{what}() after the request ended: request {self.request_id!r} is "
                f"{'aborting' if self._abort_requested and self.state not in _ENDED else self.state.value}"
            )

    def _post(self, kind: _Ev, payload: Any) -> _Completion:
        fut: asyncio.Future[Any] = self._off.loop.create_future()
        self._post_nowait(kind, payload, fut)
        return _Completion(fut)

    def _post_nowait(self, kind: _Ev, payload: Any, fut: asyncio.Future[Any] | None = None) -> None:
        self._events.append((kind, payload, fut))
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _start(self) -> None:
        self._task = self._off.loop.create_task(self._run(), name=f"aiokv-request-{self.request_id}")

    def _chain(self, n_blocks: int) -> list[bytes]:
        """The request's block hashes, computed (incrementally) at least up to block ``n_blocks``. Returns the
        request's own list: callers index it and must not modify it."""
        hashes = self._hashes
        have = len(hashes)
        if n_blocks > have:
            bs = self._off.block_size
            hashes.extend(
                block_hashes(
                    self.token_ids[have * bs : n_blocks * bs],
                    bs,
                    salt=self.salt,
                    extra_keys=self.extra_keys,
                    root=self._off.layout.root,
                    parent=hashes[-1] if hashes else None,
                )
            )
        return hashes

    async def _run(self) -> None:
        off = self._off
        events = self._events
        loop = off.loop
        try:
            while True:
                while not events:
                    self._waiter = loop.create_future()
                    await self._waiter
                    self._waiter = None
                kind, payload, fut = events.popleft()
                if kind is _Ev.STORE:
                    if not self._abort_requested:
                        self._guarded(self._do_store, *payload)
                    continue
                if fut is not None and fut.cancelled() and kind in (_Ev.LOOKUP, _Ev.LOAD):
                    # Withdrawn before it ran: leave no trace (pins of a withdrawn load are released).
                    if kind is _Ev.LOAD:
                        ticket = payload[2]
                        if ticket is not None and not ticket.done():
                            ticket.set_result(None)
                        self._unpin()
                        self._blocks = []
                        self._block_set = set()
                        self.num_computed_tokens = 0
                        self._stored_upto = 0
                        if self.state is RequestState.LOADING:
                            self.state = RequestState.WAITING
                    continue
                if kind is _Ev.BARRIER:
                    if fut is not None and not fut.done():
                        fut.set_result(None)
                    continue
                try:
                    if kind is _Ev.LOOKUP:
                        result: Any = await self._do_lookup()
                    elif kind is _Ev.LOAD:
                        result = await self._do_load(payload)
                    else:
                        if payload is not None and not self._abort_requested:
                            self._guarded(self._do_store_partial, *payload)
                        await self._drain()  # always: this is what makes the blocks reusable
                        self._unpin()
                        result = None
                        if kind is not _Ev.PREEMPT:
                            self.state = RequestState.FINISHED if kind is _Ev.FINISH else RequestState.ABORTED
                except BaseException as exc:
                    if fut is not None and not fut.done():
                        fut.set_exception(exc)
                    if isinstance(exc, (asyncio.CancelledError, KeyboardInterrupt, SystemExit)):
                        raise
                    continue
                if fut is not None and not fut.done():
                    fut.set_result(result)
                if self.state in (RequestState.FINISHED, RequestState.ABORTED):
                    return
        finally:
            self._waiter = None
            while events:  # only reachable if the task itself was cancelled (offloader shutdown)
                kind, payload, fut = events.popleft()
                if kind is _Ev.LOAD and payload[2] is not None and not payload[2].done():
                    payload[2].set_exception(RequestStateError(f"request {self.request_id!r} ended"))
                    payload[2].exception()
                if fut is not None and not fut.done():
                    if kind is _Ev.ABORT:
                        fut.set_result(None)
                    else:
                        fut.set_exception(RequestStateError(f"request {self.request_id!r} ended"))
            off._request_ended(self)

    def _guarded(self, store: Any, *args: Any) -> None:
        """Run a store submission; a failure to submit (a bug, a closed executor) drops the store, is counted
        and reported, and never stops the request's task (which must go on to drain and resolve)."""
        try:
            store(*args)
        except Exception as exc:
            self._off._counters.store_errors += 1
            self._off.loop.call_exception_handler(
                {"message": f"aiokv: store for request {self.request_id!r} failed", "exception": exc}
            )

    def _track(self, tf: TransferFuture) -> None:
        in_flight = self._in_flight
        if len(in_flight) >= 16:  # prune completed copies now and then (no per-copy callback needed)
            self._in_flight = in_flight = {t for t in in_flight if not t.done()}
        in_flight.add(tf)

    async def _drain(self) -> None:
        """Wait for every copy touching this request's blocks (failed ones included)."""
        for tf in list(self._in_flight):
            if not tf.done():
                with contextlib.suppress(TransferError):
                    await tf
        self._in_flight.clear()

    def _unpin(self) -> None:
        if self._pinned:
            self._off._unpin(self._pinned)
            self._pinned = []
            self._pinned_slots = []

    def _do_store(self, start: int, end: int, blocks: list[int], mark: Any) -> None:
        tf = self._off._store_blocks(self._chain(end), start, end, blocks, mark)
        if tf is not None:
            self._track(tf)

    def _parent(self, index: int) -> bytes:
        if index == 0:
            return chain_seed(salt=self.salt, extra_keys=self.extra_keys, root=self._off.layout.root)
        return self._chain(index)[index - 1]

    def _do_store_partial(self, index: int, block_id: int, k: int, mark: Any) -> None:
        bs = self._off.block_size
        key = partial_block_hash(self._parent(index), self.token_ids[index * bs : index * bs + k])
        tf = self._off._store_one(key, self._parent(index), index, block_id, mark)
        if tf is not None:
            self._track(tf)

    async def _do_lookup(self) -> int:
        self._unpin()
        off = self._off
        bs = off.block_size
        max_blocks = max(0, (len(self.token_ids) - 1) // bs)
        keys = self._chain(max_blocks)[:max_blocks]
        self._pinned, self._pinned_slots = await off._lookup_and_pin(keys)
        hit = len(self._pinned)
        self._partial = 0
        if off.store_partial_last_block:
            # Longest partially filled block continuing the full hit (CPU tier only).
            start = hit * bs
            parent = self._parent(hit)
            for k in range(min(bs - 1, len(self.token_ids) - 1 - start), 0, -1):
                key = partial_block_hash(parent, self.token_ids[start : start + k])
                slots = off._index.pin_prefix([key])
                if slots:
                    self._pinned.append(key)
                    self._pinned_slots.append(slots[0])
                    self._partial = k
                    break
        self._hit_blocks = hit + (1 if self._partial else 0)
        return hit * bs + self._partial

    async def _do_load(
        self, payload: tuple[list[int], Any, asyncio.Future[TransferFuture | None] | None]
    ) -> int:
        block_ids, mark, ticket = payload
        n = len(block_ids)
        if n == 0:
            self._unpin()
            if ticket is not None and not ticket.done():
                ticket.set_result(None)
            return 0
        keys, slots = self._pinned[:n], self._pinned_slots[:n]
        extra = self._pinned[n:]
        self._pinned = []
        self._pinned_slots = []
        if extra:
            self._off._unpin(extra)
        # The loaded entries stay pinned until the copy reading their slots completes (done callback).
        try:
            tf = self._off._load_blocks(keys, slots, block_ids, mark)
        except BaseException as exc:
            if ticket is not None and not ticket.done():
                ticket.set_exception(exc)
                ticket.exception()  # the load's own awaitable reports it; this one may never be awaited
            raise
        if ticket is not None and not ticket.done():
            ticket.set_result(tf)
        self._track(tf)
        with contextlib.suppress(TransferError):
            await tf
        if self.state is RequestState.LOADING:
            self.state = RequestState.RUNNING
        if tf.exception() is not None:
            # The engine blocks hold garbage: nothing of them counts as computed any more.
            self.num_computed_tokens = 0
            self._stored_upto = 0
            tf.result()
        return n * self._off.block_size


RequestHandle = Request
"""Alias: the issue's contract calls the object returned by ``Offloader.open`` a request handle."""
