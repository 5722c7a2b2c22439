"""The test servers' own harness: ports that outgoing connections cannot take, and a retry when one is taken anyway;
clusters whose config epochs are settled when they are handed out.

A CI run once failed because a cluster node's bus port, picked by binding port 0 and releasing it, was taken by an
outgoing connection's local port before the node bound it. These tests hold a picked port open on purpose and check
that the server comes up on fresh ports instead of failing the test session.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from ._servers import Binary, Cluster, Node, ServerProcess, _ephemeral_range, free_port


@contextmanager
def occupied(port: int) -> Iterator[None]:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", port))
        sock.listen(1)
        yield


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
