"""Control path: aiokv's cost per request-step while many requests decode, and finish-to-reusable latency.

A simulated engine runs ``--requests`` concurrent requests (default 1024) on a CPU layout with tiny blocks
(16 tokens, 2 tensors x 16 x 4 fp16 = 256 B per block, so copies cost next to nothing and the figure is the
control path: validation, hashing, events, index, executor submissions and completion callbacks). Each
request is opened, looked up, prefilled in one step, then decoded for ``--steps`` engine iterations; every
iteration steps every request once (``step()`` is synchronous) and then yields to the event loop once, as an
engine's async loop would, which is when aiokv's request tasks and copy completions run.

Baseline: the *lean* engine-only loop, each request's token append and block-table growth and nothing else
(issue 21). The aiokv loops do exactly that and report each step four ways: ``step()`` with keywords, the
way the README writes it (``req.step(n, new_token_ids=[t], new_block_ids=[b])`` on the steps that bring a
block, ``new_block_ids`` left out on the others); ``step()`` with keywords the way docs/guide.md's loops write
it (``new_block_ids=new`` on every step, ``new`` the list of blocks the engine allocated for it, usually
empty); ``step()`` positionally; and one ``Offloader.step_batch()`` per iteration. By default every engine iteration runs the
lean bookkeeping of a second engine (timed as the baseline) and then the same iteration with aiokv (timed as
aiokv's), so both are measured microseconds apart.

Figures: the loop with aiokv / the lean loop in the same rep (wall time, and loop-thread CPU time), median of
``--reps`` alternating runs, on the default asyncio loop and on uvloop, under three garbage-collector regimes
(see :class:`GCRegime`). The aiokv loop's time includes draining the copies it submitted. Targets: ``step()``
with keywords <= 3x the lean loop on both loops; keyword and positional within 10% of each other; <= 5 us per
request-step. Also: finish-to-reusable latency (``finish()`` call to resolution; requests finish 16 per
iteration, as in an engine) p50 / p99.

Run: ``python benchmarks/bench_control.py [--quick] [--profile] [--kv-events]`` (``--profile`` prints a
pyinstrument profile of one aiokv decode loop; ``--kv-events`` runs the offloader with ``kv_events=True`` and
no consumer, i.e. what recording every tier's events costs).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import random
import threading
import time
from collections.abc import Callable
from typing import Any

import _common as common
import torch

from aiokv import CPUTier, KVLayout, Offloader, Request

try:
    import uvloop
except ImportError:  # pragma: no cover
    uvloop = None

BLOCK = 16
PROMPT = 64
TARGET_US = 5.0
TARGET_RATIO = 3.0  # issue 21: the decode loop with aiokv <= 3x the lean engine-only loop
TARGET_KW_SPREAD = 0.10  # issue 21: keyword and positional step() within 10% of each other
FINISH_PER_ITERATION = 16


class Engine:
    """The bookkeeping every engine does per request-step anyway: sample a token, grow the block table."""

    def __init__(self, num_requests: int, steps: int, seed: int) -> None:
        blocks_per_req = (PROMPT + steps) // BLOCK + 2
        self.num_blocks = num_requests * blocks_per_req
        self.free = list(range(self.num_blocks - 1, -1, -1))
        rng = random.Random(seed)
        self.prompts = [[rng.randrange(32_000) for _ in range(PROMPT)] for _ in range(num_requests)]
        self.tokens: list[list[int]] = []
        self.blocks: list[list[int]] = []
        self.computed: list[int] = []
        self.rng = rng

    def reset(self) -> None:
        self.free = list(range(self.num_blocks - 1, -1, -1))
        self.tokens = [list(p) for p in self.prompts]
        self.blocks = []
        self.computed = [0] * len(self.prompts)

    def alloc(self, n: int) -> list[int]:
        free = self.free
        return [free.pop() for _ in range(n)]

    def lean_iteration(self) -> None:
        """One engine iteration of the lean engine-only loop: each request's token append and block-table
        growth, nothing else (the baseline the targets are stated against)."""
        tokens, tables, free = self.tokens, self.blocks, self.free
        for i in range(len(tokens)):
            toks = tokens[i]
            n = len(toks)  # the last sampled token's KV is computed in this step
            toks.append(n)  # the sampled token (any id will do)
            blocks = tables[i]
            if n >= len(blocks) * BLOCK:
                blocks.append(free.pop())

    def iteration_step_keywords(self, reqs: list[Request]) -> None:
        """The lean iteration, reporting each request's step as the README and the guide write it."""
        tokens, tables, free = self.tokens, self.blocks, self.free
        for i in range(len(tokens)):
            toks = tokens[i]
            n = len(toks)
            toks.append(n)
            blocks = tables[i]
            if n >= len(blocks) * BLOCK:
                b = free.pop()
                blocks.append(b)
                reqs[i].step(n, new_token_ids=[n], new_block_ids=[b])
            else:
                reqs[i].step(n, new_token_ids=[n])

    def iteration_step_guide(self, reqs: list[Request]) -> None:
        """The lean iteration written as docs/guide.md's loops write it: every step passes the blocks the
        engine allocated for it (``new_block_ids=new``, an empty list on the steps that bring none)."""
        tokens, tables, free = self.tokens, self.blocks, self.free
        for i in range(len(tokens)):
            toks = tokens[i]
            n = len(toks)
            toks.append(n)
            blocks = tables[i]
            new = []
            if n >= len(blocks) * BLOCK:
                b = free.pop()
                blocks.append(b)
                new = [b]
            reqs[i].step(n, new_token_ids=[n], new_block_ids=new)

    def iteration_step_positional(self, reqs: list[Request]) -> None:
        """The same with positional arguments."""
        tokens, tables, free = self.tokens, self.blocks, self.free
        for i in range(len(tokens)):
            toks = tokens[i]
            n = len(toks)
            toks.append(n)
            blocks = tables[i]
            if n >= len(blocks) * BLOCK:
                b = free.pop()
                blocks.append(b)
                reqs[i].step(n, [n], [b])
            else:
                reqs[i].step(n, [n])

    def iteration_step_batch(self, off: Offloader, reqs: list[Request]) -> None:
        """The same reported with one ``Offloader.step_batch`` call."""
        tokens, tables, free = self.tokens, self.blocks, self.free
        updates = []
        for i in range(len(tokens)):
            toks = tokens[i]
            n = len(toks)
            toks.append(n)
            blocks = tables[i]
            if n >= len(blocks) * BLOCK:
                b = free.pop()
                blocks.append(b)
                updates.append((reqs[i], n, [n], [b]))
            else:
                updates.append((reqs[i], n, [n], ()))
        off.step_batch(updates)


