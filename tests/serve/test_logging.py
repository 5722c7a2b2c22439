"""Operator logging: ``aiokv serve`` and ``aiokv replay`` as subprocesses print aiokv's and uvicorn's lines on
stderr with timestamps (text or JSON), at ``--log-level``; degradations are logged once per transition, with
floods bounded; library use configures nothing (docs/serving.md, "Logs")."""

from __future__ import annotations

import asyncio
import json
import logging
import re
import signal
import socket
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from aiokv import _log
from aiokv.testing import FakeClock as _FakeClock

from ._subproc import ROOT, ServeProcess, env

TS = r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z"  # UTC, milliseconds
PROMPT = "the quick brown fox jumps over the lazy dog; " * 6  # 270 bytes: 16 full blocks of 16 tokens


def _complete(url: str, prompt: str = PROMPT, max_tokens: int = 2) -> None:
    r = httpx.post(f"{url}/v1/completions", json={"prompt": prompt, "max_tokens": max_tokens}, timeout=30)
    assert r.status_code == 200, r.text


def _metric(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    assert m, f"{name} not in /metrics"
    return float(m.group(1))


def _corrupt_payloads(directory: Path) -> int:
    """Flip one payload byte of every entry in the disk tier's segment files (headers stay valid: the entries
    are found at open and fail verification when read). Returns how many entries were damaged."""
    entry_bytes = json.loads((directory / "aiokv-disk.json").read_text())["entry_bytes"]
    damaged = 0
    for seg in sorted(directory.glob("seg-*.akv")):
        with seg.open("r+b") as f:
            size = seg.stat().st_size
            for offset in range(0, size, entry_bytes):
                f.seek(offset)
                if f.read(4) != b"AKV\x00":
                    continue
                f.seek(offset + 128 + 7)
                byte = f.read(1)
                f.seek(offset + 128 + 7)
                f.write(bytes([byte[0] ^ 0xFF]))
                damaged += 1
    return damaged


# ------------------------------------------------------------------------------------------ degradations
def test_a_corrupt_disk_entry_is_one_timestamped_warning_on_stderr(
    tmp_path: Path, servers: list[ServeProcess]
) -> None:
    """The issue's scenario: a disk tier whose segment file was overwritten between two runs. The entries
    are misses (counted in tier_corrupt_blocks_total) and stderr says so, with a timestamp, in the shape
    docs/serving.md documents."""
    disk = tmp_path / "kv"
    disk.mkdir()
    args = ("--tiers", f"cpu=32MiB,disk={disk}:64MiB", "--load-policy", "always")
    first = ServeProcess(*args)
    servers.append(first)
    _complete(first.url)
    assert first.stop() == 0  # the close writes the queued write-through to the disk
    assert _corrupt_payloads(disk) >= 16

    second = ServeProcess(*args)
    servers.append(second)
    _complete(second.url)  # the CPU tier is empty: the prefix is read from the disk, and fails verification
    line = second.wait_line(r"WARNING aiokv\.tiers\.disk")
    assert re.fullmatch(
        rf"{TS} WARNING aiokv\.tiers\.disk: disk tier {re.escape(repr(str(disk)))}: entry [0-9a-f]{{16}} "
        r"failed verification \(bad-checksum\), dropped; a miss, its blocks are recomputed \(if this "
        r"repeats: something else writes the tier's files, or the disk is failing\)",
        line,
    ), line
    assert _metric(second.url, 'aiokv:tier_corrupt_blocks_total{model_name="aiokv-tiny",tier="disk"}') >= 1
    assert second.stop() == 0
    assert "Traceback" not in second.err


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])  # closed again: nothing listens there


