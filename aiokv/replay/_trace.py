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

``timestamp`` (milliseconds) only orders requests (a stable sort; a row without one keeps its file position);
``output_length`` is carried for reporting.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from .._errors import InvalidArgumentError
from .._hashing import block_hashes

__all__ = ["Trace", "TraceRequest", "load_trace", "max_prefix_reuse", "synthetic_trace"]


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


def _id_key(block_id: int) -> bytes:
    return block_id.to_bytes(8, "little", signed=True)


def _parse_row(row: object, block_tokens: int, where: str) -> tuple[float | None, TraceRequest]:
    if not isinstance(row, dict):
        raise InvalidArgumentError(f"{where}: each trace line must be a JSON object")
    ts = row.get("timestamp")
    if ts is not None and (isinstance(ts, bool) or not isinstance(ts, (int, float))):
        raise InvalidArgumentError(f"{where}: timestamp must be a number of milliseconds, got {ts!r}")
    output = row.get("output_length", 0)
    if "hash_ids" in row:
        ids = row["hash_ids"]
        if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            raise InvalidArgumentError(f"{where}: hash_ids must be a list of ints")
        keys = tuple(map(_id_key, ids))
        input_tokens = row.get("input_length", len(ids) * block_tokens)
    else:
        if "token_ids" in row:
            tokens = row["token_ids"]
            if not isinstance(tokens, list):
                raise InvalidArgumentError(f"{where}: token_ids must be a list of ints")
        elif "prompt" in row:
            prompt = row["prompt"]
            if not isinstance(prompt, str):
                raise InvalidArgumentError(f"{where}: prompt must be a string")
            tokens = list(prompt.encode("utf-8"))
        else:
            raise InvalidArgumentError(f"{where}: a trace row needs hash_ids, token_ids or prompt")
        try:
            keys = tuple(block_hashes(tokens, block_tokens, salt=row.get("salt")))
        except InvalidArgumentError as exc:
            raise InvalidArgumentError(f"{where}: {exc}") from None
        input_tokens = row.get("input_length", len(tokens))
    for name, value in (("input_length", input_tokens), ("output_length", output)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise InvalidArgumentError(f"{where}: {name} must be an int >= 0, got {value!r}")
    return ts, TraceRequest(0.0, keys, input_tokens, output)


def load_trace(
    path: str | Path, *, block_tokens: int = 512, limit: int | None = None, name: str | None = None
) -> Trace:
    """Read a JSONL trace (see the module docstring for the row formats); ``limit`` keeps the first rows."""
    path = Path(path)
    if not path.is_file():
        raise InvalidArgumentError(f"trace must be a readable file, got {str(path)!r}")
    requests: list[TraceRequest] = []
    last_ts = 0.0
    with path.open("rb") as f:
        for lineno, line in enumerate(f, 1):
            if limit is not None and len(requests) >= limit:
                break
            if not line.strip():
                continue
            where = f"{path.name}:{lineno}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise InvalidArgumentError(f"{where}: not valid JSON ({exc.msg})") from None
            ts, req = _parse_row(row, block_tokens, where)
            if ts is not None:
                last_ts = float(ts)
            requests.append(TraceRequest(last_ts, req.keys, req.input_tokens, req.output_tokens))
    return Trace.from_requests(name or path.name, block_tokens, requests)


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
    wait an exponential think time between turns. Deterministic for a given ``seed``."""
    for name, value in (
        ("sessions", sessions),
        ("turns", turns),
        ("system_prompts", system_prompts),
    ):
        if value < 1:
            raise InvalidArgumentError(f"{name} must be >= 1, got {value}")
    for name, (lo, hi) in (("user_blocks", user_blocks), ("answer_blocks", answer_blocks)):
        if not 0 <= lo <= hi:
            raise InvalidArgumentError(
                f"{name} must be a range (lo, hi) with 0 <= lo <= hi, got {(lo, hi)!r}"
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
        start += rng.expovariate(sessions_per_s) * 1000.0
        history = list(prompts[rng.randrange(system_prompts)])
        t = start
        for turn in range(turns):
            if turn:
                t += rng.expovariate(1.0 / think_s) * 1000.0 if think_s > 0 else 0.0
            history += fresh(rng.randint(*user_blocks))
            out_blocks = rng.randint(*answer_blocks)
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
