"""``AiokvConnector`` with ``layerwise: true``: hits loaded as vLLM's synchronous loads, layer by layer.

vLLM 0.32's real Scheduler and the worker-side connector in one process (tests/vllm/_harness.py): the fake
forward writes each token's KV as a function of its prefix and, in every layer, checks right after
``wait_for_layer_load`` that every attended position holds exactly that KV, so a layer read before its copy
ended, a restore into the wrong block or a failed load served as data fails byte-exactly. The copies are held
at aiokv's executor (``_copy_load``, one call per layer of a layer-wise load) by events that the forward's own
hooks release, so each ordering below is forced, never waited for with sleeps. Then ``LLM.generate`` end to
end (tests/vllm/_connector_run.py's ``layerwise`` scenario).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

import torch

import aiokv
from aiokv.vllm import AiokvConnector, ConnectorConfig
from aiokv.vllm._worker import WorkerSide, layer_indices

from ._harness import EngineHarness, assert_scheduler_empty, layer_names, make_engine
from ._harness import connector_stats as _stats
from ._harness import connector_worker as _worker
from ._harness import spread_prompt as _prompt

BS = 16
LAYERS = 4
GATE_S = 30.0  # a held copy is released by the test's own hooks long before this

_OPEN: list[EngineHarness] = []


@pytest.fixture(autouse=True)
def _close_engines() -> Iterator[None]:
    yield
    while _OPEN:
        engine = _OPEN.pop()
        with contextlib.suppress(Exception):
            engine.shutdown()


def _engine(*, layerwise: bool = True, **extra: Any) -> EngineHarness:
    engine = make_engine(
        64,
        num_layers=LAYERS,
        async_scheduling=False,  # what layer-wise loads need
        kv_connector="AiokvConnector",
        kv_connector_module_path="aiokv.vllm",
        kv_connector_extra_config={
            "tiers": "cpu=64MiB",
            "load_policy": "always",
            "layerwise": layerwise,
            **extra,
        },
    )
    engine.keep_scheduler_outputs = True
    _OPEN.append(engine)
    return engine


def _run_one(engine: EngineHarness, rid: str, prompt: list[int], max_tokens: int) -> None:
    engine.add_request(rid, prompt, max_tokens)
    engine.run()


def _forget(engine: EngineHarness) -> None:
    """vLLM forgets every block (its prefix cache and the bytes): a restore must bring every layer back."""
    assert engine.scheduler.reset_prefix_cache()
    for kv in engine.worker.kv_caches.values():
        kv.zero_()


def _finish(engine: EngineHarness, max_tokens: dict[str, int]) -> None:
    for rid, n in max_tokens.items():
        res = engine.results[rid]
        assert res.output_token_ids == engine.worker.reference_generation(res.prompt_token_ids, n), rid
    engine.assert_ok()
    assert_scheduler_empty(engine.scheduler)
    engine.shutdown()


def _load_step(engine: EngineHarness, rid: str) -> Any:
    """The scheduler output that scheduled ``rid``'s first forward."""
    for so in engine.scheduler_outputs:
        if any(nr.req_id == rid for nr in so.scheduled_new_reqs):
            return so
    raise AssertionError(f"{rid} was never scheduled")


class _Copies:
    """Wraps the executor's per-layer load copy: records the layers copied, can hold one layer until released,
    can fail one layer."""

    def __init__(self, worker: WorkerSide, *, hold: int | None = None, fail: int | None = None) -> None:
        assert worker.off is not None
        self.executor = worker.off.executor
        self.original = self.executor._copy_load
        self.hold, self.fail = hold, fail
        self.release = threading.Event()
        self.held = threading.Event()  # the held layer's copy has started waiting
        self.copied: list[int | None] = []
        self.executor._copy_load = self._copy  # type: ignore[method-assign]

    def _copy(self, slots: Any, blocks: Any, layer: int | None = None) -> None:
        if layer is not None and layer == self.hold:
            self.held.set()
            assert self.release.wait(GATE_S), "the held layer was never released"
        if layer is not None and layer == self.fail:
            raise OSError(f"injected copy failure of layer {layer}")
        self.original(slots, blocks, layer)
        self.copied.append(layer)

    def restore(self) -> None:
        self.executor._copy_load = self.original  # type: ignore[method-assign]


