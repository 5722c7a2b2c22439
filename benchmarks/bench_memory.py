"""Host memory: the CPU tier costs exactly its preallocated buffer, and the block index's cost per cached block.

1. Tier: RSS before and after creating an Offloader with a ``--tier-gib`` CPU tier (default 2 GiB), after
   touching the whole buffer, and after filling every slot through the offloader (real stores). The buffer
   is ``torch.empty`` (pages are committed on first touch), so creation should cost ~0 and touching exactly
   ``num_slots * slot_bytes``; anything beyond that at "filled" is the index and request bookkeeping.
2. Index: ``BlockIndex`` with LRU at ``--entries`` entries (default 1M), bytes per entry by ``tracemalloc``
   (Python allocations of the index and its policy, the 32-byte keys counted separately since engines'
   hashes are shared with requests while they run) and by RSS delta (includes allocator slack). Target:
   <= 200 B per entry.
3. Peak RSS of this benchmark.

Ratios: RSS growth / buffer bytes (1.00 = exactly the preallocated capacity). Run:
``python benchmarks/bench_memory.py [--quick]``.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import hashlib
import time
import tracemalloc
from typing import Any

import _common as common
import torch

from aiokv import CPUTier, KVLayout, Offloader
from aiokv.tiers._index import BlockIndex
from aiokv.tiers._policies import LRUPolicy

TARGET_INDEX_BYTES = 200
CHAIN = 64  # blocks per chain (a 1024-token prompt in 16-token blocks) for realistic parent links


async def tier_memory(tier_bytes: int) -> dict[str, Any]:
    # 32 layers x (K, V) of (64 blocks, 16 tokens, 8 heads, 128) fp16: 32 KiB segments, 2 MiB slots.
    tensors = [torch.ones(64, 16, 8, 128, dtype=torch.float16) for _ in range(64)]
    layout = KVLayout([(tensors[2 * i], tensors[2 * i + 1]) for i in range(32)], block_size=16)
    gc.collect()
    rss0 = common.rss_bytes()
    tier = CPUTier(capacity_bytes=tier_bytes)
    off = Offloader(layout, [tier])
    buffer_bytes = tier.buffer.numel()
    rss_created = common.rss_bytes()
    async with off:
        rss_started = common.rss_bytes()
        tier.buffer.fill_(1)  # touch every page
        rss_touched = common.rss_bytes()
        # Fill every slot through the real store path: requests of 64 blocks with distinct prompts.
        num_slots = tier.stats().num_slots
        stored = 0
        r = 0
        while stored < num_slots:
            n = min(64, num_slots - stored)
            req = off.open(f"fill-{r}", [r * 100_000 + t for t in range(n * 16 + 1)])
            req.step(n * 16, new_block_ids=list(range(n)))
            await req.finish()
            stored += n
            r += 1
        gc.collect()
        stats = off.stats()
        rss_filled = common.rss_bytes()
    return {
        "capacity_bytes": tier_bytes,
        "slot_bytes": layout.slot_bytes,
        "num_slots": num_slots,
        "buffer_bytes": buffer_bytes,
        "blocks_stored": stats.blocks_stored,
        "rss_growth_created": rss_created - rss0,
        "rss_growth_started": rss_started - rss0,
        "rss_growth_touched": rss_touched - rss0,
        "rss_growth_filled": rss_filled - rss0,
        "ratio_touched": (rss_touched - rss0) / buffer_bytes,
        "ratio_filled": (rss_filled - rss0) / buffer_bytes,
        "bookkeeping_bytes_per_block": (rss_filled - rss_touched) / max(1, stats.blocks_stored),
    }


def make_keys(n: int) -> list[bytes]:
    seed = hashlib.sha256(b"bench-memory").digest()
    return [hashlib.sha256(seed + i.to_bytes(8, "little")).digest() for i in range(n)]


def fill_index(keys: list[bytes]) -> BlockIndex:
    index = BlockIndex(len(keys), LRUPolicy())
    for i, key in enumerate(keys):
        depth = i % CHAIN
        index.insert_ready(key, keys[i - 1] if depth else None, depth)
    return index


def index_memory(entries: int) -> dict[str, Any]:
    # Keys' own cost (bytes objects), traced separately.
    gc.collect()
    tracemalloc.start()
    keys = make_keys(entries)
    key_bytes = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()

    # RSS delta (untraced, so allocation speed is realistic too).
    gc.collect()
    rss0 = common.rss_bytes()
    t0 = time.perf_counter()
    index = fill_index(keys)
    insert_s = time.perf_counter() - t0
    gc.collect()
    rss_delta = common.rss_bytes() - rss0
    assert len(index) == entries
    del index
    gc.collect()

    # tracemalloc: every Python allocation the index and its policy make.
    tracemalloc.start()
    index = fill_index(keys)
    gc.collect()
    traced, traced_peak = tracemalloc.get_traced_memory()
    snapshot = tracemalloc.take_snapshot()
    tracemalloc.stop()
    top = [
        {"where": str(stat.traceback[0]), "bytes_per_entry": stat.size / entries}
        for stat in snapshot.statistics("lineno")[:6]
    ]
    del index, snapshot
    gc.collect()
    return {
        "entries": entries,
        "chain": CHAIN,
        "policy": "lru",
        "traced_bytes_per_entry": traced / entries,
        "traced_peak_bytes_per_entry": traced_peak / entries,
        "key_bytes_per_entry": key_bytes / entries,
        "traced_with_keys_bytes_per_entry": (traced + key_bytes) / entries,
        "rss_bytes_per_entry": rss_delta / entries,
        "insert_us_per_entry": insert_s / entries * 1e6,
        "top_allocations": top,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tier-gib", type=float, default=2.0)
    parser.add_argument("--entries", type=int, default=1_000_000)
    parser.add_argument("--quick", action="store_true", help="256 MiB tier, 100k entries")
    args = parser.parse_args()
    if args.quick:
        args.tier_gib, args.entries = 0.25, 100_000
    torch.set_num_threads(1)
    common.status(f"bench_memory: {args.tier_gib:g} GiB tier, {args.entries:,} index entries")
    tier = asyncio.run(tier_memory(int(args.tier_gib * common.GiB)))
    common.status("  tier done; index ...")
    index = index_memory(args.entries)
    peak = common.peak_rss_bytes()

    mib = common.MiB
    common.print_table(
        f"bench_memory: CPU tier of {args.tier_gib:g} GiB ({tier['num_slots']} slots of {tier['slot_bytes'] // 1024} KiB)",
        ["stage", "RSS growth MiB", "x buffer"],
        [
            ["Offloader created", tier["rss_growth_created"] / mib, tier["rss_growth_created"] / tier["buffer_bytes"]],
            ["started", tier["rss_growth_started"] / mib, tier["rss_growth_started"] / tier["buffer_bytes"]],
            ["buffer touched", tier["rss_growth_touched"] / mib, tier["ratio_touched"]],
            [f"filled ({tier['blocks_stored']} blocks stored)", tier["rss_growth_filled"] / mib, tier["ratio_filled"]],
        ],
        note=f"buffer = {tier['buffer_bytes'] / mib:,.0f} MiB; bookkeeping beyond the buffer: "
        f"{tier['bookkeeping_bytes_per_block']:,.0f} B per stored block",
    )
    met = index["traced_bytes_per_entry"] <= TARGET_INDEX_BYTES
    common.print_table(
        f"bench_memory: BlockIndex + LRU at {args.entries:,} entries (bytes per entry)",
        ["measure", "B/entry"],
        [
            ["index + policy (tracemalloc)", index["traced_bytes_per_entry"]],
            ["32-byte keys (bytes objects)", index["key_bytes_per_entry"]],
            ["index + policy + keys", index["traced_with_keys_bytes_per_entry"]],
            ["index + policy (RSS delta)", index["rss_bytes_per_entry"]],
            ["insert time (us/entry)", index["insert_us_per_entry"]],
        ],
        note=f"target index <= {TARGET_INDEX_BYTES} B/entry: {'met' if met else 'MISSED'}; peak RSS of this "
        f"benchmark {peak / mib:,.0f} MiB",
    )
    for t in index["top_allocations"]:
        print(f"  {t['bytes_per_entry']:7.1f} B/entry  {t['where']}")
    path = common.write_result(
        "memory",
        {
            "config": {"tier_gib": args.tier_gib, "entries": args.entries, "quick": args.quick},
            "tier": tier,
            "index": index,
            "target_index_bytes": TARGET_INDEX_BYTES,
            "met": met,
            "peak_rss_bytes": peak,
        },
    )
    common.status(f"wrote {path}")


if __name__ == "__main__":
    main()
