from typing import Any

Buffer = Any  # an object with the buffer protocol (collections.abc.Buffer from Python 3.12)

PLAN_FIELDS: int
KIND_FP8: int
KIND_INT8: int

# plan: int64 records (aiokv.tiers._codec.Codec._plan); kind: KIND_FP8 or KIND_INT8. Returns 0, or 1 when a
# value is not finite (encode) / a scale is not finite and positive (decode). ValueError when the plan does
# not fit the buffers (checked before any byte is read).
def encode(plan: Buffer, slot: Buffer, dst: Buffer, kind: int, /) -> int: ...
def decode(plan: Buffer, src: Buffer, slot: Buffer, kind: int, /) -> int: ...
