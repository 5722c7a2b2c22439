"""The tick's decode stores have one definition, the Python loop of ``Offloader._flush_deferred``; its C loop
(``flush_plain`` in aiokv/_native/_step.c, with ``track`` for the in-flight sets) and the C commit of a
completed store (``commit_run`` in aiokv/_native/_lru.c) are held to it here.

Hypothesis draws a schedule (several requests decoding into a CPU tier too small for all of them, some busy
with a lookup, some capped, aborted, finished or preempted mid-tick, with tenants and priorities) and runs it
twice: with the C paths, and with them switched off. After every tick both runs must agree on everything an
observer can see: the index (keys, slots, states, parents, depths, priorities, the pending count), the LRU
order, the counters, each request's in-flight copies; at the end the bytes of every stored block, checked
against what the engine computed.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import aiokv._offloader as offloader_module
import aiokv.tiers._index as index_module
from aiokv import CPUTier, Offloader
from aiokv.transfer._cpu import CPUStream

from ._sim import SimEngine, running_hashes

BS = 4
NB = 96
SLOTS = 20  # fewer CPU slots than the blocks the requests complete: eviction and "no room" happen


def _natives() -> tuple[Any, Any, Any]:
    return offloader_module._flush_plain, offloader_module._track_all, index_module._native_commit


pytestmark = pytest.mark.skipif(
    any(f is None for f in _natives()), reason="the native flush and commit are not built (or are off)"
)


def _inline_submit(self: Any, jobs: list[Any]) -> None:
    """CPUStream.submit, run at once on the loop thread and completed by the loop's next callbacks: the copies
    keep their order and the run is deterministic (no worker thread decides when a copy ends)."""
    try:
        self._run_batch(jobs)
    except BaseException as exc:
        for job in jobs:
            job._error = exc
    self._loop.call_soon(self._complete, jobs)


def _index_state(off: Offloader) -> tuple[Any, ...]:
    index = off._store.index
    return (
        dict(index._slots),
        bytes(index._state),
        list(index._keys),
        list(index._parent),
        list(index._depth),
        list(index._prio),
        index._pending,
        list(index._free),
        list(index.policy.candidates()),
        index._evictions,
        index._rejected,
    )


def _counters(off: Offloader) -> tuple[Any, ...]:
    s = off.stats()
    return (
        s.blocks_stored,
        s.stores_deduplicated,
        s.stores_dropped,
        s.store_errors,
        s.in_flight,
        s.errors,
        off._counters.stores_invalidated,
    )


@st.composite
def schedules(draw: Any) -> dict[str, Any]:
    n_req = draw(st.integers(1, 5))
    prompts = [draw(st.lists(st.integers(0, 5), min_size=BS, max_size=3 * BS)) for _ in range(n_req)]
    # Shared prefixes: a block another request stored is present (the C loop leaves it to Python).
    for i in range(1, n_req):
        if draw(st.booleans()):
            prompts[i] = prompts[0][:BS] + prompts[i]
    opts = [
        {
            "max_store_tokens": draw(st.sampled_from([None, None, None, 2 * BS, 5 * BS])),
            "salt": draw(st.sampled_from([None, None, "tenant-1"])),
            "priority": draw(st.sampled_from([0, 0, 5, -3])),
        }
        for _ in range(n_req)
    ]
    ticks = []
    for _ in range(draw(st.integers(1, 14))):
        ops = draw(
            st.lists(
                st.tuples(
                    st.sampled_from(["step"] * 10 + ["lookup", "abort", "finish", "preempt"]),
                    st.integers(0, n_req - 1),
                    st.integers(0, 5),
                ),
                max_size=12,
            )
        )
        ticks.append(ops)
    eviction = draw(st.sampled_from(["lru", "lru", "arc", "session"]))
    # Twins: the same prompt and the same generated tokens, so a decode block another request stored is
    # present when it completes (the C loop must leave it to the Python one, which touches it).
    twins = draw(st.booleans())
    if twins:
        prompts = [list(prompts[0]) for _ in prompts]
        for o in opts:
            o["salt"] = None
    return {"prompts": prompts, "opts": opts, "ticks": ticks, "eviction": eviction, "twins": twins}


async def _run(schedule: dict[str, Any]) -> list[Any]:
    """Run the schedule; returns what an observer sees after every tick and, at the end, the stored bytes."""
    eng = SimEngine(num_blocks=NB, block_size=BS)
    seen: list[Any] = []
    tier = CPUTier(capacity_bytes=SLOTS * eng.layout.slot_bytes, eviction=schedule["eviction"])
    async with Offloader(eng.layout, [tier]) as off:
        reqs: list[Any] = []
        tokens: list[list[int]] = []
        blocks: list[list[int]] = []
        for i, (prompt, opts) in enumerate(zip(schedule["prompts"], schedule["opts"], strict=True)):
            reqs.append(off.open(f"r{i}", prompt, **opts))
            tokens.append(list(prompt))
            blocks.append([])
        pending: list[Any] = []
        ended: set[int] = set()
        looked = [False] * len(reqs)
        for ops in schedule["ticks"]:
            for op, i, tok in ops:
                r = reqs[i]
                if i in ended:
                    continue
                if op == "step":
                    toks = tokens[i]
                    n = r.num_computed_tokens
                    new_toks: list[int] = []
                    if n >= len(toks):  # decode: the next token
                        if schedule["twins"]:
                            tok = len(toks) % 3
                        toks.append(tok)
                        new_toks = [tok]
                    n = len(toks) if n == 0 else n + 1  # the prefill, then one token a step
                    need = -(-n // BS) - len(blocks[i])
                    ids = eng.alloc(need) if need > 0 else []
                    if ids is None:
                        continue
                    blocks[i] += ids
                    eng.compute(toks, running_hashes(toks), blocks[i], r.num_computed_tokens, n)
                    r.step(n, new_token_ids=new_toks, new_block_ids=ids)
                elif op == "lookup":  # the request's task gets an event: its stores go through it
                    if r.state.value == "waiting" and not looked[i]:
                        looked[i] = True
                        pending.append(asyncio.ensure_future(r.lookup()))
                else:  # the request ends (preempted requests are not resumed here)
                    ended.add(i)
                    pending.append(asyncio.ensure_future(getattr(r, op)()))
            await asyncio.sleep(0)  # the tick ends: the flush runs
            seen.append(
                (
                    _index_state(off),
                    _counters(off),
                    [(r.state, r._stored_upto, len(r._in_flight), len(r._hashes)) for r in reqs],
                )
            )
        await asyncio.gather(*pending, return_exceptions=True)
        for i, r in enumerate(reqs):
            if i not in ended:
                await r.finish()
        await off.executor.drain()
        seen.append((_index_state(off), _counters(off)))
        # Every stored block holds the KV of its prefix: a slot is the block's tensors one after another.
        index = off._store.index
        sb = eng.layout.slot_bytes
        stored = {}
        for i, r in enumerate(reqs):
            hashes = running_hashes(tokens[i])
            for b, key in enumerate(r._hashes):
                slot = index._slots.get(key)
                if slot is None or index._state[slot] != 2 or (b + 1) * BS > len(tokens[i]):
                    continue
                raw = tier._buffer[slot * sb : (slot + 1) * sb].clone()
                got = raw.view(torch.float32).view(len(eng.tensors), BS, -1)
                for j in range(len(eng.tensors)):
                    want = torch.tensor(hashes[b * BS : (b + 1) * BS]) + j
                    assert torch.equal(got[j, :, 0], want), f"request {i} block {b}: stored KV is another's"
                stored[key] = (slot, bytes(raw.numpy()))
        seen.append(stored)
    return seen


def _first_difference(a: Any, b: Any, path: str = "") -> str:
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            if x != y:
                return _first_difference(x, y, f"{path}[{i}]")
    return f"at {path}: {a!r} != {b!r}"[:2000]


@settings(deadline=None, max_examples=60, suppress_health_check=[HealthCheck.too_slow])
@given(schedule=schedules())
def test_the_c_flush_and_commit_agree_with_the_python_loops(schedule: dict[str, Any]) -> None:
    with pytest.MonkeyPatch.context() as m:
        m.setattr(CPUStream, "submit", _inline_submit)
        with_c = asyncio.run(_run(schedule))
        m.setattr(offloader_module, "_flush_plain", None)
        m.setattr(offloader_module, "_track_all", None)
        m.setattr(index_module, "_native_commit", None)
        python = asyncio.run(_run(schedule))
    assert len(with_c) == len(python)
    for tick, (a, b) in enumerate(zip(with_c, python, strict=True)):
        assert a == b, f"tick {tick}: the C and Python paths disagree: {_first_difference(a, b)}"


def test_the_c_flush_takes_the_decode_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    """The decode blocks of idle requests go through the C loop (else the comparison above would compare the
    Python loop with itself): counted by wrapping it."""
    taken = [0]
    native = offloader_module._flush_plain
    assert native is not None

    def counting(*args: Any) -> tuple[int, int]:
        i, reserved = native(*args)
        taken[0] += reserved
        return i, reserved

    monkeypatch.setattr(offloader_module, "_flush_plain", counting)

    async def main() -> int:
        eng = SimEngine(num_blocks=NB, block_size=BS)
        async with Offloader(eng.layout, [CPUTier(capacity_bytes=NB * eng.layout.slot_bytes)]) as off:
            reqs = [off.open(f"r{i}", [i] * BS) for i in range(4)]
            toks = [[i] * BS for i in range(4)]
            tables: list[list[int]] = []
            for i, r in enumerate(reqs):
                ids = eng.alloc(1)
                assert ids is not None
                tables.append(ids)
                eng.compute(toks[i], running_hashes(toks[i]), ids, 0, BS)
                r.step(BS, (), ids)
            await asyncio.sleep(0)
            await off.executor.drain()
            for _ in range(2 * BS):
                for i, r in enumerate(reqs):
                    n = len(toks[i])
                    toks[i].append(1)
                    ids = eng.alloc(1) if n >= len(tables[i]) * BS else []
                    assert ids is not None
                    tables[i] += ids
                    eng.compute(toks[i], running_hashes(toks[i]), tables[i], n, n + 1)
                    r.step(n + 1, new_token_ids=[1], new_block_ids=ids)
                await asyncio.sleep(0)
            await off.executor.drain()
            for r in reqs:
                await r.finish()
            return off.stats().blocks_stored

    stored = asyncio.run(main())
    assert taken[0] == 4 * 2  # every decode block (two per request) by the C loop
    assert stored == 4 * 3


def test_track_prunes_a_grown_in_flight_set_as_the_method_does() -> None:
    """``track`` adds the copy to each request's in-flight set, and a set of 16 goes to Request._track, which
    first drops the completed copies (the set stays small over a long decode)."""
    track = offloader_module._track_all
    assert track is not None

    class Done:
        def done(self) -> bool:
            return True

    async def main() -> None:
        eng = SimEngine(num_blocks=NB, block_size=BS)
        async with Offloader(eng.layout, [CPUTier(capacity_bytes=NB * eng.layout.slot_bytes)]) as off:
            small, grown = off.open("a", [1] * BS), off.open("b", [2] * BS)
            small._in_flight = {Done() for _ in range(15)}
            grown._in_flight = {Done() for _ in range(16)}
            tf = Done()
            track([small, grown], tf)
            assert len(small._in_flight) == 16
            assert tf in small._in_flight
            assert grown._in_flight == {tf}
            small._in_flight, grown._in_flight = set(), set()
            await small.abort()
            await grown.abort()

    asyncio.run(main())
