from array import array
from collections import OrderedDict
from collections.abc import Sequence

def touch_prefix(
    keys: Sequence[bytes],
    start: int,
    slots: dict[bytes, int],
    state: bytearray,
    order: OrderedDict[bytes, bytes | None],
    run: dict[bytes, None],
    last: bytes | None,
    /,
) -> tuple[int, bytes | None]: ...
def insert_chain(
    keys: Sequence[bytes],
    start: int,
    slots: dict[bytes, int],
    state: bytearray,
    free: array[int],
    key_of: list[bytes | None],
    parent_of: list[bytes | None],
    depth_of: array[int],
    on_evict: list[bytes] | None,
    order: OrderedDict[bytes, bytes | None],
    run: dict[bytes, None],
    last: bytes | None,
    /,
) -> tuple[int, int, int, bytes | None]: ...
def first_not_pending(
    keys: list[bytes] | tuple[bytes, ...], slots: dict[bytes, int], state: bytearray, /
) -> int: ...
