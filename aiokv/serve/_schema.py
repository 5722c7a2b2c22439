"""The OpenAI wire format: request validation, error bodies, response and stream-chunk builders.

Validation is strict where silence would mislead (a sampling option the engine cannot honour is refused, not
ignored) and lenient where clients differ harmlessly (``model`` may be left out; ``null`` means "default").
Every refusal is an :class:`APIError` whose message names the parameter and the constraint.
"""

from __future__ import annotations

import math
import reprlib
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

from ._tokenizer import ByteTokenizer, ChatMessage

__all__ = [
    "APIError",
    "GenerationRequest",
    "parse_chat_request",
    "parse_completion_request",
]

MAX_CHOICES = 64
"""Engine requests one HTTP request may start (prompts x n)."""
MAX_STOP = 16
MAX_STOP_LEN = 256
MAX_LOGPROBS = 20
"""The range of ``logprobs`` and ``top_logprobs`` (vLLM's default ``max_logprobs``); only 0 is served."""
MAX_TOKENS_LIMIT = (1 << 31) - 1
"""``max_tokens`` at most when the context length is not known (the service's is always known)."""
_SEED_MAX = (1 << 63) - 1


class APIError(Exception):
    """An error answered as ``{"error": {"message", "type", "param", "code"}}`` with ``status``."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def invalid(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    """A validated completions or chat request, prompts tokenized. ``max_tokens`` is ``None`` when the client
    gave none (the service picks the default for the endpoint)."""

    kind: str  # "completion" or "chat"
    model: str | None
    prompts: tuple[tuple[int, ...], ...]
    prompt_texts: tuple[str, ...]  # for echo (completions)
    n: int
    max_tokens: int | None
    temperature: float
    seed: int | None
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    echo: bool
    skip_special_tokens: bool
    ignore_eos: bool

    @property
    def num_choices(self) -> int:
        return len(self.prompts) * self.n


# ------------------------------------------------------------------------------------------- field readers
def _opt(body: Mapping[str, Any], name: str) -> Any:
    return body.get(name)


def _int(body: Mapping[str, Any], name: str, *, lo: int, hi: int) -> int | None:
    """An integer parameter: a JSON number with an integral value (``5``, ``5.0``, ``5e0``; not ``5.5``, a
    string or a boolean) in ``[lo, hi]``."""
    value = body.get(name)
    if value is None:
        return None
    number = _integer(value)
    if number is None:
        raise invalid(f"{name} must be an integer, got {_short(value)}", name)
    if not lo <= number <= hi:
        raise invalid(f"{name} must be in [{lo}, {hi}], got {_short(value)}", name)
    return number


def _integer(value: Any) -> int | None:
    """``value`` as an int when it is a JSON integer or a float with an integral value; else ``None``."""
    if type(value) is int:
        return value
    if type(value) is float and value.is_integer():
        return int(value)
    return None


def _number(body: Mapping[str, Any], name: str, *, lo: float, hi: float) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if type(value) is not int and not (type(value) is float and math.isfinite(value)):
        raise invalid(f"{name} must be a number, got {_short(value)}", name)
    if not lo <= value <= hi:  # exact for an int of any size (float() would overflow)
        raise invalid(f"{name} must be in [{lo:g}, {hi:g}], got {_short(value)}", name)
    return float(value)


def _bool(body: Mapping[str, Any], name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise invalid(f"{name} must be a boolean, got {_short(value)}", name)
    return value


def _unsupported(body: Mapping[str, Any]) -> None:
    """Refuse options the reference engine cannot honour unless they hold their neutral value."""
    neutral: dict[str, tuple[Any, ...]] = {
        "top_p": (None, 1, 1.0),
        "presence_penalty": (None, 0, 0.0),
        "frequency_penalty": (None, 0, 0.0),
        "logit_bias": (None, {}),
        "suffix": (None, ""),
        "tools": (None, []),
        "functions": (None, []),
        "tool_choice": (None, "none", "auto"),
        "function_call": (None, "none", "auto"),
        # vLLM's sampling extras: refused, not ignored, unless they say "off"
        "top_k": (None, -1, 0),
        "min_p": (None, 0, 0.0),
        "min_tokens": (None, 0),
        "repetition_penalty": (None, 1, 1.0),
        "stop_token_ids": (None, []),
        "use_beam_search": (None, False),
    }
    for name, ok in neutral.items():
        value = body.get(name)
        if not any(value == v and type(value) is type(v) for v in ok if v is not None) and value is not None:
            raise invalid(f"{name} is not supported by the aiokv reference engine, got {_short(value)}", name)
    # logprobs: a count on /v1/completions, a boolean on /v1/chat/completions
    logprobs = body.get("logprobs")
    count = logprobs if isinstance(logprobs, bool) else _int(body, "logprobs", lo=0, hi=MAX_LOGPROBS)
    top = _int(body, "top_logprobs", lo=0, hi=MAX_LOGPROBS)
    for name, value in (("logprobs", count), ("top_logprobs", top)):
        if value:
            raise invalid(
                f"{name} is not supported by the aiokv reference engine, got {_short(body[name])}", name
            )
    fmt = body.get("response_format")
    if fmt is not None and not (isinstance(fmt, Mapping) and fmt.get("type") == "text"):
        raise invalid(
            "response_format must be {'type': 'text'}: structured output is not supported", "response_format"
        )


def _common(body: Mapping[str, Any]) -> dict[str, Any]:
    if not isinstance(body, Mapping):
        raise invalid(f"the request body must be a JSON object, got {type(body).__name__}")
    _unsupported(body)
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise invalid(f"model must be a string, got {_short(model)}", "model")
    n = _int(body, "n", lo=1, hi=MAX_CHOICES) or 1
    best_of = _int(body, "best_of", lo=1, hi=MAX_CHOICES)
    if best_of is not None and best_of != n:
        raise invalid(f"best_of must equal n ({n}) or be left out, got {best_of}", "best_of")
    temperature = _number(body, "temperature", lo=0.0, hi=2.0)
    seed = _int(body, "seed", lo=-_SEED_MAX - 1, hi=_SEED_MAX)
    stream = _bool(body, "stream", False)
    options = body.get("stream_options")
    include_usage = False
    if options is not None:
        if not stream:
            raise invalid("stream_options is only allowed with stream=true", "stream_options")
        if not isinstance(options, Mapping):
            raise invalid(f"stream_options must be an object, got {_short(options)}", "stream_options")
        include_usage = _bool(options, "include_usage", False)
    return {
        "model": model,
        "n": n,
        "temperature": 1.0 if temperature is None else temperature,
        "seed": seed,
        "stop": _stop(body.get("stop")),
        "stream": stream,
        "include_usage": include_usage,
        "skip_special_tokens": _bool(body, "skip_special_tokens", True),
        "ignore_eos": _bool(body, "ignore_eos", False),
    }


def _stop(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or (len(items) <= MAX_STOP and not all(isinstance(s, str) for s in items)):
        raise invalid(f"stop must be a string or a list of strings, got {_short(value)}", "stop")
    if len(items) > MAX_STOP:
        raise invalid(f"stop must have at most {MAX_STOP} sequences, got {len(items)}", "stop")
    for s in items:
        if not s or len(s) > MAX_STOP_LEN:
            raise invalid(
                f"stop sequences must be 1 to {MAX_STOP_LEN} characters long, got {_short(s)}", "stop"
            )
    return tuple(items)


def _max_tokens(body: Mapping[str, Any], context_len: int | None, *names: str) -> int | None:
    """The first of ``names`` given: an integer in [1, the context length] (1e30 is refused here, not after
    sizing a request by it)."""
    for name in names:
        value = body.get(name)
        if value is None:
            continue
        if context_len is None:
            return _int(body, name, lo=1, hi=MAX_TOKENS_LIMIT)
        number = _integer(value)
        if number is None:
            raise invalid(f"{name} must be an integer, got {_short(value)}", name)
        if not 1 <= number <= context_len:
            raise APIError(400, f"{name} must be in [1, {context_len}] (this model's maximum context length is"
                           f" {context_len} tokens), got {_short(value)}", param=name, code="context_length_exceeded")  # fmt: skip
        return number
    return None


def _too_long(context_len: int, tokens: int, param: str, *, at_least: bool = False) -> APIError:
    has = f"at least {tokens}" if at_least else str(tokens)
    return APIError(400, f"this model's maximum context length is {context_len} tokens; the prompt has {has} tokens",
                    param=param, code="context_length_exceeded")  # fmt: skip


def _encode(tok: ByteTokenizer, text: str, param: str) -> list[int]:
    try:
        return tok.encode(text)
    except UnicodeEncodeError as exc:  # a lone surrogate (JSON can write "\ud800")
        raise invalid(f"{param} must be valid Unicode text, got a lone surrogate at character {exc.start}",
                      param) from None  # fmt: skip


def _token_ids(item: list[Any], vocab_size: int) -> tuple[int, ...]:
    """A list of token ids, checked with whole-list operations (no Python loop over a valid list)."""
    if not item:
        return ()
    kinds = set(map(type, item))
    if kinds != {int}:
        ints = [_integer(t) for t in item]  # 5.0 is token 5, as everywhere an integer is expected
        if None in ints:
            bad = item[ints.index(None)]
            raise invalid(f"prompt token ids must be integers, got {_short(bad)}", "prompt")
        item = cast("list[int]", ints)
    if min(item) < 0 or max(item) >= vocab_size:
        bad = next(t for t in item if not 0 <= t < vocab_size)
        raise invalid(f"prompt token ids must be in [0, {vocab_size}), got {bad}", "prompt")
    return tuple(item)


def _prompt(item: Any, tok: ByteTokenizer, context_len: int | None) -> tuple[int, ...]:
    """One prompt of a completions request, its length checked against ``context_len`` before it is read:
    a list's length is its token count; a string has at least one token per character."""
    if isinstance(item, str):
        if context_len is not None and len(item) >= context_len:
            raise _too_long(context_len, len(item), "prompt", at_least=not item.isascii())
        ids = tuple(_encode(tok, item, "prompt"))
    elif isinstance(item, list):
        if context_len is not None and len(item) >= context_len:
            raise _too_long(context_len, len(item), "prompt")
        ids = _token_ids(item, tok.vocab_size)
    else:
        raise invalid(f"prompt items must be strings or lists of token ids, got {_short(item)}", "prompt")
    if not ids:
        raise invalid("prompt must not be empty", "prompt")
    if context_len is not None and len(ids) >= context_len:
        raise _too_long(context_len, len(ids), "prompt")
    return ids


