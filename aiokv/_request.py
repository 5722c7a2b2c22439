"""The per-request state machine.

Each request is a coroutine (one asyncio task) that consumes the request's events in order: block-full stores
(from :meth:`Request.step`), lookup, load, finish, preempt and abort. The public methods validate their
arguments synchronously, update the request's bookkeeping (token list, block table) and enqueue an event;
the awaitable ones resolve when the task has processed that event *and every earlier one*.

The guarantee engines rely on: ``finish()``, ``preempt()`` and ``abort()`` resolve only after every copy that
reads or writes this request's engine blocks has completed. Copies are represented by
:class:`~aiokv.TransferFuture` objects that exist only once the copy is on its stream, and the task awaits all
of them, so an engine that returns blocks to its free pool when these calls resolve cannot reuse a block
under a copy. That holds even when the request's task is cancelled (an application shutting down): whatever
was queued then resolves once the copies in flight are done.

A failed copy or lower-tier read is a miss, never data: ``load()`` resolves to the tokens it really restored
(0 when its copy failed), and KV computed over a failed load is never stored.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import os
import threading
import warnings
from collections import deque
from collections.abc import Callable, Generator, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, overload

from ._errors import ClosedError, InvalidArgumentError, InvalidTypeError, RequestStateError, TransferError
from ._hashing import (
    _I64_MAX,
    _I64_MIN,
    _chain_in_place,
    chain_hashes_from,
    chain_seed,
    check_token_ids,
    partial_block_hash,
)
from .transfer._future import LayeredTransfer, TransferFuture, resolve

if TYPE_CHECKING:
    from ._host import RequestHost

__all__ = ["LoadCompletion", "Request", "RequestHandle", "RequestState"]

_get_ident = threading.get_ident


class RequestState(enum.Enum):
    WAITING = "waiting"  # opened (or resumed after preemption), holds no blocks yet
    LOADING = "loading"  # a load into its first blocks is in flight
    RUNNING = "running"  # holds blocks; steps store full blocks
    PREEMPTED = "preempted"  # holds no blocks; may lookup/load again
    FINISHING = "finishing"  # finish() called; draining stores
    FINISHED = "finished"
    ABORTED = "aborted"


class TokenView(Sequence[int]):
    """A read-only view of a request's token list (``Request.token_ids``): indexing, slicing (a new list),
    ``len``, iteration and comparison with lists and tuples; no way to change the request's tokens."""

    __slots__ = ("_tokens",)

    def __init__(self, tokens: list[int]) -> None:
        self._tokens = tokens

    def __len__(self) -> int:
        return len(self._tokens)

    @overload
    def __getitem__(self, index: int) -> int: ...

    @overload
    def __getitem__(self, index: slice) -> list[int]: ...

    def __getitem__(self, index: int | slice) -> int | list[int]:
        return self._tokens[index]

    def __iter__(self) -> Iterator[int]:
        return iter(self._tokens)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, TokenView):
            return self._tokens == other._tokens
        if isinstance(other, list):
            return self._tokens == other
        if isinstance(other, tuple):
            return tuple(self._tokens) == other
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"TokenView({self._tokens!r})"


_EMPTY: list[int] = []
_NO_CAP = 1 << 62  # tokens: no per-request store or load cap
_ENDED = (RequestState.FINISHING, RequestState.FINISHED, RequestState.ABORTED)
_ADMITTING = (RequestState.WAITING, RequestState.PREEMPTED)
_RUNNING = RequestState.RUNNING  # module constants: read on every step


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


class _ReleaseCompletion(_Completion):
    """What ``finish()``, ``preempt()`` and ``abort()`` return. The engine may reuse the request's blocks only
    once it resolves, so one that is garbage-collected without ever having been awaited warns
    (``RuntimeWarning``), like a coroutine that was never awaited."""

    __slots__ = ("_awaited", "_what")

    def __init__(self, fut: asyncio.Future[Any], what: str) -> None:
        super().__init__(fut)
        self._what = what
        self._awaited = False

    def __await__(self) -> Generator[Any, None, Any]:
        self._awaited = True
        return self._fut.__await__()

    def __del__(self) -> None:
        if not self._awaited:
            warnings.warn(
                f"{self._what} was never awaited: the request's blocks may be reused only once it resolves",
                RuntimeWarning,
                stacklevel=1,
            )


class LoadCompletion(_Completion):
    """What :meth:`Request.load` returns. Awaiting it resolves, on the host, once the KV is in the engine
    blocks, to the number of tokens restored: the last lookup's count when every block it found is loaded,
    fewer when fewer blocks are passed, 0 when the copy failed (a failed copy is a miss, counted in
    ``stats().load_errors`` and logged, never an exception).

    On a device backend an engine need not wait for the host: ``await wait_submitted()`` resolves as soon as
    the copy is queued on aiokv's load stream, and ``order_before(stream)`` then makes work enqueued on the
    engine's compute stream wait for the copy on the device::

        pending = req.load(blocks)
        restored = await pending.wait_submitted()   # tokens the load restores if its copy succeeds
        pending.order_before()                      # the forward enqueued next waits for it on the GPU
        launch_forward(...)

    The host-side ``await`` is the truth: if the copy fails on the device after ``wait_submitted()``, awaiting
    the load resolves to 0, and nothing the request computes over those blocks is stored (until it is
    preempted); the engine should then discard what it computed (preempt the request).
    """

    __slots__ = ("_layerwise", "_off", "_ticket", "_tokens")

    def __init__(
        self,
        fut: asyncio.Future[Any],
        ticket: asyncio.Future[TransferFuture | LayeredTransfer | None],
        tokens: int,
        off: RequestHost,
        layerwise: bool = False,
    ) -> None:
        super().__init__(fut)
        self._ticket = ticket
        self._tokens = tokens
        self._off = off
        self._layerwise = layerwise

    async def wait_submitted(self, layer: int | None = None) -> int:
        """Resolve once the load's copy is on its stream; return the tokens it restores when it completes (0
        when nothing was submitted, or the copy already failed).

        ``layer``: only that layer's copy (a layer-wise load: it is queued before the later layers', so an
        engine can order layer ``i``'s attention after it, with :meth:`order_layer_before`, while the rest is
        still being submitted). On a load that is not layer-wise it waits for the whole copy.

        Cancelling this wait does not withdraw the load."""
        if layer is not None:
            self._check_layer(layer)
        tf = await asyncio.shield(self._ticket)
        if tf is None:
            return 0
        part = tf.layers[layer] if layer is not None and isinstance(tf, LayeredTransfer) else tf
        await part.wait_submitted()
        if part.done() and part.exception() is not None:
            return 0
        return self._tokens

    @property
    def layerwise(self) -> bool:
        """Whether the load was submitted layer by layer (``load(..., layerwise=True)``)."""
        return self._layerwise

    async def layer(self, index: int) -> int:
        """Resolve once layer ``index`` (of :attr:`KVLayout.layers`, the order of the engine's forward) of
        the restored blocks is in the engine blocks, on the host: to the tokens the load restores, or 0 when
        the load failed or restored nothing (then recompute; the whole load resolves to 0 as well).

        A layer-wise load (``layerwise=True``) resolves layer ``i`` as soon as its own copy is done, while
        the later layers are still being copied; any other load resolves every layer when the whole copy is
        done. Cancelling this wait does not withdraw the load."""
        self._check_layer(index)
        tf = await asyncio.shield(self._ticket)
        if tf is None:
            return int(await asyncio.shield(self._fut))
        part = tf.layers[index] if isinstance(tf, LayeredTransfer) else tf
        with contextlib.suppress(TransferError):
            await part
        if part.exception() is not None:
            return 0
        return self._tokens

    def order_layer_before(self, index: int, stream: Any = None) -> None:
        """Make work enqueued on ``stream`` (default: the offloader's compute stream) from now on wait, on
        the device, for layer ``index`` of this load: call it right before enqueuing that layer's attention.
        Device backends only, once that layer is submitted (``await wait_submitted(layer=index)``, or
        ``wait_submitted()`` for every layer); before that it raises :class:`RequestStateError` (a wait on
        work not yet queued would order nothing). On a load that is not layer-wise it waits for the whole
        copy (as :meth:`order_before`)."""
        self._check_layer(index)
        tf = self._submitted_transfer("order_layer_before")
        if tf is None:
            return
        part = tf.layers[index] if isinstance(tf, LayeredTransfer) else tf
        part.order_before(stream if stream is not None else self._off.executor.compute_stream)

    def _check_layer(self, index: int) -> None:
        n = self._off.layout.num_layers
        if isinstance(index, bool) or not isinstance(index, int):
            raise InvalidTypeError(f"index must be an int, got {type(index).__name__}")
        if not 0 <= index < n:
            raise InvalidArgumentError(f"index must be in [0, {n}) (the layout's layers), got {index}")

    def _submitted_transfer(self, what: str) -> TransferFuture | LayeredTransfer | None:
        if self._off.executor.device is None:
            raise InvalidArgumentError(
                f"{what}() needs a device backend (cuda or simulated); on the cpu backend await the load"
            )
        if not self._ticket.done():
            raise RequestStateError(f"{what}() needs the load submitted first: await wait_submitted()")
        return self._ticket.result()

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


