"""What the per-request hints and tenant quotas buy, through the real Offloader (CPU backend, tiny layout).

Three scenarios, each run twice in the same process, with the knob and without it (the baseline), on the same
requests; every figure is a count of blocks or tokens, so the output is the same on every machine:

- ``quota``: a quiet tenant asks about 4 documents in turn while a noisy tenant floods the CPU tier with
  one-off prompts. Quiet tenant's token hit ratio with ``CPUTier(tenant_quota_bytes={noisy: ...})`` vs without.
- ``store_decode``: one-shot answers (a prompt, then a decode as long as the prompt; the answer is never sent
  back). Bytes stored with ``store_decode=False`` vs the default, and the hit ratio of the prompts' repeats.
- ``retain``: multi-turn chats with ``eviction="session"``; between two turns of every chat, one-off traffic
  larger than the tier. Next turn's hit ratio with ``open(..., retain_s=60)`` vs without.

    python benchmarks/bench_hints.py            # about 5 s
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from pathlib import Path

import _common as common
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import aiokv

BS = 16  # tokens per block
ENGINE_BLOCKS = 64


def _layout() -> tuple[aiokv.KVLayout, int]:
    kv = [torch.zeros(ENGINE_BLOCKS, BS, 2, 8) for _ in range(4)]
    layout = aiokv.KVLayout(kv, block_size=BS, model_id="bench-hints")
    return layout, sum(t[0].numel() * t.element_size() for t in kv)


async def serve(
    off: aiokv.Offloader, rid: str, prompt: list[int], salt: object = None, decode: int = 1, **hints: object
) -> tuple[int, int]:
    """One request, as an engine runs it: lookup, load, prefill, ``decode`` tokens, finish. Returns
    (restored tokens, prompt tokens)."""
    req = off.open(rid, prompt, salt, **hints)  # type: ignore[arg-type]
    hit = await req.lookup()
    restored = await req.load(list(range(hit // BS)))
    n_prompt = -(-len(prompt) // BS)
    table = restored // BS
    rng = random.Random(rid)
    req.step(len(prompt), new_token_ids=[rng.randrange(50_000)], new_block_ids=list(range(table, n_prompt)))
    table = n_prompt
    for i in range(1, decode):
        computed = len(prompt) + i
        new = []
        if computed > table * BS:
            new, table = [table], table + 1
        req.step(computed, new_token_ids=[rng.randrange(50_000)], new_block_ids=new)
    await req.finish()
    return restored, len(prompt)


def _doc(seed: int, blocks: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(50_000) for _ in range(blocks * BS)]


async def quota(with_knob: bool, block_bytes: int) -> dict[str, float]:
    layout, _ = _layout()
    capacity = 64  # blocks
    quotas = {"noisy": 24 * block_bytes} if with_knob else None
    tier = aiokv.CPUTier(capacity * block_bytes, tenant_quota_bytes=quotas)
    docs = [_doc(100 + d, 8) for d in range(4)]  # 4 x 8 blocks = half the tier
    hit = total = 0
    async with aiokv.Offloader(layout, tiers=[tier], eviction="lru") as off:
        n = 0
        for rnd in range(6):
            for d, doc in enumerate(docs):
                question = _doc(10_000 + rnd * 10 + d, 1)
                r, _ = await serve(off, f"q{rnd}-{d}", doc + question, salt="quiet")
                if rnd > 0:  # warm requests only
                    hit, total = hit + r, total + len(doc)
                for _ in range(4):  # 4 one-off prompts of 8 blocks per quiet request: 4x the quiet traffic
                    n += 1
                    await serve(off, f"n{n}", _doc(1_000_000 + n, 8), salt="noisy")
        noisy_bytes = tier.tenant_bytes("noisy") if with_knob else None
    return {"quiet_hit": hit / total, "noisy_bytes": noisy_bytes or 0}


async def store_decode(with_knob: bool, block_bytes: int) -> dict[str, float]:
    layout, _ = _layout()
    tier = aiokv.CPUTier(256 * block_bytes)
    hints = {"store_decode": False} if with_knob else {}
    prompts = [_doc(200 + i, 4) for i in range(8)]  # 64-token prompts, 64-token answers
    hit = total = 0
    async with aiokv.Offloader(layout, tiers=[tier]) as off:
        for rnd in range(3):
            for i, p in enumerate(prompts):
                r, t = await serve(off, f"s{rnd}-{i}", [*p, rnd], decode=4 * BS + 1, **hints)
                if rnd > 0:
                    hit, total = hit + r, total + t
        st = off.stats()
    return {"bytes_stored": st.bytes_stored, "blocks_stored": st.blocks_stored, "hit": hit / total}


async def retain(with_knob: bool, block_bytes: int) -> dict[str, float]:
    layout, _ = _layout()
    tier = aiokv.CPUTier(64 * block_bytes)
    hints = {"retain_s": 60.0} if with_knob else {}
    chats = [_doc(300 + c, 6) for c in range(4)]  # 4 chats of 6 blocks = 3/8 of the tier
    hit = total = 0
    n = 0
    async with aiokv.Offloader(layout, tiers=[tier], eviction="session") as off:
        for turn in range(4):
            for c in range(len(chats)):
                prompt = chats[c] + _doc(5000 + turn * 10 + c, 1)  # the conversation so far + a new message
                r, _ = await serve(off, f"c{c}-{turn}", prompt, **hints)
                if turn > 0:
                    hit, total = hit + r, total + len(chats[c])
                chats[c] = prompt
            for _ in range(10):  # one-off traffic between turns: 80 blocks, more than the tier holds
                n += 1
                await serve(off, f"o{n}", _doc(2_000_000 + n, 8))
    return {"hit": hit / total}


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.parse_args()
    _, block_bytes = _layout()
    started = time.perf_counter()
    print(f"block {BS} tokens, {block_bytes} bytes; CPU backend; counts, not times")
    report: dict[str, object] = {"block_bytes": block_bytes}

    base, knob = await quota(False, block_bytes), await quota(True, block_bytes)
    report["quota"] = {"quiet_hit_without": base["quiet_hit"], "quiet_hit_with": knob["quiet_hit"]}
    print(
        f"quota        quiet tenant's hit ratio (warm requests): no quota {base['quiet_hit']:.1%}, "
        f"noisy tenant capped at 24 of 64 blocks {knob['quiet_hit']:.1%} "
        f"(noisy tenant holds {knob['noisy_bytes'] // block_bytes} blocks at the end)"
    )
    base, knob = await store_decode(False, block_bytes), await store_decode(True, block_bytes)
    ratio = knob["bytes_stored"] / base["bytes_stored"]
    report["store_decode"] = {
        "bytes_stored_ratio": ratio,
        "hit_without": base["hit"],
        "hit_with": knob["hit"],
    }
    print(
        f"store_decode bytes stored: store_decode=False / default = {ratio:.2f}x "
        f"({knob['blocks_stored']} vs {base['blocks_stored']} blocks); repeated prompts' hit ratio "
        f"{knob['hit']:.1%} vs {base['hit']:.1%}"
    )
    base, knob = await retain(False, block_bytes), await retain(True, block_bytes)
    report["retain"] = {"hit_without": base["hit"], "hit_with": knob["hit"]}
    print(
        f"retain       next turn's hit ratio (session policy, one-off flood between turns): retain_s=60 "
        f"{knob['hit']:.1%}, without {base['hit']:.1%}"
    )
    print(f"{time.perf_counter() - started:.1f} s")
    print(f"wrote {common.write_result('hints', report)}")


if __name__ == "__main__":
    asyncio.run(main())
