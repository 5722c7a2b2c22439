"""``Request.load(present_blocks=)`` (an engine's own prefix cache holds the first blocks) and
``Request.append_tokens`` (tokens learned after the step that computed them)."""

from __future__ import annotations

import pytest
import torch

import aiokv
from aiokv import CPUTier, Offloader, RequestState

pytestmark = pytest.mark.asyncio

BS = 16


def _kv(num_blocks: int = 32) -> list[torch.Tensor]:
    torch.manual_seed(0)
    return [torch.randn(num_blocks, BS, 2, 8) for _ in range(4)]


def _offloader(kv: list[torch.Tensor]) -> Offloader:
    layout = aiokv.KVLayout(kv, block_size=BS)
    return Offloader(layout, tiers=[CPUTier(capacity_bytes=64 * layout.slot_bytes)])


async def _seed(off: Offloader, tokens: list[int], blocks: list[int]) -> None:
    req = off.open("seed", tokens)
    assert await req.lookup() == 0
    req.step(len(tokens), new_token_ids=[1], new_block_ids=blocks)
    await req.finish()


async def test_present_blocks_are_not_written_and_the_rest_is_restored() -> None:
    kv = _kv()
    async with _offloader(kv) as off:
        prompt = list(range(3 * BS + 5))
        await _seed(off, prompt, [0, 1, 2, 3])
        for t in kv:
            t[20] = 7.0  # block 20 stands for the engine's own cached copy of block 0: it must stay as is
        req = off.open("r", prompt)
        assert await req.lookup() == 3 * BS
        restored = await req.load([20, 21, 22], present_blocks=1)
        assert restored == 3 * BS
        assert req.state is RequestState.RUNNING
        assert req.block_ids == (20, 21, 22)
        for t in kv:
            assert torch.all(t[20] == 7.0)
            assert torch.equal(t[21], t[1])
            assert torch.equal(t[22], t[2])
        assert off.stats().blocks_loaded == 2
        req.step(len(prompt), new_token_ids=[9], new_block_ids=[23])
        await req.finish()


async def test_all_blocks_present_copies_nothing() -> None:
    kv = _kv()
    async with _offloader(kv) as off:
        prompt = list(range(2 * BS + 1))
        await _seed(off, prompt, [0, 1, 2])
        req = off.open("r", prompt)
        assert await req.lookup() == 2 * BS
        assert await req.load([5, 6], present_blocks=2) == 2 * BS
        assert off.stats().blocks_loaded == 0
        assert req.state is RequestState.RUNNING
        await req.abort()


@pytest.mark.parametrize(
    ("present", "error", "message"),
    [
        (-1, aiokv.InvalidArgumentError, "present_blocks must be in [0, 2] (the blocks passed), got -1"),
        (3, aiokv.InvalidArgumentError, "present_blocks must be in [0, 2] (the blocks passed), got 3"),
        (True, aiokv.InvalidTypeError, "present_blocks must be an int, got bool"),
    ],
)
async def test_bad_present_blocks_is_refused_and_changes_nothing(
    present: object, error: type[Exception], message: str
) -> None:
    kv = _kv()
    async with _offloader(kv) as off:
        prompt = list(range(2 * BS + 1))
        await _seed(off, prompt, [0, 1, 2])
        req = off.open("r", prompt)
        assert await req.lookup() == 2 * BS
        with pytest.raises(error) as info:
            req.load([5, 6], present_blocks=present)  # type: ignore[arg-type]
        assert str(info.value) == message
        assert req.state is RequestState.WAITING
        assert req.block_ids == ()
        assert await req.load([5, 6]) == 2 * BS  # the lookup still stands
        await req.abort()


async def test_append_tokens_lets_a_later_step_store_the_block_they_complete() -> None:
    """Asynchronous scheduling: the step that computed token 31 is reported before token 31 is known;
    the block is stored by the next step once the token arrived, and appending alone stores nothing."""
    kv = _kv()
    async with _offloader(kv) as off:
        tokens = list(range(BS + 15))  # 31 tokens known
        for rid, claim in (("only-appended", False), ("stepped", True)):
            req = off.open(rid, tokens)
            await req.lookup()
            req.step(BS + 15, new_block_ids=[0, 1] if rid == "only-appended" else [2, 3])
            req.append_tokens([99])  # token 31 learned late
            assert req.num_computed_tokens == BS + 15
            if claim:
                req.step(2 * BS)
            await req.finish()
            follow = off.open(f"follow-{rid}", [*tokens, 99, 5])
            assert await follow.lookup() == (2 * BS if claim else BS)
            await follow.abort()


async def test_append_tokens_to_a_preempted_request_extends_its_next_lookup() -> None:
    kv = _kv()
    async with _offloader(kv) as off:
        tokens = list(range(3 * BS + 1))
        await _seed(off, tokens, [0, 1, 2, 3])
        req = off.open("r", tokens[: BS + 1])
        assert await req.lookup() == BS
        req.step(BS + 1, new_block_ids=[10, 11])
        await req.preempt()
        req.append_tokens(tokens[BS + 1 :])
        assert await req.lookup() == 3 * BS
        await req.abort()


async def test_append_tokens_after_the_end_is_refused() -> None:
    kv = _kv()
    async with _offloader(kv) as off:
        req = off.open("r", [1, 2, 3])
        await req.abort()
        with pytest.raises(aiokv.RequestStateError, match="append_tokens\\(\\) after the request ended"):
            req.append_tokens([4])
        req2 = off.open("r2", [1, 2, 3])
        with pytest.raises(aiokv.InvalidTypeError):
            req2.append_tokens(["x"])  # type: ignore[list-item]
        assert req2.token_ids == [1, 2, 3]
        await req2.abort()
