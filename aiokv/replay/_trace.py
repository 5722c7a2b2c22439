"""Request traces for ``aiokv replay``: loading JSONL files and generating synthetic workloads of four shapes
(:func:`synthetic_trace`: chat, agentic, retrieval and a mix).

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
import inspect
import itertools
import json
import math
import random
import stat
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, NamedTuple, NoReturn, Protocol

from .._errors import AiokvError, InvalidArgumentError, InvalidTypeError
from ..rules import block_hashes, check_token_ids

__all__ = [
    "MAX_HASH_IDS",
    "MAX_LINE_BYTES",
    "MAX_SYNTHETIC_REFS",
    "SYNTHETIC_SHAPES",
    "Trace",
    "TraceRequest",
    "agentic_trace",
    "chat_trace",
    "load_trace",
    "max_prefix_reuse",
    "mix_trace",
    "retrieval_trace",
    "synthetic_trace",
]


@dataclass(frozen=True, slots=True)
class TraceRequest:
    timestamp_ms: float
    keys: tuple[bytes, ...]  # chained block keys, head first
    input_tokens: int
    output_tokens: int = 0


@dataclass(frozen=True, slots=True, eq=False, weakref_slot=True)
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


def _check_block_tokens(block_tokens: object) -> int:
    if isinstance(block_tokens, bool) or not isinstance(block_tokens, int) or block_tokens <= 0:
        raise InvalidArgumentError(f"block_tokens must be a positive int, got {block_tokens!r}")
    return block_tokens


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


def _defaults(generator: Callable[..., Trace], **overrides: object) -> dict[str, object]:
    """``generator``'s keyword defaults with ``overrides``: a mix's halves use their shapes' own defaults,
    defined once, in the public signatures."""
    params = inspect.signature(generator).parameters
    return {name: p.default for name, p in params.items()} | overrides


def _check_probability(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidTypeError(f"{name} must be a number, got {type(value).__name__}")
    if not (math.isfinite(value) and 0 <= value <= 1):
        shown = repr(value).removesuffix(".0")  # 2.0 -> 2, as the user probably typed it
        raise InvalidArgumentError(f"{name} must be in [0, 1], got {shown}")
    return float(value)


def _check_seed(seed: object) -> int:
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise InvalidTypeError(f"seed must be an int, got {type(seed).__name__}")
    return seed


def _refuse_size(got: str, detail: str) -> NoReturn:
    raise InvalidArgumentError(
        f"synthetic trace must hold at most {MAX_SYNTHETIC_REFS} block references, got {got} ({detail})"
    )


class _ShapeParams(Protocol):
    """A shape's validated parameters (``_Chat``, ``_Agentic``, ``_Retrieval``): what :func:`_generate` needs.
    Each class's ``check`` takes the keywords of its public function, by name (the function passes its
    ``locals()``), so the keyword list and defaults are written once, in the public signature."""

    @property
    def block_tokens(self) -> int: ...

    def oversize(self, limit: int) -> str | None:
        """``None`` when the trace holds at most ``limit`` block references, else how many it would hold."""

    def detail(self) -> str:
        """The parameters that size the trace, for the size refusal."""

    def name(self) -> str:
        """The trace's name."""

    def requests(self) -> list[TraceRequest]: ...


def _generate(params: _ShapeParams) -> Trace:
    """The trace of one shape's validated ``params``, refused before generating when larger than
    :data:`MAX_SYNTHETIC_REFS`."""
    got = params.oversize(MAX_SYNTHETIC_REFS)
    if got is not None:
        _refuse_size(got, params.detail())
    return Trace.from_requests(params.name(), params.block_tokens, params.requests())


def _check_finite_time(t: float, rate_name: str, rate: float, think_name: str, think: float) -> None:
    if not math.isfinite(t):
        raise InvalidArgumentError(
            f"{rate_name}={rate} and {think_name}={think} put arrival times beyond the float range"
        )


class _Keys:
    """Fresh block keys ``prefix + counter``: one counter per trace, so every block of a shape is unique, and
    one prefix per shape, so the halves of a mix never share a key."""

    __slots__ = ("_next", "_prefix")

    def __init__(self, prefix: bytes) -> None:
        self._prefix = prefix
        self._next = 0

    def fresh(self, n: int) -> list[bytes]:
        start, prefix = self._next, self._prefix
        self._next += n
        return [prefix + (start + i).to_bytes(8, "little") for i in range(n)]


