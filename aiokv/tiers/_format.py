"""The self-describing entry format shared by the persistent tiers (disk, Redis).

An entry is a fixed 128-byte header followed by the payload (one CPU slot). The header is little endian::

    offset size field
         0    4 magic            b"AKV\\x00"
         4    2 version          FORMAT_VERSION
         6    2 header length    HEADER_SIZE
         8    4 flags            0 (reserved)
        12    4 reserved         0
        16    8 payload length
        24    8 sequence         writer's monotonic counter (disk: recency at recovery; Redis: 0)
        32    8 payload checksum xxh3_64(payload)
        40   32 fingerprint      layout fingerprint (TierSpec.fingerprint)
        72   32 key              block hash
       104   16 reserved         zeros
       120    8 header checksum  xxh3_64(header[0:120])

Nothing is ever unpickled: an entry is accepted only when the header checksum, magic, version, header length,
fingerprint, key, payload length *and* the payload checksum all match what the reader expects. Any mismatch is
a miss. xxh3_64 is not cryptographic: it detects torn writes, bit rot and foreign data, not an adversary who
can write to the tier (protect the directory / the Redis server for that).

Fault injection (:class:`aiokv.tiers.FaultyTier`) stores entries damaged *at rest*: a :data:`Damage` names one
byte of the entry (header or payload) that is xor-ed after the header and both checksums were computed, so
the stored entry looks exactly like bit rot and only the reader's verification can catch it. The persistent
tiers accept it through their private ``_write_damaged(keys, payloads, damage)`` hook.
"""

from __future__ import annotations

import enum
import struct
from collections.abc import Sequence

import xxhash

from .._errors import InvalidArgumentError
from ._base import TierHealth

__all__ = [
    "FORMAT_VERSION",
    "Damage",
    "TierHealth",
    "HEADER_SIZE",
    "MAGIC",
    "EntryHeader",
    "Verdict",
    "checksum",
    "check_entry",
    "check_damage",
    "fold_damage",
    "check_header",
    "damaged",
    "pack_header",
    "parse_header",
]

MAGIC = b"AKV\x00"
FORMAT_VERSION = 1
HEADER_SIZE = 128

_HEAD = struct.Struct("<4sHHII QQQ 32s32s16x")
assert _HEAD.size == 120
_HEAD_CRC = struct.Struct("<Q")
_KEY_BYTES = 32


def checksum(data: bytes | bytearray | memoryview) -> int:
    """Payload checksum (xxh3_64)."""
    return xxhash.xxh3_64_intdigest(data)


class Verdict(enum.Enum):
    """Why an entry was accepted or rejected (rejections are misses; counted by reason in tests/stats)."""

    OK = "ok"
    EMPTY = "empty"  # never written (zeros) or no entry at all
    BAD_HEADER = "bad-header"  # foreign magic/version/header length, or header checksum mismatch
    FOREIGN = "foreign"  # valid header for another layout fingerprint
    WRONG_KEY = "wrong-key"
    WRONG_LENGTH = "wrong-length"  # payload length differs from the layout's, or the value is truncated
    BAD_CHECKSUM = "bad-checksum"  # payload does not match its checksum (torn write, bit rot)
    UNDECODABLE = "undecodable"  # an encoded entry that verifies but does not decode (aiokv.tiers._codec)


class EntryHeader:
    """A parsed header (only built for headers whose own checksum is valid)."""

    __slots__ = ("checksum", "fingerprint", "key", "payload_len", "seq")

    def __init__(self, payload_len: int, seq: int, checksum: int, fingerprint: bytes, key: bytes) -> None:
        self.payload_len = payload_len
        self.seq = seq
        self.checksum = checksum
        self.fingerprint = fingerprint
        self.key = key

    def __repr__(self) -> str:
        return (
            f"EntryHeader(key={self.key.hex()[:16]}, payload_len={self.payload_len}, seq={self.seq}, "
            f"fingerprint={self.fingerprint.hex()[:16]})"
        )


def pack_header(
    key: bytes,
    fingerprint: bytes,
    payload: bytes | bytearray | memoryview,
    seq: int = 0,
) -> bytes:
    """The 128-byte header of ``payload`` stored under ``key`` (computes the payload checksum)."""
    if len(key) != _KEY_BYTES:
        raise InvalidArgumentError(f"key must be {_KEY_BYTES} bytes, got {len(key)}")
    if len(fingerprint) != _KEY_BYTES:
        raise InvalidArgumentError(f"fingerprint must be {_KEY_BYTES} bytes, got {len(fingerprint)}")
    head = _HEAD.pack(
        MAGIC,
        FORMAT_VERSION,
        HEADER_SIZE,
        0,
        0,
        memoryview(payload).nbytes,
        seq,
        checksum(payload),
        fingerprint,
        key,
    )
    return head + _HEAD_CRC.pack(xxhash.xxh3_64_intdigest(head))


