"""``aiokv replay`` refuses bad input up front: one ``aiokv replay: error: ...`` line on stderr, exit status 2,
no traceback, and nothing replayed. Also the bare ``aiokv`` command, ``--version`` and the cold start."""

from __future__ import annotations

import ast
import errno
import io
import json
import math
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import aiokv.cli
import aiokv.replay
from aiokv._errors import InvalidArgumentError
from aiokv.cli import main
from aiokv.replay import (
    MAX_HASH_IDS,
    MAX_LINE_BYTES,
    MAX_SYNTHETIC_REFS,
    CostModel,
    TierConfig,
    load_trace,
    parse_bandwidth,
    replay,
    synthetic_trace,
)
from aiokv.replay import _trace as trace_module
from aiokv.replay._report import results_json

DATA = Path(__file__).resolve().parent.parent / "data"
CONV = str(DATA / "mooncake_conversation_head400.jsonl")
PACKAGE = Path(aiokv.cli.__file__).resolve().parent
REPO = PACKAGE.parent


def fail(what: str) -> Callable[..., Any]:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError(f"{what} ran although the input was invalid")

    return refuse


@pytest.fixture
def no_replay(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any replay fails the test: errors must come before the first run."""
    monkeypatch.setattr(aiokv.replay, "sweep", fail("sweep"))


@pytest.fixture
def no_work(monkeypatch: pytest.MonkeyPatch, no_replay: None) -> None:
    """Neither loading nor generating a trace may start: option errors come before the trace is read."""
    monkeypatch.setattr(aiokv.replay, "load_trace", fail("load_trace"))
    monkeypatch.setattr(aiokv.replay, "synthetic_trace", fail("synthetic_trace"))


def refuse(capsys: pytest.CaptureFixture[str], args: list[str], message: str) -> None:
    """``aiokv replay ARGS`` exits 2 with exactly ``message`` as its one line on stderr, and prints nothing."""
    assert main(["replay", *args, "--no-progress"]) == 2
    out, err = capsys.readouterr()
    assert err == f"aiokv replay: error: {message}\n"
    assert out == ""


def write(tmp_path: Path, content: str | bytes, name: str = "t.jsonl") -> str:
    path = tmp_path / name
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content, encoding="utf-8")
    return str(path)


# ------------------------------------------------------------------------------------- 1. empty traces
@pytest.mark.parametrize("content", ["", "\n", "  \n\t\n\n", "\r\n"])
def test_empty_or_blank_trace_is_refused(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, no_replay: None, content: str
) -> None:
    """An empty or whitespace-only file used to exit 0 with all-zero results."""
    path = write(tmp_path, content)
    refuse(capsys, [path, "--json"], f"trace {path} holds no requests")


def test_empty_trace_is_refused_by_the_api(tmp_path: Path) -> None:
    path = write(tmp_path, "\n\n")
    with pytest.raises(InvalidArgumentError, match=r"^trace .*t\.jsonl holds no requests$"):
        load_trace(path)


def test_trace_without_a_full_block_is_refused(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, no_replay: None
) -> None:
    """Prompts shorter than --block-tokens give no block: nothing to replay, not a 0% hit ratio."""
    path = write(tmp_path, '{"prompt": "hello"}\n{"token_ids": [1, 2, 3]}\n')
    refuse(capsys, [path, "--json"], f"trace {path} holds no full block of 512 tokens (see --block-tokens)")


# ------------------------------------------------------------------------- 2. bad rows: file and line
@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"\x00\xbe\xef\x01binary", "1: not UTF-8 text (byte 0xbe at column 2)"),
        (b'{"hash_ids": [1]}\n\xff\xfe{"hash_ids": [2]}\n', "2: not UTF-8 text (byte 0xff at column 1)"),
        (b'{"hash_ids": [1], "timestamp": 1\n', "1: not valid JSON (Expecting ',' delimiter at column 33)"),
        (
            b'{"hash_ids": [9223372036854775808]}',
            "1: hash_ids must hold ints in [0, 2**63), got 9223372036854775808",
        ),
        (b'{"hash_ids": [0, -1]}', "1: hash_ids must hold ints in [0, 2**63), got -1"),
        (b'{"hash_ids": [1' + b"0" * 5000 + b"]}", "1: not valid JSON (a number has too many digits)"),
        (b"[" * 100_000 + b"]" * 100_000, "1: not valid JSON (nested too deeply)"),
        (b'{"hash_ids": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "1: not valid JSON (nested too deeply)"),
        (b'{"token_ids": [1], "salt": ' + b"[" * 600 + b"]" * 600 + b"}", "1: salt is nested too deeply"),
        (b"[1, 2]", "1: each trace line must be a JSON object, got array"),
        (b'"row"', "1: each trace line must be a JSON object, got string"),
        (b"null", "1: each trace line must be a JSON object, got null"),
        (b'{"hash_ids": "0 1 2"}', "1: hash_ids must be a list of ints, got string"),
        (b'{"hash_ids": [1, true]}', "1: hash_ids must be a list of ints, got true"),
        (b'{"hash_ids": [1.0]}', "1: hash_ids must be a list of ints, got 1.0"),
        (b'{"token_ids": {"a": 1}}', "1: token_ids must be a list of ints, got object"),
        (b'{"token_ids": ["a"]}', "1: token_ids must contain ints, got 'a'"),
        (
            b'{"token_ids": [9223372036854775808]}',
            "1: token_ids must be in the int64 range, got 9223372036854775808",
        ),
        (b'{"prompt": 5}', "1: prompt must be a string, got number"),
        (b'{"prompt": "\\ud800"}', "1: prompt must be valid unicode text"),
        (
            b'{"token_ids": [1], "salt": {"a": 1}}',
            "1: salt must be None, bool, int, str, bytes or tuples of them, got dict",
        ),
        (b'{"hash_ids": [1], "input_length": 1.5}', "1: input_length must be an int >= 0, got 1.5"),
        (
            b'{"hash_ids": [1], "input_length": 9223372036854775808}',
            "1: input_length must be < 2**63, got 9223372036854775808",
        ),
        (b'{"hash_ids": [1], "output_length": "7"}', '1: output_length must be an int >= 0, got "7"'),
        (b'{"hash_ids": [1], "output_length": null}', "1: output_length must be an int >= 0, got null"),
        (b'{"input_length": 5}', "1: a trace row needs hash_ids, token_ids or prompt"),
    ],
)
def test_bad_row_names_the_file_and_line(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, no_replay: None, content: bytes, message: str
) -> None:
    """Binary files, huge or negative ids, deep nesting and wrong types gave tracebacks or passed."""
    path = write(tmp_path, content)
    refuse(capsys, [path, "--json"], f"{path}:{message}")


def test_line_numbers_count_blank_lines(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, no_replay: None
) -> None:
    path = write(tmp_path, '{"hash_ids": [1]}\n\n{"hash_ids": [2]}\n{"hash_ids": "x"}\n')
    refuse(capsys, [path, "--json"], f"{path}:4: hash_ids must be a list of ints, got string")


def test_limit_stops_reading_before_later_lines(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """--limit N reads N requests and not the rest of the file (a bad line after them is not reached)."""
    path = write(tmp_path, '{"hash_ids": [1, 2]}\n\n{"hash_ids": [1, 3]}\n\xff garbage\n')
    assert main(["replay", path, "--json", "--no-progress", "--limit", "2"]) == 0
    assert json.loads(capsys.readouterr().out)["trace"]["requests"] == 2


def test_a_utf8_bom_is_skipped(tmp_path: Path) -> None:
    path = write(tmp_path, b'\xef\xbb\xbf{"hash_ids": [1, 2]}\r\n{"hash_ids": [1]}\r\n')
    assert load_trace(path).block_refs == 3


def test_bad_row_error_is_an_invalid_argument_error_in_the_api(tmp_path: Path) -> None:
    path = write(tmp_path, b"\x89PNG\r\n\x1a\n")
    with pytest.raises(InvalidArgumentError, match=r"t\.jsonl:1: not UTF-8 text \(byte 0x89 at column 1\)$"):
        load_trace(path)


# -------------------------------------------------------------------------------- 4. bad timestamps
@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("NaN", "not valid JSON (NaN is not a JSON number)"),
        ("Infinity", "not valid JSON (Infinity is not a JSON number)"),
        ("-Infinity", "not valid JSON (-Infinity is not a JSON number)"),
        ("1e400", "timestamp must be a finite number of milliseconds >= 0, got Infinity"),
        (
            "1" + "0" * 400,
            "timestamp must be a finite number of milliseconds >= 0, got 1000000000000000000000000000000000000...",
        ),
        ("-5", "timestamp must be a finite number of milliseconds >= 0, got -5"),
        ("true", "timestamp must be a finite number of milliseconds >= 0, got true"),
        ('"12:00"', 'timestamp must be a finite number of milliseconds >= 0, got "12:00"'),
    ],
)
def test_non_finite_or_negative_timestamps_are_refused(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, no_replay: None, value: str, message: str
) -> None:
    """NaN and infinite timestamps were accepted and silently broke the arrival order."""
    path = write(
        tmp_path, f'{{"hash_ids": [1], "timestamp": 0}}\n{{"hash_ids": [2], "timestamp": {value}}}\n'
    )
    refuse(capsys, [path, "--json"], f"{path}:2: {message}")


def test_null_timestamp_keeps_the_file_position(tmp_path: Path) -> None:
    path = write(tmp_path, '{"hash_ids": [1], "timestamp": 7}\n{"hash_ids": [2], "timestamp": null}\n')
    assert [r.timestamp_ms for r in load_trace(path).requests] == [7.0, 7.0]


# ------------------------------------------------------------------------------------- 7. size caps
def test_a_line_over_the_cap_is_refused(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, no_replay: None
) -> None:
    """A row had no size limit: a multi-gigabyte line was read whole before anything was checked."""
    row = '{"hash_ids": [1]}'
    path = write(tmp_path, row + "\n" + row + " " * (MAX_LINE_BYTES + 1 - len(row)) + "\n")
    refuse(capsys, [path, "--json"], f"{path}:2: a trace line must be at most {MAX_LINE_BYTES} bytes long")


def test_a_line_at_the_cap_is_accepted(tmp_path: Path) -> None:
    row = '{"hash_ids": [1]}'
    path = write(tmp_path, row + " " * (MAX_LINE_BYTES - len(row)) + "\n" + row)  # no final newline
    assert len(load_trace(path)) == 2


def test_a_long_line_is_never_read_whole(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The loader reads at most MAX_LINE_BYTES + 1 bytes of a line before refusing it."""
    chunks: list[int] = []

    class Recording(io.BytesIO):
        def readline(self, size: int | None = -1) -> bytes:
            line = super().readline(size)
            chunks.append(len(line))
            return line

    monkeypatch.setattr(trace_module, "_open_trace", lambda path: Recording(b"x" * (3 * MAX_LINE_BYTES)))
    with pytest.raises(InvalidArgumentError, match="a trace line must be at most"):
        load_trace(tmp_path / "big.jsonl")
    assert chunks == [MAX_LINE_BYTES + 1]


def test_hash_ids_over_the_cap_are_refused(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, no_replay: None
) -> None:
    at_cap = json.dumps({"hash_ids": list(range(MAX_HASH_IDS))})
    over = json.dumps({"hash_ids": list(range(MAX_HASH_IDS + 1))})
    assert load_trace(write(tmp_path, at_cap, "ok.jsonl")).block_refs == MAX_HASH_IDS
    path = write(tmp_path, at_cap + "\n" + over + "\n")
    refuse(
        capsys,
        [path, "--json"],
        f"{path}:2: hash_ids must hold at most {MAX_HASH_IDS} ids, got {MAX_HASH_IDS + 1}",
    )


# --------------------------------------------------------------------------- 3. synthetic parameters
@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("sessions=0", "sessions must be >= 1, got 0"),
        ("turns=-1", "turns must be >= 1, got -1"),
        ("system_prompts=0", "system_prompts must be >= 1, got 0"),
        ("system_blocks=-2", "system_blocks must be >= 0, got -2"),
        ("sessions_per_s=0", "sessions_per_s must be > 0, got 0"),
        ("sessions_per_s=-1.5", "sessions_per_s must be > 0, got -1.5"),
        ("sessions_per_s=nan", "sessions_per_s must be finite, got nan"),
        ("sessions_per_s=inf", "sessions_per_s must be finite, got inf"),
        ("think_s=-1", "think_s must be >= 0, got -1"),
        ("think_s=nan", "think_s must be finite, got nan"),
        ("think_s=-inf", "think_s must be finite, got -inf"),
        ("sessions=1.5", "synthetic trace option sessions must be an int, got '1.5'"),
        ("think_s=soon", "synthetic trace option think_s must be a number, got 'soon'"),
        (
            "sessions=2,sessions=3",
            "synthetic trace options must name 'sessions' only once, got 'sessions=2,sessions=3'",
        ),
        (
            "sesions=3",
            "synthetic trace option must be one of ['seed', 'sessions', 'sessions_per_s', "
            "'system_blocks', 'system_prompts', 'think_s', 'turns'], got 'sesions'",
        ),
        ("sessions", "synthetic trace options must look like name=value[,name=value...], got 'sessions'"),
        (
            "sessions=100000000",
            f"synthetic trace must hold at most {MAX_SYNTHETIC_REFS} block references, got up "
            "to 24600000040 (sessions=100000000, turns=6, system_blocks=4)",
        ),
    ],
)
def test_bad_synthetic_parameters_are_refused(
    capsys: pytest.CaptureFixture[str], no_replay: None, spec: str, message: str
) -> None:
    """system_blocks=-2 gave a traceback; sessions_per_s=0 divided by zero; NaN and negatives passed."""
    refuse(capsys, [f"synthetic:{spec}", "--json"], message)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"system_blocks": -2}, "system_blocks must be >= 0, got -2"),
        ({"sessions_per_s": 0}, "sessions_per_s must be > 0, got 0"),
        ({"sessions_per_s": -1.0}, "sessions_per_s must be > 0, got -1"),
        ({"sessions_per_s": math.nan}, "sessions_per_s must be finite, got nan"),
        ({"think_s": math.inf}, "think_s must be finite, got inf"),
        ({"think_s": -0.5}, "think_s must be >= 0, got -0.5"),
        (
            {"user_blocks": (2, 1)},
            "user_blocks must be a range (lo, hi) of ints with 0 <= lo <= hi, got (2, 1)",
        ),
        (
            {"answer_blocks": (1,)},
            "answer_blocks must be a range (lo, hi) of ints with 0 <= lo <= hi, got (1,)",
        ),
        (
            {"user_blocks": (1.0, 2)},
            "user_blocks must be a range (lo, hi) of ints with 0 <= lo <= hi, got (1.0, 2)",
        ),
        ({"block_tokens": 0}, "block_tokens must be a positive int, got 0"),
        (
            {"turns": 10_000},
            f"synthetic trace must hold at most {MAX_SYNTHETIC_REFS} block references, got up to "
            "240020000040 (sessions=400, turns=10000, system_blocks=4)",
        ),
    ],
)
def test_synthetic_trace_api_validates_every_parameter(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidArgumentError) as exc:
        synthetic_trace(**kwargs)
    assert str(exc.value) == message


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"sessions": 2.0}, "sessions must be an int, got float"),
        ({"sessions_per_s": "1"}, "sessions_per_s must be a number, got str"),
        ({"seed": "x"}, "seed must be an int, got str"),
        ({"think_s": True}, "think_s must be a number, got bool"),
    ],
)
def test_synthetic_trace_api_checks_types(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(TypeError) as exc:
        synthetic_trace(**kwargs)
    assert str(exc.value) == message


def test_zero_think_time_and_zero_system_blocks_are_valid() -> None:
    trace = synthetic_trace(sessions=3, turns=2, system_blocks=0, think_s=0)
    assert len(trace) == 6


# ------------------------------------------------------------------------- 5. unwritable output paths
@pytest.mark.parametrize(
    ("plot", "message"),
    [
        ("missing/hit.png", "plot must be a writable file path, got '{p}' (no directory '{d}/missing')"),
        ("adir.png", "plot must be a writable file path, got '{p}' (a directory)"),
        (
            "hit",
            "plot must be a file name ending in .png, .svg, .svgz, .pdf, .eps, .ps, .jpg, .jpeg, .tif, "
            ".tiff, .webp, got '{p}'",
        ),
        (
            "hit.xyz",
            "plot must be a file name ending in .png, .svg, .svgz, .pdf, .eps, .ps, .jpg, .jpeg, .tif, "
            ".tiff, .webp, got '{p}'",
        ),
    ],
)
def test_unwritable_plot_path_is_refused_before_replaying(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, no_work: None, plot: str, message: str
) -> None:
    """A bad --plot path failed only after the whole run (and a suffix-less one was silently renamed)."""
    pytest.importorskip("matplotlib")
    (tmp_path / "adir.png").mkdir()
    path = str(tmp_path / plot)
    refuse(capsys, [CONV, "--json", "--plot", path], message.format(p=path, d=tmp_path))


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="root may write anywhere")
def test_read_only_plot_directory_is_refused(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, no_work: None
) -> None:
    pytest.importorskip("matplotlib")
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        path = str(ro / "hit.png")
        refuse(
            capsys,
            [CONV, "--json", "--plot", path],
            f"plot must be a writable file path, got '{path}' (permission denied)",
        )
    finally:
        ro.chmod(0o700)


