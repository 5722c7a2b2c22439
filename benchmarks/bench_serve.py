"""Multi-turn chat against ``aiokv serve``: offload vs ``--no-offload``, measured in one run.

N concurrent sessions share a long system prompt; every turn sends the whole conversation so far plus a new
user message, streaming (``stream_options.include_usage``), greedy, a fixed number of generated tokens
(``ignore_eos``). The engine's block pool is deliberately small (it holds about two sessions), so without
offloading every turn recomputes its whole prompt, and with it the prefix comes back from the CPU tier. Each
mode runs on a fresh server process (``python -m aiokv serve``); the client measures TTFT (request sent ->
first chunk), output tokens/s (all sessions) and the prefix hit rate (``cached_tokens / prompt_tokens`` from
``usage``), checks both modes generated the same text, and prints where each server says TTFT went (mean
queue, admission and prefill times from its ``/metrics``).

    python benchmarks/bench_serve.py               # 8 sessions x 6 turns, default model (~45 s on 2 cores)
    python benchmarks/bench_serve.py --quick       # 4 sessions x 2 turns, tiny model (a smoke run)

Results go to ``benchmarks/results/serve.json`` and a plot to ``benchmarks/results/serve.png``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as common

TARGET = 3.0  # TTFT p50 at least this many times lower with offloading
WORDS = [
    "the",
    "key",
    "value",
    "cache",
    "of",
    "every",
    "request",
    "is",
    "offloaded",
    "to",
    "a",
    "cheaper",
    "tier",
    "and",
    "restored",
    "on",
    "reuse",
]


@dataclass
class Turn:
    session: int
    turn: int
    ttft_s: float
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    text: str


@dataclass
class Mode:
    name: str
    wall_s: float = 0.0
    turns: list[Turn] = field(default_factory=list)
    metrics: str = ""


def _text(rng: random.Random, n_bytes: int) -> str:
    out: list[str] = []
    while sum(len(w) + 1 for w in out) < n_bytes:
        out.append(rng.choice(WORDS))
    return " ".join(out)[:n_bytes]


def _server(args: argparse.Namespace, offload: bool) -> common.ServeProcess:
    return common.ServeProcess(
        "--model", args.model, "--num-blocks", str(args.num_blocks), "--max-num-seqs", str(args.max_num_seqs),
        "--tiers", f"cpu={args.cpu_tier_mib}MiB", "--log-level", "warning", "--no-access-log",
        "--max-queued-requests", "1024", *(() if offload else ("--no-offload",)),
    )  # fmt: skip


async def _turn(
    http: httpx.AsyncClient, messages: list[dict[str, str]], max_tokens: int
) -> tuple[float, dict[str, Any], str]:
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    t0 = time.perf_counter()
    ttft = None
    usage: dict[str, Any] = {}
    parts: list[str] = []
    async with http.stream("POST", "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(chunk["error"]["message"])
            if ttft is None and chunk["choices"]:
                ttft = time.perf_counter() - t0
            if chunk["choices"]:
                parts.append(chunk["choices"][0]["delta"].get("content") or "")
            if chunk.get("usage"):
                usage = chunk["usage"]
    assert ttft is not None
    return ttft, usage, "".join(parts)


async def _run_mode(args: argparse.Namespace, offload: bool) -> Mode:
    mode = Mode("offload" if offload else "recompute")
    common.status(f"  {mode.name}: starting the server")
    server = _server(args, offload)
    system = _text(random.Random(args.seed), args.system_bytes)
    try:
        limits = httpx.Limits(max_connections=args.sessions + 4)
        async with httpx.AsyncClient(base_url=server.url, timeout=600, limits=limits) as http:

            async def session(i: int) -> None:
                rng = random.Random(args.seed * 1000 + i)
                messages = [{"role": "system", "content": system}]
                for t in range(args.turns):
                    messages.append(
                        {
                            "role": "user",
                            "content": _text(rng, rng.randint(args.user_bytes // 2, args.user_bytes)),
                        }
                    )
                    ttft, usage, text = await _turn(http, messages, args.max_tokens)
                    details = usage.get("prompt_tokens_details") or {}
                    mode.turns.append(Turn(i, t, ttft, usage["prompt_tokens"], details.get("cached_tokens", 0),
                                           usage["completion_tokens"], text))  # fmt: skip
                    messages.append({"role": "assistant", "content": text})

            t0 = time.perf_counter()
            await asyncio.gather(*(session(i) for i in range(args.sessions)))
            mode.wall_s = time.perf_counter() - t0
            mode.metrics = (await http.get("/metrics")).text
    finally:
        server.stop()
    return mode


BREAKDOWN = (
    ("queue", "aiokv:request_queue_time_seconds"),
    ("admission", "aiokv:request_admission_time_seconds"),
    ("prefill", "aiokv:request_prefill_time_seconds"),
)
"""Where the server says TTFT went: waiting for blocks, aiokv lookup + load, waiting for a step + prefill."""


def _breakdown(metrics: str) -> dict[str, float]:
    """Mean seconds per request of each part of TTFT, from the server's histograms (``_sum / _count``)."""
    from prometheus_client.parser import text_string_to_metric_families

    sums: dict[str, float] = {}
    for fam in text_string_to_metric_families(metrics):
        for s in fam.samples:
            if s.name.endswith(("_sum", "_count")):
                sums[s.name] = sums.get(s.name, 0.0) + s.value
    out = {}
    for part, name in BREAKDOWN:
        count = sums.get(name + "_count", 0.0)
        out[f"{part}_mean_s"] = sums.get(name + "_sum", 0.0) / count if count else 0.0
    return out