def parse_header(buf: bytes | bytearray | memoryview) -> EntryHeader | Verdict:
    """Parse and self-check a header; returns a :class:`Verdict` (EMPTY or BAD_HEADER) when it is not one."""
    mv = memoryview(buf)
    if mv.nbytes < HEADER_SIZE:
        return Verdict.WRONG_LENGTH if mv.nbytes else Verdict.EMPTY
    mv = mv[:HEADER_SIZE]
    if mv[:4] != MAGIC:
        return Verdict.EMPTY if not any(mv[:8]) else Verdict.BAD_HEADER
    _magic, version, hlen, _flags, _res, plen, seq, csum, fp, key = _HEAD.unpack_from(mv)
    if version != FORMAT_VERSION or hlen != HEADER_SIZE:
        return Verdict.BAD_HEADER
    (stored,) = _HEAD_CRC.unpack_from(mv, 120)
    if xxhash.xxh3_64_intdigest(mv[:120]) != stored:
        return Verdict.BAD_HEADER
    return EntryHeader(plen, seq, csum, bytes(fp), bytes(key))


def check_header(
    buf: bytes | bytearray | memoryview,
    *,
    fingerprint: bytes,
    payload_len: int,
    key: bytes | None = None,
) -> EntryHeader | Verdict:
    """Parse ``buf``'s header and check it against the reader's layout (and ``key`` when given)."""
    head = parse_header(buf)
    if isinstance(head, Verdict):
        return head
    if head.fingerprint != fingerprint:
        return Verdict.FOREIGN
    if key is not None and head.key != key:
        return Verdict.WRONG_KEY
    if head.payload_len != payload_len:
        return Verdict.WRONG_LENGTH
    return head


def check_entry(
    header: bytes | bytearray | memoryview,
    payload: bytes | bytearray | memoryview,
    *,
    fingerprint: bytes,
    key: bytes,
    payload_len: int,
) -> Verdict:
    """Full verification of one entry: header against the layout and ``key``, the length of what was actually
    read (``payload``) against ``payload_len``, then the payload checksum."""
    head = check_header(header, fingerprint=fingerprint, payload_len=payload_len, key=key)
    if isinstance(head, Verdict):
        return head
    if memoryview(payload).nbytes != payload_len:
        return Verdict.WRONG_LENGTH
    if checksum(payload) != head.checksum:
        return Verdict.BAD_CHECKSUM
    return Verdict.OK


Damage = tuple[int, int]
"""``(offset, mask)``: xor the byte at ``offset`` of the stored entry (``[0, HEADER_SIZE)``: the header,
``[HEADER_SIZE, HEADER_SIZE + payload_len)``: the payload) with ``mask`` (1-255, so the byte really changes)."""


def check_damage(damage: Sequence[Damage | None], n: int, payload_len: int) -> None:
    """Raise :class:`InvalidArgumentError` unless ``damage`` holds ``n`` entries, each ``None`` or a valid
    :data:`Damage` for an entry of ``payload_len`` payload bytes."""
    if len(damage) != n:
        raise InvalidArgumentError(f"damage must have one item per key ({n}), got {len(damage)}")
    for i, item in enumerate(damage):
        if item is None:
            continue
        offset, mask = item
        if not 0 <= offset < HEADER_SIZE + payload_len:
            raise InvalidArgumentError(
                f"damage[{i}] offset must be in [0, {HEADER_SIZE + payload_len}), got {offset}"
            )
        if not 1 <= mask <= 255:
            raise InvalidArgumentError(f"damage[{i}] mask must be in [1, 255], got {mask}")


def fold_damage(damage: Damage, payload_bytes: int) -> Damage:
    """``damage`` moved into an entry of ``payload_bytes`` payload bytes (an encoded entry, shorter than the
    caller's block a fault injector drew the offset over): an offset past its end lands in its payload (the
    same offset modulo its size), one inside it stays where it is (the header stays the header)."""
    offset, mask = damage
    if offset >= HEADER_SIZE + payload_bytes:
        offset = HEADER_SIZE + (offset - HEADER_SIZE) % payload_bytes
    return offset, mask


def damaged(
    header: bytes, payload: bytes | bytearray | memoryview, damage: Damage
) -> tuple[bytes, bytes | bytearray | memoryview]:
    """``(header, payload)`` with :data:`Damage` applied; copies only the part that changes (never writes to the
    caller's ``payload``)."""
    offset, mask = damage
    if offset < HEADER_SIZE:
        head = bytearray(header)
        head[offset] ^= mask
        return bytes(head), payload
    body = bytearray(payload)
    body[offset - HEADER_SIZE] ^= mask
    return header, body
