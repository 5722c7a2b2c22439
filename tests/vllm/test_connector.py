"""AiokvConnector against vLLM 0.32's real Scheduler and a worker-side connector in one process.

The harness's fake forward writes each token's KV as a function of its whole prefix and checks, before every
forward, that every computed token of every scheduled request holds exactly that KV: a restore of wrong KV,
a load into the wrong block, or a block written under a copy fails the test byte-exactly. Every scenario runs
with vLLM's synchronous and asynchronous scheduling.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

import aiokv
from aiokv.vllm import AiokvConnector
from aiokv.vllm._worker import WorkerSide

from ._harness import EngineHarness, assert_scheduler_empty, make_engine
from ._harness import connector_stats as _stats
from ._harness import connector_worker as _worker
from ._harness import spread_prompt as _prompt

SCHEDULING = [pytest.param(False, id="sync"), pytest.param(True, id="async")]
BS = 16


_OPEN: list[EngineHarness] = []


@pytest.fixture(autouse=True)
def _close_engines() -> Iterator[None]:
    """Engines a failed test left open are shut down (their workers' loop threads and tiers)."""
    yield
    while _OPEN:
        engine = _OPEN.pop()
        with contextlib.suppress(Exception):
            engine.shutdown()


def _engine(
    num_blocks: int = 64, *, tiers: str = "cpu=64MiB", async_scheduling: bool = False, **extra: Any
) -> EngineHarness:
    engine = make_engine(
        num_blocks,
        async_scheduling=async_scheduling,
        kv_connector="AiokvConnector",
        kv_connector_module_path="aiokv.vllm",
        kv_connector_extra_config={"tiers": tiers, "load_policy": "always", **extra},
    )
    _OPEN.append(engine)
    return engine


def _offered(engine: EngineHarness) -> int:
    conn = engine.scheduler.connector
    assert isinstance(conn, AiokvConnector)
    assert conn.scheduler is not None
    return conn.scheduler.tokens_offered


def _finish(engine: EngineHarness, max_tokens: dict[str, int]) -> None:
    """Every request got the output a plain recompute gives; nothing leaked; the KV was right throughout."""
    for rid, n in max_tokens.items():
        res = engine.results[rid]
        if res.finish_reason == "abort":
            continue
        assert res.output_token_ids == engine.worker.reference_generation(res.prompt_token_ids, n), rid
    engine.assert_ok()
    assert_scheduler_empty(engine.scheduler)
    engine.shutdown()


def _run_one(engine: EngineHarness, rid: str, prompt: list[int], max_tokens: int) -> None:
    engine.add_request(rid, prompt, max_tokens)
    engine.run()


@pytest.fixture(params=SCHEDULING)
def async_scheduling(request: pytest.FixtureRequest) -> bool:
    return bool(request.param)


# ----------------------------------------------------------------------------- restores


def test_prefix_is_restored_after_vllm_forgot_it(async_scheduling: bool) -> None:
    engine = _engine(async_scheduling=async_scheduling)
    prompt = _prompt(1, 5 * BS + 3)
    _run_one(engine, "a", prompt, 4)
    assert engine.scheduler.reset_prefix_cache()
    _run_one(engine, "b", [*prompt, 7, 8], 4)
    assert engine.num_computed_at_start["b"] == 5 * BS  # restored by aiokv, vLLM's own cache was reset
    assert _offered(engine) == 5 * BS
    stats = _stats(engine)
    assert stats.blocks_loaded == 5
    assert stats.load_errors == 0
    _finish(engine, {"a": 4, "b": 4})


def test_only_what_vllm_lacks_is_loaded(async_scheduling: bool) -> None:
    """vLLM still caches the first blocks: aiokv loads only past them (present_blocks), not over them."""
    engine = _engine(async_scheduling=async_scheduling)
    short, long = _prompt(2, 2 * BS + 1), _prompt(2, 6 * BS + 1)
    _run_one(engine, "long", long, 2)
    assert engine.scheduler.reset_prefix_cache()
    _run_one(engine, "short", short, 2)  # vLLM caches blocks 0-1 again (aiokv restores them)
    loaded = _stats(engine).blocks_loaded
    _run_one(engine, "again", [*long, 5], 2)
    assert engine.num_computed_at_start["again"] == 6 * BS
    assert _stats(engine).blocks_loaded - loaded == 4  # blocks 2..5: vLLM's own hit covered 0..1
    _finish(engine, {"long": 2, "short": 2, "again": 2})


def test_last_block_and_decode_blocks_are_stored_for_the_next_turn(async_scheduling: bool) -> None:
    """Prompt 40 tokens, 9 answered: the final step computes token 47 and completes block 2, of decode
    tokens. The next turn (prompt = the whole conversation) finds all three blocks."""
    engine = _engine(async_scheduling=async_scheduling)
    prompt = _prompt(3, 40)
    _run_one(engine, "turn1", prompt, 9)
    answer = engine.results["turn1"].output_token_ids
    assert len(answer) == 9
    assert engine.scheduler.reset_prefix_cache()
    _run_one(engine, "turn2", [*prompt, *answer, 11, 12, 13], 3)
    assert engine.num_computed_at_start["turn2"] == 3 * BS
    _finish(engine, {"turn1": 9, "turn2": 3})


def test_many_requests_with_shared_prefixes_and_preemption(async_scheduling: bool) -> None:
    """Three system prompts seed aiokv; vLLM forgets them; then 18 requests on a pool too small for them
    all (preemption) restore them, some while others decode."""
    engine = _engine(20, async_scheduling=async_scheduling)
    systems = [_prompt(s, 3 * BS + 5) for s in range(3)]
    max_tokens = {}
    for i, system in enumerate(systems):
        max_tokens[f"seed{i}"] = 2
        engine.add_request(f"seed{i}", [*system, 1], 2)
    engine.run()
    assert engine.scheduler.reset_prefix_cache()
    for i in range(18):
        rid = f"r{i}"
        max_tokens[rid] = 8 + 3 * (i % 7)
        engine.add_request(rid, [*systems[i % 3], *_prompt(100 + i, 5 + i % 20)], max_tokens[rid])
        if i % 6 == 5:
            engine.run(until=lambda: engine.steps % 5 == 0)
    engine.run()
    assert _offered(engine) >= 3 * BS
    assert engine.num_preemptions > 0
    assert _stats(engine).load_errors == 0
    _finish(engine, max_tokens)


# ----------------------------------------------------------------------------- block reuse


class _Gate:
    """Holds every store copy of a worker's offloader until released (once released it stays open)."""

    def __init__(self, worker: WorkerSide) -> None:
        assert worker.off is not None
        self.executor = worker.off.executor
        self.open = threading.Event()
        self.stores_held = 0
        original: Callable[..., None] = self.executor._copy_store

        def gated(*args: Any) -> None:
            if not self.open.is_set():
                self.stores_held += 1
            self.open.wait(60)
            original(*args)

        self.executor._copy_store = gated  # type: ignore[method-assign]


def test_preempted_blocks_are_not_reused_under_a_store_in_flight(
    async_scheduling: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The seed's reuse bug, forced: every store is held on its stream until the first preemption. vLLM
    frees the preempted request's blocks at once and the same step's forward writes them for another
    request. The gate opens either when the worker waits for the preemption (the fence) or, failing that,
    right after the forward wrote the freed blocks: without the fence the held store would copy the other
    request's KV under the old hash, and the restore below would fail the KV check."""
    engine = _engine(14, async_scheduling=async_scheduling)
    worker = _worker(engine)
    gate = _Gate(worker)
    fenced: list[bool] = []
    original_wait = WorkerSide._wait_preempted

    def wait(self: WorkerSide, fut: Any) -> None:
        fenced.append(not gate.open.is_set())
        gate.open.set()
        original_wait(self, fut)

    monkeypatch.setattr(WorkerSide, "_wait_preempted", wait)
    original_execute, original_forward = engine.worker.execute_model, engine.worker._forward
    preempting: list[bool] = [False]

    def execute(so: Any) -> Any:
        preempting[0] = bool(so.preempted_req_ids)
        return original_execute(so)

    def forward(*args: Any) -> None:
        original_forward(*args)
        if preempting[0]:
            gate.open.set()  # reached with the gate still closed only if the fence is missing

    monkeypatch.setattr(engine.worker, "execute_model", execute)
    monkeypatch.setattr(engine.worker, "_forward", forward)
    prompts = {f"p{i}": _prompt(10 + i, 3 * BS + 9) for i in range(4)}
    for rid, prompt in prompts.items():
        engine.add_request(rid, prompt, 24)
    engine.run()
    assert engine.num_preemptions > 0
    assert gate.stores_held > 0
    # Every prefix stored while the gate held the copies must restore byte-exactly.
    engine.scheduler.reset_prefix_cache()
    for rid, prompt in prompts.items():
        engine.add_request(f"{rid}-again", [*prompt, *engine.results[rid].output_token_ids[:8]], 2)
    engine.run()
    assert _offered(engine) > 0
    _finish(engine, {**dict.fromkeys(prompts, 24), **{f"{r}-again": 2 for r in prompts}})
    assert fenced  # the first preemption found the held stores and waited for them
    assert fenced[0]


def test_finished_blocks_stay_with_vllm_until_their_stores_are_done(async_scheduling: bool) -> None:
    engine = _engine(async_scheduling=async_scheduling)
    gate = _Gate(_worker(engine))
    engine.add_request("a", _prompt(20, 4 * BS + 2), 3)
    engine.run(until=lambda: engine.results["a"].finished)
    # Finished, but its stores are held: vLLM still owns its blocks.
    assert "a" in engine.scheduler.requests
    for _ in range(3):
        engine.step()
    assert "a" in engine.scheduler.requests
    assert engine.scheduler.connector.has_pending_block_frees()
    gate.open.set()
    engine.run()
    assert "a" not in engine.scheduler.requests
    assert _stats(engine).blocks_stored >= 4
    _finish(engine, {"a": 3})


# ----------------------------------------------------------------------------- abort and failures


def test_abort_while_waiting_loading_and_running(async_scheduling: bool) -> None:
    engine = _engine(async_scheduling=async_scheduling)
    base = _prompt(30, 4 * BS + 1)
    _run_one(engine, "seed", base, 2)
    engine.scheduler.reset_prefix_cache()
    assert _worker(engine).off is not None
    executor = _worker(engine).off.executor  # type: ignore[union-attr]
    hold = threading.Event()
    original = executor._copy_load

    def held_load(*args: Any) -> None:
        hold.wait(60)
        original(*args)

    executor._copy_load = held_load  # type: ignore[method-assign]
    engine.add_request("loading", [*base, 1, 2], 8)
    engine.add_request("running", _prompt(31, 50), 30)
    engine.add_request("waiting", _prompt(32, 20), 5)
    for _ in range(4):
        engine.step()
    engine.abort(["loading", "waiting"])
    hold.set()
    engine.run(until=lambda: len(engine.results["running"].output_token_ids) > 5)
    engine.abort("running")
    engine.run()
    assert all(engine.results[r].finish_reason == "abort" for r in ("loading", "running", "waiting"))
    _finish(engine, {"seed": 2})


def test_failed_load_is_recomputed_not_served(async_scheduling: bool) -> None:
    engine = _engine(async_scheduling=async_scheduling)
    prompt = _prompt(40, 5 * BS + 7)
    _run_one(engine, "a", prompt, 3)
    engine.scheduler.reset_prefix_cache()
    executor = _worker(engine).off.executor  # type: ignore[union-attr]

    def broken(*args: Any) -> None:
        raise OSError("injected copy failure")

    executor._copy_load = broken  # type: ignore[method-assign]
    _run_one(engine, "b", [*prompt, 9], 3)
    stats = _stats(engine)
    assert stats.load_errors == 5
    assert stats.blocks_loaded == 0
    _finish(engine, {"a": 3, "b": 3})


def test_corrupt_disk_entries_are_misses(tmp_path: Path, async_scheduling: bool) -> None:
    """Blocks that exist only on disk, with every entry's payload damaged: each one fails verification and
    is a miss; vLLM recomputes everything and nothing wrong is loaded."""
    tiers = f"cpu=1MiB,disk={tmp_path}:16MiB"
    first = _engine(tiers=tiers, async_scheduling=async_scheduling)
    prompt = _prompt(50, 6 * BS + 1)
    _run_one(first, "a", prompt, 2)
    _finish(first, {"a": 2})
    for seg in tmp_path.rglob("*"):
        if seg.is_file() and seg.stat().st_size > 4096:
            data = bytearray(seg.read_bytes())
            for i in range(4096, len(data), 997):
                data[i] ^= 0xFF
            seg.write_bytes(bytes(data))
    second = _engine(tiers=tiers, async_scheduling=async_scheduling)
    _run_one(second, "b", [*prompt, 3], 2)
    assert second.num_computed_at_start["b"] == 0
    _finish(second, {"b": 2})


# ----------------------------------------------------------------------------- persistent tiers


def test_a_new_engine_finds_the_disk_tier(tmp_path: Path, async_scheduling: bool) -> None:
    tiers = f"cpu=8MiB,disk={tmp_path}:64MiB"
    first = _engine(tiers=tiers, async_scheduling=async_scheduling)
    prompt = _prompt(60, 7 * BS + 3)
    _run_one(first, "a", prompt, 2)
    _finish(first, {"a": 2})  # shutdown writes what is queued for the disk
    second = _engine(tiers=tiers, async_scheduling=async_scheduling)
    _run_one(second, "b", [*prompt, 4, 4], 2)
    assert second.num_computed_at_start["b"] == 7 * BS
    assert _stats(second).staged_blocks == 7
    _finish(second, {"b": 2})


def _two_engines_share(tiers: str, async_scheduling: bool) -> None:
    """Engine A stores a prefix; once A's write-through reached the shared tier, engine B (its own empty CPU
    tier) restores it from there, byte-exactly, while A still runs."""
    from tests.tiers._servers import wait_until

    a = _engine(tiers=tiers, async_scheduling=async_scheduling)
    b = _engine(tiers=tiers, async_scheduling=async_scheduling)
    prompt = _prompt(70, 6 * BS + 2)
    _run_one(a, "a", prompt, 2)
    wait_until(lambda: _stats(a).write_through_blocks >= 6, 30, "engine A's write-through")
    _run_one(b, "b", [*prompt, 6], 2)
    assert b.num_computed_at_start["b"] == 6 * BS
    assert _stats(b).staged_blocks == 6
    _finish(a, {"a": 2})
    _finish(b, {"b": 2})


def test_two_engines_share_one_redis(tmp_path: Path, async_scheduling: bool) -> None:
    from tests.tiers._servers import LOOKED_FOR, ServerProcess, default_binary

    binary = default_binary()
    if binary is None:
        pytest.skip(f"no server binary: looked for {LOOKED_FOR['redis']}; {LOOKED_FOR['valkey']}")
    server = ServerProcess(tmp_path / "server", binary)
    server.start()
    try:
        _two_engines_share(f"cpu=4MiB,redis={server.url}", async_scheduling)
    finally:
        server.stop()


def test_two_engines_share_one_shared_memory_tier(tmp_path: Path, async_scheduling: bool) -> None:
    import uuid

    name = f"aiokv-test-{uuid.uuid4().hex[:12]}"
    try:
        _two_engines_share(f"cpu=4MiB,shm={name}:16MiB", async_scheduling)
    finally:
        import shutil

        shutil.rmtree(f"/dev/shm/aiokv-{name}", ignore_errors=True)


# ----------------------------------------------------------------------------- configuration


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"tierz": "cpu=1GiB"}, "kv_connector_extra_config has unknown key(s) 'tierz' for AiokvConnector"),
        ({"tiers": "gpu=1GiB"}, "kv_connector_extra_config['tiers']: tiers must name cpu, disk, shm"),
        ({"tiers": "disk=/tmp/x:1GiB"}, "tiers must start with cpu=SIZE"),
        (
            {"load_policy": "sometimes"},
            "kv_connector_extra_config['load_policy'] must be 'decide' or 'always'",
        ),
        ({"eviction": "random"}, "kv_connector_extra_config['eviction'] must be one of"),
        (
            {"write_through_max_bytes": -1},
            "kv_connector_extra_config['write_through_max_bytes'] must be an int >= 0",
        ),
        (
            {"close_timeout_s": "soon"},
            "kv_connector_extra_config['close_timeout_s'] must be a number of seconds",
        ),
        ({"kv_events_replay_endpoint": "tcp://127.0.0.1:1"}, "needs kv_events_endpoint"),
    ],
)
def test_bad_config_is_refused_naming_the_key(extra: dict[str, Any], message: str) -> None:
    with pytest.raises(aiokv.InvalidArgumentError) as info:
        make_engine(
            16,
            kv_connector="AiokvConnector",
            kv_connector_module_path="aiokv.vllm",
            kv_connector_extra_config=extra,
        )
    assert message in str(info.value)


