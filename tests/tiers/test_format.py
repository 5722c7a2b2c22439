"""The entry format: every foreign, damaged or truncated entry is rejected before its bytes are accepted."""

from __future__ import annotations

import hashlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aiokv._errors import InvalidArgumentError
from aiokv.tiers._format import (
    HEADER_SIZE,
    MAGIC,
    EntryHeader,
    TierHealth,
    Verdict,
    check_entry,
    check_header,
    pack_header,
    parse_header,
)

FP = hashlib.sha256(b"layout-a").digest()
FP_OTHER = hashlib.sha256(b"layout-b").digest()
KEY = hashlib.sha256(b"block-0").digest()
PAYLOAD = bytes(range(256)) * 4


def _check(header: bytes | bytearray, payload: bytes | bytearray, **kw: object) -> Verdict:
    args: dict[str, object] = {"fingerprint": FP, "key": KEY, "payload_len": len(PAYLOAD)}
    args.update(kw)
    return check_entry(header, payload, **args)  # type: ignore[arg-type]


def test_round_trip_is_accepted() -> None:
    header = pack_header(KEY, FP, PAYLOAD, seq=7)
    assert len(header) == HEADER_SIZE
    assert header[:4] == MAGIC
    parsed = parse_header(header)
    assert isinstance(parsed, EntryHeader)
    assert (parsed.key, parsed.fingerprint, parsed.payload_len, parsed.seq) == (KEY, FP, len(PAYLOAD), 7)
    assert _check(header, PAYLOAD) is Verdict.OK


def test_header_over_memoryview_payload_matches_bytes() -> None:
    assert pack_header(KEY, FP, memoryview(bytearray(PAYLOAD))) == pack_header(KEY, FP, PAYLOAD)


def test_zero_header_is_empty() -> None:
    assert parse_header(bytes(HEADER_SIZE)) is Verdict.EMPTY
    assert parse_header(b"") is Verdict.EMPTY


def test_foreign_fingerprint_key_and_length_are_rejected() -> None:
    header = pack_header(KEY, FP, PAYLOAD)
    assert _check(header, PAYLOAD, fingerprint=FP_OTHER) is Verdict.FOREIGN
    assert _check(header, PAYLOAD, key=hashlib.sha256(b"other").digest()) is Verdict.WRONG_KEY
    assert _check(header, PAYLOAD, payload_len=len(PAYLOAD) + 1) is Verdict.WRONG_LENGTH
    assert _check(header, PAYLOAD[:-1]) is Verdict.WRONG_LENGTH


def test_truncated_header_is_rejected() -> None:
    header = pack_header(KEY, FP, PAYLOAD)
    assert check_header(header[:-1], fingerprint=FP, payload_len=len(PAYLOAD)) is Verdict.WRONG_LENGTH


def test_pickle_or_garbage_is_rejected() -> None:
    import pickle

    garbage = pickle.dumps({"payload": PAYLOAD}) + bytes(HEADER_SIZE)
    assert _check(garbage[:HEADER_SIZE], PAYLOAD) is Verdict.BAD_HEADER


@settings(max_examples=200, deadline=None)
@given(pos=st.integers(0, HEADER_SIZE + len(PAYLOAD) - 1), bit=st.integers(0, 7))
def test_any_bit_flip_is_rejected(pos: int, bit: int) -> None:
    entry = bytearray(pack_header(KEY, FP, PAYLOAD) + PAYLOAD)
    entry[pos] ^= 1 << bit
    assert _check(entry[:HEADER_SIZE], entry[HEADER_SIZE:]) is not Verdict.OK


def test_bad_key_length_raises() -> None:
    with pytest.raises(InvalidArgumentError, match="key must be 32 bytes, got 3"):
        pack_header(b"abc", FP, PAYLOAD)
    with pytest.raises(InvalidArgumentError, match="fingerprint must be 32 bytes, got 0"):
        pack_header(KEY, b"", PAYLOAD)


def test_health_compares_to_its_string() -> None:
    assert TierHealth.UP == "up"
    assert str(TierHealth.DOWN) == "down"
