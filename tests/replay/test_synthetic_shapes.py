"""The ``synthetic:`` generator's workload shapes: chat, agentic, retrieval and mix. Each is deterministic per
seed, has the structure it promises, validates its arguments and bounds its size before generating, and is
reachable from ``aiokv replay synthetic:shape=...``."""

from __future__ import annotations

import itertools
import json
import math
from collections import defaultdict
from typing import Any

import pytest

from aiokv._errors import InvalidArgumentError, InvalidTypeError
from aiokv.cli import main
from aiokv.replay import (
    MAX_SYNTHETIC_REFS,
    SYNTHETIC_SHAPES,
    Trace,
    TraceRequest,
    agentic_trace,
    chat_trace,
    max_prefix_reuse,
    mix_trace,
    retrieval_trace,
    synthetic_trace,
)
from aiokv.replay import _trace as trace_module

SMALL: dict[str, dict[str, Any]] = {
    "chat": {"sessions": 20, "turns": 3},
    "agentic": {"sessions": 4, "turns": 8, "system_blocks": 10, "block_tokens": 64},
    "retrieval": {"questions": 200, "docs": 4, "doc_blocks": (5, 20)},
    "mix": {"sessions": 20},
}


def rows(trace: Trace) -> list[tuple[float, tuple[bytes, ...], int, int]]:
    return [(r.timestamp_ms, r.keys, r.input_tokens, r.output_tokens) for r in trace.requests]


def by_session(requests: list[TraceRequest], system_blocks: int) -> dict[bytes, list[TraceRequest]]:
    """Agent requests grouped by their first block past the tool prompt (unique to a session until it is
    compacted), in arrival order."""
    sessions: dict[bytes, list[TraceRequest]] = defaultdict(list)
    for r in requests:
        sessions[r.keys[system_blocks]].append(r)
    return sessions


# ----------------------------------------------------------------------------------------- every shape
def test_the_shapes_are_listed() -> None:
    assert SYNTHETIC_SHAPES == ("agentic", "chat", "mix", "retrieval")


@pytest.mark.parametrize("shape", SYNTHETIC_SHAPES)
def test_each_shape_is_deterministic_per_seed(shape: str) -> None:
    one = synthetic_trace(shape=shape, seed=3, **SMALL[shape])
    two = synthetic_trace(shape=shape, seed=3, **SMALL[shape])
    assert rows(one) == rows(two)
    assert one.name == two.name
    assert rows(synthetic_trace(shape=shape, seed=4, **SMALL[shape])) != rows(one)


@pytest.mark.parametrize("shape", SYNTHETIC_SHAPES)
def test_each_shape_keeps_keys_unique_per_block_and_eight_bytes_or_longer(shape: str) -> None:
    trace = synthetic_trace(shape=shape, seed=1, **SMALL[shape])
    keys = {k for r in trace.requests for k in r.keys}
    assert len(keys) == trace.unique_blocks > 0
    assert min(map(len, keys)) >= 8
    assert all(r.input_tokens <= len(r.keys) * trace.block_tokens for r in trace.requests)


@pytest.mark.parametrize(
    ("shape", "name"),
    [
        ("agentic", "synthetic(shape=agentic,sessions=4,seed=2)"),
        ("retrieval", "synthetic(shape=retrieval,questions=200,docs=4,seed=2)"),
        ("mix", "synthetic(shape=mix,then=retrieval,sessions=20,seed=2)"),
        ("chat", "synthetic(sessions=20,turns=3,seed=2)"),
    ],
)
def test_the_trace_name_shows_the_shape_but_chat_keeps_its_name(shape: str, name: str) -> None:
    assert synthetic_trace(shape=shape, seed=2, **SMALL[shape]).name == name


def test_chat_is_the_default_shape_and_unchanged() -> None:
    assert rows(synthetic_trace(shape="chat", seed=1)) == rows(synthetic_trace(seed=1))
    assert rows(chat_trace(seed=1)) == rows(synthetic_trace(seed=1))
    assert synthetic_trace().name == "synthetic(sessions=400,turns=6,seed=0)"


