"""RedisTier against servers whose values are capped (``proto-max-bulk-len 1mb``, the smallest allowed): blocks
are split into parts the server accepts, or refused at open with a message that says what to set."""

from __future__ import annotations

from typing import Any

import pytest

from aiokv._errors import InvalidArgumentError
from aiokv.tiers._format import HEADER_SIZE, TierHealth
from aiokv.tiers.redis import RedisTier

from . import _entries as entries
from ._servers import ADMIN_PASSWORD, Binary, Security, ServerProcess

MiB = 1 << 20
PB = 3 * MiB - 100  # entries of 3 MiB + 28 bytes: four values of at most 1 MiB
LIMITED = {"proto-max-bulk-len": "1mb"}
NO_CONFIG = Security(users=["app on >app-pw ~* +@all -config"])


@pytest.fixture
def limited(make_server: Any, server_binary: Binary) -> ServerProcess:
    """A server refusing values over 1 MiB, with a user `app` that may do anything but CONFIG."""
    server: ServerProcess = make_server(server_binary, config=LIMITED, security=NO_CONFIG)
    return server


async def open_tier(server: ServerProcess, **kw: Any) -> RedisTier:
    tier = RedisTier(server.url, namespace="big", timeout_s=5.0, **kw)
    await tier.open(entries.spec(PB))
    return tier


@pytest.mark.asyncio
async def test_blocks_over_the_server_limit_are_split_and_read_back(limited: ServerProcess) -> None:
    tier = await open_tier(limited, username="default", password=ADMIN_PASSWORD)
    stats = tier.stats()
    assert (stats.server_max_value_bytes, stats.max_value_bytes, stats.parts_per_block) == (MiB, MiB, 4)
    keys, data = entries.keys(3), entries.payloads(3, PB)
    assert await tier.write(keys, data) == 3
    raw = limited.admin()
    parts = tier.redis_keys(keys[0])
    assert [raw.strlen(k) for k in parts] == [MiB, MiB, MiB, HEADER_SIZE + PB - 3 * MiB]
    assert await tier.lookup(keys) == 3
    outs = entries.outs(3, PB)
    assert await tier.read_into(keys, outs) == 3
    assert [bytes(o) for o in outs] == [bytes(d) for d in data]
    assert (tier.stats().errors, tier.stats().corrupt) == (0, 0)
    await tier.aclose()


@pytest.mark.asyncio
async def test_a_lost_part_is_a_miss_and_a_damaged_part_is_corrupt(limited: ServerProcess) -> None:
    tier = await open_tier(limited, username="default", password=ADMIN_PASSWORD)
    keys, data = entries.keys(3), entries.payloads(3, PB)
    assert await tier.write(keys, data) == 3
    raw = limited.admin()
    raw.delete(tier.redis_keys(keys[2])[3])  # evicted by the server, say
    assert await tier.lookup(keys) == 2
    assert await tier.read_into(keys, entries.outs(3, PB)) == 2
    assert tier.stats().corrupt == 0
    raw.setrange(tier.redis_keys(keys[1])[2], 1000, b"\x00\x01")
    outs = entries.outs(3, PB)
    assert await tier.read_into(keys, outs) == 1
    assert bytes(outs[0]) == bytes(data[0])
    assert tier.stats().corrupt == 1
    assert sum(raw.exists(k) for k in tier.redis_keys(keys[1])) == 0  # every part deleted
    await tier.aclose()


@pytest.mark.asyncio
async def test_processes_with_another_part_size_use_other_keys(limited: ServerProcess) -> None:
    """A tier configured with another max_value_bytes never reads, counts or deletes the others' parts."""
    full = await open_tier(limited, username="default", password=ADMIN_PASSWORD)
    small = await open_tier(limited, username="default", password=ADMIN_PASSWORD, max_value_bytes=MiB // 2)
    assert small.stats().parts_per_block == 7
    keys, data = entries.keys(2), entries.payloads(2, PB)
    assert await full.write(keys, data) == 2
    assert await small.lookup(keys) == 0
    assert await small.read_into(keys, entries.outs(2, PB)) == 0
    assert small.stats().corrupt == 0
    assert await full.read_into(keys, entries.outs(2, PB)) == 2
    await small.aclose()
    await full.aclose()


@pytest.mark.asyncio
async def test_unreadable_limit_and_too_large_values_refuse_at_open(limited: ServerProcess) -> None:
    """The user may not run CONFIG GET, so the tier cannot read the limit: it sends one value as large as its
    largest; the server drops it, and open() says to set max_value_bytes. With it set, blocks are split."""
    tier = RedisTier(limited.url, namespace="big", username="app", password="app-pw", timeout_s=5.0)
    with pytest.raises(
        InvalidArgumentError, match=r"max_value_bytes must not exceed the server's proto-max-bulk-len"
    ):
        await tier.open(entries.spec(PB))
    raw = limited.admin()
    assert raw.exists(b"big:" + entries.FP[:8].hex().encode() + b":aiokv-permission-probe") == 0
    tier = await open_tier(limited, username="app", password="app-pw", max_value_bytes=MiB)
    stats = tier.stats()
    assert (stats.server_max_value_bytes, stats.parts_per_block, stats.health) == (None, 4, TierHealth.UP)
    keys, data = entries.keys(2), entries.payloads(2, PB)
    assert await tier.write(keys, data) == 2
    outs = entries.outs(2, PB)
    assert await tier.read_into(keys, outs) == 2
    assert [bytes(o) for o in outs] == [bytes(d) for d in data]
    await tier.aclose()


def test_max_value_bytes_is_checked() -> None:
    with pytest.raises(InvalidArgumentError, match="max_value_bytes must be >= 4096, got 100"):
        RedisTier(max_value_bytes=100)
    with pytest.raises(TypeError, match="max_value_bytes must be an int, got float"):
        RedisTier(max_value_bytes=1.5)  # type: ignore[arg-type]
