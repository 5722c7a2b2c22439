"""Bad input is rejected with a clear ``AiokvError`` subclass whose message names the parameter and the
constraint, and a rejected call leaves no trace: the request can continue and the stats are unchanged."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest
import pytest_asyncio
import torch

import aiokv
from aiokv import (
    AiokvError,
    BlockRangeError,
    CapacityError,
    ClosedError,
    CPUTier,
    DuplicateRequestError,
    InvalidArgumentError,
    InvalidLayoutError,
    InvalidTypeError,
    KVLayout,
    Offloader,
    RequestState,
    RequestStateError,
)

BS = 4  # tokens per block
NUM_BLOCKS = 16


def make_layout(num_blocks: int = NUM_BLOCKS) -> KVLayout:
    k = torch.arange(num_blocks * BS * 2 * 8, dtype=torch.float32).reshape(num_blocks, BS, 2, 8)
    return KVLayout([k, k.clone() + 0.5], block_size=BS)


@pytest_asyncio.fixture
async def off() -> AsyncIterator[Offloader]:
    layout = make_layout()
    async with Offloader(layout, [CPUTier(capacity_bytes=64 * layout.slot_bytes)]) as o:
        yield o


def snapshot(o: Offloader) -> dict[str, Any]:
    """The stats that a rejected call must not change."""
    return dataclasses.asdict(o.stats())


def request_snapshot(r: aiokv.Request) -> tuple[Any, ...]:
    return (r.state, r.num_computed_tokens, r.block_ids, tuple(r.token_ids))


# ------------------------------------------------------------------------------------ the hierarchy
@pytest.mark.parametrize(
    ("cls", "bases"),
    [
        (InvalidArgumentError, (AiokvError, ValueError)),
        (InvalidTypeError, (AiokvError, TypeError)),
        (InvalidLayoutError, (InvalidArgumentError, ValueError)),
        (BlockRangeError, (InvalidArgumentError, ValueError)),
        (CapacityError, (InvalidArgumentError, ValueError)),
        (DuplicateRequestError, (InvalidArgumentError, ValueError)),
        (RequestStateError, (AiokvError, RuntimeError)),
        (ClosedError, (AiokvError, RuntimeError)),
        (aiokv.TransferError, (AiokvError, RuntimeError)),
        (aiokv.TierLockedError, (AiokvError, RuntimeError)),
    ],
)
def test_every_error_derives_from_aiokv_error_and_the_apt_builtin(cls: type, bases: tuple[type, ...]) -> None:
    for base in bases:
        assert issubclass(cls, base)


# ------------------------------------------------------------------------------------------ KVLayout
@pytest.mark.parametrize(
    ("tensors", "kwargs", "exc", "match"),
    [
        (
            lambda: [torch.zeros(8, 4, 2)],
            {"block_size": 0},
            InvalidArgumentError,
            r"block_size must be a positive int, got 0",
        ),
        (
            lambda: [torch.zeros(8, 4, 2)],
            {"block_size": True},
            InvalidArgumentError,
            r"block_size must be a positive int, got True",
        ),
        (
            lambda: [torch.zeros(8, 4, 2)],
            {"block_dim": -1},
            InvalidArgumentError,
            r"block_dim must be a non-negative int, got -1",
        ),
        (
            lambda: [torch.zeros(8, 4, 2)],
            {"model_id": 7},
            InvalidTypeError,
            r"model_id must be a str or None, got int",
        ),
        (lambda: [], {}, InvalidLayoutError, r"tensors must contain at least one tensor"),
        (lambda: 42, {}, InvalidTypeError, r"tensors must be a tensor or a list of tensors, got int"),
        (
            lambda: [torch.zeros(8, 4), "v"],
            {},
            InvalidTypeError,
            r"tensors must contain torch.Tensor objects, got str",
        ),
        (
            lambda: [torch.zeros(8, 4, 2)],
            {"block_dim": 3},
            InvalidLayoutError,
            r"tensors\[0\] has 3 dims; block_dim=3 needs at least 4",
        ),
        (
            lambda: [torch.zeros(8, 4, dtype=torch.bool)],
            {},
            InvalidLayoutError,
            r"tensors\[0\] must be a dense numeric tensor, got torch.bool",
        ),
        (
            lambda: [torch.zeros(8, 4, 2, device="meta")],
            {},
            InvalidLayoutError,
            r"tensors must be on a cpu or cuda device, got meta",
        ),
        (
            lambda: [torch.zeros(8, 4, 2), torch.zeros(8, 4, 2, device="meta")],
            {},
            InvalidLayoutError,
            r"tensors must share one device: tensors\[1\] is on meta, tensors\[0\] on cpu",
        ),
        (
            lambda: [torch.zeros(8, 4, 2), torch.zeros(9, 4, 2)],
            {},
            InvalidLayoutError,
            r"tensors must have the same number of blocks along block_dim=0: tensors\[1\] has 9, tensors\[0\] has 8",
        ),
        (
            lambda: [torch.zeros(2, 8, 4), torch.zeros(2, 7, 4)],
            {"block_dim": 1},
            InvalidLayoutError,
            r"tensors\[1\] has 7, tensors\[0\] has 8",
        ),
        (
            lambda: [torch.zeros(8, 4, 2).transpose(1, 2)],
            {},
            InvalidLayoutError,
            r"tensors\[0\] must be contiguous in the dims after block_dim=0",
        ),
        (
            lambda: [torch.zeros(8, 6, 4)[:, :, :2]],
            {},
            InvalidLayoutError,
            r"tensors\[0\] must be contiguous in the dims after block_dim=0",
        ),
        (
            lambda: [torch.zeros(1, 4, 2).expand(8, 4, 2)],
            {},
            InvalidLayoutError,
            r"tensors\[0\] blocks must not overlap",
        ),
        (lambda: [torch.zeros(0, 4, 2)], {}, InvalidLayoutError, r"tensors must have at least one block"),
        (lambda: [torch.zeros(8, 0)], {}, InvalidLayoutError, r"a block must hold at least one byte"),
    ],
    ids=lambda v: None if not isinstance(v, str) else v[:40],
)
def test_kvlayout_rejects_bad_tensors(
    tensors: Any, kwargs: dict[str, Any], exc: type[Exception], match: str
) -> None:
    with pytest.raises(exc, match=match):
        KVLayout(tensors(), **kwargs)


@pytest.mark.parametrize(
    ("block_ids", "exc", "match"),
    [
        ([0, 16], BlockRangeError, r"block_ids must be in \[0, 16\), got 16"),
        ([-1], BlockRangeError, r"block_ids must be in \[0, 16\), got -1"),
        ([3, 3], InvalidArgumentError, r"block_ids must not contain duplicates, got \[3, 3\]"),
        ([1.0], InvalidTypeError, r"block_ids must contain ints, got 1.0"),
        ([2.5], InvalidTypeError, r"block_ids must contain ints, got 2.5"),
        (["3"], InvalidTypeError, r"block_ids must contain ints, got '3'"),
        ([None], InvalidTypeError, r"block_ids must contain ints, got None"),
        ([True], InvalidTypeError, r"block_ids must contain ints, got True"),
        ("12", InvalidTypeError, r"block_ids must be a sequence of ints, got str"),
        (5, InvalidTypeError, r"block_ids must be a sequence of ints, got int"),
    ],
)
def test_check_block_ids_rejects_bad_ids(block_ids: Any, exc: type[Exception], match: str) -> None:
    with pytest.raises(exc, match=match):
        make_layout().check_block_ids(block_ids)


def test_check_block_ids_accepts_int_likes() -> None:
    layout = make_layout()
    assert layout.check_block_ids(np.array([3, 1], dtype=np.int32)) == [3, 1]
    assert layout.check_block_ids(torch.tensor([0, 15])) == [0, 15]
    assert layout.check_block_ids([np.int64(2), torch.tensor(4)]) == [2, 4]
    assert layout.check_block_ids(range(3)) == [0, 1, 2]


# ------------------------------------------------------------------------------ Offloader and tiers
def test_cpu_tier_rejects_bad_capacity() -> None:
    with pytest.raises(InvalidTypeError, match=r"capacity_bytes must be an int, got float"):
        CPUTier(capacity_bytes=1e9)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match=r"capacity_bytes must be > 0, got 0"):
        CPUTier(capacity_bytes=0)


def test_capacity_smaller_than_one_block_fails_at_offloader_construction() -> None:
    layout = make_layout()
    with pytest.raises(
        CapacityError,
        match=rf"capacity_bytes must hold at least one block of {layout.slot_bytes} bytes, got 100",
    ):
        Offloader(layout, [CPUTier(capacity_bytes=100)])


def test_offloader_rejects_bad_arguments() -> None:
    layout = make_layout()
    with pytest.raises(InvalidTypeError, match=r"layout must be an aiokv.KVLayout, got list"):
        Offloader([torch.zeros(4, 4)], [CPUTier(capacity_bytes=1 << 20)])  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match=r"tiers must contain at least one tier"):
        Offloader(layout, [])
    with pytest.raises(InvalidArgumentError, match=r"tiers\[0\] must be a CPUTier, got str"):
        Offloader(layout, ["cpu"])  # type: ignore[list-item]
    with pytest.raises(InvalidTypeError, match=r"tiers\[1\] must be a BackingTier"):
        Offloader(layout, [CPUTier(capacity_bytes=1 << 20), object()])  # type: ignore[list-item]
    with pytest.raises(InvalidArgumentError, match=r"write_through_max_bytes must be an int >= 0, got -1"):
        Offloader(layout, [CPUTier(capacity_bytes=1 << 20)], write_through_max_bytes=-1)
    with pytest.raises(InvalidArgumentError, match=r"close_timeout must be >= 0, got -1"):
        Offloader(layout, [CPUTier(capacity_bytes=1 << 20)], close_timeout=-1)


def test_bad_eviction_name_is_rejected_with_the_valid_names() -> None:
    with pytest.raises(
        InvalidArgumentError, match=r"eviction must be one of \[.*'lru'.*\] or an EvictionPolicy, got 'mru'"
    ):
        Offloader(make_layout(), [CPUTier(capacity_bytes=1 << 20)], eviction="mru")
    with pytest.raises(InvalidArgumentError, match=r"eviction must be one of .* got 'fifo'"):
        Offloader(make_layout(), [CPUTier(capacity_bytes=1 << 20, eviction="fifo")])


def test_a_cpu_tier_serves_one_offloader() -> None:
    tier = CPUTier(capacity_bytes=1 << 20)
    Offloader(make_layout(), [tier])
    with pytest.raises(InvalidArgumentError, match=r"a CPUTier can serve only one offloader"):
        Offloader(make_layout(), [tier])


@pytest.mark.asyncio
async def test_open_before_async_with_is_rejected() -> None:
    layout = make_layout()
    off = Offloader(layout, [CPUTier(capacity_bytes=1 << 20)])
    with pytest.raises(ClosedError, match=r"offloader is not started; use 'async with Offloader\(...\)'"):
        off.open("r", [1, 2, 3])
    async with off:
        off.open("r", [1, 2, 3])
    with pytest.raises(ClosedError, match=r"offloader is closed"):
        off.open("r2", [1, 2, 3])
    with pytest.raises(ClosedError, match=r"offloader cannot be started twice \(it is closed\)"):
        await off.start()


@pytest.mark.asyncio
async def test_duplicate_request_id_is_rejected_and_the_first_request_is_untouched(off: Offloader) -> None:
    first = off.open("r1", list(range(10)))
    first.step(8, new_block_ids=[0, 1])
    before = snapshot(off)
    with pytest.raises(DuplicateRequestError, match=r"request_id 'r1' is already open"):
        off.open("r1", list(range(10)))
    assert snapshot(off) == before
    assert off.get("r1") is first
    first.step(10, [10, 11], [2])
    await first.finish()
    assert off.stats().blocks_stored == 2
    off.open("r1", list(range(10)))  # the id is free again once the first request ended


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("args", "kwargs", "exc", "match"),
    [
        ((True, [1]), {}, InvalidTypeError, r"request_id must be a str or int, got bool"),
        (
            ("r", "abc"),
            {},
            InvalidTypeError,
            r"prompt_token_ids must be a sequence of ints, got (a string|str)",
        ),
        (("r", [1, None]), {}, InvalidTypeError, r"prompt_token_ids must (be a sequence of|contain) ints"),
        (("r", []), {}, InvalidArgumentError, r"prompt_token_ids must not be empty"),
        (
            ("r", [1], 1.5),
            {},
            InvalidTypeError,
            r"(salt|hash keys) must be None, bool, int, str, bytes or tuples of them, got float",
        ),
        (("r", [1], ("t", object())), {}, InvalidTypeError, r"got object"),
        (
            ("r", [1]),
            {"extra_keys": [{"lora": 1}]},
            InvalidTypeError,
            r"must be None, bool, int, str, bytes or tuples of them, got dict",
        ),
    ],
)
async def test_open_rejects_bad_arguments_without_side_effects(
    off: Offloader, args: tuple[Any, ...], kwargs: dict[str, Any], exc: type[Exception], match: str
) -> None:
    before = snapshot(off)
    with pytest.raises(exc, match=match):
        off.open(*args, **kwargs)
    assert snapshot(off) == before
    assert off.get("r") is None
    off.open("r", [1, 2, 3])  # the id was not taken by the rejected call


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("tokens", "exc", "match"),
    [
        ([1, 2.5, 3], InvalidTypeError, r"prompt_token_ids must (be a sequence of|contain) ints"),
        ([1, 2.0, 3], InvalidTypeError, r"prompt_token_ids must (be a sequence of|contain) ints"),
        ([1, "7", 3], InvalidTypeError, r"prompt_token_ids must (be a sequence of|contain) ints"),
        ([True, 2, 3], InvalidTypeError, r"prompt_token_ids must (be a sequence of|contain) ints"),
        (
            [2**70, 1, 2, 3, 4, 5, 6, 7, 8],
            InvalidArgumentError,
            r"prompt_token_ids must be in the int64 range",
        ),
    ],
)
async def test_open_rejects_token_ids_that_would_hash_wrongly(
    off: Offloader, tokens: list[Any], exc: type[Exception], match: str
) -> None:
    """Regression: open() ran ``int(t)`` over the prompt, so 2.5 became 2 and "7" became 7 (silently wrong
    hashes), and a token outside int64 was accepted and later killed the request task with the
    InvalidArgumentError of ``block_hashes`` on its first store ('Task exception was never retrieved')."""
    before = snapshot(off)
    with pytest.raises(exc, match=match):
        off.open("r", tokens)
    assert off.get("r") is None
    assert snapshot(off) == before


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("new_tokens", "exc", "match"),
    [
        ([1.5], InvalidTypeError, r"new_token_ids must (be a sequence of|contain) ints"),
        (["7"], InvalidTypeError, r"new_token_ids must (be a sequence of|contain) ints"),
        ([False], InvalidTypeError, r"new_token_ids must (be a sequence of|contain) ints"),
        ([2**63], InvalidArgumentError, r"new_token_ids must be in the int64 range"),
    ],
)
async def test_step_rejects_token_ids_that_would_hash_wrongly(
    off: Offloader, new_tokens: list[Any], exc: type[Exception], match: str
) -> None:
    req = off.open("r", list(range(7)))
    req.step(4, new_block_ids=[0, 1])
    req_before = request_snapshot(req)
    with pytest.raises(exc, match=match):
        req.step(8, new_tokens)
    assert request_snapshot(req) == req_before
    req.step(8, [7])
    await req.finish()
    assert req.state is RequestState.FINISHED
    assert off.stats().blocks_stored == 2


# -------------------------------------------------------------------------------------- step / load
@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("step_args", "exc", "match"),
    [
        ((4, (), [16]), BlockRangeError, r"new_block_ids must be in \[0, 16\), got 16"),
        ((4, (), [5, 5]), InvalidArgumentError, r"new_block_ids must not contain duplicates, got \[5, 5\]"),
        (
            (4, (), [0]),
            InvalidArgumentError,
            r"new_block_ids must not repeat a block the request holds, got 0",
        ),
        ((4, (), [2.0]), InvalidTypeError, r"new_block_ids must contain ints, got 2.0"),
        ((4, (), ["2"]), InvalidTypeError, r"new_block_ids must contain ints, got '2'"),
        ((4.0, (), ()), InvalidTypeError, r"num_computed_tokens must be an int, got float"),
        ((3, (), ()), InvalidArgumentError, r"num_computed_tokens must not decrease, got 3 after 4"),
        ((11, (), [2]), InvalidArgumentError, r"num_computed_tokens must be <= known tokens \(10\), got 11"),
        (
            (9, (), ()),
            InvalidArgumentError,
            r"num_computed_tokens must fit in the request's 2 blocks of 4 tokens, got 9",
        ),
        ((8, [1, None], ()), InvalidTypeError, r"new_token_ids must (be a sequence of|contain) ints"),
    ],
)
async def test_rejected_step_leaves_the_request_and_stats_unchanged(
    off: Offloader, step_args: tuple[Any, ...], exc: type[Exception], match: str
) -> None:
    req = off.open("r", list(range(10)))
    req.step(4, new_block_ids=[0, 1])
    before, req_before = snapshot(off), request_snapshot(req)
    with pytest.raises(exc, match=match):
        req.step(*step_args)
    assert request_snapshot(req) == req_before
    assert snapshot(off) == before
    # The request continues as if the bad call never happened.
    req.step(10, new_block_ids=[2])
    await req.finish()
    assert req.state is RequestState.FINISHED
    assert off.stats().blocks_stored == 2


@pytest.mark.asyncio
async def test_rejected_step_with_new_blocks_can_be_retried() -> None:
    """Regression: step() appended ``new_block_ids`` (and ``new_token_ids``) before validating
    ``num_computed_tokens``, so a rejected step left the block in the table and the corrected retry failed
    with 'must not repeat a block the request holds'."""
    layout = make_layout()
    async with Offloader(layout, [CPUTier(capacity_bytes=64 * layout.slot_bytes)]) as off:
        req = off.open("r", list(range(6)))
        req.step(4, new_block_ids=[0])
        with pytest.raises(InvalidArgumentError, match=r"must be <= known tokens \(7\), got 9"):
            req.step(9, new_token_ids=[6], new_block_ids=[1, 2])
        assert req.block_ids == (0,)
        assert req.token_ids == list(range(6))
        req.step(7, new_token_ids=[6], new_block_ids=[1])
        assert req.block_ids == (0, 1)
        await req.finish()


@pytest.mark.asyncio
async def test_step_accepts_numpy_block_ids(off: Offloader) -> None:
    """Regression: ``if new_block_ids:`` raised numpy's 'truth value of an array is ambiguous' for a
    numpy array of block ids, although ``check_block_ids`` accepts arrays and tensors."""
    req = off.open("r", list(range(10)))
    req.step(8, new_block_ids=np.array([3, 4]))
    req.step(10, new_block_ids=torch.tensor([5]))
    assert req.block_ids == (3, 4, 5)
    await req.finish()


@pytest.mark.asyncio
async def test_load_rejects_bad_block_ids_and_keeps_the_lookup(off: Offloader) -> None:
    tokens = list(range(13))
    writer = off.open("w", tokens)
    writer.step(12, new_block_ids=[0, 1, 2, 3])
    await writer.finish()

    req = off.open("r", tokens)
    with pytest.raises(RequestStateError, match=r"load\(\) needs a completed lookup\(\) first"):
        req.load([4])
    assert await req.lookup() == 12
    before, req_before = snapshot(off), request_snapshot(req)
    cases: list[tuple[Any, type[Exception], str]] = [
        ([4, 16], BlockRangeError, r"block_ids must be in \[0, 16\), got 16"),
        ([4, 4], InvalidArgumentError, r"block_ids must not contain duplicates"),
        ([4, "5"], InvalidTypeError, r"block_ids must contain ints, got '5'"),
        ([4, 5.5], InvalidTypeError, r"block_ids must contain ints, got 5.5"),
        (
            [4, 5, 6, 7],
            InvalidArgumentError,
            r"block_ids must have at most 3 blocks \(the last lookup's hit\), got 4",
        ),
    ]
    for ids, exc, match in cases:
        with pytest.raises(exc, match=match):
            req.load(ids)
        assert request_snapshot(req) == req_before
        assert snapshot(off) == before
        assert off.stats().tiers[0].pinned == 3  # the lookup's pins are kept for the retry
    assert await req.load([4, 5, 6]) == 12
    for b_src, b_dst in zip([0, 1, 2], [4, 5, 6], strict=True):
        for t in off.layout.tensors:
            assert torch.equal(t[b_src], t[b_dst])
    await req.finish()
    assert off.stats().tiers[0].pinned == 0


@pytest.mark.asyncio
async def test_lookup_and_load_need_a_request_without_blocks(off: Offloader) -> None:
    req = off.open("r", list(range(10)))
    req.step(4, new_block_ids=[0])
    with pytest.raises(
        RequestStateError, match=r"lookup\(\) needs a request holding no blocks .* is running"
    ):
        req.lookup()
    with pytest.raises(
        RequestStateError, match=r"load\(\) needs a request holding no blocks, request 'r' is running"
    ):
        req.load([1])
    req.step(8, new_block_ids=[1])
    await req.finish()


# ----------------------------------------------------------------------------------- after the end
@pytest.mark.asyncio
@pytest.mark.parametrize("end", ["finish", "abort"])
async def test_calls_after_the_end_raise_request_state_error(off: Offloader, end: str) -> None:
    req = off.open("r", list(range(10)))
    req.step(8, new_block_ids=[0, 1])
    completion = getattr(req, end)()
    # Rejected at once, even before the end resolves ...
    for call in (lambda: req.step(8), req.lookup, lambda: req.load([2]), req.preempt, req.finish):
        with pytest.raises(RequestStateError, match=r"\(\) after the request ended: request 'r' is"):
            call()
    await completion
    expected = RequestState.FINISHED if end == "finish" else RequestState.ABORTED
    assert req.state is expected
    before = snapshot(off)
    # ... and after it.
    with pytest.raises(
        RequestStateError, match=rf"step\(\) after the request ended: request 'r' is {expected.value}"
    ):
        req.step(8)
    with pytest.raises(
        RequestStateError, match=rf"lookup\(\) after the request ended: request 'r' is {expected.value}"
    ):
        req.lookup()
    with pytest.raises(RequestStateError, match=r"load\(\) after the request ended"):
        req.load([2])
    with pytest.raises(RequestStateError, match=r"preempt\(\) after the request ended"):
        req.preempt()
    with pytest.raises(RequestStateError, match=r"finish\(\) after the request ended"):
        req.finish()
    # abort() is idempotent: it resolves at once and changes nothing.
    await req.abort()
    await req.abort()
    assert req.state is expected
    assert snapshot(off) == before


@pytest.mark.asyncio
async def test_abort_while_finishing_resolves() -> None:
    """Regression: abort() called after finish() but before finish resolved posted an ABORT event that
    the request task never processed (it returns after FINISH), so awaiting the abort -- and therefore
    ``Offloader.aclose()``, which aborts every open request -- hung forever."""
    layout = make_layout()
    async with Offloader(layout, [CPUTier(capacity_bytes=64 * layout.slot_bytes)]) as off:
        req = off.open("r", list(range(10)))
        req.step(8, new_block_ids=[0, 1])
        finishing = req.finish()
        aborting = req.abort()
        await finishing
        for _ in range(3):  # the task has returned; let any callback run
            await asyncio.sleep(0)
        assert aborting.done()
        await aborting
        assert req.state is RequestState.FINISHED


@pytest.mark.asyncio
async def test_aclose_with_a_finishing_request_returns() -> None:
    """Regression (same root cause as above): aclose() right after an un-awaited finish() hung."""
    layout = make_layout()
    off = Offloader(layout, [CPUTier(capacity_bytes=64 * layout.slot_bytes)])
    await off.start()
    req = off.open("r", list(range(10)))
    req.step(8, new_block_ids=[0, 1])
    finishing = req.finish()
    await asyncio.wait_for(off.aclose(), 2)  # a hang guard, not a wait
    await finishing
    assert off.stats().blocks_stored == 2
