"""Request traces for ``aiokv replay``: loading JSONL files and generating synthetic multi-turn workloads.

A trace is a list of requests, each a chain of block keys (``keys[i]`` stands for the prompt prefix up to the
end of block ``i``). Three row formats are accepted, one JSON object per line:

- ``{"hash_ids": [...], "input_length": n, "output_length": m, "timestamp": ms}``: prefix-chained block ids,
  each standing for ``block_tokens`` tokens (the Mooncake traces; their blocks are 512 tokens). The last id
  may cover a partial block; it is cached like the others, and token counts are capped at ``input_length``.
- ``{"token_ids": [...], "salt": ..., "timestamp": ms}``: hashed with :func:`aiokv.block_hashes`; only full
  blocks get a key, as in the offloader.
- ``{"prompt": "text", ...}``: the prompt's UTF-8 *bytes* are its tokens (one token per byte; no tokenizer is
  needed and the result is deterministic), then as ``token_ids``.

``timestamp`` (milliseconds, finite and >= 0) only orders requests (a stable sort; a row without one keeps its
file position); ``output_length`` is carried for reporting. ``hash_ids`` are ints in ``[0, 2**63)``, token ids
are int64, lengths are ints in ``[0, 2**63)``; other fields are ignored.

Files are read line by line, in UTF-8 (a leading BOM is skipped); blank lines are skipped. A line may hold at
most :data:`MAX_LINE_BYTES` bytes and a row at most :data:`MAX_HASH_IDS` ids. Anything else is refused with an
:class:`~aiokv.InvalidArgumentError` naming the file and line, and so is a file without any request.
"""

from __future__ import annotations

import codecs
import json
import math
import random
import stat
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from .._errors import AiokvError, InvalidArgumentError, InvalidTypeError
from ..rules import block_hashes, check_token_ids

__all__ = [
    "MAX_HASH_IDS",
    "MAX_LINE_BYTES",
    "MAX_SYNTHETIC_REFS",
    "Trace",
    "TraceRequest",
    "load_trace",
    "max_prefix_reuse",
    "synthetic_trace",
]


@dataclass(frozen=True, slots=True)
class TraceRequest:
    timestamp_ms: float
    keys: tuple[bytes, ...]  # chained block keys, head first
    input_tokens: int
    output_tokens: int = 0


@dataclass(frozen=True, slots=True, eq=False)
class Trace:
    """Requests in arrival order plus totals. Build with :meth:`from_requests`, :func:`load_trace` or
    :func:`synthetic_trace`."""

    name: str
    block_tokens: int
    requests: tuple[TraceRequest, ...]
    block_refs: int
    unique_blocks: int
    input_tokens: int

    @classmethod
    def from_requests(cls, name: str, block_tokens: int, requests: Iterable[TraceRequest]) -> Trace:
        if isinstance(block_tokens, bool) or not isinstance(block_tokens, int) or block_tokens <= 0:
            raise InvalidArgumentError(f"block_tokens must be a positive int, got {block_tokens!r}")
        ordered = tuple(sorted(requests, key=lambda r: r.timestamp_ms))
        unique: set[bytes] = set()
        refs = 0
        for r in ordered:
            unique.update(r.keys)
            refs += len(r.keys)
        return cls(
            name=name,
            block_tokens=block_tokens,
            requests=ordered,
            block_refs=refs,
            unique_blocks=len(unique),
            input_tokens=sum(r.input_tokens for r in ordered),
        )

    def __len__(self) -> int:
        return len(self.requests)

    def __repr__(self) -> str:
        return (
            f"<Trace {self.name!r} requests={len(self.requests)} block_refs={self.block_refs} "
            f"unique_blocks={self.unique_blocks} block_tokens={self.block_tokens}>"
        )


MAX_LINE_BYTES = 1 << 20
"""The longest trace line :func:`load_trace` accepts, in bytes (its line break not counted); longer lines are
refused after reading at most this many bytes of them."""

MAX_HASH_IDS = 1 << 16
"""The most ``hash_ids`` one row may hold (65,536 blocks: 32M tokens at 512 tokens per block)."""

MAX_SYNTHETIC_REFS = 10**8
"""The most block references (and requests) :func:`synthetic_trace` may generate, bounded before generating."""

_I64_LIMIT = 1 << 63


def _id_key(block_id: int) -> bytes:
    return block_id.to_bytes(8, "little", signed=True)


def _show_path(path: Path) -> str:
    """The path for a one-line message: as given, quoted only if it holds unprintable characters."""
    text = str(path)
    return text if text.isprintable() else repr(text)