# ------------------------------------------------------------------------------------------------ chat
@dataclass(frozen=True, slots=True)
class _Chat:
    """The chat shape's validated parameters; :func:`chat_trace` documents them."""

    sessions: int
    turns: int
    system_prompts: int
    system_blocks: int
    user: tuple[int, int]
    answer: tuple[int, int]
    sessions_per_s: float
    think_s: float
    block_tokens: int
    seed: int

    @classmethod
    def check(
        cls,
        sessions: object,
        turns: object,
        system_prompts: object,
        system_blocks: object,
        user_blocks: object,
        answer_blocks: object,
        sessions_per_s: object,
        think_s: object,
        block_tokens: object,
        seed: object,
    ) -> _Chat:
        n_sessions = _check_count("sessions", sessions, 1)
        n_turns = _check_count("turns", turns, 1)
        n_prompts = _check_count("system_prompts", system_prompts, 1)
        blocks = _check_count("system_blocks", system_blocks, 0)
        user = _check_range("user_blocks", user_blocks)
        answer = _check_range("answer_blocks", answer_blocks)
        rate = _check_seconds("sessions_per_s", sessions_per_s, positive=True)
        think = _check_seconds("think_s", think_s, positive=False)
        bt = _check_block_tokens(block_tokens)
        return cls(n_sessions, n_turns, n_prompts, blocks, user, answer, rate, think, bt, _check_seed(seed))

    def worst_refs(self) -> int:
        """Every turn at its longest user message and answer, plus the system prompts' keys."""
        per_request = 1 + self.system_blocks + self.turns * (self.user[1] + self.answer[1])
        return self.sessions * self.turns * per_request + self.system_prompts * (1 + self.system_blocks)

    def oversize(self, limit: int) -> str | None:
        worst = self.worst_refs()
        return f"up to {worst}" if worst > limit else None

    def detail(self) -> str:
        return f"sessions={self.sessions}, turns={self.turns}, system_blocks={self.system_blocks}"

    def name(self) -> str:
        return f"synthetic(sessions={self.sessions},turns={self.turns},seed={self.seed})"

    def requests(self) -> list[TraceRequest]:
        rng = random.Random(self.seed)
        keys = _Keys(b"syn")
        rate, think, bt = self.sessions_per_s, self.think_s, self.block_tokens
        prompts = [keys.fresh(self.system_blocks) for _ in range(self.system_prompts)]
        requests: list[TraceRequest] = []
        start = 0.0
        for _ in range(self.sessions):
            start += rng.expovariate(rate) * 1000.0
            history = list(prompts[rng.randrange(self.system_prompts)])
            t = start
            for turn in range(self.turns):
                if turn:
                    t += rng.expovariate(1.0 / think) * 1000.0 if think > 0 else 0.0
                _check_finite_time(t, "sessions_per_s", rate, "think_s", think)
                history += keys.fresh(rng.randint(*self.user))
                out_blocks = rng.randint(*self.answer)
                requests.append(TraceRequest(t, tuple(history), len(history) * bt, out_blocks * bt))
                history += keys.fresh(out_blocks)
        return requests


