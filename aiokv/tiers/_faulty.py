"""A :class:`BackingTier` wrapper that injects faults into any lower tier, seeded and reproducibly.

``FaultyTier(tier, ...)`` forwards every call to ``tier`` and, on the way, makes some of them fail, drop what
they were given, store it corrupt, or take longer. It is meant for tests (of aiokv and of engines that embed
it) and for drills: what an engine does when its disk fills up or its Redis flaps can be tried on a laptop.

Fault kinds (each with its own rate and its own random stream, so changing one never moves another):

- lookup failure (per call): ``lookup`` answers 0;
- read failure (per block): ``read_into`` stops before the failing block (reports fewer keys);
- write failure (per block): the block is not stored and not reported as stored;
- drop (per block): the block is reported as stored but never reaches the wrapped tier;
- corruption at rest (per block): the block is stored with one byte flipped *after* the wrapped tier computed
  its checksums, so the stored entry looks exactly like bit rot and the wrapped tier's own verification must
  reject it on read (through the tier's ``_write_damaged`` hook; DiskTier and RedisTier have it);
- delay (per call): the call sleeps ``delay_s`` plus up to ``delay_jitter_s`` before it proceeds.

Faults also hit chosen blocks or calls: ``fail_keys`` / ``drop_keys`` / ``corrupt_keys`` by block hash,
``fail_on`` by call index. ``fail_mode="raise"`` turns failures into ``OSError`` raised from the call, which
breaks the BackingTier contract on purpose: it tests that the caller survives a tier that raises.

Whatever is injected, a miss stays a miss: the wrapper never hands out bytes the wrapped tier did not verify.
"""

from __future__ import annotations

import asyncio
import errno
import math
import random
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Protocol, cast

from .._errors import ClosedError, InvalidArgumentError, InvalidTypeError
from .._log import get_logger
from ._base import BackingTier, TierHealth, TierSpec, check_buffers
from ._format import HEADER_SIZE, Damage

if TYPE_CHECKING:
    from ..events._emit import TierEvents

__all__ = ["FaultyTier", "FaultyTierStats"]

_OPS = ("lookup", "read", "write")
_KEY_BYTES = 32
_log = get_logger("tiers.faulty")


class _Damageable(Protocol):
    """A tier that can store entries corrupt at rest (DiskTier, RedisTier): see ``aiokv.tiers._format``."""

    async def _write_damaged(
        self, keys: Sequence[bytes], payloads: Sequence[memoryview], damage: Sequence[Damage | None]
    ) -> tuple[int, int]: ...


@dataclass(frozen=True, slots=True)
class FaultyTierStats:
    """Counters of a :class:`FaultyTier`: the faults it injected, and the wrapped tier's own ``stats()``."""

    health: TierHealth | None  # the wrapped tier's health (None when its stats carry none)
    lookups: int  # lookup() calls
    reads: int  # read_into() calls
    writes: int  # write() calls
    lookup_failures: int  # lookup() calls failed on purpose (answered 0, or raised)
    read_failures: int  # read_into() calls cut short on purpose (fewer keys reported, or raised)
    write_failures: int  # blocks whose store failed on purpose (not reported as stored, or the call raised)
    dropped: int  # blocks reported as stored that never reached the wrapped tier
    corrupted: int  # blocks the wrapped tier stored corrupt at rest (its verification must reject them)
    raised: int  # calls that raised OSError (fail_mode="raise")
    delayed: int  # calls delayed
    delayed_s: float  # total delay injected (seconds asked of asyncio.sleep)
    inner: Any  # the wrapped tier's stats()