def _show(value: object, width: int = 40) -> str:
    """A JSON value as it appears in the file, shortened to ``width`` characters."""
    text = json.dumps(value)
    return text if len(text) <= width else text[: width - 3] + "..."


_JSON_TYPES = {bool: "boolean", int: "number", float: "number", str: "string", list: "array", dict: "object"}


def _json_type(value: object) -> str:
    return "null" if value is None else _JSON_TYPES.get(type(value), type(value).__name__)


class _NonFiniteConstant(ValueError):
    pass


def _reject_constant(name: str) -> object:
    raise _NonFiniteConstant(name)


def _parse_json(text: str, where: str) -> object:
    try:
        return json.loads(text, parse_constant=_reject_constant)
    except _NonFiniteConstant as exc:
        raise InvalidArgumentError(f"{where}: not valid JSON ({exc} is not a JSON number)") from None
    except json.JSONDecodeError as exc:
        raise InvalidArgumentError(f"{where}: not valid JSON ({exc.msg} at column {exc.colno})") from None
    except RecursionError:
        raise InvalidArgumentError(f"{where}: not valid JSON (nested too deeply)") from None
    except ValueError:  # an integer longer than sys.get_int_max_str_digits()
        raise InvalidArgumentError(f"{where}: not valid JSON (a number has too many digits)") from None


def _timestamp(ts: object, where: str) -> float | None:
    if ts is None:
        return None
    if isinstance(ts, bool) or not isinstance(ts, (int, float)):
        raise InvalidArgumentError(
            f"{where}: timestamp must be a finite number of milliseconds >= 0, got {_show(ts)}"
        )
    try:
        value = float(ts)
    except OverflowError:  # an int beyond the float range
        value = math.inf
    if not (math.isfinite(value) and value >= 0):
        raise InvalidArgumentError(
            f"{where}: timestamp must be a finite number of milliseconds >= 0, got {_show(ts)}"
        )
    return value


