"""Chained block hashes: semantics, key separation, layout fingerprints and stability across processes."""

from __future__ import annotations

import hashlib
import inspect
import json
import os
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from aiokv import InvalidArgumentError, InvalidTypeError, KVLayout, block_hashes
from aiokv._hashing import check_token_ids
from aiokv.rules import NONE_ROOT, make_root

REPO = Path(__file__).resolve().parents[2]

# Golden values. They pin the on-disk / Redis key format: a disk or Redis tier filled by one aiokv version is
# only reusable by another if these stay the same, so a change here must come with a format version bump
# (the ``aiokv/block/v1`` domain string) and a changelog entry. Computed once with aiokv 0.1.0:
#   block_hashes(list(range(32)), 16)                       -> GOLDEN_PLAIN (two blocks)
#   block_hashes(list(range(16)), 16, salt="tenant", extra_keys=("lora", 3),
#                root=make_root(b"\x01" * 32, "llama"))[0]  -> GOLDEN_KEYED
GOLDEN_PLAIN = [
    "936ab93b9089eb9edc70690b9e98827376bf19302274b5685a7ba0db29c0a388",
    "80658d55fc9a28aaec56097f25c378b71adbec2d6ebbc19d6413b584ddc4301e",
]
GOLDEN_KEYED = "fec37c0ec597bb3b423e3dd11b7d6a8dedf3dc60d831a92e0f86cfc44dd11ab2"

tokens_st = st.lists(st.integers(min_value=-(2**63), max_value=2**63 - 1), max_size=80)


def golden_inputs() -> dict[str, list[str]]:
    """The values compared across processes (also run, as source, in the subprocesses)."""
    return {
        "plain": [h.hex() for h in block_hashes(list(range(32)), 16)],
        "keyed": [
            h.hex()
            for h in block_hashes(
                list(range(16)),
                16,
                salt="tenant",
                extra_keys=("lora", 3),
                root=make_root(b"\x01" * 32, "llama"),
            )
        ],
        "salts": [block_hashes([7] * 4, 4, salt=s)[0].hex() for s in (None, 0, "a", b"a", ("a", 1), True)],
        "root": [NONE_ROOT.hex(), make_root(b"fp", "m").hex()],
    }


# The child loads aiokv's hashing module without running ``aiokv/__init__`` (which imports torch: seconds per
# process on a small machine) by registering a bare package object first.
_CHILD = f"""
import json, sys, types
pkg = types.ModuleType("aiokv")
pkg.__path__ = [{str(REPO / "aiokv")!r}]
sys.modules["aiokv"] = pkg
from aiokv._hashing import NONE_ROOT, block_hashes, make_root
assert "torch" not in sys.modules
{textwrap.dedent(inspect.getsource(golden_inputs))}
print(json.dumps({{"aiokv": golden_inputs(), "str_hash": hash("aiokv")}}))
"""


# --------------------------------------------------------------------------------------- semantics
def test_golden_digests() -> None:
    got = golden_inputs()
    assert got["plain"] == GOLDEN_PLAIN
    assert got["keyed"] == [GOLDEN_KEYED]


def test_format_is_sha256_chained_over_int64_tokens() -> None:
    """The documented format, recomputed from scratch: seed = sha256(domain | root | salt | extra_keys),
    then h_i = sha256(h_{i-1} | tokens of block i as little-endian int64)."""
    seed = hashlib.sha256(b"aiokv/block/v1" + NONE_ROOT + b"N" + b"T" + struct.pack("<I", 0)).digest()
    h0 = hashlib.sha256(seed + struct.pack("<16q", *range(16))).digest()
    h1 = hashlib.sha256(h0 + struct.pack("<16q", *range(16, 32))).digest()
    assert block_hashes(list(range(32)), 16) == [h0, h1]
    assert hashlib.sha256(b"aiokv/root/v1").digest() == NONE_ROOT


def test_partial_trailing_block_gets_no_hash() -> None:
    assert block_hashes(list(range(15)), 16) == []
    full = block_hashes(list(range(32)), 16)
    assert block_hashes(list(range(47)), 16) == full
    assert len(block_hashes(list(range(48)), 16)) == 3
    assert all(len(h) == 32 and isinstance(h, bytes) for h in full)


