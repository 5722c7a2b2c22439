"""The native chained hasher (aiokv._native._sha): the same bytes as struct + hashlib on both SHA-256
implementations, and clean errors for every malformed call."""

from __future__ import annotations

import hashlib
import os
import random
import struct
from collections.abc import Iterator

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aiokv import InvalidArgumentError, block_hashes
from aiokv import _hashing as hashing

sha = pytest.importorskip("aiokv._native._sha", reason="the native hasher was not built (no C compiler)")

I64_MIN, I64_MAX = -(2**63), 2**63 - 1
IMPLS = ["portable", "shani"]


@pytest.fixture(params=IMPLS)
def impl(request: pytest.FixtureRequest) -> Iterator[str]:
    """Runs the test once per SHA-256 implementation, restoring the automatic choice afterwards."""
    name: str = request.param
    if name == "shani" and not sha.HAVE_SHANI:
        pytest.skip("this CPU (or the compiler that built the extension) has no SHA extensions")
    previous = sha._set_impl(name)
    try:
        assert sha.impl() == name
        yield name
    finally:
        sha._set_impl(previous)


def reference(prev: bytes, tokens: list[int], start: int, bs: int, n: int) -> list[bytes]:
    out = []
    for i in range(n):
        block = tokens[start + i * bs : start + (i + 1) * bs]
        prev = hashlib.sha256(prev + struct.pack(f"<{bs}q", *block)).digest()
        out.append(prev)
    return out


def random_tokens(rng: random.Random, n: int) -> list[int]:
    """A mix of vocabulary-sized ids, int64 extremes and full-range values."""
    pool = [0, 1, -1, I64_MIN, I64_MAX, I64_MIN + 1, I64_MAX - 1, 2**31, -(2**31), 2**32]
    return [
        rng.choice(pool) if rng.random() < 0.1 else rng.randrange(32_000 if rng.random() < 0.5 else 2**63)
        for _ in range(n)
    ]


# ------------------------------------------------------------------------------------------ digests
# FIPS 180-4 examples and the NIST short/long message vectors, plus lengths around the padding boundaries.
VECTORS = [
    (b"", "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"),
    (b"abc", "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"),
    (
        b"abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq",
        "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1",
    ),
    (
        b"abcdefghbcdefghicdefghijdefghijkefghijklfghijklmghijklmnhijklmnoijklmnopjklmnopqklmnopqrlmnopqrs"
        b"mnopqrstnopqrstu",
        "cf5b16a778af8380036ce59e7b0492370b249b11e8f07a51afac45037afee9d1",
    ),
    (b"a" * 1_000_000, "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0"),
]


@pytest.mark.parametrize(
    ("data", "hexdigest"), VECTORS, ids=["empty", "abc", "448-bit", "896-bit", "million-a"]
)
def test_standard_vectors(impl: str, data: bytes, hexdigest: str) -> None:
    assert sha.sha256(data).hex() == hexdigest


def test_every_length_across_padding_boundaries(impl: str) -> None:
    """Lengths 0..300 cover a tail of 55/56/63/64 bytes (one or two padding blocks) several times over."""
    rng = random.Random(1)
    for n in range(301):
        data = rng.randbytes(n)
        assert sha.sha256(data) == hashlib.sha256(data).digest(), n
    view = memoryview(rng.randbytes(1000))[3:900]
    assert sha.sha256(view) == hashlib.sha256(view).digest()


# ------------------------------------------------------------------------------------------- chains
@pytest.mark.parametrize("bs", [1, 2, 3, 7, 16, 17, 64, 255, 256, 600])
def test_chain_equals_struct_and_hashlib(impl: str, bs: int) -> None:
    """Block sizes whose messages need one, two or many compression blocks, and (600) a buffer too large for
    the stack; several start offsets, including one that is not a multiple of the block size."""
    rng = random.Random(bs)
    tokens = random_tokens(rng, bs * 6 + 5)
    prev = rng.randbytes(32)
    for start in (0, 1, bs, bs + 3):
        n = (len(tokens) - start) // bs
        for count in (n, n - 1, 1):
            assert sha.chain_hashes(prev, tokens, start, bs, count) == reference(
                prev, tokens, start, bs, count
            )


