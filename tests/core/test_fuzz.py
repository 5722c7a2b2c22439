"""Hypothesis fuzz of the public API: random sequences of open, lookup, load, step, finish, preempt, abort,
cancellations and shutdown-style task cancellations, with valid and invalid arguments, across requests and
tiers (a small CPU tier over a FaultyTier over a memory or disk tier, copy failures injected at random).

The engine side is a model: it allocates blocks from a pool, writes each position's KV as a pure function of
its prefix (``_sim.SimEngine``) and poisons blocks the instant an end (finish/preempt/abort) resolves. Checked
throughout: an invalid call raises an ``AiokvError`` subclass and changes nothing; a load restores what it
says it restored (0 or the expected count) and every restored position is byte-identical to a recomputation;
an end resolves only after the request's lookup or load did; the block index stays consistent and the stats
add up. Checked once every request has ended: no pin, slot reservation or copy is left, and no task either.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import aiokv
import aiokv.tiers
from aiokv import AiokvError, CPUTier, Offloader, RequestState
from aiokv.testing import FaultyTier
from aiokv.tiers import DiskTier

from ..tiers._memory import MemoryTier
from ._sim import SimEngine, running_hashes

pytestmark = pytest.mark.asyncio

BS = 4
NUM_BLOCKS = 24
BASES = [[(7 * i + j) % 50 for j in range(24)] for i in range(3)]  # shared prefixes: lookups hit


@dataclass
class _Sim:
    """The engine's view of one request."""

    rid: str
    req: aiokv.Request
    tokens: list[int]
    phase: str = "admit"  # admit, looking, looked, loading, running, limbo, dead, ending, ended
    blocks: list[int] = field(default_factory=list)  # engine blocks the request holds
    computed: int = 0
    hit: int = 0
    expect: int = 0  # tokens the load in flight restores if its copy succeeds
    lookup_blocks: int = 0  # keys the lookup in flight looks up
    task: asyncio.Future[Any] | None = None  # the lookup or load in flight
    end: str = ""
    end_task: asyncio.Future[Any] | None = None


async def _wait(aw: Any) -> Any:
    return await aw