def _hook(worker: WorkerSide, name: str, before: Any = None, after: Any = None) -> None:
    original = getattr(worker, name)

    def hooked(*args: Any) -> Any:
        if before is not None:
            before(*args)
        out = original(*args)
        if after is not None:
            after(*args)
        return out

    setattr(worker, name, hooked)


# ---------------------------------------------------------------------------------------------- configuration


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"layerwise": "yes"}, "kv_connector_extra_config['layerwise'] must be true or false, got 'yes'"),
        ({"layerwise": 1}, "kv_connector_extra_config['layerwise'] must be true or false, got 1"),
        (
            {"layerwise_timeout_s": 0},
            "kv_connector_extra_config['layerwise_timeout_s'] must be a number of seconds > 0, got 0",
        ),
    ],
)
def test_bad_layerwise_options_name_the_key(extra: dict[str, Any], message: str) -> None:
    with pytest.raises(aiokv.InvalidArgumentError) as info:
        ConnectorConfig.from_extra_config(extra)
    assert message in str(info.value)


def test_layerwise_is_off_by_default_and_needs_piecewise_graphs_when_on() -> None:
    assert ConnectorConfig.from_extra_config(None).layerwise is False
    assert ConnectorConfig.from_extra_config({"layerwise": True}).layerwise is True
    assert AiokvConnector.requires_piecewise_for_cudagraph({"layerwise": True}) is True
    assert AiokvConnector.requires_piecewise_for_cudagraph({"tiers": "cpu=1GiB"}) is False


def test_layerwise_with_asynchronous_scheduling_is_refused_naming_the_key() -> None:
    """vLLM schedules the next step over a synchronous load before it hears that the load failed (with a
    failed layer, vLLM 0.32 then keeps a token sampled over the unloaded layer): refused at start-up."""
    with pytest.raises(aiokv.InvalidArgumentError) as info:
        make_engine(
            16,
            async_scheduling=True,
            kv_connector="AiokvConnector",
            kv_connector_module_path="aiokv.vllm",
            kv_connector_extra_config={"layerwise": True},
        )
    assert "kv_connector_extra_config['layerwise'] needs vLLM's synchronous scheduling" in str(info.value)


def test_layer_names_map_to_the_layouts_layers_in_registration_order() -> None:
    buf = torch.zeros(8, 2, BS, 4)
    caches = {"b": torch.zeros(8, 2, BS, 4), "a": buf, "shared": buf, "c": torch.zeros(8, 2, BS, 4)}
    # The order register_kv_caches got them in (not sorted); a layer aliasing another's bytes is that layer.
    assert layer_indices(caches, 8) == {"b": 0, "a": 1, "shared": 1, "c": 2}


# ---------------------------------------------------------------------------------------------- restores


def test_a_hit_is_a_synchronous_load_restored_exactly() -> None:
    engine = _engine()
    worker = _worker(engine)
    assert worker._layer_index == {name: i for i, name in enumerate(layer_names(LAYERS))}
    prompt = _prompt(1, 5 * BS + 3)
    _run_one(engine, "a", prompt, 4)
    _forget(engine)
    _run_one(engine, "b", [*prompt, 7, 8], 4)
    assert engine.num_computed_at_start["b"] == 5 * BS  # restored by aiokv into zeroed blocks
    so = _load_step(engine, "b")
    assert so.has_sync_kv_loads  # scheduled in the very step of its load: never WAITING_FOR_REMOTE_KVS
    stats = _stats(engine)
    assert stats.blocks_loaded == 5
    assert stats.load_errors == 0
    assert worker.layerwise_failed == 0
    assert not engine.worker.tolerated_violations
    _finish(engine, {"a": 4, "b": 4})


def test_default_mode_still_loads_asynchronously() -> None:
    engine = _engine(layerwise=False)
    prompt = _prompt(2, 4 * BS + 1)
    _run_one(engine, "a", prompt, 2)
    _forget(engine)
    _run_one(engine, "b", prompt, 2)
    assert engine.num_computed_at_start["b"] == 4 * BS
    assert not _load_step(engine, "b").has_sync_kv_loads
    assert _worker(engine)._layer_index == {}
    _finish(engine, {"a": 2, "b": 2})