def _settle_ticket(
    ticket: asyncio.Future[TransferFuture | LayeredTransfer | None] | None,
    tf: TransferFuture | LayeredTransfer | None,
) -> None:
    if ticket is not None and not ticket.done():
        ticket.set_result(tf)


class Request:
    """Handle on one request's offloading (returned by :meth:`aiokv.Offloader.open`).

    Every method must be called on the thread running the offloader's event loop (else
    :class:`~aiokv.WrongThreadError`)."""

    __slots__ = (
        "_abort_requested",
        "_block_set",
        "_blocks",
        "_bs",
        "_epoch",
        "_events",
        "_failed_epoch",
        "_grouped",
        "_hashes",
        "_hit_blocks",
        "_in_flight",
        "_load_cap",
        "_load_ticket",
        "_nblk",
        "_off",
        "_partial",
        "_pending",
        "_pinned",
        "_pinned_plan",
        "_pinned_slots",
        "_prompt_blocks",
        "_quiet",
        "_quiet_waiters",
        "_retain_s",
        "_state",
        "_store_cap",
        "_stored_upto",
        "_task",
        "_task_ended",
        "_tenant",
        "_tid",
        "_token_ids",
        "_waiter",
        "extra_keys",
        "max_load_tokens",
        "max_store_tokens",
        "num_computed_tokens",
        "priority",
        "request_id",
        "salt",
        "store_decode",
    )

    def __init__(
        self,
        off: RequestHost,
        request_id: str,
        token_ids: list[int],
        salt: object,
        extra_keys: tuple[object, ...],
        *,
        max_store_tokens: int | None = None,
        max_load_tokens: int | None = None,
        store_decode: bool = True,
        tenant: bytes | None = None,
        retain_s: float | None = None,
        priority: int = 0,
    ) -> None:
        self._off = off
        # The owner's loop thread and layout, read by every step (here, and by the C fast path in
        # aiokv/_native/_step.c): fixed once the offloader runs, which open() requires.
        self._tid = off.thread
        self._bs = off.block_size
        self._nblk = off.num_blocks
        # A grouped layout (KVLayout.from_groups): block ids are rows (one id per group), stores and lookups
        # go through the offloader's unit paths, and the step fast path (one id per block) never applies.
        self._grouped = off.grouped is not None
        if self._grouped:
            self._nblk = -1  # no id passes the fast paths' range check: per-group ids go to the checked path
        self._prompt_blocks = len(token_ids) // off.block_size
        self.priority = priority  # eviction priority of the blocks it stores or stages (CPU tier)
        self._retain_s = retain_s
        self._tenant = tenant  # the CPU tier's quota key (canonical salt) when it has tenant quotas
        self.request_id = request_id
        self._token_ids = token_ids
        self.salt = salt
        self.extra_keys = extra_keys
        self.max_store_tokens = max_store_tokens
        self.max_load_tokens = max_load_tokens
        self.store_decode = store_decode
        # Per-request caps, in tokens from the start of the sequence (checked where blocks are stored and
        # looked up, never per step): only tokens [0, _store_cap) are stored, [0, _load_cap) looked up.
        store_cap = _NO_CAP if max_store_tokens is None else max_store_tokens
        if not store_decode:
            store_cap = min(store_cap, len(token_ids))
        self._store_cap = store_cap
        self._load_cap = _NO_CAP if max_load_tokens is None else max_load_tokens
        self._state = RequestState.WAITING
        self.num_computed_tokens = 0
        self._blocks: list[int] = []
        self._block_set: set[int] = set()  # membership for new_block_ids validation, O(1) per id
        self._stored_upto = 0  # leading blocks already handed to the store path
        self._hashes: list[bytes] = []
        self._events: deque[tuple[_Ev, Any, asyncio.Future[Any] | None]] = deque()
        self._waiter: asyncio.Future[None] | None = None
        self._in_flight: set[TransferFuture | LayeredTransfer] = set()
        self._pinned: list[bytes] = []  # CPU entries pinned by the last lookup
        self._pinned_slots: list[int] = []
        self._pinned_plan: list[tuple[int, int]] = []  # grouped: (block, unit) of each pinned entry
        # Grouped layouts whose groups have smaller blocks than the key block: per group, the engine blocks
        # given that do not complete a key block yet (they join the table once every group covers it).
        self._pending: list[list[int]] = [[] for _ in getattr(off.layout, "groups", ())]
        self._hit_blocks: int | None = None  # result of the last completed lookup, until load/end
        self._partial = 0  # tokens of a partially filled last block matched by the last lookup
        self._abort_requested = False
        self._task: asyncio.Task[None] | None = None
        self._task_ended = False  # _end() ran (from the task's finally, or its done callback)
        # The block table's generation: preempt(), load() and the first step after admission start a new one.
        # A lookup's result is usable only in the generation it was asked in; stores are stamped with theirs.
        self._epoch = 0
        self._failed_epoch = -1  # a generation whose KV derives from a failed load: none of it is stored
        self._load_ticket: asyncio.Future[TransferFuture | LayeredTransfer | None] | None = None
        self._quiet = False  # the task has ended and every copy it submitted is complete
        self._quiet_waiters: list[asyncio.Future[None]] = []

    # ------------------------------------------------------------------ public
    @property
    def block_ids(self) -> tuple[int, ...]:
        """The request's engine block table as aiokv knows it."""
        return tuple(self._blocks)

    @property
    def done(self) -> bool:
        return self._state in (RequestState.FINISHED, RequestState.ABORTED)

    def lookup(self) -> _Completion:
        """Find the longest cached prefix of the request's known tokens; resolves to a token count.

        The count is a multiple of ``block_size`` (unless ``store_partial_last_block``) and smaller than the
        number of known tokens (the last token is always recomputed to produce logits). The prefix may span
        tiers: blocks missing from the CPU tier are staged from lower tiers, and blocks already in the CPU tier
        after them count too, so every counted block is loadable. A block a tier fails to read (or finds
        corrupt) ends the prefix. The matched entries stay pinned until :meth:`load`, another lookup, a step
        without load, or the end of the request.
        """
        self._check_call("lookup")
        if self._state not in _ADMITTING:
            raise RequestStateError(
                f"lookup() needs a request holding no blocks (waiting or preempted), request {self.request_id!r} is {self._state.value}"
            )
        self._hit_blocks = None  # load() waits for this lookup's result
        return self._post(_Ev.LOOKUP, self._epoch)

    def load(
        self, block_ids: Sequence[int], *, present_blocks: int = 0, layerwise: bool = False
    ) -> LoadCompletion:
        """Copy the cached prefix found by :meth:`lookup` into ``block_ids``, which become the request's first
        blocks. Resolves, when the KV is in the engine blocks, to the number of tokens restored: the lookup's
        count when ``len(block_ids)`` covers every block it found (with ``store_partial_last_block`` that
        includes a partially filled last block), else ``len(block_ids) * block_size``; 0 if the copy failed
        (a miss, counted and logged; ``num_computed_tokens`` is then 0 again). Compute the rest of the prompt
        from that number, never from the lookup's: a step claiming more before the load resolved is refused.

        ``present_blocks``: the first ``present_blocks`` of ``block_ids`` already hold this prefix's KV (an
        engine's own prefix cache, e.g. vLLM's): they join the block table but are not written (an engine may
        share them with other requests), and only ``block_ids[present_blocks:]`` are copied. The result counts
        the present blocks too; when the copy fails it is 0 all the same (the engine recomputes from the first
        copied block, or from 0).

        ``layerwise``: copy layer by layer (the layout's :attr:`~aiokv.KVLayout.layers`, in order), each
        layer completing on its own, so the engine's forward can compute layer ``i`` while the later layers are
        still being copied: ``await pending.layer(i)`` on the host, or ``pending.order_layer_before(i)`` on a
        device, before layer ``i``'s attention. The whole load resolves as usual; a layer that fails fails the
        whole load (it resolves to 0: recompute, never partial KV). Plain layouts only (not
        :meth:`KVLayout.from_groups`).

        Raises only for misuse (bad ``block_ids``, wrong state, a closed offloader). Cancelling the awaiting
        task before the copy is submitted withdraws the load (nothing is copied and the pins are released).
        Once submitted a copy cannot be recalled: the blocks stay guarded until it completes, so the engine
        must still ``abort()``/``preempt()`` before reusing them.
        """
        self._check_call("load")
        if self._state not in _ADMITTING or self._blocks:
            raise RequestStateError(
                f"load() needs a request holding no blocks, request {self.request_id!r} is {self._state.value}"
            )
        if self._hit_blocks is None:
            raise RequestStateError("load() needs a completed lookup() first")
        if not isinstance(layerwise, bool):
            raise InvalidTypeError(f"layerwise must be a bool, got {type(layerwise).__name__}")
        if layerwise and self._grouped:
            raise InvalidArgumentError(
                "layerwise=True needs a plain KVLayout: a layout from KVLayout.from_groups is loaded whole"
            )
        ids = self._off.layout.check_block_ids(block_ids, "block_ids")
        if (
            self._grouped
            and 0 < len(ids) < self._hit_blocks
            and (self._off.grouped.windows or self._off.grouped.state_parts)
        ):
            raise InvalidArgumentError(
                f"block_ids must cover the whole hit ({self._hit_blocks} blocks) or nothing for a layout with "
                f"sliding-window or state groups (what a shorter prefix needs was not looked up), got {len(ids)}"
            )
        if len(ids) > self._hit_blocks:
            raise InvalidArgumentError(
                f"block_ids must have at most {self._hit_blocks} blocks (the last lookup's hit), got {len(ids)}"
            )
        if isinstance(present_blocks, bool) or not isinstance(present_blocks, int):
            raise InvalidTypeError(f"present_blocks must be an int, got {type(present_blocks).__name__}")
        if not 0 <= present_blocks <= len(ids):
            raise InvalidArgumentError(
                f"present_blocks must be in [0, {len(ids)}] (the blocks passed), got {present_blocks}"
            )
        partial = self._partial if len(ids) == self._hit_blocks else 0
        # The copy must not write the blocks before the kernels already queued on the compute stream (their
        # previous owner's) are done: take that point now, before anything changes (it may be refused).
        mark = self._off.mark() if ids else None
        self._hit_blocks = None
        self._epoch += 1
        # The block table and counters change now, synchronously, so that step() right after is validated
        # against them; the copy itself is submitted by the task in order.
        self._blocks = list(ids)
        self._block_set = self._off.layout.held(ids) if self._grouped else set(ids)  # type: ignore[attr-defined]
        self._pending = [[] for _ in self._pending]
        bs = self._off.block_size
        if partial:  # the last block is only partially filled: it is not a stored full block yet
            self.num_computed_tokens = (len(ids) - 1) * bs + partial
            self._stored_upto = len(ids) - 1
        else:
            self.num_computed_tokens = len(ids) * bs
            self._stored_upto = len(ids)
        self._state = RequestState.LOADING if ids else self._state
        fut: asyncio.Future[Any] = self._off.loop.create_future()
        ticket: asyncio.Future[TransferFuture | LayeredTransfer | None] = self._off.loop.create_future()
        self._load_ticket = ticket
        restored = self.num_computed_tokens
        self._post_nowait(
            _Ev.LOAD, (ids, mark, ticket, restored, self._epoch, present_blocks, layerwise), fut
        )
        return LoadCompletion(fut, ticket, restored, self._off, layerwise)

    def step(
        self,
        num_computed_tokens: int,
        new_token_ids: Sequence[int] = (),
        new_block_ids: Sequence[int] = (),
    ) -> None:
        """Report an engine step: ``new_block_ids`` are appended to the block table, ``new_token_ids`` to the
        known tokens, and ``num_computed_tokens`` (absolute) tokens now have their KV written.

        Synchronous and O(1) amortized: it never blocks or awaits. Every block whose tokens are all known and
        computed is queued for storing, in one batch per step. While a load is in flight, no more than the
        tokens it restores can be computed: a step claiming more is refused until the load resolved (on a
        device: until ``wait_submitted()`` returned, after which ``order_before()`` orders the forward).
        """
        # The hot path of every engine step: a running request fed plain ``int`` lists or tuples that pass
        # every check is updated inline; anything else (numpy, tensors, int-likes, other states, any doubt)
        # goes to _apply_step_general, which decides it the usual way and raises the usual errors.
        if _get_ident() != self._tid:
            raise self._off.wrong_thread("step")
        n, toks, ids = num_computed_tokens, new_token_ids, new_block_ids
        tk, ik = type(toks), type(ids)
        if (
            self._state is not _RUNNING
            or self._abort_requested
            or self._hit_blocks is not None
            or type(n) is not int
            or n < self.num_computed_tokens
            or (tk is not list and tk is not tuple)
            or (ik is not list and ik is not tuple)
        ):
            return self._apply_step_general(n, toks, ids)
        nt = len(toks)
        if nt == 1:  # a decode step; the literals are the int64 range
            t = toks[0]
            if type(t) is not int or t < -0x8000000000000000 or t > 0x7FFFFFFFFFFFFFFF:
                return self._apply_step_general(n, toks, ids)
        elif nt and not all(type(t) is int and _I64_MIN <= t <= _I64_MAX for t in toks):
            return self._apply_step_general(n, toks, ids)
        bs = self._bs
        token_ids = self._token_ids
        blocks = self._blocks
        if ids:
            held = self._block_set
            num_blocks = self._nblk
            if (
                not all(type(b) is int and 0 <= b < num_blocks and b not in held for b in ids)
                or (len(ids) > 1 and len(set(ids)) != len(ids))
                or n > len(token_ids) + nt
                or n > (len(blocks) + len(ids)) * bs
            ):
                return self._apply_step_general(n, toks, ids)
            blocks.extend(ids)
            held.update(ids)
        elif n > len(token_ids) + nt or n > len(blocks) * bs:
            return self._apply_step_general(n, toks, ids)
        if nt:
            token_ids.extend(toks)
        self.num_computed_tokens = n
        full = n // bs
        upto = self._stored_upto
        if full > upto:
            self._stored_upto = full
            self._step_store(upto, full)
        return None

    def drop_blocks(self, block_ids: Sequence[Sequence[int]]) -> _Completion:
        """Grouped layouts: the engine takes these blocks back while the request runs (vLLM frees a
        sliding-window group's blocks once they leave the window). ``block_ids`` has one sequence per group
        (empty for the others; a full or latent group's blocks cannot be dropped). aiokv never reads them
        again: their positions become :data:`aiokv.NO_BLOCK`, and a store not yet submitted skips them.
        Resolves once every copy this request has in flight is complete (after that, nothing aiokv submitted
        can still be reading them); an engine that may reuse them sooner must wait for it first."""
        self._check_call("drop_blocks")
        off = self._off
        if not self._grouped:
            raise InvalidArgumentError(
                "drop_blocks() needs a grouped layout (KVLayout.from_groups): a one-group request holds every "
                "block until it ends"
            )
        lay = off.layout
        groups = lay.groups  # type: ignore[attr-defined]
        if isinstance(block_ids, (str, bytes)) or len(block_ids) != len(groups):
            raise InvalidArgumentError(
                f"block_ids must have one sequence of block ids per group ({len(groups)}), got "
                f"{len(block_ids) if isinstance(block_ids, Sequence) else type(block_ids).__name__}"
            )
        mem = lay.memory_class  # type: ignore[attr-defined]
        rows: list[Any] = self._blocks  # grouped: one tuple of ids (each group's for the key block) per block
        owner = lay.column_group  # type: ignore[attr-defined]
        where: dict[tuple[int, int], tuple[int, int]] = {}
        for i, row in enumerate(rows):
            for c, b in enumerate(row):
                if b >= 0:
                    where[(owner[c], b)] = (i, c)
        drops: list[tuple[int, int]] = []
        for g, ids in enumerate(block_ids):
            for raw in ids:
                b = int(raw) if type(raw) is int else check_token_ids([raw], f"block_ids[{g}]")[0]
                if groups[g].kind.value in ("full", "latent"):
                    raise InvalidArgumentError(
                        f"block_ids[{g}] ({groups[g].name}) must be empty: a {groups[g].kind.value} group keeps "
                        "every block until the request ends"
                    )
                if (g, b) not in where:
                    raise InvalidArgumentError(
                        f"block_ids[{g}] ({groups[g].name}) must name blocks the request holds, got {b}"
                    )
                drops.append((g, b))
        for g, b in drops:
            i, c = where[(g, b)]
            cells = list(rows[i])
            cells[c] = -1
            rows[i] = tuple(cells)
            self._block_set.discard((mem[g], b))
        fut: asyncio.Future[Any] = off.loop.create_future()
        pending = [tf for tf in self._in_flight if not tf.done()]
        if not pending:
            fut.set_result(None)
        else:
            left = [len(pending)]

            def one_done(_tf: Any) -> None:
                left[0] -= 1
                if left[0] == 0:
                    resolve(fut, None)

            for tf in pending:
                tf.add_done_callback(one_done)
        return _Completion(fut)

    def append_tokens(self, token_ids: Sequence[int]) -> None:
        """Append known tokens without reporting a step: ``num_computed_tokens`` and the block table stay as
        they are. For an engine whose scheduler learns sampled tokens after it reported the step that computed
        them (vLLM's asynchronous scheduling), or that learns a preempted request's last tokens late: the blocks
        they complete are stored by the next :meth:`step` that covers them, and a :meth:`lookup` after a
        preemption considers them. Allowed in every state until the request ends."""
        self._check_call("append_tokens")
        toks = check_token_ids(token_ids, "token_ids") if len(token_ids) else _EMPTY
        if toks:
            self._token_ids.extend(toks)

    def _step_store(self, upto: int, full: int) -> None:
        """A step completed blocks ``upto..full-1`` (``_stored_upto`` is already ``full``): queue their store.

        On the CPU backend the store joins the tick's deferred stores, which the executor's flush submits as
        one copy at the end of the tick (Offloader._flush_deferred); any event posted to this request first
        submits them, so the order is that of an immediate submission."""
        off = self._off
        if off.device is not None:
            # The KV of this step may still be queued on the compute stream: the store waits for this point.
            self._queue_store((upto, full, self._blocks, off.mark(), self._epoch))
            return
        deferred = off.deferred
        if not deferred:
            off.executor.schedule_flush()
        deferred.append((self, upto, full, self._blocks, self._epoch))

    def _apply_step_general(self, num_computed_tokens: Any, new_token_ids: Any, new_block_ids: Any) -> None:
        """Every step the fast path did not take: validates everything before changing anything (a rejected
        step leaves the request as it was), then applies it."""
        off = self._off
        state = self._state
        if self._abort_requested or state in _ENDED:
            raise RequestStateError(
                f"step() after the request ended: request {self.request_id!r} is {state.value}"
            )
        n = num_computed_tokens
        if type(n) is not int:
            if isinstance(n, bool) or not isinstance(n, int):
                raise InvalidTypeError(f"num_computed_tokens must be an int, got {type(n).__name__}")
            n = int(n)
        blocks = self._blocks
        ids: list[int] = _EMPTY
        pending = self._pending
        if self._grouped:
            if len(new_block_ids):
                pending = [list(p) for p in pending]  # applied below, once the whole step is valid
                ids = off.layout.take_rows(new_block_ids, "new_block_ids", self._block_set, pending)  # type: ignore[attr-defined]
        elif len(new_block_ids):
            ids = off.layout.check_block_ids(new_block_ids, "new_block_ids")
            held = self._block_set
            for b in ids:
                if b in held:
                    raise InvalidArgumentError(
                        f"new_block_ids must not repeat a block the request holds, got {b}"
                    )
        toks = check_token_ids(new_token_ids, "new_token_ids") if len(new_token_ids) else _EMPTY
        computed = self.num_computed_tokens
        if n < computed:
            raise InvalidArgumentError(f"num_computed_tokens must not decrease, got {n} after {computed}")
        token_ids = self._token_ids
        known = len(token_ids) + len(toks)
        if n > known:
            raise InvalidArgumentError(f"num_computed_tokens must be <= known tokens ({known}), got {n}")
        bs = off.block_size
        nblocks = len(blocks) + len(ids)
        if self._grouped and any(pending):
            room = off.layout.pending_tokens(nblocks, pending)  # type: ignore[attr-defined]
            if n > room:
                raise InvalidArgumentError(
                    f"num_computed_tokens must fit in the request's blocks ({room} tokens in every group), got {n}"
                )
        elif n > nblocks * bs:
            raise InvalidArgumentError(
                f"num_computed_tokens must fit in the request's {nblocks} blocks of {bs} tokens, got {n}"
            )
        if state is RequestState.LOADING and n > computed:
            self._check_load_usable(n)
        full = n // bs
        stored_upto = self._stored_upto
        # The KV of this step may still be queued on the compute stream: the store waits for this point.
        mark = off.mark() if full > stored_upto and off.device is not None else None
        self._pending = pending
        if ids:
            blocks.extend(ids)
            self._block_set.update(off.layout.held(ids) if self._grouped else ids)  # type: ignore[attr-defined]
        if toks:
            token_ids.extend(toks)
        if self._hit_blocks is not None:
            # Stepping without load(): the lookup's pins are no longer needed (a LOAD of nothing releases them).
            self._hit_blocks = None
            self._post_nowait(_Ev.LOAD, (_EMPTY, None, None, 0, self._epoch))
        self.num_computed_tokens = n
        if state is not RequestState.RUNNING and state is not RequestState.LOADING:
            self._state = RequestState.RUNNING
            self._epoch += 1  # admission is over: a lookup still in flight no longer applies
        if full > stored_upto:
            self._stored_upto = full
            # The block list is only ever appended to (preempt/load replace it), so positions < full are stable.
            self._queue_store((stored_upto, full, blocks, mark, self._epoch))

    def _queue_store(self, payload: tuple[int, int, list[int], Any, int]) -> None:
        waiter = self._waiter
        if self._events or waiter is None or waiter.done():
            self._post_nowait(_Ev.STORE, payload)
        else:
            # The task is parked with nothing queued: it would run this store first thing when it wakes.
            # Submitting it here is the same order without a task wake-up per stored block.
            self._store(payload)

    def wait_processed(self) -> _Completion:
        """Resolve once the request's task has processed every event posted before this call (stores of
        earlier steps are then submitted, though not necessarily complete). For tests and diagnostics."""
        self._check_call("wait_processed")
        return self._post(_Ev.BARRIER, None)

    def finish(self) -> _Completion:
        """End the request. Every full, computed block is stored (including the one completed by the last
        step); resolves once every engine block of this request may be reused. Await it: one that is never
        awaited warns (``RuntimeWarning``)."""
        self._check_call("finish")
        tail = self._partial_tail()
        self._state = RequestState.FINISHING
        return _ReleaseCompletion(self._post_future(_Ev.FINISH, tail), self._what("finish"))

    def preempt(self) -> _Completion:
        """Give up the request's blocks but keep it open. Resolves once they may be reused; afterwards
        :meth:`lookup` / :meth:`load` / :meth:`step` rebuild the block table as for a new request. Await it:
        one that is never awaited warns (``RuntimeWarning``)."""
        self._check_call("preempt")
        tail = self._partial_tail()
        self._blocks = []
        self._block_set = set()
        self._pending = [[] for _ in self._pending]
        self.num_computed_tokens = 0
        self._stored_upto = 0
        self._hit_blocks = None
        self._epoch += 1
        self._state = RequestState.PREEMPTED
        return _ReleaseCompletion(self._post_future(_Ev.PREEMPT, tail), self._what("preempt"))

    def abort(self) -> _Completion:
        """Cancel the request: stores not yet submitted are dropped, copies in flight (loads included) are
        waited for. Resolves once every engine block may be reused. Idempotent, and also resolves (once the
        copies are done) for a request that already ended or whose task was cancelled. Await it: one that is
        never awaited warns (``RuntimeWarning``)."""
        off = self._off
        if _get_ident() != off.thread:
            raise off.wrong_thread("abort")
        return _ReleaseCompletion(self._abort_future(), self._what("abort"))

    @property
    def state(self) -> RequestState:
        """The lifecycle state (read-only: the request's own events change it)."""
        return self._state

    @property
    def token_ids(self) -> Sequence[int]:
        """Every token so far: the prompt, then each step's new tokens. A read-only view (steps extend it);
        ``list(req.token_ids)`` copies it."""
        return TokenView(self._token_ids)

    def __repr__(self) -> str:
        return (
            f"<Request {self.request_id!r} {self._state.name} tokens={len(self._token_ids)} "
            f"computed={self.num_computed_tokens} blocks={len(self._blocks)} in_flight={len(self._in_flight)}>"
        )

    # ---------------------------------------------------------------- internals
    def _what(self, method: str) -> str:
        return f"{method}() of request {self.request_id!r}"

    def _abort_future(self) -> asyncio.Future[Any]:
        """abort() without the awaitable wrapper (the offloader's close uses it; nothing warns)."""
        fut: asyncio.Future[Any] = self._off.loop.create_future()
        if self._abort_requested or self._state in _ENDED:
            # Already ending: resolve once the task is done and its copies are complete.
            if self._quiet:
                fut.set_result(None)
            else:
                self._quiet_waiters.append(fut)
            return fut
        self._abort_requested = True
        self._post_nowait(_Ev.ABORT, None, fut)
        return fut

    def _check_load_usable(self, n: int) -> None:
        """A step computing past the restored tokens of a load in flight: only once the engine can have
        ordered its forward after the copy (device: submitted; cpu: never before the load resolved)."""
        ticket = self._load_ticket
        if ticket is not None and ticket.done():
            if self._off.device is not None:
                return
            # CPU: the copy is done (every layer of a layer-wise load awaited) and succeeded, although the
            # request's task has not resumed to say so yet.
            tf = None if ticket.cancelled() or ticket.exception() is not None else ticket.result()
            if tf is not None and tf.done() and tf.exception() is None:
                return
        raise RequestStateError(
            f"num_computed_tokens must be <= {self.num_computed_tokens} (the tokens restored by the load in "
            f"flight) until the load resolved, got {n}: await the load (on a device, await its "
            "wait_submitted() and call order_before()) before computing over it"
        )

    def _partial_tail(self) -> tuple[int, int, int, Any, int] | None:
        """(block index, engine block, tokens, mark, generation) of a partially computed last block, when
        configured to store it."""
        if self._grouped:
            # A grouped layout's "tail" is its final boundary: the window and state parts it needs.
            full = min(self._stored_upto, len(self._blocks))
            if full == 0 or self._abort_requested:
                return None
            return (_FINAL, full, self._blocks, None, self._epoch)  # type: ignore[return-value]
        if not self._off.store_partial_last_block:
            return None
        bs = self._off.block_size
        full, k = divmod(self.num_computed_tokens, bs)
        if k == 0 or full >= len(self._blocks):
            return None
        return full, self._blocks[full], k, self._off.mark(), self._epoch

    def _check_call(self, what: str) -> None:
        off = self._off
        if _get_ident() != off.thread:
            raise off.wrong_thread(what)
        if self._state in _ENDED or self._abort_requested:
            raise RequestStateError(
                f"{what}() after the request ended: request {self.request_id!r} is "
                f"{'aborting' if self._abort_requested and self._state not in _ENDED else self._state.value}"
            )

    def _post(self, kind: _Ev, payload: Any) -> _Completion:
        return _Completion(self._post_future(kind, payload))

    def _post_future(self, kind: _Ev, payload: Any) -> asyncio.Future[Any]:
        fut: asyncio.Future[Any] = self._off.loop.create_future()
        self._post_nowait(kind, payload, fut)
        return fut

    def _post_nowait(self, kind: _Ev, payload: Any, fut: asyncio.Future[Any] | None = None) -> None:
        off = self._off
        if off.deferred:
            # Stores that earlier steps completed go first. Nothing may keep this event from being posted
            # (an abort or finish that never resolves would hold the engine's blocks forever).
            try:
                off.flush_deferred()
            except Exception as exc:
                off.store_not_submitted(self.request_id, exc)
        self._events.append((kind, payload, fut))
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _start(self) -> None:
        task = self._off.loop.create_task(self._run(), name=f"aiokv-request-{self.request_id}")
        task.add_done_callback(self._task_done)
        self._task = task

    def _task_done(self, _task: asyncio.Task[None]) -> None:
        # A task cancelled before its first step never enters _run(), so its finally never runs: end here.
        if not self._task_ended:
            self._end(None)

    def _chain(self, n_blocks: int) -> list[bytes]:
        """The request's block hashes, computed (incrementally) at least up to block ``n_blocks``. Returns the
        request's own list: callers index it and must not modify it."""
        hashes = self._hashes
        have = len(hashes)
        if n_blocks > have:
            bs = self._bs
            # Token ids were validated by open() and step(): the unchecked hot path is safe here.
            prev = hashes[-1] if hashes else self._parent(0)
            try:
                new = _chain_in_place(prev, self._token_ids, have * bs, bs, n_blocks - have)
            except (TypeError, OverflowError):  # not exact ints after all: the hashlib path decides
                new = chain_hashes_from(prev, self._token_ids, have * bs, bs, n_blocks - have)
            hashes.extend(new)
        return hashes

    async def _run(self) -> None:
        events = self._events
        loop = self._off.loop
        current: tuple[_Ev, Any, asyncio.Future[Any] | None] | None = None
        try:
            while True:
                while not events:
                    self._waiter = loop.create_future()
                    await self._waiter
                    self._waiter = None
                current = events.popleft()
                kind, payload, fut = current
                if kind is _Ev.STORE:
                    current = None
                    self._store(payload)
                    continue
                if fut is not None and fut.cancelled() and kind in (_Ev.LOOKUP, _Ev.LOAD):
                    current = None
                    if kind is _Ev.LOAD:  # withdrawn before it ran: leave no trace
                        self._withdraw_load(payload)
                    continue
                if kind is _Ev.BARRIER:
                    current = None
                    if fut is not None and not fut.done():
                        fut.set_result(None)
                    continue
                try:
                    if kind is _Ev.LOOKUP:
                        result: Any = await self._do_lookup(payload)
                    elif kind is _Ev.LOAD:
                        result = await self._do_load(payload)
                    else:
                        if payload is not None:
                            self._store_partial(payload)
                        await self._drain()  # always: this is what makes the blocks reusable
                        self._unpin()
                        if kind is _Ev.FINISH and self._retain_s is not None:
                            kept = self._hashes[: self._stored_upto]
                            if self._grouped:  # every unit the final boundary's hit needs
                                kept = self._off.grouped.retain_keys(kept)
                            self._off.retain(kept, self._retain_s)
                        result = None
                        if kind is not _Ev.PREEMPT:
                            self._state = (
                                RequestState.FINISHED if kind is _Ev.FINISH else RequestState.ABORTED
                            )
                except Exception as exc:
                    current = None
                    if fut is not None and not fut.done():
                        fut.set_exception(exc)
                    continue
                current = None
                if fut is not None and not fut.done():
                    fut.set_result(result)
                if self._state in (RequestState.FINISHED, RequestState.ABORTED):
                    return
        finally:
            self._waiter = None
            self._end(current)

    def _end(self, current: tuple[_Ev, Any, asyncio.Future[Any] | None] | None) -> None:
        """The task is ending. Normally after FINISH/ABORT (nothing is left); when the task was cancelled
        (an application shutting down), the request ends as aborted: everything still queued resolves (a
        lookup and a load to 0, the others to None) once the copies in flight are complete."""
        self._task_ended = True
        left = [current] if current is not None else []
        left.extend(self._events)
        self._events.clear()
        if self._state not in (RequestState.FINISHED, RequestState.ABORTED):
            self._state = RequestState.ABORTED
            self._abort_requested = True
            self._hit_blocks = None
            self._unpin()
        for kind, payload, _fut in left:
            if kind is _Ev.LOAD:
                _settle_ticket(payload[2], None)

        def settle() -> None:
            for kind, _payload, fut in left:
                if fut is not None and not fut.done():
                    fut.set_result(0 if kind in (_Ev.LOOKUP, _Ev.LOAD) else None)
            self._quiet = True
            waiters, self._quiet_waiters = self._quiet_waiters, []
            for w in waiters:
                resolve(w, None)

        self._when_copies_done(settle)
        self._off.request_ended(self)

    def _when_copies_done(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` once every copy this request submitted is complete (now, if they all are)."""
        pending = [tf for tf in self._in_flight if not tf.done()]
        self._in_flight = set(pending)
        if not pending:
            callback()
            return
        remaining = len(pending)

        def one_done(_tf: Any) -> None:
            nonlocal remaining
            remaining -= 1
            if remaining == 0:
                self._in_flight.clear()
                callback()

        for tf in pending:
            tf.add_done_callback(one_done)

    def _withdraw_load(self, payload: tuple[Any, ...]) -> None:
        """A load cancelled before the task ran it: release the lookup's pins and, unless the request moved on
        since (preempted), give up the block table load() set."""
        _settle_ticket(payload[2], None)
        self._unpin()
        if payload[4] != self._epoch:
            return
        self._blocks = []
        self._block_set = set()
        self._pending = [[] for _ in self._pending]
        self.num_computed_tokens = 0
        self._stored_upto = 0
        if self._state is RequestState.LOADING:
            self._state = RequestState.WAITING

    def _store(self, payload: tuple[int, int, list[int], Any, int]) -> None:
        start, end, blocks, mark, epoch = payload
        if self._abort_requested:
            return
        if end * self._off.block_size > self._store_cap:  # max_store_tokens / store_decode=False
            end = self._store_cap // self._off.block_size
            if start >= end:
                return
        if epoch == self._failed_epoch:
            self._off.counters.stores_invalidated += end - start
            return
        # What _guarded() does, inline: this runs for every stored block of every request.
        try:
            tf = self._off.store_blocks(self._chain(end), start, end, blocks, mark, self)
        except Exception as exc:
            self._off.store_not_submitted(self.request_id, exc)
            return
        if tf is not None:
            self._track(tf)

    def _store_partial(self, payload: tuple[Any, ...]) -> None:
        if payload[0] is _FINAL:
            self._store_final(payload)
            return
        index, block_id, k, mark, epoch = payload
        if self._abort_requested or index * self._off.block_size + k > self._store_cap:
            return
        if epoch == self._failed_epoch:
            self._off.counters.stores_invalidated += 1
            return
        self._guarded(self._do_store_partial, index, block_id, k, mark)

    def _store_final(self, payload: tuple[Any, ...]) -> None:
        """A grouped layout's request finishes or is preempted after ``full`` blocks: store the window and
        state units that boundary needs (and the fill-time rule did not store)."""
        _tag, full, blocks, mark, epoch = payload
        if self._abort_requested:
            return
        cap = self._store_cap // self._off.block_size
        if full > cap:
            return  # the final boundary lies past max_store_tokens: its parts were never wanted
        if epoch == self._failed_epoch:
            return
        try:
            tf = self._off.store_units(self._chain(full), 0, full, blocks, mark, self, final=True)
        except Exception as exc:
            self._off.store_not_submitted(self.request_id, exc)
            return
        if tf is not None:
            self._track(tf)

    def _guarded(self, store: Any, *args: Any) -> None:
        """Run a store submission; a failure to submit (a bug, a closed executor) drops the store, is counted
        and reported, and never stops the request's task (which must go on to drain and resolve)."""
        try:
            store(*args)
        except Exception as exc:
            self._off.store_not_submitted(self.request_id, exc)

    def _track(self, tf: TransferFuture | LayeredTransfer) -> None:
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
            self._off.unpin(self._pinned)
            self._pinned = []
            self._pinned_slots = []
            self._pinned_plan = []

    def _parent(self, index: int) -> bytes:
        if index == 0:
            return chain_seed(salt=self.salt, extra_keys=self.extra_keys, root=self._off.layout.root)
        return self._chain(index)[index - 1]

    def _do_store_partial(self, index: int, block_id: int, k: int, mark: Any) -> None:
        bs = self._off.block_size
        key = partial_block_hash(self._parent(index), self._token_ids[index * bs : index * bs + k])
        tf = self._off.store_one(key, self._parent(index), index, block_id, mark, self, k)
        if tf is not None:
            self._track(tf)

    async def _do_lookup(self, epoch: int) -> int:
        self._unpin()
        off = self._off
        bs = off.block_size
        max_blocks = max(0, (len(self._token_ids) - 1) // bs)
        load_cap = self._load_cap
        if max_blocks * bs > load_cap:  # max_load_tokens
            max_blocks = load_cap // bs
        keys = self._chain(max_blocks)[:max_blocks]
        if self._grouped:
            found: tuple[int, list[bytes], list[int], list[tuple[int, int]]]
            found = await off.grouped_lookup(keys, self)
            hit, self._pinned, self._pinned_slots, self._pinned_plan = found
            self._partial = 0
            if epoch == self._epoch and self._state in _ADMITTING:
                self._hit_blocks = hit
            else:
                self._unpin()
            return hit * bs
        pinned, slots = await off.lookup_and_pin(keys, self)
        hit = len(pinned)
        partial = 0
        if off.store_partial_last_block:
            # Longest partially filled block continuing the full hit (CPU tier only).
            start = hit * bs
            parent = self._parent(hit)
            for k in range(min(bs - 1, len(self._token_ids) - 1 - start, load_cap - start), 0, -1):
                key = partial_block_hash(parent, self._token_ids[start : start + k])
                got = off.pin_ready([key])
                if got:
                    pinned.append(key)
                    slots.append(got[0])
                    partial = k
                    break
        self._pinned, self._pinned_slots = pinned, slots
        self._partial = partial
        if epoch == self._epoch and self._state in _ADMITTING:
            self._hit_blocks = hit + (1 if partial else 0)
        else:
            # The request moved on while this lookup ran (preempted, stepped or ended): nothing will load it.
            self._unpin()
        return hit * bs + partial

    async def _do_load(self, payload: tuple[Any, ...]) -> int:
        block_ids: list[int] = payload[0]
        mark, ticket = payload[1], payload[2]
        restored: int = payload[3]
        epoch: int = payload[4]
        present: int = payload[5] if len(payload) > 5 else 0
        layerwise: bool = payload[6] if len(payload) > 6 else False
        n = len(block_ids)
        off = self._off
        if n == 0:
            self._unpin()
            _settle_ticket(ticket, None)
            return 0
        if self._grouped:
            keys, slots, block_ids = self._grouped_refs(block_ids, present)
            if not keys:
                _settle_ticket(ticket, None)
                if self._state is RequestState.LOADING:
                    self._state = RequestState.RUNNING
                return restored
            present = 0
        else:
            keys, slots = self._pinned[:n], self._pinned_slots[:n]
            extra = self._pinned[n:]
            self._pinned = []
            self._pinned_slots = []
            if extra:
                off.unpin(extra)
            assert len(keys) == n, "load() of more blocks than its lookup pinned"
        if present:
            # The engine holds these blocks' KV already: nothing is written into them.
            off.unpin(keys[:present])
            keys, slots, block_ids = keys[present:], slots[present:], block_ids[present:]
            if not keys:
                _settle_ticket(ticket, None)
                if self._state is RequestState.LOADING:
                    self._state = RequestState.RUNNING
                return restored
        # The loaded entries stay pinned until the copy reading their slots completes (done callback).
        try:
            tf = off.load_blocks(keys, slots, block_ids, mark, layerwise)
        except ClosedError as exc:  # the offloader is closed under the request: the engine must hear of it
            off.unpin(keys)
            self._load_failed(epoch, restored)
            if ticket is not None and not ticket.done():
                ticket.set_exception(exc)
                ticket.exception()  # the load's own awaitable reports it; this one may never be awaited
            raise
        except Exception as exc:  # a copy that cannot be submitted is a miss
            off.unpin(keys)
            off.load_not_submitted(self.request_id, len(keys), exc)
            self._load_failed(epoch, restored)
            _settle_ticket(ticket, None)
            return 0
        _settle_ticket(ticket, tf)
        self._track(tf)
        with contextlib.suppress(TransferError):
            await tf
        if tf.exception() is not None:  # counted and logged by the offloader's completion callback
            self._load_failed(epoch, restored)
            return 0
        if self._state is RequestState.LOADING:
            self._state = RequestState.RUNNING
        return restored

    def _grouped_refs(self, rows: list[Any], present: int) -> tuple[list[bytes], list[int], list[Any]]:
        """The pinned units a grouped load copies, with their ``(unit, row)`` copy refs: units of blocks the
        load covers, past the ``present`` ones, whose groups hold an engine block there. The other pins are
        released."""
        parts = self._off.grouped.parts
        unit_parts = self._off.grouped.unit_parts
        n = len(rows)
        keys: list[bytes] = []
        slots: list[int] = []
        refs: list[Any] = []
        drop: list[bytes] = []
        for key, slot, (b, u) in zip(self._pinned, self._pinned_slots, self._pinned_plan, strict=True):
            if b >= n or b < present:
                drop.append(key)
                continue
            row = rows[b]
            if any(row[c] < 0 for c in parts[unit_parts[u][0]].columns):
                drop.append(key)  # the engine holds no block there (and so needs none)
                continue
            keys.append(key)
            slots.append(slot)
            refs.append((u, row))
        self._pinned, self._pinned_slots, self._pinned_plan = [], [], []
        if drop:
            self._off.unpin(drop)
        return keys, slots, refs

    def _load_failed(self, epoch: int, restored: int) -> None:
        """The load of generation ``epoch`` restored nothing: its blocks hold garbage. Nothing computed over
        them may be stored; if the engine has computed nothing over them yet, the request counts 0 tokens
        computed and a new generation starts (the engine, awaiting the load, recomputes from 0)."""
        if self._state is RequestState.LOADING:
            self._state = RequestState.RUNNING
        self._failed_epoch = epoch
        if epoch != self._epoch:
            return  # preempted since: the table that held this load is gone
        if self.num_computed_tokens > restored:
            # A device engine already computed over the copy (ordered after it on the device): that KV is
            # wrong and stays unstored until the request is preempted.
            self._off.load_poisoned(self.request_id, self.num_computed_tokens)
            return
        self.num_computed_tokens = 0
        self._stored_upto = 0
        self._epoch += 1


_FINAL = object()  # tags a grouped request's final-boundary payload on FINISH / PREEMPT


RequestHandle = Request
"""Alias of :class:`Request`: the name the API contract gives the object returned by ``Offloader.open``."""


StepUpdate = tuple[Request, int, Sequence[int], Sequence[int]]


def step_batch(off: RequestHost, updates: Iterable[StepUpdate]) -> None:
    """:meth:`Request.step` for many requests in one call (see :meth:`aiokv.Offloader.step_batch`): each
    update is checked for its shape and its request's offloader, then applied by that request's ``step()``,
    so the two cannot disagree."""
    if _native_step is not None:
        _native_step.step_batch(off, updates, _step_batch_py)
    else:
        _step_batch_py(off, updates)


def _step_batch_py(off: RequestHost, updates: Iterable[StepUpdate]) -> None:
    """step_batch in Python: the definition (the C path of aiokv/_native/_step.c calls it for every update it
    does not take itself, and for every batch that is not a list or tuple)."""
    if _get_ident() != off.thread:
        raise off.wrong_thread("step_batch")
    if isinstance(updates, (str, bytes)) or not isinstance(updates, Iterable):
        raise InvalidTypeError(f"updates must be an iterable of tuples, got {type(updates).__name__}")
    for update in updates:
        try:
            req, n, toks, ids = update
        except (TypeError, ValueError):
            raise InvalidTypeError(
                "updates must contain (request, num_computed_tokens, new_token_ids, new_block_ids) tuples, "
                f"got {update!r}"
            ) from None
        if type(req) is not Request or req._off is not off:
            if not isinstance(req, Request):
                raise InvalidTypeError(f"updates must name Request objects, got {type(req).__name__}")
            if req._off is not off:
                raise InvalidArgumentError(
                    f"updates must name requests of this offloader, got request {req.request_id!r} of another"
                )
        req.step(n, toks, ids)


def _load_native_step() -> Any:
    """The C fast path of ``Request.step`` and ``step_batch`` (aiokv/_native/_step.c), unless it is not built
    or ``AIOKV_NATIVE_STEP=0``. It takes the common case (a running request fed exact ints that pass every
    check) and hands everything else to the Python method, which stays the definition."""
    if os.environ.get("AIOKV_NATIVE_STEP", "1") == "0":
        return None
    try:
        from ._native import _step
    except ImportError:
        return None
    try:
        _step.configure(Request, RequestState.RUNNING)
    except (TypeError, AttributeError) as exc:
        # The extension reads Request's slots by name: one renamed or retyped (an extension built from other
        # sources) turns the fast path off, never `import aiokv`.
        warnings.warn(
            f"aiokv: the C fast path of Request.step() is off ({exc}); the Python method runs alone",
            RuntimeWarning,
            stacklevel=1,
        )
        return None
    return _step


_native_step = _load_native_step()
if _native_step is not None:
    Request.step = _native_step.StepMethod(Request.step)  # type: ignore[method-assign]

# Offloader._flush_deferred's loop for its common entries, in C (None: the Python loop takes every entry).
_flush_plain: Callable[..., tuple[int, int]] | None = (
    getattr(_native_step, "flush_plain", None) if _native_step is not None else None
)
# Request._track(tf) for each of a list of requests, in C (None: call the method).
_track_all: Callable[[list[Request], TransferFuture], None] | None = (
    getattr(_native_step, "track", None) if _native_step is not None else None
)
