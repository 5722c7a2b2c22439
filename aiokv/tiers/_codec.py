"""Block encodings of the persistent tiers (``DiskTier(encoding=...)``, ``RedisTier(encoding=...)``).

A tier stores each block's payload (one CPU slot, the layout's tensors back to back) as its *encoded* form
and decodes it into the caller's slot on a read. ``raw`` stores the slot as it is (the default, and the
only encoding that restores the exact bytes). The lossy ones are opt-in:

- ``fp8``: every floating-point tensor's block as float8 e4m3 with one float32 scale per index of its
  block's second-to-last dimension (the head of vLLM's ``(block_size, heads, head_dim)``; a token of a 2-D
  latent block; the whole block of a 1-D one), ``scale = amax / 448``. A bf16 or fp16 block shrinks to a
  little over half (``fp8 holds ~1.99x`` the blocks of raw bf16 with 64-wide heads).
- ``int8``: the same groups, symmetric int8, ``scale = amax / 127``, round to nearest.

Tensors of other dtypes (integers, float8 already) are stored raw inside an encoded block. An encoded block
has a fixed size, so a tier's geometry (disk slots, Redis values) is computed from it. The encoding and its
parameters are mixed into the fingerprint a tier writes into every entry's header
(:meth:`Codec.fingerprint`), so entries written with another encoding (or by another layout) are foreign,
never decoded into this one. A block whose values are not all finite is not encoded (:class:`EncodeError`:
the tier skips it, a miss later); an entry whose scales are not finite and positive does not decode
(:class:`DecodeError`: a miss). Encoding and decoding run in the tiers' I/O threads, in C with the GIL
released (``aiokv/_native/_codec.c``: one pass per block, byte for byte what the torch definitions here
compute), or in torch when the extension is not built or ``AIOKV_NATIVE_CODEC=0``.
"""

from __future__ import annotations

import hashlib
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .._errors import InvalidArgumentError
from ._base import TierSpec
from ._sizing import TIER_ENCODINGS

try:
    from .._native import _codec as _native_codec
except ImportError:  # pragma: no cover - built without a C compiler
    _native_codec = None  # type: ignore[assignment]
if os.environ.get("AIOKV_NATIVE_CODEC", "1") == "0":  # torch only (to compare, or to rule the C path out)
    _native_codec = None  # type: ignore[assignment]

__all__ = [
    "ENCODINGS",
    "Codec",
    "DecodeError",
    "EncodeError",
    "SegmentSpec",
    "check_encoding",
    "make_codec",
    "segments_of",
]

ENCODINGS = TIER_ENCODINGS
"""The encodings a persistent tier accepts (``encoding=``)."""

_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_FP8 = getattr(torch, "float8_e4m3fn", None)
# Every float8 e4m3 byte's value (NaN for 0x7f and 0xff, which the encoder never writes).
_FP8_TABLE = (
    torch.arange(256, dtype=torch.uint8).view(_FP8).float().numpy()
    if _FP8 is not None
    else np.zeros(256, np.float32)
)
_SCALE_BYTES = 4  # float32
# The dtype codes of aiokv/_native/_codec.c's plan records (-1: a part stored as it is).
_DTYPE_CODES = {torch.float16: 1, torch.bfloat16: 2, torch.float32: 3, torch.float64: 4}


class EncodeError(ValueError):
    """A block that cannot be encoded (a value that is not finite): the tier does not store it."""


class DecodeError(ValueError):
    """An entry that passed its checksums but does not decode (scales not finite and positive): a miss."""


@dataclass(frozen=True, slots=True)
class SegmentSpec:
    """One tensor's share of a slot: ``count`` consecutive segments of ``inner_shape`` ``dtype`` elements,
    starting at byte ``offset`` (``count`` > 1 when dimensions before the block dimension split a block)."""

    offset: int
    count: int
    inner_shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return self.count * math.prod(self.inner_shape) * _itemsize(self.dtype)


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def segments_of(layout: Any) -> tuple[SegmentSpec, ...]:
    """The slot structure of a plain :class:`~aiokv.KVLayout` (``()`` for a grouped one: its slots are
    units, not encoded in this version)."""
    if getattr(layout, "grouped", False) or not getattr(layout, "layers", ()):
        return ()
    out = []
    for t, spec in zip(layout.tensors, layout.specs, strict=True):
        inner = tuple(int(s) for s in t.shape[layout.block_dim + 1 :])
        out.append(SegmentSpec(spec.slot_offset, spec.outer, inner, t.dtype))
    return tuple(out)


