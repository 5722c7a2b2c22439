from __future__ import annotations

from collections.abc import Iterator

import pytest

from ._server import ServerThread, config
from ._subproc import ServeProcess


@pytest.fixture(scope="module", params=["asyncio", "uvloop"])
def offload_server(request: pytest.FixtureRequest) -> Iterator[ServerThread]:
    """A tiny-model server with a CPU tier, on the default loop and on uvloop."""
    server = ServerThread(config(), loop=request.param).start()
    yield server
    server.stop()
    assert server.leaked == []


@pytest.fixture(scope="module")
def plain_server() -> Iterator[ServerThread]:
    """The same server without offloading (recomputes every prompt)."""
    server = ServerThread(config(offload=False)).start()
    yield server
    server.stop()
    assert server.leaked == []


@pytest.fixture
def servers() -> Iterator[list[ServeProcess]]:
    """Append the :class:`ServeProcess` instances a test starts: each is closed at the end."""
    started: list[ServeProcess] = []
    yield started
    for s in started:
        s.close()