@dataclass(frozen=True, slots=True)
class _Faults:
    """The validated fault settings of one FaultyTier."""

    lookup_fail_rate: float
    read_fail_rate: float
    write_fail_rate: float
    drop_rate: float
    corrupt_rate: float
    delay_s: float
    delay_jitter_s: float
    delay_rate: float
    fail_keys: frozenset[bytes]
    drop_keys: frozenset[bytes]
    corrupt_keys: frozenset[bytes]
    fail_on: Mapping[str, frozenset[int]]
    fail_mode: Literal["miss", "raise"]
    seed: int

    def describe(self) -> str:
        """The settings that inject something, for ``repr``."""
        parts = [f"seed={self.seed}"]
        for name in (
            "lookup_fail_rate",
            "read_fail_rate",
            "write_fail_rate",
            "drop_rate",
            "corrupt_rate",
            "delay_s",
            "delay_jitter_s",
        ):
            value = getattr(self, name)
            if value:
                parts.append(f"{name}={value:g}")
        for name in ("fail_keys", "drop_keys", "corrupt_keys"):
            if getattr(self, name):
                parts.append(f"{name}=<{len(getattr(self, name))}>")
        calls = {op: sorted(indices) for op, indices in self.fail_on.items() if indices}
        if calls:
            parts.append(f"fail_on={calls}")
        if self.fail_mode != "miss":
            parts.append(f"fail_mode={self.fail_mode!r}")
        return " ".join(parts)


class _Dice:
    """One seeded random stream per fault kind: a kind's draws depend only on the seed and on the calls."""

    __slots__ = ("_rngs",)

    def __init__(self, seed: int) -> None:
        kinds = ("lookup_fail", "read_fail", "write_fail", "drop", "corrupt", "delay")
        self._rngs = {kind: random.Random(f"aiokv.FaultyTier:{seed}:{kind}") for kind in kinds}

    def roll(self, kind: str, rate: float) -> bool:
        """True with probability ``rate`` (no draw at all when ``rate`` is 0)."""
        return rate > 0.0 and self._rngs[kind].random() < rate

    def rng(self, kind: str) -> random.Random:
        return self._rngs[kind]