# ------------------------------------------------------------------------------------------------ requests
def parse_completion_request(
    body: Any, tok: ByteTokenizer, *, context_len: int | None = None
) -> GenerationRequest:
    """``POST /v1/completions``: ``prompt`` is a string, a list of strings, a list of token ids or a list of
    token-id lists (one choice set per prompt).

    With ``context_len`` (the service's), sizes are checked before any work per token: ``max_tokens`` is at
    most ``context_len``, and a prompt that cannot leave room for one generated token is refused from its
    length alone (a list's length, a string's characters)."""
    common = _common(body)
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        items: list[Any] = [prompt]
    elif isinstance(prompt, list) and prompt:
        items = prompt if isinstance(prompt[0], (str, list)) else [prompt]
    else:
        raise invalid(
            f"prompt must be a non-empty string, list of strings or list of token ids, got {_short(prompt)}",
            "prompt",
        )
    if len(items) * common["n"] > MAX_CHOICES:
        raise invalid(f"prompts x n must be <= {MAX_CHOICES}, got {len(items)} x {common['n']}", "n")
    max_tokens = _max_tokens(body, context_len, "max_tokens")
    echo = _bool(body, "echo", False)
    prompts = tuple(_prompt(item, tok, context_len) for item in items)
    texts = tuple(
        (item if isinstance(item, str) else tok.decode(ids, skip_special_tokens=False)) if echo else ""
        for item, ids in zip(items, prompts, strict=True)
    )
    return GenerationRequest(
        kind="completion",
        prompts=prompts,
        prompt_texts=texts,
        max_tokens=max_tokens,
        echo=echo,
        **common,
    )


