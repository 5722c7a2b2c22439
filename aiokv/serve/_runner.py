"""``aiokv serve``: the service and its app on uvicorn, with a signal-driven graceful shutdown.

SIGTERM or SIGINT starts the drain: the listening socket closes (no new connections), ``/ready`` answers 503,
requests on open connections get 503, in-flight requests have ``drain_timeout`` seconds to finish and are
aborted after it; then uvicorn stops and the engine and the offloader close, in that order. A second signal
skips what is left of the grace period. The signal, the drain and its end are logged (``aiokv.serve``).

Logging: uvicorn configures its own loggers by default (its ``LOGGING_CONFIG``); ``aiokv serve`` passes
``log_config=None`` instead, after routing uvicorn's loggers through its own handler (see :mod:`aiokv.cli`).
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
import sys
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any

import anyio
import uvicorn
from uvicorn.config import LOGGING_CONFIG

from .._errors import InvalidArgumentError
from .._log import get_logger
from ._app import create_app
from ._config import ServeConfig
from ._service import Service

__all__ = ["ServerHandle", "bind", "run", "serve"]

_log = get_logger("serve")


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket (``port=0``: any free port), IPv6 when ``host`` is an IPv6 address."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY on accepted sockets only when proto says TCP (with 0, every
    # keep-alive response on the asyncio loop waited ~40 ms on Nagle + delayed ACK).
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(2048)
    except BaseException:
        sock.close()
        raise
    sock.setblocking(False)
    return sock


class _Server(uvicorn.Server):
    """uvicorn, where an exit signal asks for a drain instead of stopping at once (a second one hurries)."""

    def __init__(self, config: uvicorn.Config, on_signal: Callable[[bool], None]) -> None:
        super().__init__(config)
        self._on_signal = on_signal
        self._signals = 0
        self.last_signal: str | None = None  # the name of the last exit signal (logged from the loop)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Runs in the main thread between bytecodes: ServerHandle.shutdown hands over to the loop safely.
        self._signals += 1
        with contextlib.suppress(ValueError):
            self.last_signal = signal.Signals(sig).name
        self._on_signal(self._signals > 1)

    def stop_accepting(self) -> None:
        for server in getattr(self, "servers", ()):
            server.close()


class ServerHandle:
    """Thread-safe handle on a running :func:`serve`: its URL once it listens, and :meth:`shutdown`."""

    def __init__(self) -> None:
        self.url: str | None = None
        self.listening = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: anyio.Event | None = None
        self._hurry: anyio.Event | None = None
        self._requested = 0

    def shutdown(self, *, hurry: bool = False) -> None:
        """Start the drain (from any thread, or a signal handler); ``hurry`` (or a second call) aborts the
        in-flight requests without waiting for the grace period."""
        self._requested += 1
        loop, stop, hurry_ev = self._loop, self._stop, self._hurry
        if loop is None or stop is None or hurry_ev is None:
            return
        event = hurry_ev if hurry or self._requested > 1 else stop
        with contextlib.suppress(RuntimeError):  # the loop closed: it is shut down already
            loop.call_soon_threadsafe(event.set)
        if hurry:
            loop.call_soon_threadsafe(stop.set)

    def _attach(self, url: str) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = anyio.Event()
        self._hurry = anyio.Event()
        self.url = url
        self.listening.set()
        if self._requested:  # shutdown() came before the server listened
            self._stop.set()


async def serve(
    config: ServeConfig,
    *,
    sock: socket.socket | None = None,
    service: Service | None = None,
    handle: ServerHandle | None = None,
    on_ready: Callable[[str], None] | None = None,
    log_config: dict[str, Any] | str | None = LOGGING_CONFIG,
) -> None:
    """Start a service (or use ``service``, already started), serve it on ``sock`` (default: bind
    ``config.host:config.port``) until SIGTERM/SIGINT (in the main thread) or ``handle.shutdown()``, then
    drain and close. ``on_ready(url)`` is called once the socket listens. ``log_config`` is uvicorn's
    (default: uvicorn's own, which sets up the ``uvicorn`` loggers; ``None``: logging is left as it is)."""
    sock = sock if sock is not None else bind(config.host, config.port)
    handle = handle if handle is not None else ServerHandle()
    try:
        if service is None:
            async with Service(config) as owned:
                await _serve(config, sock, owned, handle, on_ready, log_config)
        else:
            await _serve(config, sock, service, handle, on_ready, log_config)
    finally:
        sock.close()
    _log.info("stopped")


async def _serve(
    config: ServeConfig,
    sock: socket.socket,
    service: Service,
    handle: ServerHandle,
    on_ready: Callable[[str], None] | None,
    log_config: dict[str, Any] | str | None,
) -> None:
    host, port = sock.getsockname()[:2]
    handle._attach(f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}")
    assert handle._stop is not None
    assert handle._hurry is not None
    stop, hurry = handle._stop, handle._hurry
    uv = _Server(
        uvicorn.Config(
            create_app(service=service),
            lifespan="off",
            log_config=log_config,
            log_level=config.log_level,
            access_log=config.access_log,
            timeout_graceful_shutdown=5,
            server_header=False,
        ),
        lambda again: handle.shutdown(hurry=again),
    )
    async with anyio.create_task_group() as tg:

        async def run_uvicorn() -> None:
            await uv.serve(sockets=[sock])
            stop.set()  # uvicorn stopped on its own (e.g. it failed to start)

        tg.start_soon(run_uvicorn)
        if on_ready is not None:
            assert handle.url is not None
            on_ready(handle.url)
        await stop.wait()
        _log.info(
            "%s: shutting down (a second signal aborts the requests in flight at once)",
            f"received {uv.last_signal}" if uv.last_signal else "shutdown requested",
        )
        uv.stop_accepting()
        async with anyio.create_task_group() as grace:

            async def hurry_up() -> None:
                await hurry.wait()
                _log.warning(
                    "%s again: aborting the requests in flight now",
                    f"received {uv.last_signal}" if uv.last_signal else "shutdown requested",
                )
                grace.cancel_scope.cancel()

            grace.start_soon(hurry_up)
            await service.drain()
            grace.cancel_scope.cancel()
        await service.drain(0)  # after a hurried drain: abort what is left now (otherwise nothing is left)
        uv.should_exit = True  # uvicorn closes idle connections and returns (its own wait is bounded too)


def run(
    config: ServeConfig,
    *,
    on_ready: Callable[[str], None] | None = None,
    log_config: dict[str, Any] | str | None = LOGGING_CONFIG,
) -> None:
    """Bind, then serve until a signal (blocking); uvloop unless ``config.loop`` says otherwise.
    ``log_config``: as :func:`serve`."""
    try:
        sock = bind(config.host, config.port)
    except OSError as exc:
        reason = (exc.strerror or str(exc)).lower()
        raise InvalidArgumentError(f"cannot listen on {config.host}:{config.port}: {reason}") from None
    use_uvloop = config.loop == "uvloop"
    if config.loop == "auto" and sys.platform != "win32":
        try:
            import uvloop  # noqa: F401

            use_uvloop = True
        except ImportError:
            pass
    anyio.run(
        lambda: serve(config, sock=sock, on_ready=on_ready, log_config=log_config),
        backend="asyncio",
        backend_options={"use_uvloop": use_uvloop},
    )