def test_an_unreachable_redis_is_one_down_line_and_health_degraded(servers: list[ServeProcess]) -> None:
    port = _closed_port()
    srv = ServeProcess("--tiers", f"cpu=32MiB,redis=redis://127.0.0.1:{port}/0", "--load-policy", "always")
    servers.append(srv)
    for i in range(6):
        _complete(srv.url, prompt=f"{i} {PROMPT}")
    health = httpx.get(f"{srv.url}/health", timeout=10).json()
    assert health["status"] == "degraded", health
    assert health["tiers"]["redis"] == "down", health
    down = srv.wait_line(r"is down after")
    assert re.fullmatch(
        rf"{TS} WARNING aiokv\.tiers\.redis: redis tier 'redis://127\.0\.0\.1:{port}/0' namespace '[^']+' is down "
        r"after \d+ consecutive failures \(.+\): calls are answered locally \(misses, dropped writes\) and the "
        r"server is probed again in [\d.]+ s: check that the server runs and is reachable from here "
        r"\(address, port, TLS, credentials\)",
        down,
    ), down
    assert srv.stop() == 0
    assert srv.err.count("is down after") == 1, srv.err  # one transition: one line, not one per request
    assert srv.err.count("WARNING aiokv.tiers.redis") <= 4, srv.err  # + degraded, a failed probe, a flush


# ------------------------------------------------------------------------------------------ levels, format
def test_log_level_debug_shows_aiokv_debug_lines(servers: list[ServeProcess]) -> None:
    srv = ServeProcess("--tiers", "cpu=32MiB", "--log-level", "debug")
    servers.append(srv)
    srv.wait_line(rf"^{TS} DEBUG aiokv\.offloader: offloader started: ")
    _complete(srv.url)
    srv.wait_line(rf"^{TS} DEBUG aiokv\.offloader: lookup of request '[^']+': 0 of 16 blocks cached$")
    srv.wait_line(rf'^{TS} INFO uvicorn\.access: 127\.0\.0\.1:\d+ - "POST /v1/completions HTTP/1\.1" 200$')
    assert srv.stop() == 0


def test_log_level_warning_hides_info(servers: list[ServeProcess]) -> None:
    srv = ServeProcess("--tiers", "cpu=32MiB", AIOKV_LOG_LEVEL="warning")
    servers.append(srv)
    _complete(srv.url)
    assert srv.stop() == 0
    assert srv.lines == [], srv.err  # no access lines, no drain lines, no uvicorn start/stop lines


def test_every_line_has_a_timestamp_and_all_go_to_stderr(servers: list[ServeProcess]) -> None:
    """uvicorn's lines (its start, the access log) and aiokv's (the drain) are on one stream, one format."""
    srv = ServeProcess("--tiers", "cpu=32MiB")
    servers.append(srv)
    _complete(srv.url)
    assert srv.stop() == 0
    assert srv.lines, "nothing logged"
    for line in srv.lines:
        assert re.match(rf"{TS} (DEBUG|INFO|WARNING|ERROR|CRITICAL) [\w.]+: ", line), line
    names = {line.split(" ")[2].rstrip(":") for line in srv.lines}
    assert {"uvicorn.error", "uvicorn.access", "aiokv.serve"} <= names, names
    assert srv.p.stdout is not None
    assert srv.p.stdout.read() == ""  # after the ready line, stdout stays empty


def test_log_format_json_is_one_object_per_line(servers: list[ServeProcess]) -> None:
    srv = ServeProcess("--tiers", "cpu=32MiB", "--log-format", "json")
    servers.append(srv)
    _complete(srv.url)
    assert srv.stop() == 0
    objs = [json.loads(line) for line in srv.lines]
    assert objs
    for obj in objs:
        assert {"ts", "level", "logger", "msg"} <= set(obj), obj
        assert re.fullmatch(TS, obj["ts"]), obj
    access = [o for o in objs if o["logger"] == "uvicorn.access"]
    assert access
    assert access[0]["level"] == "INFO"
    assert '"POST /v1/completions HTTP/1.1" 200' in access[0]["msg"]
    assert any(o["logger"] == "aiokv.serve" and o["msg"].startswith("draining: ") for o in objs), objs