def test_each_layer_is_computed_while_the_later_layers_are_still_copied() -> None:
    """Layer 2's copy is held until the forward asks for layer 2: layers 0 and 1 were checked exact by then
    (their attention ran, the later layers not copied yet); layer 2 waits for its copy."""
    engine = _engine()
    worker = _worker(engine)
    prompt = _prompt(3, 6 * BS + 5)
    _run_one(engine, "a", prompt, 2)
    _forget(engine)
    copies = _Copies(worker, hold=2)
    names = layer_names(LAYERS)
    seen: list[tuple[str, list[int | None]]] = []

    def before(name: str) -> None:
        if worker._layer_loads is not None:
            seen.append((name, list(copies.copied)))
            if name == names[2]:
                assert copies.held.wait(GATE_S)  # its copy started and is held: the wait below must wait
                copies.release.set()

    _hook(worker, "wait_for_layer_load", before=before)
    _run_one(engine, "b", prompt, 2)
    copies.restore()
    assert [name for name, _ in seen] == names  # one step with a load: every layer waited for, in order
    assert seen[2][1] == [0, 1]  # layers 0 and 1 computed before layer 2 was copied
    assert sorted(c for c in copies.copied if c is not None) == list(range(LAYERS))
    assert _stats(engine).blocks_loaded == 6
    _finish(engine, {"a": 2, "b": 2})


def test_several_loads_in_one_step_wait_for_each_layer_of_all() -> None:
    engine = _engine()
    prompts = {f"p{i}": _prompt(10 + i, (3 + i) * BS + 2) for i in range(3)}
    for rid, p in prompts.items():
        engine.add_request(rid, p, 3)
    engine.run()
    _forget(engine)
    for rid, p in prompts.items():
        engine.add_request(f"{rid}-again", p, 3)
    engine.run()
    loads = [so for so in engine.scheduler_outputs if so.has_sync_kv_loads]
    assert loads
    assert max(len(so.scheduled_new_reqs) for so in loads) >= 2  # loads sharing a step
    assert _stats(engine).blocks_loaded == 3 + 4 + 5
    _finish(engine, {**dict.fromkeys(prompts, 3), **{f"{r}-again": 3 for r in prompts}})


# ---------------------------------------------------------------------------------------------- failures


def test_a_failed_layer_is_reported_as_load_errors_never_served() -> None:
    """Layer 1's copy fails: layer 0 was restored, layers 1-3 of the zeroed blocks hold nothing. Every block of
    the load is a load error of that very step (the fake forward's check on layer 1 is tolerated only for
    those blocks), vLLM recomputes them, the outputs are a recompute's, and nothing more of that request is
    stored. A later request restores the same prefix again."""
    engine = _engine()
    worker = _worker(engine)
    prompt = _prompt(4, 5 * BS + 7)
    _run_one(engine, "a", prompt, 3)
    _forget(engine)
    stored = _stats(engine).blocks_stored
    copies = _Copies(worker, fail=1)
    reported: dict[int, set[int]] = {}  # scheduler output index -> the load errors of its step
    original = worker.get_block_ids_with_load_errors

    def errors() -> set[int]:
        out = original()
        reported[len(engine.scheduler_outputs) - 1] = set(out)
        return out

    worker.get_block_ids_with_load_errors = errors  # type: ignore[method-assign]
    longer = [*prompt, *_prompt(5, 2 * BS)]  # two more blocks: computed over the failed restore
    _run_one(engine, "b", longer, 3)
    copies.restore()
    so = _load_step(engine, "b")
    step = engine.scheduler_outputs.index(so)
    b_blocks = set(next(nr for nr in so.scheduled_new_reqs if nr.req_id == "b").block_ids[0][:5])
    assert reported.pop(step) == b_blocks  # the load's five blocks, in the step of the load
    assert not any(reported.values())
    tolerated = engine.worker.tolerated_violations
    assert tolerated
    assert {v.req_id for v in tolerated} == {"b"}
    # Layer 0 restored; layer 1's copy failed and layers 2 and 3 were never copied (aiokv skips the later
    # layers of a load that lost one): the forward finds all three unrestored, each tolerated as a load error.
    assert {v.layer for v in tolerated} == set(layer_names(LAYERS)[1:])
    assert copies.copied.count(2) == copies.copied.count(3) == 0
    assert worker.layerwise_failed == 1
    stats = _stats(engine)
    assert stats.load_errors == 5
    assert stats.blocks_stored == stored  # nothing computed over the failed load was stored
    _forget(engine)
    _run_one(engine, "c", longer, 3)
    assert engine.num_computed_at_start["c"] == 5 * BS
    _finish(engine, {"a": 3, "b": 3, "c": 3})