_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
_TURN_TOKENS = 4  # <|im_start|>, "\n" after the role, <|im_end|>, "\n"
_GENERATION_PROMPT_TOKENS = 2 + len("assistant")


def parse_chat_request(body: Any, tok: ByteTokenizer, *, context_len: int | None = None) -> GenerationRequest:
    """``POST /v1/chat/completions``: text messages (string content or text parts) through the ChatML
    template, ending with the assistant's generation prompt.

    With ``context_len``, the messages are counted as they are read (a character is at least one token) and
    refused once they cannot fit, before any is tokenized; ``max_tokens`` is at most ``context_len``."""
    common = _common(body)
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise invalid(f"messages must be a non-empty list, got {_short(raw)}", "messages")
    max_tokens = _max_tokens(body, context_len, "max_completion_tokens", "max_tokens")
    messages: list[ChatMessage] = []
    floor = _GENERATION_PROMPT_TOKENS
    for i, m in enumerate(raw):
        message = _message(m, i)
        floor += _TURN_TOKENS + len(message.role) + len(message.content)
        if context_len is not None and floor >= context_len:
            raise _too_long(context_len, floor, "messages", at_least=True)
        messages.append(message)
    try:
        ids = tuple(tok.apply_chat_template(messages, add_generation_prompt=True))
    except UnicodeEncodeError as exc:
        raise invalid(
            f"messages must be valid Unicode text, got a lone surrogate: {exc.reason}", "messages"
        ) from None
    if context_len is not None and len(ids) >= context_len:
        raise _too_long(context_len, len(ids), "messages")
    return GenerationRequest(
        kind="chat",
        prompts=(ids,),
        prompt_texts=("",),
        max_tokens=max_tokens,
        echo=False,
        **common,
    )


