"""The pieces without a server: tokenizer, chat template, stop sequences, settings, request validation."""

from __future__ import annotations

import pytest

from aiokv.serve import ByteTokenizer, ChatMessage, ServeConfig
from aiokv.serve._schema import APIError, parse_chat_request, parse_completion_request
from aiokv.serve._tokenizer import Detokenizer, StopMatcher

TOK = ByteTokenizer(512)


def test_tokenizer_is_bytes_plus_specials() -> None:
    text = "héllo ☃ <|im_end|>"
    ids = TOK.encode(text)
    assert ids == list(text.encode())  # special-token text in a message stays bytes
    assert max(ids) < 256
    assert TOK.decode(ids) == text
    assert (TOK.eos_token_id, TOK.im_start_id, TOK.im_end_id) == (256, 257, 258)
    assert TOK.decode([104, 105, 258, 300]) == "hi"
    assert TOK.decode([104, 105, 258, 300], skip_special_tokens=False) == "hi<|im_end|><|reserved_41|>"
    with pytest.raises(ValueError, match="vocab_size must be >= 259"):
        ByteTokenizer(256)


def test_detokenizer_holds_split_characters() -> None:
    detok = Detokenizer(TOK)
    pieces = [detok.push(b) for b in "☃!".encode()]
    assert pieces == ["", "", "☃", "!"]
    detok.push(0xE2)
    assert detok.flush() == "\ufffd"


def test_chat_template_is_chatml() -> None:
    ids = TOK.apply_chat_template([ChatMessage("system", "s"), ChatMessage("user", "u")])
    assert TOK.decode(ids, skip_special_tokens=False) == (
        "<|im_start|>system\ns<|im_end|>\n<|im_start|>user\nu<|im_end|>\n<|im_start|>assistant\n"
    )


@pytest.mark.parametrize(
    ("deltas", "stops", "sent", "stopped"),
    [
        (["ab", "cE", "ND", "x"], ["END"], "abc", True),
        (["hello wor", "ld"], ["zz"], "hello world", False),
        (["a", "b", "c"], ["bc", "abc"], "", True),
        (["xx", "y"], ["y", "xxy"], "", True),  # the earliest occurrence wins
    ],
)
def test_stop_sequences_never_leak(deltas: list[str], stops: list[str], sent: str, stopped: bool) -> None:
    m = StopMatcher(stops)
    out, hit = "", False
    for d in deltas:
        text, hit = m.push(d)
        out += text
        if hit:
            break
    if not hit:
        out += m.flush()
    assert (out, hit) == (sent, stopped)
    assert m.text == sent


def test_settings_come_from_flags_then_environment_then_defaults() -> None:
    env = {
        "AIOKV_PORT": "9000",
        "AIOKV_MODEL": "tiny",
        "AIOKV_NO_OFFLOAD": "yes",
        "AIOKV_DRAIN_TIMEOUT": "2.5",
    }
    cfg = ServeConfig.from_sources({"port": "9100", "access_log": True}, env)
    assert (cfg.port, cfg.model, cfg.offload, cfg.drain_timeout, cfg.access_log) == (
        9100,
        "tiny",
        False,
        2.5,
        False,
    )
    assert cfg.model_name == "aiokv-tiny"
    assert ServeConfig.from_sources({}, {}).tiers == "cpu=256MiB"
    with pytest.raises(ValueError, match=r"AIOKV_MAX_NUM_SEQS must be an integer, got '4x'"):
        ServeConfig.from_sources({}, {"AIOKV_MAX_NUM_SEQS": "4x"})
    with pytest.raises(ValueError, match="max_num_seqs must be > 0, got 0"):
        ServeConfig(max_num_seqs=0)
    with pytest.raises(ValueError, match="eviction must be one of"):
        ServeConfig(eviction="fifo-ish")
    with pytest.raises(ValueError, match="load_policy must be 'decide' or 'always', got 'sometimes'"):
        ServeConfig(load_policy="sometimes")
    assert ServeConfig.from_sources({}, {"AIOKV_LOAD_POLICY": "always"}).load_policy == "always"
    assert ServeConfig().load_policy == "decide"


def _bad(parse: object, body: object, message: str, param: str | None) -> None:
    with pytest.raises(APIError) as exc:
        parse(body, TOK)  # type: ignore[operator]
    assert exc.value.status == 400
    assert message in exc.value.message
    assert exc.value.param == param