def test_plot_path_that_cannot_be_created_is_refused(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path, no_work: None
) -> None:
    """The check tries to create the file (so it holds for root, read-only mounts and ACLs alike)."""
    pytest.importorskip("matplotlib")

    def denied(*args: Any, **kwargs: Any) -> int:
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr("aiokv.replay._report.os.open", denied)
    path = str(tmp_path / "hit.png")
    refuse(
        capsys,
        [CONV, "--json", "--plot", path],
        f"plot must be a writable file path, got '{path}' (permission denied)",
    )


def test_plot_path_check_leaves_no_file(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """The up-front check creates and removes a probe; a run that then fails leaves nothing behind."""
    pytest.importorskip("matplotlib")
    png = tmp_path / "hit.png"
    empty = write(tmp_path, "")
    refuse(capsys, [empty, "--json", "--plot", str(png)], f"trace {empty} holds no requests")
    assert not png.exists()


def test_plot_write_failure_after_the_run_is_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    pytest.importorskip("matplotlib")

    def disk_full(*args: Any, **kwargs: Any) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr("aiokv.replay._report.save_plot", disk_full)
    png = str(tmp_path / "hit.png")
    assert main(["replay", CONV, "--json", "--no-progress", "--plot", png, "--limit", "20"]) == 1
    err = capsys.readouterr().err
    assert err == f"aiokv replay: error: cannot write plot '{png}' (no space left on device)\n"


# ---------------------------------------------------------------------------- 6. JSON never holds NaN
@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--bandwidth", "cpu=inf"], "bandwidth of tier 'cpu' must be finite, got 'inf'"),
        (
            ["--bandwidth", "cpu=1e400GB/s"],
            "bandwidth of tier 'cpu' must be a finite number of bytes per second, got '1e400GB/s'",
        ),
        (
            ["--bandwidth", "cpu=nan"],
            "bandwidth of tier 'cpu' must be a number with an optional unit "
            "such as 25GB/s or 10Gbit/s, got 'nan'",
        ),
        (["--prefill-tokens-per-s", "inf"], "prefill-tokens-per-s must be > 0 and finite, got inf"),
        (["--prefill-tokens-per-s", "nan"], "prefill-tokens-per-s must be > 0 and finite, got nan"),
        (["--prefill-tokens-per-s", "0"], "prefill-tokens-per-s must be > 0 and finite, got 0"),
        (["--tiers", "cpu=1e400"], "capacity of tier 'cpu' must be a finite number of bytes, got '1e400'"),
    ],
)
def test_non_finite_inputs_are_refused(
    capsys: pytest.CaptureFixture[str], no_work: None, args: list[str], message: str
) -> None:
    """An infinite bandwidth printed `Infinity` in --json (invalid JSON); --prefill-tokens-per-s 0 silently
    fell back to the model's speed."""
    refuse(capsys, [CONV, "--json", *args], message)


