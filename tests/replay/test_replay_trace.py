"""Trace loading (hash_ids, token_ids, prompt rows), the synthetic generator, sizes and model presets."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from aiokv import block_hashes
from aiokv._errors import InvalidArgumentError
from aiokv.replay import (
    COST_PRESETS,
    Trace,
    TraceRequest,
    format_size,
    load_trace,
    max_prefix_reuse,
    parse_bandwidth,
    parse_size,
    synthetic_trace,
)

DATA = Path(__file__).resolve().parent.parent / "data"


def write_jsonl(path: Path, rows: list[object]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def id_key(i: int) -> bytes:
    return i.to_bytes(8, "little", signed=True)


def test_hash_ids_rows_become_chained_keys(tmp_path: Path) -> None:
    path = write_jsonl(
        tmp_path / "t.jsonl",
        [
            {"timestamp": 5, "input_length": 1000, "output_length": 7, "hash_ids": [0, 1]},
            {"timestamp": 1, "input_length": 600, "output_length": 3, "hash_ids": [0, 2]},
        ],
    )
    trace = load_trace(path)
    assert [r.timestamp_ms for r in trace.requests] == [1.0, 5.0]  # sorted by timestamp
    assert trace.requests[0] == TraceRequest(1.0, (id_key(0), id_key(2)), 600, 3)
    assert (trace.block_refs, trace.unique_blocks, trace.input_tokens) == (4, 3, 1600)
    assert trace.name == "t.jsonl"


def test_rows_without_timestamp_keep_their_file_position(tmp_path: Path) -> None:
    path = write_jsonl(
        tmp_path / "t.jsonl",
        [{"timestamp": 10, "hash_ids": [1]}, {"hash_ids": [2]}, {"timestamp": 10, "hash_ids": [3]}],
    )
    trace = load_trace(path)
    assert [r.keys[0] for r in trace.requests] == [id_key(1), id_key(2), id_key(3)]
    assert trace.requests[1].input_tokens == 512  # defaults to len(hash_ids) * block_tokens


def test_token_ids_rows_are_hashed_with_block_hashes(tmp_path: Path) -> None:
    tokens = list(range(40))
    path = write_jsonl(
        tmp_path / "t.jsonl",
        [{"token_ids": tokens}, {"token_ids": tokens, "salt": "tenant-b"}],
    )
    trace = load_trace(path, block_tokens=16)
    plain, salted = trace.requests
    assert list(plain.keys) == block_hashes(tokens, 16)  # two full blocks; the partial third gets no key
    assert len(plain.keys) == 2
    assert plain.input_tokens == 40
    assert not set(plain.keys) & set(salted.keys)


def test_prompt_rows_use_utf8_bytes_as_tokens(tmp_path: Path) -> None:
    prompt = "héllo wörld " * 4
    path = write_jsonl(tmp_path / "t.jsonl", [{"prompt": prompt}])
    [req] = load_trace(path, block_tokens=8).requests
    tokens = list(prompt.encode("utf-8"))
    assert list(req.keys) == block_hashes(tokens, 8)
    assert req.input_tokens == len(tokens)


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{not json", r"t\.jsonl:2: not valid JSON"),
        ('{"foo": 1}', r"t\.jsonl:2: a trace row needs hash_ids, token_ids or prompt"),
        ('{"hash_ids": ["a"]}', r"t\.jsonl:2: hash_ids must be a list of ints"),
        (
            '{"hash_ids": [1], "timestamp": "x"}',
            r"t\.jsonl:2: timestamp must be a finite number of milliseconds >= 0, got \"x\"",
        ),
        ('{"hash_ids": [1], "input_length": -1}', r"t\.jsonl:2: input_length must be an int >= 0, got -1"),
        ("[1, 2]", r"t\.jsonl:2: each trace line must be a JSON object"),
    ],
)
def test_bad_rows_name_the_file_and_line(tmp_path: Path, line: str, message: str) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text('{"hash_ids": [0]}\n' + line + "\n")
    with pytest.raises(InvalidArgumentError, match=message):
        load_trace(path)


def test_missing_file_is_an_argument_error(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgumentError, match="trace must be a readable file"):
        load_trace(tmp_path / "nope.jsonl")


def test_limit_keeps_the_first_rows() -> None:
    trace = load_trace(DATA / "mooncake_conversation_head400.jsonl", limit=25)
    assert len(trace) == 25


def test_max_prefix_reuse_counts_leading_runs_seen_before() -> None:
    a, b, c, d = (bytes([i]) for i in range(4))
    reqs = [
        TraceRequest(0, (a, b), 2),
        TraceRequest(1, (a, c, b), 3),  # a hits, c misses, b is not a prefix hit
        TraceRequest(2, (a, b, d), 3),
    ]
    assert max_prefix_reuse(reqs) == 1 + 2


def test_synthetic_trace_is_deterministic_and_multi_turn() -> None:
    one = synthetic_trace(sessions=30, turns=4, seed=3)
    two = synthetic_trace(sessions=30, turns=4, seed=3)
    assert [r.keys for r in one.requests] == [r.keys for r in two.requests]
    assert len(one) == 120
    assert synthetic_trace(sessions=30, turns=4, seed=4).requests != one.requests
    # every non-first turn of a session extends an earlier prompt of the same session
    prompts = {r.keys for r in one.requests}
    extended = sum(
        1 for r in one.requests if any(r.keys[: len(p)] == p and len(p) < len(r.keys) for p in prompts)
    )
    assert extended >= 90
    assert max_prefix_reuse(one.requests) > 0.5 * one.block_refs


def test_synthetic_trace_rejects_bad_arguments() -> None:
    with pytest.raises(InvalidArgumentError, match="sessions must be >= 1, got 0"):
        synthetic_trace(sessions=0)
    with pytest.raises(InvalidArgumentError, match="user_blocks must be a range"):
        synthetic_trace(user_blocks=(3, 1))


def test_trace_rejects_bad_block_tokens() -> None:
    with pytest.raises(InvalidArgumentError, match="block_tokens must be a positive int, got 0"):
        Trace.from_requests("x", 0, [])


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("64GiB", 64 * 2**30),
        ("1TiB", 2**40),
        ("1.5GB", 1_500_000_000),
        ("4096", 4096),
        ("2e9", 2_000_000_000),
        ("512 MiB", 512 * 2**20),
        ("inf", None),
        ("unlimited", None),
    ],
)
def test_parse_size(text: str, value: int | None) -> None:
    assert parse_size(text) == value


@pytest.mark.parametrize("text", ["", "12XB", "-5GB", "GiB", "0"])
def test_parse_size_rejects_garbage(text: str) -> None:
    with pytest.raises(InvalidArgumentError, match="size must be"):
        parse_size(text)


def test_parse_bandwidth_and_format_size() -> None:
    assert parse_bandwidth("25GB/s") == 25e9
    assert parse_bandwidth("6e9") == 6e9
    assert format_size(3 * 2**30) == "3 GiB"
    assert format_size(64 * 2**20) == "64 MiB"
    assert format_size(None) == "inf"
    assert format_size(100) == "100 B"


def test_model_presets_kv_bytes_per_token() -> None:
    # layers * kv_heads * head_dim * 2 (K, V) * 2 bytes (bf16)
    assert COST_PRESETS["llama3-8b"].kv_bytes_per_token == 32 * 8 * 128 * 2 * 2 == 131072
    assert COST_PRESETS["llama3-70b"].kv_bytes_per_token == 80 * 8 * 128 * 2 * 2
    assert COST_PRESETS["qwen2-7b"].kv_bytes_per_token == 28 * 4 * 128 * 2 * 2
    assert 10_000 < COST_PRESETS["llama3-8b"].prefill_tokens_per_s < 50_000
