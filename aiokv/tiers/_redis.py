"""A shared Redis / Valkey tier (single node or Redis Cluster) with bounded timeouts and a circuit breaker.

Each block is one string value: the 128-byte header of :mod:`aiokv.tiers._format` followed by the payload,
under the key ``{namespace}:{fingerprint[:8].hex()}:{block_hash.hex()}``. Entries of another layout live
under other keys; a value that is foreign anyway (written by hand, by another version, truncated) fails
verification, counts as ``corrupt``, is deleted and is a miss.

- ``lookup`` sends one pipelined ``EXISTS`` per key (one round trip for the whole prefix).
- ``read_into`` sends pipelined ``GET`` (``GETEX`` refreshing the TTL when ``ttl_s`` is set), in batches of at
  most ``max_batch_bytes``, verifies each value, then copies its payload into the caller's buffer.
- ``write`` sends pipelined ``SET`` (with ``EX ttl_s``). Eviction is the server's (``maxmemory`` +
  ``maxmemory-policy allkeys-lru`` is the recommended setup); values are never read back by the writer.

Failures never raise. Every call is bounded by ``timeout_s`` (socket timeouts plus an overall deadline);
a failed call is a miss / dropped write and is counted. After ``failures_to_down`` consecutive failures the
tier is ``"down"``: calls are answered locally without touching the network until a backoff interval
(``backoff_s``, doubling up to ``backoff_max_s`` after every failed probe) has passed, then the next call
probes the server. A successful call brings it back ``"up"``; a failure short of ``failures_to_down`` leaves it
``"degraded"``.
"""

from __future__ import annotations

import asyncio
import logging
import re
import sys
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

try:  # redis is an optional extra (aiokv[redis]): importing aiokv must work without it
    from redis.asyncio import BlockingConnectionPool, Redis
    from redis.asyncio.cluster import RedisCluster
    from redis.asyncio.connection import parse_url
    from redis.asyncio.retry import Retry
    from redis.backoff import NoBackoff
    from redis.exceptions import ResponseError

    _IMPORT_ERROR: ImportError | None = None
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    _IMPORT_ERROR = exc

from .._errors import ClosedError, InvalidArgumentError, InvalidTypeError, MissingDependencyError
from .._log import Throttled, get_logger
from ._base import BackingTier, TierSpec, check_buffers
from ._format import HEADER_SIZE, Damage, TierHealth, Verdict, check_damage, check_entry, pack_header

if sys.version_info >= (3, 11):
    from asyncio import timeout_at as _timeout_at
else:  # pragma: no cover - redis-py depends on async-timeout before 3.11.3
    from async_timeout import timeout_at as _timeout_at

__all__ = ["RedisTier", "RedisTierStats"]

T = TypeVar("T")
_log = get_logger("tiers.redis")


@dataclass(frozen=True, slots=True)
class RedisTierStats:
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
    last_error: str | None


class _Breaker:
    """Health state machine (sync core): counts consecutive failures and decides when to touch the server."""

    __slots__ = (
        "_backoff0",
        "_backoff_max",
        "_clock",
        "_failures_to_down",
        "backoff",
        "failures",
        "probing",
        "reconnects",
        "retry_at",
        "state",
    )

    def __init__(
        self, failures_to_down: int, backoff_s: float, backoff_max_s: float, clock: Callable[[], float]
    ) -> None:
        self._failures_to_down = failures_to_down
        self._backoff0 = backoff_s
        self._backoff_max = backoff_max_s
        self._clock = clock
        self.state = TierHealth.UP
        self.failures = 0
        self.backoff = backoff_s
        self.retry_at = 0.0
        self.probing = False
        self.reconnects = 0

    def allow(self) -> bool | None:
        """Whether a call may touch the server now: ``None`` no (answer locally), ``False`` yes, ``True`` yes
        as the probe of a down server (exactly one per backoff interval)."""
        if self.state is not TierHealth.DOWN:
            return False
        if self.probing or self._clock() < self.retry_at:
            return None
        self.probing = True
        return True

    def success(self) -> None:
        if self.state is TierHealth.DOWN:
            self.reconnects += 1
        self.state = TierHealth.UP
        self.failures = 0
        self.backoff = self._backoff0
        self.probing = False

    def failure(self, probe: bool) -> None:
        self.failures += 1
        if probe:  # the server is still gone: wait longer before the next probe
            self.backoff = min(self.backoff * 2, self._backoff_max)
            self.retry_at = self._clock() + self.backoff
            self.probing = False
        elif self.state is TierHealth.DOWN:
            pass  # a call already in flight when the server was declared down
        elif self.failures >= self._failures_to_down:
            self.state = TierHealth.DOWN
            self.retry_at = self._clock() + self.backoff
        else:
            self.state = TierHealth.DEGRADED

    def abandoned(self, probe: bool) -> None:
        """The call was cancelled before it could tell: let the next call probe."""
        if probe:
            self.probing = False