def test_json_output_is_strict_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        main(["replay", CONV, "--json", "--no-progress", "--tiers", "cpu=inf,disk=1TiB", "--limit", "50"])
        == 0
    )

    def no_constants(name: str) -> None:
        raise AssertionError(f"{name} in JSON output")

    out = json.loads(capsys.readouterr().out, parse_constant=no_constants)
    assert out["runs"][0]["tiers"][0]["capacity_bytes"] is None  # unlimited is null, never Infinity


def test_results_json_refuses_non_finite_numbers() -> None:
    trace = synthetic_trace(sessions=2, turns=2)
    [result] = [replay(trace, [TierConfig("cpu", None)], kv_bytes_per_token=1, cost=CostModel(1.0))]
    with pytest.raises(ValueError, match="Out of range float values are not JSON compliant"):
        results_json([result], extra=math.nan)
    assert math.isfinite(json.loads(results_json([result]))["runs"][0]["refs_per_s"])


def test_api_refuses_non_finite_bandwidth_and_speed() -> None:
    with pytest.raises(
        InvalidArgumentError, match=r"^bandwidth of tier 'cpu' must be > 0 and finite, got inf$"
    ):
        TierConfig("cpu", None, bandwidth=math.inf)
    with pytest.raises(InvalidArgumentError, match=r"^prefill_tokens_per_s must be > 0 and finite, got nan$"):
        CostModel(math.nan)
    with pytest.raises(InvalidArgumentError, match=r"^bandwidth must be finite, got 'unlimited'$"):
        parse_bandwidth("unlimited")


