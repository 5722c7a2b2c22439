"""Chained, process-stable block hashes.

A block's hash commits to every token before it (the previous block's hash is chained in), to the request's
salt (tenant) and extra keys, and to a *root* that fingerprints the KV layout and the model, so caches of
incompatible layouts can never match. Hashes are sha256 over canonical bytes; they never use Python's
``hash()`` and are therefore identical across processes and ``PYTHONHASHSEED`` values.

The per-block chain runs in C (``aiokv._native._sha``, SHA-256 with the CPU's SHA extensions where present)
when the extension is built, and with struct and hashlib otherwise; both produce the same bytes.
"""

from __future__ import annotations

import hashlib
import operator
import os
import struct
from collections.abc import Callable, Iterable, Sequence

from ._errors import InvalidArgumentError, InvalidTypeError

try:
    from ._native._sha import chain_hashes as _native_chain
except ImportError:  # pragma: no cover - built without a C compiler
    _native_chain = None  # type: ignore[assignment]
if os.environ.get("AIOKV_NATIVE_HASH", "1") == "0":  # hashlib only (to compare, or to rule the C path out)
    _native_chain = None  # type: ignore[assignment]

__all__ = ["NONE_ROOT", "block_hashes", "chain_seed", "make_root", "partial_block_hash"]

_DOMAIN = b"aiokv/block/v1"
NONE_ROOT = hashlib.sha256(b"aiokv/root/v1").digest()
"""The root used when no layout fingerprint is given (tests, replay of token traces)."""


def _canon(value: object, name: str = "hash keys") -> bytes:
    """Canonical, type-tagged bytes for the small set of values allowed in salts and extra keys."""
    if value is None:
        return b"N"
    if isinstance(value, bool):
        return b"B1" if value else b"B0"
    if isinstance(value, int):
        raw = value.to_bytes((value.bit_length() + 8) // 8 or 1, "little", signed=True)
        return b"I" + struct.pack("<I", len(raw)) + raw
    if isinstance(value, str):
        raw = value.encode("utf-8")
        return b"S" + struct.pack("<I", len(raw)) + raw
    if isinstance(value, (bytes, bytearray, memoryview)):
        raw = bytes(value)
        return b"Y" + struct.pack("<I", len(raw)) + raw
    if isinstance(value, (tuple, list)):
        return b"T" + struct.pack("<I", len(value)) + b"".join(_canon(v, name) for v in value)
    raise InvalidTypeError(
        f"{name} must be None, bool, int, str, bytes or tuples of them, got {type(value).__name__}"
    )


_I64_MIN = -(1 << 63)
_I64_MAX = (1 << 63) - 1


def check_token_ids(token_ids: object, name: str = "token_ids") -> list[int]:
    """Validate token ids at the API boundary and return them as a list of ints.

    Accepts ints and int-likes (numpy integers, 0-d tensors: anything with ``__index__``) in the int64 range;
    rejects bools, floats and strings rather than truncating or parsing them, since a wrong token silently
    changes every later block hash.
    """
    if isinstance(token_ids, (str, bytes)) or not isinstance(token_ids, Iterable):
        raise InvalidTypeError(f"{name} must be a sequence of ints, got {type(token_ids).__name__}")
    out: list[int] = []
    append = out.append
    for t in token_ids:
        if type(t) is not int:
            if isinstance(t, bool):
                raise InvalidTypeError(f"{name} must contain ints, got {t!r}")
            try:
                t = operator.index(t)
            except TypeError:
                raise InvalidTypeError(f"{name} must contain ints, got {t!r}") from None
        if t < _I64_MIN or t > _I64_MAX:
            raise InvalidArgumentError(f"{name} must be in the int64 range, got {t}")
        append(t)
    return out


def make_root(fingerprint: bytes = b"", model_id: str | None = None) -> bytes:
    """Root hash mixing a layout fingerprint and an optional model id."""
    return hashlib.sha256(b"aiokv/root/v1" + _canon(bytes(fingerprint)) + _canon(model_id)).digest()


def block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    *,
    salt: object = None,
    extra_keys: Sequence[object] = (),
    root: bytes | None = None,
    parent: bytes | None = None,
) -> list[bytes]:
    """Return the chained hash of every *full* block of ``token_ids``.

    ``hashes[i]`` identifies the prefix ``token_ids[: (i + 1) * block_size]`` together with ``salt``,
    ``extra_keys`` and ``root``. A trailing partial block gets no hash. ``parent`` continues an existing chain
    (the hash of the block just before ``token_ids``), which lets callers hash incrementally. ``root``
    defaults to :data:`NONE_ROOT`; an offloader uses its layout's root (``KVLayout.root``).
    """
    if root is None:
        root = NONE_ROOT
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
        raise InvalidArgumentError(f"block_size must be a positive int, got {block_size!r}")
    if not isinstance(root, (bytes, bytearray)) or len(root) != 32:
        raise InvalidArgumentError("root must be 32 bytes (see aiokv.rules.make_root)")
    if parent is None:
        # Validated before the early return below, so a bad salt fails even for a short prompt.
        if isinstance(extra_keys, (str, bytes)) or not isinstance(extra_keys, Iterable):
            raise InvalidTypeError(f"extra_keys must be a sequence, got {type(extra_keys).__name__}")
        head = _DOMAIN + bytes(root) + _canon(salt, "salt") + _canon(tuple(extra_keys), "extra_keys")
    n_full = len(token_ids) // block_size
    if n_full == 0:
        return []
    if parent is None:
        prev = hashlib.sha256(head).digest()
    else:
        if len(parent) != 32:
            raise InvalidArgumentError("parent must be a 32-byte block hash")
        prev = bytes(parent)
    try:
        return chain_hashes(prev, token_ids, block_size, n_full)
    except struct.error as exc:
        raise InvalidArgumentError(f"token_ids must be ints in the int64 range ({exc})") from None


