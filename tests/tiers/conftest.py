"""Fixtures for the tier tests: a real ``redis-server`` on a free loopback port, and small helpers.

``redis_server`` is shared by the session (tests isolate themselves with a unique namespace);
``own_redis_server`` is private to one test, which may ``kill()`` and ``restart()`` it on the same port.
Both skip (with the reason) only when the ``redis-server`` binary is absent. ``mount_tmpfs`` mounts small
filesystems (to fill them up) and skips where mounting is not allowed.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

REDIS_SERVER = shutil.which("redis-server")
_START_TIMEOUT_S = 10.0


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _ping(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(64).startswith(b"+PONG")
    except OSError:
        return False


class RedisServer:
    """One ``redis-server`` process on a fixed loopback port, without persistence."""

    def __init__(self, workdir: Path, port: int | None = None) -> None:
        if REDIS_SERVER is None:
            raise RuntimeError("redis-server not found")
        self.workdir = workdir
        self.port = port if port is not None else free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        assert self.proc is None, "already running"
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(
            [
                str(REDIS_SERVER),
                "--port", str(self.port),
                "--bind", "127.0.0.1",
                "--save", "",
                "--appendonly", "no",
                "--dir", str(self.workdir),
                "--logfile", str(self.workdir / "redis.log"),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )  # fmt: skip
        deadline = time.monotonic() + _START_TIMEOUT_S
        while not _ping(self.port):  # bounded poll for readiness
            if self.proc.poll() is not None:
                log = (
                    (self.workdir / "redis.log").read_text() if (self.workdir / "redis.log").exists() else ""
                )
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}: {log[-2000:]}")
            if time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"redis-server did not answer PING within {_START_TIMEOUT_S} s")
            time.sleep(0.01)

    def kill(self) -> None:
        """SIGKILL the server (an outage, not a shutdown) and reap it."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=10)
        self.proc = None

    def pause(self) -> None:
        """SIGSTOP: the server keeps its port open but answers nothing (a hung server)."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)

    def restart(self) -> None:
        self.kill()
        self.start()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)  # a paused server cannot act on SIGTERM
            self.proc.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=5)
        self.kill()


def _require_redis() -> None:
    if REDIS_SERVER is None:
        pytest.skip("redis-server binary not found on PATH (install redis or valkey to run the Redis tests)")


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    _require_redis()
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def own_redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    _require_redis()
    server = RedisServer(tmp_path / "redis")
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def closed_port() -> int:
    """A loopback port nobody listens on (connections are refused)."""
    return free_port()


@pytest.fixture
def namespace() -> str:
    """A namespace no other test uses (tests share the session's server)."""
    return f"test-{uuid.uuid4().hex[:12]}"


def run_python(code: str, *args: str, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a fresh interpreter (a second process), with the repository importable."""
    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ)
    env["PYTHONPATH"] = str(root) + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run(
        [sys.executable, "-c", code, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        check=False,
    )


@pytest.fixture
def run_py() -> Callable[..., subprocess.CompletedProcess[str]]:
    """``run_py(code, *args)`` runs ``code`` in a second interpreter process (see :func:`run_python`)."""
    return run_python


@pytest.fixture
def mount_tmpfs(tmp_path: Path) -> Iterator[Callable[..., Path]]:
    """``mount_tmpfs(size="1m", nr_inodes=None)`` mounts a tmpfs for this test and returns its directory
    (unmounted after the test). Skips the test where mounting is not allowed (needs root)."""
    mounted: list[Path] = []

    def mount(size: str = "1m", nr_inodes: int | None = None) -> Path:
        mnt = tmp_path / f"tmpfs-{uuid.uuid4().hex[:8]}"
        mnt.mkdir()
        options = f"size={size}" + (f",nr_inodes={nr_inodes}" if nr_inodes is not None else "")
        proc = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(mnt)],
            capture_output=True,
            text=True,
            check=False,
        )
        if proc.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.strip() or proc.returncode}")
        mounted.append(mnt)
        return mnt

    try:
        yield mount
    finally:
        for mnt in mounted:
            subprocess.run(["umount", "-l", str(mnt)], capture_output=True, check=False)


def fill_blocks(directory: Path) -> Path:
    """Use up every free block of the filesystem holding ``directory`` with one file, ``filler``."""
    path = directory / "filler"
    chunk = bytes(4096)
    with open(path, "wb", buffering=0) as f:
        try:
            while True:
                f.write(chunk)
        except OSError as exc:
            if exc.errno != errno.ENOSPC:
                raise
    return path


def fill_inodes(directory: Path) -> list[Path]:
    """Use up every free inode of the (small, ``nr_inodes``-limited) filesystem holding ``directory`` with
    empty files ``inode-*``."""
    made: list[Path] = []
    while True:
        path = directory / f"inode-{len(made)}"
        try:
            path.touch(exist_ok=False)
        except OSError as exc:
            if exc.errno != errno.ENOSPC:
                raise
            return made
        made.append(path)
        assert len(made) < 1000, "fill_inodes needs a filesystem mounted with a small nr_inodes"