def test_write_through_size_accepts_units() -> None:
    from aiokv.vllm import ConnectorConfig

    assert (
        ConnectorConfig.from_extra_config({"write_through_max_bytes": "64MiB"}).write_through_max_bytes
        == 64 << 20
    )


# ----------------------------------------------------------------------------- observability


def test_connector_stats_and_prometheus_counters() -> None:
    import functools

    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

    engine = _engine()
    prompt = _prompt(80, 4 * BS + 1)
    _run_one(engine, "a", prompt, 2)
    engine.scheduler.reset_prefix_cache()
    _run_one(engine, "b", [*prompt, 2], 2)
    conn = engine.worker.connector
    assert isinstance(conn, AiokvConnector)
    conn._stats_read = 0.0  # the connector reads the offloader's counters at most once a second
    stats = conn.get_kv_connector_stats()
    assert stats is not None
    data = stats.reduce()
    assert data["blocks_stored"] >= 4
    assert data["blocks_loaded"] == 4
    # vLLM sums the workers' reports, then feeds them to the connector's Prometheus metrics.
    merged = AiokvConnector.build_kv_connector_stats(dict(data)).aggregate(stats)
    assert merged.reduce()["blocks_loaded"] == 8
    registry = CollectorRegistry()
    types = {cls: functools.partial(cls, registry=registry) for cls in (Counter, Gauge, Histogram)}
    prom = AiokvConnector.build_prom_metrics(engine.vllm_config, types, ["engine"], {0: ["0"]})
    assert prom is not None
    prom.observe(data, 0)
    assert registry.get_sample_value("vllm:aiokv_blocks_loaded_total", {"engine": "0"}) == 4
    _finish(engine, {"a": 2, "b": 2})


def test_decide_policy_measures_the_engines_prefill_rate() -> None:
    """load_policy="decide" (the default) learns vLLM's prefill speed from the forwards it sees."""
    engine = make_engine(
        64,
        max_num_batched_tokens=256,
        kv_connector="AiokvConnector",
        kv_connector_module_path="aiokv.vllm",
        kv_connector_extra_config={"tiers": "cpu=64MiB"},
    )
    _OPEN.append(engine)
    _run_one(engine, "a", _prompt(90, 12 * BS), 2)
    stats = _stats(engine)
    assert stats.load_policy == "decide"
    assert stats.prefill_tokens_per_s is not None
    assert stats.prefill_tokens_per_s > 0
    _finish(engine, {"a": 2})