def check_encoding(encoding: object) -> str:
    """Validate an ``encoding=`` argument; return it."""
    if not isinstance(encoding, str) or encoding not in ENCODINGS:
        raise InvalidArgumentError(f"encoding must be one of {list(ENCODINGS)}, got {encoding!r}")
    if encoding == "fp8" and _FP8 is None:
        raise InvalidArgumentError("encoding='fp8' needs a torch with float8_e4m3fn (torch >= 2.1)")
    return encoding


class _Part:
    """How one segment spec is encoded: raw bytes, or ``groups`` scales then one byte per element."""

    __slots__ = ("elems", "enc_offset", "groups", "quantized", "rows", "spec")

    def __init__(self, spec: SegmentSpec, enc_offset: int, quantized: bool) -> None:
        self.spec = spec
        self.enc_offset = enc_offset
        self.quantized = quantized
        shape = spec.inner_shape
        if len(shape) >= 2:
            self.rows = math.prod(shape[:-2])  # the dims before the grouped one
            self.groups = shape[-2]
            self.elems = shape[-1]
        else:
            self.rows, self.groups, self.elems = 1, 1, math.prod(shape)

    @property
    def scale_count(self) -> int:
        return self.spec.count * self.groups

    @property
    def encoded_bytes(self) -> int:
        if not self.quantized:
            return self.spec.nbytes
        return self.scale_count * _SCALE_BYTES + self.spec.count * self.rows * self.groups * self.elems


def _merged(segments: Sequence[SegmentSpec]) -> list[SegmentSpec]:
    """``segments`` in slot order, adjacent ones of the same dtype and shape merged into one (a model's layers
    usually are: the whole slot is then encoded by one batch of operations)."""
    out: list[SegmentSpec] = []
    for spec in sorted(segments, key=lambda s: s.offset):
        last = out[-1] if out else None
        if (
            last is not None
            and last.dtype == spec.dtype
            and last.inner_shape == spec.inner_shape
            and last.offset + last.nbytes == spec.offset
        ):
            out[-1] = SegmentSpec(last.offset, last.count + spec.count, spec.inner_shape, spec.dtype)
        else:
            out.append(spec)
    return out


