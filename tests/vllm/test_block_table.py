"""``aiokv.vllm._block_table`` (the connector's per-group block tables) against vLLM's real scheduler with its hybrid
KV-cache manager on: a sliding-window group and a full-attention group, the tables kept from the scheduler outputs
alone compared with the KV-cache manager's own after every step."""

from __future__ import annotations

import random
from typing import Any

import pytest

pytest.importorskip("vllm")

from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request

from aiokv import NO_BLOCK
from aiokv._errors import InvalidArgumentError
from aiokv.vllm._block_table import GroupBlockTables, block_ids_of, from_vllm_ids
from tests.vllm._harness import make_request, make_scheduler, make_vllm_config
from tests.vllm._hybrid import hybrid_kv_cache_config

BLOCK = 32
WINDOW = 64


def make_hybrid_scheduler(num_blocks: int) -> Any:
    vllm_config = make_vllm_config(block_size=BLOCK, max_num_batched_tokens=256, max_model_len=1024)
    config = hybrid_kv_cache_config(vllm_config, num_blocks, WINDOW)
    scheduler = make_scheduler(vllm_config, num_blocks, kv_cache_config=config)
    assert len(scheduler.kv_cache_config.kv_cache_groups) == 2
    return scheduler


def output_for(so: SchedulerOutput, requests: dict[str, Request], rng: random.Random) -> ModelRunnerOutput:
    req_ids = [r for r, n in so.num_scheduled_tokens.items() if n > 0]
    sampled = []
    for rid in req_ids:
        req = requests[rid]
        done = req.num_computed_tokens + so.num_scheduled_tokens[rid] >= req.num_tokens
        sampled.append([rng.randrange(3, 900)] if done else [])
    return ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={r: i for i, r in enumerate(req_ids)},
        sampled_token_ids=sampled,
        logprobs=None,
        prompt_logprobs_dict={},
        pooler_output=None,
    )


def check_tables(tables: GroupBlockTables, scheduler: Any) -> int:
    """Compare with the manager's tables; returns the sliding positions vLLM nulled that ours still names (allowed
    only for ids not held by the request any more)."""
    stale = 0
    for rid in scheduler.requests:
        ours = tables.table(rid)
        real = block_ids_of(scheduler.kv_cache_manager.get_blocks(rid))
        if ours is None:
            assert not any(real), rid  # not scheduled yet (or preempted): holds no block
            continue
        sliding, full = ours
        assert full == real[1][: len(full)], rid  # full attention: the same table
        assert len(real[1]) == len(full), rid
        held = {b for g in real for b in g if b != NO_BLOCK}
        for pos, (mine, theirs) in enumerate(zip(sliding, real[0], strict=True)):
            if mine == theirs:
                continue
            # vLLM freed the block (out of the window): ours is either NO_BLOCK already or an id it no longer holds.
            assert theirs == NO_BLOCK, (rid, pos, mine, theirs)
            assert mine not in held, (rid, pos, mine)
            stale += mine != NO_BLOCK
    return stale


def run(scheduler: Any, prompts: list[list[int]], max_tokens: int, seed: int = 0) -> dict[str, int]:
    rng = random.Random(seed)
    tables = GroupBlockTables.from_kv_cache_config(scheduler.kv_cache_config)
    assert tables.sliding_groups == (0,)
    requests: dict[str, Request] = {}
    for i, p in enumerate(prompts):
        req = make_request(f"r{i}", p, max_tokens, hash_block_size=BLOCK, ignore_eos=True)
        requests[req.request_id] = req
        scheduler.add_request(req)
    counts = {"steps": 0, "released": 0, "stale": 0, "full_tables": 0, "preempted": 0}
    while scheduler.has_requests():
        counts["steps"] += 1
        assert counts["steps"] < 5000
        so = scheduler.schedule()
        before = {rid: tables.table(rid) for rid in tables}
        steps, released = tables.apply(so)
        counts["released"] += sum(len(g) for r in released.values() for g in r)
        counts["full_tables"] += sum(s.full_table for s in steps)
        counts["preempted"] += len(so.preempted_req_ids or ())
        for rid, gone in released.items():
            assert not gone[1], rid  # full-attention positions are never released
            old, table = before[rid], tables.table(rid)
            assert old is not None
            for b in gone[0]:  # every position that named a released block is NO_BLOCK now
                positions = [pos for pos, x in enumerate(old[0]) if x == b]
                assert positions, (rid, b)
                if table is not None:  # (None: preempted this step)
                    assert all(table[0][pos] == NO_BLOCK for pos in positions), (rid, b)
        counts["stale"] += check_tables(tables, scheduler)
        scheduler.update_from_output(so, output_for(so, requests, rng))
    return counts


def test_tables_follow_the_manager_with_sliding_blocks_freed_and_reused() -> None:
    """Two long requests decoding past several windows: vLLM frees their sliding blocks as they leave the window and
    hands them out again; the tables see every re-allocation and release the old positions."""
    scheduler = make_hybrid_scheduler(num_blocks=64)
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 900) for _ in range(200)] for _ in range(2)]
    counts = run(scheduler, prompts, max_tokens=150)
    assert counts["released"] > 0, counts  # blocks were reallocated while an old position still named them
    assert counts["full_tables"] == 2, counts


def test_tables_after_preemption_take_the_resumed_table() -> None:
    """A KV cache too small for every request: preempted requests come back with a whole new table per group."""
    scheduler = make_hybrid_scheduler(num_blocks=24)
    rng = random.Random(2)
    prompts = [[rng.randrange(3, 900) for _ in range(150)] for _ in range(4)]
    counts = run(scheduler, prompts, max_tokens=120)
    assert counts["preempted"] > 0, counts
    assert counts["full_tables"] > len(prompts), counts  # resumed requests sent their whole tables again


def test_block_ids_of_maps_null_blocks() -> None:
    scheduler = make_hybrid_scheduler(num_blocks=64)
    pool = scheduler.kv_cache_manager.block_pool
    blocks = KVCacheBlocks(([pool.null_block, pool.blocks[5]], [pool.blocks[6], pool.blocks[7]]))
    assert pool.null_block.block_id == 0
    assert block_ids_of(blocks) == ([NO_BLOCK, 5], [6, 7])


def test_from_vllm_ids() -> None:
    assert from_vllm_ids(([0, 0, 3], [4, 5, 6]), 2) == ([NO_BLOCK, NO_BLOCK, 3], [4, 5, 6])
    assert from_vllm_ids(None, 2) == ([], [])
    with pytest.raises(InvalidArgumentError, match=r"block ids must have one list per group \(2\), got 1"):
        from_vllm_ids(([1],), 2)


def test_bad_arguments() -> None:
    with pytest.raises(InvalidArgumentError, match="num_groups must be >= 1, got 0"):
        GroupBlockTables(0)
    with pytest.raises(InvalidArgumentError, match=r"sliding_groups must be group indices in \[0, 2\)"):
        GroupBlockTables(2, [2])
