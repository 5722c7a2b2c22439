"""Request bodies as JSON, parsed in pieces so that no single call holds the interpreter for long.

``json.loads`` runs in C without releasing the GIL: on a 4 MiB body of token ids it holds it for about 120 ms,
so even in a worker thread it stalls the event loop that long. :func:`loads` gives the same values (and
refuses ``NaN`` and ``Infinity``, which are not JSON) but drives objects and arrays from Python, one element
at a time, and parses runs of numbers (a list of token ids) ``CHUNK`` characters at a time with the C
decoder; between those calls another thread can take the GIL. Run it in a worker thread for a large body (a
small one costs about what ``json.loads`` does: strings and numbers are still parsed in C).
"""

from __future__ import annotations

import json
import json.decoder
import json.scanner
import re
from collections.abc import Callable
from json import JSONDecodeError
from typing import Any

__all__ = ["CHUNK", "MAX_DEPTH", "JSONDecodeError", "TooManyValues", "loads"]

CHUNK = 1 << 16
"""Characters one C call parses at most (a run of numbers; a single string or number is parsed whole)."""
MAX_DEPTH = 64
"""Nesting of arrays and objects at most (an OpenAI request nests 4 deep)."""


class TooManyValues(ValueError):
    """The document has more values than :func:`loads` was allowed to build."""


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


_DECODER = json.JSONDecoder(parse_constant=_no_constant)
# One value at a position (all of it: used for scalars only); a string's body from after its opening quote.
_scan: Callable[[str, int], tuple[Any, int]] = json.scanner.make_scanner(_DECODER)  # type: ignore[arg-type]
_scanstring: Callable[[str, int, bool], tuple[str, int]] = json.decoder.scanstring  # type: ignore[attr-defined]
_WS = re.compile(r"[ \t\n\r]*")
_NUMBERS = re.compile(r"[-+0-9.eE, \t\n\r]*")


def _skip(text: str, i: int) -> int:
    """The position after the whitespace at ``i``."""
    return _WS.match(text, i).end()  # type: ignore[union-attr]


def loads(raw: bytes | str, *, max_values: int | None = None) -> Any:
    """``json.loads(raw)`` (the same values and errors, ``ValueError`` subclasses), without ``NaN`` and
    ``Infinity``, nested at most :data:`MAX_DEPTH` deep.

    ``max_values`` bounds the work and the memory of a document made of many small pieces: past that many
    values (arrays, objects, strings, numbers outside a run of numbers; a run of numbers such as a list of
    token ids counts as one), :class:`TooManyValues` is raised before more are built."""
    text = raw.decode(json.detect_encoding(raw), "surrogatepass") if isinstance(raw, bytes) else raw
    if text.startswith("\ufeff"):
        raise JSONDecodeError("Unexpected UTF-8 BOM (decode using utf-8-sig)", text, 0)
    value, i = _Parser(text, max_values).value(_skip(text, 0), 0)
    i = _skip(text, i)
    if i != len(text):
        raise JSONDecodeError("Extra data", text, i)
    return value


class _Parser:
    __slots__ = ("budget", "max_values", "text")

    def __init__(self, text: str, max_values: int | None) -> None:
        self.text = text
        self.max_values = max_values
        self.budget = len(text) + 1 if max_values is None else max_values

    def value(self, i: int, depth: int) -> tuple[Any, int]:
        self.budget -= 1
        if self.budget < 0:
            raise TooManyValues(f"more than {self.max_values} values (a run of numbers counts as one)")
        c = self.text[i : i + 1]
        if c == "[" or c == "{":
            if depth >= MAX_DEPTH:
                raise JSONDecodeError(f"arrays and objects nest deeper than {MAX_DEPTH} levels", self.text, i)
            return self._array(i, depth + 1) if c == "[" else self._object(i, depth + 1)
        try:
            return _scan(self.text, i)
        except StopIteration as exc:
            raise JSONDecodeError("Expecting value", self.text, exc.value) from None

    def _array(self, i: int, depth: int) -> tuple[list[Any], int]:
        text = self.text
        i = _skip(text, i + 1)
        if text.startswith("]", i):
            return [], i + 1
        if text[i : i + 1] in ("-", "0", "1", "2", "3", "4", "5", "6", "7", "8", "9"):
            end = text.find("]", i)
            if end > 0 and all(
                _NUMBERS.fullmatch(text, p, min(p + CHUNK, end)) for p in range(i, end, CHUNK)
            ):
                return self._numbers(i, end), end + 1
        out: list[Any] = []
        append = out.append
        while True:
            value, i = self.value(i, depth)
            append(value)
            i = _skip(text, i)
            c = text[i : i + 1]
            if c == "]":
                return out, i + 1
            if c != ",":
                raise JSONDecodeError("Expecting ',' delimiter", text, i)
            i = _skip(text, i + 1)

    def _numbers(self, i: int, end: int) -> list[Any]:
        """``text[i:end]``: numbers, commas and whitespace only, decoded ``CHUNK`` characters at a time
        (each piece cut at a comma)."""
        text = self.text
        out: list[Any] = []
        while i < end:
            cut = end
            if end - i > CHUNK:
                cut = text.rfind(",", i, i + CHUNK)
                if cut < 0:  # one number longer than a chunk
                    cut = text.find(",", i + CHUNK, end)
                    cut = end if cut < 0 else cut
            piece = text[i:cut]
            if not piece.strip():
                raise JSONDecodeError("Expecting value", text, i)
            try:
                out += _DECODER.decode(f"[{piece}]")
            except JSONDecodeError as exc:
                raise JSONDecodeError(exc.msg, text, i + exc.pos - 1) from None
            i = cut + 1
        return out

    def _object(self, i: int, depth: int) -> tuple[dict[str, Any], int]:
        text = self.text
        out: dict[str, Any] = {}
        i = _skip(text, i + 1)
        if text.startswith("}", i):
            return out, i + 1
        while True:
            if not text.startswith('"', i):
                raise JSONDecodeError("Expecting property name enclosed in double quotes", text, i)
            key, i = _scanstring(text, i + 1, True)
            i = _skip(text, i)
            if not text.startswith(":", i):
                raise JSONDecodeError("Expecting ':' delimiter", text, i)
            value, i = self.value(_skip(text, i + 1), depth)
            out[key] = value
            i = _skip(text, i)
            c = text[i : i + 1]
            if c == "}":
                return out, i + 1
            if c != ",":
                raise JSONDecodeError("Expecting ',' delimiter", text, i)
            i = _skip(text, i + 1)