class FaultyTier(BackingTier):
    """Wrap ``tier`` and inject faults into its calls, reproducibly for a given ``seed``.

    Rates are probabilities in ``[0, 1]``. ``fail_rate`` is the default of the three failure rates
    (``lookup_fail_rate`` per ``lookup`` call, ``read_fail_rate`` and ``write_fail_rate`` per block); the
    silent faults have their own: ``drop_rate`` (a block reported as stored is not) and ``corrupt_rate`` (a
    block is stored corrupt at rest, which needs a tier with the ``_write_damaged`` hook: DiskTier,
    RedisTier). ``delay_s`` (plus a uniform ``[0, delay_jitter_s]``) is slept at the start of a ``lookup``,
    ``read_into`` or ``write`` call, for a fraction ``delay_rate`` of the calls.

    Chosen faults: blocks whose hash is in ``fail_keys`` fail to read and to store (``lookup`` still reports
    them), blocks in ``drop_keys`` are dropped, blocks in ``corrupt_keys`` are stored corrupt; ``fail_on``
    maps ``"lookup"``, ``"read"`` or ``"write"`` to 0-based indices of calls of that method (counted over every
    call since the tier was created) that fail entirely.

    ``fail_mode="miss"`` (the default) keeps the BackingTier contract: failures are misses and dropped writes.
    ``fail_mode="raise"`` raises ``OSError(EIO)`` from a call with a failure instead (nothing is read or
    stored by that call), to test callers against a tier that breaks the contract.

    Faults are decided when a call starts, from one random stream per fault kind seeded by ``seed``: the same
    settings and the same sequence of calls give the same faults. Set :attr:`enabled` to False to let calls
    through untouched (e.g. while filling the tier); no random draw is made meanwhile. ``stats()`` counts
    every injected fault and includes the wrapped tier's stats.
    """

    name = "faulty"

    def __init__(
        self,
        tier: BackingTier,
        *,
        fail_rate: float = 0.0,
        lookup_fail_rate: float | None = None,
        read_fail_rate: float | None = None,
        write_fail_rate: float | None = None,
        drop_rate: float = 0.0,
        corrupt_rate: float = 0.0,
        delay_s: float = 0.0,
        delay_jitter_s: float = 0.0,
        delay_rate: float = 1.0,
        fail_keys: Collection[bytes] = (),
        drop_keys: Collection[bytes] = (),
        corrupt_keys: Collection[bytes] = (),
        fail_on: Mapping[str, Collection[int]] | None = None,
        fail_mode: Literal["miss", "raise"] = "miss",
        seed: int = 0,
    ) -> None:
        if not isinstance(tier, BackingTier):
            raise InvalidTypeError(f"tier must be a BackingTier, got {type(tier).__name__}")
        default = _rate("fail_rate", fail_rate)
        faults = _Faults(
            lookup_fail_rate=_rate("lookup_fail_rate", lookup_fail_rate, default),
            read_fail_rate=_rate("read_fail_rate", read_fail_rate, default),
            write_fail_rate=_rate("write_fail_rate", write_fail_rate, default),
            drop_rate=_rate("drop_rate", drop_rate),
            corrupt_rate=_rate("corrupt_rate", corrupt_rate),
            delay_s=_seconds("delay_s", delay_s),
            delay_jitter_s=_seconds("delay_jitter_s", delay_jitter_s),
            delay_rate=_rate("delay_rate", delay_rate),
            fail_keys=_keys("fail_keys", fail_keys),
            drop_keys=_keys("drop_keys", drop_keys),
            corrupt_keys=_keys("corrupt_keys", corrupt_keys),
            fail_on=_call_indices(fail_on),
            fail_mode=_fail_mode(fail_mode),
            seed=_seed(seed),
        )
        if (faults.corrupt_rate or faults.corrupt_keys) and not callable(
            getattr(tier, "_write_damaged", None)
        ):
            raise InvalidArgumentError(
                "corrupt_rate and corrupt_keys need a tier that can store entries corrupt at rest "
                f"(DiskTier, RedisTier: the _write_damaged hook), got {type(tier).__name__}"
            )
        self.tier = tier
        self.name = f"faulty-{tier.name}"
        self.medium = tier.medium
        self._faults = faults
        self._dice = _Dice(faults.seed)
        self._enabled = True
        self._spec: TierSpec | None = None
        self._closed = False
        self._calls = dict.fromkeys(_OPS, 0)  # calls started per method (the fail_on indices)
        self._c: dict[str, int] = dict.fromkeys(
            (
                "lookup_failures",
                "read_failures",
                "write_failures",
                "dropped",
                "corrupted",
                "raised",
                "delayed",
            ),
            0,
        )
        self._delayed_s = 0.0

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open" if self._spec is not None else "new"
        enabled = "" if self._enabled else " disabled"
        return f"<FaultyTier {state}{enabled} {self._faults.describe()} over {self.tier!r}>"

    @property
    def enabled(self) -> bool:
        """Whether faults are injected (True at creation). While False, calls go straight to the wrapped
        tier and no random draw is made."""
        return self._enabled

    @enabled.setter
    def enabled(self, value: bool) -> None:
        if not isinstance(value, bool):
            raise InvalidTypeError(f"enabled must be a bool, got {type(value).__name__}")
        self._enabled = value

    def attach_events(self, events: TierEvents | None) -> None:
        """The wrapped tier reports its own changes (a dropped write never reaches it, so is never reported)."""
        self.tier.attach_events(events)

    # ------------------------------------------------------------- lifecycle
    async def open(self, spec: TierSpec) -> None:
        """Open the wrapped tier (faults are never injected here)."""
        if self._spec is not None or self._closed:
            raise ClosedError("a FaultyTier can be opened once; create a new one")
        await self.tier.open(spec)
        self._spec = spec

    async def aclose(self) -> None:
        """Close the wrapped tier. Idempotent."""
        self._closed = True
        await self.tier.aclose()

    async def __aenter__(self) -> FaultyTier:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def _live(self) -> TierSpec:
        if self._closed:
            raise ClosedError("faulty tier is closed")
        if self._spec is None:
            raise ClosedError("faulty tier is not open; call open(spec) first")
        return self._spec

    def _next_call(self, op: str) -> bool:
        """Count a call of ``op``; whether it is one of the ``fail_on`` calls."""
        index = self._calls[op]
        self._calls[op] = index + 1
        return index in self._faults.fail_on[op]

    def _draw_delay(self) -> float:
        f = self._faults
        if not (f.delay_s or f.delay_jitter_s) or not self._dice.roll("delay", f.delay_rate):
            return 0.0
        extra = self._dice.rng("delay").uniform(0.0, f.delay_jitter_s) if f.delay_jitter_s else 0.0
        return f.delay_s + extra

    async def _sleep(self, seconds: float) -> None:
        if seconds > 0.0:
            self._c["delayed"] += 1
            self._delayed_s += seconds
            await asyncio.sleep(seconds)

    def _fail(self, what: str) -> OSError:
        self._c["raised"] += 1
        return OSError(errno.EIO, f"injected fault: {what} (FaultyTier seed={self._faults.seed})")

    # ------------------------------------------------------------ operations
    async def lookup(self, keys: Sequence[bytes]) -> int:
        self._live()
        chosen = self._next_call("lookup")
        if not self._enabled:
            return await self.tier.lookup(keys)
        failed = self._dice.roll("lookup_fail", self._faults.lookup_fail_rate) or chosen
        await self._sleep(self._draw_delay())
        if not failed:
            return await self.tier.lookup(keys)
        self._c["lookup_failures"] += 1
        _log.debug("%s: lookup of %d keys failed (injected)", self.name, len(keys))
        if self._faults.fail_mode == "raise":
            raise self._fail("lookup failed")
        return 0

    async def read_into(self, keys: Sequence[bytes], outs: Sequence[memoryview]) -> int:
        spec = self._live()
        check_buffers("outs", keys, outs, spec.payload_bytes)
        chosen = self._next_call("read")
        if not self._enabled:
            return await self.tier.read_into(keys, outs)
        f = self._faults
        cut = 0 if chosen else len(keys)
        for i, key in enumerate(keys):  # one draw per block, whatever the outcome: the stream stays aligned
            if (self._dice.roll("read_fail", f.read_fail_rate) or key in f.fail_keys) and i < cut:
                cut = i
        await self._sleep(self._draw_delay())
        if cut == len(keys):
            return await self.tier.read_into(keys, outs)
        self._c["read_failures"] += 1
        _log.debug("%s: read_into of %d keys failed at key %d (injected)", self.name, len(keys), cut)
        if f.fail_mode == "raise":
            raise self._fail(f"read_into failed at key {cut} of {len(keys)}")
        return await self.tier.read_into(keys[:cut], outs[:cut]) if cut else 0

    async def write(self, keys: Sequence[bytes], payloads: Sequence[memoryview]) -> int:
        spec = self._live()
        check_buffers("payloads", keys, payloads, spec.payload_bytes)
        chosen = self._next_call("write")
        if not self._enabled:
            return await self.tier.write(keys, payloads)
        f = self._faults
        dice = self._dice
        entry_bytes = HEADER_SIZE + spec.payload_bytes
        failed: list[int] = []
        dropped: list[int] = []
        kept: list[int] = []
        damage: list[Damage | None] = []
        for i, key in enumerate(keys):  # every kind draws for every block: each stream stays aligned
            fail = dice.roll("write_fail", f.write_fail_rate) or key in f.fail_keys or chosen
            drop = dice.roll("drop", f.drop_rate) or key in f.drop_keys
            hurt: Damage | None = None
            if dice.roll("corrupt", f.corrupt_rate) or key in f.corrupt_keys:
                rng = dice.rng("corrupt")
                hurt = (rng.randrange(entry_bytes), rng.randrange(1, 256))
            if fail:
                failed.append(i)
            elif drop:
                dropped.append(i)
            else:
                kept.append(i)
                damage.append(hurt)
        await self._sleep(self._draw_delay())
        if failed:
            _log.debug("%s: %d of %d stores failed (injected)", self.name, len(failed), len(keys))
            if f.fail_mode == "raise":
                self._c["write_failures"] += len(keys)
                raise self._fail(f"write of {len(keys)} blocks failed")
            self._c["write_failures"] += len(failed)
        self._c["dropped"] += len(dropped)
        stored = 0
        if kept and any(d is not None for d in damage):
            inner = cast(_Damageable, self.tier)
            stored, hurt_count = await inner._write_damaged(
                [keys[i] for i in kept], [payloads[i] for i in kept], damage
            )
            self._c["corrupted"] += hurt_count
        elif len(kept) == len(keys):
            stored = await self.tier.write(keys, payloads)
        elif kept:
            stored = await self.tier.write([keys[i] for i in kept], [payloads[i] for i in kept])
        return stored + len(dropped)

    def stats(self) -> FaultyTierStats:
        inner = self.tier.stats()
        health = getattr(inner, "health", None)
        return FaultyTierStats(
            health=health if isinstance(health, TierHealth) else None,
            lookups=self._calls["lookup"],
            reads=self._calls["read"],
            writes=self._calls["write"],
            delayed_s=self._delayed_s,
            inner=inner,
            **self._c,
        )