@pytest.mark.parametrize(
    ("kwargs", "sizes"),
    [
        ({"shape": "agentic", "sessions": 40, "seed": 1, "block_tokens": 64}, (1753, 721227, 10164)),
        ({"shape": "retrieval", "questions": 4000, "docs": 12, "seed": 1}, (5205, 1033523, 11059)),
    ],
)
def test_the_bench_workloads_are_the_traces_its_figures_were_measured_on(
    kwargs: dict[str, Any], sizes: tuple[int, int, int]
) -> None:
    """benchmarks/bench_policies.py generated these shapes itself before they moved into the library; the
    sizes of its traces then pin that the move changed nothing (docs/policies.md quotes its figures)."""
    trace = synthetic_trace(**kwargs)
    assert (len(trace), trace.block_refs, trace.unique_blocks) == sizes


# ---------------------------------------------------------------------------------------------- agentic
def test_agentic_turns_resend_the_whole_previous_prompt_plus_new_blocks() -> None:
    trace = agentic_trace(sessions=6, turns=12, system_blocks=20, block_tokens=64, seed=5)
    sessions = by_session(list(trace.requests), 20)
    assert len(sessions) == 6
    prompts = {r.keys[:20] for r in trace.requests}
    assert len(prompts) <= 3  # the shared tool prompts
    for turns in sessions.values():
        assert len(turns) >= 5
        for prev, nxt in itertools.pairwise(turns):
            assert nxt.keys[: len(prev.keys)] == prev.keys
            assert len(nxt.keys) >= len(prev.keys) + 2  # the action, then a tool result
    assert trace.block_tokens == 64
    assert {r.output_tokens for r in trace.requests} == {64}


def test_agentic_compacts_a_context_past_context_blocks() -> None:
    """Past context_blocks the context is cut back to the tool prompt plus a 40-block summary: no request
    outgrows that by more than one tool result, and the turn after a cut does not re-send the chain."""
    trace = agentic_trace(sessions=1, turns=20, system_blocks=10, context_blocks=12, seed=2)
    assert len({r.keys[:10] for r in trace.requests}) == 1
    assert max(len(r.keys) for r in trace.requests) <= 10 + 40 + 60
    pairs = list(itertools.pairwise(trace.requests))
    assert any(nxt.keys[: len(prev.keys)] != prev.keys for prev, nxt in pairs)
    assert all(nxt.keys[:10] == prev.keys[:10] for prev, nxt in pairs)


# -------------------------------------------------------------------------------------------- retrieval
def test_retrieval_questions_share_a_few_large_documents() -> None:
    trace = retrieval_trace(questions=500, docs=5, doc_blocks=(40, 80), system_blocks=4, seed=7)
    assert len(trace) >= 500
    system = trace.requests[0].keys[:4]
    assert all(r.keys[:4] == system for r in trace.requests)
    documents = {r.keys[4] for r in trace.requests}
    assert len(documents) <= 5
    assert all(len(r.keys) <= 4 + 80 + 4 for r in trace.requests)
    assert max_prefix_reuse(trace.requests) > 0.9 * trace.block_refs
    assert trace.unique_blocks < 0.1 * trace.block_refs


def test_retrieval_without_follow_ups_has_one_request_per_question() -> None:
    assert len(retrieval_trace(questions=50, docs=2, follow_up=0, seed=1)) == 50
    assert len(retrieval_trace(questions=50, docs=2, follow_up=1, seed=1)) == 100


# -------------------------------------------------------------------------------------------------- mix
@pytest.mark.parametrize("then", ["retrieval", "agentic"])
def test_mix_shifts_from_chat_to_the_other_shape_half_way(then: str) -> None:
    trace = mix_trace(then=then, sessions=30, block_tokens=64, seed=4)
    chat = chat_trace(sessions=30, block_tokens=64, seed=4)
    half = chat.requests[-1].timestamp_ms
    first = [r for r in trace.requests if r.timestamp_ms <= half]
    second = [r for r in trace.requests if r.timestamp_ms > half]
    assert [r.keys for r in first] == [r.keys for r in chat.requests]
    assert second, "the second half is empty"
    assert second[-1].timestamp_ms <= 2 * half
    assert not {k for r in first for k in r.keys} & {k for r in second for k in r.keys}
    if then == "retrieval":
        refs = sum(len(r.keys) for r in second)
        assert max_prefix_reuse(second) > 0.8 * refs
        assert len({r.keys[4] for r in second}) <= 12
    else:
        for turns in by_session(second, 150).values():
            for prev, nxt in itertools.pairwise(turns):
                assert nxt.keys[: len(prev.keys)] == prev.keys
    assert trace.name == f"synthetic(shape=mix,then={then},sessions=30,seed=4)"


