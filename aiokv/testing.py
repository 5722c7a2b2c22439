"""Test helpers for engines that embed aiokv (and for aiokv's own tests): public, documented, kept compatible.

- :class:`FaultyTier` / :class:`FaultyTierStats`: wrap any lower tier and make some of its calls fail, drop
  what they were given, store it corrupt at rest or take longer, seeded and reproducibly (docs/tiers.md,
  "FaultyTier"; docs/guide.md, "Testing your integration").
- :class:`MemoryTier` / :class:`MemoryTierStats`: a lower tier (a :class:`~aiokv.tiers.BackingTier`) held in
  a dict, with the checks a real tier makes: it opens once and refuses calls before :meth:`~MemoryTier.open`
  and after :meth:`~MemoryTier.aclose`, checks every buffer, stores entries in the self-describing format of
  the disk and Redis tiers (header with layout fingerprint, key, length and checksums) and verifies each on
  read, so a truncated, corrupt or foreign entry is a miss (dropped and counted), never data. Optional
  capacity with least-recently-used eviction, an outage switch (:attr:`~MemoryTier.available`), KV events,
  and the corruption hook :class:`FaultyTier` uses.
- :class:`FakeClock`: a callable returning seconds that only moves when told (:meth:`~FakeClock.advance`),
  for every ``clock=`` parameter of aiokv (:class:`~aiokv.RedisTier`'s backoff,
  :class:`~aiokv.tiers.SessionPolicy`'s retention deadlines).
- :class:`SimulatedDevice`: CUDA's stream and event semantics on worker threads, for ``Offloader(device=...)``
  on a machine without a GPU (the same object as :class:`aiokv.transfer.SimulatedDevice`; see docs/devices.md).

``import aiokv.testing`` imports neither torch nor a device: :class:`SimulatedDevice` (which needs torch) and
:class:`FaultyTier` are imported on first use.
"""

from __future__ import annotations

import math
import typing
from collections.abc import Sequence
from dataclasses import dataclass

from . import _lazy
from ._errors import CapacityError, ClosedError, InvalidArgumentError, InvalidTypeError
from .tiers import BackingTier, TierHealth, TierSpec
from .tiers._base import check_buffers  # the checks every lower tier makes, and its entry format:
from .tiers._format import HEADER_SIZE, Damage, Verdict, check_damage, check_entry, pack_header

if typing.TYPE_CHECKING:
    from .tiers._faulty import FaultyTier, FaultyTierStats
    from .transfer._simdevice import SimulatedDevice

__all__ = [
    "FakeClock",
    "FaultyTier",
    "FaultyTierStats",
    "MemoryTier",
    "MemoryTierStats",
    "SimulatedDevice",
]

__getattr__, __dir__ = _lazy.attach(
    __name__,
    {
        "FaultyTier": ".tiers._faulty",
        "FaultyTierStats": ".tiers._faulty",
        "SimulatedDevice": ".transfer._simdevice",
    },
)

_KEY_BYTES = 32


class FakeClock:
    """A clock for tests: ``clock()`` returns the current time in seconds, which changes only through
    :meth:`advance` (so backoffs, deadlines and rates are decided by the test, not by the machine's speed).

    Pass it wherever aiokv takes ``clock=`` (a callable returning monotonic seconds)::

        clock = FakeClock()
        tier = aiokv.RedisTier(url, backoff_s=1.0, clock=clock)
        ...
        clock.advance(1.0)  # the next call probes the server again
    """

    __slots__ = ("_now",)

    def __init__(self, start: float = 0.0) -> None:
        self._now = _seconds("start", start, allow_negative=True)

    def __call__(self) -> float:
        return self._now

    @property
    def now(self) -> float:
        """The current time, in seconds; setting it moves the clock there (never back: it is monotonic)."""
        return self._now

    @now.setter
    def now(self, value: float) -> None:
        value = _seconds("now", value, allow_negative=True)
        if value < self._now:
            raise InvalidArgumentError(f"a monotonic clock cannot go back from {self._now:g} to {value:g}")
        self._now = value

    def advance(self, seconds: float) -> float:
        """Move the clock forward by ``seconds`` (a finite number >= 0: monotonic) and return the new time."""
        self._now += _seconds("seconds", seconds)
        return self._now

    def __repr__(self) -> str:
        return f"FakeClock(now={self._now:g})"


