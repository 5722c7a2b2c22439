"""Request intake: sizes are checked before work, and the work is done in pieces.

The body's size before it is read or parsed; a prompt's length right after parsing, before any token is
read; JSON parsed by :mod:`aiokv.serve._json` (the values and errors of ``json.loads``, in pieces that let
other threads run); detokenizing in whole-sequence operations."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aiokv.serve import ByteTokenizer
from aiokv.serve import _json as fastjson
from aiokv.serve._app import EXTRA_VALUES, INLINE_BYTES, VALUES_PER_TOKEN
from aiokv.serve._schema import APIError, _short, parse_chat_request, parse_completion_request
from aiokv.serve._tokenizer import Detokenizer

from ._server import ServerThread, config

TOK = ByteTokenizer(512)
CTX = 4096


# ---------------------------------------------------------------------------------------------- JSON
def _reference(text: str) -> tuple[str, Any]:
    try:
        return "ok", json.loads(text, parse_constant=fastjson._no_constant)
    except ValueError as exc:
        return "error", (getattr(exc, "msg", str(exc)), getattr(exc, "pos", None))


def _ours(text: str) -> tuple[str, Any]:
    try:
        return "ok", fastjson.loads(text)
    except ValueError as exc:
        return "error", (getattr(exc, "msg", str(exc)), getattr(exc, "pos", None))


_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(10**20), 10**20),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=8),
)
_documents = st.recursive(
    _scalars,
    lambda inner: st.lists(inner, max_size=6) | st.dictionaries(st.text(max_size=4), inner, max_size=4),
    max_leaves=30,
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_documents, st.sampled_from([None, 0, 1, 2]), st.data())
def test_json_matches_the_standard_library(doc: Any, indent: int | None, data: st.DataObject) -> None:
    text = json.dumps(doc, indent=indent)
    assert _ours(text) == _reference(text)
    # A damaged document: the same value or the same error at the same position.
    i = data.draw(st.integers(0, len(text)))
    damaged = (
        text[:i]
        + data.draw(st.sampled_from([",", "]", "}", "[", '"', " ", "x", ":", "-", ""]))
        + text[i + 1 :]
    )
    assert _ours(damaged) == _reference(damaged)


def test_json_parses_long_runs_of_numbers_in_pieces() -> None:
    ids = [(i * 7919) % 100_003 - 50 for i in range(3 * fastjson.CHUNK)]
    doc = {"prompt": ids, "nested": [ids[:5], [1.5, -2e-3, 0]], "s": "x"}
    for indent in (None, 1):
        text = json.dumps(doc, indent=indent)
        assert fastjson.loads(text) == doc
    text = json.dumps(ids)
    for bad in (text[:-1] + ",]", text[:1000] + ",," + text[1000:], text[:70_000] + " 1 2 " + text[70_000:]):
        assert _ours(bad) == _reference(bad)
        assert _ours(bad)[0] == "error"


def test_json_refuses_what_is_not_json_and_bounds_nesting_and_values() -> None:
    for text in ("[NaN]", '{"a": Infinity}', "[-Infinity]"):
        with pytest.raises(ValueError, match="is not a JSON number"):
            fastjson.loads(text)
    assert fastjson.loads("[" * fastjson.MAX_DEPTH + "]" * fastjson.MAX_DEPTH) is not None
    with pytest.raises(ValueError, match=f"nest deeper than {fastjson.MAX_DEPTH} levels"):
        fastjson.loads("[" * 100_000)
    with pytest.raises(fastjson.TooManyValues, match="more than 10 values"):
        fastjson.loads(json.dumps([{"a": 1}] * 6), max_values=10)
    assert len(fastjson.loads(json.dumps([1] * 100_000), max_values=1)) == 100_000  # a run counts once
    with pytest.raises(ValueError, match="BOM"):
        fastjson.loads("\ufeff{}")
    assert fastjson.loads('{"a": "\\u00e9"}'.encode("utf-16")) == {"a": "é"}


# ---------------------------------------------------------------------------------------------- tokens
@settings(max_examples=300, deadline=None)
@given(st.lists(st.one_of(st.integers(0, 255), st.integers(256, 511)), max_size=40), st.booleans())
def test_decode_is_the_detokenizer_token_by_token(ids: list[int], skip: bool) -> None:
    detok = Detokenizer(TOK, skip_special_tokens=skip)
    want = "".join(detok.push(t) for t in ids) + detok.flush()
    assert TOK.decode(ids, skip_special_tokens=skip) == want
    assert TOK.decode(iter(ids), skip_special_tokens=skip) == want


class _Untouchable(list):  # type: ignore[type-arg]
    """A prompt list that fails if anything reads its items one by one."""

    def __iter__(self) -> Iterator[Any]:
        raise AssertionError("the prompt's tokens were read")


class _Unencodable(str):
    __slots__ = ()

    def encode(self, *args: Any, **kwargs: Any) -> bytes:
        raise AssertionError("the prompt was tokenized")


def _refusal(parse: Any, body: dict[str, Any]) -> APIError:
    with pytest.raises(APIError) as exc:
        parse(body, TOK, context_len=CTX)
    return exc.value


def test_a_prompt_too_long_is_refused_before_its_tokens_are_read() -> None:
    err = _refusal(parse_completion_request, {"prompt": _Untouchable([65] * 5_000_000)})
    assert (
        err.message == f"this model's maximum context length is {CTX} tokens; the prompt has 5000000 tokens"
    )
    assert err.code == "context_length_exceeded"
    err = _refusal(parse_completion_request, {"prompt": [[65], _Untouchable([65] * CTX)]})
    assert "the prompt has 4096 tokens" in err.message
    err = _refusal(parse_completion_request, {"prompt": _Unencodable("a" * 10_000)})
    assert "the prompt has 10000 tokens" in err.message
    err = _refusal(parse_completion_request, {"prompt": _Unencodable("é" * 5000)})
    assert "the prompt has at least 5000 tokens" in err.message  # characters: a lower bound
    err = _refusal(parse_completion_request, {"prompt": "é" * 2500})  # 5000 bytes: counted once encoded
    assert "the prompt has 5000 tokens" in err.message


def test_prompts_times_n_is_checked_before_any_prompt() -> None:
    err = _refusal(parse_completion_request, {"prompt": [_Untouchable([65])] * 65})
    assert err.message == "prompts x n must be <= 64, got 65 x 1"
    err = _refusal(parse_completion_request, {"prompt": [_Untouchable([65])] * 9, "n": 8})
    assert err.param == "n"


def test_chat_messages_are_counted_as_they_are_read() -> None:
    class Endless(list):  # type: ignore[type-arg]
        """Messages that would never end: reading stops once they cannot fit."""

        def __iter__(self) -> Iterator[Any]:
            while True:
                yield {"role": "user", "content": "x" * 100}

    err = _refusal(parse_chat_request, {"messages": Endless([None])})
    assert err.code == "context_length_exceeded"
    assert err.param == "messages"
    assert "the prompt has at least 41" in err.message


def test_bad_text_and_values_are_client_errors() -> None:
    """Values that used to escape as a 500: a lone surrogate (JSON can write one), an unhashable role, a huge
    int for a float parameter."""
    assert "must be valid Unicode text" in _refusal(parse_completion_request, {"prompt": "a\ud800"}).message
    bad = {"messages": [{"role": "user", "content": "\udfff"}]}
    assert "must be valid Unicode text" in _refusal(parse_chat_request, bad).message
    bad = {"messages": [{"role": [], "content": "x"}]}
    assert "messages[0].role must be one of" in _refusal(parse_chat_request, bad).message
    bad = {"prompt": "x", "temperature": 10**400}
    assert "temperature must be in [0, 2]" in _refusal(parse_completion_request, bad).message


def test_messages_quote_a_bounded_part_of_a_huge_value() -> None:
    huge = [[65] * 1000] * 1000
    assert len(_short(huge)) <= 60
    err = _refusal(parse_completion_request, {"prompt": "x", "stop": huge})
    assert len(err.message) < 200


# ---------------------------------------------------------------------------------------------- HTTP
@pytest.fixture(scope="module")
def small_server() -> Iterator[ServerThread]:
    """A server whose body limit is 1 MiB and whose request timeout is short (a body that stops arriving)."""
    server = ServerThread(config(max_request_bytes=1 << 20, request_timeout=2.0)).start()
    yield server
    server.stop()
    assert server.leaked == []


def _post(server: ServerThread, content: Any, path: str = "/v1/completions") -> httpx.Response:
    with httpx.Client(base_url=server.url, timeout=30) as http:
        return http.post(path, content=content, headers={"content-type": "application/json"})


def test_a_body_over_the_limit_is_refused_before_it_is_read(small_server: ServerThread) -> None:
    body = json.dumps({"prompt": [65] * 400_000}).encode()  # 2.4 MB
    r = _post(small_server, body)
    assert r.status_code == 413
    assert r.json()["error"] == {
        "message": f"the request body must be at most max_request_bytes=1048576 bytes, got {len(body)}",
        "type": "invalid_request_error",
        "param": None,
        "code": "request_too_large",
    }

    def chunks() -> Iterator[bytes]:  # no Content-Length: counted as it arrives
        for i in range(0, len(body), 1 << 16):
            yield body[i : i + (1 << 16)]

    r = _post(small_server, chunks())
    assert r.status_code == 413
    assert r.json()["error"]["message"].endswith("bytes, got more")


def test_a_body_under_the_limit_is_parsed_off_the_loop_and_sized_first(small_server: ServerThread) -> None:
    body = json.dumps({"prompt": [65] * 150_000}).encode()
    assert INLINE_BYTES < len(body) < 1 << 20
    r = _post(small_server, body)
    assert r.status_code == 400
    assert r.json()["error"]["code"] == "context_length_exceeded"
    assert "the prompt has 150000 tokens" in r.json()["error"]["message"]
    chat = {"messages": [{"role": "user", "content": "a"}] * 8000}  # 3 values each
    r = _post(small_server, json.dumps(chat).encode(), "/v1/chat/completions")
    assert r.status_code == 413
    limit = VALUES_PER_TOKEN * CTX + EXTRA_VALUES
    assert f"must hold at most {limit} JSON values" in r.json()["error"]["message"]
    r = _post(small_server, b"[" * 100_000)
    assert r.status_code == 400
    assert "nest deeper than 64 levels" in r.json()["error"]["message"]
    ok = json.dumps({"prompt": [65] * 4000, "max_tokens": 2, "temperature": 0, "pad": " " * INLINE_BYTES})
    r = _post(small_server, ok.encode())
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == 4000


def _raw_request(server: ServerThread, head: bytes, body: bytes) -> socket.socket:
    host, port = server.url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=30)
    sock.sendall(head + body)
    return sock


def _response(sock: socket.socket) -> bytes:
    out = b""
    while chunk := sock.recv(65536):
        out += chunk
    return out


def test_a_body_that_stops_arriving_times_out(small_server: ServerThread) -> None:
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    head += b"Content-Length: 1000\r\nConnection: close\r\n\r\n"
    with _raw_request(small_server, head, b'{"prompt": ') as sock:
        answer = _response(sock)  # the server gives up after request_timeout (2 s)
    assert answer.startswith(b"HTTP/1.1 408 "), answer[:200]
    assert b"did not arrive within request_timeout=2 s" in answer


def test_a_body_cut_short_leaves_the_server_serving(small_server: ServerThread) -> None:
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    head += b"Content-Length: 1000\r\n\r\n"
    sock = _raw_request(small_server, head, b'{"prompt": ')
    sock.close()  # gone before the body
    svc = small_server.service
    r = _post(small_server, json.dumps({"prompt": "hi", "max_tokens": 1}).encode())
    assert r.status_code == 200
    assert small_server.call(lambda: svc.stats().requests_in_flight) == 0