# -------------------------------------------------------------------------------------------- arguments
def test_an_unknown_shape_is_refused() -> None:
    with pytest.raises(InvalidArgumentError) as exc:
        synthetic_trace(shape="x")
    assert str(exc.value) == "shape must be one of ['agentic', 'chat', 'mix', 'retrieval'], got 'x'"
    with pytest.raises(InvalidArgumentError, match=r"shape must be one of .*, got 3$"):
        synthetic_trace(shape=3)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("shape", "option", "message"),
    [
        (
            "agentic",
            "questions",
            "agentic trace option must be one of ['block_tokens', 'context_blocks', 'seed', 'sessions', "
            "'sessions_per_s', 'system_blocks', 'system_prompts', 'think_s', 'turns'], got 'questions'",
        ),
        (
            "retrieval",
            "sessions",
            "retrieval trace option must be one of ['block_tokens', 'doc_blocks', 'docs', 'follow_up', "
            "'questions', 'questions_per_s', 'seed', 'system_blocks'], got 'sessions'",
        ),
        (
            "mix",
            "turns",
            "mix trace option must be one of ['block_tokens', 'seed', 'sessions', 'then'], got 'turns'",
        ),
    ],
)
def test_an_option_the_shape_does_not_take_is_refused(shape: str, option: str, message: str) -> None:
    with pytest.raises(InvalidTypeError) as exc:
        synthetic_trace(shape=shape, **{option: 1})
    assert str(exc.value) == message


@pytest.mark.parametrize(
    ("function", "kwargs", "message"),
    [
        (agentic_trace, {"sessions": 0}, "sessions must be >= 1, got 0"),
        (agentic_trace, {"turns": 0}, "turns must be >= 1, got 0"),
        (agentic_trace, {"system_prompts": 0}, "system_prompts must be >= 1, got 0"),
        (agentic_trace, {"system_blocks": -1}, "system_blocks must be >= 0, got -1"),
        (agentic_trace, {"context_blocks": 0}, "context_blocks must be >= 1, got 0"),
        (agentic_trace, {"sessions_per_s": 0}, "sessions_per_s must be > 0, got 0"),
        (agentic_trace, {"think_s": -1}, "think_s must be >= 0, got -1"),
        (agentic_trace, {"think_s": math.nan}, "think_s must be finite, got nan"),
        (agentic_trace, {"block_tokens": 0}, "block_tokens must be a positive int, got 0"),
        (retrieval_trace, {"questions": 0}, "questions must be >= 1, got 0"),
        (retrieval_trace, {"docs": 0}, "docs must be >= 1, got 0"),
        (
            retrieval_trace,
            {"doc_blocks": (9, 3)},
            "doc_blocks must be a range (lo, hi) of ints with 0 <= lo <= hi, got (9, 3)",
        ),
        (retrieval_trace, {"system_blocks": -3}, "system_blocks must be >= 0, got -3"),
        (retrieval_trace, {"questions_per_s": -2.5}, "questions_per_s must be > 0, got -2.5"),
        (retrieval_trace, {"questions_per_s": math.inf}, "questions_per_s must be finite, got inf"),
        (retrieval_trace, {"follow_up": 1.5}, "follow_up must be in [0, 1], got 1.5"),
        (retrieval_trace, {"follow_up": -0.1}, "follow_up must be in [0, 1], got -0.1"),
        (retrieval_trace, {"follow_up": math.nan}, "follow_up must be in [0, 1], got nan"),
        (retrieval_trace, {"block_tokens": -64}, "block_tokens must be a positive int, got -64"),
        (mix_trace, {"then": "chat"}, "then must be one of ['agentic', 'retrieval'], got 'chat'"),
        (mix_trace, {"then": None}, "then must be one of ['agentic', 'retrieval'], got None"),
        (mix_trace, {"sessions": 0}, "sessions must be >= 1, got 0"),
        (mix_trace, {"block_tokens": 0}, "block_tokens must be a positive int, got 0"),
    ],
)
def test_shape_arguments_are_validated(function: Any, kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidArgumentError) as exc:
        function(**kwargs)
    assert str(exc.value) == message


