"""The Redis tier itself: :class:`RedisTier` (options, open with its credential and value-size checks, one
bounded round trip per call under the health breaker, cluster redirects followed per hop, lookups, verified
reads, stores, block encodings, logs) and its stats record :class:`RedisTierStats`.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import sys
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

# redis-py, imported absolutely: the top-level ``redis`` package, never this package (aiokv.tiers.redis).
try:  # redis is an optional extra (aiokv[redis]): importing aiokv must work without it
    from redis.asyncio import BlockingConnectionPool, Redis
    from redis.asyncio.cluster import ClusterNode, RedisCluster
    from redis.exceptions import AskError, MovedError, NoPermissionError, ResponseError

    _IMPORT_ERROR: ImportError | None = None
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    _IMPORT_ERROR = exc

from ..._errors import ClosedError, InvalidArgumentError, InvalidTypeError, MissingDependencyError
from ..._log import Throttled, Transitions, get_logger
from .._base import BackingTier, TierSpec, check_buffers, wait_thread
from .._codec import Codec, DecodeError, EncodeError, check_encoding, make_codec
from .._format import HEADER_SIZE, Damage, TierHealth, Verdict, check_damage, fold_damage, pack_header
from .._health import Breaker
from ._connection import _check_url, _close_client, _connection_options, _redact, _server_max_value_bytes
from ._replies import _FAILED, _Failed, _first_unavailable, _is_timeout, _refusal, _unavailable
from ._values import (
    _MIN_VALUE_BYTES,
    _SMALLEST_SERVER_LIMIT,
    DEFAULT_MAX_VALUE_BYTES,
    _as_bytes,
    _assemble,
    _Split,
)

if sys.version_info >= (3, 11):
    from asyncio import timeout_at as _timeout_at
else:  # pragma: no cover - redis-py depends on async-timeout before 3.11.3
    from async_timeout import timeout_at as _timeout_at

__all__ = ["RedisTier", "RedisTierStats"]

T = TypeVar("T")
_log = get_logger("tiers.redis")

_PROBE_KEY = b"aiokv-permission-probe"  # under the namespace's prefix; never created
_SPARE_CONNECTIONS = 2  # per cluster node, beyond max_connections: redirects and slot-map refreshes
_REDIRECTS = 4  # cluster: ASK / MOVED answers followed per command within one call


@dataclass(frozen=True, slots=True)
class RedisTierStats:
    """A :class:`RedisTier`'s counters and health. ``read_bytes`` and ``stored_bytes`` count the payload bytes
    moved to and from the server (headers not included): with a lossy ``encoding`` the encoded bytes, fewer than
    the blocks' size in the engine."""

    health: TierHealth
    url: str  # password removed
    namespace: str
    lookups: int
    lookup_hits: int  # blocks reported present
    reads: int  # read_into() calls
    read_blocks: int  # blocks read and verified
    read_bytes: int
    read_misses: int  # read_into() calls that returned fewer blocks than asked
    corrupt: int  # values that failed verification (deleted)
    writes: int  # write() calls
    stored_blocks: int
    stored_bytes: int
    dropped: int  # blocks not stored (server down, timeout, rejected)
    rejected: int  # blocks the server refused (e.g. OOM with maxmemory-policy noeviction)
    errors: int  # failed round trips (connection refused/reset, protocol errors)
    timeouts: int  # round trips that ran past timeout_s
    skipped: int  # calls answered locally because the server was down
    reconnects: int  # times the tier came back up after being down
    consecutive_failures: int
    backoff_s: float  # current wait before the next probe while down
    max_value_bytes: int  # the largest value sent: blocks of more bytes (header included) are split
    parts_per_block: int  # values per block (1 unless blocks are split)
    server_max_value_bytes: int | None  # the server's proto-max-bulk-len, when it could be read at open
    last_error: str | None
    encoding: str = "raw"  # how blocks are stored (RedisTier(encoding=...))
    dropped_unencodable: int = 0  # blocks not stored: a value was not finite (lossy encodings only)