@settings(max_examples=60, deadline=None)
@given(tokens=tokens_st, block_size=st.integers(1, 9), cut=st.integers(0, 80))
def test_parent_continuation_equals_one_shot(tokens: list[int], block_size: int, cut: int) -> None:
    one_shot = block_hashes(tokens, block_size, salt="s", extra_keys=(1,))
    k = min(cut // block_size, len(one_shot))
    head = block_hashes(tokens[: k * block_size], block_size, salt="s", extra_keys=(1,))
    tail = block_hashes(
        tokens[k * block_size :], block_size, parent=head[-1] if head else None, salt="s", extra_keys=(1,)
    )
    assert head + tail == one_shot


@settings(max_examples=60, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 50_000), min_size=8, max_size=40),
    pos=st.integers(0, 39),
    block_size=st.integers(1, 8),
)
def test_hash_i_depends_on_every_earlier_token(tokens: list[int], pos: int, block_size: int) -> None:
    pos %= len(tokens)
    changed = list(tokens)
    changed[pos] += 1
    a, b = block_hashes(tokens, block_size), block_hashes(changed, block_size)
    first_affected = pos // block_size
    assert a[:first_affected] == b[:first_affected]  # blocks before the change are unaffected
    for i in range(first_affected, len(a)):
        assert a[i] != b[i]  # and every block from the changed one on differs
    assert len(set(a)) == len(a)  # chaining: equal blocks at different depths hash differently


def test_identical_block_contents_hash_differently_at_different_depths() -> None:
    h = block_hashes([5] * 12, 4)
    assert len(set(h)) == 3


# --------------------------------------------------------------------------------------- separation
def test_salt_extra_keys_and_root_make_hashes_disjoint() -> None:
    tokens = list(range(64))
    variants = {
        "plain": block_hashes(tokens, 16),
        "salt-a": block_hashes(tokens, 16, salt="a"),
        "salt-b": block_hashes(tokens, 16, salt="b"),
        "salt-int": block_hashes(tokens, 16, salt=1),
        "salt-str-1": block_hashes(tokens, 16, salt="1"),
        "salt-bytes": block_hashes(tokens, 16, salt=b"a"),
        "salt-true": block_hashes(tokens, 16, salt=True),
        "salt-tuple": block_hashes(tokens, 16, salt=("a",)),
        "extra": block_hashes(tokens, 16, extra_keys=("lora-1",)),
        "extra-2": block_hashes(tokens, 16, extra_keys=("lora-2",)),
        "extra-split": block_hashes(tokens, 16, extra_keys=("lora", "-1")),
        "root": block_hashes(tokens, 16, root=make_root(b"x")),
        "root-model": block_hashes(tokens, 16, root=make_root(b"x", "model")),
    }
    seen: dict[bytes, str] = {}
    for name, hashes in variants.items():
        assert len(hashes) == 4
        for h in hashes:
            assert h not in seen, f"{name} collides with {seen.get(h)}"
            seen[h] = name


def test_extra_keys_list_and_tuple_are_the_same_key() -> None:
    assert block_hashes([1] * 4, 4, extra_keys=["a", 1]) == block_hashes([1] * 4, 4, extra_keys=("a", 1))


def test_make_root_mixes_fingerprint_and_model() -> None:
    roots = {
        make_root(),
        make_root(b"a"),
        make_root(b"b"),
        make_root(b"a", "m1"),
        make_root(b"a", "m2"),
        make_root(b"", "m1"),
    }
    assert len(roots) == 6
    assert make_root(b"a", "m1") == make_root(bytearray(b"a"), "m1")


# -------------------------------------------------------------------------------------- fingerprint
def fp(
    *shape: int,
    dtype: torch.dtype = torch.float16,
    block_size: int = 16,
    block_dim: int = 0,
    model_id: str | None = None,
) -> bytes:
    t = torch.zeros(*shape, dtype=dtype)
    return KVLayout(
        [t, t.clone()], block_size=block_size, block_dim=block_dim, token_dim=None, model_id=model_id
    ).fingerprint


def test_layout_fingerprint_ignores_num_blocks_only() -> None:
    base = fp(8, 16, 2, 4)
    assert fp(100, 16, 2, 4) == base  # more blocks: the same cache format
    assert fp(8, 16, 2, 4, dtype=torch.bfloat16) != base
    assert fp(8, 16, 2, 4, dtype=torch.float32) != base
    assert fp(8, 16, 2, 4, block_size=8) != base
    assert fp(8, 16, 4, 4) != base  # per-block shape (heads)
    assert fp(8, 16, 2, 8) != base  # per-block shape (head dim)
    assert fp(8, 16, 2, 4, model_id="m") != base
    t = torch.zeros(8, 16, 2, 4, dtype=torch.float16)
    assert KVLayout([t, t.clone(), t.clone()], block_size=16).fingerprint != base  # number of tensors


def test_layout_root_separates_caches_of_different_layouts() -> None:
    a = KVLayout([torch.zeros(4, 16, 8)], block_size=16)
    b = KVLayout([torch.zeros(4, 16, 8, dtype=torch.float16)], block_size=16)
    assert a.root != b.root
    assert block_hashes(list(range(16)), 16, root=a.root) != block_hashes(list(range(16)), 16, root=b.root)
    assert a.root == make_root(a.fingerprint, None)


