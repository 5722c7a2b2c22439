from collections.abc import Callable, Sequence
from typing import Any

MAX_UNIQUE: int  # 2**31 - 1: the most unique keys intern numbers (ids are int32)

def intern(requests: Sequence[Any], max_unique: int = ..., /) -> tuple[bytes, bytes, bytes, int] | None: ...
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