# ------------------------------------------------------------------------------------------------- drain
def test_a_drain_that_aborts_requests_logs_how_many(servers: list[ServeProcess]) -> None:
    srv = ServeProcess(
        "--tiers", "cpu=32MiB", "--num-blocks", "520", "--drain-timeout", "1", AIOKV_MAX_NUM_SEQS="4"
    )
    servers.append(srv)
    body = {"prompt": "long", "max_tokens": 8000, "stream": True, "ignore_eos": True}
    with (
        httpx.Client(base_url=srv.url, timeout=30) as http,
        http.stream("POST", "/v1/completions", json=body) as r,
    ):
        lines = r.iter_lines()
        assert next(line for line in lines if line).startswith("data: ")  # generating
        srv.p.send_signal(signal.SIGTERM)
        rest = [line for line in lines if line]
    assert json.loads(rest[-2][6:])["error"]["code"] == "shutdown"
    assert srv.p.wait(30) == 0
    srv.stop()
    srv.wait_line(rf"^{TS} INFO aiokv\.serve: received SIGTERM: shutting down \(a second signal aborts")
    srv.wait_line(
        rf"^{TS} INFO aiokv\.serve: draining: 1 requests in flight get up to 1 s to finish; new requests are "
        r"refused \(503\)$"
    )
    srv.wait_line(
        rf"^{TS} WARNING aiokv\.serve: drain: aborted 1 requests still in flight \d+\.\d s after the drain "
        r"began \(their clients get a 503 'shutdown' error\): raise --drain-timeout \(AIOKV_DRAIN_TIMEOUT, now "
        r"1 s\) to let them finish$"
    )
    srv.wait_line(rf"^{TS} INFO aiokv\.serve: drain: done in \d+\.\d s, 1 requests aborted$")
    srv.wait_line(rf"^{TS} INFO aiokv\.serve: stopped$")


# ------------------------------------------------------------------------------------------------ replay
def test_replay_logs_on_stderr_and_keeps_stdout_for_the_report() -> None:
    cmd = [sys.executable, "-m", "aiokv", "replay", "synthetic:sessions=3", "--json", "--no-progress"]
    quiet = subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=120)
    assert quiet.returncode == 0, quiet.stderr
    assert quiet.stderr == ""  # the default level is warning
    loud = subprocess.run(
        [*cmd, "--log-level", "info"], cwd=ROOT, env=env(), capture_output=True, text=True, timeout=120
    )
    assert loud.returncode == 0, loud.stderr
    assert json.loads(loud.stdout).keys() == json.loads(quiet.stdout).keys()  # the report, alone on stdout
    lines = loud.stderr.splitlines()
    assert re.fullmatch(
        rf"{TS} INFO aiokv\.replay: trace synthetic\S*: \d+ requests, \d+ block refs, \d+ unique blocks "
        r"\(read in \d+\.\d\d s\)",
        lines[0],
    ), lines
    assert re.fullmatch(rf"{TS} INFO aiokv\.replay: 1 replays in \d+\.\d\d s", lines[1]), lines
    loud = env(AIOKV_LOG_LEVEL="loud")
    bad = subprocess.run(cmd, cwd=ROOT, env=loud, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2
    assert bad.stderr == (
        "aiokv replay: error: AIOKV_LOG_LEVEL must be one of critical, error, warning, info, debug, got 'loud'\n"
    )


# ------------------------------------------------------------------------------------------ flapping
def FakeClock() -> _FakeClock:
    """aiokv.testing.FakeClock, starting at 1000.0 s."""
    return _FakeClock(1000.0)


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []
        self.arrived = asyncio.Event()

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)
        self.arrived.set()


@pytest.fixture
def captured() -> Iterator[tuple[logging.Logger, Records]]:
    log = logging.getLogger("aiokv.tests.transitions")
    handler = Records()
    log.addHandler(handler)
    log.setLevel(logging.DEBUG)
    yield log, handler
    log.removeHandler(handler)
    log.setLevel(logging.NOTSET)


def _flap(t: _log.Transitions, clock: FakeClock, times: int, step: float) -> None:
    for i in range(times):
        clock.now += step
        if i % 2:
            t.changed("up", logging.INFO, "tier x is up again (was down)")
        else:
            t.changed("down", logging.WARNING, "tier x is down: check it")