@pytest.mark.parametrize(
    ("function", "kwargs", "message"),
    [
        (agentic_trace, {"sessions": 2.0}, "sessions must be an int, got float"),
        (agentic_trace, {"context_blocks": "9"}, "context_blocks must be an int, got str"),
        (agentic_trace, {"seed": 1.5}, "seed must be an int, got float"),
        (retrieval_trace, {"follow_up": "often"}, "follow_up must be a number, got str"),
        (retrieval_trace, {"follow_up": True}, "follow_up must be a number, got bool"),
        (retrieval_trace, {"questions_per_s": None}, "questions_per_s must be a number, got NoneType"),
        (mix_trace, {"seed": "1"}, "seed must be an int, got str"),
    ],
)
def test_shape_argument_types_are_checked(function: Any, kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidTypeError) as exc:
        function(**kwargs)
    assert str(exc.value) == message


# ------------------------------------------------------------------------------------------------- size
def test_a_huge_agentic_trace_is_refused_before_anything_is_drawn() -> None:
    with pytest.raises(InvalidArgumentError) as exc:
        agentic_trace(sessions=10**8)
    assert str(exc.value) == (
        f"synthetic trace must hold at most {MAX_SYNTHETIC_REFS} block references, got more than that "
        "(shape=agentic, sessions=100000000, turns=60, system_blocks=150, context_blocks=3000)"
    )


def test_the_agentic_size_is_counted_exactly(monkeypatch: pytest.MonkeyPatch) -> None:
    trace = agentic_trace(sessions=5, turns=10, system_blocks=8, seed=3)
    exact = trace.block_refs + 3 * (1 + 8)  # the tool prompts' keys count too
    monkeypatch.setattr(trace_module, "MAX_SYNTHETIC_REFS", exact)
    assert rows(agentic_trace(sessions=5, turns=10, system_blocks=8, seed=3)) == rows(trace)
    monkeypatch.setattr(trace_module, "MAX_SYNTHETIC_REFS", exact - 1)
    with pytest.raises(InvalidArgumentError, match="got more than that"):
        agentic_trace(sessions=5, turns=10, system_blocks=8, seed=3)


@pytest.mark.parametrize(
    ("function", "kwargs", "message"),
    [
        (
            retrieval_trace,
            {"questions": 10**6},
            "got up to 814004816 (shape=retrieval, questions=1000000, docs=12, doc_blocks=(50, 400), "
            "system_blocks=4)",
        ),
        (
            retrieval_trace,
            {"docs": 10**6, "questions": 1},
            "got up to 401000818 (shape=retrieval, questions=1, docs=1000000, doc_blocks=(50, 400), "
            "system_blocks=4)",
        ),
        (
            mix_trace,
            {"sessions": 10**7},
            "got up to 2463260856 (shape=mix, then=retrieval, sessions=10000000)",
        ),
        (
            mix_trace,
            {"sessions": 10**7, "then": "agentic"},
            "got more than that (shape=mix, then=agentic, sessions=10000000)",
        ),
    ],
)
def test_the_size_is_bounded_before_generating(function: Any, kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidArgumentError) as exc:
        function(**kwargs)
    assert (
        str(exc.value)
        == f"synthetic trace must hold at most {MAX_SYNTHETIC_REFS} block references, {message}"
    )


# ------------------------------------------------------------------------------------------ command line
def replay_json(capsys: pytest.CaptureFixture[str], *args: str) -> dict[str, Any]:
    assert main(["replay", *args, "--json", "--no-progress"]) == 0
    out: dict[str, Any] = json.loads(capsys.readouterr().out)
    return out


