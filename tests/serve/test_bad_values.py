"""Every documented bad value of the command lines, their ``AIOKV_*`` variables and the vLLM connector's keys:
one error line that names the option (the variable when the value came from it), exit status 2, no traceback,
and nothing started. The tables must cover every option: a new one without a row fails
``test_every_option_has_a_row``."""

from __future__ import annotations

import dataclasses
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import aiokv.serve._runner
from aiokv._errors import InvalidArgumentError
from aiokv.cli import main
from aiokv.serve import ServeConfig
from aiokv.serve._config import OPTIONS, OPTIONS_BY_FIELD, _kv_bytes_per_token, parse_tiers
from aiokv.vllm import ConnectorConfig

ROOT = Path(__file__).resolve().parents[2]
HUGE = "1000000000000"  # blocks, bytes...: more than any machine holds
ENV_ONLY = "(env)"  # a boolean flag takes no value: its bad values come from the variable


@pytest.fixture
def fs(tmp_path: Path) -> dict[str, str]:
    """Paths for the disk tier rows: a file, a missing directory under an existing one, a missing parent."""
    (tmp_path / "a-file").write_text("")
    return {
        "{file}": str(tmp_path / "a-file"),
        "{typo}": str(tmp_path / "kv-typo"),
        "{noparent}": str(tmp_path / "no" / "such" / "kv"),
        "{tmp}": str(tmp_path),
    }


def _fill(text: str, fs: dict[str, str]) -> str:
    for key, value in fs.items():
        text = text.replace(key, value)
    return text


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for opt in OPTIONS:
        monkeypatch.delenv(opt.env, raising=False)


@pytest.fixture
def runs(monkeypatch: pytest.MonkeyPatch, clean_env: None) -> list[ServeConfig]:
    """The server is never started; a run that gets that far records its configuration."""
    started: list[ServeConfig] = []
    monkeypatch.setattr(aiokv.serve._runner, "run", lambda config, on_ready=None, **_: started.append(config))
    return started


@pytest.fixture
def no_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """A torch built without CUDA, and no MPS, whatever this machine has."""
    monkeypatch.setattr(torch.backends.cuda, "is_built", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)