def test_a_tier_flapping_a_thousand_times_a_minute_logs_a_bounded_number_of_lines(
    captured: tuple[logging.Logger, Records],
) -> None:
    log, handler = captured
    clock = FakeClock()
    t = _log.Transitions(log, "tier x", burst=5, interval_s=60, clock=clock)
    _flap(t, clock, 1001, 0.05)  # 1001 changes in 50 s: it ends down
    assert [r.getMessage() for r in handler.records] == [
        "tier x is down: check it",
        "tier x is up again (was down)",
        "tier x is down: check it",
        "tier x is up again (was down)",
        "tier x is down: check it",
    ]
    assert (t.total, t.suppressed) == (1001, 996)
    t.flush()  # what the owner's close (or the timer at the interval's end) says
    assert handler.records[-1].getMessage() == (
        "tier x changed health 996 more times than logged (flapping); it is down now"
    )
    assert handler.records[-1].levelno == logging.WARNING
    clock.now += 60  # a new interval: the next change is logged at once
    t.changed("up", logging.INFO, "tier x is up again (was down)")
    assert handler.records[-1].getMessage() == "tier x is up again (was down)"
    assert len(handler.records) == 7
    # Ten minutes of flapping: at most burst + 1 lines a minute.
    _flap(t, clock, 10_000, 0.06)
    assert len(handler.records) <= 7 + 10 * 6 + 1, len(handler.records)
    later = [r.getMessage() for r in handler.records[7:]]
    assert any(m.endswith("more changes not logged)") for m in later), later


def test_the_flapping_summary_comes_at_the_end_of_the_interval_on_a_loop(
    captured: tuple[logging.Logger, Records],
) -> None:
    log, handler = captured

    async def main() -> None:
        t = _log.Transitions(log, "tier y", burst=1, interval_s=0.2)
        t.changed("down", logging.WARNING, "tier y is down")
        t.changed("up", logging.INFO, "tier y is up again")  # counted
        t.changed("down", logging.WARNING, "tier y is down")  # counted: it ends down
        handler.arrived.clear()
        await asyncio.wait_for(handler.arrived.wait(), 10)  # the timer's summary, no further change needed
        assert handler.records[-1].getMessage() == (
            "tier y changed health 2 more times than logged (flapping); it is down now"
        )

    asyncio.run(main())
    assert len(handler.records) == 2


# ------------------------------------------------------------------------------------------ library use
_LIBRARY = """
import asyncio, logging, sys, tempfile
import torch
import aiokv
from aiokv.tiers import DiskTier, FaultyTier

root = logging.getLogger()
before = (list(root.handlers), root.level)

async def main():
    kv = [torch.randn(16, 16, 2, 8) for _ in range(4)]
    layout = aiokv.KVLayout(kv, block_size=16)
    with tempfile.TemporaryDirectory() as d:
        # Every write-through raises: aiokv logs a WARNING, which nothing prints.
        disk = FaultyTier(DiskTier(d, 1 << 20), write_fail_rate=1.0, fail_mode="raise")
        async with aiokv.Offloader(layout, tiers=[aiokv.CPUTier(capacity_bytes=1 << 20), disk]) as off:
            req = off.open("r", list(range(40)))
            await req.lookup()
            req.step(40, new_token_ids=[1], new_block_ids=[0, 1, 2])
            await req.finish()
            await off.flush()
            assert off.stats().write_through[0].errors == 1

asyncio.run(main())
aiokv_logger = logging.getLogger("aiokv")
assert (list(root.handlers), root.level) == before == ([], logging.WARNING), (root.handlers, root.level)
assert [type(h) for h in aiokv_logger.handlers] == [logging.NullHandler], aiokv_logger.handlers
assert aiokv_logger.level == logging.NOTSET and aiokv_logger.propagate
print("ok")
"""


