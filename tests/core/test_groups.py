"""Grouped layouts (issue 20): full + sliding-window + latent + state groups through the public API.

The engine here is a toy: each group's block ``i`` is filled with values derived from the block's chained hash
and the group, so a restore can be checked byte for byte, and blocks a restore must not touch are poisoned.
"""

from __future__ import annotations

import hashlib
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import aiokv
from aiokv import NO_BLOCK, CPUTier, KVGroup, KVLayout, Offloader
from aiokv._groups import longest_hit, window_blocks

BS = 16


def _value(key: bytes, group: int) -> float:
    return float(int.from_bytes(hashlib.sha256(key + bytes([group])).digest()[:3], "little"))


class GroupSim:
    """Engine tensors per group, one shared block table (like vLLM with the hybrid allocator off)."""

    def __init__(
        self, kinds: list[tuple[str, int | None]], num_blocks: int = 96, **layout_kw: object
    ) -> None:
        self.kinds = kinds
        self.num_blocks = num_blocks
        self.tensors: list[torch.Tensor] = []
        groups = []
        for kind, window in kinds:
            if kind == "state":
                t = torch.zeros(num_blocks, 3, 8)
                groups.append(KVGroup([t], kind="state"))
            elif kind == "latent":
                t = torch.zeros(num_blocks, BS, 12)
                groups.append(KVGroup([t], kind="latent"))
            else:
                t = torch.zeros(num_blocks, BS, 2, 4)
                groups.append(KVGroup([t], kind=kind, window=window))
            self.tensors.append(t)
        self.layout = KVLayout.from_groups(groups, BS, **layout_kw)
        self.free = list(range(num_blocks))

    def alloc(self, n: int) -> list[int]:
        out, self.free = self.free[:n], self.free[n:]
        assert len(out) == n
        return out

    def release(self, blocks: list[int]) -> None:
        self.free.extend(blocks)

    def rows(self, blocks: list[int]) -> tuple[list[int], ...]:
        return tuple(list(blocks) for _ in self.kinds)

    def compute(self, keys: list[bytes], blocks: list[int]) -> None:
        for i, b in enumerate(blocks[: len(keys)]):
            for g, t in enumerate(self.tensors):
                t[b].fill_(_value(keys[i], g))

    def poison(self, blocks: list[int]) -> None:
        for t in self.tensors:
            for b in blocks:
                t[b].fill_(float("nan"))

    def holds(self, group: int, block: int, key: bytes) -> bool:
        return bool((self.tensors[group][block] == _value(key, group)).all())

    def untouched(self, group: int, block: int) -> bool:
        return bool(self.tensors[group][block].isnan().all())


def _hashes(layout: KVLayout, tokens: list[int]) -> list[bytes]:
    return aiokv.block_hashes(tokens, BS, root=layout.root)