def test_requests_are_validated_with_the_parameter_named() -> None:
    _bad(parse_completion_request, [], "must be a JSON object", None)
    _bad(parse_completion_request, {"prompt": ""}, "prompt must not be empty", "prompt")
    _bad(
        parse_completion_request,
        {"prompt": [1, 600]},
        "prompt token ids must be in [0, 512), got 600",
        "prompt",
    )
    _bad(parse_completion_request, {"prompt": "x", "n": 0}, "n must be in [1, 64], got 0", "n")
    _bad(
        parse_completion_request,
        {"prompt": "x", "temperature": 3},
        "temperature must be in [0, 2], got 3",
        "temperature",
    )
    _bad(parse_completion_request, {"prompt": "x", "stop": [""]}, "stop sequences must be 1 to", "stop")
    _bad(
        parse_completion_request,
        {"prompt": "x", "stream_options": {}},
        "only allowed with stream=true",
        "stream_options",
    )
    _bad(parse_completion_request, {"prompt": "x", "logprobs": 2}, "logprobs is not supported", "logprobs")
    _bad(parse_chat_request, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
         "only text is supported", "messages[0].content")  # fmt: skip
    _bad(
        parse_chat_request,
        {"messages": [{"role": "tool", "content": "x"}]},
        "role must be one of",
        "messages[0].role",
    )
    ok = parse_completion_request(
        {"prompt": [[1, 2], "ab"], "n": 2, "max_tokens": 3, "top_p": 1, "logprobs": None}, TOK
    )
    assert ok.prompts == ((1, 2), (97, 98))
    assert ok.num_choices == 4
    chat = parse_chat_request(
        {"messages": [{"role": "developer", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
         "max_completion_tokens": 5},
        TOK,
    )  # fmt: skip
    assert TOK.decode(chat.prompts[0], skip_special_tokens=False).startswith(
        "<|im_start|>system\nab<|im_end|>"
    )
    assert chat.max_tokens == 5


def test_serving_docs_list_every_flag_and_variable() -> None:
    from pathlib import Path

    from aiokv.serve._config import OPTIONS

    text = (Path(__file__).resolve().parents[2] / "docs" / "serving.md").read_text()
    missing = [o.option for o in OPTIONS if f"`{o.option}`" not in text or f"`{o.env}`" not in text]
    assert missing == []


@pytest.mark.parametrize(
    ("text", "size", "bandwidth"),
    [
        ("4096", 4096, 4096.0),
        ("4096B", 4096, 4096.0),
        ("1.5GB", 1_500_000_000, 1.5e9),
        ("500 kB", 500_000, 5e5),
        ("500KB", 500_000, 5e5),
        ("64GiB", 64 << 30, float(64 << 30)),
        ("64gB", 64 * 10**9, 64e9),  # prefixes are case-insensitive, the B of bytes is not
        ("64G", 64 * 10**9, 64e9),
        ("64Gi", 64 << 30, float(64 << 30)),
        ("2e9", 2 * 10**9, 2e9),
        ("1PiB", 1 << 50, float(1 << 50)),
    ],
)
def test_sizes_and_bandwidths_share_one_grammar(text: str, size: int, bandwidth: float) -> None:
    from aiokv._units import parse_bandwidth, parse_size

    assert parse_size(text) == size
    assert parse_bandwidth(text) == bandwidth
    assert parse_bandwidth(text + "/s") == bandwidth


@pytest.mark.parametrize(
    ("text", "bandwidth"),
    [("10Gbit/s", 1.25e9), ("10Gbit", 1.25e9), ("10Gbps", 1.25e9), ("100 Mbit/s", 12.5e6), ("1Kibit/s", 128.0),
     ("25GBps", 25e9)],
)  # fmt: skip
def test_bandwidths_may_be_in_bits_spelled_out(text: str, bandwidth: float) -> None:
    from aiokv._units import parse_bandwidth

    assert parse_bandwidth(text) == bandwidth


@pytest.mark.parametrize(
    ("parse", "text", "message"),
    [
        ("size", "64Gb", "size must be in bytes, got '64Gb' (a lower-case b reads as bits): write 64GB or 64GiB"),
        ("size", "64gb", "size must be in bytes, got '64gb' (a lower-case b reads as bits): write 64GB or 64GiB"),
        ("size", "512kib", "write 512kB or 512KiB"),
        ("size", "4096b", "size must be in bytes, got '4096b' (a lower-case b reads as bits): write 4096B"),
        ("size", "64Gbit", "size must be in bytes, not bits, got '64Gbit': write 8GB"),
        ("size", "64Gibit", "write 8GiB"),
        ("size", "1e999", "size must be a finite number of bytes, got '1e999'"),
        ("size", "GiB", "size must be a number of bytes with an optional unit such as 64GiB, got 'GiB'"),
        ("size", "1iB", "size must be a number of bytes with an optional unit such as 64GiB, got '1iB'"),
        ("size", "64GB/s", "size must be a number of bytes with an optional unit"),
        ("bandwidth", "10Gb/s", "bandwidth must say bytes or bits, got '10Gb/s' (a lower-case b is ambiguous): "
         "write 10GB/s for bytes or 10Gbit/s for bits per second"),
        ("bandwidth", "10gib/s", "write 10GiB/s for bytes or 10Gibit/s for bits per second"),
        ("bandwidth", "unlimited", "bandwidth must be finite, got 'unlimited'"),
        ("bandwidth", "4bit/s", "bandwidth must be at least 1 byte per second, got '4bit/s'"),
        ("bandwidth", "fast", "bandwidth must be a number with an optional unit such as 25GB/s or 10Gbit/s, "
         "got 'fast'"),
    ],
)  # fmt: skip
def test_ambiguous_and_bad_quantities_say_what_to_write(parse: str, text: str, message: str) -> None:
    from aiokv._errors import InvalidArgumentError
    from aiokv._units import parse_bandwidth, parse_size

    with pytest.raises(InvalidArgumentError) as info:
        (parse_size if parse == "size" else parse_bandwidth)(text)
    assert message in str(info.value)


def test_replay_and_serve_parse_with_the_same_functions() -> None:
    import aiokv._units
    import aiokv.replay

    assert aiokv.replay.parse_size is aiokv._units.parse_size
    assert aiokv.replay.parse_bandwidth is aiokv._units.parse_bandwidth
