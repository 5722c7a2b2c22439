"""AiokvConnector with vLLM's hybrid KV-cache manager: two KV-cache groups (a 32-token sliding window and full
attention, tests/vllm/_hybrid.py), vLLM's real scheduler and a worker-side connector in one process.

The fake forward checks every attended position of every layer byte-exactly before attention (the sliding layer
its window only), so a restore of wrong window KV or a sliding block written under a store still reading it fails
the test. Every scenario runs with vLLM's synchronous and asynchronous scheduling.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import threading
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm")

from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec, MambaSpec, SlidingWindowSpec

from aiokv._errors import InvalidArgumentError
from aiokv.vllm import AiokvConnector
from aiokv.vllm._block_table import vllm_groups
from aiokv.vllm._worker import WorkerSide

from ._harness import assert_scheduler_empty
from ._harness import connector_stats as _stats
from ._harness import connector_worker as _worker
from ._harness import spread_prompt as _prompt
from ._hybrid import HybridEngine, make_hybrid_engine

SCHEDULING = [pytest.param(False, id="sync"), pytest.param(True, id="async")]
BS = 16
WINDOW = 32  # two blocks

_OPEN: list[HybridEngine] = []


@pytest.fixture(autouse=True)
def _close_engines() -> Iterator[None]:
    yield
    while _OPEN:
        engine = _OPEN.pop()
        with contextlib.suppress(Exception):
            engine.shutdown()


@pytest.fixture(params=SCHEDULING)
def async_scheduling(request: pytest.FixtureRequest) -> bool:
    return bool(request.param)


def _engine(num_blocks: int = 96, *, async_scheduling: bool = False, **extra: Any) -> HybridEngine:
    engine = make_hybrid_engine(
        num_blocks,
        window=WINDOW,
        block_size=BS,
        async_scheduling=async_scheduling,
        kv_connector="AiokvConnector",
        kv_connector_module_path="aiokv.vllm",
        kv_connector_extra_config={"tiers": "cpu=64MiB", "load_policy": "always", **extra},
    )
    _OPEN.append(engine)
    return engine


def _sched(engine: HybridEngine) -> Any:
    conn = engine.scheduler.connector
    assert isinstance(conn, AiokvConnector)
    assert conn.scheduler is not None
    return conn.scheduler


def _finish(engine: HybridEngine, max_tokens: dict[str, int]) -> None:
    """Every request got a plain recompute's output; the KV was right throughout; nothing leaked."""
    for rid, n in max_tokens.items():
        res = engine.results[rid]
        assert res.output_token_ids == engine.worker.reference_generation(res.prompt_token_ids, n), rid
    engine.assert_ok()
    assert_scheduler_empty(engine.scheduler)
    engine.shutdown()


def test_connector_keeps_both_groups() -> None:
    engine = _engine()
    layout = _worker(engine).off.layout  # type: ignore[union-attr]
    assert layout.is_grouped
    assert [(g.kind.value, g.window) for g in layout.groups] == [("sliding_window", WINDOW), ("full", None)]
    assert layout.memory_class == (0, 0)  # the groups overlay one buffer
    assert _sched(engine).tables is not None
    engine.shutdown()


def test_sliding_window_prefix_is_restored_exactly(async_scheduling: bool) -> None:
    """A prompt several windows long and a decode past more windows; vLLM's cache reset; the prompt again, and the
    first turn's output with more tokens: both restored from aiokv (the window units of the prompt's end and of the
    final boundary), every attended position exact."""
    engine = _engine(async_scheduling=async_scheduling)
    prompt = _prompt(1, 7 * BS + 5)
    engine.add_request("a", prompt, 3 * BS)
    engine.run()
    assert engine.scheduler.reset_prefix_cache()
    turn2 = [*prompt, *engine.results["a"].output_token_ids, *_prompt(2, 9)]
    engine.add_request("again", prompt, 4)
    engine.add_request("turn2", turn2, 4)
    engine.run()
    assert engine.num_computed_at_start["again"] == 7 * BS  # the prompt's end boundary
    final = (len(prompt) + 3 * BS - 1) // BS * BS
    assert engine.num_computed_at_start["turn2"] == final  # turn 1's final boundary
    stats = _stats(engine)
    assert stats.blocks_loaded > 0
    assert stats.load_errors == stats.store_errors == 0
    _finish(engine, {"a": 3 * BS, "again": 4, "turn2": 4})


def test_many_requests_with_a_small_cache_preempt_and_stay_exact(async_scheduling: bool) -> None:
    """A cache too small for every request: preemptions, sliding blocks freed and reused at once, restores of
    preempted requests from aiokv; every request's output and every attended position as a recompute's."""
    engine = _engine(40, async_scheduling=async_scheduling)
    prompts = {f"p{i}": _prompt(10 + i, 4 * BS + 3 * i) for i in range(6)}
    for rid, prompt in prompts.items():
        engine.add_request(rid, prompt, 40)
    engine.run()
    assert engine.num_preemptions > 0
    assert _sched(engine).blocks_dropped > 0  # vLLM reused sliding blocks while requests ran
    engine.scheduler.reset_prefix_cache()
    for rid, prompt in prompts.items():
        engine.add_request(f"{rid}-again", [*prompt, *engine.results[rid].output_token_ids[:20]], 2)
    engine.run()
    assert _stats(engine).blocks_loaded > 0
    _finish(engine, {**dict.fromkeys(prompts, 40), **{f"{r}-again": 2 for r in prompts}})


