"""BlockIndex.first_not_pending_or_repeated: a completed copy's keys must be distinct pending reservations.
The C scan (aiokv/_native/_lru.c) against the Python definition, on random mixes of pending, ready, absent
and repeated keys; and the scan leaves every entry's state as it found it."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aiokv.tiers import _index as index_mod
from aiokv.tiers._index import BlockIndex
from aiokv.tiers._policies import make_policy


def python_definition(index: BlockIndex, keys: list[bytes]) -> bytes | None:
    key = index.first_not_pending(keys)
    if key is None and len(keys) > 1 and len(set(keys)) < len(keys):
        key = next(k for i, k in enumerate(keys) if k in keys[:i])
    return key


def make_index(n_pending: int, n_ready: int) -> tuple[BlockIndex, list[bytes], list[bytes]]:
    index = BlockIndex(n_pending + n_ready + 1, make_policy("lru", n_pending + n_ready + 1))
    pending = [b"p%d" % i for i in range(n_pending)]
    ready = [b"r%d" % i for i in range(n_ready)]
    for key in pending + ready:
        assert index.reserve(key) is not None
    for key in ready:
        index.commit(key)
    return index, pending, ready


@pytest.mark.skipif(
    index_mod._native_first_not_pending is None,
    reason="aiokv._native._lru is not built (or AIOKV_NATIVE_LRU=0)",
)
@settings(max_examples=300, deadline=None)
@given(
    st.integers(0, 40),
    st.integers(0, 5),
    st.data(),
)
def test_the_c_scan_names_the_same_key_as_the_python_definition(
    n_pending: int, n_ready: int, data: st.DataObject
) -> None:
    index, pending, ready = make_index(n_pending, n_ready)
    pool = pending + ready + [b"absent"]
    if data.draw(st.booleans()) and pending:  # mostly distinct pending keys, the common case
        keys = data.draw(st.permutations(pending))
        if data.draw(st.booleans()):
            at = data.draw(st.integers(0, len(keys)))
            keys = [*keys[:at], data.draw(st.sampled_from(pool)), *keys[at:]]
    else:
        keys = data.draw(st.lists(st.sampled_from(pool), max_size=300))
    states = bytes(index._state)
    for seq in (list(keys), tuple(keys)):
        assert index.first_not_pending_or_repeated(seq) == python_definition(index, list(keys))
        assert bytes(index._state) == states  # the marks of the repeat scan are all restored
    index.check_invariants()


def test_without_the_extension_the_python_definition_answers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(index_mod, "_native_first_not_pending", None)
    index, pending, ready = make_index(3, 1)
    assert index.first_not_pending_or_repeated(pending) is None
    assert index.first_not_pending_or_repeated([*pending, pending[1]]) == pending[1]
    assert index.first_not_pending_or_repeated([pending[0], ready[0], pending[0]]) == ready[0]
    assert index.first_not_pending_or_repeated([pending[2], b"absent"]) == b"absent"


@pytest.mark.skipif(
    index_mod._native_first_not_pending is None,
    reason="aiokv._native._lru is not built (or AIOKV_NATIVE_LRU=0)",
)
def test_a_copy_of_more_keys_than_the_scans_stack_buffer() -> None:
    index, pending, _ = make_index(600, 0)
    states = bytes(index._state)
    assert index.first_not_pending_or_repeated(pending) is None
    assert index.first_not_pending_or_repeated([*pending, pending[299]]) == pending[299]
    assert index.first_not_pending_or_repeated([*pending[:400], b"absent", pending[0]]) == b"absent"
    assert bytes(index._state) == states


@pytest.mark.skipif(
    index_mod._native_first_not_pending is None,
    reason="aiokv._native._lru is not built (or AIOKV_NATIVE_LRU=0)",
)
def test_keys_whose_hash_changes_the_list_or_the_index_are_refused_not_read_out_of_bounds() -> None:
    """The scan may run Python code (a key's hash): a list shrunk under it is a RuntimeError, an index whose
    state shrank under it names the moved key as not pending; nothing is read past either."""
    index, pending, _ = make_index(4, 0)
    keys: list[bytes] = []

    class Shrinks(bytes):
        def __hash__(self) -> int:
            del keys[1:]
            return bytes.__hash__(self)

    keys.extend([pending[0], Shrinks(pending[1]), pending[2], pending[3]])
    with pytest.raises(RuntimeError, match="keys changed size"):
        index.first_not_pending_or_repeated(keys)

    class Truncates(bytes):
        def __hash__(self) -> int:
            del index._state[1:]
            return bytes.__hash__(self)

    index, pending, _ = make_index(4, 0)
    keys = [pending[3], Truncates(pending[0])]
    assert index.first_not_pending_or_repeated(keys) == pending[3]
