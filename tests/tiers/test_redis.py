"""RedisTier against a real redis-server: round trips, verification, sharing between processes, outages."""

from __future__ import annotations

import asyncio
import hashlib
import random
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio
import redis.asyncio as aioredis
from redis.asyncio.connection import SSLConnection

from aiokv._errors import ClosedError, InvalidArgumentError
from aiokv.testing import FakeClock as _FakeClock
from aiokv.tiers._base import TierSpec
from aiokv.tiers._format import HEADER_SIZE, TierHealth, pack_header
from aiokv.tiers.redis import RedisTier

from . import _entries as entries
from ._entries import FP, RunPy

PB = 4096
make_keys = entries.keys


def make_spec(payload_bytes: int = PB, fingerprint: bytes = FP) -> TierSpec:
    return entries.spec(payload_bytes, fingerprint)


def make_payloads(n: int, payload_bytes: int = PB, seed: int = 0) -> list[memoryview]:
    return entries.payloads(n, payload_bytes, seed)


def make_outs(n: int, payload_bytes: int = PB) -> list[memoryview]:
    return entries.outs(n, payload_bytes)


def FakeClock() -> _FakeClock:
    """aiokv.testing.FakeClock, starting at 1000.0 s."""
    return _FakeClock(1000.0)


@pytest_asyncio.fixture
async def raw(redis_server: Any) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.Redis.from_url(redis_server.url)
    yield client
    await client.aclose()


async def open_tier(url: str, namespace: str, spec: TierSpec | None = None, **kw: object) -> RedisTier:
    tier = RedisTier(url, namespace=namespace, **kw)  # type: ignore[arg-type]
    await tier.open(spec or make_spec())
    return tier


@pytest.mark.asyncio
async def test_write_lookup_read_round_trip_is_byte_identical(redis_server: Any, namespace: str) -> None:
    tier = await open_tier(redis_server.url, namespace)
    keys, data = make_keys(8), make_payloads(8)
    assert await tier.lookup(keys) == 0
    assert await tier.write(keys[:6], data[:6]) == 6
    assert await tier.lookup(keys) == 6
    assert await tier.lookup([keys[0], keys[7], keys[1]]) == 1
    outs = make_outs(8)
    assert await tier.read_into(keys, outs) == 6
    assert [bytes(o) for o in outs[:6]] == [bytes(d) for d in data[:6]]
    stats = tier.stats()
    assert (stats.health, stats.stored_blocks, stats.read_blocks, stats.read_misses) == (
        TierHealth.UP,
        6,
        6,
        1,
    )
    assert (stats.corrupt, stats.errors, stats.timeouts, stats.dropped) == (0, 0, 0, 0)
    await tier.aclose()
    await tier.aclose()
    with pytest.raises(ClosedError, match="redis tier is closed"):
        await tier.lookup(keys)


@pytest.mark.asyncio
async def test_large_prefixes_are_split_into_bounded_batches(redis_server: Any, namespace: str) -> None:
    tier = await open_tier(redis_server.url, namespace, max_batch_bytes=3 * (PB + HEADER_SIZE))
    keys, data = make_keys(10), make_payloads(10)
    assert await tier.write(keys, data) == 10
    outs = make_outs(10)
    assert await tier.read_into(keys, outs) == 10
    assert [bytes(o) for o in outs] == [bytes(d) for d in data]
    await tier.aclose()


@pytest.mark.asyncio
async def test_value_layout_and_ttl(redis_server: Any, namespace: str, raw: aioredis.Redis) -> None:
    tier = await open_tier(redis_server.url, namespace, ttl_s=100)
    keys, data = make_keys(1), make_payloads(1)
    assert await tier.write(keys, data) == 1
    rkey = tier.redis_key(keys[0])
    assert rkey == f"{namespace}:{FP[:8].hex()}:{keys[0].hex()}".encode()
    value = await raw.get(rkey)
    assert value == pack_header(keys[0], FP, data[0]) + bytes(data[0])
    assert 95_000 < await raw.pttl(rkey) <= 100_000
    await raw.pexpire(rkey, 5_000)
    assert await tier.read_into(keys, make_outs(1)) == 1
    assert await raw.pttl(rkey) > 95_000  # refreshed by the read
    await tier.aclose()


