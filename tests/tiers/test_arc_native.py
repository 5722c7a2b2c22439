"""``BlockIndex.insert_chain`` / ``touch_prefix`` with ARC: the C loops (aiokv/_native/_arc.c, reached through
``_index._FAST_PATHS``) held to the generic Python loops over ``ARCPolicy``'s methods (the definition).

Hypothesis drives random operation sequences through two worlds built alike, one calling the C loops and one
with ``_index._FAST_PATHS`` emptied around each of its calls: chains that share prefixes, walks from any start,
re-stores of present keys (T1 -> T2 promotions), re-stores of evicted keys (ghost hits that move ``p``),
degenerate chains whose keys repeat, capacities from 1 slot, a policy capacity that differs from the slot count
(ghost trimming at its bounds, and the KeyError of a trim with nothing left to drop), ``on_evict`` on and off,
and the offloader's own operations mixed in (reserve/commit, pins, discards). Each world has its own key objects
(bytes, big ints, tuples, NaN floats: any hashable key), so after every operation both must have the same
return value or exception, the same index state and counters, the same T1/T2/B1/B2 (and open runs, last keys),
the same ``p`` to the bit, and the same reference count on every key (no leak, no early release).
"""

from __future__ import annotations

import math
import random
import sys
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aiokv.tiers import _index
from aiokv.tiers._index import BlockIndex
from aiokv.tiers._policies import ARCPolicy

_arc = pytest.importorskip("aiokv._native._arc", reason="aiokv._native._arc is not built")

pytestmark = pytest.mark.skipif(
    ARCPolicy not in _index._FAST_PATHS, reason="the native fast paths are off (AIOKV_NATIVE_LRU=0)"
)


def _python(fn: Callable[..., Any], *args: Any) -> Any:
    """Call ``fn`` with the C loops hidden: the generic Python loops run."""
    saved = _index._FAST_PATHS
    _index._FAST_PATHS = {}
    try:
        return fn(*args)
    finally:
        _index._FAST_PATHS = saved


def _outcome(fn: Callable[..., Any], *args: Any) -> tuple[str, Any]:
    try:
        return "ok", fn(*args)
    except Exception as exc:  # compared between the worlds
        return type(exc).__name__, exc.args


class World:
    """One index and its own key objects: logical key (an int) -> an object of the chosen kind, made fresh."""

    def __init__(self, slots: int, capacity: int, kind: str, on_evict: bool) -> None:
        self.index = BlockIndex(slots, ARCPolicy(capacity))
        if on_evict:
            self.index.on_evict = []
        self.kind = kind
        self.objs: dict[int, Any] = {}
        self.label: dict[int, int] = {}  # id(object) -> logical key

    def key(self, n: int) -> Any:
        obj = self.objs.get(n)
        if obj is None:
            kind = self.kind if self.kind != "mixed" else ("bytes", "int", "tuple", "nan")[n % 4]
            if kind == "bytes":
                obj = bytes(bytearray(b"blk-%03d" % n))  # a new object, never a shared constant
            elif kind == "int":
                obj = 10**12 + n
            elif kind == "tuple":
                obj = tuple(["t", n * 1000 + 1001])
            else:
                obj = float("nan")  # equal to nothing, itself included: only identity finds it
            self.objs[n] = obj
            self.label[id(obj)] = n
        return obj

    def chain(self, logical: list[int], as_tuple: bool) -> Any:
        keys = [self.key(n) for n in logical]
        return tuple(keys) if as_tuple else keys

    def lab(self, x: Any) -> Any:
        if x is None or isinstance(x, (bool, str)):
            return x
        n = self.label.get(id(x))
        return ("key", n) if n is not None else ("other", x)

    def labels(self, xs: Any) -> list[Any]:
        return [self.lab(x) for x in xs]

    def outcome(self, out: tuple[str, Any]) -> tuple[str, Any]:
        kind, val = out
        if kind == "KeyError":
            return kind, self.labels(val)
        return kind, val

    def snapshot(self) -> tuple[Any, ...]:
        ix = self.index
        pol: ARCPolicy = ix.policy  # type: ignore[assignment]
        lists = []
        for rl in (pol._t1, pol._t2):
            lists.append(
                (
                    [(self.lab(k), self.lab(v)) for k, v in rl._order.items()],
                    self.labels(rl._run),
                    self.lab(rl._last),
                    self.labels(rl),
                )
            )
        return (
            type(pol.p),
            float(pol.p).hex(),
            self.labels(pol.t1()),
            self.labels(pol.t2()),
            self.labels(pol.b1()),
            self.labels(pol.b2()),
            lists,
            sorted((self.lab(k), v) for k, v in ix._slots.items()),
            bytes(ix._state),
            list(ix._free),
            self.labels(ix._keys),
            self.labels(ix._parent),
            list(ix._depth),
            None if ix.on_evict is None else self.labels(ix.on_evict),
            ix.stats(),
            self.labels(ix.policy.candidates()),
        )

    def refcounts(self) -> list[int]:
        return [sys.getrefcount(self.objs[n]) for n in sorted(self.objs)]