def test_a_layer_past_the_timeout_fails_the_load_and_its_copy_is_waited_for() -> None:
    """Layer 1's copy is held past ``layerwise_timeout_s``, and released only once the step ended: the load
    fails (its blocks are load errors of that step, recomputed), and the next step's forward, which
    recomputes into those blocks, starts only after the late copy ended."""
    engine = _engine(layerwise_timeout_s=0.2)
    worker = _worker(engine)
    prompt = _prompt(6, 4 * BS + 3)
    _run_one(engine, "a", prompt, 3)
    _forget(engine)
    copies = _Copies(worker, hold=1)
    unsettled: list[int] = []

    def after_save(*_: Any) -> None:
        if copies.held.is_set() and not copies.release.is_set():
            unsettled.append(len(worker._unsettled))
            copies.release.set()  # only now: the next step must wait for this copy before its forward

    _hook(worker, "wait_for_save", after=after_save)
    waited: list[bool] = []

    def before_prepare(meta: Any) -> None:
        if worker._unsettled and meta is not worker._prepared:
            waited.append(True)

    _hook(worker, "_prepare", before=before_prepare)
    _run_one(engine, "b", [*prompt, 1], 3)
    copies.restore()
    assert unsettled == [1]  # given up on while its copy was still held
    assert waited  # and a later step waited for it
    assert worker._unsettled == []
    assert worker.layerwise_failed == 1
    assert _stats(engine).load_errors == 0  # the copy itself succeeded, late; vLLM recomputed all the same
    assert {v.req_id for v in engine.worker.tolerated_violations} <= {"b"}
    _finish(engine, {"a": 3, "b": 3})


def test_a_load_of_a_request_the_worker_does_not_know_fails_cleanly() -> None:
    engine = _engine()
    worker = _worker(engine)
    prompt = _prompt(7, 3 * BS + 1)
    _run_one(engine, "a", prompt, 2)
    _forget(engine)
    original = worker._on_layer_loads

    def forget_request(step: Any, loads: Any) -> None:
        for job in loads:
            req = worker._reqs.pop(job.req_id)
            worker._reqs[f"{job.req_id}-elsewhere"] = req
        original(step, loads)

    worker._on_layer_loads = forget_request  # type: ignore[method-assign]
    _run_one(engine, "b", prompt, 2)
    worker._on_layer_loads = original  # type: ignore[method-assign]
    assert worker.layerwise_failed == 1
    assert "b" not in worker._reqs  # never reopened from its later steps: nothing of it stored
    assert worker._given_up == set()  # forgotten once it ended
    res = engine.results["b"]
    assert res.output_token_ids == engine.worker.reference_generation(prompt, 2)
    engine.assert_ok()
    assert_scheduler_empty(engine.scheduler)
    engine.shutdown()


# ---------------------------------------------------------------------------------------------- end to end

REPO = Path(__file__).resolve().parents[2]
RUN = (sys.executable, "-m", "tests.vllm._connector_run")


def test_llm_generate_with_layerwise_loads(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """``LLM.generate`` on the tiny random-weight Llama, with a layer-wise connector engine next to one without
    a connector: the same greedy tokens, and after ``reset_prefix_cache()`` the prefixes restored by aiokv."""
    out = tmp_path / "result.json"
    proc = subprocess.run(
        [*RUN, "layerwise", "--model", str(tiny_llama_dir), "--out", str(out)],
        cwd=REPO,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, f"layerwise failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
    result = json.loads(out.read_text())
    from tests.vllm._connector_run import PROMPT_LENS

    plain, conn = result["plain"], result["conn"]
    assert conn["reset1"] >= 1
    for i, n in enumerate(PROMPT_LENS):
        hit = (n - 1) // 32 * 32
        for key in ("round1", "round2"):
            assert conn[key][i]["token_ids"] == plain[key][i]["token_ids"], (key, n)
        assert conn["round1"][i]["num_cached_tokens"] == 0
        assert conn["round2"][i]["num_cached_tokens"] == hit, n  # restored from aiokv after the reset


pytestmark = pytest.mark.timeout(900)
