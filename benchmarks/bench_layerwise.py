"""Layer-wise loads on the simulated device with a modelled host link: restored TTFT against the bound
``1.15 x max(total copy, total compute) + one layer's copy``, versus loading the whole prefix first.

The model (what the figures stand for): Llama-3.1-8B on an H100 whose host link moves 25 GB/s (pinned
host -> device over PCIe), restoring a cached prefix of 4k or 32k tokens and then computing a suffix of
``--suffix`` new tokens (default 512: a new chat turn). Derived numbers (printed, and in the results file):

- KV per token and layer: K and V x 8 KV heads x 128 dims x 2 bytes (bf16) = 4 KiB; x 32 layers = 128 KiB
  per token; a 16-token block is 64 KiB per layer (2 MiB per slot).
- Copy per layer: restored tokens x 4 KiB / 25 GB/s: 0.67 ms at 4k (21.5 ms in all), 5.37 ms at 32k (172 ms).
- Compute per layer (the suffix's forward, which is what can overlap the load): the layer's linear work,
  2 x 218.1 M parameters x suffix tokens, plus attention over the context, 4 x 4096 (query width) x suffix x
  (restored + suffix / 2), at 500 TFLOP/s (about 50 % of the H100's dense bf16 peak): 0.52 ms at 4k
  (16.6 ms in all), 1.00 ms at 32k (32 ms). So at 4k copy and compute are nearly equal (where overlapping
  matters most) and at 32k the copy dominates.

The simulation: ``SimulatedDevice(copy_bytes_per_s=...)`` makes every host <-> device copy occupy its stream
for its modelled time; each layer's compute is a kernel on the compute stream that sleeps its modelled time.
To keep memory and per-operation overhead of the (Python) simulator small while keeping every ratio, one
simulated block stands for ``--blocks-per-block`` (16) real blocks: 4k restored tokens are 16 simulated blocks,
32k are 128; each simulated block holds 4 KiB per layer and the link rate is scaled so that it takes exactly
the modelled time of the 16 real blocks' bytes. The staging area is scaled the same way (the default 256 MiB
holds 64 real blocks per direction: 4 simulated rows), so a layer is copied in the same number of chunks as
on the real device (4 at 4k, 32 at 32k). Time is dilated by ``--time-scale`` (5: a modelled millisecond
lasts 5 ms) so that the sleeps' granularity stays small against a layer; every figure reported is modelled
time (wall / time scale).

Measured per size, ``--reps`` times (median, min-max), in this order in each rep:

- copy alone: the whole load, then a kernel ordered after it (``order_before``): total copy time;
- compute alone: the 32 layer kernels, nothing loaded: total compute time;
- whole: ``load()``, ``await wait_submitted()``, ``order_before()``, the 32 layer kernels; TTFT = from
  ``load()`` to the end of the last kernel;
- layer-wise (the documented pattern): ``load(..., layerwise=True)``, then per layer
  ``await wait_submitted(layer=i)``, ``order_layer_before(i)`` and that layer's kernel;
- layer-wise after the whole submission (diagnostic, the key ``eager`` in the JSON for older readers): as
  layer-wise, but ``await wait_submitted()`` for every layer first, then the per-layer orders and kernels.

The bound uses the copy-alone and compute-alone times measured in the same rep (so the simulator's own
overheads are on both sides); the modelled ideal figures are shown next to them. Loop thread CPU
(``time.thread_time`` on the event loop thread): aiokv's calls from ``load()`` to the last
``order_layer_before`` (``load``, ``wait_submitted``, the per-layer calls; not the benchmark's kernel
launches), per layer; and including the completions delivered until the load resolves. The whole load's
figure per layer is the baseline.

Run: ``python benchmarks/bench_layerwise.py [--quick] [--reps N] [--time-scale X] [--suffix N]``.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from collections.abc import Callable
from typing import Any

import _common as common
import torch

from aiokv import CPUTier, KVLayout, Offloader
from aiokv.transfer import SimulatedDevice

# The modelled model and machine (see the module docstring).
LAYERS = 32
KV_HEADS = 8
HEAD_DIM = 128
DTYPE_BYTES = 2  # bf16
BLOCK_TOKENS = 16  # vLLM's default block size
PARAMS_PER_LAYER = 218.1e6  # Llama-3.1-8B: attention 41.9 M + MLP 176.2 M per layer
QUERY_WIDTH = 4096  # 32 query heads x 128
LINK_BYTES_PER_S = 25e9
FLOPS = 500e12  # effective bf16 throughput of a prefill chunk on an H100 (~50 % of the dense peak)
STAGING_BYTES = 256 << 20  # the Offloader's default
SIZES = (4096, 32768)
SLACK = 1.15

# The simulated tensors: per layer K and V of (num_blocks, BLOCK_TOKENS, SIM_HEADS, SIM_DIM) fp16.
SIM_HEADS = 1
SIM_DIM = 64

KV_BYTES_PER_TOKEN_LAYER = 2 * KV_HEADS * HEAD_DIM * DTYPE_BYTES


def model(tokens: int, suffix: int) -> dict[str, float]:
    """Modelled per-layer copy and compute seconds for ``tokens`` restored and ``suffix`` new tokens."""
    copy_layer = tokens * KV_BYTES_PER_TOKEN_LAYER / LINK_BYTES_PER_S
    linear = 2 * PARAMS_PER_LAYER * suffix
    attention = 4 * QUERY_WIDTH * suffix * (tokens + suffix / 2)
    compute_layer = (linear + attention) / FLOPS
    copy, compute = LAYERS * copy_layer, LAYERS * compute_layer
    return {
        "copy_layer_s": copy_layer,
        "compute_layer_s": compute_layer,
        "copy_s": copy,
        "compute_s": compute,
        "bound_s": SLACK * max(copy, compute) + copy_layer,
        "ideal_layerwise_s": max(copy, compute) + min(copy_layer, compute_layer),
        "whole_s": copy + compute,
    }


class Rig:
    """The simulated device with its scaled link, one offloader, and the prefixes stored in its CPU tier."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.scale = float(args.time_scale)
        self.bpb = int(args.blocks_per_block)
        sim_layer_block = 2 * BLOCK_TOKENS * SIM_HEADS * SIM_DIM * 2
        real_layer_block = BLOCK_TOKENS * KV_BYTES_PER_TOKEN_LAYER
        self.bytes_factor = self.bpb * real_layer_block / sim_layer_block  # real bytes per simulated byte
        self.sim = SimulatedDevice(copy_bytes_per_s=LINK_BYTES_PER_S / (self.bytes_factor * self.scale))
        self.compute = self.sim.new_stream("compute")
        self.max_blocks = max(self.sim_blocks(n) for n in args.sizes)
        num_blocks = 2 * self.max_blocks + 8
        self.kv = [
            (
                torch.zeros(num_blocks, BLOCK_TOKENS, SIM_HEADS, SIM_DIM, dtype=torch.float16),
                torch.zeros(num_blocks, BLOCK_TOKENS, SIM_HEADS, SIM_DIM, dtype=torch.float16),
            )
            for _ in range(LAYERS)
        ]
        self.layout = KVLayout(self.kv, block_size=BLOCK_TOKENS)
        real_slot = LAYERS * real_layer_block
        self.real_rows = STAGING_BYTES // (2 * real_slot)
        self.rows = max(1, self.real_rows // self.bpb)
        self.staging_bytes = 2 * self.rows * self.layout.slot_bytes
        slots = 2 * sum(self.sim_blocks(n) for n in args.sizes) + 8
        self.off = Offloader(
            self.layout,
            [CPUTier(capacity_bytes=slots * self.layout.slot_bytes)],
            device=self.sim,
            compute_stream=self.compute,
            staging_bytes=self.staging_bytes,
        )
        self.prompts: dict[int, list[int]] = {}

    def sim_blocks(self, tokens: int) -> int:
        return max(1, tokens // (BLOCK_TOKENS * self.bpb))

    async def seed(self, tokens: int) -> None:
        n = self.sim_blocks(tokens)
        prompt = [tokens * 1000 + t for t in range(n * BLOCK_TOKENS + 1)]
        r = self.off.open(f"seed-{tokens}", prompt)
        await r.lookup()
        r.step(len(prompt), new_token_ids=[1], new_block_ids=list(range(n + 1)))
        await r.finish()
        await asyncio.to_thread(self.sim.synchronize_all)
        self.prompts[tokens] = prompt

    def kernels(self, seconds: float, ends: list[float]) -> list[Callable[[], None]]:
        wall = seconds * self.scale

        def make(i: int) -> Callable[[], None]:
            def kernel() -> None:
                time.sleep(wall)
                ends[i] = time.perf_counter()

            return kernel

        return [make(i) for i in range(LAYERS)]

    async def run(self, tokens: int, mode: str, m: dict[str, float]) -> dict[str, float]:
        """One measurement; modelled seconds (wall / scale) and loop CPU seconds."""
        await asyncio.to_thread(self.sim.synchronize_all)
        sim, launch = self.sim, self.sim.launch
        n = self.sim_blocks(tokens)
        target = list(range(self.max_blocks + 4, self.max_blocks + 4 + n))
        ends = [0.0] * LAYERS
        kernels = self.kernels(m["compute_layer_s"], ends)
        done = [0.0]

        def mark_done() -> None:
            done[0] = time.perf_counter()

        req = None
        if mode != "compute":
            req = self.off.open(f"{mode}-{tokens}-{time.perf_counter_ns()}", self.prompts[tokens])
            assert await req.lookup() == n * BLOCK_TOKENS
        modelled0 = sim.modelled_copy_s
        # Loop thread CPU: in aiokv's calls (load, order_*) and while awaiting the submission (the loop's
        # wakeups for the per-layer notifications and whatever completions arrive meanwhile).
        calls = waits = 0.0
        submitted = float("nan")
        thread_time, perf = time.thread_time, time.perf_counter
        t0 = perf()
        if mode == "compute":
            for k in kernels:
                launch(self.compute, k)
        else:
            assert req is not None
            c = thread_time()
            pending = req.load(target, layerwise=mode not in ("whole", "copy"))
            c, calls = thread_time(), calls + thread_time() - c
            if mode == "layerwise":
                for i, k in enumerate(kernels):
                    c = thread_time()
                    assert await pending.wait_submitted(layer=i) == n * BLOCK_TOKENS
                    c, waits = thread_time(), waits + thread_time() - c
                    if i == LAYERS - 1:
                        submitted = perf()
                    pending.order_layer_before(i)
                    calls += thread_time() - c
                    launch(self.compute, k)
            else:
                c = thread_time()
                assert await pending.wait_submitted() == n * BLOCK_TOKENS
                waits += thread_time() - c
                submitted = perf()
                if mode == "eager":
                    for i, k in enumerate(kernels):
                        c = thread_time()
                        pending.order_layer_before(i)
                        calls += thread_time() - c
                        launch(self.compute, k)
                else:
                    c = thread_time()
                    pending.order_before()
                    calls += thread_time() - c
                    if mode in ("copy", "lwcopy"):
                        launch(self.compute, mark_done)
                    else:
                        for k in kernels:
                            launch(self.compute, k)
            c = thread_time()
            assert await pending == n * BLOCK_TOKENS
            rest = thread_time() - c
        await asyncio.to_thread(sim.synchronize_stream, self.compute)
        end = done[0] if mode in ("copy", "lwcopy") else ends[-1]
        out = {"ttft_s": (end - t0) / self.scale, "submitted_s": (submitted - t0) / self.scale}
        if req is not None:
            await req.abort()
            out["loop_calls_us_per_layer"] = calls / LAYERS * 1e6
            out["loop_us_per_layer"] = (calls + waits) / LAYERS * 1e6
            out["loop_total_us_per_layer"] = (calls + waits + rest) / LAYERS * 1e6
            out["modelled_copy_s"] = (sim.modelled_copy_s - modelled0) / self.scale
        return out

    async def wakeup_cost(self, n: int = 200, gap_s: float = 0.0005) -> float:
        """Baseline: loop thread CPU seconds per wakeup by another thread's ``call_soon_threadsafe`` (what each
        notification of a submission or completion costs the loop at least, on this machine, now)."""
        loop = asyncio.get_running_loop()
        finished = asyncio.Event()
        count = [0]

        def tick() -> None:
            count[0] += 1
            if count[0] == n:
                finished.set()

        def poke() -> None:
            for _ in range(n):
                time.sleep(gap_s)
                loop.call_soon_threadsafe(tick)

        c = time.thread_time()
        thread = asyncio.create_task(asyncio.to_thread(poke))
        await finished.wait()
        cpu = time.thread_time() - c
        await thread
        return cpu / n

    async def aclose(self) -> None:
        await self.off.aclose()
        self.sim.close()


MODES = ("copy", "lwcopy", "compute", "whole", "layerwise", "eager")


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    rig = Rig(args)
    await rig.off.start()
    try:
        for n in args.sizes:
            await rig.seed(n)
        wakeup_s = await rig.wakeup_cost()
        rows = []
        for n in args.sizes:
            m = model(n, args.suffix)
            common.status(
                f"  {n} tokens ({rig.sim_blocks(n)} simulated blocks of {rig.bpb} real):"
                f" copy {m['copy_layer_s'] * 1e3:.2f} ms/layer, compute {m['compute_layer_s'] * 1e3:.2f} ms/layer"
            )
            for mode in MODES:  # warm-up
                await rig.run(n, mode, m)
            samples: dict[str, list[dict[str, float]]] = {mode: [] for mode in MODES}
            for _ in range(args.reps):
                for mode in MODES:
                    samples[mode].append(await rig.run(n, mode, m))
            ttft = {mode: [s["ttft_s"] for s in samples[mode]] for mode in MODES}
            bound = [
                SLACK * max(c, k) + c / LAYERS for c, k in zip(ttft["copy"], ttft["compute"], strict=True)
            ]
            ratio = {
                mode: [t / b for t, b in zip(ttft[mode], bound, strict=True)]
                for mode in ("whole", "layerwise", "eager")
            }
            loop = {
                key: {
                    mode: common.summarize([s[key] for s in samples[mode]])
                    for mode in ("whole", "layerwise", "eager")
                }
                for key in ("loop_calls_us_per_layer", "loop_us_per_layer", "loop_total_us_per_layer")
            }
            rows.append(
                {
                    "restored_tokens": n,
                    "suffix_tokens": args.suffix,
                    "simulated_blocks": rig.sim_blocks(n),
                    "real_blocks": n // BLOCK_TOKENS,
                    "chunks_per_layer": -(-rig.sim_blocks(n) // rig.rows),
                    "host_copies_per_layer_real": n // BLOCK_TOKENS,
                    "host_copy_bytes_real": BLOCK_TOKENS * KV_BYTES_PER_TOKEN_LAYER,
                    "model": m,
                    "ttft_s": {mode: common.summarize(v) for mode, v in ttft.items()},
                    "bound_s": common.summarize(bound),
                    "ratio_to_bound": {mode: common.summarize(v) for mode, v in ratio.items()},
                    "met": statistics.median(ratio["layerwise"]) <= 1.0,
                    "eager_met": statistics.median(ratio["eager"]) <= 1.0,
                    **loop,
                    "submitted_s": {
                        mode: common.summarize([s["submitted_s"] for s in samples[mode]])
                        for mode in ("whole", "layerwise")
                    },
                    "modelled_copy_s_per_load": statistics.median(
                        s["modelled_copy_s"] for s in samples["copy"]
                    ),
                }
            )
        wakeup_s = min(wakeup_s, await rig.wakeup_cost())
        return {
            "rows": rows,
            "staging_rows": rig.rows,
            "real_staging_rows": rig.real_rows,
            "loop_wakeup_us": wakeup_s * 1e6,
        }
    finally:
        await rig.aclose()


def _ms(s: dict[str, float]) -> str:
    return f"{s['median'] * 1e3:.1f} [{s['min'] * 1e3:.1f}-{s['max'] * 1e3:.1f}]"


def _r(s: dict[str, float]) -> str:
    return f"{s['median']:.2f} [{s['min']:.2f}-{s['max']:.2f}]"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=list(SIZES), help="restored tokens")
    parser.add_argument(
        "--suffix", type=int, default=512, help="new tokens computed after the restored prefix"
    )
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--time-scale", type=float, default=5.0, help="wall seconds per modelled second")
    parser.add_argument("--blocks-per-block", type=int, default=16, help="real blocks per simulated block")
    parser.add_argument("--quick", action="store_true", help="2 reps")
    args = parser.parse_args(argv)
    if args.quick:
        args.reps = min(args.reps, 2)
    common.status(
        f"bench_layerwise: {LAYERS} layers, {KV_BYTES_PER_TOKEN_LAYER * LAYERS >> 10} KiB/token,"
        f" {LINK_BYTES_PER_S / 1e9:g} GB/s link, {FLOPS / 1e12:g} TFLOP/s, suffix {args.suffix} tokens,"
        f" time x{args.time_scale:g}, {args.reps} reps"
    )
    t0 = time.perf_counter()
    result = asyncio.run(bench(args))
    wall = time.perf_counter() - t0
    rows = result["rows"]
    table = []
    for r in rows:
        m, t = r["model"], r["ttft_s"]
        table.append(
            [
                r["restored_tokens"],
                f"{m['copy_s'] * 1e3:.1f} / {_ms(t['copy'])}",
                _ms(t["lwcopy"]),
                f"{m['compute_s'] * 1e3:.1f} / {_ms(t['compute'])}",
                f"{m['whole_s'] * 1e3:.1f} / {_ms(t['whole'])}",
                f"{m['bound_s'] * 1e3:.1f} / {_ms(r['bound_s'])}",
                _ms(t["layerwise"]),
                _r(r["ratio_to_bound"]["layerwise"]),
                "yes" if r["met"] else "NO",
                _ms(t["eager"]),
                _r(r["ratio_to_bound"]["eager"]),
                _r(r["ratio_to_bound"]["whole"]),
            ]
        )
    common.print_table(
        f"bench_layerwise: restored TTFT, modelled ms: model / measured median [min-max], {args.reps} reps",
        [
            "tokens",
            "copy: model / measured",
            "layer-wise copy",
            "compute: model / measured",
            "whole TTFT: model / measured",
            "bound: model / measured",
            "layer-wise TTFT",
            "layer-wise / bound",
            "met",
            "LW after whole submit TTFT",
            "after-submit / bound",
            "whole / bound",
        ],
        table,
        note=(
            f"bound = {SLACK} x max(copy, compute) + copy/{LAYERS} (measured: from the copy-alone and compute-alone"
            " runs of each rep); LW = load(layerwise=True), then per layer await wait_submitted(layer=i),"
            " order_layer_before(i) + kernel (as docs/devices.md writes it); after-submit = the same after awaiting"
            " wait_submitted() for every layer first (diagnostic); LW copy = the layer-wise load alone"
        ),
    )
    table2 = []
    for r in rows:
        sub = r["submitted_s"]
        table2.append(
            [
                r["restored_tokens"],
                r["chunks_per_layer"],
                f"{r['host_copies_per_layer_real']} x {r['host_copy_bytes_real'] >> 10} KiB",
                _ms(sub["whole"]),
                _ms(sub["layerwise"]),
                _r(r["loop_calls_us_per_layer"]["layerwise"]),
                _r(r["loop_us_per_layer"]["layerwise"]),
                _r(r["loop_total_us_per_layer"]["layerwise"]),
                _r(r["loop_calls_us_per_layer"]["whole"]),
                _r(r["loop_us_per_layer"]["whole"]),
                _r(r["loop_us_per_layer"]["eager"]),
            ]
        )
    common.print_table(
        "bench_layerwise: submission and loop thread CPU (µs per layer; a whole load's per layer = its figure / 32)",
        [
            "tokens",
            "chunks/layer",
            "host copies/layer (real)",
            "whole submitted ms",
            "LW submitted ms",
            "LW calls",
            "LW to last order",
            "LW until done",
            "whole calls",
            "whole to order",
            "after-submit to last order",
        ],
        table2,
        note=(
            f"calls: load() + order_layer_before/order_before; 'to last order' adds the CPU while awaiting"
            f" wait_submitted (loop wakeups); 'until done' adds the completions until the load resolves. One bare"
            f" loop wakeup (call_soon_threadsafe from a thread) costs {result['loop_wakeup_us']:.1f} µs here."
            f" Staging: {result['real_staging_rows']} real blocks per direction ({result['staging_rows']} simulated"
            " rows); 'submitted ms' = when wait_submitted() returned, from load()"
        ),
    )
    worst = max(r["ratio_to_bound"]["layerwise"]["median"] for r in rows)
    worst_us = max(r["loop_us_per_layer"]["layerwise"]["median"] for r in rows)
    path = common.write_result(
        "layerwise",
        {
            "config": vars(args),
            "model": {
                "layers": LAYERS,
                "kv_heads": KV_HEADS,
                "head_dim": HEAD_DIM,
                "dtype_bytes": DTYPE_BYTES,
                "block_tokens": BLOCK_TOKENS,
                "kv_bytes_per_token": KV_BYTES_PER_TOKEN_LAYER * LAYERS,
                "params_per_layer": PARAMS_PER_LAYER,
                "link_bytes_per_s": LINK_BYTES_PER_S,
                "flops": FLOPS,
                "staging_bytes": STAGING_BYTES,
            },
            "slack": SLACK,
            "met": all(r["met"] for r in rows),
            "worst_ratio": worst,
            "worst_us": worst_us,
            "wall_s": wall,
            **result,
        },
    )
    common.status(f"wrote {path} in {wall:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
