"""JSON numbers where an integer is expected: ``5`` and ``5.0`` are the integer 5, ``5.5`` is refused, and so is
every value outside the parameter's range (``1e30`` included) with a message naming the parameter and its
range; strings and booleans are never integers."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from aiokv.serve import ByteTokenizer
from aiokv.serve._schema import APIError, parse_chat_request, parse_completion_request

from ._server import ServerThread

TOK = ByteTokenizer(512)
CTX = 4096
SEED = "[-9223372036854775808, 9223372036854775807]"

# (endpoint, integer parameter, its range as the message writes it)
PARAMS = [
    ("completion", "max_tokens", f"[1, {CTX}]"),
    ("chat", "max_tokens", f"[1, {CTX}]"),
    ("chat", "max_completion_tokens", f"[1, {CTX}]"),
    ("completion", "n", "[1, 64]"),
    ("chat", "n", "[1, 64]"),
    ("completion", "best_of", "[1, 64]"),
    ("completion", "seed", SEED),
    ("chat", "seed", SEED),
    ("completion", "logprobs", "[0, 20]"),
    ("chat", "top_logprobs", "[0, 20]"),
]
NOT_INTEGERS = [5.5, -0.5, "5", True, False, [5], {"value": 5}]
OUT_OF_RANGE = [1e30, -1e30, 10**30, -(10**30)]


def _parse(kind: str, fields: dict[str, Any]) -> Any:
    if kind == "chat":
        return parse_chat_request(
            {"messages": [{"role": "user", "content": "hi"}], **fields}, TOK, context_len=CTX
        )
    return parse_completion_request({"prompt": "hi", **fields}, TOK, context_len=CTX)


def _refused(kind: str, fields: dict[str, Any]) -> APIError:
    with pytest.raises(APIError) as exc:
        _parse(kind, fields)
    assert exc.value.status == 400
    return exc.value


@pytest.mark.parametrize(
    ("kind", "name", "value"),
    [
        pytest.param(kind, name, value, id=f"{kind}-{name}-{value!r}")
        for kind, name, _ in PARAMS
        for value in NOT_INTEGERS
        if not (name == "logprobs" and isinstance(value, bool))  # chat's boolean form: false is neutral
    ],
)
def test_a_value_that_is_not_an_integer_is_refused_by_name(kind: str, name: str, value: Any) -> None:
    err = _refused(kind, {name: value})
    assert err.param == name
    assert err.message == f"{name} must be an integer, got {value!r}"


@pytest.mark.parametrize(
    ("kind", "name", "bounds", "value"),
    [
        pytest.param(kind, name, bounds, value, id=f"{kind}-{name}-{value!r}")
        for kind, name, bounds in PARAMS
        for value in OUT_OF_RANGE
    ],
)
def test_a_value_out_of_range_is_refused_with_the_range(
    kind: str, name: str, bounds: str, value: Any
) -> None:
    err = _refused(kind, {name: value})
    assert err.param == name
    assert f"{name} must be in {bounds}" in err.message
    assert err.message.endswith(f"got {value!r}"), err.message  # as sent: 1e+30, not 31 digits


def test_an_integral_float_is_that_integer() -> None:
    req = _parse("completion", {"max_tokens": 5.0, "n": 2.0, "best_of": 2e0, "seed": -3.0, "logprobs": 0.0})
    assert (req.max_tokens, req.n, req.seed) == (5, 2, -3)
    assert type(req.max_tokens) is int
    chat = _parse("chat", {"max_completion_tokens": 7.0, "top_logprobs": 0.0, "logprobs": False})
    assert chat.max_tokens == 7
    ids = parse_completion_request({"prompt": [65.0, 66]}, TOK).prompts
    assert ids == ((65, 66),)
    assert all(type(t) is int for t in ids[0])


def test_max_tokens_over_the_context_is_a_context_length_error() -> None:
    err = _refused("completion", {"max_tokens": 1e30})
    assert err.code == "context_length_exceeded"
    assert err.message == (
        f"max_tokens must be in [1, {CTX}] (this model's maximum context length is {CTX} tokens), got 1e+30"
    )


def test_token_ids_follow_the_same_rule() -> None:
    for ids, message in (
        ([65, 5.5], "prompt token ids must be integers, got 5.5"),
        ([65, "a"], "prompt token ids must be integers, got 'a'"),
        ([65, True], "prompt token ids must be integers, got True"),
        ([65, 1e30], "prompt token ids must be in [0, 512), got 1000000000000000019884624838656"),
    ):
        with pytest.raises(APIError) as exc:
            parse_completion_request({"prompt": ids}, TOK)
        assert exc.value.message == message
        assert exc.value.param == "prompt"


def test_a_nonzero_logprobs_is_unsupported_not_out_of_range() -> None:
    for kind, fields in (
        ("completion", {"logprobs": 3}),
        ("chat", {"logprobs": True}),
        ("chat", {"top_logprobs": 2.0}),
    ):
        err = _refused(kind, fields)
        assert "is not supported by the aiokv reference engine" in err.message


def test_numbers_over_http(offload_server: ServerThread) -> None:
    """The same rule through the server: the body's numbers as JSON writes them."""
    with httpx.Client(base_url=offload_server.url, timeout=30) as http:
        for raw, status, needle in (
            (b'{"prompt": "hi", "max_tokens": 1e30}', 400, "max_tokens must be in [1, 4096]"),
            (b'{"prompt": "hi", "max_tokens": 5.5}', 400, "max_tokens must be an integer, got 5.5"),
            (b'{"prompt": "hi", "max_tokens": "5"}', 400, "max_tokens must be an integer, got '5'"),
            (b'{"prompt": "hi", "n": 1e3}', 400, "n must be in [1, 64], got 1000.0"),
            (b'{"prompt": "hi", "temperature": 1e400}', 400, "temperature must be a number, got inf"),
            (b'{"prompt": "hi", "temperature": ' + b"9" * 400 + b"}", 400, "temperature must be in [0, 2]"),
            (b'{"prompt": "hi", "max_tokens": 2.0, "temperature": 0}', 200, ""),
        ):
            r = http.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
            assert r.status_code == status, (raw, r.text)
            if status == 200:
                assert r.json()["usage"]["completion_tokens"] <= 2
            else:
                assert needle in r.json()["error"]["message"], r.text


@pytest.mark.parametrize(
    ("name", "value"),
    [("top_k", 40), ("min_p", 0.1), ("min_tokens", 4), ("repetition_penalty", 1.2), ("stop_token_ids", [7]),
     ("use_beam_search", True), ("top_k", "40")],
)  # fmt: skip
def test_vllm_sampling_extras_are_refused_not_ignored(name: str, value: Any) -> None:
    for kind in ("completion", "chat"):
        err = _refused(kind, {name: value})
        assert err.param == name
        assert err.message.startswith(f"{name} is not supported by the aiokv reference engine, got ")


@pytest.mark.parametrize(
    ("name", "value"),
    [("top_k", -1), ("top_k", 0), ("min_p", 0.0), ("min_tokens", 0), ("repetition_penalty", 1.0),
     ("stop_token_ids", []), ("use_beam_search", False)],
)  # fmt: skip
def test_vllm_sampling_extras_at_their_neutral_value_are_accepted(name: str, value: Any) -> None:
    parse_completion_request({"prompt": "hi", name: value}, TOK)
