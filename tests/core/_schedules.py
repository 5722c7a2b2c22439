"""The reuse race, adversarially: seeded random schedules of requests against one offloader.

An engine poisons (reuses) blocks the instant ``finish()``/``preempt()``/``abort()`` resolve; requests look up,
load, step, decode, get preempted, resume, finish and abort in random interleavings while copies are held
back at random. Every block ever loaded must equal a recomputation of its prefix, and nothing may be lost
except by counted eviction.

Two modes: on the CPU backend copies are held by a :class:`~._sim.Gate` on the executor's worker threads; on
the simulated device (``device=True``) the engine's KV writes, block reuse and checks are kernels on the
compute stream (landing after the calls that enqueue them), the compute stream is held at random points,
aiokv's copy streams are paused at random, every stream has seeded jitter, and loads are ordered either on
the host (await, then check) or on the device (``wait_submitted`` + ``order_before``, check at once).
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass, field
from typing import Any

import aiokv
import aiokv.tiers
from aiokv import CPUTier, Offloader
from aiokv.transfer import SimulatedDevice

from ._sim import DeviceSimEngine, Gate, SimEngine, running_hashes


@dataclass
class _Sim:
    rid: str
    tokens: list[int]
    decode_budget: int
    end: str
    req: aiokv.Request | None = None
    blocks: list[int] = field(default_factory=list)
    computed: int = 0
    phase: str = "lookup"
    pending: asyncio.Future[object] | None = None
    hashes: list[float] = field(default_factory=list)


async def _wait(aw: object) -> object:
    return await aw  # type: ignore[misc]


async def _submitted_then_ordered(pending: aiokv.LoadCompletion) -> int:
    """The device pattern: once the load is on its stream, order the compute stream after it, no host wait."""
    n = await pending.wait_submitted()
    pending.order_before()
    return n


class _DeviceGate:
    """The device mode's gate: pauses aiokv's copy streams and holds the compute stream at random."""

    def __init__(self, sim: SimulatedDevice, compute: Any, rng: random.Random) -> None:
        self._sim = sim
        self._compute = compute
        self._rng = rng
        self._holds: list[Any] = []
        self.copy_streams: list[Any] = []

    def close(self) -> None:
        for s in self.copy_streams:
            s.pause()

    def allow(self, k: int = 1) -> None:
        for s in self.copy_streams:
            if self._rng.random() < 0.5:
                s.resume()
        if self._holds and self._rng.random() < 0.5:
            self._holds.pop(0).set()

    def maybe_hold(self) -> None:
        # At most a few holds outstanding: each is an operation on the compute stream, and a driver that
        # added one per scheduling point would enqueue them faster than the stream retires them.
        if len(self._holds) < 4 and self._rng.random() < 0.15:
            self._holds.append(self._compute.hold())

    async def bound_run_ahead(self, limit: int = 64) -> None:
        """Like an engine whose host runs at most a few steps ahead of its device: when the compute stream has
        more than ``limit`` operations queued, release everything and wait (off the loop) until it catches up.
        Without it a request cycling through preemption could enqueue work faster than the stream retires it."""
        if self._compute.pending <= limit:
            return
        self.open()
        ev = self._sim.new_event(blocking=True)
        self._sim.record(ev, self._compute)
        await asyncio.to_thread(self._sim.synchronize, ev)
        self.close()

    def open(self) -> None:
        for s in self.copy_streams:
            s.resume()
        for h in self._holds:
            h.set()
        self._holds.clear()


async def run_schedule(seed: int, gate: Gate | None = None, *, device: bool = False) -> dict[str, int]:
    rng = random.Random(seed)
    bs = 4
    num_blocks = rng.choice([6, 10, 24])
    sim: SimulatedDevice | None = None
    dgate: _DeviceGate | None = None
    if device:
        sim = SimulatedDevice(seed=seed, jitter_s=rng.choice([0.0, 0.00002, 0.0002]))
        compute = sim.new_stream("compute")
        eng: SimEngine = DeviceSimEngine(
            sim, compute, num_blocks=num_blocks, block_size=bs, num_tensors=2, width=2
        )
        dgate = _DeviceGate(sim, compute, rng)
        g: Any = dgate
    else:
        assert gate is not None
        eng = SimEngine(num_blocks=num_blocks, block_size=bs, num_tensors=2, width=2)
        g = gate
    roomy = rng.random() < 0.4
    cap = 256 if roomy else rng.choice([2, 3, 5, 8])
    eviction = rng.choice(aiokv.tiers.policy_names())
    bases = [[rng.randrange(40) for _ in range(rng.randint(4, 14))] for _ in range(3)]
    finished: list[tuple[list[int], int]] = []
    checked_loads = 0
    partial = rng.random() < 0.3
    extra: dict[str, Any] = {}
    if sim is not None:
        extra = {
            "device": sim,
            "compute_stream": compute,
            "staging_bytes": rng.choice([2, 4, 64]) * eng.layout.slot_bytes,
        }
    try:
        async with Offloader(
            eng.layout,
            tiers=[CPUTier(capacity_bytes=cap * eng.layout.slot_bytes)],
            eviction=eviction,
            store_partial_last_block=partial,
            **extra,
        ) as off:
            if dgate is not None:
                pipes = off.executor._dev._pipes  # type: ignore[union-attr]
                dgate.copy_streams = [p.stream for p in pipes]
            g.close()
            out = await _drive(rng, off, eng, g, dgate, bases, finished, partial)
            checked_loads += out
            g.open()
            stats = off.stats()
            assert stats.in_flight == 0
            cpu = off.cpu.stats()
            assert cpu.pinned == 0
            assert cpu.pending == 0
            off.cpu.index.check_invariants()
            # Everything a finished request computed is still there unless eviction (counted) took it.
            for i, (tokens, computed) in enumerate(finished):
                probe = off.open(f"probe{i}", tokens)
                hit = await probe.lookup()
                expect = min(computed // bs, (len(tokens) - 1) // bs)
                if roomy:
                    assert stats.evictions == 0
                    assert stats.stores_dropped == 0
                    assert hit // bs >= expect, (
                        f"seed {seed}: finished request lost blocks ({hit // bs} < {expect})"
                    )
                n = min(-(-hit // bs), len(eng.free))
                dst = eng.alloc(n)
                assert dst is not None
                await probe.load(dst)
                eng.check_tokens(running_hashes(tokens), dst, min(hit, n * bs))
                checked_loads += n
                await probe.finish()
                eng.release(dst)
            if isinstance(eng, DeviceSimEngine):
                eng.verify()
    finally:
        g.open()
        if sim is not None:
            sim.close()
    return {"loads": checked_loads, "evictions": stats.evictions}


async def _drive(
    rng: random.Random,
    off: Offloader,
    eng: SimEngine,
    g: Any,
    dgate: _DeviceGate | None,
    bases: list[list[int]],
    finished: list[tuple[list[int], int]],
    partial: bool,
) -> int:
    bs = eng.block_size
    checked_loads = 0
    sims: list[_Sim] = []
    for i in range(rng.randint(2, 6)):
        if finished and rng.random() < 0.4:
            prev, _ = rng.choice(finished)
            prompt = prev + [rng.randrange(40) for _ in range(rng.randint(1, 6))]
        else:
            base = rng.choice(bases)
            prompt = base[: rng.randint(1, len(base))] + [rng.randrange(40) for _ in range(rng.randint(0, 5))]
        end = rng.choices(["finish", "abort", "preempt"], weights=[6, 2, 2])[0]
        sims.append(_Sim(f"r{i}", prompt, rng.randint(0, 6), end))
    active = sims[: rng.randint(1, len(sims))]
    queue = sims[len(active) :]
    for s in active:
        s.req = off.open(s.rid, s.tokens)

    def start(s: _Sim, aw: object) -> None:
        s.pending = asyncio.ensure_future(_wait(aw))

    while active:
        if dgate is not None:
            await dgate.bound_run_ahead()
        if rng.random() < 0.3:
            g.allow(rng.randint(1, 3))
        s = rng.choice(active)
        if s.pending is not None and not s.pending.done():
            if all(x.pending is not None and not x.pending.done() for x in active):
                g.open()
                await asyncio.wait(
                    [x.pending for x in active if x.pending], return_when=asyncio.FIRST_COMPLETED
                )
                g.close()
            else:
                await asyncio.sleep(0)  # a scheduling point: lets request tasks and callbacks run
            continue
        if dgate is not None:
            dgate.maybe_hold()  # only where the engine acts: never once per scheduling point
        req = s.req
        assert req is not None
        result = s.pending.result() if s.pending is not None else None
        s.pending = None
        if s.phase == "lookup":
            start(s, req.lookup())
            s.phase = "lookup-wait"
        elif s.phase == "lookup-wait":
            assert isinstance(result, int)
            n = -(-result // bs)  # a partially filled last block counts
            n = min(n, len(eng.free), rng.randint(0, n))
            dst = eng.alloc(n)
            assert dst is not None
            s.blocks = dst
            s.computed = min(result, n * bs)
            pending = req.load(dst)
            if dgate is not None and dst and rng.random() < 0.5:
                # Order the engine's next kernels after the load on the device; the host learns later.
                start(s, _submitted_then_ordered(pending))
                s.phase = "load-submitted"
                continue
            start(s, pending)
            s.phase = "load-wait"
        elif s.phase in ("load-wait", "load-submitted"):
            s.hashes = running_hashes(s.tokens)
            # THE check: restored KV equals a recomputation of its prefix (on the device: a kernel ordered
            # after the load by the host's await, or by order_before()).
            eng.check_tokens(s.hashes, s.blocks, s.computed)
            assert req.num_computed_tokens == s.computed
            checked_loads += len(s.blocks)
            s.phase = "run"
        elif s.phase == "run":
            known = len(s.tokens)
            if s.computed < known:
                k = rng.randint(1, known - s.computed)
                need = -(-(s.computed + k) // bs) - len(s.blocks)
                new = eng.alloc(need) if need > 0 else []
                if new is None:
                    start(s, req.preempt())
                    s.phase = "preempt-wait"
                    continue
                s.blocks += new
                s.hashes = running_hashes(s.tokens)
                eng.compute(s.tokens, s.hashes, s.blocks, s.computed, s.computed + k)
                s.computed += k
                sampled: tuple[int, ...] = ()
                if s.computed == known and s.decode_budget > 0:
                    s.decode_budget -= 1
                    sampled = (rng.randrange(40),)
                    s.tokens.append(sampled[0])
                req.step(s.computed, new_token_ids=sampled, new_block_ids=new)
                if not sampled and s.computed == known:
                    s.phase = "end"
            elif rng.random() < 0.5:
                s.phase = "end"
            if s.phase == "end" or rng.random() < 0.08:
                kind = s.end if s.phase == "end" else rng.choice(["preempt", "abort", "finish"])
                if kind == "preempt" and s.phase == "end":
                    kind = "finish"  # a preempted request resumes; make sure it ends eventually
                start(s, getattr(req, kind)())
                s.phase = f"{kind}-wait"
        elif s.phase in ("finish-wait", "abort-wait", "preempt-wait"):
            eng.release(s.blocks)  # poison: the engine reuses them the instant the call resolved
            s.blocks = []
            if s.phase == "preempt-wait":
                s.computed = 0
                s.phase = "lookup"
                continue
            if s.phase == "finish-wait":
                finished.append((list(s.tokens), s.computed))
            active.remove(s)
            if queue:
                nxt = queue.pop(0)
                nxt.req = off.open(nxt.rid, nxt.tokens)
                active.append(nxt)
    return checked_loads