def test_library_use_adds_no_handler_and_changes_no_level() -> None:
    r = subprocess.run(
        [sys.executable, "-c", _LIBRARY], cwd=ROOT, env=env(), capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout == "ok\n"
    assert r.stderr == ""  # nothing printed: aiokv's NullHandler keeps the last-resort handler out


# ----------------------------------------------------------------------------------------------- vLLM
_VLLM = """
import io, logging
from aiokv._log import adopt_vllm_handlers
import aiokv.tiers  # a library module's logger exists before the connector starts

stream = io.StringIO()
vllm = logging.getLogger("vllm")  # as vllm.logger's dictConfig leaves it
handler = logging.StreamHandler(stream)
handler.setFormatter(logging.Formatter("VLLMFMT %(levelname)s %(filename)s %(message)s"))
vllm.addHandler(handler)
vllm.setLevel(logging.INFO)
vllm.propagate = False
assert adopt_vllm_handlers(None)
assert not adopt_vllm_handlers("debug")  # once per process
logging.getLogger("aiokv.tiers.disk").warning("disk tier %r degraded", "/x")
logging.getLogger("aiokv.vllm").debug("hidden at vLLM's level")
assert stream.getvalue() == "VLLMFMT WARNING <string> disk tier '/x' degraded\\n", stream.getvalue()
print("ok")
"""

_VLLM_APP_CONFIGURED = """
import logging, sys
from aiokv._log import adopt_vllm_handlers
logging.getLogger("vllm").addHandler(logging.StreamHandler(sys.stdout))
logging.basicConfig(stream=sys.stdout, format="APP %(name)s %(message)s")  # the application's own
assert not adopt_vllm_handlers("debug")
assert logging.getLogger("aiokv").handlers[1:] == []  # only the NullHandler
logging.getLogger("aiokv.vllm").debug("shown at the connector's log_level, by the application's handler")
"""


def _python(script: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)], cwd=ROOT, env=env(), capture_output=True, text=True,
        timeout=60,
    )  # fmt: skip


def test_the_connector_prints_aiokv_lines_with_vllms_handler_and_format() -> None:
    r = _python(_VLLM)
    assert (r.returncode, r.stdout, r.stderr) == (0, "ok\n", "")


def test_the_connector_leaves_an_application_configured_logging_alone() -> None:
    r = _python(_VLLM_APP_CONFIGURED)
    assert r.returncode == 0, r.stderr
    assert r.stdout == "APP aiokv.vllm shown at the connector's log_level, by the application's handler\n"


_REAL_VLLM = """
import logging
from vllm.config.logging import LoggingConfig
from vllm.logger import configure_logging, init_logger

configure_logging(LoggingConfig())  # what vLLM's engine core and workers do before creating the connector
from aiokv._log import adopt_vllm_handlers

assert adopt_vllm_handlers(None)
logging.getLogger("aiokv.tiers.redis").warning("redis tier x is down")
logging.getLogger("aiokv.vllm").debug("hidden at vLLM's INFO")
init_logger("vllm.test").info("a vllm line")
"""


@pytest.mark.skipif(
    not (ROOT / ".venv-vllm/bin/python").exists(), reason="needs the vLLM venv (make venv-vllm)"
)
def test_with_vllms_own_logging_configuration_aiokv_lines_look_like_vllms() -> None:
    vllm_env = env(VLLM_LOGGING_STREAM="ext://sys.stdout", VLLM_LOGGING_COLOR="0", VLLM_LOGGING_LEVEL="INFO")
    r = subprocess.run(
        [str(ROOT / ".venv-vllm/bin/python"), "-c", _REAL_VLLM], cwd=ROOT, env=vllm_env, capture_output=True,
        text=True, timeout=300,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    shape = r"\(MainProcess pid=\d+\) {} \d\d-\d\d \d\d:\d\d:\d\d \[<string>:\d+\] {}"
    lines = r.stdout.splitlines()
    assert len(lines) == 2, r.stdout
    assert re.fullmatch(shape.format("WARNING", "redis tier x is down"), lines[0]), lines
    assert re.fullmatch(shape.format("INFO", "a vllm line"), lines[1]), lines