@pytest.mark.asyncio
@pytest.mark.parametrize(
    "damage",
    ["garbage", "truncated", "foreign-fingerprint", "wrong-key", "flipped-payload-byte", "wrong-type"],
)
async def test_foreign_or_corrupt_values_miss_and_are_deleted(
    redis_server: Any, namespace: str, raw: aioredis.Redis, damage: str
) -> None:
    tier = await open_tier(redis_server.url, namespace)
    keys, data = make_keys(3), make_payloads(3)
    assert await tier.write(keys, data) == 3
    rkey = tier.redis_key(keys[1])
    good = pack_header(keys[1], FP, data[1]) + bytes(data[1])
    if damage == "garbage":
        await raw.set(rkey, b"\x80\x04garbage" * 100)
    elif damage == "truncated":
        await raw.set(rkey, good[:-1])
    elif damage == "foreign-fingerprint":
        other = hashlib.sha256(b"layout-b").digest()
        await raw.set(rkey, pack_header(keys[1], other, data[1]) + bytes(data[1]))
    elif damage == "wrong-key":
        await raw.set(rkey, pack_header(keys[2], FP, data[2]) + bytes(data[2]))
    elif damage == "flipped-payload-byte":
        bad = bytearray(good)
        bad[HEADER_SIZE + 7] ^= 1
        await raw.set(rkey, bytes(bad))
    else:
        await raw.delete(rkey)
        await raw.hset(rkey, "field", "value")

    assert await tier.lookup(keys) == 3  # EXISTS cannot tell; the read verifies
    outs = make_outs(3)
    assert await tier.read_into(keys, outs) == 1
    assert bytes(outs[0]) == bytes(data[0])
    stats = tier.stats()
    assert (stats.corrupt, stats.read_blocks, stats.health) == (1, 1, TierHealth.UP)
    assert await raw.exists(rkey) == 0  # dropped from the tier
    assert await tier.lookup(keys) == 1
    await tier.aclose()


@pytest.mark.asyncio
async def test_other_layouts_use_other_keys(redis_server: Any, namespace: str) -> None:
    a = await open_tier(redis_server.url, namespace)
    b = await open_tier(
        redis_server.url, namespace, spec=make_spec(fingerprint=hashlib.sha256(b"b").digest())
    )
    keys = make_keys(2)
    assert await a.write(keys, make_payloads(2)) == 2
    assert await b.lookup(keys) == 0
    assert await b.read_into(keys, make_outs(2)) == 0
    await a.aclose()
    await b.aclose()


_WRITER = """
import asyncio, hashlib, random, sys
from aiokv.tiers._base import TierSpec
from aiokv.tiers.redis import RedisTier

async def main():
    tier = RedisTier(sys.argv[1], namespace=sys.argv[2])
    await tier.open(TierSpec(4096, hashlib.sha256(b"layout-a").digest(), 16, "test layout"))
    rng = random.Random(42)
    keys = [hashlib.sha256(f"shared-{i}".encode()).digest() for i in range(12)]
    data = [memoryview(bytearray(rng.randbytes(4096))) for _ in range(12)]
    print(await tier.write(keys, data), tier.stats().health.value)
    await tier.aclose()

asyncio.run(main())
"""


@pytest.mark.asyncio
async def test_two_processes_share_one_server(redis_server: Any, namespace: str, run_py: RunPy) -> None:
    """Process A stores blocks; process B (this one) finds and reads them byte-identical."""
    result = await asyncio.to_thread(run_py, _WRITER, redis_server.url, namespace)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["12", "up"]
    rng = random.Random(42)
    expected = [rng.randbytes(4096) for _ in range(12)]
    keys = make_keys(12, "shared")
    tier = await open_tier(redis_server.url, namespace)
    assert await tier.lookup(keys) == 12
    outs = make_outs(12)
    assert await tier.read_into(keys, outs) == 12
    assert [bytes(o) for o in outs] == expected
    await tier.aclose()