# ------------------------------------------------------------------ validation
def _rate(name: str, value: object, default: float | None = None) -> float:
    if value is None and default is not None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidTypeError(f"{name} must be a number, got {type(value).__name__}")
    if not 0.0 <= value <= 1.0:
        raise InvalidArgumentError(f"{name} must be in [0, 1], got {value}")
    return float(value)


def _seconds(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidTypeError(f"{name} must be a number, got {type(value).__name__}")
    if not (value >= 0 and math.isfinite(value)):
        raise InvalidArgumentError(f"{name} must be a finite number >= 0, got {value}")
    return float(value)


def _keys(name: str, value: object) -> frozenset[bytes]:
    if isinstance(value, (str, bytes, bytearray, memoryview)) or not isinstance(value, Collection):
        raise InvalidTypeError(
            f"{name} must be a collection of 32-byte block hashes, got {type(value).__name__}"
        )
    for key in value:
        if not isinstance(key, bytes):
            raise InvalidTypeError(f"{name} must hold bytes, got {type(key).__name__}")
        if len(key) != _KEY_BYTES:
            raise InvalidArgumentError(
                f"{name} must hold {_KEY_BYTES}-byte block hashes, got {len(key)} bytes"
            )
    return frozenset(value)


def _call_indices(fail_on: object) -> Mapping[str, frozenset[int]]:
    out: dict[str, frozenset[int]] = dict.fromkeys(_OPS, frozenset())
    if fail_on is None:
        return out
    if not isinstance(fail_on, Mapping):
        raise InvalidTypeError(
            f"fail_on must be a mapping of 'lookup', 'read' or 'write' to call indices, got {type(fail_on).__name__}"
        )
    for op, indices in fail_on.items():
        if op not in _OPS:
            raise InvalidArgumentError(f"fail_on keys must be 'lookup', 'read' or 'write', got {op!r}")
        if isinstance(indices, (str, bytes)) or not isinstance(indices, Collection):
            raise InvalidTypeError(
                f"fail_on[{op!r}] must be a collection of call indices, got {type(indices).__name__}"
            )
        for index in indices:
            if isinstance(index, bool) or not isinstance(index, int):
                raise InvalidTypeError(f"fail_on[{op!r}] must hold ints, got {type(index).__name__}")
            if index < 0:
                raise InvalidArgumentError(f"fail_on[{op!r}] call indices must be >= 0, got {index}")
        out[op] = frozenset(indices)
    return out


def _fail_mode(value: object) -> Literal["miss", "raise"]:
    if value == "miss" or value == "raise":
        return value
    raise InvalidArgumentError(f"fail_mode must be 'miss' or 'raise', got {value!r}")


def _seed(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidTypeError(f"seed must be an int, got {type(value).__name__}")
    return value