def _seconds(name: str, value: object, *, allow_negative: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidTypeError(f"{name} must be a number of seconds, got {type(value).__name__}")
    if not math.isfinite(value) or (value < 0 and not allow_negative):
        raise InvalidArgumentError(
            f"{name} must be a finite number{'' if allow_negative else ' >= 0'}, got {value}"
        )
    return float(value)


@dataclass(frozen=True, slots=True)
class MemoryTierStats:
    """Counters of a :class:`MemoryTier`."""

    health: TierHealth  # UP, or DOWN while the tier is not available
    capacity_bytes: int | None  # None: unbounded
    entry_bytes: int  # bytes one entry holds (header + payload); 0 before open
    entries: int  # entries held (in this tier's store, shared or not)
    evictions: int  # entries evicted to make room (least recently used first)
    lookups: int  # lookup() calls
    lookup_hits: int  # blocks reported present by lookup()
    reads: int  # read_into() calls
    read_blocks: int  # blocks read and verified
    read_misses: int  # read_into() calls that returned fewer blocks than asked
    corrupt: int  # entries that failed verification on read (dropped): truncated, damaged, foreign, misfiled
    writes: int  # write() calls
    stored_blocks: int  # blocks stored
    skipped_existing: int  # blocks not stored because the tier already held them
    dropped_down: int  # blocks not stored because the tier was not available


class MemoryTier(BackingTier):
    """A lower tier in memory that behaves like a real one (see the module documentation).

    ``capacity_bytes``: bound on the bytes of the entries held (each is its 128-byte header plus one payload);
    beyond it the least recently stored or read entries are evicted. ``None`` (the default): unbounded. A
    capacity that cannot hold one entry is refused by :meth:`open` (:class:`~aiokv.CapacityError`), as the disk
    tier does.

    ``store``: the dict the entries live in, ``key -> header + payload`` (a new one by default). Pass another
    tier's :attr:`store` to share its contents, as several processes share one Redis, or to keep them across
    an offloader's restart (a tier is opened once: the next offloader gets a new ``MemoryTier(store=...)``).
    Writing raw bytes into it (a truncated value, another layout's entry) is how a test plants a bad entry.

    ``name`` and ``medium`` are what stats, logs and KV events call the tier (``medium="DISK"`` to stand in
    for a disk tier).
    """

    def __init__(
        self,
        capacity_bytes: int | None = None,
        *,
        store: dict[bytes, bytes] | None = None,
        name: str = "memory",
        medium: str = "REMOTE",
    ) -> None:
        if capacity_bytes is not None and (
            isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, int) or capacity_bytes <= 0
        ):
            raise InvalidArgumentError(
                f"capacity_bytes must be a positive int or None, got {capacity_bytes!r}"
            )
        if store is not None and not isinstance(store, dict):
            raise InvalidTypeError(f"store must be a dict, got {type(store).__name__}")
        if not isinstance(name, str) or not name:
            raise InvalidArgumentError(f"name must be a non-empty str, got {name!r}")
        if not isinstance(medium, str) or not medium:
            raise InvalidArgumentError(f"medium must be a non-empty str, got {medium!r}")
        self.capacity_bytes = capacity_bytes
        self.store: dict[bytes, bytes] = {} if store is None else store
        self.name = name
        self.medium = medium
        self.available = True
        """While false the backend is "gone": lookups answer 0, reads miss and writes are dropped (counted
        in ``dropped_down``), health is ``DOWN``; nothing raises (the :class:`BackingTier` contract)."""
        self._spec: TierSpec | None = None
        self._closed = False
        self._c = dict.fromkeys(
            (
                "evictions",
                "lookups",
                "lookup_hits",
                "reads",
                "read_blocks",
                "read_misses",
                "corrupt",
                "writes",
                "stored_blocks",
                "skipped_existing",
                "dropped_down",
            ),
            0,
        )

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open" if self._spec is not None else "new"
        health = TierHealth.UP if self.available else TierHealth.DOWN
        return f"<MemoryTier {self.name!r} {state} health={health.value} entries={len(self.store)}>"

    # ------------------------------------------------------------- lifecycle
    async def open(self, spec: TierSpec) -> None:
        """Bind to the layout. Refuses a second open, a bad spec, and a capacity below one entry."""
        if self._spec is not None or self._closed:
            raise ClosedError("a MemoryTier can be opened once; create a new one (store= keeps the contents)")
        if not isinstance(spec, TierSpec):
            raise InvalidTypeError(f"spec must be a TierSpec, got {type(spec).__name__}")
        if spec.payload_bytes <= 0:
            raise InvalidArgumentError(f"spec.payload_bytes must be > 0, got {spec.payload_bytes}")
        if len(spec.fingerprint) != _KEY_BYTES:
            raise InvalidArgumentError(f"spec.fingerprint must be 32 bytes, got {len(spec.fingerprint)}")
        entry = HEADER_SIZE + spec.payload_bytes
        if self.capacity_bytes is not None and self.capacity_bytes < entry:
            raise CapacityError(
                f"capacity_bytes must hold at least one entry of {entry} bytes, got {self.capacity_bytes}"
            )
        self._spec = spec

    async def aclose(self) -> None:
        """Close (idempotent). The entries stay in :attr:`store`."""
        self._closed = True

    async def __aenter__(self) -> MemoryTier:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def _live(self) -> TierSpec:
        if self._closed:
            raise ClosedError("memory tier is closed")
        if self._spec is None:
            raise ClosedError("memory tier is not open; call open(spec) first")
        return self._spec

    # ------------------------------------------------------------ operations
    async def lookup(self, keys: Sequence[bytes]) -> int:
        self._live()
        self._c["lookups"] += 1
        if not self.available:
            return 0
        n = 0
        for key in keys:
            if key not in self.store:
                break
            n += 1
        self._c["lookup_hits"] += n
        return n

    async def read_into(self, keys: Sequence[bytes], outs: Sequence[memoryview]) -> int:
        spec = self._live()
        check_buffers("outs", keys, outs, spec.payload_bytes)
        self._c["reads"] += 1
        n = 0
        if self.available:
            for key, out in zip(keys, outs, strict=True):
                value = self.store.get(key)
                if value is None:
                    break
                verdict = check_entry(
                    value[:HEADER_SIZE],
                    value[HEADER_SIZE:],
                    fingerprint=spec.fingerprint,
                    key=key,
                    payload_len=spec.payload_bytes,
                )
                if verdict is not Verdict.OK:
                    self._drop(key)
                    self._c["corrupt"] += 1
                    break
                out.cast("B")[:] = value[HEADER_SIZE:]
                del self.store[key]  # most recently used: last in the eviction order
                self.store[key] = value
                n += 1
        self._c["read_blocks"] += n
        if n < len(keys):
            self._c["read_misses"] += 1
        return n

    async def write(self, keys: Sequence[bytes], payloads: Sequence[memoryview]) -> int:
        stored, _ = await self._write_damaged(keys, payloads, [None] * len(keys))
        return stored

    async def _write_damaged(
        self, keys: Sequence[bytes], payloads: Sequence[memoryview], damage: Sequence[Damage | None]
    ) -> tuple[int, int]:
        """Store, with ``damage[i]`` (``(offset, mask)``) xor-ed into entry ``i`` after its checksums were
        computed: bit rot at rest, which only the read's verification catches (:class:`FaultyTier` uses it)."""
        spec = self._live()
        check_buffers("payloads", keys, payloads, spec.payload_bytes)
        check_damage(damage, len(keys), spec.payload_bytes)
        for i, key in enumerate(keys):
            if not isinstance(key, bytes) or len(key) != _KEY_BYTES:
                raise InvalidArgumentError(f"keys[{i}] must be a 32-byte block hash")
        self._c["writes"] += 1
        if not self.available:
            self._c["dropped_down"] += len(keys)
            return 0, 0
        entry = HEADER_SIZE + spec.payload_bytes
        new: list[bytes] = []
        hurt = 0
        for key, payload, dmg in zip(keys, payloads, damage, strict=True):
            if key in self.store:
                self._c["skipped_existing"] += 1
                continue
            value = pack_header(key, spec.fingerprint, payload) + bytes(payload)
            if dmg is not None:
                raw = bytearray(value)
                raw[dmg[0]] ^= dmg[1]
                value = bytes(raw)
                hurt += 1
            if self.capacity_bytes is not None:
                self._make_room(entry)
            self.store[key] = value
            new.append(key)
        self._c["stored_blocks"] += len(new)
        if new and self.kv_events is not None:
            self.kv_events.stored(new)
        return len(keys), hurt

    def _make_room(self, entry: int) -> None:
        assert self.capacity_bytes is not None
        while self.store and (len(self.store) + 1) * entry > self.capacity_bytes:
            victim = next(iter(self.store))
            self._drop(victim)
            self._c["evictions"] += 1

    def _drop(self, key: bytes) -> None:
        del self.store[key]
        if self.kv_events is not None and self.kv_events.holds(key):
            self.kv_events.removed([key])

    def stats(self) -> MemoryTierStats:
        spec = self._spec
        return MemoryTierStats(
            health=TierHealth.UP if self.available else TierHealth.DOWN,
            capacity_bytes=self.capacity_bytes,
            entry_bytes=0 if spec is None else HEADER_SIZE + spec.payload_bytes,
            entries=len(self.store),
            **self._c,
        )