class _Fuzz:
    def __init__(
        self, data: st.DataObject, off: Offloader, eng: SimEngine, faulty: FaultyTier | None
    ) -> None:
        self.data = data
        self.off = off
        self.eng = eng
        self.faulty = faulty
        self.sims: list[_Sim] = []
        self.opened = 0
        self.fail = {"load": 0, "store": 0}
        self.looked_up = 0  # keys of lookups whose result was observed
        self.unsure = 0  # keys of lookups cancelled (counted or not)
        ex = off.executor
        real_load, real_store = ex._copy_load, ex._copy_store

        def copy_load(a: Any, b: Any) -> None:
            if self.fail["load"]:
                self.fail["load"] -= 1
                raise OSError("injected load copy failure")
            real_load(a, b)

        def copy_store(a: Any, b: Any) -> None:
            if self.fail["store"]:
                self.fail["store"] -= 1
                raise OSError("injected store copy failure")
            real_store(a, b)

        ex._copy_load = copy_load  # type: ignore[method-assign]
        ex._copy_store = copy_store  # type: ignore[method-assign]

    def draw(self, strategy: st.SearchStrategy[Any]) -> Any:
        return self.data.draw(strategy)

    def live(self, *phases: str) -> list[_Sim]:
        return [s for s in self.sims if s.phase in phases]

    # ------------------------------------------------------------------ checks
    def invalid(self, s: _Sim, call: Any) -> None:
        """``call`` is a misuse: it raises an AiokvError subclass and leaves the request as it was."""
        r = s.req
        before = (r.state, r.num_computed_tokens, r.block_ids, len(r.token_ids))
        stats = self.off.stats()
        with pytest.raises(AiokvError):
            call()
        assert (r.state, r.num_computed_tokens, r.block_ids, len(r.token_ids)) == before
        after = self.off.stats()
        assert (after.lookups, after.blocks_stored, after.in_flight) == (
            stats.lookups,
            stats.blocks_stored,
            stats.in_flight,
        )

    def invariants(self) -> None:
        off = self.off
        off.cpu.index.check_invariants()
        log = off.event_log
        if log is not None:  # KV events: the log holds exactly what each tier's lookups can find, always
            snap = log.snapshot()
            assert set(snap.tiers["cpu"]) == set(off.cpu.index.ready_keys())
            disk = self.faulty.tier if self.faulty is not None else None
            if isinstance(disk, DiskTier) and disk._index is not None:
                assert set(snap.tiers["faulty-disk"]) == set(disk._index.ready_keys())
        s = off.stats()
        assert s.in_flight >= 0
        assert s.in_flight_bytes >= 0
        assert s.requests_opened - s.requests_finished == s.requests_open
        assert s.hit_tokens == s.hits * BS
        in_flight = sum(x.lookup_blocks for x in self.sims if x.phase == "looking")
        assert self.looked_up <= s.hits + s.misses <= self.looked_up + self.unsure + in_flight
        cpu = off.cpu.stats()
        assert cpu.ready + cpu.pending == cpu.used_slots <= cpu.num_slots
        assert cpu.pinned <= cpu.used_slots

    # -------------------------------------------------------------------- ops
    async def op_open(self) -> None:
        kind = self.draw(st.sampled_from(["ok", "ok", "ok", "empty", "duplicate", "salt"]))
        if kind == "empty":
            with pytest.raises(AiokvError):
                self.off.open("x-empty", [])
            return
        if kind == "duplicate" and self.live("admit", "running"):
            with pytest.raises(aiokv.DuplicateRequestError):
                self.off.open(self.draw(st.sampled_from(self.live("admit", "running"))).rid, [1, 2])
            return
        if kind == "salt":
            with pytest.raises(AiokvError):
                self.off.open("x-salt", [1, 2], salt=object())
            return
        base = self.draw(st.sampled_from(BASES))
        tokens = base[: self.draw(st.integers(1, len(base)))] + self.draw(
            st.lists(st.integers(0, 49), max_size=6)
        )
        rid = f"r{self.opened}"
        self.opened += 1
        self.sims.append(_Sim(rid, self.off.open(rid, tokens), tokens))

    async def op_lookup(self) -> None:
        s = self.pick("admit")
        if s is None:
            return
        s.lookup_blocks = (len(s.tokens) - 1) // BS
        s.task = asyncio.ensure_future(_wait(s.req.lookup()))
        s.phase = "looking"

    async def op_load(self) -> None:
        s = self.pick("looked")
        if s is None:
            return
        hit_blocks = -(-s.hit // BS)
        bad = self.draw(st.sampled_from(["none", "none", "too-many", "duplicate", "range", "type"]))
        if bad == "too-many":
            self.invalid(s, lambda: s.req.load(list(range(hit_blocks + 1))))
        elif bad == "duplicate" and hit_blocks >= 2:
            self.invalid(s, lambda: s.req.load([0, 0]))
        elif bad == "range":
            self.invalid(s, lambda: s.req.load([NUM_BLOCKS]))
        elif bad == "type":
            self.invalid(s, lambda: s.req.load(["0"]))
        n = min(self.draw(st.integers(0, hit_blocks)), len(self.eng.free))
        dst = self.eng.alloc(n)
        assert dst is not None
        s.blocks = dst
        s.expect = s.hit if n == hit_blocks else n * BS
        pending = s.req.load(dst)
        if n and s.req.state is RequestState.LOADING:  # not resolved yet: computing over it is refused
            self.invalid(s, lambda: s.req.step(s.expect + 1))
        s.task = asyncio.ensure_future(_wait(pending))
        s.phase = "loading"

    async def op_step(self) -> None:
        s = self.pick("running", "admit", "looked")
        if s is None:
            return
        r = s.req
        bad = self.draw(
            st.sampled_from(["none", "none", "none", "decrease", "beyond", "type", "repeat", "batch"])
        )
        if bad == "decrease" and s.computed:
            self.invalid(s, lambda: r.step(s.computed - 1))
        elif bad == "beyond":
            self.invalid(s, lambda: r.step(len(s.tokens) + 1))
        elif bad == "type":
            self.invalid(s, lambda: r.step(float(s.computed)))  # type: ignore[arg-type]
        elif bad == "repeat" and s.blocks:
            self.invalid(s, lambda: r.step(s.computed, new_block_ids=[s.blocks[0]]))
        elif bad == "batch" and s.blocks:
            self.invalid(s, lambda: self.off.step_batch([(r, s.computed, [], [s.blocks[-1]])]))
        known = len(s.tokens)
        k = self.draw(st.integers(0, known - s.computed)) if s.computed < known else 0
        end = s.computed + k
        need = -(-end // BS) - len(s.blocks) + self.draw(st.integers(0, 1))  # sometimes a lookahead block
        new = self.eng.alloc(max(0, need)) if need > 0 else []
        if new is None:
            return
        hashes = running_hashes(s.tokens)
        self.eng.compute(s.tokens, hashes, s.blocks + new, s.computed, end)
        sampled = [self.draw(st.integers(0, 49))] if end == known and self.draw(st.booleans()) else []
        if self.draw(st.booleans()):
            r.step(end, new_token_ids=sampled, new_block_ids=new)
        else:  # the per-engine-step form must behave the same
            self.off.step_batch([(r, end, sampled, new)])
        s.tokens += sampled
        s.blocks += new
        s.computed = end
        s.phase = "running"

    async def op_end(self) -> None:
        s = self.pick("running", "admit", "looked", "looking", "loading", "limbo", "dead")
        if s is None:
            return
        pending = s.phase in ("looking", "loading", "limbo", "dead")
        kind = "abort" if pending else self.draw(st.sampled_from(["finish", "finish", "preempt", "abort"]))
        s.end = kind
        s.end_task = asyncio.ensure_future(_wait(getattr(s.req, kind)()))
        if s.phase == "looking":
            self.unsure += s.lookup_blocks
        if s.phase in ("looking", "loading"):
            s.phase = "limbo"  # its lookup/load resolves before the abort does
        if s.phase != "limbo" and s.phase != "dead":
            s.phase = "ending"
        for call in (s.req.lookup, lambda: s.req.step(s.computed), s.req.finish):
            if kind != "preempt":
                self.invalid(s, call)

    async def op_cancel(self) -> None:
        s = self.pick("looking", "loading")
        if s is None or s.task is None:
            return
        s.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            result = await s.task
            await self.settled(s, result)
            return
        s.task = None
        if s.phase == "looking":
            self.unsure += s.lookup_blocks
            s.phase = "admit"
        else:
            s.phase = "limbo"  # copied or not: only an abort/preempt makes the blocks reusable

    async def op_kill(self) -> None:
        """An application's shutdown handler cancels the request's task."""
        s = self.pick("running", "admit", "looked", "looking", "loading", "limbo")
        if s is None or s.end_task is not None:
            return
        s.req._task.cancel()  # type: ignore[union-attr]
        for _ in range(100):  # scheduling points until the task has run its cancellation
            if s.req.state is RequestState.ABORTED:
                break
            await asyncio.sleep(0)
        if s.phase == "looking":
            self.unsure += s.lookup_blocks
        s.phase = "dead"
        assert s.req.state is RequestState.ABORTED
        self.invalid(s, s.req.lookup)

    async def op_settle(self) -> None:
        waiting = [s for s in self.sims if s.task is not None or s.end_task is not None]
        if not waiting:
            return
        s = self.draw(st.sampled_from(waiting))
        if s.task is not None:
            result = await s.task
            await self.settled(s, result)
        else:
            await self.end_settled(s)

    async def op_barrier(self) -> None:
        s = self.pick("running", "admit", "looked")
        if s is not None:
            await s.req.wait_processed()

    async def op_faults(self) -> None:
        what = self.draw(st.sampled_from(["load", "store", "tier"]))
        if what == "tier":
            if self.faulty is not None:
                self.faulty.enabled = not self.faulty.enabled
        else:
            self.fail[what] += 1

    async def op_flush(self) -> None:
        await self.off.flush()

    # ------------------------------------------------------------------- outcomes
    async def settled(self, s: _Sim, result: Any) -> None:
        s.task = None
        if s.phase == "looking":
            assert isinstance(result, int)
            assert 0 <= result < len(s.tokens)
            assert result % BS == 0 or self.off.store_partial_last_block
            self.looked_up += s.lookup_blocks
            s.hit = result
            s.phase = "looked"
        elif s.phase == "loading":
            assert result in (0, s.expect), (result, s.expect)
            assert s.req.num_computed_tokens == result
            if result:
                self.eng.check_tokens(running_hashes(s.tokens), s.blocks, result)  # THE data check
            s.computed = result
            s.phase = "running"
        elif s.phase in ("limbo", "dead"):
            assert isinstance(
                result, int
            )  # a lookup or load that resolves before its abort (its data unused)
        else:
            raise AssertionError(f"unexpected result in phase {s.phase}")

    async def end_settled(self, s: _Sim) -> None:
        assert s.end_task is not None
        await s.end_task
        s.end_task = None
        if s.task is not None:  # an end resolves only after the lookup/load before it
            assert s.task.done()
            with contextlib.suppress(asyncio.CancelledError):
                s.task.result()
            s.task = None
        self.eng.release(s.blocks)  # reused (poisoned) the instant the end resolved
        s.blocks = []
        s.computed = 0
        if s.end == "preempt" and s.phase == "ending":
            assert s.req.state is RequestState.PREEMPTED
            s.phase = "admit"
            return
        assert s.req.state in (RequestState.FINISHED, RequestState.ABORTED)
        s.phase = "ended"
        await s.req.abort()  # idempotent: resolves at once
        self.invalid(s, s.req.lookup)

    def pick(self, *phases: str) -> _Sim | None:
        cands = [s for s in self.live(*phases) if s.end_task is None]
        if not cands:
            return None
        return self.draw(st.sampled_from(cands))

    async def wind_down(self) -> None:
        for s in self.sims:
            if s.task is not None and s.phase in ("looking", "loading"):
                result = await s.task
                await self.settled(s, result)
        for s in self.sims:
            if s.phase not in ("ended", "ending") and s.end_task is None:
                s.end = "abort"
                s.end_task = asyncio.ensure_future(_wait(s.req.abort()))
                if s.phase != "dead":
                    s.phase = "limbo"
        for s in self.sims:
            if s.end_task is not None:
                await self.end_settled(s)
                if s.phase == "admit":  # a preempt that resolved: end it for good
                    await s.req.abort()
                    s.phase = "ended"


OPS = ["open", "lookup", "load", "step", "end", "cancel", "kill", "settle", "barrier", "faults", "flush"]
WEIGHTS = st.sampled_from(
    [op for op, w in zip(OPS, [3, 4, 4, 6, 3, 1, 1, 6, 1, 1, 1], strict=True) for _ in range(w)]
)


@settings(
    max_examples=int(os.environ.get("AIOKV_FUZZ_EXAMPLES", "25")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(data=st.data())
async def test_random_api_sequences_keep_every_invariant(data: st.DataObject) -> None:
    eng = SimEngine(num_blocks=NUM_BLOCKS, block_size=BS, num_tensors=2, width=2)
    lower_kind = data.draw(st.sampled_from(["none", "memory", "memory", "disk"]), label="lower tier")
    with tempfile.TemporaryDirectory() as tmp:
        faulty: FaultyTier | None = None
        lower: list[Any] = []
        if lower_kind != "none":
            backing = (
                MemoryTier()
                if lower_kind == "memory"
                else DiskTier(Path(tmp) / "disk", 1 << 20, io_threads=1, preallocate=False)
            )
            faulty = FaultyTier(
                backing,
                read_fail_rate=data.draw(st.sampled_from([0.0, 0.1, 0.3]), label="read_fail_rate"),
                write_fail_rate=data.draw(st.sampled_from([0.0, 0.1]), label="write_fail_rate"),
                lookup_fail_rate=data.draw(st.sampled_from([0.0, 0.1]), label="lookup_fail_rate"),
                corrupt_rate=data.draw(st.sampled_from([0.0, 0.2]), label="corrupt_rate"),
                fail_mode=data.draw(st.sampled_from(["miss", "raise"]), label="fail_mode"),
                seed=data.draw(st.integers(0, 1000), label="seed"),
            )
            lower.append(faulty)
        off = Offloader(
            eng.layout,
            tiers=[
                CPUTier(
                    capacity_bytes=data.draw(st.sampled_from([3, 6, 64]), label="slots")
                    * eng.layout.slot_bytes
                ),
                *lower,
            ],
            eviction=data.draw(st.sampled_from(aiokv.tiers.policy_names()), label="eviction"),
            store_partial_last_block=data.draw(st.booleans(), label="partial"),
            copy_threads=1,
            kv_events=data.draw(st.booleans(), label="kv_events"),
        )
        async with off:
            fuzz = _Fuzz(data, off, eng, faulty)
            await fuzz.op_open()
            for _ in range(data.draw(st.integers(5, 60), label="ops")):
                op = data.draw(WEIGHTS)
                await getattr(fuzz, f"op_{op}")()
                fuzz.invariants()
            await fuzz.wind_down()
            await off.flush()
            fuzz.invariants()
            s = off.stats()
            cpu = off.cpu.stats()
            assert (cpu.pinned, cpu.pending) == (0, 0)
            assert (s.in_flight, s.in_flight_bytes, s.write_through_in_flight_bytes) == (0, 0, 0)
            assert s.requests_open == 0
            assert s.requests_opened == s.requests_finished == fuzz.opened
            assert sorted(eng.free) == list(range(NUM_BLOCKS))  # every engine block came back
        assert not [t for t in asyncio.all_tasks() if t.get_name().startswith("aiokv-")]
