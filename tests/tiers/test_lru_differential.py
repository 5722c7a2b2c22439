"""``BlockIndex.insert_chain`` / ``touch_prefix`` with LRU: the C loops (aiokv/_native/_lru.c) held to the
Python loops (``_insert_chain_lru`` / ``_touch_prefix_lru``, the definition).

Hypothesis drives random operation sequences through two indexes built alike, one calling the C loops and one
with them hidden (``_index._native_lru`` set to ``None`` around each of its calls): chains that share prefixes,
walks from any start, re-stores of present keys, degenerate chains whose keys repeat (a touch that meets
its key in the open run), capacities from 1 slot, and
the offloader's own operations mixed in (reserve/commit, pins, discards: pins send ``insert_chain`` to its
general path, and the hand-over back must leave both alike). After every operation: the same return value,
the same evicted keys in order, the same recency order (and the open run), the same slots, states and stats.
tests/tiers/test_index_fastpath.py holds both to a list-based reference as well.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aiokv.tiers import _index
from aiokv.tiers._index import BlockIndex
from aiokv.tiers._policies import make_policy

pytestmark = pytest.mark.skipif(_index._native_lru is None, reason="aiokv._native._lru is not built")


def _python(index: BlockIndex, method: str, *args: Any) -> Any:
    """Call ``method`` with the C loops hidden: the Python definition runs."""
    saved = _index._native_lru
    _index._native_lru = None
    try:
        return getattr(index, method)(*args)
    finally:
        _index._native_lru = saved


def _snapshot(index: BlockIndex) -> tuple[Any, ...]:
    index.check_invariants()
    lst = index.policy._list  # type: ignore[attr-defined]
    return (
        list(index.policy.candidates()),
        list(lst._order.items()),
        list(lst._run),
        lst._last,
        dict(index._slots),
        bytes(index._state),
        list(index._free),
        list(index._keys),
        list(index._parent),
        list(index._depth),
        list(index.on_evict or ()),
        index.stats(),
    )


def _keys(prefix: int, n: int) -> list[bytes]:
    return [b"c%02d-%02d" % (prefix, i) for i in range(n)]


@st.composite
def chains(draw: Any) -> list[bytes]:
    """A chain: a shared trunk's first blocks (chains of one trunk share a prefix), then its own blocks; or a
    degenerate one over a few keys that may repeat (keys that become each other's parent, a key met again in
    the open run)."""
    if draw(st.integers(0, 3)) == 0:
        return draw(st.lists(st.sampled_from([b"x", b"y", b"z", b"w"]), max_size=8))
    trunk = draw(st.integers(0, 3))
    shared = draw(st.integers(0, 6))
    own = draw(st.integers(0, 6))
    tail = _keys(10 + draw(st.integers(0, 9)), own)
    return _keys(trunk, shared) + tail


OPS = ["replay", "replay", "replay", "touch", "insert", "reserve", "pin", "unpin", "discard", "discard"]


@settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), slots=st.integers(1, 12), as_tuple=st.booleans())
def test_the_c_loops_and_the_python_loops_agree(data: st.DataObject, slots: int, as_tuple: bool) -> None:
    c_index = BlockIndex(slots, make_policy("lru", slots))
    py_index = BlockIndex(slots, make_policy("lru", slots))
    c_index.on_evict, py_index.on_evict = [], []
    pinned: list[bytes] = []
    pending: list[bytes] = []
    for _ in range(data.draw(st.integers(1, 40), label="ops")):
        chain = data.draw(chains())
        keys: Any = tuple(chain) if as_tuple else chain
        op = data.draw(st.sampled_from(OPS))
        if op == "replay":  # aiokv replay's step: the leading run, then store the rest
            hit = c_index.touch_prefix(keys)
            assert hit == _python(py_index, "touch_prefix", keys)
            assert c_index.insert_chain(keys, hit) == _python(py_index, "insert_chain", keys, hit)
        elif op in ("touch", "insert"):
            start = data.draw(st.integers(0, len(chain)))
            method = "touch_prefix" if op == "touch" else "insert_chain"
            assert getattr(c_index, method)(keys, start) == _python(py_index, method, keys, start)
        elif op == "reserve":  # the offloader's store: reserve head first; commit or discard later
            for i, key in enumerate(chain):
                parent = chain[i - 1] if i else None
                got = c_index.reserve(key, parent, i)
                assert got == py_index.reserve(key, parent, i)
                if got is not None:
                    pending.append(key)
            for key in pending[: data.draw(st.integers(0, len(pending)))]:
                c_index.commit(key)
                py_index.commit(key)
            pending = [k for k in pending if c_index.state(k) is _index.EntryState.PENDING]
        elif op == "pin":
            got = c_index.pin_prefix(chain)
            assert got == py_index.pin_prefix(chain)
            pinned.extend(chain[: len(got)])
        elif op == "unpin" and pinned:
            n = data.draw(st.integers(1, len(pinned)))
            c_index.unpin(pinned[:n])
            py_index.unpin(pinned[:n])
            del pinned[:n]
        elif (
            op == "discard"
        ):  # a failed copy (pending) or a corrupt read (ready): any unpinned key of the chain
            for key in chain[: data.draw(st.integers(0, len(chain)))]:
                if c_index.pins(key) == 0:
                    assert c_index.discard(key) == py_index.discard(key)
            pending = [k for k in pending if c_index.state(k) is _index.EntryState.PENDING]
        assert _snapshot(c_index) == _snapshot(py_index)