class Codec:
    """The encoding of one layout's slots (build with :func:`make_codec`). ``encode(src, dst)`` and
    ``decode(src, dst)`` take byte buffers of :attr:`decoded_bytes` / :attr:`encoded_bytes`."""

    def __init__(self, encoding: str, segments: Sequence[SegmentSpec], decoded_bytes: int) -> None:
        self.encoding = encoding
        self.decoded_bytes = decoded_bytes
        parts = []
        pos = 0
        for spec in _merged(segments):
            part = _Part(spec, pos, spec.dtype in _FLOATS)
            parts.append(part)
            pos += part.encoded_bytes
        self._parts = tuple(parts)
        self.encoded_bytes = pos
        self._qdtype: torch.dtype
        if encoding == "fp8":
            assert _FP8 is not None  # check_encoding refuses fp8 without it
            self._qdtype, self._qmax, self._kind = _FP8, 448.0, 0
        else:
            self._qdtype, self._qmax, self._kind = torch.int8, 127.0, 1
        # The parts as aiokv/_native/_codec.c's int64 records: slot_offset, enc_offset, count, rows, groups,
        # elems, dtype code (-1: stored as it is), nbytes.
        self._plan = np.array(
            [
                (
                    p.spec.offset,
                    p.enc_offset,
                    p.spec.count,
                    p.rows,
                    p.groups,
                    p.elems,
                    _DTYPE_CODES[p.spec.dtype] if p.quantized else -1,
                    p.spec.nbytes,
                )
                for p in parts
            ],
            dtype=np.int64,
        ).tobytes()
        self.native = _native_codec is not None
        """Whether this codec runs in C (``aiokv/_native/_codec.c``) rather than torch."""
        desc = ";".join(
            f"{p.spec.offset}:{p.spec.count}x{list(p.spec.inner_shape)}:{p.spec.dtype}" for p in parts
        )
        self.tag = f"aiokv/encoding/v1;{encoding};groups=dim-2;scale=f32/amax;{desc}".encode()

    def __repr__(self) -> str:
        return f"<Codec {self.encoding} {self.decoded_bytes} -> {self.encoded_bytes} bytes>"

    def fingerprint(self, base: bytes) -> bytes:
        """The 32-byte fingerprint of entries of ``base``'s layout in this encoding."""
        return hashlib.sha256(base + b"|" + self.tag).digest()

    def stored_spec(self, spec: TierSpec) -> TierSpec:
        """What a tier stores for blocks of ``spec`` in this encoding: the encoded payload, under the
        encoding's own fingerprint (entries of another encoding, or raw, are another layout to the tier:
        never decoded)."""
        return TierSpec(
            payload_bytes=self.encoded_bytes,
            fingerprint=self.fingerprint(spec.fingerprint),
            block_size=spec.block_size,
            description=f"{spec.description} (encoding {self.encoding})",
            segments=spec.segments,
        )

    def encode(self, src: Any, dst: Any) -> None:
        """Encode the slot ``src`` into ``dst``; :class:`EncodeError` when a value is not finite."""
        if self.native:
            if _native_codec.encode(self._plan, src, dst, self._kind):
                raise EncodeError("a value of the block is not finite")
            return
        self._encode_torch(src, dst)

    def _encode_torch(self, src: Any, dst: Any) -> None:
        s = torch.frombuffer(_writable(src), dtype=torch.uint8)
        d = torch.frombuffer(dst, dtype=torch.uint8)
        for part in self._parts:
            spec = part.spec
            raw = s[spec.offset : spec.offset + spec.nbytes]
            out = d[part.enc_offset : part.enc_offset + part.encoded_bytes]
            if not part.quantized:
                out.copy_(raw)
                continue
            x = raw.view(spec.dtype).view(spec.count, part.rows, part.groups, part.elems).float()
            amax = x.abs().amax(dim=(1, 3))  # (count, groups)
            if not bool(torch.isfinite(amax).all()):
                raise EncodeError("a value of the block is not finite")
            scale = torch.where(amax > 0, amax / self._qmax, torch.ones_like(amax))
            n_scale = part.scale_count * _SCALE_BYTES
            out[:n_scale].view(torch.float32).copy_(scale.reshape(-1))
            q = x / scale.view(spec.count, 1, part.groups, 1)
            if self._qdtype is torch.int8:
                q = q.round_()
            q = q.clamp_(-self._qmax, self._qmax).to(self._qdtype)
            out[n_scale:].copy_(q.reshape(-1).view(torch.uint8))

    def decode(self, src: Any, dst: Any) -> None:
        """Decode the entry payload ``src`` into the slot ``dst``; :class:`DecodeError` when it is not one."""
        if self.native:
            if _native_codec.decode(self._plan, src, dst, self._kind):
                raise DecodeError("an entry's scales are not finite and positive")
            return
        self._decode_torch(src, dst)

    def _decode_torch(self, src: Any, dst: Any) -> None:
        s = torch.frombuffer(_writable(src), dtype=torch.uint8)
        d = torch.frombuffer(dst, dtype=torch.uint8)
        for part in self._parts:
            spec = part.spec
            enc = s[part.enc_offset : part.enc_offset + part.encoded_bytes]
            out = d[spec.offset : spec.offset + spec.nbytes]
            if not part.quantized:
                out.copy_(enc)
                continue
            n_scale = part.scale_count * _SCALE_BYTES
            scale = enc[:n_scale].view(torch.float32).view(spec.count, 1, part.groups, 1)
            if not bool((torch.isfinite(scale) & (scale > 0)).all()):
                raise DecodeError("an entry's scales are not finite and positive")
            shape = (spec.count, part.rows, part.groups, part.elems)
            if self._qdtype is torch.int8:
                values = enc[n_scale:].view(torch.int8).view(shape).float()
            else:  # torch's float8 -> float32 conversion is slow on CPUs: a 256-entry table instead
                values = torch.from_numpy(np.take(_FP8_TABLE, enc[n_scale:].numpy())).view(shape)
            out.view(spec.dtype).view(shape).copy_(values.mul_(scale))


def _writable(buf: Any) -> Any:
    """``buf``, or a copy of it when it is read-only (``bytes`` from Redis): torch views writable memory only
    (it is only read here)."""
    view = memoryview(buf)
    return bytearray(view) if view.readonly else buf


def make_codec(encoding: str, segments: Sequence[SegmentSpec], decoded_bytes: int) -> Codec | None:
    """The codec of ``encoding`` for slots of ``segments`` (``None`` for ``raw``: stored as they are)."""
    check_encoding(encoding)
    if encoding == "raw":
        return None
    if not segments:
        raise InvalidArgumentError(
            f"encoding={encoding!r} needs the layout's tensor shapes (a plain KVLayout, the tier opened by an "
            "Offloader); a layout from KVLayout.from_groups is stored raw: use encoding='raw'"
        )
    if sum(s.nbytes for s in segments) != decoded_bytes:
        raise InvalidArgumentError(
            f"segments must cover the payload: {sum(s.nbytes for s in segments)} bytes of {decoded_bytes}"
        )
    return Codec(encoding, segments, decoded_bytes)