@settings(max_examples=200, deadline=None)
@given(
    tokens=st.lists(st.integers(I64_MIN, I64_MAX), max_size=200),
    bs=st.integers(1, 70),
    start=st.integers(0, 200),
    prev=st.binary(min_size=32, max_size=32),
)
def test_chain_equals_reference_for_any_input(tokens: list[int], bs: int, start: int, prev: bytes) -> None:
    start = min(start, len(tokens))
    n = (len(tokens) - start) // bs
    expect = reference(prev, tokens, start, bs, n)
    for name in ("portable", "shani") if sha.HAVE_SHANI else ("portable",):
        previous = sha._set_impl(name)
        try:
            assert sha.chain_hashes(prev, tokens, start, bs, n) == expect
            assert sha.chain_hashes(prev, tuple(tokens), start, bs, n) == expect
        finally:
            sha._set_impl(previous)


def test_long_chain(impl: str) -> None:
    rng = random.Random(7)
    tokens = random_tokens(rng, 16 * 2000)
    got = sha.chain_hashes(b"\x00" * 32, tokens, 0, 16, 2000)
    assert got == reference(b"\x00" * 32, tokens, 0, 16, 2000)
    assert len(set(got)) == len(got)


class Int(int):
    pass


def test_int64_boundaries_digit_boundaries_and_int_subclasses(impl: str) -> None:
    """Values at the edges of CPython's one-digit ints (read directly) and beyond; bool and other int
    subclasses, which struct packs by value."""
    tokens = [I64_MIN, I64_MAX, -1, 0, True, False, I64_MIN + 1, I64_MAX - 1, Int(5), Int(-(2**40)), Int(0)]
    for k in (15, 30, 31, 32, 60, 62):
        tokens += [2**k - 1, 2**k, -(2**k) + 1, -(2**k), -(2**k) - 1]
    for bs in (1, 2, 8):
        n = len(tokens) // bs
        assert sha.chain_hashes(b"\x11" * 32, tokens, 0, bs, n) == reference(b"\x11" * 32, tokens, 0, bs, n)


def test_zero_blocks_return_an_empty_list(impl: str) -> None:
    assert sha.chain_hashes(b"\x00" * 32, [], 0, 16, 0) == []
    assert sha.chain_hashes(b"\x00" * 32, [1, 2, 3], 3, 16, 0) == []


def test_implementations_agree() -> None:
    if not sha.HAVE_SHANI:
        pytest.skip("this CPU (or the compiler that built the extension) has no SHA extensions")
    rng = random.Random(3)
    tokens = random_tokens(rng, 4096)
    results = {}
    for name in IMPLS:
        previous = sha._set_impl(name)
        try:
            results[name] = sha.chain_hashes(b"\x05" * 32, tokens, 0, 16, 256)
        finally:
            sha._set_impl(previous)
    assert results["portable"] == results["shani"]


def test_set_impl_returns_the_previous_choice() -> None:
    first = sha._set_impl("portable")
    try:
        assert sha.impl() == "portable"
        assert sha._set_impl("auto") == "portable"
        assert sha.impl() == ("shani" if sha.HAVE_SHANI else "portable")
        with pytest.raises(ValueError, match=r"impl must be 'auto', 'portable' or 'shani', got 'fast'"):
            sha._set_impl("fast")
        with pytest.raises(TypeError, match=r"impl must be a str, got int"):
            sha._set_impl(1)  # type: ignore[arg-type]
        if not sha.HAVE_SHANI:
            with pytest.raises(ValueError, match=r"impl 'shani' is not available"):
                sha._set_impl("shani")
        assert sha._set_impl("auto") == "auto"  # the failed calls changed nothing
    finally:
        sha._set_impl(first)


# ------------------------------------------------------------------------------------------- errors
P = b"\x00" * 32


class Index:
    def __index__(self) -> int:
        return 1