class _Gate:
    """Holds every store copy of a worker's offloader until released (once released it stays open); ``reading``:
    the ``(group, engine block)`` pairs the held copies read."""

    def __init__(self, worker: WorkerSide) -> None:
        assert worker.off is not None
        layout = worker.off.layout
        self.executor = worker.off.executor
        self.open = threading.Event()
        self.stores_held = 0
        self.reading: set[tuple[int, int]] = set()
        original: Callable[..., None] = self.executor._copy_store

        def gated(block_ids: Any, slot_ids: Any) -> None:
            if not self.open.is_set():
                self.stores_held += 1
                for unit, row in block_ids:
                    for g in layout.parts[layout.unit_parts[unit][0]].groups:
                        self.reading.add((g, row[g]))
            self.open.wait(60)
            original(block_ids, slot_ids)

        self.executor._copy_store = gated  # type: ignore[method-assign]


def _dropped(meta: Any) -> set[tuple[int, int]]:
    """The ``(group, block)`` pairs a step's metadata reports freed."""
    lists = [job.block_ids for job in meta.drops] + [e.drops for e in meta.ended + meta.preempted if e.drops]
    return {(g, b) for ids in lists for g, group in enumerate(ids) for b in group}


def test_reused_sliding_blocks_are_not_written_under_a_store_in_flight(
    async_scheduling: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The reason for the drop fence, forced: every store is held on its stream (the window units of the prompt's
    end among them) while one request decodes past several windows in a small cache, so that vLLM hands the
    sliding blocks that left its window out again (vLLM frees them silently, at the start of a step). The gate
    opens either when the worker waits for the dropped blocks' copies (the fence) or, failing that, right after a
    forward that wrote a block a held copy reads (the mutation of removing the fence fails this test there): without the fence that copy would store the new KV under the
    old block's key, and the restore of the prompt below (its end's window units) would fail the window check."""
    # Nine blocks: the prefill takes eight (four per group); the window then moves off the prompt's end blocks
    # (cached: vLLM appends them to its free queue) and the decode's next blocks are exactly those.
    engine = _engine(10, async_scheduling=async_scheduling)
    worker = _worker(engine)
    gate = _Gate(worker)
    fenced: list[bool] = []
    original_wait = WorkerSide._wait_dropped

    def wait(self: WorkerSide, fut: Any) -> None:
        closed = not gate.open.is_set()
        if closed:
            # A fence that does not wait for the held copies completes with the gate closed: give it the chance
            # (a correct one cannot complete before the gate opens, so this bound is spent once).
            concurrent.futures.wait([fut], timeout=1.0)
        fenced.append(closed and not fut.done())
        gate.open.set()
        original_wait(self, fut)

    monkeypatch.setattr(WorkerSide, "_wait_dropped", wait)
    original_execute, original_forward = engine.worker.execute_model, engine.worker._forward
    overwriting = [False]
    reused: list[tuple[int, int]] = []

    def execute(so: Any) -> Any:
        hit = _dropped(so.kv_connector_metadata) & gate.reading
        overwriting[0] = bool(hit) and not gate.open.is_set()
        reused.extend(hit)
        return original_execute(so)

    def forward(*args: Any) -> None:
        original_forward(*args)
        if overwriting[0]:
            gate.open.set()  # reached with the gate still closed only if the fence is missing

    monkeypatch.setattr(engine.worker, "execute_model", execute)
    monkeypatch.setattr(engine.worker, "_forward", forward)
    prompt = _prompt(50, 3 * BS + 4)
    engine.add_request("a", prompt, 40)
    engine.run()
    assert gate.stores_held > 0
    assert reused, "vLLM never reused a block a held store reads"
    assert engine.scheduler.reset_prefix_cache()
    engine.add_request("again", prompt, 2)
    engine.run()
    # Restored up to the prompt's end boundary: its window units are among the stores the gate held.
    assert engine.num_computed_at_start["again"] == 3 * BS
    assert fenced, "no step dropped a reused sliding block"
    assert fenced[0]  # the first drop found the held stores and waited for them
    _finish(engine, {"a": 40, "again": 2})


def _config(*specs: Any) -> Any:
    groups = [KVCacheGroupSpec([f"model.layers.{i}.attn"], spec) for i, spec in enumerate(specs)]
    return SimpleNamespace(kv_cache_groups=groups)


def test_group_kinds_from_vllm_specs() -> None:
    import torch

    common = {"block_size": 16, "num_kv_heads": 2, "head_size": 32, "dtype": torch.float32}
    assert vllm_groups(_config(FullAttentionSpec(**common))) is None  # one group: stored as before
    (g,) = vllm_groups(_config(SlidingWindowSpec(sliding_window=64, **common))) or ()
    assert (g.kind, g.window) == ("sliding_window", 64)  # vLLM frees its blocks: a grouped layout
    groups = vllm_groups(_config(SlidingWindowSpec(sliding_window=64, **common), FullAttentionSpec(**common)))
    assert [(g.kind, g.window, g.layer_names) for g in groups or ()] == [
        ("sliding_window", 64, ("model.layers.0.attn",)),
        ("full", None, ("model.layers.1.attn",)),
    ]
    mamba = MambaSpec(block_size=16, shapes=((3, 8), (2, 4, 4)), dtypes=(torch.float32, torch.float32))
    with pytest.raises(
        InvalidArgumentError,
        match=r"kv_cache_groups\[1\] \(MambaSpec, layers model.layers.1.attn\) is not supported by AiokvConnector",
    ):
        vllm_groups(_config(FullAttentionSpec(**common), mamba))
    other = {**common, "block_size": 32}
    with pytest.raises(
        InvalidArgumentError, match=r"must share one block size .*, got block sizes \[16, 32\]"
    ):
        vllm_groups(_config(SlidingWindowSpec(sliding_window=64, **common), FullAttentionSpec(**other)))