# --------------------------------------------------------------------------------------------- input
@pytest.mark.parametrize(
    ("kwargs", "exc", "match"),
    [
        ({"block_size": 0}, InvalidArgumentError, r"block_size must be a positive int, got 0"),
        ({"block_size": 2.0}, InvalidArgumentError, r"block_size must be a positive int, got 2.0"),
        ({"root": b"short"}, InvalidArgumentError, r"root must be 32 bytes"),
        ({"root": "x" * 32}, InvalidArgumentError, r"root must be 32 bytes"),
        ({"parent": b"\x00" * 31}, InvalidArgumentError, r"parent must be a 32-byte block hash"),
        (
            {"salt": 1.5},
            InvalidTypeError,
            r"salt must be None, bool, int, str, bytes or tuples of them, got float",
        ),
        ({"salt": {"tenant": 1}}, InvalidTypeError, r"salt must be .* got dict"),
        ({"salt": ("ok", 2.5)}, InvalidTypeError, r"salt must be .* got float"),
        ({"extra_keys": (object(),)}, InvalidTypeError, r"extra_keys must be .* got object"),
        ({"extra_keys": 5}, InvalidTypeError, r"extra_keys must be a sequence, got int"),
        ({"extra_keys": "lora"}, InvalidTypeError, r"extra_keys must be a sequence, got str"),
    ],
)
def test_bad_arguments_are_rejected(kwargs: dict[str, object], exc: type[Exception], match: str) -> None:
    args: dict[str, object] = {"block_size": 4, **kwargs}
    with pytest.raises(exc, match=match):
        block_hashes([1, 2, 3, 4], **args)  # type: ignore[arg-type]
    if "salt" in kwargs or "extra_keys" in kwargs:  # also for a prompt shorter than one block
        with pytest.raises(exc, match=match):
            block_hashes([1], **args)  # type: ignore[arg-type]


@pytest.mark.parametrize("tokens", [[1, 2, 3, 2**63], [1, 2, 3, -(2**63) - 1]])
def test_tokens_outside_int64_are_rejected(tokens: list[int]) -> None:
    with pytest.raises(InvalidArgumentError, match=r"token_ids must be ints in the int64 range"):
        block_hashes(tokens, 4)


def test_check_token_ids_accepts_ints_and_int_likes() -> None:
    assert check_token_ids([1, 2**63 - 1, -(2**63)]) == [1, 2**63 - 1, -(2**63)]
    assert check_token_ids(np.array([3, 4], dtype=np.int32)) == [3, 4]
    assert check_token_ids([np.int64(5), torch.tensor(6)]) == [5, 6]
    assert check_token_ids(range(3)) == [0, 1, 2]
    assert check_token_ids(()) == []


@pytest.mark.parametrize(
    ("tokens", "exc", "match"),
    [
        ([1, 2.0], InvalidTypeError, r"prompt_token_ids must contain ints, got 2.0"),
        ([1.5], InvalidTypeError, r"prompt_token_ids must contain ints, got 1.5"),
        (["7"], InvalidTypeError, r"prompt_token_ids must contain ints, got '7'"),
        ([True], InvalidTypeError, r"prompt_token_ids must contain ints, got True"),
        ([None], InvalidTypeError, r"prompt_token_ids must contain ints, got None"),
        ("123", InvalidTypeError, r"prompt_token_ids must be a sequence of ints, got str"),
        (7, InvalidTypeError, r"prompt_token_ids must be a sequence of ints, got int"),
        (
            [2**63],
            InvalidArgumentError,
            r"prompt_token_ids must be in the int64 range, got 9223372036854775808",
        ),
        ([-(2**63) - 1], InvalidArgumentError, r"prompt_token_ids must be in the int64 range"),
    ],
)
def test_check_token_ids_rejects_what_would_change_hashes_silently(
    tokens: object, exc: type[Exception], match: str
) -> None:
    with pytest.raises(exc, match=match):
        check_token_ids(tokens, "prompt_token_ids")


# ----------------------------------------------------------------------------------------- processes
def test_hashes_are_stable_across_processes_and_hash_seeds() -> None:
    children = {
        seed: subprocess.Popen(
            [sys.executable, "-c", _CHILD],
            env={**os.environ, "PYTHONHASHSEED": seed},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=REPO,
        )
        for seed in ("0", "12345", "random")
    }
    results = {}
    for seed, child in children.items():
        out, err = child.communicate(timeout=60)
        assert child.returncode == 0, err
        results[seed] = json.loads(out)
    # The seeds took effect: Python's own str hash differs between the processes ...
    assert results["0"]["str_hash"] != results["12345"]["str_hash"]
    # ... while aiokv's hashes are the same everywhere, and equal to the golden values.
    expected = golden_inputs()
    for seed, result in results.items():
        assert result["aiokv"] == expected, f"PYTHONHASHSEED={seed}"
    assert expected["plain"] == GOLDEN_PLAIN