def _positive(name: str, value: object, *, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidTypeError(f"{name} must be a number, got {type(value).__name__}")
    if not value > 0:
        raise InvalidArgumentError(f"{name} must be > 0, got {value}")


def _positive_int(name: str, value: object, *, minimum: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidTypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise InvalidArgumentError(f"{name} must be >= {minimum}, got {value}")


class RedisTier(BackingTier):
    """Tier in a Redis / Valkey server (``cluster=True``: a Redis Cluster), shared by every process that uses
    the same ``url`` and ``namespace`` and the same KV layout.

    ``ttl_s`` expires entries (refreshed on every read); ``timeout_s`` bounds every call; ``username`` /
    ``password`` authenticate (or put them in the URL); ``ssl=True`` or a ``rediss://`` URL enables TLS, with
    ``ssl_options`` (``ssl_ca_certs``, ``ssl_certfile``, ``ssl_keyfile``, ``ssl_cert_reqs``,
    ``ssl_check_hostname``, ...) passed through to redis-py, as are ``client_options``.
    ``max_connections`` bounds the connection pool (per node for a cluster) and the round trips in flight,
    ``max_batch_bytes`` the bytes of one pipelined read or write. ``max_value_bytes`` caps the size of one value
    (default: the server's ``proto-max-bulk-len``, read at open, else 512 MiB): larger blocks are split into
    parts. ``clock`` (monotonic seconds) times the backoff; it exists for tests.

    ``encoding`` is how blocks are stored: ``"raw"`` (the default: the exact bytes), or ``"fp8"`` / ``"int8"``,
    lossy, about half the bytes of a bf16 or fp16 block (see :mod:`aiokv.tiers._codec`; the tier must be opened
    with the layout's tensor shapes, as an :class:`~aiokv.Offloader` does). Entries of each encoding live under
    keys and a fingerprint of their own: processes using another encoding (or raw) never read them. Encoding
    and decoding run in the loop's default executor, and ``timeout_s`` bounds the round trips only: that work
    comes on top. A block with a value that is not finite is not stored (``dropped_unencodable``).

    :meth:`open` raises :class:`~aiokv.InvalidArgumentError` when the server refuses the credentials or the
    user may not run the tier's commands on its keys; an unreachable server only leaves the tier degraded.
    """

    name = "redis"

    def __init__(
        self,
        url: str = "redis://127.0.0.1:6379/0",
        *,
        namespace: str = "aiokv",
        ttl_s: float | None = None,
        timeout_s: float = 1.0,
        cluster: bool = False,
        username: str | None = None,
        password: str | None = None,
        ssl: bool | None = None,
        ssl_options: Mapping[str, Any] | None = None,
        client_options: Mapping[str, Any] | None = None,
        max_connections: int = 32,
        max_batch_bytes: int = 64 << 20,
        max_value_bytes: int | None = None,
        failures_to_down: int = 2,
        backoff_s: float = 0.5,
        backoff_max_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
        encoding: str = "raw",
    ) -> None:
        if _IMPORT_ERROR is not None:
            raise MissingDependencyError(
                f"RedisTier needs the redis extra: pip install 'aiokv[redis]' ({_IMPORT_ERROR})"
            )
        self.url = _check_url(url, ssl)
        if not isinstance(namespace, str) or not namespace:
            raise InvalidArgumentError(f"namespace must be a non-empty str, got {namespace!r}")
        _positive("ttl_s", ttl_s, allow_none=True)
        _positive("timeout_s", timeout_s)
        _positive("backoff_s", backoff_s)
        _positive("backoff_max_s", backoff_max_s)
        _positive_int("max_connections", max_connections)
        _positive_int("max_batch_bytes", max_batch_bytes)
        _positive_int("failures_to_down", failures_to_down)
        if max_value_bytes is not None:
            _positive_int("max_value_bytes", max_value_bytes, minimum=_MIN_VALUE_BYTES)
        self._encoding = check_encoding(encoding)
        self.namespace = namespace
        self.ttl_s = ttl_s
        self.timeout_s = float(timeout_s)
        self.cluster = cluster
        self._client_kwargs = _connection_options(
            self.timeout_s, username, password, ssl_options, client_options
        )
        self._username = username
        self._max_connections = max_connections
        self._max_batch_bytes = max_batch_bytes
        self._max_value_bytes = max_value_bytes
        self._clock = clock
        self._breaker = Breaker(failures_to_down, float(backoff_s), float(backoff_max_s), clock)
        self._init_state()
        self._init_logs()

    def _init_state(self) -> None:
        self._client: Redis | RedisCluster | None = None
        self._in_flight: asyncio.Semaphore | None = None  # cluster: bounds the round trips in flight
        self._stale_topology = False  # cluster: refresh the slot map before the next round trip
        self._buffers: list[bytearray] = []  # reusable value buffers (header + payload), see write()
        self._keep_buffers = 0
        self._spec: TierSpec | None = None  # the caller's: buffers are slots of its payload_bytes
        self._stored: TierSpec | None = None  # the entries' (encoded payload, fingerprint): see open()
        self._codec: Codec | None = None  # None: blocks stored raw
        self._split: _Split | None = None
        self._server_max_value_bytes: int | None = None
        self._prefix = b""
        self._opened = False
        self._closed = False
        self._last_error: str | None = None
        self._c: dict[str, int] = dict.fromkeys(
            (
                "lookups",
                "lookup_hits",
                "reads",
                "read_blocks",
                "read_bytes",
                "read_misses",
                "corrupt",
                "writes",
                "stored_blocks",
                "stored_bytes",
                "dropped",
                "dropped_unencodable",
                "rejected",
                "errors",
                "timeouts",
                "skipped",
            ),
            0,
        )

    def _init_logs(self) -> None:
        where = f"redis tier {_redact(self.url)!r} namespace {self.namespace!r}"
        self._where = where
        self._log_health = Transitions(_log, where)
        self._log_io = Throttled(_log, logging.WARNING, f"{where}: failed round trips")
        self._log_corrupt = Throttled(_log, logging.WARNING, f"{where}: corrupt values dropped")
        self._log_rejected = Throttled(_log, logging.WARNING, f"{where}: values refused by the server")
        self._log_unencodable = Throttled(
            _log, logging.WARNING, f"{where}: blocks not stored (values not finite)"
        )
        self._log_too_large = Throttled(
            _log, logging.ERROR, f"{where}: values larger than the server accepts"
        )

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open" if self._opened else "new"
        return (
            f"<RedisTier {_redact(self.url)!r} namespace={self.namespace!r} encoding={self._encoding!r} "
            f"{state} health={self._breaker.state.value}>"
        )

    @property
    def encoding(self) -> str:
        """How blocks are stored: ``"raw"``, ``"fp8"`` or ``"int8"`` (see the class docstring)."""
        return self._encoding

    # ------------------------------------------------------------- lifecycle
    async def open(self, spec: TierSpec) -> None:
        """Create the client, then one bounded round trip checks the credentials and the user's permissions
        (on a key that never exists: nothing is written) and reads the server's ``proto-max-bulk-len``.

        Raises :class:`~aiokv.InvalidArgumentError` when the server refuses the credentials (``WRONGPASS``,
        ``NOAUTH``) or the user may not run ``EXISTS``, ``GET``/``GETEX``, ``SET`` and ``DEL`` on the
        namespace's keys (``NOPERM``); the tier is closed then; also (before connecting) for a lossy
        ``encoding`` and a ``spec`` without the layout's tensor shapes (``segments``). Never raises for an
        unreachable server: the tier starts ``"degraded"`` or ``"down"`` and probes again later.
        """
        if self._opened or self._closed:
            raise ClosedError("a RedisTier can be opened once; create a new one")
        if not isinstance(spec, TierSpec):
            raise InvalidTypeError(f"spec must be a TierSpec, got {type(spec).__name__}")
        if spec.payload_bytes <= 0:
            raise InvalidArgumentError(f"spec.payload_bytes must be > 0, got {spec.payload_bytes}")
        if len(spec.fingerprint) != 32:
            raise InvalidArgumentError(f"spec.fingerprint must be 32 bytes, got {len(spec.fingerprint)}")
        codec = make_codec(self._encoding, spec.segments, spec.payload_bytes)
        # Entries hold the encoded payload in keys of their own (the prefix holds the stored fingerprint).
        stored = spec if codec is None else codec.stored_spec(spec)
        self._spec = spec
        self._stored = stored
        self._codec = codec
        self._prefix = f"{self.namespace}:{stored.fingerprint[:8].hex()}:".encode()
        self._split = _Split.of(
            HEADER_SIZE + stored.payload_bytes, self._max_value_bytes or DEFAULT_MAX_VALUE_BYTES
        )
        self._keep_buffers = self._batch_len()
        self._client = self._make_client()
        self._opened = True
        try:
            await self._check_server()
        except InvalidArgumentError:
            await self.aclose()
            raise

    def _make_client(self) -> Redis | RedisCluster:
        if self.cluster:
            self._in_flight = asyncio.Semaphore(self._max_connections)
            return RedisCluster.from_url(
                self.url, max_connections=self._max_connections + _SPARE_CONNECTIONS, **self._client_kwargs
            )
        pool = BlockingConnectionPool.from_url(
            self.url, max_connections=self._max_connections, timeout=self.timeout_s, **self._client_kwargs
        )
        return Redis.from_pool(pool)

    async def _check_server(self) -> None:
        """The open-time round trip (see :meth:`open`)."""
        probe = self._prefix + _PROBE_KEY
        px = self._ttl_ms()

        async def op(client: Redis | RedisCluster) -> tuple[int | None]:
            pipe = client.pipeline(transaction=False)
            pipe.exists(probe)
            if px is None:
                pipe.get(probe)
            else:
                pipe.getex(probe, px=px)
            pipe.set(probe, b"", xx=True, px=px)  # XX: only if it exists, which it never does
            pipe.delete(probe)
            for reply in await pipe.execute(raise_on_error=False):
                refused = _refusal(reply)
                if refused is not None:
                    raise refused
            return (await _server_max_value_bytes(client),)

        answer = await self._call(op, _now() + self.timeout_s, refusals_raise=True)
        if isinstance(answer, _Failed):
            return  # no answer: the tier starts degraded and later calls probe the server
        (limit,) = answer
        if limit is None:
            await self._check_value_size()
            return
        self._server_max_value_bytes = limit
        split = _Split.of(self._parts().entry_bytes, min(limit, self._max_value_bytes or limit))
        if split.parts > 1:
            _log.info(
                "%s: blocks of %d bytes exceed the largest value %d: each is stored in %d values",
                self._where,
                split.entry_bytes,
                split.part_bytes,
                split.parts,
            )
        self._split = split

    async def _check_value_size(self) -> None:
        """When the server's ``proto-max-bulk-len`` cannot be read: send one value as large as the largest this
        tier sends (``SET ... XX``: never stored). A server that answers PING but drops the connection over that
        value refuses values this large: raise, naming ``max_value_bytes``."""
        size = self._parts().part_bytes
        if size <= _SMALLEST_SERVER_LIMIT:
            return
        probe, value = self._prefix + _PROBE_KEY, bytes(size)

        async def op(client: Redis | RedisCluster) -> Any:
            return await client.set(probe, value, xx=True)

        if not isinstance(await self._call(op, _now() + self.timeout_s), _Failed) or not await self.ping():
            return
        raise InvalidArgumentError(
            f"max_value_bytes must not exceed the server's proto-max-bulk-len: {self._where} refused a value of "
            f"{size} bytes ({self._last_error}) and the user may not read the limit (CONFIG GET); set "
            "max_value_bytes to it, larger blocks are then split"
        )

    async def ping(self) -> bool:
        """One round trip to the server (bounded by ``timeout_s``); updates the health. True when it answered."""
        self._live()

        async def op(client: Redis | RedisCluster) -> Any:
            return await client.ping()

        return not isinstance(await self._call(op, _now() + self.timeout_s), _Failed)

    async def aclose(self) -> None:
        """Close the connections (bounded by ``timeout_s``). Idempotent."""
        if self._closed:
            return
        self._closed = True
        for throttle in (
            self._log_health,
            self._log_io,
            self._log_corrupt,
            self._log_rejected,
            self._log_unencodable,
            self._log_too_large,
        ):
            throttle.flush()
        client, self._client = self._client, None
        if client is not None:
            try:
                async with _timeout_at(asyncio.get_running_loop().time() + self.timeout_s):
                    await _close_client(client)
            except Exception:  # closing a dead connection may fail in many ways
                pass

    async def __aenter__(self) -> RedisTier:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def _live(self) -> tuple[Redis | RedisCluster, TierSpec]:
        if self._closed:
            raise ClosedError("redis tier is closed")
        if self._client is None or self._spec is None:
            raise ClosedError("redis tier is not open; call open(spec) first")
        return self._client, self._spec

    def _parts(self) -> _Split:
        assert self._split is not None
        return self._split

    def _stored_spec(self) -> TierSpec:
        """The spec of the stored entries: the caller's, or with a lossy encoding its encoded payload size and
        fingerprint (see :meth:`open`)."""
        assert self._stored is not None
        return self._stored

    def redis_key(self, key: bytes) -> bytes:
        """The Redis key of block ``key`` (of its first part when blocks are split), for tools and tests."""
        return self.redis_keys(key)[0]

    def redis_keys(self, key: bytes) -> list[bytes]:
        """The Redis keys of block ``key``'s values: one, or one per part when blocks are split."""
        if not self._prefix or self._split is None:
            raise ClosedError("redis tier is not open; call open(spec) first")
        base = self._prefix + key.hex().encode()
        split = self._split
        if split.parts == 1:
            return [base]
        return [b"%s:%d:%d" % (base, split.part_bytes, j) for j in range(split.parts)]

    def _ttl_ms(self) -> int | None:
        return None if self.ttl_s is None else max(1, round(self.ttl_s * 1000))

    # --------------------------------------------------------------- plumbing
    async def _call(
        self,
        op: Callable[[Redis | RedisCluster], Awaitable[T]],
        deadline: float,
        *,
        check: Callable[[T], BaseException | None] | None = None,
        refusals_raise: bool = False,
    ) -> T | _Failed:
        """Run one round trip under the breaker and the deadline (loop time); never raises but cancellation
        (and, with ``refusals_raise``, :class:`InvalidArgumentError` for refused credentials or permissions).

        ``check`` inspects a result for replies saying the server could not serve (see :func:`_unavailable`):
        the round trip then counts as a failure, and the result is still returned (its other replies hold)."""
        client = self._client
        breaker = self._breaker
        before = breaker.state
        probe = breaker.allow()
        if client is None or probe is None:
            self._c["skipped"] += 1
            return _FAILED
        if deadline <= _now():
            return self._failed(TimeoutError("deadline passed before the round trip"), probe)
        try:
            async with _timeout_at(deadline):
                result = await self._run(client, op)
        except asyncio.CancelledError:
            breaker.abandoned(probe)
            raise
        except Exception as exc:  # any failure of the backend is a miss, never an error
            refused = _refusal(exc) if refusals_raise else None
            if refused is not None:
                raise InvalidArgumentError(self._explain_refusal(refused)) from exc
            failure = self._failed(exc, probe)
            await self._after_failure(client)
            return failure
        problem = check(result) if check is not None else None
        if problem is None:
            breaker.success(bool(probe))
            self._health_changed(before)
            return result
        self._failed(problem, probe)
        await self._after_failure(client)
        return result

    async def _run(
        self, client: Redis | RedisCluster, op: Callable[[Redis | RedisCluster], Awaitable[T]]
    ) -> T:
        if not isinstance(client, RedisCluster):
            return await op(client)
        assert self._in_flight is not None
        async with self._in_flight:
            if self._stale_topology:  # after a failure: a master may have been replaced by its replica
                await client.nodes_manager.initialize()
                self._stale_topology = False
            return await op(client)

    async def _pipeline(self, client: Redis | RedisCluster, commands: Sequence[tuple[Any, ...]]) -> list[Any]:
        """Send single-key ``commands`` in one pipelined round trip (one per node in a cluster) and return their
        replies in order, errors as exception objects.

        In a cluster the redirects are followed here rather than by redis-py, which re-sends each redirected
        command alone and sends its ``ASKING`` as a command of its own on whichever pooled connection is free:
        with two idle connections to the importing node, ``ASKING`` goes out on one and the command on the
        other, which the node answers ``MOVED`` back to the source until redis-py gives up -- a miss for every
        key of a migrating slot already moved, a dropped write for every new one. Here each hop is one pipeline to the nodes the redirects
        name, an ``ASK``-ed command right behind its ``ASKING`` on the same connection; at most
        :data:`_REDIRECTS` hops, after which the last redirect is the reply (a failure, see
        :func:`_unavailable`). A ``MOVED`` means the slot map is stale: the next call refreshes it."""
        if not isinstance(client, RedisCluster):
            pipe = client.pipeline(transaction=False)
            for args in commands:
                pipe.execute_command(*args)
            return await pipe.execute(raise_on_error=False)
        replies: list[Any] = [None] * len(commands)
        # (command, node the last redirect named or None for the slot map's, ASKING first)
        sends: list[tuple[int, ClusterNode | None, bool]] = [(i, None, False) for i in range(len(commands))]
        for hop in range(_REDIRECTS + 1):
            hop_pipe = client.pipeline(transaction=False)
            for i, node, asking in sends:
                if node is None:
                    hop_pipe.execute_command(*commands[i])
                    continue
                if asking:
                    hop_pipe.execute_command("ASKING", target_nodes=node)
                hop_pipe.execute_command(*commands[i], target_nodes=node)
            answers = iter(await hop_pipe.execute(raise_on_error=False, allow_redirections=False))
            redirected: list[tuple[int, ClusterNode | None, bool]] = []
            for i, _, asking in sends:
                allowed = next(answers) if asking else None
                reply = next(answers)
                if isinstance(allowed, BaseException):  # ASKING refused (NOPERM: a user without +asking)
                    reply = allowed
                replies[i] = reply
                if not isinstance(reply, AskError):  # a value, or an error that no other node would fix
                    continue
                moved = isinstance(reply, MovedError)  # a subclass of AskError
                if moved:
                    self._stale_topology = True
                target = client.get_node(host=reply.host, port=reply.port)
                if target is not None:  # a node the client has never heard of: the redirect stays the reply
                    redirected.append((i, target, not moved))
            if not redirected or hop == _REDIRECTS:
                break
            sends = redirected
        return replies

    async def _after_failure(self, client: Redis | RedisCluster) -> None:
        """After a failure the pooled idle connections are suspect (a restarted server leaves them half
        closed): close them so that the next call, the probe in particular, connects afresh; in a cluster, also
        refresh the slot map before the next round trip."""
        try:
            async with _timeout_at(_now() + self.timeout_s):
                if isinstance(client, RedisCluster):
                    self._stale_topology = True
                    await asyncio.gather(
                        *(node.disconnect_free_connections() for node in client.get_nodes()),
                        return_exceptions=True,
                    )
                else:
                    await client.connection_pool.disconnect(inuse_connections=False)
        except Exception:  # closing sockets of a dead server may fail in many ways; they are gone anyway
            pass

    def _failed(self, exc: BaseException, probe: bool) -> _Failed:
        self._c["timeouts" if _is_timeout(exc) else "errors"] += 1
        self._last_error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        before = self._breaker.state
        self._breaker.failure(probe)
        self._log_io.event(
            "%s: %s failed: %s", self._where, "probe" if probe else "round trip", self._last_error
        )
        if "bulk length" in str(exc):  # the server refused a value larger than its proto-max-bulk-len
            self._log_too_large.event(
                "%s: the server refused a value of %d bytes (%s): set max_value_bytes to its "
                "proto-max-bulk-len, or grant the user +config|get so that the tier reads it at open",
                self._where,
                self._parts().part_bytes,
                self._last_error,
            )
        self._health_changed(before)
        return _FAILED

    def _explain_refusal(self, exc: BaseException) -> str:
        if isinstance(exc, NoPermissionError) or str(exc).startswith("NOPERM"):
            return (
                f"username {self._username!r} may not run the commands {self._where} needs ({exc}): grant it "
                f"at least ~{self.namespace}:* +exists +get +getex +set +del +ping, and +command "
                "+cluster|slots +asking for a cluster (+config|get lets the tier read proto-max-bulk-len)"
            )
        return f"password or username refused by {self._where}: {exc}"

    def _health_changed(self, before: TierHealth) -> None:
        """Log a transition of the breaker's state (WARNING when worse, INFO when back up)."""
        breaker = self._breaker
        state = breaker.state
        if state is before:
            return
        log = self._log_health
        if state is TierHealth.UP:
            log.changed("up", logging.INFO, "%s is up again (was %s)", self._where, before.value)
        elif state is TierHealth.DEGRADED:
            log.changed(
                "degraded",
                logging.WARNING,
                "%s degraded: %s; failed calls are misses and dropped writes: check the server's load and the "
                "network (down after %d consecutive failures)",
                self._where,
                self._last_error,
                breaker.failures_to_down,
            )
        else:
            log.changed(
                "down",
                logging.WARNING,
                "%s is down after %d consecutive failures (%s): calls are answered locally (misses, dropped "
                "writes) and the server is probed again in %.1f s: check that the server runs and is reachable "
                "from here (address, port, TLS, credentials)",
                self._where,
                breaker.failures,
                self._last_error,
                breaker.backoff,
            )

    def _batch_len(self) -> int:
        """Blocks per pipelined round trip."""
        return max(1, self._max_batch_bytes // self._parts().entry_bytes)

    # ------------------------------------------------------------ operations
    async def lookup(self, keys: Sequence[bytes]) -> int:
        self._live()
        self._c["lookups"] += 1
        if not keys:
            return 0
        per = self._parts().parts
        commands = [("EXISTS", rkey) for key in keys for rkey in self.redis_keys(key)]

        async def op(client: Redis | RedisCluster) -> list[Any]:
            return await self._pipeline(client, commands)

        result = await self._call(op, _now() + self.timeout_s, check=_first_unavailable)
        if isinstance(result, _Failed):
            return 0
        n = 0
        while n < len(keys) and all(present == 1 for present in result[n * per : (n + 1) * per]):
            n += 1
        self._c["lookup_hits"] += n
        if n < len(keys) and self.kv_events is not None:
            self._report_gone(keys, result, per)
        return n

    def _report_gone(self, keys: Sequence[bytes], present: Sequence[Any], per: int) -> None:
        """KV events: blocks this tier reported stored that the server says it no longer holds (expired or
        evicted by the server): removed, as far as this process can see."""
        assert self.kv_events is not None
        gone = [
            key
            for j, key in enumerate(keys)
            if any(p == 0 for p in present[j * per : (j + 1) * per]) and self.kv_events.holds(key)
        ]
        self.kv_events.removed(gone)

    async def read_into(self, keys: Sequence[bytes], outs: Sequence[memoryview]) -> int:
        _, spec = self._live()
        check_buffers("outs", keys, outs, spec.payload_bytes)
        if not keys:
            return 0
        self._c["reads"] += 1
        deadline = _now() + self.timeout_s
        ttl = self._ttl_ms()
        step = self._batch_len()
        per = self._parts().parts
        done = 0

        async def fetch(chunk: Sequence[bytes]) -> list[Any] | _Failed:
            commands = [
                ("GET", rkey) if ttl is None else ("GETEX", rkey, "PX", ttl)
                for key in chunk
                for rkey in self.redis_keys(key)
            ]

            async def op(client: Redis | RedisCluster) -> list[Any]:
                return await self._pipeline(client, commands)

            return await self._call(op, deadline, check=_first_unavailable)

        # Encoded blocks are decoded in a thread (the C codec releases the GIL): meanwhile the next chunk's
        # round trip runs on the loop, so decoding overlaps the transfer. A prefetch not needed (the read
        # stopped at a miss or a corrupt entry) is cancelled and awaited before returning.
        prefetch: asyncio.Task[list[Any] | _Failed] | None = None
        try:
            while done < len(keys):
                chunk = keys[done : done + step]
                if prefetch is not None:
                    values = await prefetch
                    prefetch = None
                else:
                    values = await fetch(chunk)
                if isinstance(values, _Failed):
                    break
                verdicts: Iterable[Verdict | None]
                if self._codec is None:  # verified block by block, up to the first that is not OK
                    verdicts = (
                        self._assemble(key, values[j * per : (j + 1) * per], outs[done + j])
                        for j, key in enumerate(chunk)
                    )
                else:  # verified and decoded in a thread, up to the first that is not OK
                    after = done + len(chunk)
                    if after < len(keys):
                        prefetch = asyncio.ensure_future(fetch(keys[after : after + step]))
                    started = _now()
                    verdicts = await _off_loop(
                        self._decode_values, chunk, values, outs[done : done + len(chunk)]
                    )
                    if prefetch is None:
                        deadline += _now() - started  # timeout_s bounds the round trips, not the decoding
                corrupt: bytes | None = None
                accepted = 0
                for j, (key, verdict) in enumerate(zip(chunk, verdicts, strict=False)):
                    if verdict is None:  # absent, or its node could not serve it: a miss
                        if self.kv_events is not None and None in values[j * per : (j + 1) * per]:
                            self.kv_events.removed([key])  # gone from the server (expired, evicted)
                        break
                    if verdict is not Verdict.OK:
                        self._c["corrupt"] += 1
                        self._log_corrupt.event(
                            "%s: value of %s failed verification (%s), deleted; a miss, its blocks are "
                            "recomputed (if this repeats: something else writes keys of this namespace)",
                            self._where,
                            key.hex()[:16],
                            verdict.value,
                        )
                        corrupt = key
                        break
                    accepted += 1
                done += accepted
                if corrupt is not None:
                    if self.kv_events is not None:
                        self.kv_events.removed([corrupt])
                    await self._delete(self.redis_keys(corrupt), deadline)
                if accepted < len(chunk):
                    break
        finally:
            if prefetch is not None:
                prefetch.cancel()
                await asyncio.gather(prefetch, return_exceptions=True)
        if done < len(keys):
            self._c["read_misses"] += 1
        self._c["read_blocks"] += done
        self._c["read_bytes"] += done * self._stored_spec().payload_bytes
        return done

    def _assemble(self, key: bytes, values: Sequence[Any], out: memoryview) -> Verdict | None:
        """Verify block ``key`` from its values and copy its (stored) payload into ``out``: see
        :func:`aiokv.tiers.redis._values._assemble`."""
        return _assemble(key, values, out, self._stored_spec(), self._parts())

    def _decode_values(
        self, keys: Sequence[bytes], values: Sequence[Any], outs: Sequence[memoryview]
    ) -> list[Verdict | None]:
        """Verify the encoded entries of ``keys`` from their ``values`` (``parts`` each) and decode each into
        ``outs[i]`` (runs in a thread): the verdicts up to the first that is not OK (``UNDECODABLE`` for an entry
        that verifies but does not decode; ``outs[i]`` may then hold partial data, as for a corrupt entry)."""
        codec = self._codec
        assert codec is not None
        per = self._parts().parts
        scratch = memoryview(bytearray(codec.encoded_bytes))  # one entry at a time: verified, then decoded
        verdicts: list[Verdict | None] = []
        for j, key in enumerate(keys):
            verdict = self._assemble(key, values[j * per : (j + 1) * per], scratch)
            if verdict is Verdict.OK:
                try:
                    codec.decode(scratch, outs[j])
                except DecodeError:
                    verdict = Verdict.UNDECODABLE
            verdicts.append(verdict)
            if verdict is not Verdict.OK:
                break
        return verdicts

    async def _delete(self, rkeys: list[bytes], deadline: float) -> None:
        async def op(client: Redis | RedisCluster) -> list[Any]:
            return await self._pipeline(client, [("DEL", rkey) for rkey in rkeys])

        await self._call(op, max(deadline, _now() + self.timeout_s / 4), check=_first_unavailable)

    async def write(self, keys: Sequence[bytes], payloads: Sequence[memoryview]) -> int:
        stored, _ = await self._store(keys, payloads, None)
        return stored

    async def _write_damaged(
        self, keys: Sequence[bytes], payloads: Sequence[memoryview], damage: Sequence[Damage | None]
    ) -> tuple[int, int]:
        """Fault injection hook (used by :class:`~aiokv.tiers.FaultyTier` only): ``write``, except that value
        ``i`` is stored with the :data:`~aiokv.tiers._format.Damage` ``damage[i]`` applied after its
        checksums were computed, i.e. corrupt at rest. Returns (stored, how many of them were damaged).

        Offsets are of an entry of the caller's ``payload_bytes`` (what a wrapper sees). With a lossy encoding
        the stored entry is shorter: an offset past its end is folded into its payload, so the damage still
        hits the stored, encoded entry (the header stays the header)."""
        _, spec = self._live()
        check_damage(damage, len(keys), spec.payload_bytes)
        size = self._stored_spec().payload_bytes
        if size != spec.payload_bytes:
            damage = [None if dmg is None else fold_damage(dmg, size) for dmg in damage]
        return await self._store(keys, payloads, damage)

    async def _store(
        self, keys: Sequence[bytes], payloads: Sequence[memoryview], damage: Sequence[Damage | None] | None
    ) -> tuple[int, int]:
        _, spec = self._live()
        check_buffers("payloads", keys, payloads, spec.payload_bytes)
        self._c["writes"] += 1
        deadline = _now() + self.timeout_s
        ttl = self._ttl_ms()
        px = () if ttl is None else ("PX", ttl)
        step = self._batch_len()
        split = self._parts()
        per = split.parts
        bounds = split.bounds()
        fingerprint = self._stored_spec().fingerprint
        stored = 0
        stored_damaged = 0
        unencodable = 0
        start = 0
        while start < len(keys):
            # Values are built (payloads copied or encoded) before the round trip: nothing references the
            # caller's buffers once this iteration awaits the server, so a cancelled write never reads a recycled
            # slot. Reused buffers avoid page-faulting a fresh allocation per value (the dominant cost of building
            # large values).
            chunk_keys = keys[start : start + step]
            chunk_payloads = payloads[start : start + step]
            bufs = [
                self._buffers.pop() if self._buffers else bytearray(split.entry_bytes) for _ in chunk_keys
            ]
            if self._codec is None:
                for k, p, buf in zip(chunk_keys, chunk_payloads, bufs, strict=True):
                    value = memoryview(buf)
                    value[:HEADER_SIZE] = pack_header(k, fingerprint, p)
                    value[HEADER_SIZE:] = _as_bytes(p)
                kept = list(range(len(bufs)))
            else:  # encoded in a thread, which has finished reading the payloads when it returns
                started = _now()
                kept = await _off_loop(self._encode_values, chunk_keys, chunk_payloads, bufs, fingerprint)
                deadline += _now() - started  # timeout_s bounds the round trips, not the encoding
                unencodable += len(bufs) - len(kept)
            sent = [bufs[i] for i in kept]
            # Fault injection: flip one byte of an entry after its checksums were computed (a reused buffer is
            # rewritten whole before its next use).
            hurt = [damage[start + i] for i in kept] if damage is not None else []
            for buf, dmg in zip(sent, hurt, strict=False):  # hurt is empty without damage
                if dmg is not None:
                    buf[dmg[0]] ^= dmg[1]
            items = [
                (rkey, memoryview(buf)[a:b])
                for i, buf in zip(kept, sent, strict=True)
                for rkey, (a, b) in zip(self.redis_keys(chunk_keys[i]), bounds, strict=True)
            ]

            async def op(
                client: Redis | RedisCluster, items: list[tuple[bytes, memoryview]] = items
            ) -> list[Any]:
                return await self._pipeline(client, [("SET", rkey, value, *px) for rkey, value in items])

            result: list[Any] | _Failed = []  # nothing to send when no block of the batch could be encoded
            if items:
                result = await self._call(op, deadline, check=_first_unavailable)
            if isinstance(result, _Failed):
                break  # the buffers may still be referenced by a closing connection: let them go
            acked: list[bytes] | None = [] if self.kv_events is not None else None
            for j, i in enumerate(kept):
                replies = result[j * per : (j + 1) * per]
                if all(reply is True for reply in replies):
                    stored += 1
                    stored_damaged += bool(hurt) and hurt[j] is not None
                    if acked is not None:
                        acked.append(chunk_keys[i])
                    continue
                refusal = next(
                    (r for r in replies if isinstance(r, ResponseError) and not _unavailable(r)), None
                )
                if refusal is not None:
                    self._c["rejected"] += 1
                    self._last_error = f"ResponseError: {refusal}"
                    self._log_rejected.event("%s: the server refused a value: %s", self._where, refusal)
            if acked and self.kv_events is not None:
                self.kv_events.stored(acked)
            start += len(bufs)
            del items
            # The server answered, so every byte was sent: the buffers can be reused.
            self._buffers.extend(bufs[: max(0, self._keep_buffers - len(self._buffers))])
        if unencodable:
            self._c["dropped_unencodable"] += unencodable
            self._log_unencodable.event(
                "%s: %d blocks not stored: a value was not finite (encoding %r)",
                self._where,
                unencodable,
                self._encoding,
            )
        self._c["stored_blocks"] += stored
        self._c["stored_bytes"] += stored * self._stored_spec().payload_bytes
        self._c["dropped"] += len(keys) - stored
        return stored, stored_damaged

    def _encode_values(
        self,
        keys: Sequence[bytes],
        payloads: Sequence[memoryview],
        bufs: Sequence[bytearray],
        fingerprint: bytes,
    ) -> list[int]:
        """Encode ``payloads[i]`` into the entry ``bufs[i]`` (header + encoded payload; runs in a thread): the
        indices of the blocks encoded (a block with a value that is not finite is left out: not stored)."""
        codec = self._codec
        assert codec is not None
        kept: list[int] = []
        for i, (key, payload, buf) in enumerate(zip(keys, payloads, bufs, strict=True)):
            value = memoryview(buf)
            try:
                codec.encode(payload, value[HEADER_SIZE:])
            except EncodeError:
                continue
            value[:HEADER_SIZE] = pack_header(key, fingerprint, value[HEADER_SIZE:])
            kept.append(i)
        return kept

    def stats(self) -> RedisTierStats:
        breaker = self._breaker
        split = self._split
        return RedisTierStats(
            health=breaker.state,
            url=_redact(self.url),
            namespace=self.namespace,
            reconnects=breaker.reconnects,
            consecutive_failures=breaker.failures,
            backoff_s=breaker.backoff,
            max_value_bytes=split.part_bytes if split is not None else 0,
            parts_per_block=split.parts if split is not None else 0,
            server_max_value_bytes=self._server_max_value_bytes,
            last_error=self._last_error,
            encoding=self._encoding,
            **self._c,
        )


async def _off_loop(fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` (encoding, decoding: CPU work) on the loop's default executor. A cancellation waits for it
    to finish (it reads or writes the caller's buffers, and a thread cannot be recalled), then is re-raised."""
    fut, cancelled = await wait_thread(
        asyncio.get_running_loop().run_in_executor(None, functools.partial(fn, *args))
    )
    if cancelled:
        fut.exception()  # retrieved: never logged as unhandled
        raise asyncio.CancelledError
    return fut.result()


def _now() -> float:
    return asyncio.get_running_loop().time()