async def _serve(sim: GroupSim, off: Offloader, rid: str, tokens: list[int], extra: int = 1) -> None:
    """Prefill ``tokens`` in one step, decode ``extra`` tokens, finish."""
    req = off.open(rid, tokens)
    assert await req.lookup() >= 0
    n = len(tokens)
    blocks = sim.alloc(-(-(n + extra) // BS))
    keys = _hashes(sim.layout, tokens + [7] * extra)
    sim.compute(keys, blocks)
    req.step(n, new_token_ids=[7], new_block_ids=sim.rows(blocks))
    for i in range(1, extra):
        req.step(n + i, new_token_ids=[7])
    await req.finish()
    sim.release(blocks)


@pytest.mark.asyncio
async def test_full_and_sliding_restore_exactly_and_skip_the_rest() -> None:
    sim = GroupSim([("full", None), ("sliding_window", 40)], checkpoint_blocks=8)
    lay = sim.layout
    w = window_blocks(40, BS)
    assert w == 3
    prompt = list(range(1000, 1000 + 20 * BS + 5))  # 20 full blocks
    async with Offloader(lay, tiers=[CPUTier(capacity_bytes=400 * lay.slot_bytes)]) as off:
        await _serve(sim, off, "a", prompt)
        # Base units for all 20 blocks; window units of blocks 5-7, 13-15 (checkpoints 8, 16) and 17-19 (the
        # prompt's end, also the final boundary): 11 window units never stored.
        assert off.stats().retention_bytes_saved == 11 * lay.slot_bytes
        await _serve(sim, off, "a2", prompt)  # the same blocks again: nothing new is left out
        assert off.stats().retention_bytes_saved == 11 * lay.slot_bytes
        req = off.open("b", [*prompt, 5, 6, 7])
        hit = await req.lookup()
        assert hit == 20 * BS
        dst = sim.alloc(20)
        sim.poison(dst)
        got = await req.load(sim.rows(dst))
        assert got == 20 * BS
        keys = _hashes(lay, prompt)
        for i in range(20):
            assert sim.holds(0, dst[i], keys[i]), i
            if i >= 20 - w:
                assert sim.holds(1, dst[i], keys[i]), i
            else:
                assert sim.untouched(1, dst[i]), i  # outside the window: never written
        await req.abort()


@pytest.mark.asyncio
async def test_shorter_prefix_hits_the_last_checkpoint() -> None:
    sim = GroupSim([("full", None), ("sliding_window", 40)], checkpoint_blocks=8)
    lay = sim.layout
    prompt = list(range(20 * BS + 5))
    async with Offloader(lay, tiers=[CPUTier(capacity_bytes=400 * lay.slot_bytes)]) as off:
        await _serve(sim, off, "a", prompt)
        # Shares 13 blocks: the kept boundaries at or below 13 are 8 (a checkpoint).
        other = prompt[: 13 * BS] + [99] * 40
        req = off.open("b", other)
        assert await req.lookup() == 8 * BS
        await req.abort()


@pytest.mark.asyncio
async def test_final_boundary_window_is_stored_at_finish() -> None:
    sim = GroupSim([("full", None), ("sliding_window", 40)], checkpoint_blocks=64)
    lay = sim.layout
    prompt = list(range(3 * BS + 1))  # the prompt ends in block 3
    async with Offloader(lay, tiers=[CPUTier(capacity_bytes=400 * lay.slot_bytes)]) as off:
        await _serve(sim, off, "a", prompt, extra=5 * BS)  # decode to 8 full blocks
        seq = prompt + [7] * (5 * BS)
        req = off.open("b", [*seq, 1, 2])
        assert await req.lookup() == (len(seq) // BS) * BS  # the final boundary
        await req.abort()


@pytest.mark.asyncio
async def test_sliding_only_and_state_groups() -> None:
    sim = GroupSim([("sliding_window", 20), ("state", None)], checkpoint_blocks=4)
    lay = sim.layout
    assert not lay.has_base
    prompt = list(range(10 * BS + 3))
    async with Offloader(lay, tiers=[CPUTier(capacity_bytes=200 * lay.slot_bytes)]) as off:
        await _serve(sim, off, "a", prompt)
        req = off.open("b", [*prompt, 1])
        assert await req.lookup() == 10 * BS
        dst = sim.alloc(10)
        sim.poison(dst)
        assert await req.load(sim.rows(dst)) == 10 * BS
        keys = _hashes(lay, prompt)
        assert sim.holds(1, dst[9], keys[9])  # the snapshot at the boundary
        assert sim.untouched(1, dst[8])
        assert sim.holds(0, dst[9], keys[9])
        assert sim.holds(0, dst[8], keys[8])
        assert sim.untouched(0, dst[7])
        await req.abort()
        other = prompt[: 6 * BS] + [5] * 30
        req = off.open("c", other)
        assert await req.lookup() == 4 * BS  # checkpoint 4
        await req.abort()


@pytest.mark.asyncio
async def test_no_block_rows_are_neither_stored_nor_loaded() -> None:
    sim = GroupSim([("full", None), ("sliding_window", 40)], checkpoint_blocks=4)
    lay = sim.layout
    prompt = list(range(8 * BS + 1))
    async with Offloader(lay, tiers=[CPUTier(capacity_bytes=400 * lay.slot_bytes)]) as off:
        req = off.open("a", prompt)
        await req.lookup()
        blocks = sim.alloc(9)
        keys = _hashes(lay, prompt)
        sim.compute(keys, blocks)
        sliding = [NO_BLOCK] * 6 + blocks[6:]  # the engine freed the sliding blocks 0..5
        req.step(len(prompt), [7], (blocks, sliding))
        await req.finish()
        req = off.open("b", prompt)
        # Boundary 8 needs sliding blocks 5..7: block 5 was never held, so the hit backs off to 4... whose
        # window (1..3) was not held either: a miss, never wrong KV.
        assert await req.lookup() == 0
        await req.abort()


@pytest.mark.asyncio
async def test_grouped_misuse_is_refused() -> None:
    sim = GroupSim([("full", None), ("sliding_window", 40)])
    lay = sim.layout
    async with Offloader(lay, tiers=[CPUTier(capacity_bytes=64 * lay.slot_bytes)]) as off:
        req = off.open("a", list(range(40)))
        await req.lookup()
        with pytest.raises(aiokv.InvalidArgumentError, match="one sequence of block ids per group"):
            req.step(16, [], ([0],))
        with pytest.raises(aiokv.InvalidArgumentError, match=r"must fit in the request's blocks \(16 tokens"):
            req.step(32, [], ([0, 1], [2]))  # the sliding group covers one block: 16 tokens, not 32
        with pytest.raises(aiokv.InvalidArgumentError, match="must hold a block at every position"):
            req.step(16, [], ([NO_BLOCK], [2]))
        req.step(16, [], ([0], [1]))
        # Running now (the fast paths apply): a flat list (one group's ids) is never taken for per-group ids.
        with pytest.raises(aiokv.InvalidTypeError, match=r"new_block_ids\[0\] must be a sequence of ints"):
            req.step(32, [], [5, 6])
        with pytest.raises(aiokv.InvalidTypeError, match=r"new_block_ids\[0\] must be a sequence of ints"):
            req.step(32, [], (5, 6))
        with pytest.raises(aiokv.InvalidArgumentError, match="must not repeat a block"):
            req.step(32, [], ([0], [3]))
        await req.abort()
    with pytest.raises(aiokv.InvalidArgumentError, match="store_partial_last_block"):
        Offloader(lay, tiers=[CPUTier(capacity_bytes=64 * lay.slot_bytes)], store_partial_last_block=True)


def test_layout_errors_name_the_parameter() -> None:
    t = torch.zeros(8, BS, 2, 4)
    with pytest.raises(aiokv.InvalidArgumentError, match=r"groups\[0\].window must be given"):
        KVLayout.from_groups([KVGroup([t], kind="sliding_window")], BS)
    with pytest.raises(aiokv.InvalidArgumentError, match=r"groups\[0\].kind must be one of"):
        KVLayout.from_groups([KVGroup([t], kind="mamba")], BS)
    with pytest.raises(aiokv.InvalidArgumentError, match=r"groups\[0\].window must be None"):
        KVLayout.from_groups([KVGroup([t], window=4)], BS)
    with pytest.raises(aiokv.InvalidLayoutError, match="must not share memory except as the very same"):
        KVLayout.from_groups([KVGroup([t]), KVGroup([t.view(8, BS, 8)], kind="sliding_window", window=8)], BS)
    with pytest.raises(aiokv.InvalidLayoutError, match=r"groups\[0\] \(full0\): tensors\[1\] must not share"):
        KVLayout.from_groups([KVGroup([t, t])], BS)
    with pytest.raises(aiokv.InvalidArgumentError, match="tp_rank must be in"):
        KVLayout.from_groups([KVGroup([t])], BS, tp_rank=2, tp_size=2)
    with pytest.raises(aiokv.InvalidLayoutError, match="block_size must equal"):
        KVLayout.from_groups([KVGroup([t])], 8)


def test_fingerprint_covers_every_group_and_tp() -> None:
    def lay(**kw: object) -> KVLayout:
        f, s = torch.zeros(8, BS, 2, 4), torch.zeros(8, BS, 2, 4)
        window = kw.pop("window", 32)
        kind = kw.pop("kind", "sliding_window")
        return KVLayout.from_groups([KVGroup([f]), KVGroup([s], kind=kind, window=window)], BS, **kw)

    base = lay().root
    assert lay().root == base
    assert lay(window=64).root != base
    assert lay(kind="full", window=None).root != base
    assert lay(tp_size=2).root != base  # a sharded cache never restores at another TP size
    assert lay(tp_size=2, tp_rank=1).root == lay(tp_size=2).root  # the rank is in the unit keys instead
    assert lay(pp_size=2, pp_rank=1).root != lay(pp_size=2).root  # pipeline stages never share a cache
    one = KVLayout([torch.zeros(8, BS, 2, 4), torch.zeros(8, BS, 2, 4)], BS)
    assert one.root != lay(kind="full", window=None).root


def test_tp_keys_per_rank_and_replicated_once() -> None:
    lat = [torch.zeros(8, BS, 12) for _ in range(2)]
    r0 = KVLayout.from_groups([KVGroup([lat[0]], kind="latent")], BS, tp_rank=0, tp_size=2)
    r1 = KVLayout.from_groups([KVGroup([lat[1]], kind="latent")], BS, tp_rank=1, tp_size=4)
    assert r0.root == r1.root  # replicated latent: the same bytes at any rank and TP size
    key = b"k" * 32
    assert r0.unit_key(key, 0) == r1.unit_key(key, 0) == key
    full = [torch.zeros(8, BS, 2, 4) for _ in range(2)]
    s0 = KVLayout.from_groups([KVGroup([full[0]])], BS, tp_rank=0, tp_size=2)
    s1 = KVLayout.from_groups([KVGroup([full[1]])], BS, tp_rank=1, tp_size=2)
    assert s0.unit_key(key, 0) != s1.unit_key(key, 0)


# --------------------------------------------------------------- the hit rule


def _oracle(
    n: int, base: list[bool] | None, windows: list[tuple[int, list[bool]]], states: list[list[bool]]
) -> int:
    for N in range(n, 0, -1):
        if base is not None and not all(base[:N]):
            continue
        if not all(present[j] for w, present in windows for j in range(max(0, N - w), N)):
            continue
        if not all(st[N - 1] for st in states):
            continue
        return N
    return 0


@settings(max_examples=400, deadline=None)
@given(
    n=st.integers(0, 24),
    seed=st.integers(0, 2**32 - 1),
    has_base=st.booleans(),
    ws=st.lists(st.integers(1, 6), max_size=2),
    n_states=st.integers(0, 2),
    density=st.floats(0.5, 1.0),
)
def test_longest_hit_matches_brute_force(
    n: int, seed: int, has_base: bool, ws: list[int], n_states: int, density: float
) -> None:
    rng = random.Random(seed)

    def bits() -> list[bool]:
        return [rng.random() < density for _ in range(n)]

    base = bits() if has_base else None
    windows = [(w, bits()) for w in ws]
    states = [bits() for _ in range(n_states)]
    assert longest_hit(n, base, windows, states) == _oracle(n, base, windows, states)


# ------------------------------------------------------ tiers, preemption, schedules


@pytest.mark.asyncio
async def test_units_write_through_and_stage_back_from_disk(tmp_path: object) -> None:
    sim = GroupSim([("full", None), ("sliding_window", 40)], checkpoint_blocks=8)
    lay = sim.layout
    prompt = list(range(5000, 5000 + 12 * BS + 2))
    cap = 200 * lay.slot_bytes

    def tiers() -> list[object]:
        return [CPUTier(capacity_bytes=cap), aiokv.DiskTier(str(tmp_path), capacity_bytes=4 * cap)]

    async with Offloader(lay, tiers=tiers()) as off:  # type: ignore[arg-type]
        await _serve(sim, off, "a", prompt)
        await off.flush()
        stored = off.stats().blocks_stored
    async with Offloader(lay, tiers=tiers()) as off:  # type: ignore[arg-type]
        req = off.open("b", [*prompt, 1])
        assert await req.lookup() == 12 * BS
        assert off.stats().staged_blocks > 0
        dst = sim.alloc(12)
        sim.poison(dst)
        assert await req.load(sim.rows(dst)) == 12 * BS
        keys = _hashes(lay, prompt)
        assert all(sim.holds(0, dst[i], keys[i]) for i in range(12))
        assert all(sim.holds(1, dst[i], keys[i]) for i in range(12 - 3, 12))
        await req.abort()
    assert stored > 12  # base units plus window units


@pytest.mark.asyncio
async def test_each_group_has_its_own_block_table() -> None:
    sim = GroupSim([("full", None), ("sliding_window", 40)], checkpoint_blocks=4)
    lay = sim.layout
    prompt = list(range(8 * BS + 3))
    keys = _hashes(lay, prompt)
    async with Offloader(lay, tiers=[CPUTier(capacity_bytes=200 * lay.slot_bytes)]) as off:
        req = off.open("a", prompt)
        await req.lookup()
        full, slide = list(range(0, 9)), list(range(50, 59))
        for i in range(8):
            sim.tensors[0][full[i]].fill_(_value(keys[i], 0))
            sim.tensors[1][slide[i]].fill_(_value(keys[i], 1))
        req.step(len(prompt), [7], (full, slide))
        await req.finish()
        req = off.open("b", prompt)
        assert await req.lookup() == 8 * BS
        f2, s2 = list(range(20, 28)), list(range(70, 78))
        sim.poison(f2 + s2)
        assert await req.load((f2, s2)) == 8 * BS
        assert all(sim.holds(0, f2[i], keys[i]) for i in range(8))
        assert all(sim.holds(1, s2[i], keys[i]) for i in range(5, 8))
        assert all(sim.untouched(1, s2[i]) for i in range(5))
        assert all(sim.untouched(0, s) for s in s2)  # nothing crossed into the other group's blocks
        await req.abort()


@pytest.mark.asyncio
async def test_preemption_keeps_the_boundary_it_stopped_at() -> None:
    sim = GroupSim([("full", None), ("sliding_window", 40)], checkpoint_blocks=64)
    lay = sim.layout
    prompt = list(range(10 * BS + 4))  # no checkpoint before 64 blocks; the prompt ends at 10
    async with Offloader(lay, tiers=[CPUTier(capacity_bytes=200 * lay.slot_bytes)]) as off:
        req = off.open("a", prompt)
        await req.lookup()
        blocks = sim.alloc(11)
        keys = _hashes(lay, prompt)
        sim.compute(keys, blocks)
        req.step(7 * BS, [], sim.rows(blocks))  # a chunked prefill, preempted after 7 blocks
        await req.preempt()
        sim.release(blocks)
        # The preempted boundary (7) kept its window: the same request resumes from it.
        assert await req.lookup() == 7 * BS
        dst = sim.alloc(7)
        sim.poison(dst)
        assert await req.load(sim.rows(dst)) == 7 * BS
        assert all(sim.holds(0, dst[i], keys[i]) for i in range(7))
        assert all(sim.holds(1, dst[i], keys[i]) for i in range(4, 7))
        await req.abort()


@pytest.mark.asyncio
@pytest.mark.parametrize("disk", [False, True], ids=["cpu", "cpu+disk"])
@pytest.mark.parametrize("seed", range(10))
async def test_random_schedules_never_restore_wrong_kv(seed: int, disk: bool, tmp_path: object) -> None:
    """Many requests sharing prefixes in a CPU tier far too small (units evicted independently; with a disk
    tier below it, staged back), with preemptions and aborts: every hit is loadable and every restored block
    is exactly the right one."""
    rng = random.Random(seed)
    kinds: list[tuple[str, int | None]] = rng.choice(
        [
            [("full", None), ("sliding_window", 40)],
            [("sliding_window", 24), ("full", None), ("sliding_window", 56)],
            [("latent", None), ("state", None)],
            [("sliding_window", 33)],
            [
                ("full", None),
                ("latent", None),
                ("sliding_window", 20),
            ],  # two base parts (sharded, replicated)
        ]
    )
    sim = GroupSim(kinds, num_blocks=160, checkpoint_blocks=rng.choice([2, 3, 5]))
    lay = sim.layout
    stems = [[rng.randrange(50) for _ in range(rng.randrange(1, 6) * BS)] for _ in range(3)]
    tiers: list[object] = [CPUTier(capacity_bytes=rng.randrange(12, 40) * lay.slot_bytes)]
    if disk:
        tiers.append(aiokv.DiskTier(str(tmp_path), capacity_bytes=rng.randrange(40, 400) * lay.slot_bytes))
    async with Offloader(lay, tiers=tiers) as off:  # type: ignore[arg-type]
        for r in range(30):
            tokens = rng.choice(stems) + [rng.randrange(50) for _ in range(rng.randrange(1, 4 * BS))]
            req = off.open(f"r{r}", tokens)
            hit = await req.lookup()
            assert hit % BS == 0
            assert hit < len(tokens)
            n_hit = hit // BS
            keys = _hashes(lay, tokens)
            blocks: list[int] = []
            if n_hit:
                blocks = sim.alloc(n_hit)
                sim.poison(blocks)
                got = await req.load(sim.rows(blocks))
                assert got == hit
                base = [g for g, (k, _w) in enumerate(kinds) if k in ("full", "latent")]
                for i in range(n_hit):
                    for g in base:
                        assert sim.holds(g, blocks[i], keys[i]), (r, i, g)
                for g, (k, w) in enumerate(kinds):
                    if k == "sliding_window":
                        assert w is not None
                        for i in range(max(0, n_hit - window_blocks(w, BS)), n_hit):
                            assert sim.holds(g, blocks[i], keys[i]), (r, i, g)
                    if k == "state":
                        assert sim.holds(g, blocks[n_hit - 1], keys[n_hit - 1]), (r, g)
            more = sim.alloc(-(-len(tokens) // BS) - n_hit)
            blocks += more
            sim.compute(keys, blocks)
            stop = rng.choice([len(tokens), len(tokens), rng.randrange(hit, len(tokens) + 1)])
            req.step(stop, [], sim.rows(more))
            what = rng.random()
            if what < 0.15:
                await req.abort()
            elif what < 0.3:
                await req.preempt()
                await req.abort()
            else:
                await req.finish()
            sim.release(blocks)
        assert off.stats().hits > 0
        if disk:  # units went down to the disk (and, for most seeds, came back: staged_blocks)
            assert off.stats().write_through_blocks > 0


@pytest.mark.asyncio
async def test_replicated_latent_restores_on_another_rank_and_tp_size(tmp_path: object) -> None:
    """Rank 0 of TP=2 serves a prompt into a shared disk tier; rank 1 of TP=4 (another process's view of the
    same tier) restores the latent cache from it. A sharded full-attention cache does not cross ranks."""
    prompt = list(range(6 * BS + 1))
    disk = str(tmp_path)

    def latent_rank(rank: int, tp: int) -> GroupSim:
        return GroupSim([("latent", None)], tp_rank=rank, tp_size=tp)

    r0 = latent_rank(0, 2)
    cap = 64 * r0.layout.slot_bytes
    async with Offloader(
        r0.layout, tiers=[CPUTier(capacity_bytes=cap), aiokv.DiskTier(disk, 4 * cap, shared=True)]
    ) as off:
        await _serve(r0, off, "a", prompt)
        await off.flush()
    r1 = latent_rank(1, 4)
    async with Offloader(
        r1.layout, tiers=[CPUTier(capacity_bytes=cap), aiokv.DiskTier(disk, 4 * cap, shared=True)]
    ) as off:
        req = off.open("b", prompt)
        assert await req.lookup() == 6 * BS
        dst = r1.alloc(6)
        r1.poison(dst)
        assert await req.load(r1.rows(dst)) == 6 * BS
        keys = _hashes(r1.layout, prompt)
        assert all(r1.holds(0, dst[i], keys[i]) for i in range(6))
        await req.abort()

    f0 = GroupSim([("full", None)], tp_rank=0, tp_size=2)
    f1 = GroupSim([("full", None)], tp_rank=1, tp_size=2)
    d2 = str(tmp_path) + "-full"
    async with Offloader(
        f0.layout, tiers=[CPUTier(capacity_bytes=cap), aiokv.DiskTier(d2, 4 * cap, shared=True)]
    ) as off:
        await _serve(f0, off, "a", prompt)
        await off.flush()
    async with Offloader(
        f1.layout, tiers=[CPUTier(capacity_bytes=cap), aiokv.DiskTier(d2, 4 * cap, shared=True)]
    ) as off:
        req = off.open("b", prompt)
        assert await req.lookup() == 0  # rank 1's shard was never stored: a miss, not rank 0's bytes
        await req.abort()


@pytest.mark.asyncio
async def test_replicated_units_are_written_through_by_rank_zero_only(tmp_path: object) -> None:
    """TP=2 ranks in one process serve the same requests (as TP ranks do) over one shared disk tier: the
    latent units reach the disk once, from rank 0; the sharded full-attention units from both ranks."""
    prompt = list(range(4 * BS + 1))
    disk = str(tmp_path)
    sims = [GroupSim([("latent", None), ("full", None)], tp_rank=r, tp_size=2) for r in range(2)]
    cap = 64 * sims[0].layout.slot_bytes
    offs = [
        Offloader(s.layout, tiers=[CPUTier(capacity_bytes=cap), aiokv.DiskTier(disk, 8 * cap, shared=True)])
        for s in sims
    ]
    for off in offs:
        await off.start()
    try:
        for sim, off in zip(sims, offs, strict=True):
            await _serve(sim, off, "a", prompt)
            await off.flush()
        wt = [off.stats().write_through_blocks for off in offs]
        lay = sims[0].layout
        sharded = sum(p.units for p in lay.parts if not p.replicated)
        replicated = sum(p.units for p in lay.parts if p.replicated)
        assert sharded >= 1
        assert replicated >= 1
        assert wt == [4 * (sharded + replicated), 4 * sharded]  # 4 full blocks each
        assert [off.stats().blocks_stored for off in offs] == [4 * (sharded + replicated)] * 2
    finally:
        for off in offs:
            await off.aclose()


def _rank(*args: object) -> dict[str, object]:
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    out = subprocess.run(
        [sys.executable, "-m", "tests.core._tp_worker", *map(str, args)],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def test_ranks_in_separate_processes_share_a_tier(tmp_path: object) -> None:
    """Rank 0 of TP=2 writes a latent cache to a shared disk tier from its own process; rank 1 of TP=2 and
    rank 3 of TP=4 restore it exactly from theirs. A sharded full-attention cache written at TP=2 restores
    on the same rank only: not on another rank, not at TP=4."""
    lat, full = f"{tmp_path}/latent", f"{tmp_path}/full"
    assert _rank("serve", 0, 2, "latent", lat)["written"] == 6
    assert _rank("restore", 1, 2, "latent", lat) == {"hit": 6 * BS, "exact": True}
    assert _rank("restore", 3, 4, "latent", lat) == {"hit": 6 * BS, "exact": True}
    assert _rank("serve", 1, 2, "full", full)["written"] == 6
    assert _rank("restore", 1, 2, "full", full) == {"hit": 6 * BS, "exact": True}
    assert _rank("restore", 0, 2, "full", full) == {"hit": 0, "exact": None}
    assert _rank("restore", 1, 4, "full", full) == {"hit": 0, "exact": None}


@pytest.mark.asyncio
async def test_lower_tier_lookup_backs_off_to_a_checkpoint(tmp_path: object) -> None:
    """Only the disk holds the cache (a fresh CPU tier): a prefix shared up to block 30 resumes at the
    checkpoint 24 below it, completed from the disk in a second round trip."""
    sim = GroupSim([("full", None), ("sliding_window", 40)], num_blocks=128, checkpoint_blocks=8)
    lay = sim.layout
    prompt = list(range(7000, 7000 + 40 * BS + 1))
    cap = 400 * lay.slot_bytes

    def tiers() -> list[object]:
        return [CPUTier(capacity_bytes=cap), aiokv.DiskTier(str(tmp_path), capacity_bytes=4 * cap)]

    async with Offloader(lay, tiers=tiers()) as off:  # type: ignore[arg-type]
        await _serve(sim, off, "a", prompt)
        await off.flush()
    async with Offloader(lay, tiers=tiers()) as off:  # type: ignore[arg-type]
        other = prompt[: 30 * BS] + [1] * 50
        req = off.open("b", other)
        assert await req.lookup() == 24 * BS
        dst = sim.alloc(24)
        sim.poison(dst)
        assert await req.load(sim.rows(dst)) == 24 * BS
        keys = _hashes(lay, prompt)
        assert all(sim.holds(0, dst[i], keys[i]) for i in range(24))
        assert all(sim.holds(1, dst[i], keys[i]) for i in range(21, 24))
        await req.abort()


@pytest.mark.asyncio
async def test_groups_sharing_tensors_use_their_own_block_ids() -> None:
    """vLLM's hybrid allocator: a sliding-window layer and a full-attention layer share one buffer, each
    group owning different block ids of it. Stores and loads address each group's own ids; one id given to
    both groups sharing the buffer in a request is refused."""
    shared = [torch.full((64, BS, 2, 4), float("nan")) for _ in range(2)]
    lay = KVLayout.from_groups(
        [KVGroup([shared[0], shared[1]]), KVGroup([shared[0], shared[1]], kind="sliding_window", window=33)],
        BS,
        checkpoint_blocks=4,
    )
    assert lay.memory_class == (0, 0)
    prompt = list(range(4 * BS + 1))
    keys = _hashes(lay, prompt)
    full, slide = [0, 1, 2, 3, 4], [10, 11, 12, 13, 14]
    for i in range(4):
        for t in shared:
            t[full[i]].fill_(_value(keys[i], 0))
            t[slide[i]].fill_(_value(keys[i], 1))
    async with Offloader(lay, tiers=[CPUTier(capacity_bytes=64 * lay.slot_bytes)]) as off:
        req = off.open("a", prompt)
        await req.lookup()
        with pytest.raises(aiokv.InvalidArgumentError, match="or one of a group sharing its tensors"):
            req.step(len(prompt), [], (full, [10, 11, 12, 13, 4]))
        req.step(len(prompt), [], (full, slide))
        await req.finish()
        req = off.open("b", prompt)
        assert await req.lookup() == 4 * BS
        f2, s2 = [20, 21, 22, 23], [30, 31, 32, 33]
        assert await req.load((f2, s2)) == 4 * BS
        for t in shared:
            assert all(bool((t[f2[i]] == _value(keys[i], 0)).all()) for i in range(4))
            assert all(bool((t[s2[i]] == _value(keys[i], 1)).all()) for i in (2, 3))
            assert all(bool(t[s2[i]].isnan().all()) for i in (0, 1))
        await req.abort()


@pytest.mark.asyncio
async def test_dropped_sliding_blocks_are_never_read_again() -> None:
    """vLLM frees a sliding-window group's blocks as they leave the window: after drop_blocks() the final
    boundary's store skips them (a miss for that boundary), never reading what another request wrote there."""
    sim = GroupSim([("full", None), ("sliding_window", 40)], checkpoint_blocks=64)
    lay = sim.layout
    prompt = list(range(2 * BS + 1))
    async with Offloader(lay, tiers=[CPUTier(capacity_bytes=200 * lay.slot_bytes)]) as off:
        req = off.open("a", prompt)
        await req.lookup()
        blocks = sim.alloc(8)
        seq = prompt + [7] * (6 * BS)
        keys = _hashes(lay, seq)
        sim.compute(keys, blocks)
        req.step(len(prompt), [7], sim.rows(blocks[:3]))
        for n in range(len(prompt) + 1, len(seq)):
            req.step(n, [7], sim.rows(blocks[3 + (n // BS) - 3 : 4 + (n // BS) - 3]) if n % BS == 0 else ())
        held = [b for row in req.block_ids for b in row[1:]]
        await req.drop_blocks(([], [held[5]]))  # block 5 left the window; another request may write it now
        sim.tensors[1][held[5]].fill_(-1.0)
        with pytest.raises(aiokv.InvalidArgumentError, match="must be empty"):
            req.drop_blocks(([blocks[0]], []))
        with pytest.raises(aiokv.InvalidArgumentError, match="must name blocks the request holds"):
            req.drop_blocks(([], [held[5]]))
        await req.finish()
        final = (len(seq) - 1) // BS
        req = off.open("b", [*seq[: final * BS], 1])
        hit = await req.lookup()
        assert hit < final * BS  # the final boundary's window lost block 5: not restorable there
        if hit:
            dst = sim.alloc(hit // BS)
            sim.poison(dst)
            await req.load(sim.rows(dst))
            assert not any(bool((sim.tensors[1][d] == -1.0).any()) for d in dst)
        await req.abort()


@pytest.mark.asyncio
async def test_retention_keeps_every_unit_the_next_turn_needs() -> None:
    """``retain_s`` on a grouped layout keeps the base units and the final boundary's window units: under
    eviction pressure from other requests the next turn still resumes at the final boundary."""
    sim = GroupSim([("full", None), ("sliding_window", 40)], num_blocks=128, checkpoint_blocks=64)
    lay = sim.layout
    prompt = list(range(8 * BS + 1))
    async with Offloader(lay, tiers=[CPUTier(capacity_bytes=24 * lay.slot_bytes)], eviction="session") as off:
        req = off.open("a", prompt, retain_s=3600.0)
        await req.lookup()
        blocks = sim.alloc(9)
        sim.compute(_hashes(lay, [*prompt, 7]), blocks)
        req.step(len(prompt), [7], sim.rows(blocks))
        await req.finish()
        sim.release(blocks)
        for r in range(4):  # 8 base + 3 window units each: far more than the 13 slots left
            await _serve(sim, off, f"o{r}", [50_000 + r * 1000 + t for t in range(8 * BS + 1)])
        assert off.stats().evictions > 0
        nxt = off.open("b", [*prompt, 7, 8, 9])
        assert await nxt.lookup() == 8 * BS
        await nxt.abort()


@pytest.mark.asyncio
async def test_groups_with_different_block_sizes() -> None:
    """A full-attention group of 16-token blocks and a sliding-window group of 32-token blocks under 32-token
    key blocks: the engine hands each group blocks in its own granularity (decode steps bring a full-group block
    every 16 tokens, a sliding one every 32); a key block joins aiokv's table once every group covers it, and a
    restore puts every sub-block back exactly."""
    kb = 32
    full = torch.full((64, 16, 2, 4), float("nan"))
    slide = torch.full((64, 32, 2, 4), float("nan"))
    lay = KVLayout.from_groups(
        [KVGroup([full], block_size=16), KVGroup([slide], kind="sliding_window", window=40)],
        kb,
        checkpoint_blocks=2,
    )
    assert [g.ratio for g in lay.groups] == [2, 1]
    prompt = list(range(3 * kb + 5))
    seq = [*prompt, *range(900, 900 + 2 * kb)]
    keys = aiokv.block_hashes(seq, kb, root=lay.root)

    def fill(fids: list[int], sids: list[int], upto: int) -> None:
        for i in range(upto):
            full[fids[2 * i]].fill_(_value(keys[i], 10))
            full[fids[2 * i + 1]].fill_(_value(keys[i], 11))
            slide[sids[i]].fill_(_value(keys[i], 20))

    async with Offloader(lay, tiers=[CPUTier(capacity_bytes=64 * lay.slot_bytes)]) as off:
        req = off.open("a", prompt)
        assert await req.lookup() == 0
        fill(list(range(12)), list(range(20, 26)), len(seq) // kb)  # the KV every block will hold
        fids, sids = list(range(0, 7)), list(range(20, 24))  # 7 x 16 and 4 x 32 tokens: covers 101 tokens
        req.step(len(prompt), [seq[len(prompt)]], (fids, sids))
        with pytest.raises(aiokv.InvalidArgumentError, match="must fit in the request's blocks"):
            req.step(113, seq[102:114])  # 113 tokens computed: the full group's 7 blocks hold only 112
        for n in range(len(prompt) + 1, len(seq)):
            new_f = [len(fids)] if n % 16 == 0 else []
            new_s = [20 + len(sids)] if n % 32 == 0 else []
            fids += new_f
            sids += new_s
            req.step(n, [seq[n]], (new_f, new_s))
        assert fids == list(range(len(fids)))
        assert sids == list(range(20, 20 + len(sids)))
        assert req.num_computed_tokens == len(seq) - 1
        await req.finish()
        final = (len(seq) - 1) // kb
        nxt = off.open("b", [*seq[: final * kb], 1])
        assert await nxt.lookup() == final * kb
        f2, s2 = list(range(30, 30 + 2 * final)), list(range(40, 40 + final))
        full[f2].fill_(float("nan"))
        slide[s2].fill_(float("nan"))
        with pytest.raises(aiokv.InvalidArgumentError, match="must cover the same key blocks"):
            nxt.load((f2[:-1], s2))
        assert await nxt.load((f2, s2)) == final * kb
        for i in range(final):
            assert bool((full[f2[2 * i]] == _value(keys[i], 10)).all()), i
            assert bool((full[f2[2 * i + 1]] == _value(keys[i], 11)).all()), i
        w = window_blocks(40, kb)
        for i in range(final - w, final):
            assert bool((slide[s2[i]] == _value(keys[i], 20)).all()), i
        await nxt.abort()
