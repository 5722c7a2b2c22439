"""``aiokv serve`` as a user runs it: a subprocess, found by the URL it prints, stopped with SIGTERM."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from ._subproc import ROOT, ServeProcess, env


def _run(*args: str, timeout: float = 60, **extra_env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "aiokv", "serve", *args],
        cwd=ROOT,
        env=env(**extra_env),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_serve_answers_and_sigterm_drains_within_the_deadline(servers: list[ServeProcess]) -> None:
    srv = ServeProcess(
        "--tiers",
        "cpu=32MiB",
        "--drain-timeout",
        "1",
        "--log-level",
        "info",
        "--num-blocks",
        "520",
        AIOKV_MAX_NUM_SEQS="4",
    )
    servers.append(srv)
    with httpx.Client(base_url=srv.url, timeout=30) as http:
        assert http.get("/ready").json() == {"status": "ready"}
        done = http.post(
            "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
        )
        assert done.status_code == 200
        assert done.json()["usage"]["completion_tokens"] <= 3
        body = {"prompt": "long", "max_tokens": 8000, "stream": True, "ignore_eos": True}
        with http.stream("POST", "/v1/completions", json=body) as r:
            lines = r.iter_lines()
            assert next(line for line in lines if line).startswith("data: ")  # generating
            t0 = time.perf_counter()
            srv.p.send_signal(signal.SIGTERM)
            rest = [line for line in lines if line]
        aborted_after = time.perf_counter() - t0
    assert rest[-1] == "data: [DONE]"
    assert json.loads(rest[-2][6:])["error"]["code"] == "shutdown"
    assert 0.9 <= aborted_after < 6
    assert srv.wait(30) == 0
    assert time.perf_counter() - t0 < 15
    log = srv.err
    for bad in ("Traceback", "Warning", "was destroyed", "never awaited", "ERROR"):
        assert bad not in log, log


@pytest.mark.parametrize(
    ("args", "env", "message"),
    [
        (["--tiers", "gpu=1GiB"], {}, "tiers must name cpu, disk, shm, redis or redis-cluster, got 'gpu'"),
        (["--tiers", "disk=/tmp/x:1GiB"], {}, "tiers must start with cpu=SIZE"),
        (["--tiers", "cpu=1GiB,disk=1GiB"], {}, "disk tier must look like disk=PATH:SIZE"),
        (["--tiers", "cpu=lots"], {}, "capacity of tier 'cpu' must be a number of bytes"),
        (
            ["--tiers", "cpu=1GiB,redis=localhost:6379"],
            {},
            "redis tier must be a redis://, rediss://, valkey://",
        ),
        ([], {"AIOKV_PORT": "eighty"}, "AIOKV_PORT must be an integer, got 'eighty'"),
        (["--port", "70000"], {}, "port must be in [0, 65535], got 70000"),
        (["--model", "huge"], {}, "--model must be one of tiny, default, got 'huge'"),
        ([], {"AIOKV_NO_OFFLOAD": "maybe"}, "AIOKV_NO_OFFLOAD must be one of"),
        (["--block-size", "24"], {}, "--block-size must be a power of two >= 16, got 24"),
        (["--max-model-len", "999999"], {}, "--max-model-len must be in [2, 8192]"),
        (["--device", "gpu"], {}, "--device must be cpu, cuda, cuda:N or mps, got 'gpu'"),
        ([], {"AIOKV_TIERS": "cpu=64Gb"}, "AIOKV_TIERS: capacity of tier 'cpu' must be in bytes, got '64Gb'"),
    ],
)
def test_bad_settings_are_one_line_errors(args: list[str], env: dict[str, str], message: str) -> None:
    r = _run(*args, **env)
    assert r.returncode == 2
    assert r.stderr.count("\n") == 1, r.stderr
    assert r.stderr.startswith("aiokv serve: error: ")
    assert message in r.stderr, r.stderr


def test_a_port_in_use_is_a_one_line_error(servers: list[ServeProcess]) -> None:
    srv = ServeProcess("--tiers", "cpu=32MiB")
    servers.append(srv)
    port = srv.url.rsplit(":", 1)[1]
    r = _run("--model", "tiny", "--port", port)
    assert r.returncode == 2
    assert (
        r.stderr.strip() == f"aiokv serve: error: cannot listen on 127.0.0.1:{port}: address already in use"
    )
    assert srv.stop(30) == 0


def test_disk_and_redis_tiers_are_real_tiers(tmp_path: Path) -> None:
    from aiokv.serve import ServeConfig
    from aiokv.tiers import CPUTier, DiskTier, RedisTier

    cfg = ServeConfig(
        tiers=f"cpu=1GiB,disk={tmp_path}/kv:2GiB,redis=redis://:pw@127.0.0.1:6390/0", create_dirs=True
    )
    cpu, disk, redis = (s.build() for s in cfg.tier_specs)
    assert isinstance(cpu, CPUTier)
    assert cpu.capacity_bytes == 1 << 30
    assert isinstance(disk, DiskTier)
    assert (str(disk.path), disk.capacity_bytes) == (f"{tmp_path}/kv", 2 << 30)
    assert isinstance(redis, RedisTier)
    assert [s.describe() for s in cfg.tier_specs][2] == "redis=redis://***@127.0.0.1:6390/0"
    assert ServeConfig(offload=False, tiers="nonsense").tier_specs == ()
