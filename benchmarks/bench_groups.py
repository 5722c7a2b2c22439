"""Grouped layouts against one group, for the same bytes, through the public API (issue 20).

**Copy path.** 32 layers x (K, V) fp16 tensors of shape ``(num_blocks, 16, heads, 128)``, as in bench_copy,
served two ways in the same run, with the strongest baseline this machine offers for the same bytes (the
faster of torch's and numpy's contiguous copy, as in bench_copy) measured in each repetition too: one :class:`aiokv.KVLayout` of all 64 tensors, and
``KVLayout.from_groups`` with the first 16 layers a full-attention group and the other 16 a sliding-window group
with ``checkpoint_blocks=1`` (every block's window part is kept, so both move exactly the same bytes; the
grouped one as two units per block). A measurement stores ``--batch-mib`` of blocks (default 1 GiB) (requests of 64 scattered
blocks: ``step()`` then ``finish()``) and loads them back (``lookup()`` untimed, then ``load()``), alternating
the two layouts within each repetition. The figure: grouped GB/s over one-group GB/s per repetition (median
and range). Target: >= 0.9 for stores and loads.

**Lookup cost.** A 256-block prefix cached in the CPU tier, looked up again and again (``lookup()`` then
``abort()``, timed per block) with 1, 2, 4 and 8 full-attention groups of the same total bytes: the cost per
block must not grow with the number of groups (one dictionary probe per block). Reported as µs per block and
as the ratio to one group.

Run: ``python benchmarks/bench_groups.py [--quick]``.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import random
import time
from typing import Any

import _common as common
import torch
from bench_copy import Baselines, fill_nonzero

from aiokv import CPUTier, KVGroup, KVLayout, Offloader

LAYERS = 32
BLOCK_TOKENS = 16
HEAD_DIM = 128
REQUEST_BLOCKS = 64
TARGET = 0.9
LOOKUP_BLOCKS = 256


def _layouts(tensors: list[torch.Tensor]) -> dict[str, KVLayout]:
    pairs = [(tensors[2 * i], tensors[2 * i + 1]) for i in range(LAYERS)]
    half = LAYERS // 2
    return {
        "one": KVLayout(pairs, block_size=BLOCK_TOKENS),
        "two": KVLayout.from_groups(
            [
                KVGroup(pairs[:half], kind="full", name="full"),
                KVGroup(pairs[half:], kind="sliding_window", window=1024, name="sliding"),
            ],
            BLOCK_TOKENS,
            checkpoint_blocks=1,
        ),
    }


async def _copy_round(
    off: Offloader, grouped: bool, rng: random.Random, requests: int, num_blocks: int, tag: str
) -> tuple[float, float]:
    prompt_len = REQUEST_BLOCKS * BLOCK_TOKENS

    def ids(blocks: list[int]) -> Any:
        return (blocks, blocks) if grouped else blocks

    prompts = [[rng.randrange(1 << 30) for _ in range(prompt_len + 1)] for _ in range(requests)]
    reqs = []
    for i, p in enumerate(prompts):
        r = off.open(f"s{tag}-{i}", p)
        await r.lookup()
        reqs.append(r)
    pick = [rng.sample(range(num_blocks), REQUEST_BLOCKS + 1) for _ in reqs]
    t0 = time.perf_counter()
    for r, blocks in zip(reqs, pick, strict=True):
        r.step(prompt_len + 1, new_token_ids=[1], new_block_ids=ids(blocks))
    for d in [r.finish() for r in reqs]:
        await d
    store_s = time.perf_counter() - t0
    reqs = []
    for i, p in enumerate(prompts):
        r = off.open(f"l{tag}-{i}", p)
        assert await r.lookup() == prompt_len
        reqs.append(r)
    pick = [rng.sample(range(num_blocks), REQUEST_BLOCKS) for _ in reqs]
    t0 = time.perf_counter()
    pending = [r.load(ids(b)) for r, b in zip(reqs, pick, strict=True)]
    for p in pending:
        assert await p == prompt_len
    load_s = time.perf_counter() - t0
    for r in reqs:
        await r.abort()
    return store_s, load_s


async def copy_path(seg_kib: int, batch_bytes: int, reps: int, seed: int, threads: int) -> dict[str, Any]:
    heads = seg_kib * common.KiB // (BLOCK_TOKENS * HEAD_DIM * 2)
    slot_bytes = 2 * LAYERS * BLOCK_TOKENS * heads * HEAD_DIM * 2
    requests = max(1, batch_bytes // (slot_bytes * REQUEST_BLOCKS))
    batch_blocks = requests * REQUEST_BLOCKS
    num_blocks = 2 * batch_blocks
    nbytes = batch_blocks * slot_bytes
    common.status(f"  copy path: {requests} requests x {REQUEST_BLOCKS} blocks of {slot_bytes >> 10} KiB")
    tensors = [
        torch.empty(num_blocks, BLOCK_TOKENS, heads, HEAD_DIM, dtype=torch.float16) for _ in range(2 * LAYERS)
    ]
    for i, t in enumerate(tensors):
        fill_nonzero(t, seed + i)
    layouts = _layouts(tensors)
    assert layouts["two"].block_bytes == layouts["one"].slot_bytes
    rng = random.Random(seed)
    base = Baselines(nbytes, threads)
    gbps: dict[str, list[float]] = {f"{k}_{d}": [] for k in layouts for d in ("store", "load")}
    gbps["contiguous"] = []
    offs: dict[str, Offloader] = {}
    for name, layout in layouts.items():
        off = Offloader(layout, [CPUTier(capacity_bytes=2 * nbytes + 4 * slot_bytes)])
        await off.start()
        fill_nonzero(off.cpu.buffer, seed + 1000)
        offs[name] = off
    try:
        for name, off in offs.items():  # warm-up, untimed
            await _copy_round(off, name == "two", rng, requests, num_blocks, f"w{name}")
        for rep in range(reps):
            # The strongest baseline of the same bytes this machine offers (bench_copy's): a contiguous copy.
            gbps["contiguous"].append(nbytes / min(base.torch_copy(), base.numpy_copy()) / 1e9)
            order = list(offs) if rep % 2 == 0 else list(reversed(offs))
            for name in order:
                s, lo = await _copy_round(
                    offs[name], name == "two", rng, requests, num_blocks, f"{rep}{name}"
                )
                gbps[f"{name}_store"].append(nbytes / s / 1e9)
                gbps[f"{name}_load"].append(nbytes / lo / 1e9)
            gc.collect()
        for off in offs.values():
            st = off.stats()
            assert st.store_errors == 0
            assert st.load_errors == 0
    finally:
        for off in offs.values():
            await off.aclose()
    ratios = {
        d: [t / o for t, o in zip(gbps[f"two_{d}"], gbps[f"one_{d}"], strict=True)] for d in ("store", "load")
    }
    vs_copy = {
        d: [t / b for t, b in zip(gbps[f"two_{d}"], gbps["contiguous"], strict=True)]
        for d in ("store", "load")
    }
    return {
        "segment_kib": seg_kib,
        "slot_bytes": slot_bytes,
        "batch_bytes": nbytes,
        "gbps": {k: common.summarize(v) for k, v in gbps.items()},
        "ratio": {k: common.summarize(v) for k, v in ratios.items()},
        "ratio_samples": ratios,
        "vs_contiguous": {k: common.summarize(v) for k, v in vs_copy.items()},
    }


async def lookup_cost(reps: int, seed: int, lookups: int = 100) -> dict[str, Any]:
    """µs per looked-up block with 1..8 full-attention groups holding the same bytes; the four offloaders are
    measured in turn within each repetition (rotating the order), so drift on a shared machine hits all."""
    rng = random.Random(seed)
    prompt = [rng.randrange(1 << 30) for _ in range(LOOKUP_BLOCKS * BLOCK_TOKENS + 1)]
    counts = (1, 2, 4, 8)
    offs: dict[int, Offloader] = {}
    for groups in counts:
        num_blocks = LOOKUP_BLOCKS + 8
        tensors = [torch.zeros(num_blocks, BLOCK_TOKENS, 8, 8, dtype=torch.float16) for _ in range(8)]
        per = 8 // groups
        if groups == 1:
            layout: KVLayout = KVLayout(tensors, block_size=BLOCK_TOKENS)
        else:
            layout = KVLayout.from_groups(
                [KVGroup(tensors[g * per : (g + 1) * per], name=f"g{g}") for g in range(groups)], BLOCK_TOKENS
            )
        off = Offloader(layout, [CPUTier(capacity_bytes=(LOOKUP_BLOCKS + 8) * layout.slot_bytes)])
        await off.start()
        ids = list(range(LOOKUP_BLOCKS + 1))
        r = off.open("seed", prompt)
        await r.lookup()
        r.step(len(prompt), new_token_ids=[1], new_block_ids=ids if groups == 1 else tuple(ids for _ in range(groups)))
        await r.finish()
        offs[groups] = off
    samples: dict[int, list[float]] = {g: [] for g in counts}
    try:
        for rep in range(reps):
            order = counts[rep % 4 :] + counts[: rep % 4]
            for groups in order:
                off = offs[groups]
                t0 = time.perf_counter()
                for i in range(lookups):
                    q = off.open(f"q{rep}-{i}", prompt)
                    assert await q.lookup() == LOOKUP_BLOCKS * BLOCK_TOKENS
                    await q.abort()
                samples[groups].append((time.perf_counter() - t0) / (lookups * LOOKUP_BLOCKS) * 1e6)
    finally:
        for off in offs.values():
            await off.aclose()
    out: dict[str, Any] = {str(g): common.summarize(v) for g, v in samples.items()}
    for g in counts[1:]:
        ratios = [x / b for x, b in zip(samples[g], samples[1], strict=True)]
        out[str(g)]["ratio_to_one"] = common.summarize(ratios)["median"]
    return out


def _range(s: dict[str, float]) -> str:
    return f"{s['median']:.2f} [{s['min']:.2f}-{s['max']:.2f}]"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--segment-kib", type=int, default=64, help="KiB per block per tensor")
    parser.add_argument("--batch-mib", type=int, default=1024)
    parser.add_argument("--reps", type=int, default=11)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="64 MiB batches, 3 reps (a smoke run)")
    args = parser.parse_args()
    if args.quick:
        args.batch_mib, args.reps = 64, 3
    common.status(f"bench_groups: {args.reps} reps of {args.batch_mib} MiB")
    copy = asyncio.run(
        copy_path(
            args.segment_kib, args.batch_mib * common.MiB, args.reps, args.seed, len(os.sched_getaffinity(0))
        )
    )
    look = asyncio.run(lookup_cost(args.reps, args.seed))
    g = copy["gbps"]
    worst = min(copy["ratio"]["store"]["median"], copy["ratio"]["load"]["median"])
    common.print_table(
        f"bench_groups: two groups (full + sliding, every part kept) vs one group, same bytes "
        f"({args.batch_mib} MiB, {args.reps} reps, {args.segment_kib} KiB segments)",
        [
            "direction",
            "contiguous GB/s",
            "one group GB/s",
            "two groups GB/s",
            "ratio [range]",
            "vs contiguous",
        ],
        [
            [
                d,
                g["contiguous"]["median"],
                g[f"one_{d}"]["median"],
                g[f"two_{d}"]["median"],
                _range(copy["ratio"][d]),
                _range(copy["vs_contiguous"][d]),
            ]
            for d in ("store", "load")
        ],
        note=f"ratio = two groups / one group per rep (target >= {TARGET}; worst median {worst:.2f}, "
        f"{'met' if worst >= TARGET else 'MISSED'}); vs contiguous = two groups / max(torch, numpy) contiguous "
        "copy of the same bytes in the same rep",
    )
    common.print_table(
        f"bench_groups: lookup of a {LOOKUP_BLOCKS}-block cached prefix, µs per block",
        ["groups", "µs/block [range]", "ratio to one group"],
        [[k, _range(v), f"{v.get('ratio_to_one', 1.0):.2f}"] for k, v in look.items()],
        note="one dictionary probe per block whatever the number of groups: the ratio should stay near 1",
    )
    path = common.write_result(
        "groups",
        {
            "config": {
                "layers": LAYERS,
                "segment_kib": args.segment_kib,
                "batch_mib": args.batch_mib,
                "reps": args.reps,
                "quick": args.quick,
            },
            "copy": copy,
            "lookup_us_per_block": look,
            "target": TARGET,
            "met": worst >= TARGET,
        },
    )
    common.status(f"wrote {path}")


if __name__ == "__main__":
    main()
