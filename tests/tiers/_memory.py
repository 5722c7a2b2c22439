"""In-memory backing tiers for the tier tests (fakes that implement the real interface, httpcore-style).

``MemoryTier`` stores entries in the real entry format (header + payload) and verifies them on read like the
persistent tiers, including the ``_write_damaged`` fault-injection hook. ``PlainTier`` is a bare dict of
payloads without any verification and without the hook (a third-party tier that FaultyTier cannot corrupt).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from aiokv.tiers._base import BackingTier, TierHealth, TierSpec, check_buffers
from aiokv.tiers._format import HEADER_SIZE, Damage, Verdict, check_damage, check_entry, pack_header


@dataclass(frozen=True, slots=True)
class MemoryTierStats:
    health: TierHealth
    entries: int
    lookups: int
    reads: int  # read_into() calls
    read_blocks: int
    writes: int  # write() calls
    stored_blocks: int
    corrupt: int  # entries that failed verification on read (deleted)


class MemoryTier(BackingTier):
    """A dict of ``key -> header + payload`` that verifies every entry it reads."""

    name = "memory"

    def __init__(self) -> None:
        self.entries: dict[bytes, bytes] = {}
        self.spec: TierSpec | None = None
        self.closed = False
        self.verdicts: list[Verdict] = []  # why each rejected entry was rejected
        self._c = dict.fromkeys(
            ("lookups", "reads", "read_blocks", "writes", "stored_blocks", "corrupt"),
            0,
        )

    async def open(self, spec: TierSpec) -> None:
        self.spec = spec

    async def aclose(self) -> None:
        self.closed = True

    def _spec(self) -> TierSpec:
        assert self.spec is not None
        assert not self.closed
        return self.spec

    async def lookup(self, keys: Sequence[bytes]) -> int:
        self._spec()
        self._c["lookups"] += 1
        n = 0
        for key in keys:
            if key not in self.entries:
                break
            n += 1
        return n

    async def read_into(self, keys: Sequence[bytes], outs: Sequence[memoryview]) -> int:
        spec = self._spec()
        check_buffers("outs", keys, outs, spec.payload_bytes)
        self._c["reads"] += 1
        n = 0
        for key, out in zip(keys, outs, strict=True):
            value = self.entries.get(key)
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
                self._c["corrupt"] += 1
                self.verdicts.append(verdict)
                del self.entries[key]
                break
            out.cast("B")[:] = value[HEADER_SIZE:]
            n += 1
        self._c["read_blocks"] += n
        return n

    async def write(self, keys: Sequence[bytes], payloads: Sequence[memoryview]) -> int:
        stored, _ = await self._write_damaged(keys, payloads, [None] * len(keys))
        return stored

    async def _write_damaged(
        self, keys: Sequence[bytes], payloads: Sequence[memoryview], damage: Sequence[Damage | None]
    ) -> tuple[int, int]:
        spec = self._spec()
        check_buffers("payloads", keys, payloads, spec.payload_bytes)
        check_damage(damage, len(keys), spec.payload_bytes)
        self._c["writes"] += 1
        hurt = 0
        for key, payload, dmg in zip(keys, payloads, damage, strict=True):
            value = bytearray(pack_header(key, spec.fingerprint, payload) + bytes(payload))
            if dmg is not None:
                value[dmg[0]] ^= dmg[1]
                hurt += 1
            self.entries[key] = bytes(value)
        self._c["stored_blocks"] += len(keys)
        return len(keys), hurt

    def stats(self) -> MemoryTierStats:
        return MemoryTierStats(health=TierHealth.UP, entries=len(self.entries), **self._c)


class PlainTier(BackingTier):
    """A dict of payloads: no format, no verification, no ``_write_damaged`` hook."""

    name = "plain"

    def __init__(self) -> None:
        self.data: dict[bytes, bytes] = {}
        self.calls: list[str] = []

    async def open(self, spec: TierSpec) -> None:
        self.calls.append("open")

    async def aclose(self) -> None:
        self.calls.append("aclose")

    async def lookup(self, keys: Sequence[bytes]) -> int:
        self.calls.append("lookup")
        n = 0
        for key in keys:
            if key not in self.data:
                break
            n += 1
        return n

    async def read_into(self, keys: Sequence[bytes], outs: Sequence[memoryview]) -> int:
        self.calls.append("read_into")
        n = 0
        for key, out in zip(keys, outs, strict=True):
            payload = self.data.get(key)
            if payload is None:
                break
            out.cast("B")[:] = payload
            n += 1
        return n

    async def write(self, keys: Sequence[bytes], payloads: Sequence[memoryview]) -> int:
        self.calls.append("write")
        for key, payload in zip(keys, payloads, strict=True):
            self.data[key] = bytes(payload)
        return len(keys)

    def stats(self) -> dict[str, int]:
        return {"entries": len(self.data)}
