from collections.abc import Callable, Sequence
from typing import Any

def intern(requests: Sequence[Any], /) -> tuple[bytes, bytes, bytes, int]: ...
def run(
    ids: bytes,
    offsets: bytes,
    limits: bytes,
    unique: int,
    block_tokens: int,
    tiers: Sequence[tuple[int, tuple[Any, ...]]],
    inflight: int,
    progress: Callable[[int], object] | None,
    /,
) -> tuple[list[tuple[int, int, int, int, int, int]], int]: ...
