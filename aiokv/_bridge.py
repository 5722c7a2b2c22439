"""A thread-safe bridge for engines whose scheduler is a synchronous loop in another thread.

Every operation of :class:`~aiokv.Request` (and :meth:`~aiokv.Offloader.open`) is marshalled onto the
offloader's event loop with ``loop.call_soon_threadsafe`` and answered through a
:class:`concurrent.futures.Future`. Calls made from one thread run on the loop in the order they were made,
so a scheduler may fire ``step()`` after ``step()`` without waiting and then wait only for what it needs::

    bridge = ThreadBridge(offloader)                  # built anywhere; used from the engine's thread
    req = bridge.open("r1", prompt).result()
    hit = req.lookup().result()                       # tokens, as Request.lookup
    req.load(blocks[: hit // block_size]).result()
    req.step(len(prompt), new_token_ids=[tok], new_block_ids=blocks)   # fire and forget
    req.finish().result()                             # only now may the blocks be reused

An engine stepping many requests hands the whole step over at once with :meth:`ThreadBridge.step_batch`
(one loop hand-over per engine step instead of one per request).

**The reuse guarantee is Request's**: the futures of ``finish()``, ``preempt()`` and ``abort()`` resolve only
after the loop-side completion resolved, i.e. after every copy touching the request's blocks ended.

**Cancellation**: ``future.cancel()`` succeeds only while the call has not reached the loop, and then the call
never happens (nothing to undo). Once it runs it cannot be cancelled; to drop a load in flight, ``abort()``.
A call made after the loop closed fails with :class:`~aiokv.ClosedError`. Do not block on these futures on the
loop's own thread (it would wait for itself): that is refused with :class:`~aiokv.InvalidArgumentError`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from ._errors import ClosedError, InvalidArgumentError, InvalidTypeError

if TYPE_CHECKING:
    from ._offloader import Offloader
    from ._request import LoadCompletion, Request
    from ._stats import OffloaderStats

__all__ = ["ThreadBridge", "ThreadLoad", "ThreadRequest", "call_in_loop"]

T = TypeVar("T")


def call_in_loop(
    loop: asyncio.AbstractEventLoop, fn: Callable[[], T | Awaitable[T]]
) -> concurrent.futures.Future[T]:
    """Run ``fn()`` on ``loop`` from another thread; if it returns an awaitable, the future resolves with the
    awaitable's result. The one path from a thread to the loop: it refuses the loop's own thread, fails the
    future with :class:`ClosedError` when the loop is closed, and does nothing if the future was cancelled
    before ``fn`` ran."""
    try:
        running = asyncio.get_running_loop()
    except RuntimeError:
        running = None
    if running is loop:
        raise InvalidArgumentError(
            "the thread bridge is for other threads; on the event loop's thread call the Request directly"
        )
    cf: concurrent.futures.Future[T] = concurrent.futures.Future()

    def run() -> None:
        if not cf.set_running_or_notify_cancel():
            return  # cancelled before it reached the loop: it never happens
        try:
            out = fn()
        except BaseException as exc:
            cf.set_exception(exc)
            if not isinstance(exc, Exception):
                raise
            return
        if not isinstance(out, Awaitable):
            cf.set_result(out)
            return
        task_or_fut = asyncio.ensure_future(out)

        def relay(f: asyncio.Future[Any]) -> None:
            if f.cancelled():
                cf.set_exception(ClosedError("the operation was cancelled on the event loop"))
            elif f.exception() is not None:
                cf.set_exception(f.exception())
            else:
                cf.set_result(f.result())

        task_or_fut.add_done_callback(relay)

    if loop.is_closed():
        cf.set_exception(ClosedError("the offloader's event loop is closed"))
        return cf
    try:
        loop.call_soon_threadsafe(run)
    except RuntimeError:  # closed between the check and the call
        cf = concurrent.futures.Future()
        cf.set_exception(ClosedError("the offloader's event loop is closed"))
    return cf


class ThreadBridge:
    """Thread-side handle on a started :class:`~aiokv.Offloader` (see the module docstring)."""

    __slots__ = ("_loop", "_off")

    def __init__(self, offloader: Offloader) -> None:
        self._off = offloader
        self._loop = offloader.loop  # raises ClosedError unless started

    @property
    def offloader(self) -> Offloader:
        return self._off

    def open(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        salt: object = None,
        *,
        extra_keys: Sequence[object] = (),
        max_store_tokens: int | None = None,
        max_load_tokens: int | None = None,
        store_decode: bool = True,
        retain_s: float | None = None,
        priority: int = 0,
    ) -> concurrent.futures.Future[ThreadRequest]:
        """:meth:`Offloader.open` on the loop; resolves to the request's thread-side handle."""
        tokens = list(prompt_token_ids)
        extra = tuple(extra_keys)

        def op() -> ThreadRequest:
            req = self._off.open(
                request_id,
                tokens,
                salt,
                extra_keys=extra,
                max_store_tokens=max_store_tokens,
                max_load_tokens=max_load_tokens,
                store_decode=store_decode,
                retain_s=retain_s,
                priority=priority,
            )
            return ThreadRequest(self, req)

        return call_in_loop(self._loop, op)

    def step_batch(
        self, updates: Iterable[tuple[ThreadRequest, int, Sequence[int], Sequence[int]]]
    ) -> concurrent.futures.Future[None]:
        """:meth:`Offloader.step_batch` on the loop, in one hand-over for the whole engine step: each update is
        ``(thread_request, num_computed_tokens, new_token_ids, new_block_ids)``. The token and block lists are
        copied here, so the engine may reuse its lists at once. The future holds the error of the first
        invalid update (the updates before it were applied). Like ``step()``, it need not be waited for."""
        if isinstance(updates, (str, bytes)) or not isinstance(updates, Iterable):
            raise InvalidTypeError(f"updates must be an iterable of tuples, got {type(updates).__name__}")
        batch: list[tuple[Request, int, list[int], list[int]]] = []
        for update in updates:
            try:
                handle, n, toks, ids = update
            except (TypeError, ValueError):
                raise InvalidTypeError(
                    "updates must contain (thread_request, num_computed_tokens, new_token_ids, new_block_ids) "
                    f"tuples, got {update!r}"
                ) from None
            if not isinstance(handle, ThreadRequest):
                raise InvalidTypeError(
                    f"updates must name ThreadRequest handles, got {type(handle).__name__}"
                )
            batch.append((handle._req, n, list(toks), list(ids)))
        return call_in_loop(self._loop, lambda: self._off.step_batch(batch))

    def record_prefill(self, tokens: int, seconds: float) -> concurrent.futures.Future[None]:
        """:meth:`Offloader.record_prefill` on the loop (the load planner's prefill measurement). Like
        ``step_batch``, it need not be waited for; the future holds the error of an invalid report."""
        return call_in_loop(self._loop, lambda: self._off.record_prefill(tokens, seconds))

    def stats(self) -> concurrent.futures.Future[OffloaderStats]:
        """:meth:`Offloader.stats`, read on the loop (a consistent snapshot)."""
        return call_in_loop(self._loop, self._off.stats)

    def __repr__(self) -> str:
        return f"<ThreadBridge {self._off!r}>"


