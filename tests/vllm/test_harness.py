"""Self-tests of the vLLM harness: real vLLM scheduler + FakeWorker, no connector or vLLM's
ExampleConnector or the test-only OracleConnector.  They prove the harness (hook order, KV
checks, batch queue) is right before aiokv's connector is plugged in."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from vllm.v1.engine import FinishReason

from ._harness import (
    EngineHarness,
    FakeWorker,
    assert_scheduler_empty,
    make_engine,
    make_scheduler,
    make_vllm_config,
    run_engine_steps,
)

SCHEDULING = [pytest.param(False, id="sync"), pytest.param(True, id="async")]
ORACLE = {"kv_connector": "OracleConnector", "kv_connector_module_path": "tests.vllm._oracle_connector"}


def _prompt(seed: int, n: int) -> list[int]:
    return [(seed * 7919 + i * 104729) % 1000 for i in range(n)]


def _assert_reference_outputs(
    engine: EngineHarness, max_tokens: dict[str, int], skip: set[str] = frozenset()
) -> None:
    for req_id, n in max_tokens.items():
        if req_id in skip:
            continue
        res = engine.results[req_id]
        expected = engine.worker.reference_generation(res.prompt_token_ids, n)
        assert res.output_token_ids == expected, req_id
        want = FinishReason.STOP if expected[-1] == engine.worker.eos_token_id else FinishReason.LENGTH
        assert res.finish_reason == want, (req_id, res.finish_reason)


def _done(engine: EngineHarness) -> None:
    engine.assert_ok()
    assert_scheduler_empty(engine.scheduler)
    engine.shutdown()


# ----------------------------------------------------------------------------- no connector


@pytest.mark.parametrize("async_scheduling", SCHEDULING)
def test_many_requests_complete(async_scheduling: bool) -> None:
    engine = make_engine(num_blocks=128, async_scheduling=async_scheduling, eos_every=29)
    assert engine.batch_queue_size == (2 if async_scheduling else 1)
    max_tokens = {}
    for i in range(12):
        # some prompts are longer than max_num_batched_tokens (64): chunked prefill
        max_tokens[f"r{i}"] = 5 + 3 * i
        engine.add_request(f"r{i}", _prompt(i, 10 + 13 * i), max_tokens[f"r{i}"])
    engine.run(max_steps=500)
    _assert_reference_outputs(engine, max_tokens)
    assert any(r.finish_reason == FinishReason.STOP for r in engine.results.values())
    assert engine.worker.step_count == engine.steps or async_scheduling
    _done(engine)


@pytest.mark.parametrize("async_scheduling", SCHEDULING)
def test_preemption_with_small_block_pool(async_scheduling: bool) -> None:
    # 8 requests needing up to 8 blocks each, 23 usable blocks: repeated preemption.
    engine = make_engine(num_blocks=24, async_scheduling=async_scheduling, max_num_batched_tokens=128)
    max_tokens = {f"p{i}": 60 for i in range(8)}
    for i in range(8):
        engine.add_request(f"p{i}", _prompt(100 + i, 40 + 5 * i), 60)
    engine.run(max_steps=2000)
    assert engine.num_preemptions >= 3
    _assert_reference_outputs(engine, max_tokens)
    _done(engine)


@pytest.mark.parametrize("async_scheduling", SCHEDULING)
def test_abort_running_and_waiting(async_scheduling: bool) -> None:
    engine = make_engine(num_blocks=64, async_scheduling=async_scheduling, max_num_seqs=2)
    max_tokens = {f"a{i}": 30 for i in range(4)}
    for i in range(4):
        engine.add_request(f"a{i}", _prompt(200 + i, 20), 30)
    for _ in range(5):
        engine.step()
    assert {r.request_id for r in engine.scheduler.running} == {"a0", "a1"}
    engine.abort(["a1", "a3"])  # one running (maybe with a batch in flight), one waiting
    engine.run(max_steps=500)
    assert engine.results["a1"].finish_reason == "abort"
    assert engine.results["a3"].finish_reason == "abort"
    assert engine.results["a3"].output_token_ids == []
    a1 = engine.results["a1"].output_token_ids
    assert 0 < len(a1) < 30
    assert a1 == engine.worker.reference_generation(engine.results["a1"].prompt_token_ids, 30)[: len(a1)]
    _assert_reference_outputs(engine, max_tokens, skip={"a1", "a3"})
    _done(engine)


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("async_scheduling", SCHEDULING)
def test_prefix_cache_reuse(async_scheduling: bool, block_size: int) -> None:
    engine = make_engine(num_blocks=64, async_scheduling=async_scheduling, block_size=block_size)
    base = _prompt(300, 3 * block_size + 5)
    engine.add_request("first", base, 8)
    engine.run()
    # A later request sharing 3 full blocks hits vLLM's prefix cache: the fake forward
    # then checks that the reused blocks hold exactly the KV a recompute would write.
    engine.add_request("second", base[: 3 * block_size] + _prompt(301, 7), 8)
    # Two concurrent requests sharing 2 blocks with each other.
    shared = _prompt(302, 2 * block_size)
    engine.add_request("c1", [*shared, *_prompt(303, 9)], 8)
    engine.add_request("c2", [*shared, *_prompt(304, 11)], 8)
    engine.run()
    assert engine.num_computed_at_start["first"] == 0
    assert engine.num_computed_at_start["second"] == 3 * block_size
    _assert_reference_outputs(engine, {"first": 8, "second": 8, "c1": 8, "c2": 8})
    assert not engine.verify_cached_blocks()
    _done(engine)


def test_detects_corrupted_cached_block() -> None:
    engine = make_engine(num_blocks=64)
    base = _prompt(400, 40)
    engine.add_request("first", base, 4)
    engine.run()
    cached = [b for b in engine.scheduler.kv_cache_manager.block_pool.blocks if b.block_hash is not None]
    assert len(cached) >= 2
    victim = cached[1].block_id
    layer = engine.worker.layer_names[1]
    engine.worker.kv_caches[layer][victim, 0, 3, 5] += 1
    assert any(f"block {victim} " in p for p in engine.verify_cached_blocks())
    engine.add_request("second", base[:32] + _prompt(401, 3), 4)
    with pytest.raises(AssertionError, match=r"context: request 'second' layer model\.layers\.1"):
        engine.run()
    assert engine.worker.violations[0].block_ids == [victim]


def test_building_blocks_and_run_engine_steps() -> None:
    config = make_vllm_config(block_size=16, max_num_batched_tokens=32)
    scheduler = make_scheduler(config, num_blocks=32)
    worker = FakeWorker(config, scheduler.kv_cache_config)
    kv = worker.kv_caches["model.layers.0.self_attn.attn"]
    assert tuple(kv.shape) == (32, 2, 16, 64)  # [blocks, kv_heads, block_size, K|V]
    assert worker.connector is None
    engine = EngineHarness(scheduler, worker)
    scheduler.add_request(engine.make_request("x", _prompt(500, 50), 6))
    results = run_engine_steps(scheduler, worker, max_steps=100)
    assert results["x"].output_token_ids == worker.reference_generation(_prompt(500, 50), 6)
    assert not worker.violations
    assert_scheduler_empty(scheduler)


# ----------------------------------------------------------------------------- ExampleConnector


def _example_engine(tmp_path, **kw):
    # ExampleConnector saves a new request's whole prompt in one step, so prefill must not be
    # chunked (then max_num_batched_tokens must be >= max_model_len).
    return make_engine(
        num_blocks=64,
        kv_connector="ExampleConnector",
        kv_connector_extra_config={"shared_storage_path": str(tmp_path)},
        enable_chunked_prefill=False,
        max_model_len=256,
        max_num_batched_tokens=256,
        **kw,
    )


@pytest.mark.parametrize("async_scheduling", SCHEDULING)
def test_example_connector_disk_roundtrip(tmp_path, async_scheduling: bool) -> None:
    prompts = {f"e{i}": _prompt(600 + i, 40 + 8 * i) for i in range(3)}
    first = _example_engine(tmp_path, async_scheduling=async_scheduling)
    for req_id, prompt in prompts.items():
        first.add_request(req_id, prompt, 6)
    first.run()
    _done(first)
    assert any(tmp_path.iterdir()), "ExampleConnector saved nothing"

    # A fresh engine (zeroed KV cache, empty prefix cache) loads the prompts from disk.
    second = _example_engine(tmp_path, async_scheduling=async_scheduling)
    for req_id, prompt in prompts.items():
        second.add_request(req_id, prompt, 6)
    second.run()
    for req_id, prompt in prompts.items():
        assert second.num_computed_at_start[req_id] == (len(prompt) - 2) // 16 * 16
    _assert_reference_outputs(second, {r: 6 for r in prompts})
    _done(second)


def test_hook_order_example_connector(tmp_path) -> None:
    engine = _example_engine(tmp_path)
    engine.add_request("h", _prompt(700, 20), 3)
    engine.step()
    per_layer = ["wait_for_layer_load", "save_kv_layer"] * 2
    tail = [
        "start_load_kv",
        "wait_for_save",
        "get_transfer_results",
        "get_block_ids_with_load_errors",
        "get_kv_connector_stats",
        "get_kv_connector_kv_cache_events",
        "build_connector_worker_meta",
        "clear_connector_metadata",
    ]
    assert engine.worker.hook_log == ["handle_preemptions", "bind_connector_metadata", *per_layer, *tail]
    engine.run()
    _done(engine)


# ----------------------------------------------------------------------------- OracleConnector


@pytest.mark.parametrize("async_scheduling", SCHEDULING)
@pytest.mark.parametrize("load_async", [False, True], ids=["sync_load", "async_load"])
def test_oracle_external_loads(async_scheduling: bool, load_async: bool) -> None:
    engine = make_engine(
        num_blocks=64,
        async_scheduling=async_scheduling,
        kv_connector_extra_config={"load_async": load_async, "async_delay": 2},
        **ORACLE,
    )
    max_tokens = {}
    for i in range(4):
        max_tokens[f"o{i}"] = 10
        engine.add_request(f"o{i}", _prompt(800 + i, 30 + 11 * i), 10, kv_transfer_params={"oracle": True})
    engine.add_request("plain", _prompt(899, 33), 10)
    max_tokens["plain"] = 10
    if not load_async:
        engine.step()
        assert engine.worker.hook_log[:3] == [
            "handle_preemptions",
            "bind_connector_metadata",
            "start_load_kv",
        ]
    engine.run()
    for i in range(4):
        n = len(engine.results[f"o{i}"].prompt_token_ids)
        assert engine.num_computed_at_start[f"o{i}"] == (n - 1) // 16 * 16
    assert engine.num_computed_at_start["plain"] == 0
    assert engine.scheduler.connector.num_loads == 4
    _assert_reference_outputs(engine, max_tokens)
    _done(engine)


@pytest.mark.parametrize("load_async", [False, True], ids=["sync_load", "async_load"])
def test_oracle_load_failure_recompute(load_async: bool) -> None:
    engine = make_engine(
        num_blocks=64,
        kv_load_failure_policy="recompute",
        kv_connector_extra_config={"load_async": load_async, "fail_first_block": True},
        **ORACLE,
    )
    for i in range(3):
        engine.add_request(f"f{i}", _prompt(900 + i, 50), 8, kv_transfer_params={"oracle": True})
    engine.run()
    # sync: the forward read the unloaded block in the pass that reported it (tolerated);
    # async: the request never ran on it.
    assert bool(engine.worker.tolerated_violations) == (not load_async)
    _assert_reference_outputs(engine, {f"f{i}": 8 for i in range(3)})
    _done(engine)


def test_oracle_load_failure_fail_policy() -> None:
    engine = make_engine(
        num_blocks=64,
        kv_load_failure_policy="fail",
        kv_connector_extra_config={"fail_first_block": True},
        **ORACLE,
    )
    engine.add_request("bad", _prompt(950, 50), 8, kv_transfer_params={"oracle": True})
    engine.add_request("good", _prompt(951, 50), 8)
    engine.run()
    assert engine.results["bad"].finish_reason == FinishReason.ERROR
    _assert_reference_outputs(engine, {"good": 8})
    _done(engine)


def test_oracle_corrupt_load_is_detected() -> None:
    engine = make_engine(num_blocks=64, kv_connector_extra_config={"corrupt_load": True}, **ORACLE)
    engine.add_request("c", _prompt(960, 40), 4, kv_transfer_params={"oracle": True})
    with pytest.raises(AssertionError, match="context: request 'c'"):
        engine.run()


@pytest.mark.parametrize("async_scheduling", SCHEDULING)
def test_oracle_delayed_block_free(async_scheduling: bool) -> None:
    # request_finished() keeps the blocks; finished_sending arrives 3 steps later, after the
    # worker checked the blocks were not reused meanwhile (small pool: pressure to reuse).
    engine = make_engine(
        num_blocks=24,
        async_scheduling=async_scheduling,
        max_num_batched_tokens=128,
        kv_connector_extra_config={"delay_free_steps": 3},
        **ORACLE,
    )
    max_tokens = {f"d{i}": 20 for i in range(6)}
    for i in range(6):
        engine.add_request(f"d{i}", _prompt(970 + i, 45), 20)
    engine.run(max_steps=2000)
    assert sorted(engine.worker.connector.sent_ok) == sorted(max_tokens)
    _assert_reference_outputs(engine, max_tokens)
    _done(engine)
