"""The engine: offloading on vs off, the block-reuse guarantee, preemption, streaming, cancellation."""

from __future__ import annotations

import asyncio
import contextlib
import random
import threading
from collections.abc import Sequence
from typing import Any

import pytest
import torch

import aiokv
import aiokv.testing
from aiokv.engine import Engine, EngineStats, PagedKVCache, Transformer
from aiokv.transfer import SimulatedDevice

from ._workload import KVRecorder, chat
from .conftest import TINY

STALL_S = 60.0
"""A workload takes well under a second; this guard turns a scheduler stall into a failure, not a hang."""


def _offloader(cache: PagedKVCache, device: SimulatedDevice | None = None) -> aiokv.Offloader:
    extra: dict[str, Any] = {}
    if device is not None:
        extra = {"device": device, "compute_stream": device.new_stream("compute"), "staging_bytes": 1 << 20}
    # "always": these tests check that every restore is exact; with "decide" the tiny model's recompute can
    # beat a copy, so whether a prefix is restored would depend on the machine's timing.
    return aiokv.Offloader(
        cache.layout(),
        tiers=[aiokv.CPUTier(capacity_bytes=32 << 20)],
        eviction="lru",
        load_policy="always",
        **extra,
    )


def _assert_accounting(stats: EngineStats) -> None:
    assert (
        stats.admitted_tokens == stats.cached_tokens + stats.prefill_tokens + stats.abandoned_prefill_tokens
    )
    assert stats.forward_tokens == stats.prefill_tokens + stats.decode_tokens
    assert stats.free_blocks == stats.num_blocks
    assert stats.releasing_blocks == stats.waiting == stats.running == stats.admitting == 0


