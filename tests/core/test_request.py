"""The request state machine: what gets stored when, the reuse guarantee, cancellation."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

import aiokv
import aiokv.transfer
from aiokv import CPUTier, Offloader, RequestState

from ._schedules import run_schedule
from ._sim import Gate, SimEngine, running_hashes

pytestmark = pytest.mark.asyncio


def _offloader(eng: SimEngine, blocks: int = 64, eviction: str = "lru") -> Offloader:
    return Offloader(
        eng.layout, tiers=[CPUTier(capacity_bytes=blocks * eng.layout.slot_bytes)], eviction=eviction
    )


async def _prefill_and_decode(
    eng: SimEngine, req: aiokv.Request, tokens: list[int], decode: list[int], *, skip_computed: int = 0
) -> list[int]:
    """Drive one request like an engine: prefill its tokens, then one step per sampled token in ``decode``.

    The first sampled token comes from the prefill step; each later one from a decode step that computes the
    previous token. Returns the engine blocks the request holds.
    """
    bs = eng.block_size
    blocks = list(req.block_ids)
    computed = skip_computed
    hashes = running_hashes(tokens + decode)
    for i, sampled in enumerate(decode):
        end = len(tokens) + i  # tokens known before this step's sample
        need = -(-end // bs) - len(blocks)
        new = eng.alloc(need) if need > 0 else []
        assert new is not None
        blocks += new
        eng.compute(tokens + decode, hashes, blocks, computed, end)
        req.step(end, new_token_ids=(sampled,), new_block_ids=new)
        computed = end
    return blocks


async def _seed(eng: SimEngine, off: Offloader, prompt: list[int]) -> None:
    """Serve ``prompt`` once (prefill, one sampled token, finish) so its full blocks are cached."""
    seed = off.open("seed", prompt)
    await seed.lookup()
    blocks = await _prefill_and_decode(eng, seed, prompt, [1])
    await seed.finish()
    eng.release(blocks)


async def test_block_completed_by_final_step_is_stored() -> None:
    """Block 16, prompt 30, three sampled tokens: the final decode step completes block 1 (tokens 16..31)
    and the request finishes in the same breath. vLLM dropped that block; it must be stored here."""
    eng = SimEngine(block_size=16)
    prompt = list(range(100, 130))
    decode = [7, 8, 9]  # t30 from prefill, t31 and t32 from decode steps; t32's KV is never written
    async with _offloader(eng) as off:
        req = off.open("a", prompt)
        assert await req.lookup() == 0
        blocks = await _prefill_and_decode(eng, req, prompt, decode)
        assert req.num_computed_tokens == 32
        await req.finish()
        eng.release(blocks)
        assert off.stats().blocks_stored == 2

        follow = prompt + decode[:2] + [1, 2, 3]
        req2 = off.open("b", follow)
        assert await req2.lookup() == 32
        dst = eng.alloc(2)
        assert dst is not None
        await req2.load(dst)
        hashes = running_hashes(follow)
        eng.check_block(hashes, dst[0], 0)
        eng.check_block(hashes, dst[1], 1)
        await req2.abort()


@pytest.mark.parametrize("prompt_len", [2 * 16 - 1, 2 * 16 - 2])
async def test_eos_stores_only_blocks_whose_kv_was_written(prompt_len: int) -> None:
    """Prompts of 31 and 30 tokens ending with EOS after prefill: the sampled token's KV is never written, so
    block 1 is incomplete and only block 0 is stored."""
    eng = SimEngine(block_size=16)
    prompt = list(range(prompt_len))
    async with _offloader(eng) as off:
        req = off.open("a", prompt)
        await req.lookup()
        blocks = await _prefill_and_decode(eng, req, prompt, [99] * (32 - prompt_len))
        await req.finish()
        eng.release(blocks)
        assert off.stats().blocks_stored == 1
        probe = off.open("b", prompt + [99] * (32 - prompt_len) + [5])
        assert await probe.lookup() == 16
        await probe.abort()


async def test_state_is_shown_in_repr_and_transitions() -> None:
    eng = SimEngine(block_size=4)
    async with _offloader(eng) as off:
        req = off.open("r", [1, 2, 3, 4, 5])
        assert req.state is RequestState.WAITING
        assert "WAITING" in repr(req)
        await req.lookup()
        blocks = await _prefill_and_decode(eng, req, [1, 2, 3, 4, 5], [6])
        assert req.state is RequestState.RUNNING
        fin = req.finish()
        assert req.state is RequestState.FINISHING
        await fin
        assert req.state is RequestState.FINISHED
        assert "FINISHED" in repr(req)
        eng.release(blocks)
        assert off.get("r") is None  # the id may be reused
        await off.open("r", [1]).abort()


async def test_preempted_request_resumes_from_its_own_generated_tokens() -> None:
    """After preempt() the request holds nothing; lookup() then sees prompt + generated tokens."""
    eng = SimEngine(block_size=4)
    prompt = list(range(10))
    decode = [50, 51, 52, 53, 54, 55]
    async with _offloader(eng) as off:
        req = off.open("p", prompt)
        await req.lookup()
        blocks = await _prefill_and_decode(eng, req, prompt, decode)
        assert req.num_computed_tokens == 15
        await req.preempt()
        assert req.state is RequestState.PREEMPTED
        assert req.block_ids == ()
        eng.release(blocks)
        hit = await req.lookup()
        assert hit == 12  # 16 known tokens -> at most 15 reusable -> 3 full blocks
        dst = eng.alloc(3)
        assert dst is not None
        await req.load(dst)
        hashes = running_hashes(prompt + decode)
        for i, b in enumerate(dst):
            eng.check_block(hashes, b, i)
        # Resume: compute tokens 12..15 into a new block and keep going.
        new = eng.alloc(1)
        assert new is not None
        blocks = dst + new
        eng.compute(prompt + decode, hashes, blocks, 12, 16)
        req.step(16, new_token_ids=(56,), new_block_ids=new)
        await req.finish()
        assert off.stats().blocks_stored == 4


async def test_salt_isolates_tenants() -> None:
    eng = SimEngine(block_size=4)
    async with _offloader(eng) as off:
        req = off.open("a", list(range(9)), salt="tenant-a")
        await req.lookup()
        blocks = await _prefill_and_decode(eng, req, list(range(9)), [1])
        await req.finish()
        eng.release(blocks)
        other = off.open("b", list(range(9)), salt="tenant-b")
        same = off.open("c", list(range(9)), salt="tenant-a")
        assert await other.lookup() == 0
        assert await same.lookup() == 8
        await other.abort()
        await same.abort()


async def test_failed_store_is_never_visible(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(self: object, a: object, b: object) -> None:
        raise OSError("injected copy failure")

    monkeypatch.setattr(aiokv.transfer.TransferExecutor, "_copy_store", broken)
    eng = SimEngine(block_size=4)
    async with _offloader(eng) as off:
        req = off.open("a", list(range(9)))
        await req.lookup()
        blocks = await _prefill_and_decode(eng, req, list(range(9)), [1])
        await req.finish()  # still resolves: the blocks are reusable, the entries were dropped
        eng.release(blocks)
        s = off.stats()
        assert s.store_errors == 2
        assert s.blocks_stored == 0
        assert off.cpu.stats().used_slots == 0
        probe = off.open("b", list(range(9)))
        assert await probe.lookup() == 0
        await probe.abort()
        off.cpu.index.check_invariants()


async def test_cancelled_load_before_submission_leaves_no_trace(monkeypatch: pytest.MonkeyPatch) -> None:
    """The awaiting task is cancelled after load() posted its event but before the request task ran it:
    nothing is copied, no entry stays pinned, and the request can look up again."""
    eng = SimEngine(block_size=4)
    prompt = list(range(9))
    async with _offloader(eng) as off:
        await _seed(eng, off, prompt)

        req = off.open("r", prompt)
        assert await req.lookup() == 8
        assert off.cpu.stats().pinned == 2
        dst = eng.alloc(2)
        assert dst is not None

        async def do_load() -> None:
            await req.load(dst)

        task = asyncio.create_task(do_load())
        await asyncio.sleep(0)  # scheduling point: do_load posts the LOAD event and awaits it
        task.cancel()  # ...before the request task, scheduled after us, processes the event
        with pytest.raises(asyncio.CancelledError):
            await task
        probe = req.lookup()  # queued behind the withdrawn load; resolves after it was skipped
        assert await probe == 8
        assert off.stats().blocks_loaded == 0
        assert req.state is RequestState.WAITING
        await req.abort()
        assert off.cpu.stats().pinned == 0
        for b in dst:  # never written
            assert eng.tensors[0][b, 0, 0].item() == -7.0


async def test_cancelled_load_after_submission_keeps_blocks_guarded(monkeypatch: pytest.MonkeyPatch) -> None:
    """Once the copy is on its stream it cannot be recalled: abort() resolves only after it completed, and
    the source entries stay pinned (unevictable) until then."""
    gate = Gate()
    gate.install(monkeypatch)
    gate.open()
    eng = SimEngine(block_size=4)
    prompt = list(range(9))
    async with _offloader(eng) as off:
        await _seed(eng, off, prompt)

        gate.close()
        req = off.open("r", prompt)
        await req.lookup()
        dst = eng.alloc(2)
        assert dst is not None
        submitted = asyncio.Event()
        orig = aiokv.transfer.TransferExecutor._submit

        def spy(
            self: aiokv.transfer.TransferExecutor, kind: str, *args: Any, **kw: Any
        ) -> aiokv.transfer.TransferFuture:
            tf = orig(self, kind, *args, **kw)
            if kind == "load":
                submitted.set()
            return tf

        monkeypatch.setattr(aiokv.transfer.TransferExecutor, "_submit", spy)
        loading = asyncio.ensure_future(_wait(req.load(dst)))
        await submitted.wait()  # the request task has put the copy on its stream
        loading.cancel()
        aborting = asyncio.ensure_future(_wait(req.abort()))
        for _ in range(20):
            await asyncio.sleep(0)
        assert not aborting.done()  # the copy is still held by the gate
        assert off.cpu.stats().pinned == 2
        gate.open()
        await aborting
        assert off.cpu.stats().pinned == 0
        assert off.stats().in_flight == 0
        hashes = running_hashes([*prompt, 1])
        eng.check_block(hashes, dst[0], 0)  # the copy did complete before abort() resolved
        eng.check_block(hashes, dst[1], 1)


async def test_cancelled_finish_still_finishes_without_reporting_reuse(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    gate = Gate()
    gate.install(monkeypatch)
    eng = SimEngine(block_size=4)
    prompt = list(range(9))
    async with _offloader(eng) as off:
        req = off.open("r", prompt)
        await req.lookup()
        await _prefill_and_decode(eng, req, prompt, [1])
        finishing = asyncio.ensure_future(_wait(req.finish()))
        for _ in range(5):
            await asyncio.sleep(0)
        assert not finishing.done()
        finishing.cancel()
        with pytest.raises(asyncio.CancelledError):
            await finishing
        assert off.stats().in_flight == 1
        gate.open()
        await req.abort()  # idempotent: resolves when the request task is done
        assert req.state is RequestState.FINISHED
        s = off.stats()
        assert s.blocks_stored == 2
        assert s.in_flight == 0
        assert off.cpu.stats().pending == 0


async def test_aexit_drains_in_flight_copies(monkeypatch: pytest.MonkeyPatch) -> None:
    gate = Gate()
    gate.install(monkeypatch)
    eng = SimEngine(block_size=4)
    prompt = list(range(9))
    off = _offloader(eng)
    async with off:
        req = off.open("r", prompt)
        await req.lookup()
        await _prefill_and_decode(eng, req, prompt, [1])
        assert off.stats().in_flight == 0 or True
        gate.allow(100)
    assert off.stats().in_flight == 0
    assert req.state is RequestState.ABORTED
    with pytest.raises(aiokv.ClosedError, match="offloader is closed"):
        off.open("x", [1])


async def _wait(aw: object) -> object:
    return await aw  # type: ignore[misc]


@pytest.mark.parametrize("chunk", range(10))
async def test_reuse_race_random_schedules(chunk: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """An engine that poisons blocks the instant finish()/preempt()/abort() resolve, under seeded random
    interleavings of steps, ends, resumes and gated copies, with tiny and roomy tiers: every block ever
    loaded equals a recomputation of its prefix, and nothing is lost except by counted eviction."""
    gate = Gate()
    gate.install(monkeypatch)
    loads = evictions = 0
    for seed in range(chunk * 200, (chunk + 1) * 200):
        out = await run_schedule(seed, gate)
        loads += out["loads"]
        evictions += out["evictions"]
    assert loads > 100  # the schedules really exercised restores
    assert evictions > 0  # ...and eviction pressure


async def test_partial_last_block_is_reused_by_the_next_turn() -> None:
    """With store_partial_last_block, the next turn reuses this one up to its exact last computed token,
    not just up to the last full block."""
    eng = SimEngine(block_size=4)
    off = Offloader(
        eng.layout, tiers=[CPUTier(capacity_bytes=64 * eng.layout.slot_bytes)], store_partial_last_block=True
    )
    async with off:
        turn1 = list(range(9))
        req = off.open("t1", turn1)
        await req.lookup()
        blocks = await _prefill_and_decode(eng, req, turn1, [40, 41, 42])  # computes 9, 10, then 11 tokens
        assert req.num_computed_tokens == 11  # blocks 0-1 full, block 2 holds 3 computed tokens
        await req.finish()
        eng.release(blocks)
        s = off.stats()
        assert s.blocks_stored == 3  # two full blocks + the partial one

        turn2 = [*turn1, 40, 41, 42, 7, 7]
        t2 = off.open("t2", turn2)
        assert await t2.lookup() == 11
        dst = eng.alloc(3)
        assert dst is not None
        await t2.load(dst)
        assert t2.num_computed_tokens == 11
        h2 = running_hashes(turn2)
        eng.check_block(h2, dst[0], 0)
        eng.check_block(h2, dst[1], 1)
        for p in range(3):
            assert eng.tensors[0][dst[2], p, 0].item() == h2[8 + p]
        # The engine continues from token 11 in the partially filled block.
        eng.compute(turn2, h2, dst, 11, 12)
        t2.step(12, new_token_ids=(1,))
        await t2.finish()
        assert off.stats().blocks_stored == 4  # block 2 is now stored as a full block too


async def test_without_partial_option_hits_are_block_multiples() -> None:
    eng = SimEngine(block_size=4)
    async with _offloader(eng) as off:
        turn1 = list(range(9))
        req = off.open("t1", turn1)
        await req.lookup()
        blocks = await _prefill_and_decode(eng, req, turn1, [40, 41, 42])
        await req.finish()
        eng.release(blocks)
        t2 = off.open("t2", [*turn1, 40, 41, 42, 7])
        assert await t2.lookup() == 8
        await t2.abort()


async def test_stepping_without_load_releases_the_lookup_pins() -> None:
    """An engine may ignore a hit (e.g. no free blocks) and prefill from scratch: the pins must not outlive
    that decision, or the entries would stay unevictable for the whole request."""
    eng = SimEngine(block_size=4)
    prompt = list(range(9))
    async with _offloader(eng) as off:
        await _seed(eng, off, prompt)
        req = off.open("r", prompt)
        assert await req.lookup() == 8
        assert off.cpu.stats().pinned == 2
        blocks = await _prefill_and_decode(eng, req, prompt, [1])  # recompute, no load()
        await req.wait_processed()
        assert off.cpu.stats().pinned == 0
        await req.finish()
        eng.release(blocks)


async def test_a_store_that_cannot_be_submitted_never_hangs_finish(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*args: object) -> None:
        raise RuntimeError("injected submission bug")

    eng = SimEngine(block_size=4)
    reported: list[dict[str, Any]] = []
    asyncio.get_running_loop().set_exception_handler(lambda _loop, ctx: reported.append(ctx))
    try:
        async with _offloader(eng) as off:
            monkeypatch.setattr(off._host, "store_blocks", broken)  # what its requests call
            req = off.open("r", list(range(9)))
            await req.lookup()
            blocks = await _prefill_and_decode(eng, req, list(range(9)), [1])
            await req.finish()
            eng.release(blocks)
            assert off.stats().store_errors == 1
            assert off.stats().blocks_stored == 0
    finally:
        asyncio.get_running_loop().set_exception_handler(None)
    assert any("store for request 'r' failed" in ctx["message"] for ctx in reported)


async def test_load_resolves_to_the_tokens_it_restored_and_steps_compute_from_there() -> None:
    """Regression: with store_partial_last_block, lookup() returned 40 (two full blocks of 16 and 8 tokens of
    a third), a load of 2 blocks restored 32, and step(50) was accepted although positions 32-39 were never
    computed. load() resolves to the tokens it restored (the lookup's count only when every block found is
    loaded), and a step claiming more than that before the load resolved is refused."""
    eng = SimEngine(block_size=16)
    off = Offloader(
        eng.layout, tiers=[CPUTier(capacity_bytes=64 * eng.layout.slot_bytes)], store_partial_last_block=True
    )
    async with off:
        prompt = list(range(40))
        seed = off.open("seed", prompt)
        await seed.lookup()
        blocks = await _prefill_and_decode(
            eng, seed, prompt, [7]
        )  # computes 40: blocks 0-1 full, 8 in block 2
        await seed.finish()
        eng.release(blocks)
        turn2 = [*prompt, 7, *range(100, 110)]
        hashes = running_hashes(turn2)

        # Fewer blocks than found: the load restores exactly those blocks' tokens.
        short = off.open("short", turn2)
        assert await short.lookup() == 40
        dst = eng.alloc(2)
        assert dst is not None
        assert await short.load(dst) == 32
        assert short.num_computed_tokens == 32
        eng.check_tokens(hashes, dst, 32)
        await short.abort()
        eng.release(dst)

        # Every block found: the lookup's count, partial block included.
        full = off.open("full", turn2)
        assert await full.lookup() == 40
        dst = eng.alloc(3)
        new = eng.alloc(1)
        assert dst is not None
        assert new is not None
        pending = full.load(dst)
        before = (full.state, full.num_computed_tokens, full.block_ids, len(full.token_ids))
        with pytest.raises(
            aiokv.RequestStateError,
            match=r"num_computed_tokens must be <= 40 \(the tokens restored by the load in flight\) until the "
            r"load resolved, got 50: await the load",
        ):
            full.step(50, new_token_ids=[1], new_block_ids=new)
        assert (full.state, full.num_computed_tokens, full.block_ids, len(full.token_ids)) == before
        full.step(40)  # claiming nothing more than the load restores is fine
        assert await pending == 40
        eng.check_tokens(hashes, dst, 40)
        eng.compute(turn2, hashes, dst + new, 40, 50)
        full.step(50, new_token_ids=[1], new_block_ids=new)  # now computed from the restored count
        await full.finish()
        eng.release(dst + new)