# --------------------------------------------------------------------------------- other bad options
@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--tiers", "cpu=0"], "capacity of tier 'cpu' must be at least 1 byte, got '0'"),
        (["--tiers", "cpu=-1GiB"], "capacity of tier 'cpu' must be at least 1 byte, got '-1GiB'"),
        (
            ["--tiers", "cpu=1XB"],
            "capacity of tier 'cpu' must be a number of bytes with an optional unit such as 64GiB, got '1XB'",
        ),
        (["--tiers", "cpu=1GiB,"], "tiers must look like name=value[,name=value...], got 'cpu=1GiB,'"),
        (["--tiers", "=1GiB"], "tiers must look like name=value[,name=value...], got '=1GiB'"),
        (["--tiers", "cpu=1GiB,cpu=2GiB"], "tiers must name 'cpu' only once, got 'cpu=1GiB,cpu=2GiB'"),
        (["--tiers", "c[bold]=1GiB"], "tier name must be letters, digits, '_', '-' or '.', got 'c[bold]'"),
        (
            ["--tiers", "cpu=1KiB"],
            "capacity of tier 'cpu' must hold at least one block of 67108864 bytes "
            "(512 tokens * 131072 bytes), got 1024",
        ),
        (["--policy", "mru"], "policy must be one of ['adaptive', 'arc', 'chain-lru', 'lru', 'session'], got 'mru'"),
        (["--policy", ","], "policy must name at least one policy, got ','"),
        (["--policy", "lru,arc,lru"], "policy must name 'lru' only once, got 'lru,arc,lru'"),
        (
            ["--bandwidth", "redis=10Gb/s"],
            "bandwidth of tier 'redis' must say bytes or bits, got '10Gb/s' (a lower-case b is ambiguous): "
            "write 10GB/s for bytes or 10Gbit/s for bits per second",
        ),
        (
            ["--bandwidth", "cpu=1GB/s,cpu=2GB/s"],
            "bandwidth must name 'cpu' only once, got 'cpu=1GB/s,cpu=2GB/s'",
        ),
        (["--sweep", "cpu="], "sweep must look like TIER=SIZE,SIZE... or TIER=auto, got 'cpu='"),
        (
            ["--sweep", "cpu=1GiB,,2GiB"],
            "sweep must look like TIER=SIZE,SIZE... or TIER=auto, got 'cpu=1GiB,,2GiB'",
        ),
        (["--sweep", "disk=auto"], "sweep tier must be one of the tiers ['cpu'], got 'disk'"),
        (
            ["--sweep", "cpu=auto,1GiB"],
            "sweep must be TIER=auto alone or TIER=SIZE,SIZE..., got 'cpu=auto,1GiB'",
        ),
        (
            ["--sweep", "cpu=1GiB,1073741824"],
            "sweep must list each capacity once, got '1073741824' again in 'cpu=1GiB,1073741824'",
        ),
        (
            ["--sweep", "cpu=1GiB,1KiB"],
            "capacity of tier 'cpu' must hold at least one block of 67108864 bytes "
            "(512 tokens * 131072 bytes), got 1024",
        ),
        (["--block-tokens", "0"], "block-tokens must be in [1, 1048576], got 0"),
        (["--kv-bytes-per-token", "0"], "kv-bytes-per-token must be in [1, 1073741824], got 0"),
        (
            ["--kv-bytes-per-token", "9" * 400],
            f"kv-bytes-per-token must be in [1, 1073741824], got {'9' * 400}",
        ),
        (["--inflight", "-1"], "inflight must be >= 0, got -1"),
        (["--limit", "0"], "limit must be >= 1, got 0"),
    ],
)
def test_bad_options_are_refused_before_the_trace_is_read(
    capsys: pytest.CaptureFixture[str], no_work: None, args: list[str], message: str
) -> None:
    refuse(capsys, [CONV, "--json", *args], message)


