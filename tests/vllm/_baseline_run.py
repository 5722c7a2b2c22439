"""One vLLM engine run without any connector: the baseline the connector tests compare against.

Run as ``python -m tests.vllm._baseline_run --model DIR --out FILE.json`` from the repository root (test_engine_baseline
does, in a subprocess: ``LLM(...)`` spawns engine processes and sets process-wide state, which a pytest process with
``filterwarnings = error`` and a SIGALRM timeout is no place for). Writes the phases' results and wall times as JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

BLOCK_SIZE = 32  # the CPU attention backend needs a multiple of 32
MAX_MODEL_LEN = 1024
# 64 MiB: 16k tokens of the tiny model (4 layers x 2 kv heads x 64 x fp32 x K,V = 4 KiB/token)
KV_CACHE_BYTES = 64 << 20
PROMPT_LEN = 100  # 3 full blocks + 4 tokens: a repeat hits the 3 full blocks (96 tokens)
MAX_TOKENS = 8


def make_llm(model: str, **overrides: Any) -> Any:
    from vllm import LLM

    kwargs: dict[str, Any] = {
        "model": model,
        "skip_tokenizer_init": True,
        "dtype": "float32",
        "block_size": BLOCK_SIZE,
        "enforce_eager": True,
        "max_model_len": MAX_MODEL_LEN,
        "kv_cache_memory_bytes": KV_CACHE_BYTES,
        "seed": 0,
        "enable_prefix_caching": True,
    }
    kwargs.update(overrides)
    return LLM(**kwargs)


def sampling_params() -> Any:
    from vllm import SamplingParams

    return SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=1, detokenize=False)


def prompt_ids(seed: int, n: int = PROMPT_LEN, vocab: int = 2048) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(n)]


def run_one(llm: Any, ids: list[int]) -> dict[str, Any]:
    """Generate once for ``ids``; the output's tokens, logprobs (exact floats), cached-token count and wall time."""
    from vllm.inputs import TokensPrompt

    t0 = time.perf_counter()
    (out,) = llm.generate([TokensPrompt(prompt_token_ids=ids)], sampling_params(), use_tqdm=False)
    wall = time.perf_counter() - t0
    comp = out.outputs[0]
    logprobs = [
        [[tid, lp.logprob, lp.rank] for tid, lp in sorted(step.items())] for step in comp.logprobs or []
    ]
    return {
        "token_ids": list(comp.token_ids),
        "logprobs": logprobs,
        "cumulative_logprob": comp.cumulative_logprob,
        "num_cached_tokens": out.num_cached_tokens,
        "finish_reason": comp.finish_reason,
        "wall_s": wall,
    }


def process_tree() -> list[dict[str, Any]]:
    import psutil

    me = psutil.Process()
    rows = []
    for p in [me, *me.children(recursive=True)]:
        with contextlib.suppress(psutil.Error):
            rows.append(
                {"pid": p.pid, "ppid": p.ppid(), "name": p.name(), "cmdline": " ".join(p.cmdline())[:160]}
            )
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--tp", type=int, default=1, help="tensor_parallel_size")
    args = ap.parse_args(argv)

    result: dict[str, Any] = {
        "pid": os.getpid(),
        "env_multiprocessing": os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING"),
    }
    t0 = time.perf_counter()
    llm = make_llm(args.model, tensor_parallel_size=args.tp)
    result["engine_start_s"] = time.perf_counter() - t0
    result["processes"] = process_tree()

    a, b = prompt_ids(1), prompt_ids(2)
    result["first"] = run_one(llm, a)  # cold: nothing cached
    result["repeat"] = run_one(llm, a)  # vLLM's own prefix cache: 3 full blocks hit
    result["other"] = run_one(llm, b)  # a different prompt: different greedy tokens
    t1 = time.perf_counter()
    result["reset_ok"] = llm.reset_prefix_cache()
    result["reset_s"] = time.perf_counter() - t1
    result["after_reset"] = run_one(llm, a)  # recomputed from scratch: must equal "first" bit for bit

    Path(args.out).write_text(json.dumps(result, indent=1))
    # The engine core and its workers exit with this process; shutting them down explicitly keeps the logs quiet.
    shutdown = getattr(llm.llm_engine, "shutdown", None)
    if callable(shutdown):
        shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
