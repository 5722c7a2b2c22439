"""The connection side of a RedisTier: the URL (checked, and redacted wherever it is shown), the options
every redis-py client is made with (bounded sockets, no retries inside redis-py: the breaker decides),
closing a client whole, and reading the server's ``proto-max-bulk-len``.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Mapping
from typing import Any

# redis-py, imported absolutely: the top-level ``redis`` package, never this package (aiokv.tiers.redis).
try:  # redis is an optional extra (aiokv[redis]): importing aiokv must work without it
    from redis.asyncio import Redis
    from redis.asyncio.cluster import RedisCluster
    from redis.asyncio.connection import parse_url
    from redis.asyncio.retry import Retry
    from redis.backoff import NoBackoff
    from redis.exceptions import ResponseError

    _IMPORT_ERROR: ImportError | None = None
except ImportError as exc:  # pragma: no cover - exercised only without the extra (RedisTier() raises then)
    _IMPORT_ERROR = exc

from ..._errors import InvalidArgumentError, InvalidTypeError

__all__ = ["_check_url", "_close_client", "_connection_options", "_redact", "_server_max_value_bytes"]

_PASSWORD_RE = re.compile(r"(//[^:/@]*:)[^@/]*@")


def _redact(url: str) -> str:
    return _PASSWORD_RE.sub(r"\1***@", url)


def _check_url(url: object, ssl: bool | None) -> str:
    if not isinstance(url, str):
        raise InvalidTypeError(f"url must be a str, got {type(url).__name__}")
    if ssl and url.startswith("redis://"):
        url = "rediss://" + url[len("redis://") :]
    try:
        parse_url(url)
    except ValueError as exc:
        raise InvalidArgumentError(
            f"url must be a redis://, rediss:// or unix:// url, got {_redact(url)!r}"
        ) from exc
    return url


def _connection_options(
    timeout_s: float,
    username: str | None,
    password: str | None,
    ssl_options: Mapping[str, Any] | None,
    client_options: Mapping[str, Any] | None,
) -> dict[str, Any]:
    """redis-py connection options: bounded sockets, no retries inside redis-py (the breaker decides)."""
    options: dict[str, Any] = {
        "socket_timeout": timeout_s,
        "socket_connect_timeout": timeout_s,
        "retry": Retry(NoBackoff(), 0),
        "health_check_interval": 0,
        **(ssl_options or {}),
        **(client_options or {}),
    }
    if username is not None:
        options["username"] = username
    if password is not None:
        options["password"] = password
    return options


async def _close_client(client: Redis | RedisCluster) -> None:
    """Close every connection of ``client``; one whose close fails does not keep the others open."""
    try:
        await client.aclose()
    finally:
        if isinstance(client, RedisCluster):
            # A cluster client whose start failed (refused credentials, no node answered) closes nothing in
            # aclose(); and redis-py's RedisCluster.aclose() raises as soon as one node's close fails (a TLS
            # close that outlasts socket_connect_timeout, say), before it closes the startup nodes -- other
            # objects than the nodes found, with sockets of their own (the one that asked CLUSTER SLOTS). So
            # close every node the client knows, each on its own.
            manager = client.nodes_manager
            nodes = {id(n): n for n in (*manager.nodes_cache.values(), *manager.startup_nodes.values())}
            await asyncio.gather(*(node.disconnect() for node in nodes.values()), return_exceptions=True)


async def _server_max_value_bytes(client: Redis | RedisCluster) -> int | None:
    """The server's ``proto-max-bulk-len``, or None when the user may not read it (``NOPERM``) or ``CONFIG``
    is renamed away (managed services); connection failures propagate."""
    try:
        reply: Any = await client.config_get("proto-max-bulk-len")
    except ResponseError:
        return None
    if isinstance(reply, dict) and reply and all(isinstance(v, dict) for v in reply.values()):
        reply = next(iter(reply.values()))  # one answer per node
    try:
        return int(reply["proto-max-bulk-len"])
    except (KeyError, TypeError, ValueError):
        return None