def test_a_small_tier_capacity_is_fine_when_the_sweep_replaces_it(capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        main(
            [
                "replay",
                CONV,
                "--json",
                "--no-progress",
                "--tiers",
                "cpu=1KiB",
                "--sweep",
                "cpu=1GiB",
                "--limit",
                "20",
            ]
        )
        == 0
    )
    assert json.loads(capsys.readouterr().out)["runs"][0]["tiers"][0]["capacity_bytes"] == 2**30


@pytest.mark.parametrize(
    ("trace", "reason"),
    [
        ("none.jsonl", "no such file"),
        (".", "a directory"),
        pytest.param(
            "/dev/null", "not a regular file", marks=pytest.mark.skipif(os.name != "posix", reason="posix")
        ),
        pytest.param(
            "n" * 5000,
            "file name too long",
            marks=pytest.mark.skipif(sys.platform != "linux", reason="linux"),
        ),
    ],
)
def test_missing_trace_or_directory_is_refused(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, no_replay: None, trace: str, reason: str
) -> None:
    path = str(tmp_path / trace)
    refuse(capsys, [path, "--json"], f"trace must be a readable file, got {path!r} ({reason})")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["replay"], "aiokv replay: error: the following arguments are required: TRACE"),
        (["replay", CONV, "--limit", "x"], "aiokv replay: error: argument --limit: invalid int value: 'x'"),
        (
            ["replay", CONV, "--model", "gpt"],
            "aiokv replay: error: argument --model: invalid choice: 'gpt' "
            "(choose from 'llama3-70b', 'llama3-8b', 'mistral-7b', 'qwen2-72b', 'qwen2-7b')",
        ),
        (
            ["bogus"],
            "aiokv: error: argument COMMAND: invalid choice: 'bogus' (choose from 'replay', 'serve')",
        ),
    ],
)
def test_usage_errors_are_one_line(capsys: pytest.CaptureFixture[str], args: list[str], message: str) -> None:
    with pytest.raises(SystemExit) as exc:
        main(args)
    assert exc.value.code == 2
    assert capsys.readouterr().err == message + "\n"


