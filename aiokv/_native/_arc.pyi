from collections.abc import Sequence
from typing import Any

def touch_prefix(index: Any, policy: Any, keys: Sequence[bytes], start: int, /) -> int | None: ...
def insert_chain(
    index: Any, policy: Any, keys: Sequence[bytes], start: int, /
) -> tuple[int, int, int] | None: ...