class _Failed:
    """Marker result of a round trip that did not happen or failed."""


_FAILED = _Failed()
_PASSWORD_RE = re.compile(r"(//[^:/@]*:)[^@/]*@")


def _redact(url: str) -> str:
    return _PASSWORD_RE.sub(r"\1***@", url)


def _positive(name: str, value: object, *, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidTypeError(f"{name} must be a number, got {type(value).__name__}")
    if not value > 0:
        raise InvalidArgumentError(f"{name} must be > 0, got {value}")


class RedisTier(BackingTier):
    """Tier in a Redis / Valkey server (``cluster=True``: a Redis Cluster), shared by every process that uses
    the same ``url`` and ``namespace`` and the same KV layout.

    ``ttl_s`` expires entries (refreshed on every read); ``timeout_s`` bounds every call; ``username`` /
    ``password`` authenticate (or put them in the URL); ``ssl=True`` or a ``rediss://`` URL enables TLS, with
    ``ssl_options`` (``ssl_ca_certs``, ``ssl_certfile``, ``ssl_keyfile``, ``ssl_cert_reqs``,
    ``ssl_check_hostname``, ...) passed through to redis-py, as are ``client_options``.
    ``max_connections`` bounds the connection pool (per node for a cluster), ``max_batch_bytes`` the bytes of
    one pipelined read or write. ``clock`` (monotonic seconds) times the backoff; it exists for tests.
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
        failures_to_down: int = 2,
        backoff_s: float = 0.5,
        backoff_max_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if _IMPORT_ERROR is not None:
            raise MissingDependencyError(
                f"RedisTier needs the redis extra: pip install 'aiokv[redis]' ({_IMPORT_ERROR})"
            )
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
        if not isinstance(namespace, str) or not namespace:
            raise InvalidArgumentError(f"namespace must be a non-empty str, got {namespace!r}")
        _positive("ttl_s", ttl_s, allow_none=True)
        _positive("timeout_s", timeout_s)
        _positive("backoff_s", backoff_s)
        _positive("backoff_max_s", backoff_max_s)
        for name, value in (
            ("max_connections", max_connections),
            ("max_batch_bytes", max_batch_bytes),
            ("failures_to_down", failures_to_down),
        ):
            if isinstance(value, bool) or not isinstance(value, int):
                raise InvalidTypeError(f"{name} must be an int, got {type(value).__name__}")
            if value <= 0:
                raise InvalidArgumentError(f"{name} must be > 0, got {value}")
        self.url = url
        self.namespace = namespace
        self.ttl_s = ttl_s
        self.timeout_s = float(timeout_s)
        self.cluster = cluster
        self._client_kwargs: dict[str, Any] = {
            "socket_timeout": self.timeout_s,
            "socket_connect_timeout": self.timeout_s,
            "retry": Retry(NoBackoff(), 0),  # never retry inside redis-py: the breaker decides
            "health_check_interval": 0,
            **(ssl_options or {}),
            **(client_options or {}),
        }
        if username is not None:
            self._client_kwargs["username"] = username
        if password is not None:
            self._client_kwargs["password"] = password
        self._max_connections = max_connections
        self._max_batch_bytes = max_batch_bytes
        self._clock = clock
        self._breaker = _Breaker(failures_to_down, float(backoff_s), float(backoff_max_s), clock)
        self._client: Redis | RedisCluster | None = None
        self._buffers: list[bytearray] = []  # reusable value buffers (header + payload), see write()
        self._keep_buffers = 0
        self._spec: TierSpec | None = None
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
                "rejected",
                "errors",
                "timeouts",
                "skipped",
            ),
            0,
        )
        where = f"redis tier {_redact(self.url)!r} namespace {namespace!r}"
        self._where = where
        self._log_degraded = Throttled(_log, logging.WARNING, f"{where}: degraded again")
        self._log_down = Throttled(_log, logging.WARNING, f"{where}: down again")
        self._log_up = Throttled(_log, logging.INFO, f"{where}: up again")
        self._log_io = Throttled(_log, logging.WARNING, f"{where}: failed round trips")
        self._log_corrupt = Throttled(_log, logging.WARNING, f"{where}: corrupt values dropped")
        self._log_rejected = Throttled(_log, logging.WARNING, f"{where}: values refused by the server")

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open" if self._opened else "new"
        return (
            f"<RedisTier {_redact(self.url)!r} namespace={self.namespace!r} {state} "
            f"health={self._breaker.state.value}>"
        )

    # ------------------------------------------------------------- lifecycle
    async def open(self, spec: TierSpec) -> None:
        """Create the client and ping the server once. Never raises for an unreachable server: the tier
        starts ``"degraded"`` or ``"down"`` and probes again later."""
        if self._opened or self._closed:
            raise ClosedError("a RedisTier can be opened once; create a new one")
        if not isinstance(spec, TierSpec):
            raise InvalidTypeError(f"spec must be a TierSpec, got {type(spec).__name__}")
        if spec.payload_bytes <= 0:
            raise InvalidArgumentError(f"spec.payload_bytes must be > 0, got {spec.payload_bytes}")
        if len(spec.fingerprint) != 32:
            raise InvalidArgumentError(f"spec.fingerprint must be 32 bytes, got {len(spec.fingerprint)}")
        self._spec = spec
        self._prefix = f"{self.namespace}:{spec.fingerprint[:8].hex()}:".encode()
        self._keep_buffers = self._batch_len()
        if self.cluster:
            self._client = RedisCluster.from_url(
                self.url, max_connections=self._max_connections, **self._client_kwargs
            )
        else:
            pool = BlockingConnectionPool.from_url(
                self.url, max_connections=self._max_connections, timeout=self.timeout_s, **self._client_kwargs
            )
            self._client = Redis.from_pool(pool)
        self._opened = True
        await self.ping()

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
            self._log_degraded,
            self._log_down,
            self._log_up,
            self._log_io,
            self._log_corrupt,
            self._log_rejected,
        ):
            throttle.flush()
        client, self._client = self._client, None
        if client is not None:
            try:
                async with _timeout_at(asyncio.get_running_loop().time() + self.timeout_s):
                    await client.aclose()
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

    def redis_key(self, key: bytes) -> bytes:
        """The Redis key of block ``key`` (for tools and tests)."""
        if not self._prefix:
            raise ClosedError("redis tier is not open; call open(spec) first")
        return self._prefix + key.hex().encode()

    # --------------------------------------------------------------- plumbing
    async def _call(self, op: Callable[[Redis | RedisCluster], Awaitable[T]], deadline: float) -> T | _Failed:
        """Run one round trip under the breaker and the deadline (loop time); never raises but cancellation."""
        client = self._client
        breaker = self._breaker
        before = breaker.state
        probe = breaker.allow()
        if client is None or probe is None:
            self._c["skipped"] += 1
            return _FAILED
        if deadline <= _now():
            return self._failed(TimeoutError("deadline passed before the round trip"), probe, timeout=True)
        try:
            async with _timeout_at(deadline):
                result = await op(client)
        except asyncio.CancelledError:
            breaker.abandoned(probe)
            raise
        except TimeoutError as exc:  # redis' TimeoutError is not a builtin TimeoutError subclass
            failure = self._failed(exc, probe, timeout=True)
        except Exception as exc:  # any failure of the backend is a miss, never an error
            failure = self._failed(exc, probe, timeout="Timeout" in type(exc).__name__)
        else:
            breaker.success()
            self._health_changed(before)
            return result
        await self._drop_idle_connections(client)
        return failure

    async def _drop_idle_connections(self, client: Redis | RedisCluster) -> None:
        """After a failure the pooled idle connections are suspect (a restarted server leaves them half
        closed): close them so that the next call, the probe in particular, connects afresh."""
        try:
            async with _timeout_at(_now() + self.timeout_s):
                if isinstance(client, RedisCluster):
                    await asyncio.gather(
                        *(node.disconnect_free_connections() for node in client.get_nodes()),
                        return_exceptions=True,
                    )
                else:
                    await client.connection_pool.disconnect(inuse_connections=False)
        except Exception:  # closing sockets of a dead server may fail in many ways; they are gone anyway
            pass

    def _failed(self, exc: BaseException, probe: bool, *, timeout: bool) -> _Failed:
        self._c["timeouts" if timeout else "errors"] += 1
        self._last_error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        before = self._breaker.state
        self._breaker.failure(probe)
        self._log_io.event(
            "%s: %s failed: %s", self._where, "probe" if probe else "round trip", self._last_error
        )
        self._health_changed(before)
        return _FAILED

    def _health_changed(self, before: TierHealth) -> None:
        """Log a transition of the breaker's state (WARNING when worse, INFO when back up)."""
        breaker = self._breaker
        state = breaker.state
        if state is before:
            return
        if state is TierHealth.UP:
            self._log_up.event("%s is up again (was %s)", self._where, before.value)
        elif state is TierHealth.DEGRADED:
            self._log_degraded.event("%s degraded: %s", self._where, self._last_error)
        else:
            self._log_down.event(
                "%s is down after %d consecutive failures (%s): calls are answered locally (misses, dropped "
                "writes) and the server is probed again in %.1f s",
                self._where,
                breaker.failures,
                self._last_error,
                breaker.backoff,
            )

    def _batch_len(self) -> int:
        assert self._spec is not None
        return max(1, self._max_batch_bytes // (HEADER_SIZE + self._spec.payload_bytes))

    # ------------------------------------------------------------ operations
    async def lookup(self, keys: Sequence[bytes]) -> int:
        self._live()
        self._c["lookups"] += 1
        if not keys:
            return 0
        rkeys = [self.redis_key(k) for k in keys]

        async def op(client: Redis | RedisCluster) -> list[Any]:
            pipe = client.pipeline(transaction=False)
            for rkey in rkeys:
                pipe.exists(rkey)
            return await pipe.execute(raise_on_error=False)

        result = await self._call(op, _now() + self.timeout_s)
        if isinstance(result, _Failed):
            return 0
        n = 0
        for present in result:
            if present != 1:
                break
            n += 1
        self._c["lookup_hits"] += n
        return n

    async def read_into(self, keys: Sequence[bytes], outs: Sequence[memoryview]) -> int:
        _, spec = self._live()
        check_buffers("outs", keys, outs, spec.payload_bytes)
        if not keys:
            return 0
        self._c["reads"] += 1
        deadline = _now() + self.timeout_s
        ttl = None if self.ttl_s is None else max(1, round(self.ttl_s * 1000))
        step = self._batch_len()
        done = 0
        while done < len(keys):
            chunk = [self.redis_key(k) for k in keys[done : done + step]]

            async def op(client: Redis | RedisCluster, chunk: list[bytes] = chunk) -> list[Any]:
                pipe = client.pipeline(transaction=False)
                for rkey in chunk:
                    if ttl is None:
                        pipe.get(rkey)
                    else:
                        pipe.getex(rkey, px=ttl)
                return await pipe.execute(raise_on_error=False)

            values = await self._call(op, deadline)
            if isinstance(values, _Failed):
                break
            corrupt: bytes | None = None
            accepted = 0
            for rkey, value in zip(chunk, values, strict=True):
                i = done + accepted
                if value is None:
                    break
                verdict = (
                    check_entry(
                        memoryview(value)[:HEADER_SIZE],
                        memoryview(value)[HEADER_SIZE:],
                        fingerprint=spec.fingerprint,
                        key=keys[i],
                        payload_len=spec.payload_bytes,
                    )
                    if isinstance(value, bytes)
                    else Verdict.BAD_HEADER  # WRONGTYPE and friends
                )
                if verdict is not Verdict.OK:
                    self._c["corrupt"] += 1
                    self._log_corrupt.event(
                        "%s: value of %s failed verification (%s), deleted",
                        self._where,
                        keys[i].hex()[:16],
                        verdict.value,
                    )
                    corrupt = rkey
                    break
                _as_bytes(outs[i])[:] = memoryview(value)[HEADER_SIZE:]
                accepted += 1
            done += accepted
            if corrupt is not None:
                await self._delete(corrupt, deadline)
            if accepted < len(chunk):
                break
        if done < len(keys):
            self._c["read_misses"] += 1
        self._c["read_blocks"] += done
        self._c["read_bytes"] += done * spec.payload_bytes
        return done

    async def _delete(self, rkey: bytes, deadline: float) -> None:
        async def op(client: Redis | RedisCluster) -> Any:
            return await client.delete(rkey)

        await self._call(op, max(deadline, _now() + self.timeout_s / 4))

    async def write(self, keys: Sequence[bytes], payloads: Sequence[memoryview]) -> int:
        stored, _ = await self._store(keys, payloads, None)
        return stored

    async def _write_damaged(
        self, keys: Sequence[bytes], payloads: Sequence[memoryview], damage: Sequence[Damage | None]
    ) -> tuple[int, int]:
        """Fault injection hook (used by :class:`~aiokv.tiers.FaultyTier` only): ``write``, except that value
        ``i`` is stored with the :data:`~aiokv.tiers._format.Damage` ``damage[i]`` applied after its
        checksums were computed, i.e. corrupt at rest. Returns (stored, how many of them were damaged)."""
        _, spec = self._live()
        check_damage(damage, len(keys), spec.payload_bytes)
        return await self._store(keys, payloads, damage)

    async def _store(
        self, keys: Sequence[bytes], payloads: Sequence[memoryview], damage: Sequence[Damage | None] | None
    ) -> tuple[int, int]:
        _, spec = self._live()
        check_buffers("payloads", keys, payloads, spec.payload_bytes)
        self._c["writes"] += 1
        deadline = _now() + self.timeout_s
        ttl = None if self.ttl_s is None else max(1, round(self.ttl_s * 1000))
        step = self._batch_len()
        entry = HEADER_SIZE + spec.payload_bytes
        stored = 0
        stored_damaged = 0
        start = 0
        while start < len(keys):
            # Values are built (payloads copied) before the round trip: nothing references the caller's buffers
            # once this iteration awaits, so a cancelled write never reads a recycled slot. Reused buffers avoid
            # page-faulting a fresh allocation per value (the dominant cost of building large values).
            bufs: list[bytearray] = []
            items: list[tuple[bytes, memoryview]] = []
            for k, p in zip(keys[start : start + step], payloads[start : start + step], strict=True):
                buf = self._buffers.pop() if self._buffers else bytearray(entry)
                value = memoryview(buf)
                value[:HEADER_SIZE] = pack_header(k, spec.fingerprint, p)
                value[HEADER_SIZE:] = _as_bytes(p)
                bufs.append(buf)
                items.append((self.redis_key(k), value))
            # Fault injection: flip one byte of a value after its checksums were computed (a reused buffer is
            # rewritten whole before its next use).
            hurt = damage[start : start + len(items)] if damage is not None else ()
            for (_, value), dmg in zip(items, hurt, strict=False):
                if dmg is not None:
                    value[dmg[0]] ^= dmg[1]

            async def op(
                client: Redis | RedisCluster, items: list[tuple[bytes, memoryview]] = items
            ) -> list[Any]:
                pipe = client.pipeline(transaction=False)
                for rkey, value in items:
                    pipe.set(rkey, value, px=ttl)
                return await pipe.execute(raise_on_error=False)

            result = await self._call(op, deadline)
            if isinstance(result, _Failed):
                break  # the buffers may still be referenced by a closing connection: let them go
            for j, reply in enumerate(result):
                if isinstance(reply, ResponseError):
                    self._c["rejected"] += 1
                    self._last_error = f"ResponseError: {reply}"
                    self._log_rejected.event("%s: the server refused a value: %s", self._where, reply)
                elif reply:
                    stored += 1
                    stored_damaged += bool(hurt) and hurt[j] is not None
            start += len(items)
            del items
            # The server answered, so every byte was sent: the buffers can be reused.
            self._buffers.extend(bufs[: max(0, self._keep_buffers - len(self._buffers))])
        self._c["stored_blocks"] += stored
        self._c["stored_bytes"] += stored * spec.payload_bytes
        self._c["dropped"] += len(keys) - stored
        return stored, stored_damaged

    def stats(self) -> RedisTierStats:
        breaker = self._breaker
        return RedisTierStats(
            health=breaker.state,
            url=_redact(self.url),
            namespace=self.namespace,
            reconnects=breaker.reconnects,
            consecutive_failures=breaker.failures,
            backoff_s=breaker.backoff,
            last_error=self._last_error,
            **self._c,
        )


def _now() -> float:
    return asyncio.get_running_loop().time()


def _as_bytes(buf: memoryview) -> memoryview:
    return buf if buf.format == "B" and buf.ndim == 1 else buf.cast("B")