# ------------------------------------------------------------------------------------------- aiokv serve
# (field, bad raw value, what the message says after the flag or variable). "{...}" are paths of ``fs``.
SERVE_ROWS: list[tuple[str, str, str]] = [
    ("host", "", "must not be empty"),
    ("port", "70000", "must be in [0, 65535], got 70000"),
    ("port", "eighty", "must be an integer, got 'eighty'"),
    ("model", "huge", "must be one of tiny, default, got 'huge'"),
    ("served_model_name", " ", "must not be empty"),
    ("model_seed", "-1", "must be in [0, 2**64) (a 64-bit seed), got -1"),
    ("model_seed", "1e3", "must be an integer, got '1e3'"),
    ("device", "gpu", "must be cpu, cuda, cuda:N or mps, got 'gpu'"),
    ("device", "cuda", f"'cuda' cannot be used: torch {torch.__version__} is built without CUDA"),
    ("device", "cuda:7", "'cuda:7' cannot be used: torch"),
    ("device", "mps", "'mps' cannot be used: MPS is not available"),
    ("num_blocks", "0", "must be > 0, got 0"),
    ("num_blocks", HUGE, f"{HUGE} (x 16-token blocks) makes a KV pool of "),
    ("block_size", "24", "must be a power of two >= 16, got 24"),
    ("max_num_seqs", "0", "must be > 0, got 0"),
    ("max_num_batched_tokens", "-5", "must be > 0, got -5"),
    ("max_model_len", "1", "must be in [2, 8192] (num_blocks x block_size), got 1"),
    ("max_queued_requests", "0", "must be > 0, got 0"),
    ("max_request_bytes", "0", "must be > 0, got 0"),
    ("default_max_tokens", "0", "must be > 0, got 0"),
    ("tiers", "gpu=1GiB", "must name cpu, disk, shm, redis or redis-cluster, got 'gpu'"),
    ("tiers", "disk={tmp}:1GiB", "must start with cpu=SIZE"),
    ("tiers", "cpu=1GiB,cpu=2GiB", "must name 'cpu' only once"),
    ("tiers", "cpu=1GiB,", "must look like name=value[,name=value...]"),
    ("tiers", "cpu=lots", ": capacity of tier 'cpu' must be a number of bytes with an optional unit"),
    ("tiers", "cpu=0", ": capacity of tier 'cpu' must be at least 1 byte, got '0'"),
    ("tiers", "cpu=inf", ": capacity of tier 'cpu' must be finite: it is allocated up front"),
    (
        "tiers",
        "cpu=64Gb",
        ": capacity of tier 'cpu' must be in bytes, got '64Gb' (a lower-case b reads as "
        "bits): write 64GB or 64GiB",
    ),
    ("tiers", "cpu=64gb", "got '64gb' (a lower-case b reads as bits): write 64GB or 64GiB"),
    ("tiers", "cpu=64Gbit", ": capacity of tier 'cpu' must be in bytes, not bits, got '64Gbit': write 8GB"),
    ("tiers", f"cpu={HUGE}TB", ": capacity of tier 'cpu' ("),  # more than the memory
    ("tiers", "cpu=1GiB,disk=1GiB", ": disk tier must look like disk=PATH:SIZE"),
    (
        "tiers",
        "cpu=1GiB,disk={typo}:1GiB",
        ": disk tier directory '{typo}' is missing (it does not exist): "
        "check the path, or pass --create-dirs (AIOKV_CREATE_DIRS=1) to create it",
    ),
    ("tiers", "cpu=1GiB,disk={noparent}:1GiB", "is missing (its parent directory does not exist)"),
    ("tiers", "cpu=1GiB,disk={file}:1GiB", ": disk tier path '{file}' exists and is not a directory"),
    ("tiers", "cpu=1GiB,disk={tmp}:1000PiB", ": capacity of tier 'disk' ("),  # more than the filesystem
    ("tiers", "cpu=1GiB,shm=:1GiB", ": shm tier must look like shm=NAME:SIZE"),
    (
        "tiers",
        "cpu=1GiB,shm=/dev/shm/x:1GiB",
        ": shm tier NAME must be 1-64 letters, digits, '.', '_' or '-'",
    ),
    ("tiers", "cpu=1GiB,redis=localhost:6379", ": redis tier must be a redis://, rediss://, valkey://"),
    (
        "tiers",
        "cpu=1GiB,redis=redis://a/0,redis-cluster=redis://b/0",
        "must name each kind of tier at most once",
    ),
    ("create_dirs", ENV_ONLY + "maybe", "must be one of 1/0, true/false, yes/no, got 'maybe'"),
    ("eviction", "fifo-ish", "must be one of ['adaptive', 'arc', 'chain-lru', 'lru', 'session'], got 'fifo-ish'"),
    ("load_policy", "sometimes", "must be one of decide, always, got 'sometimes'"),
    ("offload", ENV_ONLY + "maybe", "must be one of 1/0, true/false, yes/no, got 'maybe'"),
    ("kv_events_endpoint", "", "must not be empty"),
    ("kv_events_replay_endpoint", "tcp://*:5558", "needs kv_events_endpoint"),
    ("drain_timeout", "inf", "must be a finite number of seconds >= 0, got inf"),
    ("drain_timeout", "soon", "must be a number, got 'soon'"),
    ("request_timeout", "-1", "must be a finite number of seconds >= 0, got -1.0"),
    ("api_key", "", "must not be empty"),
    ("torch_threads", "0", "must be > 0, got 0"),
    ("torch_threads", "100000", "(the cores this process may use), got 100000"),
    ("log_level", "verbose", "must be one of critical, error, warning, info, debug, got 'verbose'"),
    ("log_format", "xml", "must be one of text, json, got 'xml'"),
    ("access_log", ENV_ONLY + "maybe", "must be one of 1/0, true/false, yes/no, got 'maybe'"),
    ("loop", "trio", "must be one of auto, asyncio, uvloop, got 'trio'"),
]


