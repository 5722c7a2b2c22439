"""Stores completed by ``step()`` on the CPU backend are submitted together at the end of the loop tick.

``Request.step`` (and its C fast path) only records a completed block; the executor's end-of-tick flush
reserves the slots of every block recorded during the tick and submits them as one copy. Whatever the engine
does after the step -- ``finish()``, ``preempt()``, ``abort()``, another ``step()`` that needs the Python
path, ``executor.drain()`` -- submits the recorded stores first, so the order is the order of an immediate
submission. These tests pin each of those orders with KV that is checked after the engine reused the blocks,
and show that a tick's stores from many requests are one copy.
"""

from __future__ import annotations

import asyncio
import random

import pytest

import aiokv
from aiokv import CPUTier, Offloader

from ._sim import SimEngine, running_hashes

pytestmark = pytest.mark.asyncio

BS = 4


def _offloader(eng: SimEngine, blocks: int = 64) -> Offloader:
    return Offloader(eng.layout, tiers=[CPUTier(capacity_bytes=blocks * eng.layout.slot_bytes)])


async def _running(
    off: Offloader, eng: SimEngine, rid: str, prompt: list[int]
) -> tuple[aiokv.Request, list[int]]:
    """A request whose prompt (minus its last token) is computed, so the next step completes a block."""
    req = off.open(rid, prompt)
    assert await req.lookup() == 0
    blocks = eng.alloc(-(-len(prompt) // BS))
    assert blocks is not None
    hashes = running_hashes(prompt)
    eng.compute(prompt, hashes, blocks, 0, len(prompt) - 1)
    req.step(len(prompt) - 1, (), blocks)
    await req.wait_processed()
    await off.executor.drain()
    return req, blocks


async def _restored(off: Offloader, eng: SimEngine, prompt: list[int]) -> int:
    """Tokens of ``prompt`` a new request continuing it restores, after checking the KV it got (a lookup
    leaves a prompt's last token to compute, hence the one more token)."""
    prompt = [*prompt, 7]
    req = off.open(f"check-{random.random()}", prompt)
    hit = await req.lookup()
    dst = eng.alloc(-(-hit // BS)) if hit else []
    assert dst is not None
    if hit:
        assert await req.load(dst) == hit
        eng.check_tokens(running_hashes(prompt), dst, hit)
    await req.abort()
    eng.release(dst)
    return hit


@pytest.mark.parametrize("after", ["finish", "preempt"])
async def test_a_block_completed_by_the_step_right_before_finish_or_preempt_is_stored(after: str) -> None:
    eng = SimEngine(block_size=BS)
    async with _offloader(eng) as off:
        prompt = list(range(100, 108))  # two blocks; the step below completes the second
        req, blocks = await _running(off, eng, "r", prompt)
        assert off.stats().blocks_stored == 1
        eng.compute(prompt, running_hashes(prompt), blocks, 7, 8)
        req.step(8, new_token_ids=[0])  # completes block 1; recorded, not yet submitted
        assert off.stats().blocks_stored == 1
        await (req.finish() if after == "finish" else req.preempt())  # same tick: the store goes first
        eng.release(blocks)  # the engine reuses (poisons) the blocks at once
        assert off.stats().blocks_stored == 2
        assert await _restored(off, eng, prompt) == 8
        if after == "preempt":
            await req.abort()


async def test_abort_right_after_the_step_drops_the_recorded_store_and_serves_nothing_wrong() -> None:
    eng = SimEngine(block_size=BS)
    async with _offloader(eng) as off:
        prompt = list(range(200, 208))
        req, blocks = await _running(off, eng, "r", prompt)
        eng.compute(prompt, running_hashes(prompt), blocks, 7, 8)
        req.step(8, new_token_ids=[0])
        await req.abort()  # stores not yet submitted are dropped
        eng.release(blocks)
        stats = off.stats()
        assert (stats.blocks_stored, stats.in_flight, stats.store_errors) == (1, 0, 0)
        assert await _restored(off, eng, prompt) == 4  # only the block stored before the step


async def test_drain_right_after_the_step_waits_for_the_recorded_store() -> None:
    eng = SimEngine(block_size=BS)
    async with _offloader(eng) as off:
        prompt = list(range(300, 308))
        req, blocks = await _running(off, eng, "r", prompt)
        eng.compute(prompt, running_hashes(prompt), blocks, 7, 8)
        req.step(8, new_token_ids=[0])
        await off.executor.drain()
        assert off.stats().blocks_stored == 2
        await req.finish()


async def test_a_ticks_stores_from_many_requests_are_one_copy_with_each_requests_kv() -> None:
    eng = SimEngine(num_blocks=64, block_size=BS)
    async with _offloader(eng) as off:
        prompts = [list(range(1000 * i, 1000 * i + 8)) for i in range(1, 9)]
        running = [await _running(off, eng, f"r{i}", p) for i, p in enumerate(prompts)]
        before = off.executor.stats()
        for (req, blocks), p in zip(running, prompts, strict=True):
            eng.compute(p, running_hashes(p), blocks, 7, 8)
            req.step(8, new_token_ids=[0])
        await asyncio.sleep(0)  # the tick ends: one flush
        await off.executor.drain()
        after = off.executor.stats()
        assert after.batches - before.batches == 1
        assert off.stats().blocks_stored == 16
        for (req, blocks), _p in zip(running, prompts, strict=True):
            await req.finish()
            eng.release(blocks)
        for p in prompts:
            assert await _restored(off, eng, p) == 8


async def test_a_request_whose_task_is_busy_gets_its_store_in_order_after_what_it_is_doing() -> None:
    """The step after a first step that left the lookup's pins (a LOAD of nothing is queued): the recorded
    store goes to the task as an event, behind that one, exactly as an immediate submission would."""
    eng = SimEngine(block_size=BS)
    async with _offloader(eng) as off:
        prompt = list(range(400, 412))
        req = off.open("r", prompt)
        assert await req.lookup() == 0
        blocks = eng.alloc(3)
        assert blocks is not None
        hashes = running_hashes(prompt)
        eng.compute(prompt, hashes, blocks, 0, 11)
        req.step(4, (), blocks)  # the Python path: the task gets an event to run
        req.step(8)  # C path: records block 1 while the task is busy
        req.step(11)
        eng.compute(prompt, hashes, blocks, 11, 12)
        req.step(12, new_token_ids=[0])
        await req.finish()
        eng.release(blocks)
        assert off.stats().blocks_stored == 3
        assert await _restored(off, eng, prompt) == 12


async def test_a_store_that_cannot_be_submitted_at_the_flush_is_counted_and_the_request_still_ends(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    eng = SimEngine(block_size=BS)
    async with _offloader(eng) as off:
        prompt = list(range(500, 508))
        req, blocks = await _running(off, eng, "r", prompt)
        eng.compute(prompt, running_hashes(prompt), blocks, 7, 8)

        def refuse(*_args: object, **_kwargs: object) -> None:
            raise RuntimeError("no submission now")

        errors: list[dict[str, object]] = []
        asyncio.get_running_loop().set_exception_handler(lambda _loop, ctx: errors.append(ctx))
        monkeypatch.setattr(off.executor, "_submit", refuse)
        req.step(8, new_token_ids=[0])
        await req.finish()
        monkeypatch.undo()
        eng.release(blocks)
        stats = off.stats()
        assert (stats.blocks_stored, stats.store_errors, stats.in_flight) == (1, 1, 0)
        assert errors
        assert "no submission now" in repr(errors[0]["exception"])
        assert await _restored(off, eng, prompt) == 4  # the reservation was released: a miss, never garbage


@pytest.mark.parametrize("seed", range(6))
async def test_random_schedules_of_steps_and_ends_within_ticks_serve_only_correct_kv(seed: int) -> None:
    """Several requests step, finish, preempt and abort in random orders within and across ticks; every
    prefix a later request restores carries its own KV, and every block a finished request completed is
    stored."""
    rng = random.Random(seed)
    eng = SimEngine(num_blocks=128, block_size=BS)
    async with _offloader(eng, blocks=128) as off:
        prompts = [[rng.randrange(1 << 20) for _ in range(rng.randrange(5, 14))] for _ in range(6)]
        state = [await _running(off, eng, f"r{i}", p) for i, p in enumerate(prompts)]
        done: list[tuple[str, list[int]]] = []
        pending = list(range(len(prompts)))
        while pending:
            rng.shuffle(pending)
            for i in list(pending):
                req, blocks = state[i]
                p = prompts[i]
                action = rng.choice(["step", "step", "finish", "preempt", "abort", "yield"])
                if action == "step" and req.num_computed_tokens < len(p):
                    eng.compute(p, running_hashes(p), blocks, req.num_computed_tokens, len(p))
                    req.step(len(p), new_token_ids=[0])
                elif action in ("finish", "preempt", "abort"):
                    end = (
                        req.finish()
                        if action == "finish"
                        else req.preempt()
                        if action == "preempt"
                        else req.abort()
                    )
                    await end
                    if action == "preempt":
                        await req.abort()
                    eng.release(blocks)
                    done.append(
                        (action if req.num_computed_tokens == len(p) or action != "finish" else "partial", p)
                    )
                    pending.remove(i)
                elif action == "yield":
                    await asyncio.sleep(0)
        for action, p in done:
            hit = await _restored(off, eng, p)
            if action == "finish":
                assert hit == len(p) // BS * BS
