"""vLLM engines with and without ``AiokvConnector``, end to end with ``LLM.generate``: what test_engine_connector checks.

Run as ``python -m tests.vllm._connector_run SCENARIO --model DIR --out FILE.json [...]`` from the repository root
(test_engine_connector does, in a subprocess, like tests/vllm/_baseline_run.py). Each scenario starts the engines it
needs once and writes every result (tokens, exact logprobs, cached-token counts) as JSON:

- ``main``: a no-connector engine and a connector engine (``tiers=cpu=256MiB``) side by side in this process: a few
  prompts, the same again (vLLM's own prefix cache), ``reset_prefix_cache()``, the same again (the connector engine:
  restored from aiokv); a two-turn conversation with a reset between the turns; then the no-connector engine (large
  KV cache) runs the preemption batch and the last prompt, as the references. Then a start-up with a
  bad option (must fail), then a connector engine with a small KV cache and a disk tier (``--disk-dir``) that runs
  the batch with preemptions and one last prompt, and is shut down only by this process's exit.
- ``disk``: a fresh process with the same tiers as ``main``'s disk engine: the batch and the last prompt again, the
  first request of each restored from the disk tier.
- ``tp2``: the connector engine with ``tensor_parallel_size=2``: the prompts, a reset, the prompts again.
- ``layerwise``: a no-connector engine and a connector engine with ``layerwise: true``: the prompts, a reset, the
  prompts again (test_connector_layerwise).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from tests.vllm._baseline_run import BLOCK_SIZE, make_llm, prompt_ids

MAX_TOKENS = 8
# Lengths of the single prompts: a hit is every full block before the last token, (n - 1) // 32 * 32 tokens: 96,
# 32 (a prompt of exactly two blocks: its last token is recomputed), 64, 0 (shorter than a block), 192.
PROMPT_LENS = (100, 64, 65, 20, 200)
# Two turns: turn 1 computes TURN1_LEN + TURN1_TOKENS - 1 = 96 tokens' KV (the last sampled token has none), so its
# final decode step completes block 2 (tokens 64..95, all of them generated). Turn 2 = turn 1's prompt and output
# plus TURN2_NEW tokens (117 tokens): a restore covers 96 tokens, 46 past turn 1's prompt.
TURN1_LEN, TURN1_TOKENS, TURN2_NEW = 50, 47, 20
# The preemption batch: BATCH_N prompts of 312..319 tokens (10 blocks each), BATCH_TOKENS tokens each (12 blocks at
# the end; 96 blocks for all of them). The small engine's 42 blocks admit 4 prompts with a block or two to spare, and
# their first decode steps cross into an 11th block one request after another: vLLM preempts the newest running
# request (it is re-admitted later, its prefix found by aiokv's lookup or vLLM's own prefix cache).
BATCH_N, BATCH_TOKENS = 8, 40
SMALL_KV_BYTES = 42 * BLOCK_SIZE * 4096  # 4 layers x K,V x 2 kv heads x 64 x fp32 = 4 KiB per token
# The small engine's last prompt, right before its process exits: writes towards the disk may still be queued then.
LAST_LEN = 160
BAD_EXTRA = {"tierz": "cpu=1GiB"}


def batch_prompts() -> list[list[int]]:
    return [prompt_ids(300 + i, 312 + i) for i in range(BATCH_N)]


def single_prompts() -> list[list[int]]:
    return [prompt_ids(100 + i, n) for i, n in enumerate(PROMPT_LENS)]


def last_prompt() -> list[int]:
    return prompt_ids(999, LAST_LEN)


def kv_transfer(tiers: str, **extra: Any) -> Any:
    from vllm.config import KVTransferConfig

    return KVTransferConfig(
        kv_connector="AiokvConnector",
        kv_connector_module_path="aiokv.vllm",
        kv_role="kv_both",
        kv_connector_extra_config={"tiers": tiers, "load_policy": "always", **extra},
    )


def generate(llm: Any, prompts: list[list[int]], max_tokens: int = MAX_TOKENS) -> list[dict[str, Any]]:
    """One ``generate`` call for every prompt: per prompt its tokens, exact logprobs, cached tokens, preemptions."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0, max_tokens=max_tokens, logprobs=1, detokenize=False)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    rows = []
    for out in outs:
        comp = out.outputs[0]
        rows.append(
            {
                "token_ids": list(comp.token_ids),
                "logprobs": [
                    [[tid, lp.logprob, lp.rank] for tid, lp in sorted(step.items())]
                    for step in comp.logprobs or []
                ],
                "cumulative_logprob": comp.cumulative_logprob,
                "num_cached_tokens": out.num_cached_tokens,
                "finish_reason": comp.finish_reason,
                "num_preemptions": getattr(out.metrics, "num_preemptions", None),
            }
        )
    return rows


def reset(llm: Any) -> int:
    """``reset_prefix_cache()``; returns the attempt that succeeded (0: none did). vLLM refuses a reset while any
    block is held, and the connector holds a finished request's blocks until its stores are done (reported at a
    later engine step): a one-token request between attempts steps the engine."""
    for attempt in range(1, 4):
        if llm.reset_prefix_cache():
            return attempt
        generate(llm, [[5, 6, 7]], max_tokens=1)
    return 0


def shutdown(llm: Any) -> None:
    """Stop the engine core and its workers now (vLLM 0.32's ``LLM`` has no ``shutdown``)."""
    llm.llm_engine.engine_core.shutdown()


