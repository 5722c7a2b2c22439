"""Misuse that used to pass silently is now loud: calls from another thread, end awaitables that are never
awaited, an eviction policy set in two places."""

from __future__ import annotations

import asyncio
import gc
import re
import warnings
from collections.abc import Callable
from typing import Any

import pytest

import aiokv
from aiokv import CPUTier, InvalidArgumentError, Offloader, RequestState
from aiokv._errors import WrongThreadError
from aiokv.tiers import ARCPolicy, LRUPolicy

from ._sim import SimEngine

pytestmark = pytest.mark.asyncio


def _offloader(eng: SimEngine, **kw: Any) -> Offloader:
    return Offloader(eng.layout, tiers=[CPUTier(capacity_bytes=64 * eng.layout.slot_bytes)], **kw)


# ------------------------------------------------------------------------------------------ threads
async def test_calls_from_another_thread_are_refused_and_change_nothing() -> None:
    """Regression: calling step() (or any other method) from a thread other than the loop's was silently
    accepted, racing the loop on unlocked state. Each call now raises WrongThreadError and changes nothing."""
    eng = SimEngine(block_size=4)
    async with _offloader(eng) as off:
        req = off.open("r", list(range(9)))
        calls: dict[str, Callable[[], object]] = {
            "step": lambda: req.step(4, new_token_ids=[1], new_block_ids=[0]),
            "lookup": req.lookup,
            "load": lambda: req.load([0]),
            "finish": req.finish,
            "preempt": req.preempt,
            "abort": req.abort,
            "wait_processed": req.wait_processed,
            "open": lambda: off.open("other", [1, 2]),
        }

        def call_all() -> dict[str, str]:
            out: dict[str, str] = {}
            for name, call in calls.items():
                try:
                    call()
                except WrongThreadError as exc:
                    out[name] = str(exc)
            return out

        errors = await asyncio.to_thread(call_all)
        assert set(errors) == set(calls)
        for name, message in errors.items():
            assert re.fullmatch(
                rf"{name}\(\) must be called on the thread running the offloader's event loop \(thread \d+\), "
                r"got thread \d+: hand the call over with loop\.call_soon_threadsafe",
                message,
            ), message
        assert issubclass(WrongThreadError, aiokv.AiokvError)
        assert issubclass(WrongThreadError, RuntimeError)
        assert (req.state, req.num_computed_tokens, req.block_ids) == (RequestState.WAITING, 0, ())
        assert off.get("other") is None
        # The same calls on the loop's thread work.
        assert await req.lookup() == 0
        req.step(4, new_token_ids=[1], new_block_ids=[0])
        await req.finish()


# ------------------------------------------------------------------------------ never-awaited ends
@pytest.mark.parametrize("end", ["finish", "preempt", "abort"])
async def test_an_end_awaitable_dropped_without_being_awaited_warns(end: str) -> None:
    """Regression: the awaitable of finish()/preempt()/abort() could be dropped without a sign, although
    the engine may reuse the blocks only once it resolved. Dropping it unawaited warns like a coroutine that
    was never awaited; awaiting it (directly or through a task) does not."""
    eng = SimEngine(block_size=4)
    async with _offloader(eng) as off:
        req = off.open("r", list(range(9)))
        req.step(8, new_block_ids=[0, 1])
        with pytest.warns(
            RuntimeWarning,
            match=rf"{end}\(\) of request 'r' was never awaited: the request's blocks may be reused only once "
            r"it resolves",
        ):
            getattr(req, end)()  # dropped at once: collected by reference counting
        await req.abort()
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            awaited = off.open("a", list(range(9)))
            await getattr(awaited, end)()
            by_task = off.open("t", list(range(9)))
            await asyncio.ensure_future(getattr(by_task, end)())
            await awaited.abort()
            await by_task.abort()
            gc.collect()


async def test_the_offloaders_own_aborts_at_close_never_warn() -> None:
    """aclose() aborts open requests through the internal path: nothing is dropped unawaited, even when the
    close is cancelled and retried."""
    eng = SimEngine(block_size=4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        off = _offloader(eng)
        await off.start()
        for i in range(3):
            off.open(f"r{i}", list(range(9))).step(8, new_block_ids=[2 * i, 2 * i + 1])
        closing = asyncio.ensure_future(off.aclose())
        await asyncio.sleep(0)
        closing.cancel()
        with pytest.raises(asyncio.CancelledError):
            await closing
        await off.aclose()
        gc.collect()
    assert off.stats().requests_open == 0


# ------------------------------------------------------------------------------------------ eviction
async def test_eviction_is_set_in_one_place() -> None:
    """Regression: CPUTier(eviction=...) silently overrode Offloader(eviction=...). Two different policies
    are refused; either place alone (or both the same) works, and stats() names the active policy."""
    eng = SimEngine(block_size=4)
    cap = 64 * eng.layout.slot_bytes
    tier = CPUTier(capacity_bytes=cap, eviction="arc")
    with pytest.raises(
        InvalidArgumentError,
        match=r"eviction must be set in one place, got 'lru' on the Offloader and 'arc' on its CPUTier",
    ):
        Offloader(eng.layout, [tier], eviction="lru")
    policy = LRUPolicy()
    with pytest.raises(
        InvalidArgumentError, match=r"got 'arc' on the Offloader and 'lru' \(LRUPolicy\) on its"
    ):
        Offloader(eng.layout, [CPUTier(capacity_bytes=cap, eviction=policy)], eviction="arc")
    cases: list[tuple[Any, Any, str, type]] = [
        ("arc", None, "arc", ARCPolicy),
        (None, "arc", "arc", ARCPolicy),
        (None, None, "lru", LRUPolicy),
        ("arc", "arc", "arc", ARCPolicy),
        (policy, policy, "lru", LRUPolicy),
    ]
    for on_tier, on_offloader, active, cls in cases:
        kw = {} if on_offloader is None else {"eviction": on_offloader}
        off = Offloader(eng.layout, [CPUTier(capacity_bytes=cap, eviction=on_tier)], **kw)
        async with off:
            assert isinstance(off.cpu.index.policy, cls)
            assert off.stats().eviction == active
            assert off.cpu.stats().eviction == active
    # The refused tier was left unbound: it can serve an offloader that does not contradict it.
    async with Offloader(eng.layout, [tier]) as off:
        assert off.stats().eviction == "arc"