def _serve_row_id(row: tuple[str, str, str]) -> str:
    return f"{row[0]}={row[1]}"


def _one_error_line(err: str, prog: str) -> str:
    assert err.endswith("\n"), err
    assert err.count("\n") == 1, err
    assert err.startswith(f"{prog}: error: "), err
    assert "Traceback" not in err
    return err.removeprefix(f"{prog}: error: ").rstrip("\n")


def _serve(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    assert main(["serve", *argv]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    return _one_error_line(err, "aiokv serve")


@pytest.mark.usefixtures("no_cuda")
@pytest.mark.parametrize("row", [r for r in SERVE_ROWS if not r[1].startswith(ENV_ONLY)], ids=_serve_row_id)
def test_a_bad_flag_is_one_line_naming_the_flag(
    row: tuple[str, str, str], runs: list[ServeConfig], fs: dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    field, raw, message = row
    opt = OPTIONS_BY_FIELD[field]
    line = _serve(capsys, [opt.option, _fill(raw, fs)])
    assert line.startswith((opt.option + " ", opt.option + ": ")), line
    assert _fill(message, fs) in line
    assert runs == []


@pytest.mark.usefixtures("no_cuda")
@pytest.mark.parametrize("row", SERVE_ROWS, ids=_serve_row_id)
def test_a_bad_variable_is_one_line_naming_the_variable(
    row: tuple[str, str, str],
    runs: list[ServeConfig],
    fs: dict[str, str],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    field, raw, message = row
    opt = OPTIONS_BY_FIELD[field]
    monkeypatch.setenv(opt.env, _fill(raw.removeprefix(ENV_ONLY), fs))
    line = _serve(capsys, [])
    assert line.startswith((opt.env + " ", opt.env + ": ")), line
    assert _fill(message, fs) in line
    assert runs == []


def test_every_option_has_a_row() -> None:
    assert sorted({o.field for o in OPTIONS} - {row[0] for row in SERVE_ROWS}) == []
    keys = {f.name for f in dataclasses.fields(ConnectorConfig)}
    assert sorted(keys - {next(iter(extra)) for extra, _ in VLLM_ROWS}) == []


def test_the_flag_wins_over_the_variable(
    runs: list[ServeConfig], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AIOKV_PORT", "eighty")
    # Both bad: the flag's error is the one reported.
    assert _serve(capsys, ["--port", "70000"]).startswith("--port must be in [0, 65535]")
    # A good flag over a bad variable: the variable is not even read.
    monkeypatch.setenv("AIOKV_TIERS", "cpu=64Gb")
    monkeypatch.setenv("AIOKV_NO_OFFLOAD", "maybe")
    assert main(["serve", "--port", "9", "--tiers", "cpu=64GB", "--no-offload"]) == 0
    assert [(c.port, c.tiers, c.offload) for c in runs] == [(9, "cpu=64GB", False)]


def test_a_cross_field_error_names_where_the_value_came_from(
    runs: list[ServeConfig], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AIOKV_KV_EVENTS_ENDPOINT", "tcp://*:5557")
    assert _serve(capsys, ["--no-offload"]) == "AIOKV_KV_EVENTS_ENDPOINT needs offloading (drop --no-offload)"
    monkeypatch.setenv("AIOKV_MAX_MODEL_LEN", "8000")
    assert _serve(capsys, ["--num-blocks", "100"]).startswith("AIOKV_MAX_MODEL_LEN must be in [2, 1600]")


def test_a_usable_device_passes(runs: list[ServeConfig], monkeypatch: pytest.MonkeyPatch) -> None:
    """What the driver reports decides: two visible GPUs make cuda:1 usable and cuda:2 not."""
    monkeypatch.setattr(torch.backends.cuda, "is_built", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert main(["serve", "--device", "cuda:1"]) == 0
    assert [c.device for c in runs] == ["cuda:1"]
    with pytest.raises(InvalidArgumentError, match=r"^device 'cuda:2' cannot be used: 2 CUDA devices are "
                       r"visible \(cuda:0 to cuda:1\)$"):  # fmt: skip
        ServeConfig(device="cuda:2")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    with pytest.raises(InvalidArgumentError, match=r"no CUDA device is visible \(CUDA_VISIBLE_DEVICES=''\)"):
        ServeConfig(device="cuda")


def test_create_dirs_creates_the_disk_directory_and_logs_it(
    tmp_path: Path, runs: list[ServeConfig], caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "new" / "kv"
    monkeypatch.setenv("AIOKV_CREATE_DIRS", "1")
    assert main(["serve", "--tiers", f"cpu=1GiB,disk={path}:1GiB"]) == 0
    [config] = runs
    assert config.create_dirs
    assert not path.exists()  # nothing is created before the tiers are built
    with caplog.at_level(logging.INFO, logger="aiokv.tiers"):  # TierSetting.build logs it
        disk = config.tier_specs[1].build()
    assert path.is_dir()
    assert str(getattr(disk, "path", "")) == str(path)
    assert f"created the disk tier directory {path}" in caplog.messages
    assert ServeConfig(tiers=f"cpu=1GiB,disk={path}:1GiB").create_dirs is False  # it exists now: no flag
    assert ServeConfig.from_sources({"create_dirs": True}, {}).create_dirs


def test_the_checks_without_torch_match_the_real_rules() -> None:
    """The configuration checks sizes and names before anything heavy is imported: its copies of the
    model's KV shape and of the shared-memory tier's name rule must stay the real ones."""
    from aiokv.serve._config import ENGINE_PRESETS
    from aiokv.tiers._settings import _SHM_NAME
    from aiokv.tiers._shm import _NAME

    assert _SHM_NAME.pattern == _NAME.pattern

    for preset in ENGINE_PRESETS:
        assert _kv_bytes_per_token(preset) == ServeConfig(model=preset).model_config().bytes_per_token


@pytest.mark.parametrize(
    ("argv", "env", "message"),
    [
        (["--device", "gpu"], {}, "--device must be cpu, cuda, cuda:N or mps, got 'gpu'"),
        (["--device", "cuda:99"], {}, "--device 'cuda:99' cannot be used: "),
        ([], {"AIOKV_TIERS": "cpu=64Gb"}, "AIOKV_TIERS: capacity of tier 'cpu' must be in bytes, got '64Gb'"),
        (["--tiers", "cpu=1GiB,disk={typo}:1GiB"], {}, "--tiers: disk tier directory '{typo}' is missing"),
        (
            ["--block-size", "24"],
            {"AIOKV_BLOCK_SIZE": "x"},
            "--block-size must be a power of two >= 16, got 24",
        ),
    ],
)
def test_a_real_process_prints_one_line_and_exits_2(
    argv: list[str], env: dict[str, str], message: str, fs: dict[str, str]
) -> None:
    base = {k: v for k, v in os.environ.items() if not k.startswith("AIOKV_")}
    r = subprocess.run(
        [sys.executable, "-m", "aiokv", "serve", *[_fill(a, fs) for a in argv]],
        cwd=ROOT,
        env={**base, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2, r.stderr
    assert _fill(message, fs) in _one_error_line(r.stderr, "aiokv serve")
    assert r.stdout == ""


# ------------------------------------------------------------------------------------------ aiokv replay
# (arguments, the option as the message names it, the message's tail).
REPLAY_ROWS: list[tuple[list[str], str, str]] = [
    (
        ["--tiers", "cpu=64Gb"],
        "capacity of tier 'cpu'",
        "must be in bytes, got '64Gb' (a lower-case b reads as bits)",
    ),
    (
        ["--tiers", "cpu=64Gbit"],
        "capacity of tier 'cpu'",
        "must be in bytes, not bits, got '64Gbit': write 8GB",
    ),
    (["--tiers", "cpu=0"], "capacity of tier 'cpu'", "must be at least 1 byte, got '0'"),
    (["--tiers", "cpu=1XB"], "capacity of tier 'cpu'", "must be a number of bytes with an optional unit"),
    (["--tiers", "cpu"], "tiers", "must look like name=value[,name=value...], got 'cpu'"),
    (["--tiers", "c[x]=1GiB"], "tier name", "must be letters, digits, '_', '-' or '.', got 'c[x]'"),
    (["--tiers", "cpu=1KiB"], "capacity of tier 'cpu'", "must hold at least one block of 67108864 bytes"),
    (["--tiers", "cpu=1GiB,ssd=1TiB"], "bandwidth of tier 'ssd'", "is unknown (defaults exist for"),
    (
        ["--bandwidth", "cpu=10Gb/s"],
        "bandwidth of tier 'cpu'",
        "must say bytes or bits, got '10Gb/s' "
        "(a lower-case b is ambiguous): write 10GB/s for bytes or 10Gbit/s for bits per second",
    ),
    (["--bandwidth", "cpu=fast"], "bandwidth of tier 'cpu'", "must be a number with an optional unit"),
    (["--bandwidth", "cpu=inf"], "bandwidth of tier 'cpu'", "must be finite, got 'inf'"),
    (["--bandwidth", "cpu=1bit/s"], "bandwidth of tier 'cpu'", "must be at least 1 byte per second"),
    (["--bandwidth", "gpu=1GB/s"], "bandwidth", "names tiers that are not in --tiers: ['gpu']"),
    (["--policy", "mru"], "policy", "must be one of ['adaptive', 'arc', 'chain-lru', 'lru', 'session'], got 'mru'"),
    (["--policy", ","], "policy", "must name at least one policy"),
    (["--sweep", "cpu="], "sweep", "must look like TIER=SIZE,SIZE... or TIER=auto"),
    (["--sweep", "disk=auto"], "sweep tier", "must be one of the tiers ['cpu'], got 'disk'"),
    (["--sweep", "cpu=1Gb"], "sweep capacity of tier 'cpu'", "must be in bytes, got '1Gb'"),
    (["--block-tokens", "0"], "block-tokens", "must be in [1, 1048576], got 0"),
    (["--block-tokens", "x"], "argument --block-tokens", "invalid int value: 'x'"),
    (["--kv-bytes-per-token", "0"], "kv-bytes-per-token", "must be in [1, 1073741824], got 0"),
    (["--prefill-tokens-per-s", "nan"], "prefill-tokens-per-s", "must be > 0 and finite, got nan"),
    (["--inflight", "-1"], "inflight", "must be >= 0, got -1"),
    (["--limit", "0"], "limit", "must be >= 1, got 0"),
    (["--model", "gpt"], "argument --model", "invalid choice: 'gpt'"),
    (["--load-policy", "never"], "argument --load-policy", "invalid choice: 'never'"),
    (["--plot", "hit.txt"], "plot", ".txt"),
]


@pytest.mark.parametrize(("args", "names", "message"), REPLAY_ROWS, ids=[" ".join(r[0]) for r in REPLAY_ROWS])
def test_a_bad_replay_option_is_one_line_naming_it(
    args: list[str], names: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code: int | str | None
    try:  # argparse's own errors (a number that is not one, a bad choice) exit through SystemExit
        code = main(["replay", "synthetic:sessions=2", "--json", "--no-progress", *args])
    except SystemExit as exc:
        code = exc.code
    assert code == 2
    out, err = capsys.readouterr()
    line = _one_error_line(err, "aiokv replay")
    assert out == ""
    assert line.startswith(names) or f" {names}" in line, line
    assert message in line, line


# ----------------------------------------------------------------------------------------- vLLM connector
VLLM_ROWS: list[tuple[dict[str, Any], str]] = [
    ({"tiers": ""}, "['tiers'] must be a non-empty string"),
    ({"tiers": "cpu=4Gb"}, "['tiers']: capacity of tier 'cpu' must be in bytes, got '4Gb'"),
    (
        {"tiers": "cpu=1GiB,disk={typo}:1GiB"},
        "['tiers']: disk tier directory '{typo}' is missing (it does not "
        "exist): check the path, or set kv_connector_extra_config['create_dirs'] = true to create it",
    ),
    (
        {"tiers": "cpu=1GiB,disk={file}:1GiB"},
        "['tiers']: disk tier path '{file}' exists and is not a directory",
    ),
    ({"create_dirs": "yes"}, "['create_dirs'] must be true or false, got 'yes'"),
    ({"layerwise": "yes"}, "['layerwise'] must be true or false, got 'yes'"),
    ({"layerwise_timeout_s": 0}, "['layerwise_timeout_s'] must be a number of seconds > 0"),
    ({"load_policy": "never"}, "['load_policy'] must be 'decide' or 'always', got 'never'"),
    ({"eviction": "fifo"}, "['eviction'] must be one of"),
    ({"write_through_max_bytes": "64Mb"}, "['write_through_max_bytes'] must be in bytes, got '64Mb'"),
    ({"write_through_max_bytes": -1}, "['write_through_max_bytes'] must be an int >= 0, got -1"),
    ({"write_through_max_delay_s": 0}, "['write_through_max_delay_s'] must be a number of seconds > 0"),
    ({"lower_tier_deadline_s": "10"}, "['lower_tier_deadline_s'] must be a number of seconds > 0"),
    ({"close_timeout_s": -1}, "['close_timeout_s'] must be a number of seconds >= 0"),
    ({"kv_events_endpoint": ""}, "['kv_events_endpoint'] must be a non-empty string"),
    ({"kv_events_replay_endpoint": "tcp://*:5558"}, "['kv_events_replay_endpoint'] needs kv_events_endpoint"),
    ({"salt": 7}, "['salt'] must be a non-empty string, got 7"),
    ({"model_id": " "}, "['model_id'] must be a non-empty string"),
    ({"prefill_tokens_per_s": 0}, "['prefill_tokens_per_s'] must be a number > 0"),
    ({"copy_threads": 0}, "['copy_threads'] must be an int >= 1"),
    ({"lookup_wait_s": float("inf")}, "['lookup_wait_s'] must be a number of seconds >= 0"),
    (
        {"log_level": "verbose"},
        "['log_level'] must be one of critical, error, warning, info, debug, got 'verbose'",
    ),
]


@pytest.mark.parametrize(("extra", "message"), VLLM_ROWS, ids=[next(iter(r[0])) for r in VLLM_ROWS])
def test_a_bad_connector_key_is_one_line_naming_it(
    extra: dict[str, Any], message: str, fs: dict[str, str]
) -> None:
    extra = {k: _fill(v, fs) if isinstance(v, str) else v for k, v in extra.items()}
    with pytest.raises(InvalidArgumentError) as info:
        ConnectorConfig.from_extra_config(extra)
    text = str(info.value)
    assert "\n" not in text
    assert text.startswith("kv_connector_extra_config[")
    assert _fill(message, fs) in text


def test_connector_create_dirs_allows_a_new_directory(tmp_path: Path) -> None:
    path = tmp_path / "kv"
    cfg = ConnectorConfig.from_extra_config({"tiers": f"cpu=1GiB,disk={path}:1GiB", "create_dirs": True})
    assert cfg.create_dirs
    parse_tiers(cfg.tiers)[1].build()
    assert path.is_dir()
