"""A byte-level tokenizer for the reference model's vocabulary, with a ChatML chat template.

Token ids ``0..255`` are the bytes of the UTF-8 text; then come the special tokens (:data:`SPECIAL_TOKENS`);
every id above them up to ``vocab_size - 1`` is reserved (the reference model's weights are random, so it
samples those too). Text given by a client is always encoded byte by byte: writing ``<|im_end|>`` in a
message yields its 10 bytes, never the special token, so a message cannot forge the template.
"""

from __future__ import annotations

import codecs
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from .._errors import InvalidArgumentError

__all__ = ["SPECIAL_TOKENS", "ByteTokenizer", "ChatMessage", "Detokenizer", "StopMatcher"]

NUM_BYTES = 256
SPECIAL_TOKENS: tuple[str, ...] = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
"""Special tokens, in id order from 256: end of text (the completions stop token), and ChatML's turn
delimiters (``<|im_end|>`` stops a chat completion)."""


@dataclass(frozen=True, slots=True)
class ChatMessage:
    """One turn of a conversation after validation: ``role`` is system, user or assistant."""

    role: str
    content: str


class ByteTokenizer:
    """Bytes plus specials, sized to a model's vocabulary (``vocab_size >= 259``)."""

    def __init__(self, vocab_size: int) -> None:
        if vocab_size < NUM_BYTES + len(SPECIAL_TOKENS):
            raise InvalidArgumentError(
                f"vocab_size must be >= {NUM_BYTES + len(SPECIAL_TOKENS)} for the byte tokenizer"
                f" (256 bytes and {len(SPECIAL_TOKENS)} special tokens), got {vocab_size}"
            )
        self.vocab_size = vocab_size
        self.eos_token_id = NUM_BYTES + SPECIAL_TOKENS.index("<|endoftext|>")
        self.im_start_id = NUM_BYTES + SPECIAL_TOKENS.index("<|im_start|>")
        self.im_end_id = NUM_BYTES + SPECIAL_TOKENS.index("<|im_end|>")
        self._newline = list(b"\n")

    def encode(self, text: str) -> list[int]:
        """The UTF-8 bytes of ``text`` (special-token text included, as plain bytes)."""
        return list(text.encode("utf-8"))

    def is_special(self, token_id: int) -> bool:
        """Whether ``token_id`` is a special or reserved token (not a byte)."""
        return token_id >= NUM_BYTES

    def token_text(self, token_id: int) -> str:
        """How a non-byte token reads when special tokens are shown."""
        if token_id < NUM_BYTES:
            return bytes([token_id]).decode("utf-8", errors="replace")
        index = token_id - NUM_BYTES
        if index < len(SPECIAL_TOKENS):
            return SPECIAL_TOKENS[index]
        return f"<|reserved_{index - len(SPECIAL_TOKENS)}|>"

    def decode(self, token_ids: Iterable[int], *, skip_special_tokens: bool = True) -> str:
        """The text of ``token_ids``, as :class:`Detokenizer` would give it token by token (invalid UTF-8 as
        U+FFFD), in whole-sequence operations: the bytes are decoded at once, not a token at a time."""
        ids = token_ids if isinstance(token_ids, (list, tuple)) else list(token_ids)
        if not ids:
            return ""
        if max(ids) < NUM_BYTES:
            return bytes(ids).decode("utf-8", errors="replace")
        if skip_special_tokens:  # the bytes on either side of a dropped token join up
            return bytes([t for t in ids if t < NUM_BYTES]).decode("utf-8", errors="replace")
        parts: list[str] = []
        run = bytearray()
        for t in ids:
            if t < NUM_BYTES:
                run.append(t)
            else:  # a special token ends the bytes before it
                parts.append(run.decode("utf-8", errors="replace"))
                parts.append(self.token_text(t))
                run.clear()
        parts.append(run.decode("utf-8", errors="replace"))
        return "".join(parts)

    def apply_chat_template(
        self, messages: Sequence[ChatMessage], *, add_generation_prompt: bool = True
    ) -> list[int]:
        """ChatML: ``<|im_start|>{role}\\n{content}<|im_end|>\\n`` per message, then
        ``<|im_start|>assistant\\n`` when ``add_generation_prompt``."""
        ids: list[int] = []
        for m in messages:
            ids.append(self.im_start_id)
            ids += self.encode(m.role)
            ids += self._newline
            ids += self.encode(m.content)
            ids.append(self.im_end_id)
            ids += self._newline
        if add_generation_prompt:
            ids.append(self.im_start_id)
            ids += self.encode("assistant")
            ids += self._newline
        return ids

    def __repr__(self) -> str:
        return f"<ByteTokenizer vocab_size={self.vocab_size} specials={list(SPECIAL_TOKENS)}>"


class Detokenizer:
    """Incremental decoding: bytes split across tokens (a multi-byte character) come out whole, invalid
    UTF-8 as U+FFFD; special and reserved tokens are dropped (``skip_special_tokens``) or spelled out."""

    __slots__ = ("_decoder", "_skip", "_tok")

    def __init__(self, tokenizer: ByteTokenizer, *, skip_special_tokens: bool = True) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        """The text that ``token_id`` completes (often ``""`` inside a multi-byte character)."""
        if token_id < NUM_BYTES:
            return self._decoder.decode(bytes((token_id,)))
        if self._skip:
            return ""
        return self._decoder.decode(b"", final=True) + self._tok.token_text(token_id)

    def flush(self) -> str:
        """Whatever an unfinished multi-byte character leaves (as U+FFFD)."""
        return self._decoder.decode(b"", final=True)


class StopMatcher:
    """Cuts generated text at the first of ``stops`` (OpenAI's ``stop``), holding back the tail that could
    still begin one, so no part of a stop sequence is ever sent."""

    __slots__ = ("_checked", "_emitted", "_hold", "_stops", "text")

    def __init__(self, stops: Sequence[str]) -> None:
        self._stops = tuple(stops)
        self._hold = max((len(s) for s in self._stops), default=1) - 1
        self.text = ""
        self._emitted = 0
        self._checked = 0

    def push(self, delta: str) -> tuple[str, bool]:
        """Add ``delta``; return the text that may be sent now and whether a stop sequence was found."""
        if not delta:
            return "", False
        self.text += delta
        if self._stops:
            cut = -1
            for s in self._stops:
                i = self.text.find(s, max(0, self._checked - len(s) + 1))
                if i >= 0 and (cut < 0 or i < cut):
                    cut = i
            self._checked = len(self.text)
            if cut >= 0:
                self.text = self.text[:cut]
                out = self.text[self._emitted :]
                self._emitted = len(self.text)
                return out, True
        upto = max(self._emitted, len(self.text) - self._hold)
        out = self.text[self._emitted : upto]
        self._emitted = upto
        return out, False

    def flush(self) -> str:
        """The held-back tail, once generation ended without a stop sequence."""
        out = self.text[self._emitted :]
        self._emitted = len(self.text)
        return out