@pytest.mark.asyncio
async def test_killed_server_degrades_within_the_timeout_and_recovers(own_redis_server: Any) -> None:
    """The server is SIGKILLed in the middle of a workload and restarted later on the same port."""
    clock = FakeClock()
    timeout_s = 0.5
    tier = await open_tier(
        own_redis_server.url, "outage", timeout_s=timeout_s, failures_to_down=2, backoff_s=5, clock=clock
    )
    keys, data = make_keys(30), make_payloads(30)
    slowest = 0.0
    for i in range(30):
        if i == 10:
            own_redis_server.kill()
        if i == 20:
            own_redis_server.start()
            assert tier.stats().health == TierHealth.DOWN
            clock.now += 5  # the backoff interval passes: the next call probes the restarted server
        began = time.monotonic()
        stored, hits, read = await asyncio.gather(
            tier.write(keys[i : i + 1], data[i : i + 1]),
            tier.lookup(keys[max(0, i - 1) : i]),
            tier.read_into(keys[max(0, i - 1) : i], make_outs(min(i, 1))),
        )
        slowest = max(slowest, time.monotonic() - began)
        if i < 10:
            assert stored == 1
            assert hits == read == min(i, 1)
        elif i < 20:
            assert (stored, hits, read) == (0, 0, 0)
            if i >= 11:
                assert tier.stats().health == TierHealth.DOWN
        elif i >= 22:  # after the probe, entries written since the restart are found again
            assert (stored, hits, read) == (1, 1, 1), (i, tier.stats())
    assert slowest < timeout_s + 0.25
    stats = tier.stats()
    assert stats.health == TierHealth.UP
    assert stats.reconnects == 1
    assert stats.errors >= 2
    assert stats.skipped > 0  # calls answered locally while down
    assert stats.dropped >= 10
    assert stats.last_error is not None
    outs = make_outs(8)
    assert await tier.read_into(keys[22:], outs) == 8
    assert [bytes(o) for o in outs] == [bytes(d) for d in data[22:]]
    await tier.aclose()


@pytest.mark.asyncio
async def test_down_server_is_probed_with_growing_backoff(closed_port: int) -> None:
    clock = FakeClock()
    tier = RedisTier(
        f"redis://127.0.0.1:{closed_port}/0",
        timeout_s=0.5,
        failures_to_down=1,
        backoff_s=1,
        backoff_max_s=4,
        clock=clock,
    )
    await tier.open(make_spec())  # nobody listens: never raises
    stats = tier.stats()
    assert (stats.health, stats.errors, stats.backoff_s) == (TierHealth.DOWN, 1, 1)
    keys = make_keys(1)
    assert await tier.lookup(keys) == 0
    assert tier.stats().skipped == 1  # not even tried
    expected_backoff = [2, 4, 4]
    for backoff in expected_backoff:
        clock.now += 10
        assert await tier.lookup(keys) == 0
        assert tier.stats().backoff_s == backoff
    assert tier.stats().errors == 1 + len(expected_backoff)
    await tier.aclose()


@pytest.mark.asyncio
async def test_hung_server_calls_return_within_the_timeout(own_redis_server: Any) -> None:
    timeout_s = 0.3
    tier = await open_tier(own_redis_server.url, "hung", timeout_s=timeout_s, failures_to_down=3)
    keys, data = make_keys(2), make_payloads(2)
    assert await tier.write(keys, data) == 2
    own_redis_server.pause()
    try:
        began = time.monotonic()
        results = await asyncio.gather(tier.lookup(keys), tier.read_into(keys, make_outs(2)))
        elapsed = time.monotonic() - began
    finally:
        own_redis_server.resume()
    assert results == [0, 0]
    assert elapsed < timeout_s + 0.25
    stats = tier.stats()
    assert stats.timeouts == 2
    assert stats.health == TierHealth.DEGRADED
    assert await tier.lookup(keys) == 2
    assert tier.stats().health == TierHealth.UP
    await tier.aclose()


@pytest.mark.asyncio
async def test_cluster_mode_against_a_plain_server_degrades_without_raising(redis_server: Any) -> None:
    """Only construction and failure handling of cluster mode can be tested here (no cluster available)."""
    tier = RedisTier(redis_server.url, namespace="cluster", cluster=True, timeout_s=0.5, failures_to_down=1)
    await tier.open(make_spec())
    assert tier.stats().health == TierHealth.DOWN
    assert "cluster" in (tier.stats().last_error or "").lower()
    assert await tier.write(make_keys(1), make_payloads(1)) == 0
    assert await tier.lookup(make_keys(1)) == 0
    await tier.aclose()


