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