def make_layout(num_blocks: int) -> KVLayout:
    k = torch.ones(num_blocks, BLOCK, 4, dtype=torch.float16)
    return KVLayout([k, k.clone()], block_size=BLOCK)


class GCRegime:
    """How the garbage collector runs during the timed loop (the same for aiokv and the baseline).

    ``default``: CPython's defaults; a full collection walks every tracked object of the process (torch alone
    has ~170k), so its cost depends on the host application more than on aiokv. ``freeze``: ``gc.freeze()``
    after setup, as vLLM's engine core does, so collections skip the long-lived startup heap. ``off``: no
    collections during the loop, a lower bound showing aiokv's own CPU cost.
    """

    MODES = ("default", "freeze", "off")

    def __init__(self, mode: str) -> None:
        self.mode = mode

    def __enter__(self) -> GCRegime:
        gc.collect()
        if self.mode == "freeze":
            gc.freeze()
        elif self.mode == "off":
            gc.disable()
        return self

    def __exit__(self, *exc: object) -> None:
        gc.enable()
        if self.mode == "freeze":
            gc.unfreeze()


async def decode_loop_baseline(eng: Engine, steps: int, gc_mode: str = "default") -> tuple[float, float]:
    """Wall time and loop-thread CPU time of the engine-only decode loop."""
    _prefill_baseline(eng)
    with GCRegime(gc_mode):
        t0, c0 = time.perf_counter(), time.thread_time()
        for _ in range(steps):
            eng.lean_iteration()
            await asyncio.sleep(0)
        return time.perf_counter() - t0, time.thread_time() - c0