@st.composite
def chains(draw: Any) -> list[int]:
    """A chain of logical keys: a shared trunk's first blocks then its own blocks; or a degenerate one over a
    few keys that may repeat (keys that become each other's parent, a key met again in the open run)."""
    if draw(st.integers(0, 3)) == 0:
        return draw(st.lists(st.sampled_from([900, 901, 902, 903]), max_size=8))
    trunk = draw(st.integers(0, 3))
    shared = draw(st.integers(0, 6))
    own = draw(st.integers(0, 6))
    tail = 100 + 10 * draw(st.integers(0, 14))
    return [trunk * 10 + i for i in range(shared)] + [tail + i for i in range(own)]


OPS = ["replay", "replay", "replay", "replay", "touch", "insert", "reserve", "pin", "unpin", "discard"]


@settings(deadline=None, max_examples=200, suppress_health_check=[HealthCheck.too_slow])
@given(
    data=st.data(),
    slots=st.integers(1, 20),
    as_tuple=st.booleans(),
    on_evict=st.booleans(),
    kind=st.sampled_from(["bytes", "bytes", "bytes", "int", "tuple", "nan", "mixed"]),
    capacity=st.one_of(st.none(), st.integers(1, 20)),
)
def test_the_c_loops_and_the_python_loops_agree(
    data: st.DataObject, slots: int, as_tuple: bool, on_evict: bool, kind: str, capacity: int | None
) -> None:
    cap = slots if capacity is None else capacity
    cw = World(slots, cap, kind, on_evict)
    pw = World(slots, cap, kind, on_evict)
    pinned: list[int] = []
    pending: list[int] = []
    errors = 0  # operations that raised (in both worlds alike): the structures may be left out of step

    def both(method: str, logical: list[int], *args: Any) -> Any:
        c_out = _outcome(getattr(cw.index, method), cw.chain(logical, as_tuple), *args)
        p_out = _python(_outcome, getattr(pw.index, method), pw.chain(logical, as_tuple), *args)
        c_lab, p_lab = cw.outcome(c_out), pw.outcome(p_out)
        del c_out, p_out
        assert c_lab == p_lab
        nonlocal errors
        errors += c_lab[0] != "ok"
        return c_lab

    for _ in range(data.draw(st.integers(1, 40), label="ops")):
        chain = data.draw(chains())
        op = data.draw(st.sampled_from(OPS))
        if op == "replay":  # aiokv replay's step: the leading run, then store the rest
            kind_, hit = both("touch_prefix", chain, 0)
            if kind_ == "ok":
                both("insert_chain", chain, hit)
        elif op in ("touch", "insert"):
            start = data.draw(st.integers(0, len(chain)))
            both("touch_prefix" if op == "touch" else "insert_chain", chain, start)
        elif op == "reserve":  # the offloader's store: reserve head first; commit some now, the rest later
            for i, n in enumerate(chain):
                got = [
                    w.outcome(_outcome(w.index.reserve, w.key(n), w.key(chain[i - 1]) if i else None, i))
                    for w in (cw, pw)
                ]
                assert got[0] == got[1]
                errors += got[0][0] != "ok"
                if got[0] == ("ok", None) or got[0][0] != "ok":
                    continue
                pending.append(n)
            for n in pending[: data.draw(st.integers(0, len(pending)))]:
                got = [w.outcome(_outcome(w.index.commit, w.key(n))) for w in (cw, pw)]
                assert got[0] == got[1]
                errors += got[0][0] != "ok"
            pending = [n for n in pending if cw.index.state(cw.key(n)) is _index.EntryState.PENDING]
        elif op == "pin":  # pinned keys send insert_chain to its general path; touch_prefix stays in C
            got = [w.outcome(_outcome(w.index.pin_prefix, w.chain(chain, as_tuple))) for w in (cw, pw)]
            assert got[0] == got[1]
            if got[0][0] == "ok":
                pinned.extend(chain[: len(got[0][1])])
        elif op == "unpin" and pinned:
            k = data.draw(st.integers(1, len(pinned)))
            for w in (cw, pw):
                w.index.unpin([w.key(n) for n in pinned[:k]])
            del pinned[:k]
        elif (
            op == "discard"
        ):  # a failed copy (pending) or a corrupt read (ready): any unpinned key of the chain
            for n in chain[: data.draw(st.integers(0, len(chain)))]:
                if cw.index.pins(cw.key(n)) == 0:
                    got = [w.outcome(_outcome(w.index.discard, w.key(n))) for w in (cw, pw)]
                    assert got[0] == got[1]
                    errors += got[0][0] != "ok"
            pending = [n for n in pending if cw.index.state(cw.key(n)) is _index.EntryState.PENDING]
        assert cw.snapshot() == pw.snapshot()
        assert cw.refcounts() == pw.refcounts()
        if not errors and kind not in ("nan", "mixed"):  # NaN keys are not equal to themselves
            cw.index.check_invariants()


