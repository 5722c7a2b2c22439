"""KV events: an ordered, replayable record of which blocks every tier holds, for routers and dashboards.

Every change of a tier's contents is one :class:`KVEvent` with a sequence number: blocks *stored* (a chain
of blocks, with the parent of its first block, the tokens each block holds, and the tenant tag of the request
that stored them), blocks *removed* (evicted, expired, found corrupt) and a tier *cleared*. The log keeps the
last ``buffer`` events for consumers that fall behind, and the current state of every tier for consumers that
join late or fall further behind than the buffer: they get a :class:`KVSnapshot` and continue from its sequence
number, so a consumer that applies what it receives always ends with exactly the tiers' contents.

Emitting is synchronous and O(blocks) on the loop thread; subscribers are woken once per loop tick.
"""

from __future__ import annotations

import asyncio
import enum
import itertools
import time
from collections import deque
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from .._errors import InvalidArgumentError

__all__ = ["BlockInfo", "EventKind", "KVEvent", "KVEventLog", "KVEventStream", "KVSnapshot"]


class EventKind(str, enum.Enum):
    STORED = "stored"
    REMOVED = "removed"
    CLEARED = "cleared"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True, slots=True)
class KVEvent:
    """One change of one tier. ``block_hashes`` are 32-byte aiokv block hashes; for a stored event they form a
    chain (each block's parent is the one before it, the first one's is ``parent_hash``)."""

    seq: int
    kind: EventKind
    tier: str  # "cpu", "disk", "redis", ...
    medium: str  # "CPU", "DISK", "REMOTE" (what a router groups tiers by)
    block_hashes: tuple[bytes, ...] = ()
    parent_hash: bytes | None = None
    block_size: int = 0  # tokens per block (stored events)
    token_counts: tuple[int, ...] = ()  # tokens each stored block holds (< block_size for a partial block)
    token_ids: tuple[int, ...] | None = None  # the stored blocks' tokens, concatenated, when known
    tenant: Any = None  # the storing request's salt (tenant tag), when known
    ts: float = 0.0  # time.time() at emission


@dataclass(frozen=True, slots=True)
class BlockInfo:
    parent_hash: bytes | None
    token_count: int
    tenant: Any = None


@dataclass(frozen=True, slots=True)
class KVSnapshot:
    """Every tier's blocks as of event ``seq``: applying the events after ``seq`` to it gives the tiers'
    contents at any later point."""

    seq: int
    tiers: dict[str, dict[bytes, BlockInfo]] = field(default_factory=dict)
    media: dict[str, str] = field(default_factory=dict)


