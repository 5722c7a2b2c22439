"""The listening socket :func:`aiokv.serve._runner.bind` makes: accepted connections get TCP_NODELAY on every
loop (asyncio sets it only when the socket's protocol says TCP; without it each keep-alive response on the
asyncio loop waited ~40 ms on Nagle and delayed ACKs)."""

from __future__ import annotations

import asyncio
import socket

import pytest

from aiokv.serve._runner import bind

pytestmark = pytest.mark.asyncio


@pytest.mark.parametrize("host", ["127.0.0.1"])
async def test_accepted_connections_have_tcp_nodelay(host: str) -> None:
    sock = bind(host, 0)
    accepted: asyncio.Future[int] = asyncio.get_running_loop().create_future()

    def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        s = writer.get_extra_info("socket")
        accepted.set_result(s.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
        writer.close()

    server = await asyncio.start_server(on_connect, sock=sock)
    try:
        _, writer = await asyncio.open_connection(*sock.getsockname()[:2])
        assert await asyncio.wait_for(accepted, 10) != 0
        writer.close()
    finally:
        server.close()
        await server.wait_closed()
