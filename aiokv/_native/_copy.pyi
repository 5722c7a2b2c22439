from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

Buffer = Any  # an object with the buffer protocol (collections.abc.Buffer from Python 3.12)

# dst/src: a buffer or a sequence of buffers (dst's writable); *_index: which buffer each segment is in (None:
# buffer 0); *_offsets: byte offsets in it. Every (offset, nbytes) is checked against its buffer's length
# before any byte is copied (ValueError naming the argument).

def copy_segments(
    dst: Buffer | Sequence[Buffer],
    dst_index: npt.NDArray[np.int64] | None,
    dst_offsets: npt.NDArray[np.int64],
    src: Buffer | Sequence[Buffer],
    src_index: npt.NDArray[np.int64] | None,
    src_offsets: npt.NDArray[np.int64],
    nbytes: npt.NDArray[np.int64],
    group: int = 1,
    chunk: int = 512,
    stream: int = -1,
) -> None: ...

class CopyJob:
    def __new__(
        cls,
        dst: Buffer | Sequence[Buffer],
        dst_index: npt.NDArray[np.int64] | None,
        dst_offsets: npt.NDArray[np.int64],
        src: Buffer | Sequence[Buffer],
        src_index: npt.NDArray[np.int64] | None,
        src_offsets: npt.NDArray[np.int64],
        nbytes: npt.NDArray[np.int64],
        group: int = 1,
        chunk: int = 512,
        part_bytes: int = 1048576,
    ) -> CopyJob: ...
    @property
    def parts(self) -> int: ...
    @property
    def nbytes(self) -> int: ...
    @property
    def done(self) -> bool: ...
    def run(self) -> int: ...
    def wait(self) -> None: ...

# KVLayout.copy_plan of the pairs (slot_ids[i], block_ids[i]) sorted by (slot, block): for pair i and segment j,
# engine bases[j] + block * strides[j] (bases relative to engine buffer seg_buf[j]; seg_buf None: buffer 0),
# host host_base + slot * slot_bytes + offs[j], length lens[j]. Results are int64 bytearrays (engine offsets,
# host offsets, lengths, engine buffer index or None) and the number of pairs.
def plan_blocks(
    block_ids: Sequence[int],  # a list or tuple (anything else is a TypeError)
    slot_ids: Sequence[int],
    bases: npt.NDArray[np.int64],
    strides: npt.NDArray[np.int64],
    lens: npt.NDArray[np.int64],
    offs: npt.NDArray[np.int64],
    slot_bytes: int,
    host_base: int,
    seg_buf: npt.NDArray[np.int64] | None,
) -> tuple[bytearray, bytearray, bytearray, bytearray | None, int]: ...