class KVEventLog:
    """The ordered event log of one offloader (see the module docstring).

    ``buffer`` events are kept for replay (:meth:`events_since`); the current state of every tier is kept
    for :meth:`snapshot` (one small record per cached block: enable events only when something consumes them).
    """

    def __init__(self, *, buffer: int = 10_000) -> None:
        if isinstance(buffer, bool) or not isinstance(buffer, int) or buffer < 1:
            raise InvalidArgumentError(f"buffer must be an int >= 1, got {buffer!r}")
        # The buffer holds each event's fields as a plain tuple (cheap to record); KVEvent objects are made for
        # the readers that ask (events_since), so a log nobody reads costs no event objects.
        self._events: deque[tuple[Any, ...]] = deque(maxlen=buffer)
        self._state: dict[str, dict[bytes, BlockInfo]] = {}
        self._media: dict[str, str] = {}
        self._seq = 0
        self._waiters: list[asyncio.Future[None]] = []
        self._wake_scheduled = False
        self._closed = False

    @property
    def seq(self) -> int:
        """The sequence number of the last event (0 before any)."""
        return self._seq

    # ------------------------------------------------------------------ emitting (loop thread)
    def stored(
        self,
        tier: str,
        medium: str,
        block_hashes: Sequence[bytes],
        parent_hash: bytes | None,
        block_size: int,
        *,
        token_counts: Sequence[int] | None = None,
        token_ids: Sequence[int] | None = None,
        tenant: Any = None,
    ) -> None:
        if not block_hashes:
            return
        counts = tuple(token_counts) if token_counts is not None else (block_size,) * len(block_hashes)
        state = self._tier(tier, medium)
        parent = parent_hash
        for key, n in zip(block_hashes, counts, strict=True):
            state[key] = BlockInfo(parent, n, tenant)
            parent = key
        self._append(
            (
                EventKind.STORED,
                tier,
                medium,
                tuple(block_hashes),
                parent_hash,
                block_size,
                counts,
                None if token_ids is None else tuple(token_ids),
                tenant,
            )
        )

    def removed(self, tier: str, medium: str, block_hashes: Sequence[bytes]) -> None:
        state = self._tier(tier, medium)
        gone = tuple(k for k in block_hashes if state.pop(k, None) is not None)
        if gone:
            self._append((EventKind.REMOVED, tier, medium, gone, None, 0, (), None, None))

    def cleared(self, tier: str, medium: str) -> None:
        self._tier(tier, medium).clear()
        self._append((EventKind.CLEARED, tier, medium, (), None, 0, (), None, None))

    def declare_tier(self, tier: str, medium: str) -> None:
        """Make ``tier`` (on ``medium``) part of every snapshot from now on, even while it holds nothing."""
        self._tier(tier, medium)

    def block(self, tier: str, key: bytes) -> BlockInfo | None:
        """What the log records for block ``key`` in ``tier`` (``None``: not stored there)."""
        state = self._state.get(tier)
        return None if state is None else state.get(key)

    def _tier(self, tier: str, medium: str) -> dict[bytes, BlockInfo]:
        state = self._state.get(tier)
        if state is None:
            state = self._state[tier] = {}
            self._media[tier] = medium
        return state

    def _append(self, fields: tuple[Any, ...]) -> None:
        """Record one event: ``fields`` are KVEvent's fields after ``seq`` and before ``ts``."""
        self._seq += 1
        self._events.append((self._seq, *fields, time.time()))
        if self._waiters and not self._wake_scheduled:
            self._wake_scheduled = True
            asyncio.get_running_loop().call_soon(self._wake)

    def _wake(self) -> None:
        self._wake_scheduled = False
        waiters, self._waiters = self._waiters, []
        for w in waiters:
            if not w.done():
                w.set_result(None)

    # ------------------------------------------------------------------ reading
    def events_since(self, seq: int) -> list[KVEvent] | None:
        """The events after ``seq``, or ``None`` when some of them have left the buffer (take a snapshot)."""
        if seq >= self._seq:
            return []
        events = self._events
        if not events or events[0][0] > seq + 1:
            return None
        start = seq + 1 - events[0][0]
        return [KVEvent(*fields) for fields in itertools.islice(events, start, None)]

    def snapshot(self) -> KVSnapshot:
        return KVSnapshot(
            self._seq, {tier: dict(blocks) for tier, blocks in self._state.items()}, dict(self._media)
        )

    def subscribe(self, from_seq: int | None = None) -> KVEventStream:
        """An async iterator of the events after ``from_seq``; a :class:`KVSnapshot` first when ``from_seq``
        is ``None`` or too old for the buffer (the consumer then replaces its state with it)."""
        return KVEventStream(self, from_seq)

    async def _wait_beyond(self, seq: int) -> None:
        while self._seq <= seq and not self._closed:
            fut = asyncio.get_running_loop().create_future()
            self._waiters.append(fut)
            await fut

    def close(self) -> None:
        """End every subscription (after it has drained what is buffered)."""
        self._closed = True
        self._wake()

    @property
    def closed(self) -> bool:
        return self._closed

    def __repr__(self) -> str:
        return f"<KVEventLog seq={self._seq} tiers={ {t: len(s) for t, s in self._state.items()} }>"


class KVEventStream:
    """``async for item in log.subscribe(...)``: :class:`KVEvent` items, and a :class:`KVSnapshot` whenever the
    consumer must resynchronize. Ends when the log is closed."""

    def __init__(self, log: KVEventLog, from_seq: int | None) -> None:
        self._log = log
        self._cursor = from_seq
        self._pending: deque[KVEvent] = deque()

    def __aiter__(self) -> AsyncIterator[KVEvent | KVSnapshot]:
        return self

    @property
    def cursor(self) -> int | None:
        """The sequence number of the last item returned (``None``: a snapshot comes next)."""
        return self._cursor

    def drain_nowait(self) -> list[KVEvent] | None:
        """Every event available right now after the cursor, without waiting (advancing the cursor);
        ``None`` when a snapshot must come first."""
        if self._cursor is None:
            return None
        out = list(self._pending)
        self._pending.clear()
        if out:
            self._cursor = out[-1].seq
        more = self._log.events_since(self._cursor)
        if more is None:
            self._cursor = None
            return None
        if more:
            out.extend(more)
            self._cursor = more[-1].seq
        return out

    async def __anext__(self) -> KVEvent | KVSnapshot:
        log = self._log
        while True:
            if self._pending:
                event = self._pending.popleft()
                self._cursor = event.seq
                return event
            if self._cursor is None:
                snap = log.snapshot()
                self._cursor = snap.seq
                return snap
            events = log.events_since(self._cursor)
            if events is None:
                self._cursor = None  # fell behind the buffer: resynchronize
                continue
            if events:
                self._pending.extend(events)
                continue
            if log.closed:
                raise StopAsyncIteration
            await log._wait_beyond(self._cursor)
