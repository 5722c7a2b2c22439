"""Every request that leaves the engine is counted once in ``EngineStats``, under its real outcome: finished
(by finish reason), aborted (by reason) or failed."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import pytest
import torch

import aiokv
from aiokv.engine import Engine, EngineStats, PagedKVCache, SeqChunk, Transformer

from .conftest import TINY


def _offloader(cache: PagedKVCache) -> aiokv.Offloader:
    return aiokv.Offloader(
        cache.layout(), tiers=[aiokv.CPUTier(capacity_bytes=8 << 20)], load_policy="always"
    )


def _outcomes(s: EngineStats) -> dict[str, int]:
    """The non-zero outcome counters, after checking that the totals are the sums of their reasons."""
    assert s.finished == s.finished_stop + s.finished_length
    assert s.aborted == s.aborted_cancelled + s.aborted_shutdown
    fields = ("finished_stop", "finished_length", "aborted_cancelled", "aborted_shutdown", "failed")
    return {f: getattr(s, f) for f in fields if getattr(s, f)}


@pytest.mark.asyncio
async def test_eos_and_max_tokens_count_as_finished_by_reason(tiny_model: Transformer) -> None:
    prompt = list(range(40))
    async with Engine(tiny_model, PagedKVCache(TINY, 32)) as engine:
        first = await engine.generate(prompt, max_tokens=4)
        eos = first.output_token_ids[0]  # greedy: the same request samples this token first again
        stopped = await engine.generate(prompt, max_tokens=4, eos_token_id=eos)
        await engine.wait_idle()
        stats = engine.stats()
    assert (first.finish_reason, stopped.finish_reason) == ("length", "stop")
    assert _outcomes(stats) == {"finished_stop": 1, "finished_length": 1}


@pytest.mark.asyncio
async def test_a_stop_string_finish_counts_as_finished_not_aborted(tiny_model: Transformer) -> None:
    """Regression: a caller that ended a stream on a stop string (the server does) was counted as an abort,
    as a client disconnect is. ``TokenStream.finish()`` ends it as finished with reason "stop"."""
    cache = PagedKVCache(TINY, 32)
    async with _offloader(cache) as off, Engine(tiny_model, cache, offloader=off) as engine:
        read: list[int] = []
        async with engine.stream(list(range(40)), max_tokens=100) as tokens:
            async for token in tokens:
                read.append(token)
                if len(read) == 3:
                    tokens.finish()  # the text now holds the stop string
                    break
            rest = [t async for t in tokens]  # tokens sampled before finish() and not read yet, then the end
            result = tokens.result
        tokens.finish()  # after the end: nothing
        await engine.wait_idle()
        stats = engine.stats()
        assert off.stats().requests_open == 0
    assert result.finish_reason == "stop"
    assert list(result.output_token_ids) == read + rest
    assert len(result.output_token_ids) < 100
    assert _outcomes(stats) == {"finished_stop": 1}
    assert stats.free_blocks == stats.num_blocks


@pytest.mark.asyncio
async def test_finish_before_the_first_token_and_leaving_a_stream_early_count_as_cancelled(
    tiny_model: Transformer,
) -> None:
    async with Engine(tiny_model, PagedKVCache(TINY, 32)) as engine:
        async with engine.stream(list(range(40)), max_tokens=100) as tokens:
            tokens.finish()  # nothing sampled yet (no forward ran): there is nothing to finish
            assert [t async for t in tokens] == []
        async with engine.stream(list(range(40)), max_tokens=100) as tokens:
            async for _ in tokens:
                break  # leaving the block aborts
        await engine.wait_idle()
        assert _outcomes(engine.stats()) == {"aborted_cancelled": 2}


@pytest.mark.asyncio
async def test_closing_the_engine_counts_requests_in_flight_as_aborted_by_shutdown(
    tiny_model: Transformer,
) -> None:
    cache = PagedKVCache(TINY, 32)
    async with _offloader(cache) as off:
        engine = Engine(tiny_model, cache, offloader=off)
        async with engine, engine.stream(list(range(40)), max_tokens=100) as tokens:
            await tokens.__anext__()
            await engine.aclose()
            with pytest.raises(aiokv.ClosedError, match="engine closed"):
                await tokens.__anext__()
        assert _outcomes(engine.stats()) == {"aborted_shutdown": 1}


class _Failing(Transformer):
    """The tiny model, whose second forward raises."""

    def __init__(self) -> None:
        super().__init__(TINY)
        self.forwards = 0

    def forward(self, chunks: Sequence[SeqChunk], kv: Sequence[torch.Tensor]) -> Any:
        self.forwards += 1
        if self.forwards == 2:
            raise RuntimeError("boom")
        return super().forward(chunks, kv)


@pytest.mark.asyncio
async def test_an_engine_failure_counts_its_requests_as_failed_once() -> None:
    engine = Engine(_Failing(), PagedKVCache(TINY, 32))
    async with engine:
        results = await asyncio.gather(
            *(engine.generate(list(range(i, i + 20)), max_tokens=50) for i in range(2)),
            return_exceptions=True,
        )
        assert [type(r) for r in results] == [RuntimeError, RuntimeError]
        assert _outcomes(engine.stats()) == {"failed": 2}
    assert _outcomes(engine.stats()) == {"failed": 2}  # closing does not count them again as aborted