_PACKERS: dict[int, struct.Struct] = {}


def chain_hashes(prev: bytes, token_ids: Sequence[int], block_size: int, n_full: int) -> list[bytes]:
    """The hashes of the first ``n_full`` blocks of ``token_ids``, chained after ``prev``. Arguments are not
    validated (callers did: ints in the int64 range, ``n_full * block_size <= len(token_ids)``); this is the
    per-block hot path of :func:`block_hashes` and of a request's incremental chain."""
    if _native_chain is not None:
        try:
            return _native_chain(prev, token_ids, 0, block_size, n_full)
        except (TypeError, OverflowError):
            # Not a list or tuple of ints in the int64 range: hashlib's path accepts int-likes (numpy
            # integers, other sequences) and raises struct.error for the rest, as it always did.
            pass
    return _chain_py(prev, token_ids, block_size, n_full)


def chain_hashes_from(
    prev: bytes, token_ids: Sequence[int], start: int, block_size: int, n_blocks: int
) -> list[bytes]:
    """:func:`chain_hashes` of ``token_ids[start : start + n_blocks * block_size]`` without copying the slice
    when the native hasher reads ``token_ids`` in place (a request's growing token list)."""
    if _native_chain is not None:
        try:
            return _native_chain(prev, token_ids, start, block_size, n_blocks)
        except (TypeError, OverflowError):
            pass  # as in chain_hashes
    return _chain_py(prev, token_ids[start : start + n_blocks * block_size], block_size, n_blocks)


def _chain_py(prev: bytes, token_ids: Sequence[int], block_size: int, n_full: int) -> list[bytes]:
    packer = _PACKERS.get(block_size)
    if packer is None:
        packer = _PACKERS[block_size] = struct.Struct(f"<{block_size}q")
    pack = packer.pack
    sha = hashlib.sha256
    out: list[bytes] = []
    for i in range(0, n_full * block_size, block_size):
        prev = sha(prev + pack(*token_ids[i : i + block_size])).digest()
        out.append(prev)
    return out


def _native_agrees(native: Callable[[bytes, Sequence[int], int, int, int], list[bytes]]) -> bool:
    """Whether ``native`` (the C chain hasher) gives hashlib's bytes on fixed vectors: block sizes 1, 16 and
    an odd 17, offsets into the list, tokens at the int64 edges, chains longer than one block. A divergence
    would silently split every persistent cache (no key written by one build would match the other)."""
    edges = [0, 1, -1, 255, 256, 65535, -(1 << 31), (1 << 31) - 1, _I64_MIN, _I64_MAX, 123456789]
    tokens = [(i * 2654435761) % (1 << 62) - (1 << 61) for i in range(200)] + edges * 3
    seeds = [NONE_ROOT, bytes(32), hashlib.sha256(b"aiokv/selftest").digest()]
    try:
        for prev in seeds:
            for bs, start, n in ((1, 0, 5), (16, 0, 12), (16, 16, 3), (17, 5, 11), (16, 200, 2)):
                want = _chain_py(prev, tokens[start : start + bs * n], bs, n)
                if native(prev, tokens, start, bs, n) != want:
                    return False
    except Exception:
        return False
    return True


# Checked once at import: on any mismatch the native hasher is turned off (hashlib gives the same keys, slower),
# with a warning, never a silent split of the cache.
if _native_chain is not None and not _native_agrees(_native_chain):
    import warnings

    warnings.warn(
        "aiokv: the native block hasher (aiokv/_native/_sha.c) disagrees with hashlib on its self-test; "
        "using hashlib (same keys, slower). Please report this build.",
        RuntimeWarning,
        stacklevel=1,
    )
    _native_chain = None  # type: ignore[assignment]

# A request's incremental chain (Request._chain): its token list holds exact ints in the int64 range (open()
# and step() validated them), so the native hasher reads it in place, without chain_hashes_from's frame.
_chain_in_place: Callable[[bytes, Sequence[int], int, int, int], list[bytes]] = (
    _native_chain if _native_chain is not None else chain_hashes_from
)


def chain_seed(*, salt: object = None, extra_keys: Sequence[object] = (), root: bytes | None = None) -> bytes:
    """The value chained into a sequence's first block: root, salt and extra keys."""
    if root is None:
        root = NONE_ROOT
    return hashlib.sha256(_DOMAIN + bytes(root) + _canon(salt) + _canon(tuple(extra_keys))).digest()


def partial_block_hash(parent: bytes, token_ids: Sequence[int]) -> bytes:
    """Key of a partially filled block (``0 < len(token_ids)``) following ``parent`` (the previous block's
    hash, or :func:`chain_seed` for a sequence's first block). Disjoint from full-block hashes."""
    packed = struct.pack(f"<{len(token_ids)}q", *token_ids)
    return hashlib.sha256(
        b"aiokv/partial/v1" + bytes(parent) + struct.pack("<I", len(token_ids)) + packed
    ).digest()
