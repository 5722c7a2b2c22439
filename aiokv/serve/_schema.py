"""The OpenAI wire format: request validation, error bodies, response and stream-chunk builders.

Validation is strict where silence would mislead (a sampling option the engine cannot honour is refused, not
ignored) and lenient where clients differ harmlessly (``model`` may be left out; ``null`` means "default").
Every refusal is an :class:`APIError` whose message names the parameter and the constraint.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

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


def _int(body: Mapping[str, Any], name: str, *, lo: int, hi: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        else:
            raise invalid(f"{name} must be an integer, got {value!r}", name)
    if value < lo or (hi is not None and value > hi):
        bound = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise invalid(f"{name} must be {bound}, got {value}", name)
    return value


def _number(body: Mapping[str, Any], name: str, *, lo: float, hi: float) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise invalid(f"{name} must be a number, got {value!r}", name)
    if not lo <= value <= hi:
        raise invalid(f"{name} must be in [{lo:g}, {hi:g}], got {value:g}", name)
    return float(value)


def _bool(body: Mapping[str, Any], name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise invalid(f"{name} must be a boolean, got {value!r}", name)
    return value


def _unsupported(body: Mapping[str, Any]) -> None:
    """Refuse options the reference engine cannot honour unless they hold their neutral value."""
    neutral: dict[str, tuple[Any, ...]] = {
        "top_p": (None, 1, 1.0),
        "presence_penalty": (None, 0, 0.0),
        "frequency_penalty": (None, 0, 0.0),
        "logprobs": (None, False, 0),
        "top_logprobs": (None, 0),
        "logit_bias": (None, {}),
        "suffix": (None, ""),
        "tools": (None, []),
        "functions": (None, []),
        "tool_choice": (None, "none", "auto"),
        "function_call": (None, "none", "auto"),
    }
    for name, ok in neutral.items():
        value = body.get(name)
        if not any(value == v and type(value) is type(v) for v in ok if v is not None) and value is not None:
            raise invalid(f"{name} is not supported by the aiokv reference engine, got {value!r}", name)
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
        raise invalid(f"model must be a string, got {model!r}", "model")
    n = _int(body, "n", lo=1, hi=MAX_CHOICES) or 1
    best_of = _int(body, "best_of", lo=1)
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
            raise invalid(f"stream_options must be an object, got {options!r}", "stream_options")
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
    if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
        raise invalid(f"stop must be a string or a list of strings, got {value!r}", "stop")
    if len(items) > MAX_STOP:
        raise invalid(f"stop must have at most {MAX_STOP} sequences, got {len(items)}", "stop")
    for s in items:
        if not s or len(s) > MAX_STOP_LEN:
            raise invalid(f"stop sequences must be 1 to {MAX_STOP_LEN} characters long, got {s!r}", "stop")
    return tuple(items)


def _max_tokens(body: Mapping[str, Any], *names: str) -> int | None:
    for name in names:
        value = _int(body, name, lo=1)
        if value is not None:
            return value
    return None


# ------------------------------------------------------------------------------------------------ requests
def parse_completion_request(body: Any, tok: ByteTokenizer) -> GenerationRequest:
    """``POST /v1/completions``: ``prompt`` is a string, a list of strings, a list of token ids or a list of
    token-id lists (one choice set per prompt)."""
    common = _common(body)
    prompt = body.get("prompt")
    prompts: list[tuple[int, ...]] = []
    texts: list[str] = []
    if isinstance(prompt, str):
        items: list[Any] = [prompt]
    elif (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(p, int) and not isinstance(p, bool) for p in prompt)
    ):
        items = [prompt]
    elif isinstance(prompt, list) and prompt:
        items = prompt
    else:
        raise invalid(
            f"prompt must be a non-empty string, list of strings or list of token ids, got {_short(prompt)}",
            "prompt",
        )
    for item in items:
        if isinstance(item, str):
            ids = tuple(tok.encode(item))
            texts.append(item)
        elif isinstance(item, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in item):
            bad = [t for t in item if not 0 <= t < tok.vocab_size]
            if bad:
                raise invalid(f"prompt token ids must be in [0, {tok.vocab_size}), got {bad[0]}", "prompt")
            ids = tuple(item)
            texts.append(tok.decode(ids, skip_special_tokens=False))
        else:
            raise invalid(f"prompt items must be strings or lists of token ids, got {_short(item)}", "prompt")
        if not ids:
            raise invalid("prompt must not be empty", "prompt")
        prompts.append(ids)
    if len(prompts) * common["n"] > MAX_CHOICES:
        raise invalid(f"prompts x n must be <= {MAX_CHOICES}, got {len(prompts)} x {common['n']}", "n")
    return GenerationRequest(
        kind="completion",
        prompts=tuple(prompts),
        prompt_texts=tuple(texts),
        max_tokens=_max_tokens(body, "max_tokens"),
        echo=_bool(body, "echo", False),
        **common,
    )


_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


def parse_chat_request(body: Any, tok: ByteTokenizer) -> GenerationRequest:
    """``POST /v1/chat/completions``: text messages (string content or text parts) through the ChatML
    template, ending with the assistant's generation prompt."""
    common = _common(body)
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise invalid(f"messages must be a non-empty list, got {_short(raw)}", "messages")
    messages = [_message(m, i) for i, m in enumerate(raw)]
    ids = tuple(tok.apply_chat_template(messages, add_generation_prompt=True))
    return GenerationRequest(
        kind="chat",
        prompts=(ids,),
        prompt_texts=("",),
        max_tokens=_max_tokens(body, "max_completion_tokens", "max_tokens"),
        echo=False,
        **common,
    )


def _message(m: Any, i: int) -> ChatMessage:
    where = f"messages[{i}]"
    if not isinstance(m, Mapping):
        raise invalid(f"{where} must be an object with role and content, got {_short(m)}", where)
    role = m.get("role")
    if role not in _ROLES:
        raise invalid(
            f"{where}.role must be one of system, developer, user, assistant, got {role!r}", f"{where}.role"
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


def _short(value: Any) -> str:
    text = repr(value)
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