@pytest.mark.parametrize(
    ("args", "exc", "match"),
    [
        ((b"\x00" * 31, [1], 0, 1, 1), ValueError, r"prev must be 32 bytes, got 31"),
        ((b"\x00" * 33, [1], 0, 1, 1), ValueError, r"prev must be 32 bytes, got 33"),
        ((bytearray(32), [1], 0, 1, 1), TypeError, r"prev must be bytes, got bytearray"),
        (("x" * 32, [1], 0, 1, 1), TypeError, r"prev must be bytes, got str"),
        ((P, range(4), 0, 1, 1), TypeError, r"token_ids must be a list or tuple, got range"),
        ((P, np.arange(4), 0, 1, 1), TypeError, r"token_ids must be a list or tuple, got numpy.ndarray"),
        ((P, [1, 2], -1, 1, 1), ValueError, r"start must be >= 0, got -1"),
        ((P, [1, 2], 0, 0, 1), ValueError, r"block_size must be in \[1, \d+\], got 0"),
        ((P, [1, 2], 0, 2**62, 0), ValueError, r"block_size must be in \[1, \d+\], got 4611686018427387904"),
        ((P, [1, 2], 0, -3, 1), ValueError, r"block_size must be >= 0, got -3"),
        ((P, [1, 2], 0, 1, -1), ValueError, r"n_blocks must be >= 0, got -1"),
        ((P, [1, 2], 0, 1, 3), ValueError, r"start \+ n_blocks \* block_size must be <= len\(token_ids\)"),
        ((P, [1, 2], 3, 1, 0), ValueError, r"start \+ n_blocks \* block_size must be <= len\(token_ids\)"),
        ((P, [1, 2], 1, 2, 1), ValueError, r"start \+ n_blocks \* block_size must be <= len\(token_ids\)"),
        (
            (P, [1, 2], 0, 1, 2**62),
            ValueError,
            r"start \+ n_blocks \* block_size must be <= len\(token_ids\)",
        ),
        ((P, [1, 2], 0, 1, 2**70), OverflowError, r"too large"),
        ((P, [1, 2], 2**70, 1, 1), OverflowError, r"too large"),
        ((P, [1, 2], 0, 1.0, 1), TypeError, r"block_size must be an int, got float"),
        ((P, [1, 2], Index(), 1, 1), TypeError, r"start must be an int, got Index"),
        ((P, [1, 2.0], 0, 2, 1), TypeError, r"token_ids must contain ints, got float at index 1"),
        ((P, ["1", 2], 0, 2, 1), TypeError, r"token_ids must contain ints, got str at index 0"),
        ((P, [1, None], 0, 1, 2), TypeError, r"token_ids must contain ints, got NoneType at index 1"),
        ((P, [np.int64(1)], 0, 1, 1), TypeError, r"token_ids must contain ints, got numpy.int64 at index 0"),
        ((P, [1, 2**63], 0, 1, 2), OverflowError, r"token_ids\[1\] is outside the int64 range"),
        ((P, (I64_MIN - 1,), 0, 1, 1), OverflowError, r"token_ids\[0\] is outside the int64 range"),
        ((P, [1, 2**200], 0, 2, 1), OverflowError, r"token_ids\[1\] is outside the int64 range"),
    ],
)
def test_bad_calls_raise_clean_errors(args: tuple[object, ...], exc: type[Exception], match: str) -> None:
    with pytest.raises(exc, match=match):
        sha.chain_hashes(*args)  # type: ignore[arg-type]


def test_wrong_argument_counts_raise_type_error() -> None:
    with pytest.raises(TypeError, match=r"chain_hashes expected 5 arguments, got 4"):
        sha.chain_hashes(P, [1], 0, 1)  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        sha.chain_hashes(P, [1], 0, 1, 1, 1)  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        sha.sha256("text")  # type: ignore[arg-type]


def test_bad_token_past_the_hashed_blocks_is_not_read() -> None:
    """Only the requested range is read: a non-int after it does not matter."""
    assert sha.chain_hashes(P, [1, 2, "x"], 0, 2, 1) == reference(P, [1, 2], 0, 2, 1)


# ------------------------------------------------------------------------------------ integration
@pytest.fixture
def python_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hashing, "_native_chain", None)


def _block_hash_cases() -> list[tuple[object, int]]:
    rng = random.Random(11)
    tokens = random_tokens(rng, 1000)
    return [
        (tokens, 16),
        (tokens, 1),
        (tokens, 7),
        (tokens, 256),
        (tuple(tokens), 16),
        ([np.int64(t) for t in tokens[:100]], 16),  # int-likes: the native call declines, hashlib takes them
        (np.array(tokens[:100], dtype=np.int64), 16),
        (range(100), 16),
        ([*tokens[:40], np.int32(5), *tokens[40:80]], 8),  # an int-like after some native-hashable blocks
    ]


