"""The disk and Redis tiers live in packages (``aiokv.tiers.disk``, ``aiokv.tiers.redis``): the old module
paths (``aiokv.tiers._disk``, ``aiokv.tiers._redis``) still give the very same objects, settings are not
copied there (a patch of a copy would change nothing), and the package named ``redis`` never shadows
redis-py."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import aiokv
import aiokv.tiers
from aiokv.tiers import _disk, _redis, disk, redis
from aiokv.tiers._health import Breaker
from aiokv.tiers.disk import _files, _tier


def test_the_old_disk_module_reexports_the_package_objects() -> None:
    assert _disk.DiskTier is disk.DiskTier is _tier.DiskTier is aiokv.DiskTier is aiokv.tiers.DiskTier
    assert _disk.DiskTierStats is disk.DiskTierStats is _tier.DiskTierStats is aiokv.tiers.DiskTierStats
    assert (_disk.LOCK_NAME, _disk.META_NAME, _disk.CATALOG_NAME) == (
        _files.LOCK_NAME,
        _files.META_NAME,
        _files.CATALOG_NAME,
    )
    assert _disk._Files is _files._Files
    assert aiokv.tiers.SharedMemoryTier.__mro__[1] is disk.DiskTier
    for setting in ("_SPLIT_BYTES", "_REOPEN_BACKOFF_S", "_RESERVE_LOCK_S", "_COMMIT_LOCK_S"):
        assert hasattr(_tier, setting)
        assert not hasattr(_disk, setting), f"{setting}: patch it in aiokv.tiers.disk._tier"


def test_the_old_redis_module_reexports_the_package_objects() -> None:
    assert _redis.RedisTier is redis.RedisTier is aiokv.RedisTier is aiokv.tiers.RedisTier
    assert _redis.RedisTierStats is redis.RedisTierStats is aiokv.tiers.RedisTierStats
    assert _redis._Breaker is Breaker


def test_the_redis_package_does_not_shadow_redis_py(tmp_path: Path) -> None:
    pytest.importorskip("redis")
    code = (
        "import aiokv.tiers.redis, redis, redis.asyncio, redis.exceptions\n"
        "from aiokv.tiers.redis import _connection, _replies, _tier\n"
        "assert redis.__name__ == 'redis' and 'aiokv' not in redis.__file__, redis.__file__\n"
        "assert _tier.Redis is redis.asyncio.Redis and _connection.Redis is redis.asyncio.Redis\n"
        "assert _replies.ResponseError is redis.exceptions.ResponseError\n"
        "assert _tier._IMPORT_ERROR is None\n"
        "print(redis.asyncio.__file__)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, check=True, capture_output=True, text=True, timeout=60
    )
    package_dir = Path(aiokv.__file__).resolve().parent
    assert package_dir not in Path(out.stdout.strip()).resolve().parents, out.stdout