@pytest.mark.asyncio
async def test_tls_and_auth_options_reach_the_connection(closed_port: int) -> None:
    tier = RedisTier(
        f"redis://user:secret@127.0.0.1:{closed_port}/0",
        ssl=True,
        ssl_options={"ssl_cert_reqs": "none", "ssl_check_hostname": False},
        timeout_s=0.5,
    )
    assert tier.url.startswith("rediss://")
    assert "secret" not in repr(tier)
    await tier.open(make_spec())
    client = tier._client
    assert isinstance(client, aioredis.Redis)
    pool = client.connection_pool
    assert pool.connection_class is SSLConnection
    assert pool.connection_kwargs["username"] == "user"
    assert pool.connection_kwargs["password"] == "secret"
    assert pool.connection_kwargs["ssl_cert_reqs"] == "none"
    stats = tier.stats()
    assert stats.health != TierHealth.UP
    assert "secret" not in stats.url
    await tier.aclose()


@pytest.mark.asyncio
async def test_refused_password_raises_at_open_and_closes_the_tier(own_redis_server: Any) -> None:
    """Wrong credentials are a configuration error: open() raises (the engine does not start as if the cache
    were merely down); the right ones work."""
    admin = aioredis.Redis.from_url(own_redis_server.url)
    await admin.config_set("requirepass", "s3cret")
    await admin.aclose()
    wrong = RedisTier(own_redis_server.url, namespace="auth", password="nope", failures_to_down=1)
    with pytest.raises(
        InvalidArgumentError, match=r"password or username refused by redis tier .*WRONGPASS|invalid"
    ):
        await wrong.open(make_spec())
    assert "closed" in repr(wrong)
    assert "nope" not in repr(wrong)
    missing = RedisTier(own_redis_server.url, namespace="auth")
    with pytest.raises(InvalidArgumentError, match="password or username refused"):
        await missing.open(make_spec())
    right = await open_tier(own_redis_server.url, "auth", password="s3cret")
    assert await right.write(make_keys(1), make_payloads(1)) == 1
    assert right.stats().health == TierHealth.UP
    await right.aclose()


def test_bad_arguments_are_rejected() -> None:
    with pytest.raises(InvalidArgumentError, match="url must be a redis://, rediss:// or unix:// url"):
        RedisTier("http://localhost")
    with pytest.raises(InvalidArgumentError, match="timeout_s must be > 0, got 0"):
        RedisTier(timeout_s=0)
    with pytest.raises(InvalidArgumentError, match="namespace must be a non-empty str"):
        RedisTier(namespace="")
    with pytest.raises(TypeError, match="max_connections must be an int, got float"):
        RedisTier(max_connections=1.5)  # type: ignore[arg-type]


@pytest.mark.asyncio
async def test_wrong_buffer_sizes_are_rejected(redis_server: Any, namespace: str) -> None:
    tier = await open_tier(redis_server.url, namespace)
    with pytest.raises(
        InvalidArgumentError, match=r"payloads\[0\] must be payload_bytes=4096 bytes long, got 3"
    ):
        await tier.write(make_keys(1), [memoryview(bytearray(3))])
    await tier.aclose()


def test_breaker_counts_only_the_probe_against_the_backoff() -> None:
    """Calls already in flight when the server is declared down must not push the next probe further out."""
    from aiokv.tiers._redis import _Breaker

    clock = FakeClock()
    breaker = _Breaker(failures_to_down=2, backoff_s=1, backoff_max_s=8, clock=clock)
    assert breaker.allow() is False
    breaker.failure(probe=False)
    assert breaker.state == TierHealth.DEGRADED
    breaker.failure(probe=False)
    assert breaker.state == TierHealth.DOWN
    breaker.failure(probe=False)  # a straggler
    assert (breaker.backoff, breaker.retry_at) == (1, clock.now + 1)
    breaker.success(probe=False)  # a straggler's answer read after the server died: not a reconnect
    assert (breaker.state, breaker.reconnects) == (TierHealth.DOWN, 0)
    assert breaker.allow() is None
    clock.now += 1
    assert breaker.allow() is True  # the probe
    assert breaker.allow() is None  # only one at a time
    breaker.abandoned(probe=True)  # cancelled: the next call may probe
    assert breaker.allow() is True
    breaker.failure(probe=True)
    assert (breaker.backoff, breaker.retry_at) == (2, clock.now + 2)
    clock.now += 2
    assert breaker.allow() is True
    breaker.success(probe=True)
    assert (breaker.state, breaker.backoff, breaker.reconnects, breaker.failures) == (TierHealth.UP, 1, 1, 0)