async def _run(
    model: Transformer,
    num_blocks: int,
    *,
    offload: bool,
    recorder: bool = True,
    budget: int = 64,
    device: SimulatedDevice | None = None,
    layerwise: bool = False,
    **workload: Any,
) -> tuple[dict[str, Any], EngineStats, aiokv.OffloaderStats | None, KVRecorder]:
    cache = PagedKVCache(model.config, num_blocks)
    rec = KVRecorder(cache)
    hook = rec if recorder else None
    if not offload:
        async with Engine(model, cache, max_num_batched_tokens=budget, on_blocks=hook) as engine:
            results = await asyncio.wait_for(chat(engine, **workload), STALL_S)
            await engine.wait_idle()
            return results, engine.stats(), None, rec
    async with (
        _offloader(cache, device) as off,
        Engine(
            model,
            cache,
            offloader=off,
            max_num_batched_tokens=budget,
            on_blocks=hook,
            layerwise_loads=layerwise,
        ) as engine,
    ):
        results = await asyncio.wait_for(chat(engine, **workload), STALL_S)
        await engine.wait_idle()
        return results, engine.stats(), off.stats(), rec


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("seed", "sessions", "num_blocks", "temperature", "budget"),
    [
        (0, 4, 20, 0.0, 64),
        (1, 4, 20, 0.0, 64),
        (2, 4, 20, 0.8, 64),
        (2, 6, 20, 0.0, 64),
        (3, 6, 28, 0.8, 64),
        (4, 6, 20, 0.8, 64),
        (5, 4, 20, 0.0, 17),
    ],
)
async def test_offload_matches_recompute_across_multi_turn_workloads_with_preemption(
    tiny_model: Transformer, seed: int, sessions: int, num_blocks: int, temperature: float, budget: int
) -> None:
    """Concurrent 3-turn chats on a 20- or 28-block pool (each context grows to ~12 blocks): requests are
    preempted and their prefixes leave the engine and come back from the CPU tier. Tokens, last logits and
    restored KV bytes must all be bitwise those of the recompute run.

    (2, 6, 20) is also the regression test for a stall: admission held back while a running request was
    short of blocks was never retried once that request left, with nothing left to wake the loop."""
    workload = dict(sessions=sessions, turns=3, seed=seed, temperature=temperature)
    cold, cold_stats, _, cold_kv = await _run(
        tiny_model, num_blocks, offload=False, budget=budget, **workload
    )
    warm, warm_stats, off_stats, warm_kv = await _run(
        tiny_model, num_blocks, offload=True, budget=budget, **workload
    )
    assert off_stats is not None

    assert cold.keys() == warm.keys()
    for rid, c in cold.items():
        w = warm[rid]
        assert w.output_token_ids == c.output_token_ids, rid
        # Bitwise on CPU (the forward is batch invariant); the stated fp32 tolerance elsewhere is 0.
        assert torch.equal(w.last_logits, c.last_logits), rid

    assert cold_stats.preemptions > 0
    assert warm_stats.preemptions > 0
    assert cold_stats.cached_tokens == 0
    assert warm_stats.cached_tokens > 0
    assert warm_stats.cached_tokens == off_stats.hit_tokens == sum(r.restored_tokens for r in warm.values())
    for (
        r
    ) in warm.values():  # OpenAI's meaning: prompt tokens served from the cache, never more than the prompt
        assert r.cached_tokens <= len(r.prompt_token_ids)
        assert r.cached_tokens <= r.restored_tokens
    assert any(r.restored_tokens > r.cached_tokens for r in warm.values())  # re-admissions after preemption
    assert off_stats.bytes_loaded == off_stats.hit_tokens * TINY.bytes_per_token
    _assert_accounting(cold_stats)
    _assert_accounting(warm_stats)
    # Prefill actually computed is what was admitted minus exactly what was restored (and what preemption
    # cut short); the recompute run restores nothing.
    assert (
        warm_stats.prefill_tokens
        == warm_stats.admitted_tokens - warm_stats.cached_tokens - warm_stats.abandoned_prefill_tokens
    )

    # Every restored prefix holds bitwise the KV the recompute run computed for the same positions.
    assert warm_kv.loaded
    for rid, tokens, kv in warm_kv.loaded:
        cold_tokens, cold_tensors = cold_kv.released[rid]
        n = len(tokens)
        assert cold_tokens[:n] == tokens
        for restored, computed in zip(kv, cold_tensors, strict=True):
            assert torch.equal(restored, computed[:n]), rid


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("seed", "jitter_s", "layerwise"),
    [
        (0, 0.0, False),
        (1, 0.0002, False),
        (3, 0.001, False),
        (0, 0.0, True),
        (1, 0.0002, True),
        (3, 0.001, True),
    ],
)
async def test_offload_on_a_simulated_device_matches_recompute(
    tiny_model: Transformer, seed: int, jitter_s: float, layerwise: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine schedules asynchronously on a simulated device: each forward is a kernel on the compute
    stream, ``step()`` is called before it has run (its KV lands later), and loads are awaited on the device
    (``order_before``) rather than on the host; with ``layerwise_loads`` a restore is copied layer by layer
    and the first forward over it runs each layer as a kernel ordered after that layer's copy only. With
    seeded jitter on every stream, tokens, logits and every restored KV byte must still be those of the
    recompute run."""
    workload = dict(sessions=4, turns=3, seed=seed, temperature=0.8 if seed % 2 else 0.0)
    cold, _, _, cold_kv = await _run(tiny_model, 20, offload=False, **workload)
    waits: list[int] = []
    real = aiokv.LoadCompletion.order_layer_before

    def order_layer_before(self: aiokv.LoadCompletion, index: int, stream: Any = None) -> None:
        waits.append(index)
        real(self, index, stream)

    monkeypatch.setattr(aiokv.LoadCompletion, "order_layer_before", order_layer_before)
    device = SimulatedDevice(seed=seed, jitter_s=jitter_s)
    try:
        warm, warm_stats, off_stats, warm_kv = await _run(
            tiny_model, 20, offload=True, device=device, layerwise=layerwise, **workload
        )
    finally:
        device.close()
    # Layer-wise: the first forward over each restore waited for its layers one by one, in order.
    if layerwise:
        layers = tiny_model.config.num_layers
        assert waits
        assert sorted(set(waits)) == list(range(layers))
        assert all(waits.count(i) == waits.count(0) for i in range(layers))  # every layer, for every restore
    else:
        assert waits == []
    assert off_stats is not None
    assert off_stats.backend == "sim"
    assert warm_stats.preemptions > 0
    assert warm_stats.cached_tokens > 0
    for rid, c in cold.items():
        assert warm[rid].output_token_ids == c.output_token_ids, rid
        assert torch.equal(warm[rid].last_logits, c.last_logits), rid
    _assert_accounting(warm_stats)
    assert warm_kv.loaded
    for rid, tokens, kv in warm_kv.loaded:
        cold_tokens, cold_tensors = cold_kv.released[rid]
        n = len(tokens)
        assert cold_tokens[:n] == tokens
        for restored, computed in zip(kv, cold_tensors, strict=True):
            assert torch.equal(restored, computed[:n]), rid


@pytest.mark.asyncio
async def test_prefill_computed_drops_by_exactly_the_hit_count(tiny_model: Transformer) -> None:
    """One session, five turns, a pool large enough for no preemption: the offload run computes exactly
    ``hit_tokens`` fewer prefill positions than the recompute run, and the same decode positions."""
    workload = dict(sessions=1, turns=5, seed=3)
    cold, cold_stats, _, _ = await _run(tiny_model, 64, offload=False, recorder=False, **workload)
    warm, warm_stats, off_stats, _ = await _run(tiny_model, 64, offload=True, recorder=False, **workload)
    assert off_stats is not None
    assert cold_stats.preemptions == warm_stats.preemptions == 0
    assert [r.output_token_ids for r in warm.values()] == [r.output_token_ids for r in cold.values()]
    assert off_stats.hit_tokens > 0
    assert (
        cold_stats.prefill_tokens - warm_stats.prefill_tokens
        == off_stats.hit_tokens
        == warm_stats.cached_tokens
    )
    assert cold_stats.decode_tokens == warm_stats.decode_tokens
    assert cold_stats.forward_tokens - warm_stats.forward_tokens == off_stats.hit_tokens


@pytest.mark.asyncio
async def test_preempted_request_resumes_through_lookup_and_load(tiny_model: Transformer) -> None:
    """Two requests growing to 5 blocks each on an 8-block pool: the newer one is preempted when the older
    needs a block, and resumes after it by restoring its stored blocks instead of recomputing them."""
    prompts = [[(i * 37 + j * 11) % 256 for j in range(40)] for i in range(2)]

    async def run(off: Any, cache: PagedKVCache) -> list[Any]:
        async with Engine(tiny_model, cache, offloader=off) as engine:
            out = await asyncio.gather(
                *(engine.generate(p, max_tokens=40, return_logits=True) for p in prompts)
            )
            await engine.wait_idle()
            assert engine.stats().preemptions >= 1
            return out

    cold = await run(None, PagedKVCache(TINY, 8))
    cache = PagedKVCache(TINY, 8)
    async with _offloader(cache) as off:
        warm = await run(off, cache)
    assert [r.output_token_ids for r in warm] == [r.output_token_ids for r in cold]
    resumed = warm[1]
    assert resumed.num_preemptions >= 1
    assert resumed.restored_tokens >= 16
    assert resumed.computed_prefill_tokens < cold[1].computed_prefill_tokens


class _Gate:
    """Offloader stand-in that delays ``finish``/``preempt``/``abort`` until released: a slow drain."""

    def __init__(self, off: aiokv.Offloader) -> None:
        self._off = off
        self.layout = off.layout
        self.open_gate = asyncio.Event()
        self.pending = 0

    def open(self, *args: Any, **kwargs: Any) -> _GatedHandle:
        return _GatedHandle(self, self._off.open(*args, **kwargs))


class _GatedHandle:
    def __init__(self, gate: _Gate, handle: aiokv.Request) -> None:
        self._gate = gate
        self._h = handle

    def lookup(self) -> Any:
        return self._h.lookup()

    def load(self, block_ids: Sequence[int]) -> Any:
        return self._h.load(block_ids)

    def step(self, *args: Any, **kwargs: Any) -> None:
        self._h.step(*args, **kwargs)

    async def _end(self, op: Any) -> None:
        self._gate.pending += 1
        await self._gate.open_gate.wait()
        await op()
        self._gate.pending -= 1

    async def finish(self) -> None:
        await self._end(self._h.finish)

    async def preempt(self) -> None:
        await self._end(self._h.preempt)

    async def abort(self) -> None:
        await self._end(self._h.abort)


@pytest.mark.asyncio
async def test_blocks_return_to_the_pool_only_when_finish_resolves(tiny_model: Transformer) -> None:
    cache = PagedKVCache(TINY, 16)
    async with _offloader(cache) as off:
        gate = _Gate(off)
        async with Engine(tiny_model, cache, offloader=gate) as engine:  # type: ignore[arg-type]
            result = await engine.generate(list(range(50)), max_tokens=8)
            held = -(-(50 + 8) // 16)
            stats = engine.stats()
            assert stats.releasing_blocks == held
            assert stats.free_blocks == 16 - held
            assert gate.pending == 1
            # Other requests keep running on the remaining blocks meanwhile.
            other = await engine.generate(list(range(30)), max_tokens=4)
            assert len(other.output_token_ids) == 4
            gate.open_gate.set()
            await engine.wait_idle()
            assert engine.stats().free_blocks == 16
            assert len(result.output_token_ids) == 8


class _HeldForwards:
    """Model stand-in whose forwards wait, in the engine's worker thread, while held: a step in flight."""

    def __init__(self, model: Transformer) -> None:
        self._model = model
        self.config = model.config
        self.device = model.device
        self._cv = threading.Condition()
        self._held = False
        self.blocked = 0

    def hold(self) -> None:
        with self._cv:
            self._held = True

    def release(self) -> None:
        with self._cv:
            self._held = False
            self._cv.notify_all()

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        with self._cv:
            self.blocked += 1
            self._cv.notify_all()
            while self._held:
                self._cv.wait()
            self.blocked -= 1
        return self._model.forward(*args, **kwargs)

    def wait_blocked(self) -> None:
        with self._cv:
            if not self._cv.wait_for(lambda: self.blocked > 0, timeout=STALL_S):
                raise TimeoutError("no forward reached the hold")


class _OpenRecorder(_Gate):
    """A :class:`_Gate` that also signals each aiokv request it opens (an admission starting)."""

    def __init__(self, off: aiokv.Offloader) -> None:
        super().__init__(off)
        self.opened: list[str] = []
        self.changed = asyncio.Event()

    def open(self, *args: Any, **kwargs: Any) -> _GatedHandle:
        self.opened.append(str(args[0]).split("#")[0])
        self.changed.set()
        return super().open(*args, **kwargs)

    async def wait_opened(self, request_id: str) -> None:
        while request_id not in self.opened:
            self.changed.clear()
            await self.changed.wait()


@pytest.mark.asyncio
async def test_admission_starts_as_soon_as_blocks_are_free_not_at_the_next_step(
    tiny_model: Transformer,
) -> None:
    """A request waiting for blocks starts its lookup/load the moment a finished request's blocks come back,
    and a request arriving to free blocks at once, while the forward in flight still runs (so it joins the
    very next step); neither waits for the step boundary."""
    cache = PagedKVCache(TINY, 16)
    model = _HeldForwards(tiny_model)
    async with _offloader(cache) as off:
        gate = _OpenRecorder(off)
        async with Engine(model, cache, offloader=gate) as engine:  # type: ignore[arg-type]
            await engine.generate(list(range(150)), max_tokens=8, request_id="a")  # 10 blocks, releasing
            assert engine.stats().releasing_blocks == 10
            try:
                async with engine.stream([7] * 20, max_tokens=40, request_id="c") as c_tokens:
                    await c_tokens.__anext__()  # c decodes on its own blocks
                    model.hold()
                    await asyncio.to_thread(model.wait_blocked)  # c's next forward is in flight
                    async with engine.stream(list(range(1, 151)), max_tokens=4, request_id="b") as b_tokens:
                        assert engine.stats().waiting == 1  # no room yet
                        assert "b" not in gate.opened
                        gate.open_gate.set()  # a's finish() resolves: its 10 blocks are free again
                        await asyncio.wait_for(gate.wait_opened("b"), 10)
                        assert model.blocked == 1, "b's admission waited for the forward in flight"
                        async with engine.stream([9] * 10, max_tokens=2, request_id="d") as d_tokens:
                            await asyncio.wait_for(gate.wait_opened("d"), 10)  # arrived to free blocks
                            assert model.blocked == 1
                            model.release()
                            assert len([t async for t in d_tokens]) == 2
                        assert len([t async for t in b_tokens]) == 4
                    assert len([t async for t in c_tokens]) == 39
            finally:
                model.release()  # a failed check must not leave a forward held (closing waits for it)
            await engine.wait_idle()
            _assert_accounting(engine.stats())


@pytest.mark.asyncio
async def test_ttft_splits_into_queue_admission_and_prefill(tiny_model: Transformer) -> None:
    prompt = [(j * 7 + 3) % 256 for j in range(100)]
    async with Engine(tiny_model, PagedKVCache(TINY, 16)) as engine:
        plain = await engine.generate(prompt, max_tokens=3)
    assert plain.admission_s == 0.0
    cache = PagedKVCache(TINY, 16)
    async with _offloader(cache) as off, Engine(tiny_model, cache, offloader=off) as engine:
        cold = await engine.generate(prompt, max_tokens=3)
        await engine.wait_idle()  # its blocks are stored
        warm = await engine.generate(prompt, max_tokens=3)
    assert warm.cached_tokens == 96
    assert warm.admission_s > 0.0  # the lookup and the load of 6 blocks
    for r in (plain, cold, warm):
        assert min(r.queued_s, r.admission_s, r.prefill_s) >= 0.0
        assert r.queued_s + r.admission_s + r.prefill_s == pytest.approx(r.ttft_s, abs=1e-9)


@pytest.mark.asyncio
async def test_engine_decodes_like_the_dense_reference(tiny_model: Transformer) -> None:
    prompt = [(j * 13 + 5) % 256 for j in range(37)]
    ctx = list(prompt)
    for _ in range(12):
        ctx.append(int(tiny_model.forward_dense(ctx)[-1].argmax()))
    async with Engine(tiny_model, PagedKVCache(TINY, 8)) as engine:
        result = await engine.generate(prompt, max_tokens=12)
    assert list(result.output_token_ids) == ctx[len(prompt) :]
    assert result.finish_reason == "length"
    assert 0 < result.ttft_s <= result.latency_s


@pytest.mark.asyncio
async def test_stream_yields_the_tokens_generate_returns(tiny_model: Transformer) -> None:
    prompt = list(range(20, 60))
    async with Engine(tiny_model, PagedKVCache(TINY, 16)) as engine:
        expected = await engine.generate(prompt, max_tokens=10)
        async with engine.stream(prompt, max_tokens=10) as tokens:
            got = [t async for t in tokens]
        assert tuple(got) == expected.output_token_ids
        assert tokens.result.output_token_ids == expected.output_token_ids


@pytest.mark.asyncio
async def test_eos_stops_generation(tiny_model: Transformer) -> None:
    prompt = list(range(100, 130))
    async with Engine(tiny_model, PagedKVCache(TINY, 16)) as engine:
        full = await engine.generate(prompt, max_tokens=10)
        eos = full.output_token_ids[3]
        stopped = await engine.generate(prompt, max_tokens=10, eos_token_id=eos)
    cut = full.output_token_ids.index(eos) + 1
    assert stopped.output_token_ids == full.output_token_ids[:cut]
    assert stopped.finish_reason == "stop"


@pytest.mark.asyncio
async def test_seeded_sampling_does_not_depend_on_batching(tiny_model: Transformer) -> None:
    prompt = list(range(40))
    async with Engine(tiny_model, PagedKVCache(TINY, 32)) as engine:
        alone = await engine.generate(prompt, max_tokens=12, temperature=1.0, seed=5)
        batched = await asyncio.gather(
            engine.generate(prompt, max_tokens=12, temperature=1.0, seed=5),
            *(
                engine.generate(list(range(i, i + 30)), max_tokens=8, temperature=1.0, seed=i)
                for i in range(3)
            ),
        )
        other_seed = await engine.generate(prompt, max_tokens=12, temperature=1.0, seed=6)
    assert batched[0].output_token_ids == alone.output_token_ids
    assert other_seed.output_token_ids != alone.output_token_ids


@pytest.mark.asyncio
async def test_leaving_a_stream_early_aborts_and_frees_the_blocks(tiny_model: Transformer) -> None:
    cache = PagedKVCache(TINY, 16)
    async with _offloader(cache) as off, Engine(tiny_model, cache, offloader=off) as engine:
        async with engine.stream(list(range(50)), max_tokens=100) as tokens:
            async for _ in tokens:
                break
        await engine.wait_idle()
        stats = engine.stats()
        assert stats.aborted == 1
        assert stats.free_blocks == 16
        assert off.stats().requests_open == 0


@pytest.mark.asyncio
async def test_cancelling_generate_aborts_the_request(tiny_model: Transformer) -> None:
    cache = PagedKVCache(TINY, 16)
    async with _offloader(cache) as off, Engine(tiny_model, cache, offloader=off) as engine:
        task = asyncio.create_task(engine.generate(list(range(50)), max_tokens=100))
        await asyncio.sleep(0)  # let it submit
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await engine.wait_idle()
        assert engine.stats().aborted == 1
        assert engine.stats().free_blocks == 16
        # The engine keeps serving.
        assert len((await engine.generate(list(range(10)), max_tokens=3)).output_token_ids) == 3


@pytest.mark.asyncio
async def test_aclose_fails_in_flight_requests_and_is_idempotent(tiny_model: Transformer) -> None:
    cache = PagedKVCache(TINY, 16)
    async with _offloader(cache) as off:
        engine = Engine(tiny_model, cache, offloader=off)
        await engine.start()
        tasks = [
            asyncio.create_task(engine.generate(list(range(i, i + 40)), max_tokens=200)) for i in range(2)
        ]
        await asyncio.sleep(0)
        await engine.aclose()
        await engine.aclose()
        for t in tasks:
            with pytest.raises(aiokv.ClosedError, match="engine closed"):
                await t
        with pytest.raises(aiokv.ClosedError, match="engine is closed"):
            await engine.generate([1, 2, 3])
        assert off.stats().requests_open == 0


@pytest.mark.asyncio
async def test_generate_rejects_what_cannot_fit(tiny_model: Transformer) -> None:
    async with Engine(tiny_model, PagedKVCache(TINY, 4)) as engine:
        with pytest.raises(
            aiokv.InvalidArgumentError, match="must fit in the cache's 4 blocks of 16 tokens, got 70"
        ):
            await engine.generate(list(range(60)), max_tokens=10)
        with pytest.raises(aiokv.InvalidArgumentError, match="max_tokens must be > 0, got 0"):
            await engine.generate([1], max_tokens=0)
        with pytest.raises(aiokv.InvalidArgumentError, match=r"prompt_token_ids must be in \[0, 256\)"):
            await engine.generate([256])


@pytest.mark.asyncio
@pytest.mark.parametrize("seed", range(3))
async def test_random_aborts_leak_nothing_and_the_rest_match_recompute(
    tiny_model: Transformer, seed: int
) -> None:
    """Ten requests on a 20-block pool with a 32-token step budget; four are streams left after a seeded
    number of tokens (0 = before the first token is read) and two are generate() calls cancelled when a
    stream reaches its cut. Afterwards every block is free and aiokv holds no request; every survivor and
    every abandoned stream's prefix match a recompute engine serving each prompt alone."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(256) for _ in range(rng.randint(10, 120))] for _ in range(10)]
    max_tokens = [rng.randint(5, 40) for _ in prompts]
    streamed, cancelled = rng.sample(range(10), 6)[:4], set()
    cuts = {i: rng.randint(0, max_tokens[i] - 1) for i in streamed}

    async with Engine(tiny_model, PagedKVCache(TINY, 20)) as ref_engine:
        expected = [
            (await ref_engine.generate(p, max_tokens=m)).output_token_ids
            for p, m in zip(prompts, max_tokens, strict=True)
        ]

    cache = PagedKVCache(TINY, 20)
    async with (
        _offloader(cache) as off,
        Engine(tiny_model, cache, offloader=off, max_num_batched_tokens=32) as engine,
    ):
        plain = [i for i in range(10) if i not in cuts]
        tasks = {i: asyncio.create_task(engine.generate(prompts[i], max_tokens=max_tokens[i])) for i in plain}
        to_cancel = [tasks[i] for i in rng.sample(plain, 2)]

        async def stream(i: int) -> tuple[int, ...]:
            got: list[int] = []
            async with engine.stream(prompts[i], max_tokens=max_tokens[i]) as tokens:
                async for t in tokens:
                    got.append(t)
                    if len(got) > cuts[i]:
                        break
            if to_cancel:
                victim = to_cancel.pop()
                victim.cancel()
                cancelled.add(victim)
            return tuple(got)

        prefixes = await asyncio.gather(*(stream(i) for i in cuts))
        for i, task in tasks.items():
            if task in cancelled:
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            else:
                assert (await task).output_token_ids == expected[i]
        for i, prefix in zip(cuts, prefixes, strict=True):
            assert prefix == expected[i][: len(prefix)]
        await engine.wait_idle()
        stats = engine.stats()
        assert stats.free_blocks == 20
        assert stats.aborted >= len(cuts) - sum(cuts[i] + 1 >= max_tokens[i] for i in cuts)
        assert off.stats().requests_open == 0
        assert off.stats().in_flight == 0


@pytest.mark.asyncio
async def test_an_engine_whose_offloader_closed_reports_itself_unhealthy(tiny_model: Transformer) -> None:
    """The offloader is closed under a running engine: the engine says so (healthy is False, failure names
    the cause) and refuses new requests with that cause, instead of failing them with an unrelated error."""
    cache = PagedKVCache(TINY, 16)
    off = _offloader(cache)
    await off.start()
    async with Engine(tiny_model, cache, offloader=off) as engine:
        assert engine.healthy
        await engine.generate(list(range(40)), max_tokens=2)
        await off.aclose()
        with pytest.raises(aiokv.AiokvError, match="offloader"):
            await engine.generate(list(range(40)), max_tokens=2)
        assert not engine.healthy
        assert engine.failure is not None
        with pytest.raises(
            aiokv.EngineError, match=r"engine is unhealthy and accepts no requests: .*offloader"
        ):
            await engine.generate(list(range(40)), max_tokens=2)
        with pytest.raises(aiokv.EngineError):
            engine.stream(list(range(40)), max_tokens=2)


@pytest.mark.asyncio
async def test_a_stream_that_is_never_entered_runs_nothing(tiny_model: Transformer) -> None:
    async with Engine(tiny_model, PagedKVCache(TINY, 16)) as engine:
        stream = engine.stream(list(range(40)), max_tokens=50)
        await engine.wait_idle()
        assert engine.stats().steps == 0
        assert engine.stats().waiting == 0
        await stream.aclose()  # nothing to abort
        with pytest.raises(aiokv.InvalidArgumentError, match="prompt_token_ids must not be empty"):
            engine.stream([], max_tokens=4)  # arguments are still checked at once
        async with engine.stream(list(range(40)), max_tokens=3) as tokens:
            assert len([t async for t in tokens]) == 3
        assert tokens.result.finish_reason == "length"


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"max_tokens": 2.5}, aiokv.InvalidTypeError, "max_tokens must be an int, got float"),
        (
            {"temperature": float("nan")},
            aiokv.InvalidArgumentError,
            "temperature must be a finite number >= 0",
        ),
        ({"eos_token_id": 10**6}, aiokv.InvalidArgumentError, r"eos_token_id must be None or in \[0, 256\)"),
        ({"request_id": 7}, aiokv.InvalidTypeError, "request_id must be a str or None, got int"),
    ],
)
async def test_bad_generation_arguments_are_clear_errors(
    tiny_model: Transformer, kwargs: dict[str, Any], error: type, message: str
) -> None:
    async with Engine(tiny_model, PagedKVCache(TINY, 16)) as engine:
        with pytest.raises(error, match=message):
            await engine.generate(list(range(10)), **kwargs)
        with pytest.raises(aiokv.InvalidTypeError, match="prompt_token_ids must contain ints"):
            await engine.generate([1.5, 2.0])  # type: ignore[list-item]
        assert engine.healthy


@pytest.mark.asyncio
@pytest.mark.parametrize("seed", range(2))
async def test_failed_and_corrupt_loads_are_recomputed_and_outputs_match(
    tiny_model: Transformer, seed: int
) -> None:
    """Faults on every load path: a CPU tier too small for the workload (prefixes come back from a lower tier
    that fails reads and corrupts entries at rest) and load copies that fail. Every fault is a miss the engine
    recomputes: tokens and last logits are bitwise those of the recompute run, and the faults really happened."""
    from ..tiers._memory import MemoryTier

    workload = dict(sessions=4, turns=3, seed=seed, temperature=0.0)
    cold, _, _, _ = await _run(tiny_model, 20, offload=False, **workload)

    cache = PagedKVCache(tiny_model.config, 20)
    lower = aiokv.testing.FaultyTier(MemoryTier(), read_fail_rate=0.2, corrupt_rate=0.2, seed=seed)
    # Every hit restored (the planner, timed on this shared machine, could skip the loads that carry the
    # faults; it is tested on its own).
    off = aiokv.Offloader(
        cache.layout(),
        tiers=[aiokv.CPUTier(capacity_bytes=6 * cache.layout().slot_bytes), lower],
        load_policy="always",
    )
    async with off, Engine(tiny_model, cache, offloader=off, max_num_batched_tokens=64) as engine:
        real_load = off.executor._copy_load
        calls = 0

        def flaky_load(slots: Any, blocks: Any) -> None:
            nonlocal calls
            calls += 1
            if calls % 3 == 0:
                raise OSError("injected load copy failure")
            real_load(slots, blocks)

        off.executor._copy_load = flaky_load  # type: ignore[method-assign]
        warm = await asyncio.wait_for(chat(engine, **workload), STALL_S)
        await engine.wait_idle()
        stats = off.stats()
        assert engine.healthy
        _assert_accounting(engine.stats())

    for rid, c in cold.items():
        assert warm[rid].output_token_ids == c.output_token_ids, rid
        assert torch.equal(warm[rid].last_logits, c.last_logits), rid
    assert stats.load_errors > 0  # copies failed...
    assert stats.blocks_loaded > 0  # ...others restored
    faults = lower.stats()
    assert faults.read_failures + faults.corrupted > 0  # and the lower tier misbehaved


@pytest.mark.asyncio
async def test_the_engine_reports_its_prefill_speed_to_the_load_planner(tiny_model: Transformer) -> None:
    """load_policy="decide" needs no configuration with the reference engine: its prefill forwards are
    reported, so the offloader knows the rate recomputing a prefix would run at."""
    cache = PagedKVCache(tiny_model.config, 20)
    off = aiokv.Offloader(cache.layout(), tiers=[aiokv.CPUTier(capacity_bytes=8 * cache.layout().slot_bytes)])
    async with off, Engine(tiny_model, cache, offloader=off) as engine:
        assert off.stats().prefill_tokens_per_s is None
        await engine.generate(list(range(40)), max_tokens=2)
        stats = off.stats()
    assert stats.load_policy == "decide"
    assert stats.prefill_tokens_per_s is not None
    assert stats.prefill_tokens_per_s > 0


@pytest.mark.asyncio
async def test_the_lifecycle_is_an_enum_shown_in_repr(tiny_model: Transformer) -> None:
    from aiokv.engine import EngineState

    engine = Engine(tiny_model, PagedKVCache(tiny_model.config, num_blocks=8, block_size=4))
    assert engine.state is EngineState.NEW
    assert repr(engine).startswith("<Engine NEW recompute")
    async with engine:
        assert engine.state is EngineState.RUNNING
        assert repr(engine).startswith("<Engine RUNNING recompute")
        with pytest.raises(aiokv.ClosedError, match="cannot be started twice \\(it is running\\)"):
            await engine.start()
    assert engine.state is EngineState.CLOSED
    assert repr(engine).startswith("<Engine CLOSED")
    with pytest.raises(aiokv.ClosedError, match="engine is closed"):
        await engine.generate([1, 2, 3], max_tokens=1)
    never = Engine(tiny_model, PagedKVCache(tiny_model.config, num_blocks=8, block_size=4))
    await never.aclose()
    assert never.state is EngineState.CLOSED


@pytest.mark.asyncio
async def test_layerwise_loads_on_the_cpu_backend_match_recompute(tiny_model: Transformer) -> None:
    workload = dict(sessions=4, turns=3, seed=2, temperature=0.0)
    cold, _, _, _ = await _run(tiny_model, 20, offload=False, **workload)
    warm, warm_stats, off_stats, _ = await _run(tiny_model, 20, offload=True, layerwise=True, **workload)
    assert off_stats is not None
    assert warm_stats.cached_tokens > 0
    assert off_stats.load_errors == 0
    for rid, c in cold.items():
        assert warm[rid].output_token_ids == c.output_token_ids, rid
    _assert_accounting(warm_stats)


@pytest.mark.asyncio
async def test_layerwise_loads_need_a_plain_layout_and_a_bool(tiny_model: Transformer) -> None:
    cache = PagedKVCache(tiny_model.config, 8)
    with pytest.raises(aiokv.InvalidArgumentError, match="layerwise_loads must be a bool"):
        Engine(tiny_model, cache, layerwise_loads=1)  # type: ignore[arg-type]
    with pytest.raises(aiokv.InvalidArgumentError, match="layerwise_loads needs an offloader"):
        Engine(tiny_model, cache, layerwise_loads=True)