def _summary(mode: Mode) -> dict[str, Any]:
    ttfts = [t.ttft_s for t in mode.turns]
    prompt = sum(t.prompt_tokens for t in mode.turns)
    return {
        "ttft_mean_s": sum(ttfts) / len(ttfts),
        "server_ttft_breakdown": _breakdown(mode.metrics),
        "ttft_p50_s": common.percentile(ttfts, 50),
        "ttft_p95_s": common.percentile(ttfts, 95),
        "output_tokens_per_s": sum(t.completion_tokens for t in mode.turns) / mode.wall_s,
        "hit_rate": sum(t.cached_tokens for t in mode.turns) / prompt if prompt else 0.0,
        "prompt_tokens": prompt,
        "cached_tokens": sum(t.cached_tokens for t in mode.turns),
        "wall_s": mode.wall_s,
        "requests": len(mode.turns),
    }


def _plot(modes: list[Mode], path: Path, title: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for mode in modes:
        ttfts = sorted(t.ttft_s * 1e3 for t in mode.turns)
        ax1.plot(
            ttfts, [(i + 1) / len(ttfts) for i in range(len(ttfts))], label=mode.name, drawstyle="steps-post"
        )
        turns = sorted({t.turn for t in mode.turns})
        ax2.plot([t + 1 for t in turns],
                 [common.percentile([x.ttft_s * 1e3 for x in mode.turns if x.turn == t], 50) for t in turns],
                 marker="o", label=mode.name)  # fmt: skip
    ax1.set(xlabel="TTFT (ms)", ylabel="fraction of requests", title="TTFT distribution", xscale="log")
    ax2.set(xlabel="turn", ylabel="TTFT p50 (ms)", title="TTFT by turn", yscale="log")
    from matplotlib.ticker import NullFormatter, ScalarFormatter

    for ax, axis in ((ax1, ax1.xaxis), (ax2, ax2.yaxis)):
        axis.set_major_formatter(ScalarFormatter())
        axis.set_minor_formatter(NullFormatter())
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    modes = [await _run_mode(args, offload=False), await _run_mode(args, offload=True)]
    rec, off = (_summary(m) for m in modes)
    ratio = rec["ttft_p50_s"] / off["ttft_p50_s"] if off["ttft_p50_s"] else float("inf")
    key = lambda t: (t.session, t.turn)  # noqa: E731
    same = [t.text for t in sorted(modes[0].turns, key=key)] == [
        t.text for t in sorted(modes[1].turns, key=key)
    ]
    title = (f"aiokv serve, {args.model} model: {args.sessions} sessions x {args.turns} turns, "
             f"{args.system_bytes}-token system prompt, {args.num_blocks}-block pool")  # fmt: skip
    common.print_table(
        title,
        ["mode", "TTFT p50 ms", "TTFT p95 ms", "output tok/s", "hit rate", "wall s"],
        [
            [
                name,
                s["ttft_p50_s"] * 1e3,
                s["ttft_p95_s"] * 1e3,
                s["output_tokens_per_s"],
                f"{s['hit_rate']:.1%}",
                s["wall_s"],
            ]
            for name, s in (("recompute (--no-offload)", rec), ("offload", off))
        ],
        note=f"TTFT p50 {ratio:.1f}x lower with offloading (target >= {TARGET:g}x); outputs "
        + ("matched" if same else "DIFFER"),
    )
    for name, s in (("recompute", rec), ("offload", off)):
        b = s["server_ttft_breakdown"]
        print(
            f"  {name}: mean TTFT {s['ttft_mean_s'] * 1e3:,.0f} ms = queue {b['queue_mean_s'] * 1e3:,.0f}"
            f" + admission (lookup, load) {b['admission_mean_s'] * 1e3:,.1f}"
            f" + prefill (step wait, compute) {b['prefill_mean_s'] * 1e3:,.0f} ms (server side)"
        )
    plot = common.RESULTS / "serve.png"
    plotted = _plot(modes, plot, title)
    return {
        "config": vars(args),
        "recompute": rec,
        "offload": off,
        "ttft_p50_ratio": ratio,
        "worst_ratio": ratio,
        "target_ratio": TARGET,
        "met": ratio >= TARGET and same,
        "outputs_matched": same,
        "plot": str(plot) if plotted else None,
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny model, 4 sessions x 2 turns")
    p.add_argument("--model", default="default", choices=["tiny", "default"])
    p.add_argument("--sessions", type=int, default=8)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--system-bytes", type=int, default=1024, help="system prompt length (1 token per byte)")
    p.add_argument("--user-bytes", type=int, default=96, help="max new user bytes per turn (min is half)")
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--num-blocks", type=int, default=192, help="engine KV blocks (small: forces eviction)")
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--cpu-tier-mib", type=int, default=512)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.quick:  # smaller defaults; options given explicitly still win
        for name, value in (("model", "tiny"), ("sessions", 4), ("turns", 2)):
            if getattr(args, name) == p.get_default(name):
                setattr(args, name, value)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    t0 = time.perf_counter()
    result = asyncio.run(bench(args))
    result["bench_wall_s"] = time.perf_counter() - t0
    path = common.write_result("serve", result)
    common.status(f"wrote {path} in {result['bench_wall_s']:.0f} s")
    return 0 if result["outputs_matched"] else 1


if __name__ == "__main__":
    sys.exit(main())