def chat_trace(
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
    """A multi-turn chat workload (``synthetic_trace(shape="chat")``, the default shape): each session starts
    with one of ``system_prompts`` shared system prompts (``system_blocks`` blocks), and every turn's prompt
    is the whole conversation so far plus a new user message (``user_blocks`` blocks, uniform); the answer
    (``answer_blocks``) joins the conversation for the next turn. Sessions arrive as a Poisson process and
    wait an exponential think time between turns. Deterministic for a given ``seed``.

    Every argument is validated before anything is generated; the worst case may not exceed
    :data:`MAX_SYNTHETIC_REFS` block references.
    """
    return _generate(_Chat.check(**locals()))  # (first statement: locals() holds the keywords only)


# --------------------------------------------------------------------------------------------- agentic
_AGENTIC_MIN_TURNS = 5
_AGENTIC_TOOL_ALPHA = 1.2  # Pareto shape of a tool result's size: mostly one block, now and then dozens
_AGENTIC_TOOL_MAX = 60
_AGENTIC_ACTION_BLOCKS = (1, 4)
_AGENTIC_SUMMARY_BLOCKS = 40  # what a compaction leaves after the tool prompt
_AGENTIC_OUTPUT_TOKENS = 64


class _AgenticTurn(NamedTuple):
    """One agent turn, with no keys: the random draws and the lengths they give."""

    prompt: int  # the tool prompt the session starts from, on its first turn; -1 on the others
    t: float
    tool: int  # blocks of the tool result appended before the request
    input_tokens: int
    action: int  # blocks of the model's action appended after it
    compact: bool  # the context is compacted after the action
    refs: int  # blocks in the request


@dataclass(frozen=True, slots=True)
class _Agentic:
    """The agentic shape's validated parameters; :func:`agentic_trace` documents them."""

    sessions: int
    turns: int
    system_prompts: int
    system_blocks: int
    context_blocks: int
    sessions_per_s: float
    think_s: float
    block_tokens: int
    seed: int

    @classmethod
    def check(
        cls,
        sessions: object,
        turns: object,
        system_prompts: object,
        system_blocks: object,
        context_blocks: object,
        sessions_per_s: object,
        think_s: object,
        block_tokens: object,
        seed: object,
    ) -> _Agentic:
        n_sessions = _check_count("sessions", sessions, 1)
        n_turns = _check_count("turns", turns, 1)
        n_prompts = _check_count("system_prompts", system_prompts, 1)
        blocks = _check_count("system_blocks", system_blocks, 0)
        context = _check_count("context_blocks", context_blocks, 1)
        rate = _check_seconds("sessions_per_s", sessions_per_s, positive=True)
        think = _check_seconds("think_s", think_s, positive=False)
        bt = _check_block_tokens(block_tokens)
        return cls(n_sessions, n_turns, n_prompts, blocks, context, rate, think, bt, _check_seed(seed))

    def turns_drawn(self) -> Iterator[_AgenticTurn]:
        """The trace as lengths. Counting and building both walk it, so the size is known exactly before a
        single key is made: the number of turns is random and unbounded, so no formula bounds it tightly."""
        rng = random.Random(self.seed)
        rate, think, bt = self.sessions_per_s, self.think_s, self.block_tokens
        start = 0.0
        for _ in range(self.sessions):
            start += rng.expovariate(rate) * 1000.0
            prompt = rng.randrange(self.system_prompts)
            length = self.system_blocks
            t = start
            for turn in range(max(_AGENTIC_MIN_TURNS, int(rng.expovariate(1 / self.turns)))):
                if turn:
                    t += rng.expovariate(1 / think) * 1000.0 if think > 0 else 0.0
                _check_finite_time(t, "sessions_per_s", rate, "think_s", think)
                tool = min(_AGENTIC_TOOL_MAX, max(1, int(rng.paretovariate(_AGENTIC_TOOL_ALPHA))))
                length += tool
                inputs = length * bt - rng.randrange(bt)
                refs = length
                action = rng.randint(*_AGENTIC_ACTION_BLOCKS)
                length += action
                compact = length > self.context_blocks
                if compact:
                    length = self.system_blocks + _AGENTIC_SUMMARY_BLOCKS
                yield _AgenticTurn(-1 if turn else prompt, t, tool, inputs, action, compact, refs)

    def count_refs(self, limit: int) -> int | None:
        """The exact block references (and the tool prompts' keys), or ``None`` once past ``limit``. A lower
        bound refuses a huge request at once: a session has at least five turns, its first request is the
        prompt plus at least one block and each later one at least two blocks longer (1 + 3 + 5 + 7 + 9)."""
        total = self.system_prompts * (1 + self.system_blocks)
        least = _AGENTIC_MIN_TURNS * self.system_blocks + _AGENTIC_MIN_TURNS**2
        if total + self.sessions * least > limit:
            return None
        for turn in self.turns_drawn():
            total += turn.refs
            if total > limit:
                return None
        return total

    def oversize(self, limit: int) -> str | None:
        return "more than that" if self.count_refs(limit) is None else None

    def requests(self) -> list[TraceRequest]:
        keys = _Keys(b"ag")
        prompts = [keys.fresh(self.system_blocks) for _ in range(self.system_prompts)]
        history: list[bytes] = []
        requests: list[TraceRequest] = []
        for turn in self.turns_drawn():
            if turn.prompt >= 0:
                history = list(prompts[turn.prompt])
            history += keys.fresh(turn.tool)
            requests.append(TraceRequest(turn.t, tuple(history), turn.input_tokens, _AGENTIC_OUTPUT_TOKENS))
            history += keys.fresh(turn.action)
            if turn.compact:
                history = history[: self.system_blocks] + keys.fresh(_AGENTIC_SUMMARY_BLOCKS)
        return requests

    def detail(self) -> str:
        return (
            f"shape=agentic, sessions={self.sessions}, turns={self.turns}, system_blocks={self.system_blocks}, "
            f"context_blocks={self.context_blocks}"
        )

    def name(self) -> str:
        return f"synthetic(shape=agentic,sessions={self.sessions},seed={self.seed})"


def agentic_trace(
    *,
    sessions: int = 40,
    turns: int = 60,
    system_prompts: int = 3,
    system_blocks: int = 150,
    context_blocks: int = 3000,
    sessions_per_s: float = 0.05,
    think_s: float = 3.0,
    block_tokens: int = 512,
    seed: int = 0,
) -> Trace:
    """Coding-agent sessions (``synthetic_trace(shape="agentic")``): long sessions whose context grows by tool
    calls and is re-sent whole every turn, so request *k + 1* of a session starts with request *k*'s keys.

    Each session starts from one of ``system_prompts`` shared tool prompts of ``system_blocks`` blocks and
    runs ``max(5, floor(Exp(mean=turns)))`` turns; a turn appends a tool result (Pareto-sized, 1 to 60
    blocks), sends the whole context, then appends the model's action (1 to 4 blocks; 64 output tokens).
    Past ``context_blocks`` blocks the context is compacted to the tool prompt plus 40 fresh blocks (a
    summary), which orphans the long chain. Sessions arrive as a Poisson process (``sessions_per_s``, many
    active at once) and think ``think_s`` seconds (exponential) between turns. A request's token count
    ends inside its last block. Deterministic for a given ``seed``.

    The sizes are meant for **64-token blocks** (``block_tokens=64``, ``aiokv replay --block-tokens 64``),
    the granularity at which agent contexts diverge; ``block_tokens`` stays 512 by default, as for every
    shape and the command line, and only scales the token counts.

    Every argument is validated before anything is generated. The size is counted exactly before any key is
    made and may not exceed :data:`MAX_SYNTHETIC_REFS` block references.
    """
    return _generate(_Agentic.check(**locals()))  # (first statement: locals() holds the keywords only)


# ------------------------------------------------------------------------------------------- retrieval
_RETRIEVAL_QUESTION_BLOCKS = (1, 2)
_RETRIEVAL_FOLLOW_UP_BLOCKS = 2
_RETRIEVAL_FOLLOW_UP_MS = 20_000.0
_RETRIEVAL_OUTPUT_TOKENS = 256


@dataclass(frozen=True, slots=True)
class _Retrieval:
    """The retrieval shape's validated parameters; :func:`retrieval_trace` documents them."""

    questions: int
    docs: int
    doc_blocks: tuple[int, int]
    system_blocks: int
    questions_per_s: float
    follow_up: float
    block_tokens: int
    seed: int

    @classmethod
    def check(
        cls,
        questions: object,
        docs: object,
        doc_blocks: object,
        system_blocks: object,
        questions_per_s: object,
        follow_up: object,
        block_tokens: object,
        seed: object,
    ) -> _Retrieval:
        n_questions = _check_count("questions", questions, 1)
        n_docs = _check_count("docs", docs, 1)
        sizes = _check_range("doc_blocks", doc_blocks)
        blocks = _check_count("system_blocks", system_blocks, 0)
        rate = _check_seconds("questions_per_s", questions_per_s, positive=True)
        p_follow = _check_probability("follow_up", follow_up)
        bt = _check_block_tokens(block_tokens)
        return cls(n_questions, n_docs, sizes, blocks, rate, p_follow, bt, _check_seed(seed))

    def worst_refs(self) -> int:
        """Every question on the longest document and followed up, plus the documents' keys."""
        longest = self.system_blocks + self.doc_blocks[1]
        per_question = 2 * longest + _RETRIEVAL_QUESTION_BLOCKS[1] * 2 + _RETRIEVAL_FOLLOW_UP_BLOCKS
        return self.questions * per_question + self.system_blocks + self.docs * (1 + self.doc_blocks[1])

    def oversize(self, limit: int) -> str | None:
        worst = self.worst_refs()
        return f"up to {worst}" if worst > limit else None

    def requests(self) -> list[TraceRequest]:
        rng = random.Random(self.seed)
        keys = _Keys(b"rt")
        bt = self.block_tokens
        system = keys.fresh(self.system_blocks)
        documents = [keys.fresh(rng.randint(*self.doc_blocks)) for _ in range(self.docs)]
        # Zipf popularity; cumulative once (random.choices would sum the weights on every call)
        cum_weights = list(itertools.accumulate(1 / (i + 1) for i in range(self.docs)))
        population = range(self.docs)
        requests: list[TraceRequest] = []
        t = 0.0
        for _ in range(self.questions):
            t += rng.expovariate(self.questions_per_s) * 1000.0
            if not math.isfinite(t + _RETRIEVAL_FOLLOW_UP_MS):
                raise InvalidArgumentError(
                    f"questions_per_s={self.questions_per_s} puts arrival times beyond the float range"
                )
            doc = documents[rng.choices(population, cum_weights=cum_weights)[0]]
            history = system + doc + keys.fresh(rng.randint(*_RETRIEVAL_QUESTION_BLOCKS))
            inputs = len(history) * bt - rng.randrange(bt)
            requests.append(TraceRequest(t, tuple(history), inputs, _RETRIEVAL_OUTPUT_TOKENS))
            if rng.random() < self.follow_up:
                history = history + keys.fresh(_RETRIEVAL_FOLLOW_UP_BLOCKS)
                inputs = len(history) * bt - rng.randrange(bt)
                requests.append(
                    TraceRequest(
                        t + _RETRIEVAL_FOLLOW_UP_MS, tuple(history), inputs, _RETRIEVAL_OUTPUT_TOKENS
                    )
                )
        return requests

    def detail(self) -> str:
        return (
            f"shape=retrieval, questions={self.questions}, docs={self.docs}, doc_blocks={self.doc_blocks}, "
            f"system_blocks={self.system_blocks}"
        )

    def name(self) -> str:
        return f"synthetic(shape=retrieval,questions={self.questions},docs={self.docs},seed={self.seed})"


def retrieval_trace(
    *,
    questions: int = 4000,
    docs: int = 12,
    doc_blocks: tuple[int, int] = (50, 400),
    system_blocks: int = 4,
    questions_per_s: float = 5.0,
    follow_up: float = 0.3,
    block_tokens: int = 512,
    seed: int = 0,
) -> Trace:
    """Retrieval-augmented questions (``synthetic_trace(shape="retrieval")``): a few large shared documents
    behind many short questions, so nearly every block is a document block re-read by many requests.

    ``docs`` documents of ``doc_blocks`` blocks (uniform), Zipf-popular (document *i* drawn with weight
    1/(i + 1)), sit behind a shared system prompt of ``system_blocks`` blocks; each of ``questions``
    questions (a Poisson process, ``questions_per_s``) is the system prompt, one document and 1 to 2 blocks
    of question; with probability ``follow_up`` a follow-up 20 s later re-sends it plus 2 blocks. Answers
    are 256 tokens; a request's token count ends inside its last block. Deterministic for a given ``seed``.

    Every argument is validated before anything is generated; the worst case may not exceed
    :data:`MAX_SYNTHETIC_REFS` block references.
    """
    return _generate(_Retrieval.check(**locals()))  # (first statement: locals() holds the keywords only)


# ------------------------------------------------------------------------------------------------- mix
_MIX_SECOND_SHAPES = ("agentic", "retrieval")
"""The shapes :func:`mix_trace` can shift to half-way."""


def mix_trace(
    *, then: str = "retrieval", sessions: int = 400, block_tokens: int = 512, seed: int = 0
) -> Trace:
    """A workload whose shape shifts half-way (``synthetic_trace(shape="mix")``): a chat workload
    (:func:`chat_trace` with ``sessions`` sessions, its other defaults) for the first half of the time, then
    the ``then`` shape (``"retrieval"`` by default, or ``"agentic"``; its defaults) for the second half.

    The first half spans ``[0, T]``, ``T`` the chat's last arrival; the second half is shifted to start at
    ``T`` and cut at ``2 T``, so a policy tuned to the first half has as long again to follow the shift.
    The halves never share a key (each shape has its own key prefix), so nothing learnt on the chat pays off
    after the shift. Retrieval is the default because, like chat, it is sized for the default 512-token
    blocks; the agentic half is sized for 64 (see :func:`agentic_trace`). Deterministic for a given
    ``seed``, which both halves use.

    Every argument is validated before anything is generated; the two halves together may not exceed
    :data:`MAX_SYNTHETIC_REFS` block references.
    """
    if not isinstance(then, str) or then not in _MIX_SECOND_SHAPES:
        raise InvalidArgumentError(f"then must be one of {list(_MIX_SECOND_SHAPES)}, got {then!r}")
    chat = _Chat.check(**_defaults(chat_trace, sessions=sessions, block_tokens=block_tokens, seed=seed))
    chat_refs = chat.worst_refs()
    detail = f"shape=mix, then={then}, sessions={chat.sessions}"
    second: _Agentic | _Retrieval
    if then == "agentic":
        second = _Agentic.check(**_defaults(agentic_trace, block_tokens=block_tokens, seed=seed))
        counted = second.count_refs(max(0, MAX_SYNTHETIC_REFS - chat_refs))
        if counted is None:
            _refuse_size("more than that", detail)
        second_refs = counted
    else:
        second = _Retrieval.check(**_defaults(retrieval_trace, block_tokens=block_tokens, seed=seed))
        second_refs = second.worst_refs()
    if chat_refs + second_refs > MAX_SYNTHETIC_REFS:
        _refuse_size(f"up to {chat_refs + second_refs}", detail)
    first = chat.requests()
    half = max(r.timestamp_ms for r in first)
    shifted = [
        TraceRequest(half + r.timestamp_ms, r.keys, r.input_tokens, r.output_tokens)
        for r in second.requests()
        if r.timestamp_ms <= half
    ]
    return Trace.from_requests(
        f"synthetic(shape=mix,then={then},sessions={chat.sessions},seed={chat.seed})",
        chat.block_tokens,
        first + shifted,
    )


# ---------------------------------------------------------------------------------------------- shapes
_SHAPES: dict[str, Callable[..., Trace]] = {
    "agentic": agentic_trace,
    "chat": chat_trace,
    "mix": mix_trace,
    "retrieval": retrieval_trace,
}

SYNTHETIC_SHAPES = tuple(sorted(_SHAPES))
"""The workload shapes :func:`synthetic_trace` generates: ``("agentic", "chat", "mix", "retrieval")``."""


def _shape_options(shape: str) -> tuple[str, ...]:
    """The keyword options ``shape``'s generator takes (its function's parameters), sorted."""
    generator = _SHAPES.get(shape) if isinstance(shape, str) else None
    if generator is None:
        raise InvalidArgumentError(f"shape must be one of {list(SYNTHETIC_SHAPES)}, got {shape!r}")
    return tuple(sorted(inspect.signature(generator).parameters))


def synthetic_trace(*, shape: str = "chat", **options: Any) -> Trace:
    """A synthetic workload of one of :data:`SYNTHETIC_SHAPES`, the ``aiokv replay synthetic:...`` trace:
    ``options`` go to the shape's generator, which documents them and their defaults:

    - ``"chat"`` (the default; :func:`chat_trace`): multi-turn chats behind a few shared system prompts.
      ``synthetic_trace()`` and ``synthetic_trace(seed=1)`` are what they were before there were shapes;
    - ``"agentic"`` (:func:`agentic_trace`): long agent sessions whose context grows by tool calls and is
      re-sent every turn, sized for 64-token blocks;
    - ``"retrieval"`` (:func:`retrieval_trace`): a few large shared documents behind many short questions;
    - ``"mix"`` (:func:`mix_trace`): chat for the first half of the time, then retrieval (or agentic).

    Each shape has its own defaults, which is why they are separate functions rather than one parameter
    list: 400 chat sessions are light, 400 agent sessions are not. An unknown shape raises
    :class:`InvalidArgumentError`, an option the shape does not take :class:`InvalidTypeError` (as Python
    does for an unexpected keyword); the generator validates the values and bounds the size by
    :data:`MAX_SYNTHETIC_REFS` before generating.
    """
    names = _shape_options(shape)
    for name in options:
        if name not in names:
            raise InvalidTypeError(f"{shape} trace option must be one of {list(names)}, got {name!r}")
    return _SHAPES[shape](**options)


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
