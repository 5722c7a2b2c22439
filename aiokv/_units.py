"""Sizes and bandwidths as people write them: one grammar for every option of aiokv (``aiokv serve`` and
``aiokv replay`` flags, ``AIOKV_*`` variables, the vLLM connector's keys).

A quantity is a number, optional spaces and a unit (docs/serving.md, "Sizes and bandwidths"):

- bytes: a unit ending in an upper-case ``B``: ``B``, decimal ``kB``/``KB`` ``MB`` ``GB`` ``TB`` ``PB``
  (powers of 1000), binary ``KiB`` ``MiB`` ``GiB`` ``TiB`` ``PiB`` (powers of 1024); a bare number or a bare
  prefix (``4096``, ``64G``, ``64Gi``) is bytes too;
- bits: a unit ending in ``bit`` (``Gbit``, ``Mbit``, ``Gibit``), or ``bps`` for a rate (``10Gbps``);
  bandwidths only: a size in bits is refused;
- a lower-case ``b`` after a prefix (``Gb``, ``gb``, ``Mb``, ``kib``) or alone is refused as ambiguous (bits
  to a network engineer, bytes to many others), with an error that says what to write.

Prefixes are case-insensitive (``k`` = ``K``, ``g`` = ``G``). A bandwidth may end in ``/s`` (``25GB/s``,
``10Gbit/s``). :func:`format_size` writes a size back for people (``3 GiB``). Standard library only.
"""

from __future__ import annotations

import math
import re

from ._errors import InvalidArgumentError, InvalidTypeError

__all__ = ["format_size", "parse_assignments", "parse_bandwidth", "parse_size"]

_PREFIX = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12, "p": 10**15}
_BINARY = {"k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40, "p": 2**50}
_QUANTITY = re.compile(r"^\s*([+-]?(?:[0-9]*\.)?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*$")
_UNIT = re.compile(r"^(?P<prefix>[kKmMgGtTpP]?)(?P<bin>[iI]?)(?P<base>B|b|bits?|)$")
_INFINITE = ("inf", "infinite", "unlimited")


def _scan(text: str, what: str, expected: str, shown: str) -> tuple[str, float, str, str, str] | None:
    """``"64 GiB"`` -> ``("64", 64.0, "G", "i", "B")``; ``None`` for unlimited. Refuses what is not a
    quantity at all."""
    if text.strip().lower() in _INFINITE:
        return None
    m = _QUANTITY.match(text)
    unit = _UNIT.match(m.group(2)) if m else None
    if m is None or unit is None or (unit.group("bin") and not unit.group("prefix")):
        raise InvalidArgumentError(f"{what} must be {expected}, got {shown!r}")
    number = m.group(1)
    return number, float(number), unit.group("prefix"), unit.group("bin"), unit.group("base")


def _factor(prefix: str, binary: str) -> int:
    return (_BINARY if binary else _PREFIX)[prefix.lower()]


def _upper(prefix: str) -> str:
    """The prefix as written in a unit: ``kB`` (SI's lower-case kilo), ``MB``, ``GB``..."""
    return "k" if prefix.lower() == "k" else prefix.upper()


def _bytes_spelling(number: str, prefix: str) -> str:
    return f"{number}{_upper(prefix)}B or {number}{prefix.upper()}iB" if prefix else f"{number}B"


def parse_size(text: str, *, what: str = "size") -> int | None:
    """``"64GiB"`` -> 68719476736 bytes; decimal (kB, MB, GB, TB, PB) and binary (KiB ... PiB) units, plain
    bytes, and ``"inf"``/``"unlimited"`` -> ``None`` (no limit). Sizes are in bytes: ``"64Gbit"`` is refused,
    and so is the ambiguous ``"64Gb"`` (write ``64GB`` or ``64GiB``). Fractions of a byte are dropped."""
    if not isinstance(text, str):
        raise InvalidTypeError(f"{what} must be a string such as 64GiB, got {type(text).__name__}")
    scanned = _scan(text, what, "a number of bytes with an optional unit such as 64GiB", text)
    if scanned is None:
        return None
    number, value, prefix, binary, base = scanned
    if base == "b":
        raise InvalidArgumentError(
            f"{what} must be in bytes, got {text!r} (a lower-case b reads as bits): "
            f"write {_bytes_spelling(number, prefix)}"
        )
    if base.startswith("bit"):
        raise InvalidArgumentError(
            f"{what} must be in bytes, not bits, got {text!r}: write {value / 8:g}{_upper(prefix)}{binary}B"
        )
    return int(_at_least_one_byte(value * _factor(prefix, binary), text, what, ""))


def _at_least_one_byte(value: float, text: str, what: str, per: str) -> float:
    if math.isinf(value):
        raise InvalidArgumentError(f"{what} must be a finite number of bytes{per}, got {text!r}")
    if value < 1:
        raise InvalidArgumentError(f"{what} must be at least 1 byte{per}, got {text!r}")
    return value


def parse_bandwidth(text: str, *, what: str = "bandwidth") -> float:
    """``"25GB/s"`` -> 25e9 bytes per second, ``"10Gbit/s"`` or ``"10Gbps"`` -> 1.25e9 (the ``/s`` is
    optional). Bandwidths are finite and at least 1 byte per second; the ambiguous ``"10Gb/s"`` is refused
    (write ``10GB/s`` for bytes or ``10Gbit/s`` for bits)."""
    if not isinstance(text, str):
        raise InvalidTypeError(f"{what} must be a string such as 25GB/s, got {type(text).__name__}")
    stripped = text.strip()
    if stripped.lower().endswith("/s"):
        stripped = stripped[:-2].rstrip()
    elif stripped.endswith("bps"):  # 10Gbps: bits per second, always
        stripped = stripped[:-3] + "bit"
    elif stripped.endswith("Bps"):
        stripped = stripped[:-2]
    scanned = _scan(stripped, what, "a number with an optional unit such as 25GB/s or 10Gbit/s", text)
    if scanned is None:
        raise InvalidArgumentError(f"{what} must be finite, got {text!r}")
    number, value, prefix, binary, base = scanned
    if base == "b":
        p = _upper(prefix) if not binary else prefix.upper()
        raise InvalidArgumentError(
            f"{what} must say bytes or bits, got {text!r} (a lower-case b is ambiguous): "
            f"write {number}{p}{binary}B/s for bytes or {number}{p}{binary}bit/s for bits per second"
        )
    scale = _factor(prefix, binary) / (8 if base.startswith("bit") else 1)
    return _at_least_one_byte(value * scale, text, what, " per second")


def parse_assignments(text: str, what: str) -> list[tuple[str, str]]:
    """``"cpu=64GiB,disk=1TiB"`` -> ``[("cpu", "64GiB"), ("disk", "1TiB")]``; a name may appear once."""
    out: list[tuple[str, str]] = []
    for part in text.split(","):
        name, sep, value = part.partition("=")
        if not sep or not name.strip() or not value.strip():
            raise InvalidArgumentError(f"{what} must look like name=value[,name=value...], got {text!r}")
        if name.strip() in (n for n, _ in out):
            raise InvalidArgumentError(f"{what} must name {name.strip()!r} only once, got {text!r}")
        out.append((name.strip(), value.strip()))
    return out


def format_size(n: float | None) -> str:
    """Binary units, three significant digits: ``format_size(3 * 2**30) == "3 GiB"``."""
    if n is None or math.isinf(n):
        return "inf"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            if unit == "B":
                return f"{int(value)} B"
            return f"{value:.3g} {unit}"
        value /= 1024
    raise AssertionError("unreachable")  # pragma: no cover