def _count(value: object, name: str, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InvalidArgumentError(f"{where}: {name} must be an int >= 0, got {_show(value)}")
    if value >= _I64_LIMIT:
        raise InvalidArgumentError(f"{where}: {name} must be < 2**63, got {_show(value)}")
    return value


def _hash_id_keys(ids: object, where: str) -> tuple[bytes, ...]:
    if not isinstance(ids, list):
        raise InvalidArgumentError(f"{where}: hash_ids must be a list of ints, got {_json_type(ids)}")
    if len(ids) > MAX_HASH_IDS:
        raise InvalidArgumentError(f"{where}: hash_ids must hold at most {MAX_HASH_IDS} ids, got {len(ids)}")
    for i in ids:
        if type(i) is not int:  # bools and floats too
            raise InvalidArgumentError(f"{where}: hash_ids must be a list of ints, got {_show(i)}")
        if not 0 <= i < _I64_LIMIT:
            raise InvalidArgumentError(f"{where}: hash_ids must hold ints in [0, 2**63), got {_show(i)}")
    return tuple(map(_id_key, ids))


def _token_keys(row: dict[str, object], block_tokens: int, where: str) -> tuple[tuple[bytes, ...], int]:
    """Keys and token count of a ``token_ids`` or ``prompt`` row."""
    if "token_ids" in row:
        raw = row["token_ids"]
        if not isinstance(raw, list):
            raise InvalidArgumentError(f"{where}: token_ids must be a list of ints, got {_json_type(raw)}")
        try:
            tokens = check_token_ids(raw)
        except AiokvError as exc:
            raise InvalidArgumentError(f"{where}: {exc}") from None
    else:
        prompt = row["prompt"]
        if not isinstance(prompt, str):
            raise InvalidArgumentError(f"{where}: prompt must be a string, got {_json_type(prompt)}")
        try:
            tokens = list(prompt.encode("utf-8"))
        except UnicodeEncodeError:  # a lone surrogate escaped as \udXXX
            raise InvalidArgumentError(f"{where}: prompt must be valid unicode text") from None
    try:
        keys = tuple(block_hashes(tokens, block_tokens, salt=row.get("salt")))
    except AiokvError as exc:
        raise InvalidArgumentError(f"{where}: {exc}") from None
    except RecursionError:
        raise InvalidArgumentError(f"{where}: salt is nested too deeply") from None
    return keys, len(tokens)


def _parse_row(row: object, block_tokens: int, where: str) -> tuple[float | None, TraceRequest]:
    """Validate one decoded row; the timestamp is returned apart (``None``: keep the file position)."""
    if not isinstance(row, dict):
        raise InvalidArgumentError(f"{where}: each trace line must be a JSON object, got {_json_type(row)}")
    ts = _timestamp(row.get("timestamp"), where)
    if "hash_ids" in row:
        keys = _hash_id_keys(row["hash_ids"], where)
        default_input = len(keys) * block_tokens
    elif "token_ids" in row or "prompt" in row:
        keys, default_input = _token_keys(row, block_tokens, where)
    else:
        raise InvalidArgumentError(f"{where}: a trace row needs hash_ids, token_ids or prompt")
    input_tokens = _count(row.get("input_length", default_input), "input_length", where)
    output_tokens = _count(row.get("output_length", 0), "output_length", where)
    return ts, TraceRequest(0.0, keys, input_tokens, output_tokens)


def _lines(f: BinaryIO, shown: str) -> Iterator[tuple[str, bytes]]:
    """``(where, line)`` per line of ``f`` without its line break, never holding more than
    :data:`MAX_LINE_BYTES` + 1 bytes of a line."""
    lineno = 0
    while True:
        try:
            raw = f.readline(MAX_LINE_BYTES + 1)
        except OSError as exc:
            raise InvalidArgumentError(f"{shown}: cannot read the trace ({exc.strerror or exc})") from None
        if not raw:
            return
        lineno += 1
        where = f"{shown}:{lineno}"
        line = raw[:-1] if raw.endswith(b"\n") else raw
        if len(line) > MAX_LINE_BYTES:
            raise InvalidArgumentError(f"{where}: a trace line must be at most {MAX_LINE_BYTES} bytes long")
        if lineno == 1 and line.startswith(codecs.BOM_UTF8):
            line = line[len(codecs.BOM_UTF8) :]
        yield where, line


def _decode(line: bytes, where: str) -> str:
    try:
        return line.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidArgumentError(
            f"{where}: not UTF-8 text (byte 0x{line[exc.start]:02x} at column {exc.start + 1})"
        ) from None


def _open_trace(path: Path) -> BinaryIO:
    got = repr(str(path))
    reason = None
    try:
        mode = path.stat().st_mode
        if stat.S_ISREG(mode):
            return path.open("rb")
        reason = "a directory" if stat.S_ISDIR(mode) else "not a regular file"
    except FileNotFoundError:
        reason = "no such file"
    except (OSError, ValueError) as exc:  # permission, name too long, embedded NUL, ...
        reason = (getattr(exc, "strerror", None) or str(exc)).lower()
    raise InvalidArgumentError(f"trace must be a readable file, got {got} ({reason})")


def _check_block_tokens(block_tokens: object) -> None:
    if isinstance(block_tokens, bool) or not isinstance(block_tokens, int) or block_tokens <= 0:
        raise InvalidArgumentError(f"block_tokens must be a positive int, got {block_tokens!r}")


def load_trace(
    path: str | Path, *, block_tokens: int = 512, limit: int | None = None, name: str | None = None
) -> Trace:
    """Read a JSONL trace (see the module docstring for the row formats); ``limit`` keeps the first rows.

    The file is read line by line: a line longer than :data:`MAX_LINE_BYTES`, a row with more than
    :data:`MAX_HASH_IDS` ids, a line that is not UTF-8 JSON, a value of the wrong type or out of range, and a
    file without any request raise :class:`InvalidArgumentError` naming the file and line.
    """
    _check_block_tokens(block_tokens)
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise InvalidArgumentError(f"limit must be an int >= 1 or None, got {limit!r}")
    path = Path(path)
    shown = _show_path(path)
    requests: list[TraceRequest] = []
    last_ts = 0.0
    with _open_trace(path) as f:
        for where, line in _lines(f, shown):
            text = _decode(line, where)
            if not text.strip():
                continue
            ts, req = _parse_row(_parse_json(text, where), block_tokens, where)
            if ts is not None:
                last_ts = ts
            requests.append(TraceRequest(last_ts, req.keys, req.input_tokens, req.output_tokens))
            if limit is not None and len(requests) >= limit:
                break  # the rest of the file is not read
    if not requests:
        raise InvalidArgumentError(f"trace {shown} holds no requests")
    if name is None:
        name = path.name if path.name.isprintable() else repr(path.name)
    return Trace.from_requests(name, block_tokens, requests)


def _check_count(name: str, value: object, lo: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidTypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < lo:
        raise InvalidArgumentError(f"{name} must be >= {lo}, got {value}")
    return value


def _check_seconds(name: str, value: object, *, positive: bool) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidTypeError(f"{name} must be a number, got {type(value).__name__}")
    shown = repr(value).removesuffix(".0")  # 0.0 -> 0, as the user probably typed it
    if not math.isfinite(value):
        raise InvalidArgumentError(f"{name} must be finite, got {shown}")
    if positive and value <= 0:
        raise InvalidArgumentError(f"{name} must be > 0, got {shown}")
    if value < 0:
        raise InvalidArgumentError(f"{name} must be >= 0, got {shown}")
    return float(value)


def _check_range(name: str, value: object) -> tuple[int, int]:
    if not (
        isinstance(value, (tuple, list))
        and len(value) == 2
        and all(type(v) is int for v in value)
        and 0 <= value[0] <= value[1]
    ):
        raise InvalidArgumentError(
            f"{name} must be a range (lo, hi) of ints with 0 <= lo <= hi, got {value!r}"
        )
    return value[0], value[1]


def synthetic_trace(
    *,
    sessions: int = 400,
    turns: int = 6,
    system_prompts: int = 8,
    system_blocks: int = 4,
    user_blocks: tuple[int, int] = (1, 4),
    answer_blocks: tuple[int, int] = (1, 2),
    sessions_per_s: float = 1.0,
    think_s: float = 30.0,
    block_tokens: int = 512,
    seed: int = 0,
) -> Trace:
    """A multi-turn chat workload: each session starts with one of ``system_prompts`` shared system prompts
    (``system_blocks`` blocks), and every turn's prompt is the whole conversation so far plus a new user
    message; the answer joins the conversation for the next turn. Sessions arrive as a Poisson process and
    wait an exponential think time between turns. Deterministic for a given ``seed``.

    Every argument is validated before anything is generated; the worst case may not exceed
    :data:`MAX_SYNTHETIC_REFS` block references.
    """
    for name, value in (("sessions", sessions), ("turns", turns), ("system_prompts", system_prompts)):
        _check_count(name, value, 1)
    _check_count("system_blocks", system_blocks, 0)
    user_lo, user_hi = _check_range("user_blocks", user_blocks)
    answer_lo, answer_hi = _check_range("answer_blocks", answer_blocks)
    rate = _check_seconds("sessions_per_s", sessions_per_s, positive=True)
    think = _check_seconds("think_s", think_s, positive=False)
    _check_block_tokens(block_tokens)
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise InvalidTypeError(f"seed must be an int, got {type(seed).__name__}")
    worst = sessions * turns * (1 + system_blocks + turns * (user_hi + answer_hi)) + system_prompts * (
        1 + system_blocks
    )
    if worst > MAX_SYNTHETIC_REFS:
        raise InvalidArgumentError(
            f"synthetic trace must hold at most {MAX_SYNTHETIC_REFS} block references, got up to {worst} "
            f"(sessions={sessions}, turns={turns}, system_blocks={system_blocks})"
        )
    rng = random.Random(seed)
    counter = 0

    def fresh(n: int) -> list[bytes]:
        nonlocal counter
        out = [b"syn" + (counter + i).to_bytes(8, "little") for i in range(n)]
        counter += n
        return out

    prompts = [fresh(system_blocks) for _ in range(system_prompts)]
    requests: list[TraceRequest] = []
    start = 0.0
    for _ in range(sessions):
        start += rng.expovariate(rate) * 1000.0
        history = list(prompts[rng.randrange(system_prompts)])
        t = start
        for turn in range(turns):
            if turn:
                t += rng.expovariate(1.0 / think) * 1000.0 if think > 0 else 0.0
            if not math.isfinite(t):
                raise InvalidArgumentError(
                    f"sessions_per_s={sessions_per_s} and think_s={think_s} put arrival times beyond the "
                    "float range"
                )
            history += fresh(rng.randint(user_lo, user_hi))
            out_blocks = rng.randint(answer_lo, answer_hi)
            requests.append(
                TraceRequest(t, tuple(history), len(history) * block_tokens, out_blocks * block_tokens)
            )
            history += fresh(out_blocks)
    return Trace.from_requests(
        f"synthetic(sessions={sessions},turns={turns},seed={seed})", block_tokens, requests
    )


def max_prefix_reuse(requests: Sequence[TraceRequest]) -> int:
    """Blocks hit with unlimited capacity: for each request, the leading run of keys seen in earlier requests."""
    seen: set[bytes] = set()
    hits = 0
    for r in requests:
        for key in r.keys:
            if key not in seen:
                break
            hits += 1
        seen.update(r.keys)
    return hits