class ThreadRequest:
    """Thread-side handle on one :class:`~aiokv.Request`; every method returns a
    :class:`concurrent.futures.Future` and mirrors the Request method of the same name."""

    __slots__ = ("_bridge", "_req")

    def __init__(self, bridge: ThreadBridge, req: Request) -> None:
        self._bridge = bridge
        self._req = req

    @property
    def request_id(self) -> str:
        return self._req.request_id

    def _call(self, fn: Callable[[], Any]) -> concurrent.futures.Future[Any]:
        return call_in_loop(self._bridge._loop, fn)

    def lookup(self) -> concurrent.futures.Future[int]:
        """Resolves to the cached prefix length in tokens (see :meth:`Request.lookup`)."""
        return self._call(self._req.lookup)

    def load(
        self, block_ids: Sequence[int], *, present_blocks: int = 0, layerwise: bool = False
    ) -> ThreadLoad:
        """Resolves once the cached prefix is in ``block_ids``, to the tokens restored (see
        :meth:`Request.load`, also for ``present_blocks`` and ``layerwise``). The returned future's
        :meth:`ThreadLoad.layer` resolves per layer (a layer-wise load: as each layer's copy completes)."""
        ids = _copy_ids(block_ids)
        out = ThreadLoad(self._bridge._loop)

        def op() -> Any:
            completion = self._req.load(ids, present_blocks=present_blocks, layerwise=layerwise)
            out._completion = completion
            return completion

        relay = self._call(op)
        relay.add_done_callback(out._settle)
        return out

    def step(
        self, num_computed_tokens: int, new_token_ids: Sequence[int] = (), new_block_ids: Sequence[int] = ()
    ) -> concurrent.futures.Future[None]:
        """Report an engine step; the future resolves once the loop applied it (or holds its validation
        error). Steps need not be waited for: later calls run after them."""
        toks, blocks = list(new_token_ids), _copy_ids(new_block_ids)
        return self._call(lambda: self._req.step(num_computed_tokens, toks, blocks))

    def drop_blocks(self, block_ids: Sequence[Sequence[int]]) -> concurrent.futures.Future[None]:
        """Grouped layouts: the engine takes these blocks back mid-request (see :meth:`Request.drop_blocks`);
        resolves once the request's copies in flight are complete."""
        ids = _copy_ids(block_ids)
        return self._call(lambda: self._req.drop_blocks(ids))

    def finish(self) -> concurrent.futures.Future[None]:
        """Resolves once every engine block of the request may be reused."""
        return self._call(self._req.finish)

    def preempt(self) -> concurrent.futures.Future[None]:
        """Resolves once the request's blocks may be reused; the request stays open."""
        return self._call(self._req.preempt)

    def abort(self) -> concurrent.futures.Future[None]:
        """Resolves once every engine block may be reused (copies in flight ended). Idempotent."""
        return self._call(self._req.abort)

    def __repr__(self) -> str:
        return f"<ThreadRequest {self._req!r}>"


