"""The C replay's entry points refuse what ``intern`` cannot have produced: ``run`` indexes its arrays by the
ids and offsets it is given without further checks, so arrays out of step with each other (an id past
``unique``, offsets past the ids, a limit missing) are refused with a ValueError naming the argument before the
loop starts; and a trace with more unique blocks than int32 ids can number is an InvalidArgumentError."""

from __future__ import annotations

import array
import re
from typing import Any

import pytest

from aiokv._errors import InvalidArgumentError
from aiokv.replay import CostModel, TierConfig, Trace, TraceRequest, _sim, replay

pytestmark = pytest.mark.skipif(
    _sim._native_replay is None, reason="the native replay is off or not built (AIOKV_NATIVE_REPLAY=0)"
)

BT = 4
REQUESTS = [TraceRequest(0.0, (b"a", b"b"), 8), TraceRequest(1.0, (b"b", b"c", b"a"), 10)]
# intern(REQUESTS): ids 0 1 | 1 2 0, offsets 0 2 5, limits 8 10, 3 unique


def i32(*values: int) -> bytes:
    return array.array("i", values).tobytes()


def i64(*values: int) -> bytes:
    return array.array("q", values).tobytes()


GOOD: dict[str, Any] = {
    "ids": i32(0, 1, 1, 2, 0),
    "offsets": i64(0, 2, 5),
    "limits": i64(8, 10),
    "unique": 3,
    "block_tokens": BT,
    "inflight": 0,
}


def run(**changes: Any) -> tuple[list[tuple[int, ...]], int]:
    """``run`` over two tiers (lru of 2 slots, session of 8) on GOOD with ``changes``."""
    a = GOOD | changes
    return _sim._native_replay.run(
        a["ids"],
        a["offsets"],
        a["limits"],
        a["unique"],
        a["block_tokens"],
        [(2, ("lru",)), (8, ("session", 8, 32, 0.25, 8.0))],
        a["inflight"],
        None,
    )


def test_the_arrays_intern_makes_are_the_ones_run_takes() -> None:
    assert _sim._native_replay.intern(REQUESTS) == (GOOD["ids"], GOOD["offsets"], GOOD["limits"], 3)
    # the second request hits "b" in the first tier (2 slots), which stores a, b, c, a and evicts twice
    assert run() == ([(1, 4, 4, 0, 2, 0), (0, 0, 3, 0, 0, 0)], 4)
    empty = _sim._native_replay.intern([])
    assert empty == (b"", i64(0), b"", 0)
    assert run(ids=empty[0], offsets=empty[1], limits=empty[2], unique=0) == ([(0,) * 6, (0,) * 6], 0)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"ids": i32(0, 1, 1, 3, 0)}, "ids must be in [0, unique) = [0, 3), got 3 at 3"),
        ({"ids": i32(-1, 1, 1, 2, 0)}, "ids must be in [0, unique) = [0, 3), got -1 at 0"),
        ({"unique": 2}, "ids must be in [0, unique) = [0, 2), got 2 at 3"),
        ({"offsets": i64(1, 2, 5)}, "offsets must start at 0, got 1"),
        ({"offsets": i64(0, 6, 5)}, "offsets must not decrease, got 5 after 6 at 2"),
        ({"offsets": i64(0, 2, 6)}, "offsets must end at the number of ids (5), got 6"),
        ({"offsets": i64(0, 2, 4)}, "offsets must end at the number of ids (5), got 4"),
        ({"offsets": b""}, "offsets must hold one int64 more than there are requests, got none"),
        ({"limits": i64(8)}, "limits must hold one int64 per request (2), got 8 bytes"),
        ({"limits": i64(8, 10, 12)}, "limits must hold one int64 per request (2), got 24 bytes"),
        (
            {"ids": i32(0, 1, 1, 2, 0) + b"\0"},
            "ids must hold int32 ids (a multiple of 4 bytes), got 21 bytes",
        ),
        (
            {"offsets": i64(0, 2, 5) + b"\0"},
            "offsets must hold int64 offsets (a multiple of 8 bytes), got 25 bytes",
        ),
        ({"limits": i64(8, 10)[:-1]}, "limits must hold int64 limits (a multiple of 8 bytes), got 15 bytes"),
        (
            {"ids": bytearray(i32(0, 1, 1, 2, 0))},
            "ids must be a read-only buffer such as bytes, got bytearray",
        ),
        (
            {"offsets": bytearray(i64(0, 2, 5))},
            "offsets must be a read-only buffer such as bytes, got bytearray",
        ),
        ({"unique": -1}, "unique must be in [0, 2147483647], got -1"),
        ({"unique": 2**31}, "unique must be in [0, 2147483647], got 2147483648"),
        ({"block_tokens": 0}, "block_tokens must be > 0, got 0"),
        ({"inflight": -1}, "inflight must be >= 0, got -1"),
    ],
)
def test_run_refuses_arrays_intern_cannot_have_made(changes: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        run(**changes)


def test_intern_numbers_at_most_max_unique_keys() -> None:
    intern = _sim._native_replay.intern
    assert _sim._native_replay.MAX_UNIQUE == _sim._NATIVE_MAX_UNIQUE == 2**31 - 1
    assert intern(REQUESTS, 3) == intern(REQUESTS)
    assert intern(REQUESTS, 2) is None  # the third key would be one too many
    assert intern(REQUESTS[:1], 2) is not None
    for bad in (-1, 2**31):
        with pytest.raises(ValueError, match=rf"^max_unique must be in \[0, 2147483647\], got {bad}$"):
            intern(REQUESTS, bad)


def test_a_trace_with_more_unique_blocks_than_int32_ids_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """A trace with more than 2**31 - 1 unique blocks made interning raise OverflowError; it is an
    InvalidArgumentError naming the limit. The limit is lowered here: such a trace does not fit in memory."""
    tiers = [TierConfig("cpu", None)]
    cost = CostModel(prefill_tokens_per_s=1000.0)
    monkeypatch.setattr(_sim, "_NATIVE_MAX_UNIQUE", 3)
    fits = replay(Trace.from_requests("fits", BT, REQUESTS), tiers, kv_bytes_per_token=1, cost=cost)
    assert fits.unique_blocks == 3
    monkeypatch.setattr(_sim, "_NATIVE_MAX_UNIQUE", 2)
    with pytest.raises(
        InvalidArgumentError, match=r"^trace 'big' must hold at most 2 unique blocks, got more$"
    ):
        replay(Trace.from_requests("big", BT, REQUESTS), tiers, kv_bytes_per_token=1, cost=cost)


@pytest.mark.parametrize("name", ["lru", "arc", "session", "adaptive"])
def test_a_policy_used_then_emptied_is_not_taken_for_a_fresh_one(name: str) -> None:
    """The C replay starts every policy from its initial state: a policy that held keys and is empty again
    (ARC's ghosts, adaptive's scores and last key, session's ghosts) goes to the Python loop instead."""
    from aiokv.tiers._policies import make_policy

    fresh = make_policy(name, 4)
    assert _sim._native_spec(fresh) is not None
    used = make_policy(name, 4)
    for i in range(6):
        used.insert(b"k%d" % i, b"k%d" % (i - 1) if i else None, i)
        used.touch(b"k%d" % i)
    for key in list(used.candidates()):
        used.remove(key, True)
    assert len(used) == 0
    if name == "lru":
        assert _sim._native_spec(used) == _sim._native_spec(fresh)  # an empty LRU is a fresh one
    else:
        assert _sim._native_spec(used) is None