def test_interrupt_is_exit_130_without_traceback(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def interrupted(*args: Any, **kwargs: Any) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(aiokv.replay, "sweep", interrupted)
    assert main(["replay", CONV, "--json", "--no-progress", "--limit", "5"]) == 130
    assert capsys.readouterr().err == "aiokv replay: interrupted\n"


# ---------------------------------------------------------------------------- 8. bare command, version
def test_no_command_prints_help_and_exits_0(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("usage: aiokv [-h] [--version] COMMAND ...")
    assert "replay" in out
    assert err == ""


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    from importlib.metadata import version

    assert capsys.readouterr().out == f"aiokv {version('aiokv')}\n"
    assert version("aiokv") == aiokv.__version__  # one version: the package's, which the metadata matches


# ------------------------------------------------------------------------------- real processes
def run_aiokv(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "aiokv", *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
        check=False,
    )


def test_python_m_aiokv_exit_status_and_one_line_error(tmp_path: Path) -> None:
    """`python -m aiokv` ignored main()'s status: errors exited 0."""
    empty = write(tmp_path, " \n")
    proc = run_aiokv("replay", empty, "--json")
    assert (proc.returncode, proc.stdout, proc.stderr) == (
        2,
        "",
        f"aiokv replay: error: trace {empty} holds no requests\n",
    )


def test_python_m_aiokv_bad_binary_trace_has_no_traceback(tmp_path: Path) -> None:
    path = write(tmp_path, bytes(range(128, 256)))
    proc = run_aiokv("replay", path, "--json")
    assert proc.returncode == 2
    assert proc.stderr == f"aiokv replay: error: {path}:1: not UTF-8 text (byte 0x80 at column 1)\n"


def test_python_m_aiokv_without_command_prints_help() -> None:
    proc = run_aiokv()
    assert proc.returncode == 0
    assert proc.stdout.startswith("usage: aiokv")
    assert proc.stderr == ""


# ----------------------------------------------------------------------------------- 9. cold start
HEAVY = ("torch", "numpy", "rich", "matplotlib")


def module_level_imports(tree: ast.Module) -> list[str]:
    """Modules imported by statements that run at import time (not inside functions or TYPE_CHECKING)."""
    found: list[str] = []

    def visit(nodes: list[ast.stmt]) -> None:
        for node in nodes:
            if isinstance(node, ast.Import):
                found.extend(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                found.append(node.module)
            elif isinstance(node, ast.If):
                if not (isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"):
                    visit(node.body)
                visit(node.orelse)
            elif isinstance(node, ast.Try):
                visit(node.body)
                for handler in node.handlers:
                    visit(handler.body)
                visit(node.orelse)
                visit(node.finalbody)
            elif isinstance(node, (ast.With, ast.ClassDef)):
                visit(node.body)

    visit(tree.body)
    return found


@pytest.mark.parametrize(
    "module",
    ["cli.py", "__main__.py", *sorted(f"replay/{p.name}" for p in (PACKAGE / "replay").glob("*.py"))],
)
def test_cli_and_replay_modules_import_nothing_heavy_at_module_level(module: str) -> None:
    imported = module_level_imports(ast.parse((PACKAGE / module).read_text(encoding="utf-8")))
    assert [m for m in imported if m.split(".")[0] in HEAVY] == []


def test_help_and_version_do_not_import_torch_rich_or_matplotlib() -> None:
    """The CLI's own import graph stays light; aiokv/__init__.py is bypassed (its eager imports are not the
    CLI's) by registering the package without running it."""
    code = f"""
import contextlib, io, sys, types
pkg = types.ModuleType("aiokv")
pkg.__path__ = [{str(PACKAGE)!r}]
sys.modules["aiokv"] = pkg
from aiokv.cli import main
for argv in (["--help"], ["replay", "--help"], ["--version"], []):
    with contextlib.redirect_stdout(io.StringIO()):
        try:
            main(argv)
        except SystemExit:
            pass
print(sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "rich", "matplotlib")))
"""
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert proc.stdout == "[]\n"


def test_trace_name_with_brackets_is_printed_as_is(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """A file named ``x[bold].jsonl`` was shown as ``x.jsonl``: rich read the brackets as markup."""
    pytest.importorskip("rich")
    path = write(tmp_path, '{"hash_ids": [1, 2]}\n{"hash_ids": [1, 3]}\n', "x[bold].jsonl")
    assert main(["replay", path, "--no-progress"]) == 0
    assert capsys.readouterr().out.startswith("x[bold].jsonl: 2 requests")
