"""One tensor-parallel rank in its own process, for tests/core/test_groups.py: serve or restore a prompt over a
shared disk tier and print what it found as JSON. ``python -m tests.core._tp_worker ROLE RANK TP KINDS DIR``."""

from __future__ import annotations

import asyncio
import json
import sys

import aiokv
from aiokv import CPUTier, Offloader

from .test_groups import BS, GroupSim, _hashes, _serve


async def main(role: str, rank: int, tp: int, kinds: str, disk: str) -> dict[str, object]:
    sim = GroupSim([(k, None) for k in kinds.split(",")], tp_rank=rank, tp_size=tp)
    prompt = list(range(6 * BS + 1))
    cap = 64 * sim.layout.slot_bytes
    tiers = [CPUTier(capacity_bytes=cap), aiokv.DiskTier(disk, 8 * cap, shared=True)]
    async with Offloader(sim.layout, tiers=tiers) as off:  # type: ignore[arg-type]
        if role == "serve":
            await _serve(sim, off, "a", prompt)
            await off.flush()
            return {"written": off.stats().write_through_blocks}
        req = off.open("b", prompt)
        hit = await req.lookup()
        exact = None
        if hit:
            dst = sim.alloc(hit // BS)
            sim.poison(dst)
            assert await req.load(sim.rows(dst)) == hit
            keys = _hashes(sim.layout, prompt)
            exact = all(sim.holds(g, dst[i], keys[i]) for g in range(len(sim.kinds)) for i in range(hit // BS))
        await req.abort()
        return {"hit": hit, "exact": exact}


if __name__ == "__main__":
    role, rank, tp, kinds, disk = sys.argv[1:6]
    print(json.dumps(asyncio.run(main(role, int(rank), int(tp), kinds, disk))))