def test_block_hashes_same_with_and_without_the_native_hasher(monkeypatch: pytest.MonkeyPatch) -> None:
    cases = _block_hash_cases()
    native = [block_hashes(t, bs, salt="s", extra_keys=(1,)) for t, bs in cases]  # type: ignore[arg-type]
    monkeypatch.setattr(hashing, "_native_chain", None)
    python = [block_hashes(t, bs, salt="s", extra_keys=(1,)) for t, bs in cases]  # type: ignore[arg-type]
    assert native == python
    assert all(native)


def test_chain_hashes_from_matches_a_slice() -> None:
    rng = random.Random(5)
    tokens = random_tokens(rng, 300)
    prev = rng.randbytes(32)
    for start, bs, n in [(0, 16, 18), (16, 16, 5), (3, 7, 40), (300, 16, 0)]:
        expect = reference(prev, tokens, start, bs, n)
        assert hashing.chain_hashes_from(prev, tokens, start, bs, n) == expect
        assert hashing.chain_hashes(prev, tokens[start:], bs, n) == expect


@pytest.mark.usefixtures("python_only")
def test_chain_hashes_from_without_the_native_hasher() -> None:
    rng = random.Random(6)
    tokens = random_tokens(rng, 100)
    assert hashing.chain_hashes_from(P, tokens, 4, 8, 12) == reference(P, tokens, 4, 8, 12)


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize(
    "tokens",
    [[1, 2, 3, 2**63], [1, 2, 3, -(2**63) - 1], [1, 2, 3, 4.0], [1, 2, "3", 4], [None, 1, 2, 3]],
)
def test_bad_tokens_in_block_hashes_raise_as_before(
    monkeypatch: pytest.MonkeyPatch, native: bool, tokens: list[object]
) -> None:
    """The native call's TypeError/OverflowError never escapes: the hashlib path re-raises the public error."""
    if not native:
        monkeypatch.setattr(hashing, "_native_chain", None)
    with pytest.raises(InvalidArgumentError, match=r"token_ids must be ints in the int64 range"):
        block_hashes(tokens, 4)  # type: ignore[arg-type]


def test_the_import_time_self_test_accepts_the_built_hasher_and_refuses_a_wrong_one() -> None:
    assert hashing._native_agrees(sha.chain_hashes)
    assert not hashing._native_agrees(lambda prev, toks, start, bs, n: [bytes(32)] * n)
    no_offset = lambda prev, toks, start, bs, n: hashing._chain_py(prev, toks, bs, n)  # noqa: E731
    assert not hashing._native_agrees(no_offset)

    def raises(*_args: object) -> list[bytes]:
        raise OverflowError("cannot take int64")

    assert not hashing._native_agrees(raises)


_WRONG_NATIVE = """
import sys, types, warnings
fake = types.ModuleType("aiokv._native._sha")
fake.chain_hashes = lambda prev, toks, start, bs, n: [bytes(32)] * n
sys.modules["aiokv._native._sha"] = fake
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    from aiokv import _hashing
    import aiokv
print(_hashing._native_chain is None, _hashing._chain_in_place is _hashing.chain_hashes_from)
print(aiokv.block_hashes([1, 2, 3, 4], 2)[1].hex())
print(" | ".join(str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)))
"""


def test_a_native_hasher_that_disagrees_is_turned_off_at_import_with_a_warning() -> None:
    """A build whose hasher gives other bytes would silently split every persistent cache: it is refused at
    import and hashlib gives the keys (the same as any correct build's)."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "AIOKV_NATIVE_HASH"}  # the check runs on the native path
    out = subprocess.run(
        [sys.executable, "-c", _WRONG_NATIVE], capture_output=True, text=True, timeout=60, env=env
    )
    assert out.returncode == 0, out.stderr
    flags, key, warned = out.stdout.splitlines()
    assert flags == "True True"
    assert key == block_hashes([1, 2, 3, 4], 2)[1].hex()  # this process's hasher, native or not
    assert "disagrees with hashlib" in warned