class ThreadLoad(concurrent.futures.Future[int]):
    """What :meth:`ThreadRequest.load` returns: a :class:`concurrent.futures.Future` of the whole load's
    result (the tokens restored, 0 on a miss), and :meth:`layer` for each layer of it."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__()
        self._loop = loop
        self._completion: LoadCompletion | None = None  # set on the loop, before anything below runs there

    def _settle(self, relay: concurrent.futures.Future[int]) -> None:
        exc = relay.exception()
        if exc is not None:
            self.set_exception(exc)
        else:
            self.set_result(relay.result())

    def layer(self, index: int) -> concurrent.futures.Future[int]:
        """Resolves once layer ``index`` (of :attr:`KVLayout.layers`) of the restored blocks is in place, to
        the tokens the load restores (0 if it failed): :meth:`LoadCompletion.layer`, from this thread. Calls
        reach the loop in order, so the load has been submitted there before this runs."""

        def op() -> Any:
            if self._completion is None:  # load() itself was refused: its future holds the error
                raise InvalidArgumentError("layer() of a load that was refused: see the load's own future")
            return self._completion.layer(index)

        return call_in_loop(self._loop, op)


def _copy_ids(block_ids: Any) -> Any:
    """A copy the loop thread can keep while the engine's thread reuses its lists: one list, or one list per
    group for a grouped layout (a sequence of sequences)."""
    items = list(block_ids)
    if items and not isinstance(items[0], (int, bytes, str)) and hasattr(items[0], "__iter__"):
        return [list(g) for g in items]
    return items