class GCClock:
    """Time the garbage collector spends while ``charging`` is set (a ``gc.callbacks`` hook).

    In the interleaved measurement a collection triggered during the engine-only segment is charged to the
    aiokv loop, not to the baseline: aiokv's allocations may have triggered it, and the conservative choice is
    to count it against aiokv."""

    def __init__(self) -> None:
        self.charging = False
        self.wall = 0.0
        self.cpu = 0.0
        self._loop_thread = threading.get_ident()
        self._starts: dict[int, tuple[float, float]] = {}

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        # A collection may run on aiokv's copy threads too (they allocate): it holds the GIL, so it stops the
        # loop thread as well, and its wall time is charged; only the loop thread's own CPU time is.
        # Start and stop are paired per thread: the GIL may pass between a start callback and its collection.
        tid = threading.get_ident()
        if phase == "start":
            if self.charging:
                self._starts[tid] = (time.perf_counter(), time.thread_time())
            return
        start = self._starts.pop(tid, None)
        if start is not None:
            self.wall += time.perf_counter() - start[0]
            if tid == self._loop_thread:
                self.cpu += time.thread_time() - start[1]

    def __enter__(self) -> GCClock:
        gc.callbacks.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self)


def _prefill_baseline(eng: Engine) -> None:
    eng.reset()
    for i in range(len(eng.prompts)):
        eng.blocks.append(eng.alloc(PROMPT // BLOCK + 1))
        eng.computed[i] = PROMPT


async def decode_loop_aiokv(
    eng: Engine,
    steps: int,
    gc_mode: str = "default",
    profile: bool = False,
    api: str = "step",
    kv_events: bool = False,
    store_decode: bool = True,
    paired: Engine | None = None,
) -> dict[str, Any]:
    """The decode loop with aiokv. With ``paired`` (a second engine with the same prompts), every iteration
    first runs the engine-only bookkeeping of ``paired`` (timed as the baseline, without yielding to the loop,
    so every callback aiokv scheduled runs in aiokv's own segment), then the same iteration with aiokv (timed
    as aiokv's): the two are measured microseconds apart, so a machine whose speed drifts (a shared VM) slows
    both alike."""
    eng.reset()
    n_req = len(eng.prompts)
    layout = make_layout(eng.num_blocks)
    capacity = layout.slot_bytes * eng.num_blocks
    async with Offloader(layout, [CPUTier(capacity_bytes=capacity)], kv_events=kv_events) as off:
        reqs: list[Request] = []
        for i in range(n_req):
            reqs.append(off.open(f"r{i}", eng.prompts[i], store_decode=store_decode))
        hits = await asyncio.gather(*(r.lookup() for r in reqs))
        assert sum(hits) == 0
        for i, r in enumerate(reqs):
            blocks = eng.alloc(PROMPT // BLOCK + 1)
            eng.blocks.append(blocks)
            eng.computed[i] = PROMPT
            r.step(PROMPT, (), blocks)  # prefill (its last token's KV included)
        await asyncio.sleep(0)
        await off.executor.drain()  # the prefill's stores are not part of the decode figure

        iterate: Callable[[], None] = {
            "step": lambda: eng.iteration_step_keywords(reqs),
            "step_guide": lambda: eng.iteration_step_guide(reqs),
            "step_pos": lambda: eng.iteration_step_positional(reqs),
            "batch": lambda: eng.iteration_step_batch(off, reqs),
        }[api]
        profiler = None
        if profile:
            from pyinstrument import Profiler

            profiler = Profiler(interval=0.0002, async_mode="disabled")
        base_wall = base_cpu = 0.0
        with GCRegime(gc_mode), GCClock() as gc_clock:
            if profiler is not None:
                profiler.start()
            t0, c0 = time.perf_counter(), time.thread_time()
            if paired is not None:
                _prefill_baseline(paired)
                lean = paired.lean_iteration
                perf, thread = time.perf_counter, time.thread_time
                wall = cpu = 0.0
                for _ in range(steps):
                    a, ac = perf(), thread()
                    gc_clock.charging = True
                    lean()
                    gc_clock.charging = False
                    b, bc = perf(), thread()
                    iterate()
                    await asyncio.sleep(0)
                    c, cc = perf(), thread()
                    base_wall += b - a
                    base_cpu += bc - ac
                    wall += c - b
                    cpu += cc - bc
                a, ac = perf(), thread()
                await off.executor.drain()
                wall += perf() - a + gc_clock.wall
                cpu += thread() - ac + gc_clock.cpu
                base_wall -= gc_clock.wall
                base_cpu -= gc_clock.cpu
                elapsed, cpu_elapsed = wall, cpu
            else:
                for _ in range(steps):
                    iterate()
                    await asyncio.sleep(0)
            if paired is None:
                await (
                    off.executor.drain()
                )  # copies and completions the loop has not run yet are aiokv work too
                elapsed = time.perf_counter() - t0
                cpu_elapsed = time.thread_time() - c0
            if profiler is not None:
                profiler.stop()

        # Finish 16 requests per iteration; latency = finish() call to resolution.
        latencies: list[float] = []

        async def finish(r: Request) -> None:
            t = time.perf_counter()
            await r.finish()
            latencies.append(time.perf_counter() - t)

        tasks = []
        for start in range(0, n_req, FINISH_PER_ITERATION):
            for r in reqs[start : start + FINISH_PER_ITERATION]:
                tasks.append(asyncio.ensure_future(finish(r)))
            await asyncio.sleep(0)
        await asyncio.gather(*tasks)
        stats = off.stats()
    return {
        "seconds": elapsed,
        "cpu_seconds": cpu_elapsed,
        "base_seconds": base_wall,
        "base_cpu_seconds": base_cpu,
        "finish_latencies": latencies,
        "blocks_stored": stats.blocks_stored,
        "store_errors": stats.store_errors,
        "profile": profiler.output_text(unicode=True, color=False, show_all=False) if profiler else None,
    }


APIS = ("step", "step_guide", "step_pos", "batch")
API_LABELS = {
    "step": "step() keywords",
    "step_guide": "step() keywords, guide form",
    "step_pos": "step() positional",
    "batch": "step_batch",
}


def run_on(
    loop_name: str, new_loop: Callable[[], asyncio.AbstractEventLoop], gc_mode: str, args: argparse.Namespace
) -> dict[str, Any]:
    eng = Engine(args.requests, args.steps, args.seed)
    paired = Engine(args.requests, args.steps, args.seed) if args.interleave == "iteration" else None
    base: list[float] = []
    base_cpu: list[float] = []
    # Each API's runs and the baseline each is compared with (its own, interleaved; or the rep's loop).
    with_aiokv: dict[str, list[float]] = {api: [] for api in APIS}
    cpu_aiokv: dict[str, list[float]] = {api: [] for api in APIS}
    base_of: dict[str, list[float]] = {api: [] for api in APIS}
    base_cpu_of: dict[str, list[float]] = {api: [] for api in APIS}
    fin: list[float] = []
    stored = 0
    with asyncio.Runner(loop_factory=new_loop) as runner:
        runner.run(decode_loop_baseline(eng, max(8, args.steps // 8)))  # warm-up
        for rep in range(args.reps):
            common.status(f"  {loop_name}, gc {gc_mode}: rep {rep + 1}/{args.reps}")
            if paired is None:
                wall, cpu = runner.run(decode_loop_baseline(eng, args.steps, gc_mode))
                base.append(wall)
                base_cpu.append(cpu)
            # Alternate which API goes first, so neither always runs right after the baseline.
            for api in APIS if rep % 2 == 0 else APIS[::-1]:
                res = runner.run(
                    decode_loop_aiokv(
                        eng,
                        args.steps,
                        gc_mode,
                        api=api,
                        kv_events=args.kv_events,
                        store_decode=not args.no_decode_stores,
                        paired=paired,
                    )
                )
                with_aiokv[api].append(res["seconds"])
                cpu_aiokv[api].append(res["cpu_seconds"])
                if paired is not None:
                    base.append(res["base_seconds"])
                    base_cpu.append(res["base_cpu_seconds"])
                base_of[api].append(base[-1])
                base_cpu_of[api].append(base_cpu[-1])
                assert res["store_errors"] == 0
                if stored and res["blocks_stored"] != stored:
                    raise AssertionError(f"{api}: stored {res['blocks_stored']} blocks, expected {stored}")
                stored = res["blocks_stored"]
                if api == "step":
                    fin.extend(res["finish_latencies"])
        profile = None
        if args.profile:
            profile = runner.run(
                decode_loop_aiokv(
                    eng, args.steps, gc_mode, profile=True, api=args.profile_api, kv_events=args.kv_events
                )
            )["profile"]
    request_steps = args.requests * args.steps
    out: dict[str, Any] = {
        "loop": loop_name,
        "gc": gc_mode,
        "baseline_s": common.summarize(base),
        "baseline_us_per_request_step": common.summarize(base)["median"] / request_steps * 1e6,
        "finish_us": {
            "p50": common.percentile(fin, 50) * 1e6,
            "p99": common.percentile(fin, 99) * 1e6,
            "max": max(fin) * 1e6,
            "n": len(fin),
        },
        "blocks_stored_per_run": stored,
        "profile": profile,
    }
    for api in APIS:
        runs = with_aiokv[api]
        per_step = sorted((a - b) / request_steps * 1e6 for a, b in zip(runs, base_of[api], strict=True))
        # Each rep's loop-time ratio against the baseline measured in the same rep: median and spread.
        ratios = sorted(a / b for a, b in zip(runs, base_of[api], strict=True))
        # The same on the loop thread's CPU time: the work aiokv adds to the thread that runs the engine's
        # scheduler, without the time that thread spent descheduled (a shared machine) or in copy threads.
        cpu_ratios = sorted(a / b for a, b in zip(cpu_aiokv[api], base_cpu_of[api], strict=True))
        out[api] = {
            "aiokv_s": common.summarize(runs),
            "us_per_request_step": common.summarize(per_step)["median"],
            "us_per_request_step_samples": per_step,
            "ratio_to_baseline_loop": common.summarize(ratios)["median"],
            "ratio_samples": ratios,
            "cpu_ratio_to_baseline_loop": common.summarize(cpu_ratios)["median"],
            "cpu_ratio_samples": cpu_ratios,
        }
    # Kept for readers of earlier result files: the per-request step() figures.
    out["us_per_request_step"] = out["step"]["us_per_request_step"]
    out["ratio_to_baseline_loop"] = out["step"]["ratio_to_baseline_loop"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=256, help="decode iterations")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="256 requests x 64 steps x 2 reps")
    parser.add_argument("--profile", action="store_true", help="print a pyinstrument profile per loop")
    parser.add_argument("--profile-api", choices=APIS, default="batch", help="which API --profile profiles")
    parser.add_argument("--gc", nargs="+", choices=GCRegime.MODES, default=list(GCRegime.MODES))
    parser.add_argument("--kv-events", action="store_true", help="Offloader(kv_events=True), no consumer")
    parser.add_argument(
        "--no-decode-stores",
        action="store_true",
        help="open requests with store_decode=False: the step calls' cost without the stores of decode blocks",
    )
    parser.add_argument(
        "--interleave",
        choices=("iteration", "run"),
        default="iteration",
        help="iteration: each engine iteration runs the engine-only bookkeeping then the aiokv step, timed "
        "apart (the baseline is measured microseconds from what it is compared with); run: a whole "
        "engine-only loop, then whole aiokv loops (sensitive to the machine's speed drifting between them)",
    )
    args = parser.parse_args()
    if args.quick:
        args.requests, args.steps, args.reps = 256, 64, 2
    torch.set_num_threads(1)
    loops: list[tuple[str, Callable[[], asyncio.AbstractEventLoop]]] = [("asyncio", asyncio.new_event_loop)]
    if uvloop is not None:
        loops.append(("uvloop", uvloop.new_event_loop))
    common.status(f"bench_control: {args.requests} requests x {args.steps} decode steps x {args.reps} reps")
    results = [run_on(name, factory, mode, args) for mode in args.gc for name, factory in loops]

    def spread(r: dict[str, Any], api: str, key: str) -> str:
        samples = r[api][f"{key}_samples"]
        return f"{r[api][f'{key}_to_baseline_loop']:.2f} ({min(samples):.2f}-{max(samples):.2f})"

    def kw_vs_pos(r: dict[str, Any]) -> float:
        return float(r["step"]["ratio_to_baseline_loop"] / r["step_pos"]["ratio_to_baseline_loop"])

    rows = [
        [
            r["loop"],
            r["gc"],
            r["baseline_us_per_request_step"],
            r["step"]["us_per_request_step"],
            spread(r, "step", "ratio"),
            spread(r, "step", "cpu_ratio"),
            spread(r, "step_guide", "ratio"),
            spread(r, "step_pos", "ratio"),
            f"{kw_vs_pos(r):.3f}",
            spread(r, "batch", "ratio"),
            r["finish_us"]["p50"],
            r["finish_us"]["p99"],
        ]
        for r in results
    ]
    worst = max(r["step"]["us_per_request_step"] for r in results)
    by_mode = {m: max(r["step"]["us_per_request_step"] for r in results if r["gc"] == m) for m in args.gc}
    worst_ratio = {api: max(r[api]["ratio_to_baseline_loop"] for r in results) for api in APIS}
    worst_cpu_ratio = {api: max(r[api]["cpu_ratio_to_baseline_loop"] for r in results) for api in APIS}
    worst_kw = max(abs(kw_vs_pos(r) - 1.0) for r in results)

    def verdict(ok: bool) -> str:
        return "met" if ok else "MISSED"

    common.print_table(
        f"bench_control: {args.requests} requests x {args.steps} decode steps, block {BLOCK} (median of "
        f"{args.reps}; baseline interleaved per {args.interleave})",
        [
            "loop",
            "gc",
            "lean engine-only us/step",
            "step() kw us/step",
            "step() kw wall x",
            "step() kw loop-CPU x",
            "step() guide form wall x",
            "step() positional wall x",
            "kw / positional",
            "step_batch wall x",
            "finish p50 us",
            "finish p99 us",
        ],
        rows,
        note="Baseline: the lean engine-only loop (each request's token append and block-table growth, nothing "
        "else); the aiokv loops do the same and report each step: step() with keywords as the README writes it "
        "(new_block_ids only on the steps that bring a block), step() with keywords as the guide's loops write it "
        "(new_block_ids=new every step, usually an empty list: the caller builds one more list per step), "
        "step() positionally, or one step_batch() per iteration. wall x / loop-CPU x = the loop with aiokv / the "
        "lean loop in the same rep (wall time / loop-thread CPU time), median (range). "
        f"Targets: step() with keywords <= {TARGET_RATIO}x on both loops: worst median wall "
        f"{worst_ratio['step']:.2f} ({verdict(worst_ratio['step'] <= TARGET_RATIO)}), loop-CPU "
        f"{worst_cpu_ratio['step']:.2f} ({verdict(worst_cpu_ratio['step'] <= TARGET_RATIO)}), guide form wall "
        f"{worst_ratio['step_guide']:.2f} ({verdict(worst_ratio['step_guide'] <= TARGET_RATIO)}) loop-CPU "
        f"{worst_cpu_ratio['step_guide']:.2f} ({verdict(worst_cpu_ratio['step_guide'] <= TARGET_RATIO)}); keyword and "
        f"positional within {TARGET_KW_SPREAD:.0%}: worst {worst_kw:.1%} ({verdict(worst_kw <= TARGET_KW_SPREAD)}); "
        f"step_batch worst median {worst_ratio['batch']:.2f}; us/step (aiokv's time per request-step over the lean "
        f"loop) <= {TARGET_US} us: "
        + ", ".join(f"gc {m} worst {v:.2f} ({verdict(v <= TARGET_US)})" for m, v in by_mode.items()),
    )
    for r in results:
        if r["profile"]:
            print(f"\n--- pyinstrument profile, {r['loop']}, gc {r['gc']} ---\n{r['profile']}")
    path = common.write_result(
        "control",
        {
            "config": {
                "requests": args.requests,
                "decode_steps": args.steps,
                "prompt_tokens": PROMPT,
                "block_tokens": BLOCK,
                "reps": args.reps,
                "finish_per_iteration": FINISH_PER_ITERATION,
                "quick": args.quick,
                "gc_modes": args.gc,
                "kv_events": args.kv_events,
                "decode_stores": not args.no_decode_stores,
                "interleave": args.interleave,
            },
            "target_us": TARGET_US,
            "worst_us": worst,
            "worst_us_by_gc": by_mode,
            "met": worst <= TARGET_US,
            "target_ratio": TARGET_RATIO,
            "worst_ratio_by_api": worst_ratio,
            "worst_cpu_ratio_by_api": worst_cpu_ratio,
            "ratio_met": {api: v <= TARGET_RATIO for api, v in worst_ratio.items()},
            "target_keyword_vs_positional": TARGET_KW_SPREAD,
            "worst_keyword_vs_positional": worst_kw,
            "keyword_vs_positional_met": worst_kw <= TARGET_KW_SPREAD,
            "cpu_ratio_met": {api: v <= TARGET_RATIO for api, v in worst_cpu_ratio.items()},
            "loops": [{k: v for k, v in r.items() if k != "profile"} for r in results],
        },
    )
    common.status(f"wrote {path}")


if __name__ == "__main__":
    main()
