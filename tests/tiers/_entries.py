"""Keys, payloads and specs shared by the disk and Redis tier tests."""

from __future__ import annotations

import hashlib
import random
import subprocess
from collections.abc import Callable

from aiokv.tiers._base import TierSpec

FP = hashlib.sha256(b"layout-a").digest()
RunPy = Callable[..., subprocess.CompletedProcess[str]]


def spec(payload_bytes: int, fingerprint: bytes = FP) -> TierSpec:
    return TierSpec(payload_bytes, fingerprint, 16, "test layout")


def keys(n: int, tag: str = "a") -> list[bytes]:
    return [hashlib.sha256(f"{tag}-{i}".encode()).digest() for i in range(n)]


def payloads(n: int, payload_bytes: int, seed: int = 0) -> list[memoryview]:
    rng = random.Random(seed)
    return [memoryview(bytearray(rng.randbytes(payload_bytes))) for _ in range(n)]


def outs(n: int, payload_bytes: int) -> list[memoryview]:
    return [memoryview(bytearray(payload_bytes)) for _ in range(n)]