class ScriptedPipeline:
    """A redis-py pipeline stand-in whose execute() returns the next scripted list of replies."""

    def __init__(self, client: ScriptedClient) -> None:
        self.client = client
        self.commands: list[tuple[str, bytes]] = []

    def __getattr__(self, name: str) -> Any:
        def queue(key: bytes, *args: Any, **kwargs: Any) -> None:
            self.commands.append((name, key))

        return queue

    def execute_command(self, name: str, key: bytes, *args: Any, **kwargs: Any) -> None:
        self.commands.append((name.lower(), key))

    async def execute(self, raise_on_error: bool = True) -> list[Any]:
        self.client.sent.append(self.commands)
        return self.client.replies.pop(0)


class ScriptedClient:
    def __init__(self, *replies: list[Any]) -> None:
        self.replies = list(replies)
        self.sent: list[list[tuple[str, bytes]]] = []

    def pipeline(self, transaction: bool = False) -> ScriptedPipeline:
        return ScriptedPipeline(self)


async def scripted(
    redis_server: Any, namespace: str, *replies: list[Any]
) -> tuple[RedisTier, ScriptedClient]:
    tier = await open_tier(redis_server.url, namespace, failures_to_down=10)
    await tier._client.aclose()  # type: ignore[union-attr]
    fake = ScriptedClient(*replies)
    tier._client = fake  # type: ignore[assignment]
    return tier, fake


@pytest.mark.asyncio
async def test_error_replies_in_a_pipeline_are_not_stored_nor_corrupt(
    redis_server: Any, namespace: str
) -> None:
    """Regression: a pipeline whose node failed part way returns exception objects among the replies. They
    must count as failed round trips -- not as stored blocks, and not as corrupt values to delete."""
    from redis.exceptions import ClusterDownError
    from redis.exceptions import ConnectionError as RedisConnectionError

    keys, data = make_keys(2), make_payloads(2)
    good = pack_header(keys[0], FP, data[0]) + bytes(data[0])
    tier, fake = await scripted(
        redis_server,
        namespace,
        [True, RedisConnectionError("Connection reset by peer")],
        [good, ClusterDownError("CLUSTERDOWN The cluster is down")],
        [1, RedisConnectionError("Connection reset by peer")],
    )
    assert await tier.write(keys, data) == 1
    outs = make_outs(2)
    assert await tier.read_into(keys, outs) == 1
    assert bytes(outs[0]) == bytes(data[0])
    assert await tier.lookup(keys) == 1
    stats = tier.stats()
    assert (stats.stored_blocks, stats.dropped, stats.corrupt, stats.errors) == (1, 1, 0, 3)
    assert (stats.health, stats.consecutive_failures) == (TierHealth.DEGRADED, 3)
    assert [name for batch in fake.sent for name, _ in batch] == [
        "set",
        "set",
        "get",
        "get",
        "exists",
        "exists",
    ]
    await tier.aclose()


@pytest.mark.asyncio
async def test_refusals_of_one_value_leave_the_tier_up(redis_server: Any, namespace: str) -> None:
    """OOM (maxmemory-policy noeviction) refuses one value: counted as rejected, the server is healthy;
    WRONGTYPE is a foreign value under our key: corrupt, deleted."""
    from redis.exceptions import OutOfMemoryError, ResponseError

    keys, data = make_keys(2), make_payloads(2)
    good = pack_header(keys[0], FP, data[0]) + bytes(data[0])
    tier, fake = await scripted(
        redis_server,
        namespace,
        [True, OutOfMemoryError("OOM command not allowed when used memory > 'maxmemory'.")],
        [good, ResponseError("WRONGTYPE Operation against a key holding the wrong kind of value")],
        [1],
    )
    assert await tier.write(keys, data) == 1
    assert await tier.read_into(keys, make_outs(2)) == 1
    stats = tier.stats()
    assert (stats.stored_blocks, stats.rejected, stats.corrupt, stats.errors, stats.health) == (
        1,
        1,
        1,
        0,
        TierHealth.UP,
    )
    assert fake.sent[-1] == [("del", tier.redis_key(keys[1]))]
    await tier.aclose()
