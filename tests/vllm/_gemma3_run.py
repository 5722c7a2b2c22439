"""vLLM engines on a two-group model (the tiny random Gemma 3: sliding-window and full-attention layers), with and
without ``AiokvConnector``: what test_gemma3 checks.

Run as ``python -m tests.vllm._gemma3_run --model DIR --out FILE.json`` from the repository root, with
``VLLM_ALLOW_INSECURE_SERIALIZATION=1`` (the worker-side probes below are functions sent with ``collective_rpc``).
One process starts four engines, one after another where it can:

- a no-connector engine: vLLM's hybrid KV-cache manager is on, two KV-cache groups;
- a connector engine (``tiers=cpu=256MiB``): the connector is ``SupportsHMA``, so the hybrid manager stays on,
  with the same two groups (a sliding-window group and a full-attention group sharing one buffer);
- a connector engine with the hybrid manager off (``disable_hybrid_kv_cache_manager=True``): one group holds
  every layer, sliding ones allocated like full attention.

All three run the single prompts, the same again (vLLM's own prefix cache), ``reset_prefix_cache()``, the same
again (the connector engines: restored from aiokv), and a two-turn conversation with a reset between the turns;
the worker's offloader stats are read around each restoring round. Then the no-connector engine runs the
preemption batch as the reference, and

- a connector engine (hybrid manager on) with a small KV cache runs the batch with preemptions: vLLM frees the
  sliding-window blocks as they leave the window and hands them out again at once.

Every prompt is several sliding windows long (``SLIDING_WINDOW`` tokens).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path
from typing import Any

from tests.vllm._baseline_run import BLOCK_SIZE, make_llm, prompt_ids
from tests.vllm._connector_run import (
    BATCH_N,
    each,
    generate,
    kv_transfer,
    reset,
    shutdown,
    timed,
)

SLIDING_WINDOW = 64  # tokens: two blocks
# Hits, (n - 1) // 32 * 32 tokens: 288 (4.5 windows), 128 (a prompt of a block and a token), 192, 32, 0.
PROMPT_LENS = (300, 129, 200, 64, 20)
# Turn 1 computes TURN1_LEN + TURN1_TOKENS - 1 = 192 tokens' KV: its final decode step completes block 5 (tokens
# 160..191, all generated). Turn 2 (213 tokens) restores 192 tokens, 92 past turn 1's prompt (more than a window).
TURN1_LEN, TURN1_TOKENS, TURN2_NEW = 100, 93, 20
# The preemption batch (hybrid manager on): BATCH_N prompts of 100..107 tokens (4 blocks per group at the prefill; the
# sliding group's out-of-window ones are freed at the next step), HMA_BATCH_TOKENS tokens each (7 full-attention
# blocks at the end). The small engine's 40 blocks (a block id holds a block of two layers, 64 KiB: the groups
# overlay each other) admit five at once; their decode steps outgrow the cache and vLLM preempts.
HMA_BATCH_TOKENS = 120
SMALL_KV_BYTES_HMA = 40 * BLOCK_SIZE * 2048
SMALL_MAX_MODEL_LEN = (
    512  # 1024 would need 66 blocks at least (a prefill allocates every sliding position too)
)


def hma_batch_prompts() -> list[list[int]]:
    return [prompt_ids(600 + i, 100 + i) for i in range(BATCH_N)]


def single_prompts() -> list[list[int]]:
    return [prompt_ids(500 + i, n) for i, n in enumerate(PROMPT_LENS)]


def worker_probe(worker: Any) -> dict[str, Any]:
    """In each worker (``collective_rpc``): its KV-cache groups and, with the connector, the offloader's stats."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    config = worker.model_runner.kv_cache_config
    out: dict[str, Any] = {
        "num_blocks": config.num_blocks,
        "groups": [
            {
                "spec": type(g.kv_cache_spec).__name__,
                "sliding_window": getattr(g.kv_cache_spec, "sliding_window", None),
                "layers": list(g.layer_names),
            }
            for g in config.kv_cache_groups
        ],
        "stats": None,
    }
    if has_kv_transfer_group():
        side = get_kv_transfer_group().worker
        stats = side.stats()
        out["stats"] = {
            f.name: getattr(stats, f.name)
            for f in dataclasses.fields(stats)
            if isinstance(getattr(stats, f.name), int)
        }
        out["layout"] = side.off.layout.describe()
        out["grouped"] = side.groups is not None
        out["blocks_dropped"] = side.blocks_dropped
    return out


def probe(llm: Any) -> dict[str, Any]:
    (one,) = llm.collective_rpc(worker_probe)
    result: dict[str, Any] = one
    return result


def rounds(llm: Any) -> dict[str, Any]:
    """The single prompts (computed), again (vLLM's prefix cache), a reset, again (the connector engine: from
    aiokv); then two turns, a reset between them, and turn 2 again (vLLM's prefix cache). The probes before and
    after each round that can restore."""
    prompts = single_prompts()
    res: dict[str, Any] = {"round1": each(llm, prompts)}
    res["repeat"] = each(llm, prompts)
    res["reset1"] = reset(llm)
    res["probe_before_round2"] = probe(llm)
    res["round2"] = each(llm, prompts)
    res["probe_after_round2"] = probe(llm)
    (turn1,) = each(llm, [prompt_ids(7, TURN1_LEN)], TURN1_TOKENS)
    res["turn1"] = turn1
    res["reset2"] = reset(llm)
    turn2_prompt = prompt_ids(7, TURN1_LEN) + turn1["token_ids"] + prompt_ids(8, TURN2_NEW)
    res["turn2_len"] = len(turn2_prompt)
    res["probe_before_turn2"] = probe(llm)
    (res["turn2"],) = each(llm, [turn2_prompt])
    res["probe_after_turn2"] = probe(llm)
    (res["turn2_repeat"],) = each(llm, [turn2_prompt])
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    result: dict[str, Any] = {"pid": os.getpid(), "block_size": BLOCK_SIZE}
    try:
        plain = timed(result, "start_plain", make_llm, args.model)
        conn = timed(result, "start_conn", make_llm, args.model, kv_transfer_config=kv_transfer("cpu=256MiB"))
        result["plain_probe"] = probe(plain)
        result["conn_probe"] = probe(conn)
        result["plain"] = timed(result, "rounds_plain", rounds, plain)
        result["conn"] = timed(result, "rounds_conn", rounds, conn)
        shutdown(conn)
        off = timed(
            result,
            "start_off",
            make_llm,
            args.model,
            disable_hybrid_kv_cache_manager=True,
            kv_transfer_config=kv_transfer("cpu=256MiB"),
        )
        result["off_probe"] = probe(off)
        result["off"] = timed(result, "rounds_off", rounds, off)
        shutdown(off)
        result["plain_batch"] = timed(
            result, "batch_plain", generate, plain, hma_batch_prompts(), HMA_BATCH_TOKENS
        )
        shutdown(plain)
        small = timed(
            result,
            "start_small",
            make_llm,
            args.model,
            kv_cache_memory_bytes=SMALL_KV_BYTES_HMA,
            max_model_len=SMALL_MAX_MODEL_LEN,
            disable_log_stats=False,  # RequestOutput.metrics (num_preemptions)
            kv_transfer_config=kv_transfer("cpu=256MiB"),
        )
        result["small_batch"] = timed(
            result, "batch_small", generate, small, hma_batch_prompts(), HMA_BATCH_TOKENS
        )
        result["small_probe"] = probe(small)
        shutdown(small)
    finally:  # what ran so far, for a failing test's message
        Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