def timed(result: dict[str, Any], key: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
    t0 = time.perf_counter()
    value = fn(*args, **kwargs)
    result.setdefault("wall_s", {})[key] = round(time.perf_counter() - t0, 2)
    return value


def each(llm: Any, prompts: list[list[int]], max_tokens: int = MAX_TOKENS) -> list[dict[str, Any]]:
    """One ``generate`` call per prompt: each request runs alone, so its forwards are the same shapes whether its
    prefix is computed, found in vLLM's prefix cache or restored by aiokv (in a batch, a restored request joins
    the running batch a step or two later than a computed one, and other batch shapes change float rounding)."""
    return [generate(llm, [p], max_tokens)[0] for p in prompts]


def rounds(llm: Any) -> dict[str, Any]:
    """The single prompts (computed), again (vLLM's own prefix cache), a reset, again (the connector engine: from
    aiokv); then two turns, a reset between them, and turn 2 again (vLLM's own prefix cache)."""
    prompts = single_prompts()
    res: dict[str, Any] = {"round1": each(llm, prompts)}
    res["repeat"] = each(llm, prompts)
    res["reset1"] = reset(llm)
    res["round2"] = each(llm, prompts)
    (turn1,) = each(llm, [prompt_ids(7, TURN1_LEN)], TURN1_TOKENS)
    res["turn1"] = turn1
    res["reset2"] = reset(llm)
    turn2_prompt = prompt_ids(7, TURN1_LEN) + turn1["token_ids"] + prompt_ids(8, TURN2_NEW)
    res["turn2_len"] = len(turn2_prompt)
    (res["turn2"],) = each(llm, [turn2_prompt])
    (res["turn2_repeat"],) = each(llm, [turn2_prompt])
    return res


def scenario_main(args: argparse.Namespace, result: dict[str, Any]) -> None:
    plain = timed(result, "start_plain", make_llm, args.model)
    conn = timed(result, "start_conn", make_llm, args.model, kv_transfer_config=kv_transfer("cpu=256MiB"))
    result["plain"] = timed(result, "rounds_plain", rounds, plain)
    result["conn"] = timed(result, "rounds_conn", rounds, conn)
    result["plain_batch"] = timed(result, "batch_plain", generate, plain, batch_prompts(), BATCH_TOKENS)
    result["plain_last"] = generate(plain, [last_prompt()])[0]
    shutdown(conn)
    shutdown(plain)

    t0 = time.perf_counter()
    try:
        bad = make_llm(args.model, kv_transfer_config=kv_transfer("cpu=64MiB", **BAD_EXTRA))
    except Exception as exc:
        result["bad"] = {
            "raised": True,
            "type": type(exc).__name__,
            "text": "".join(traceback.format_exception(exc)),
        }
    else:
        result["bad"] = {"raised": False}
        shutdown(bad)
    result.setdefault("wall_s", {})["start_bad"] = round(time.perf_counter() - t0, 2)

    # Shut down by this process's exit only: the disk tier's files must hold every block when "disk" reads them.
    small = timed(
        result,
        "start_small",
        make_llm,
        args.model,
        kv_cache_memory_bytes=SMALL_KV_BYTES,
        disable_log_stats=False,  # RequestOutput.metrics (num_preemptions)
        kv_transfer_config=kv_transfer(disk_tiers(args.disk_dir)),
    )
    result["small_batch"] = timed(result, "batch_small", generate, small, batch_prompts(), BATCH_TOKENS)
    result["small_last"] = generate(small, [last_prompt()])[0]


def disk_tiers(disk_dir: str) -> str:
    return f"cpu=64MiB,disk={disk_dir}:256MiB"


def scenario_disk(args: argparse.Namespace, result: dict[str, Any]) -> None:
    llm = timed(
        result, "start", make_llm, args.model, kv_transfer_config=kv_transfer(disk_tiers(args.disk_dir))
    )
    result["last"] = generate(llm, [last_prompt()])[0]
    result["batch"] = timed(result, "batch", generate, llm, batch_prompts(), BATCH_TOKENS)
    shutdown(llm)


def scenario_tp2(args: argparse.Namespace, result: dict[str, Any]) -> None:
    llm = timed(
        result,
        "start",
        make_llm,
        args.model,
        tensor_parallel_size=2,
        kv_transfer_config=kv_transfer("cpu=256MiB"),
    )
    result["conn"] = timed(result, "rounds", rounds, llm)
    shutdown(llm)


def scenario_layerwise(args: argparse.Namespace, result: dict[str, Any]) -> None:
    """A no-connector engine and a connector engine with ``layerwise: true`` side by side, both with synchronous
    scheduling (what layer-wise loads need): the single prompts (computed), a reset, the same again (the
    connector engine: restored from aiokv, layer by layer)."""
    plain = timed(result, "start_plain", make_llm, args.model, async_scheduling=False)
    conn = timed(
        result,
        "start_conn",
        make_llm,
        args.model,
        async_scheduling=False,
        kv_transfer_config=kv_transfer("cpu=256MiB", layerwise=True),
    )
    for name, llm in (("plain", plain), ("conn", conn)):
        prompts = single_prompts()
        res: dict[str, Any] = {"round1": each(llm, prompts)}
        res["reset1"] = reset(llm)
        res["round2"] = timed(result, f"round2_{name}", each, llm, prompts)
        result[name] = res
    shutdown(conn)
    shutdown(plain)


SCENARIOS = {
    "main": scenario_main,
    "disk": scenario_disk,
    "tp2": scenario_tp2,
    "layerwise": scenario_layerwise,
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("scenario", choices=sorted(SCENARIOS))
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--disk-dir", help="the disk tier's directory (main, disk)")
    args = ap.parse_args(argv)
    result: dict[str, Any] = {"pid": os.getpid(), "scenario": args.scenario}
    try:
        SCENARIOS[args.scenario](args, result)
    finally:  # what ran so far, for a failing test's message
        Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