# ------------------------------------------------------------------------------------------ fixed cases
def _pair(slots: int, capacity: int | None = None) -> tuple[World, World]:
    cap = slots if capacity is None else capacity
    return World(slots, cap, "bytes", True), World(slots, cap, "bytes", True)


def _replay(w: World, logical: list[int], python: bool) -> tuple[int, int]:
    keys = w.chain(logical, False)
    call = _python if python else (lambda fn, *a: fn(*a))
    hit = call(w.index.touch_prefix, keys, 0)
    return hit, call(w.index.insert_chain, keys, hit)


def test_the_fast_path_is_taken() -> None:
    assert _index._FAST_PATHS[ARCPolicy] == (_arc.touch_prefix, _arc.insert_chain)
    w = World(4, 4, "bytes", False)
    keys = w.chain([1, 2, 3], False)
    pol = w.index.policy
    assert _arc.insert_chain(w.index, pol, keys, 0) == (3, 0, 0)  # done in C, not handed back (None)
    assert _arc.touch_prefix(w.index, pol, keys, 0) == 3
    assert w.labels(pol.t2()) == [("key", 3), ("key", 2), ("key", 1)]


def test_ghost_hits_move_p_like_python() -> None:
    cw, pw = _pair(4)
    rng = random.Random(5)
    ups = downs = 0
    for _ in range(400):
        first = rng.randrange(12)
        logical = [first + 100 * i for i in range(rng.randrange(1, 4))]
        p0 = cw.index.policy.p  # type: ignore[attr-defined]
        assert _replay(cw, logical, False) == _replay(pw, logical, True)
        assert cw.snapshot() == pw.snapshot()
        ups += cw.index.policy.p > p0  # type: ignore[attr-defined]
        downs += cw.index.policy.p < p0  # type: ignore[attr-defined]
    assert ups
    assert downs


def test_p_keeps_python_float_arithmetic() -> None:
    # len(b2) / len(b1) with a non-terminating binary fraction, added to a p that is not a whole number
    cw, pw = _pair(8, 20)
    for w in (cw, pw):
        pol = w.index.policy
        pol.p = 0.1  # type: ignore[attr-defined]
        for n in range(30, 33):
            pol._b1[w.key(n)] = None  # type: ignore[attr-defined]
        for n in range(40, 47):
            pol._b2[w.key(n)] = None  # type: ignore[attr-defined]
    assert _replay(cw, [30, 41], False) == _replay(pw, [30, 41], True)
    assert cw.index.policy.p == 0.1 + 7 / 3 - 1.0  # type: ignore[attr-defined]  # then max(2 / 7, 1.0)
    assert cw.snapshot() == pw.snapshot()