def _message(m: Any, i: int) -> ChatMessage:
    where = f"messages[{i}]"
    if not isinstance(m, Mapping):
        raise invalid(f"{where} must be an object with role and content, got {_short(m)}", where)
    role = m.get("role")
    if not isinstance(role, str) or role not in _ROLES:
        raise invalid(
            f"{where}.role must be one of system, developer, user, assistant, got {_short(role)}",
            f"{where}.role",
        )
    if m.get("tool_calls") or m.get("function_call"):
        raise invalid(f"{where}: tool calls are not supported by the aiokv reference engine", where)
    content = m.get("content")
    if isinstance(content, str):
        text = content
    elif isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if not (
                isinstance(part, Mapping) and part.get("type") == "text" and isinstance(part.get("text"), str)
            ):
                raise invalid(
                    f"{where}.content[{j}] must be {{'type': 'text', 'text': str}}: only text is supported",
                    f"{where}.content",
                )
            parts.append(part["text"])
        text = "".join(parts)
    elif content is None and role == "assistant":
        text = ""
    else:
        raise invalid(
            f"{where}.content must be a string or a list of text parts, got {_short(content)}",
            f"{where}.content",
        )
    return ChatMessage(_ROLES[role], text)


_REPR = reprlib.Repr()
_REPR.maxlevel = 2
_REPR.maxdict = _REPR.maxlist = _REPR.maxtuple = _REPR.maxset = 4
_REPR.maxstring = _REPR.maxother = _REPR.maxlong = 40


def _short(value: Any) -> str:
    """A bounded ``repr`` for messages (a 5-million-item list costs what a short one does)."""
    text = _REPR.repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


# ---------------------------------------------------------------------------------------------- responses
def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": min(cached_tokens, prompt_tokens)},
    }


@dataclass(frozen=True, slots=True)
class ChoiceResult:
    index: int
    text: str
    finish_reason: str
    prompt_index: int
    completion_tokens: int
    cached_tokens: int


class ResponseBuilder:
    """Builds the JSON bodies and stream chunks of one request (its id, created time and model fixed)."""

    __slots__ = ("created", "id", "kind", "model")

    def __init__(self, kind: str, request_id: str, model: str) -> None:
        self.kind = kind
        self.id = ("chatcmpl-" if kind == "chat" else "cmpl-") + request_id
        self.created = int(time.time())
        self.model = model

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def response(
        self, choices: Sequence[ChoiceResult], usage_: dict[str, Any], echo_texts: Sequence[str] | None
    ) -> dict[str, Any]:
        if self.kind == "chat":
            body = self._head("chat.completion")
            body["choices"] = [
                {
                    "index": c.index,
                    "message": {"role": "assistant", "content": c.text},
                    "logprobs": None,
                    "finish_reason": c.finish_reason,
                }
                for c in choices
            ]
        else:
            body = self._head("text_completion")
            body["choices"] = [
                {
                    "index": c.index,
                    "text": (echo_texts[c.prompt_index] if echo_texts else "") + c.text,
                    "logprobs": None,
                    "finish_reason": c.finish_reason,
                }
                for c in choices
            ]
        body["usage"] = usage_
        return body

    def chunk(
        self, index: int, text: str, finish_reason: str | None, *, first: bool, with_usage: bool
    ) -> dict[str, Any]:
        if self.kind == "chat":
            body = self._head("chat.completion.chunk")
            delta: dict[str, Any] = (
                {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
            )
            choice: dict[str, Any] = {
                "index": index,
                "delta": delta,
                "logprobs": None,
                "finish_reason": finish_reason,
            }
        else:
            body = self._head("text_completion")
            choice = {"index": index, "text": text, "logprobs": None, "finish_reason": finish_reason}
        body["choices"] = [choice]
        if with_usage:
            body["usage"] = None
        return body

    def usage_chunk(self, usage_: dict[str, Any]) -> dict[str, Any]:
        body = self._head("chat.completion.chunk" if self.kind == "chat" else "text_completion")
        body["choices"] = []
        body["usage"] = usage_
        return body