def test_the_command_line_replays_a_retrieval_trace(capsys: pytest.CaptureFixture[str]) -> None:
    out = replay_json(capsys, "synthetic:questions=60,shape=retrieval,docs=3,seed=2", "--tiers", "cpu=inf")
    expected = retrieval_trace(questions=60, docs=3, seed=2)
    assert out["trace"]["name"] == expected.name
    assert out["trace"]["requests"] == len(expected)
    assert out["trace"]["block_refs"] == expected.block_refs
    assert out["trace"]["max_prefix_reuse_ratio"] > 0.8
    assert out["runs"][0]["block_hit_ratio"] == pytest.approx(out["trace"]["max_prefix_reuse_ratio"])


@pytest.mark.parametrize(
    ("spec", "block_tokens", "expected"),
    [
        (
            "shape=agentic,sessions=2,turns=5,seed=3",
            64,
            agentic_trace(sessions=2, turns=5, block_tokens=64, seed=3),
        ),
        (
            "shape=mix,then=agentic,sessions=5,seed=1",
            64,
            mix_trace(then="agentic", sessions=5, block_tokens=64, seed=1),
        ),
        ("shape=chat,sessions=4,turns=2", 512, chat_trace(sessions=4, turns=2)),
    ],
)
def test_the_command_line_passes_each_shape_its_options(
    capsys: pytest.CaptureFixture[str], spec: str, block_tokens: int, expected: Trace
) -> None:
    out = replay_json(capsys, f"synthetic:{spec}", "--block-tokens", str(block_tokens), "--tiers", "cpu=inf")
    assert out["trace"]["name"] == expected.name
    assert out["trace"]["block_refs"] == expected.block_refs
    assert out["trace"]["block_tokens"] == block_tokens


CHAT_OPTIONS = "['seed', 'sessions', 'sessions_per_s', 'system_blocks', 'system_prompts', 'think_s', 'turns']"


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("shape=x", "shape must be one of ['agentic', 'chat', 'mix', 'retrieval'], got 'x'"),
        (
            "sessions=2,shape=",
            "synthetic trace options must look like name=value[,name=value...], got 'sessions=2,shape='",
        ),
        ("shape=chat,docs=3", f"synthetic trace option must be one of {CHAT_OPTIONS}, got 'docs'"),
        ("docs=3", f"synthetic trace option must be one of {CHAT_OPTIONS}, got 'docs'"),
        (
            "shape=agentic,questions=3",
            "synthetic trace option for shape agentic must be one of ['context_blocks', 'seed', 'sessions', "
            "'sessions_per_s', 'system_blocks', 'system_prompts', 'think_s', 'turns'], got 'questions'",
        ),
        (
            "shape=retrieval,sessions=3",
            "synthetic trace option for shape retrieval must be one of ['docs', 'follow_up', 'questions', "
            "'questions_per_s', 'seed', 'system_blocks'], got 'sessions'",
        ),
        (
            "shape=mix,turns=3",
            "synthetic trace option for shape mix must be one of ['seed', 'sessions', 'then'], got 'turns'",
        ),
        ("shape=retrieval,docs=many", "synthetic trace option docs must be an int, got 'many'"),
        ("shape=retrieval,follow_up=half", "synthetic trace option follow_up must be a number, got 'half'"),
        ("shape=retrieval,follow_up=2", "follow_up must be in [0, 1], got 2"),
        ("shape=agentic,context_blocks=0", "context_blocks must be >= 1, got 0"),
        ("shape=mix,then=chat", "then must be one of ['agentic', 'retrieval'], got 'chat'"),
        (
            "shape=agentic,shape=chat",
            "synthetic trace options must name 'shape' only once, got 'shape=agentic,shape=chat'",
        ),
    ],
)
def test_the_command_line_refuses_bad_shape_options(
    capsys: pytest.CaptureFixture[str], spec: str, message: str
) -> None:
    assert main(["replay", f"synthetic:{spec}", "--json", "--no-progress"]) == 2
    out, err = capsys.readouterr()
    assert err == f"aiokv replay: error: {message}\n"
    assert out == ""