def test_a_state_it_does_not_cover_is_handed_back_unchanged() -> None:
    w = World(4, 4, "bytes", False)
    keys = w.chain([1, 2], False)
    pol = w.index.policy
    pol.p = 0  # type: ignore[attr-defined]  # an int: the Python loop handles it
    before = w.snapshot()
    assert _arc.insert_chain(w.index, pol, keys, 0) is None
    assert _arc.touch_prefix(w.index, pol, keys, 0) is None
    assert _arc.insert_chain(w.index, pol, keys, 5) is None  # keys[start - 1] raises in the Python loop
    assert _arc.insert_chain(w.index, pol, keys, -1) is None
    assert w.snapshot() == before
    assert w.index.insert_chain(keys) == 2  # through the Python loop
    assert pol.p == 0


def test_trimming_past_empty_ghosts_raises_like_python() -> None:
    # capacity 1 over 4 slots: T1 + T2 exceed 2 * capacity with no ghost left to drop -> KeyError
    cw, pw = _pair(4, 1)
    c_out = cw.outcome(_outcome(cw.index.insert_chain, cw.chain([1, 2, 3], False)))
    p_out = pw.outcome(_python(_outcome, pw.index.insert_chain, pw.chain([1, 2, 3], False)))
    assert c_out == p_out
    assert c_out[0] == "KeyError"
    assert cw.snapshot() == pw.snapshot()


def test_a_victim_missing_from_the_index_raises_key_error() -> None:
    cw, pw = _pair(2)
    for w in (cw, pw):
        w.index.insert_chain(w.chain([1, 2], False))
        del w.index._slots[w.key(2)]  # corrupt: the policy's T1 tail is no longer in the index
        w.index._free.append(1)
        w.index._free.append(5)  # and a slot out of range
    c_out = cw.outcome(_outcome(cw.index.insert_chain, cw.chain([3, 4, 5], False)))
    p_out = pw.outcome(_python(_outcome, pw.index.insert_chain, pw.chain([3, 4, 5], False)))
    assert c_out == p_out
    assert cw.snapshot() == pw.snapshot()
    for w in (cw, pw):
        w.index._free = type(w.index._free)("I")
    c_out = cw.outcome(_outcome(cw.index.insert_chain, cw.chain([6, 7], False)))
    p_out = pw.outcome(_python(_outcome, pw.index.insert_chain, pw.chain([6, 7], False)))
    assert c_out == p_out
    assert cw.snapshot() == pw.snapshot()


def test_unhashable_and_odd_keys() -> None:
    for bad in ([1, 2], {"a": 1}):
        cw, pw = _pair(3)
        for w in (cw, pw):
            w.index.insert_chain(w.chain([1, 2], False))
        c = [*cw.chain([1, 2], False), bad]
        p = [*pw.chain([1, 2], False), bad]
        for method in ("touch_prefix", "insert_chain"):
            c_out = _outcome(getattr(cw.index, method), c)
            p_out = _python(_outcome, getattr(pw.index, method), p)
            assert c_out == p_out
            assert c_out[0] == "TypeError"
            assert cw.snapshot() == pw.snapshot()


def test_a_corrupt_slot_value_behaves_like_python() -> None:
    for slot_value in (-1, 99, "x", None, True):
        cw, pw = _pair(3)
        for w in (cw, pw):
            w.index.insert_chain(w.chain([1, 2], False))
            w.index._slots[w.key(2)] = slot_value  # type: ignore[assignment]
        for method in ("touch_prefix", "insert_chain"):
            c_out = cw.outcome(_outcome(getattr(cw.index, method), cw.chain([1, 2, 3], False)))
            p_out = pw.outcome(_python(_outcome, getattr(pw.index, method), pw.chain([1, 2, 3], False)))
            assert c_out == p_out
            assert cw.snapshot() == pw.snapshot()


def test_keys_dropped_by_the_caller_stay_alive_while_held() -> None:
    # every key object is referenced only by the list handed in (and then by the index and policy): the C loop
    # must own what it holds across mutations, and release all of it
    ix = BlockIndex(3, ARCPolicy(3))
    ix.on_evict = []
    for r in range(200):
        keys = [bytes(bytearray(b"r%d-%d" % (r % 13, i))) for i in range(r % 5 + 1)]
        hit = ix.touch_prefix(keys, 0)
        ix.insert_chain(keys, hit)
        del keys
        ix.on_evict.clear()
    ix.check_invariants()
    pol: ARCPolicy = ix.policy  # type: ignore[assignment]
    for k in pol.t1() + pol.t2() + pol.b1() + pol.b2():
        assert isinstance(k, bytes)
    assert not math.isnan(pol.p)
