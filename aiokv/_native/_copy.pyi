import numpy as np
import numpy.typing as npt

def copy_segments(
    dst_addrs: npt.NDArray[np.int64],
    src_addrs: npt.NDArray[np.int64],
    nbytes: npt.NDArray[np.int64],
    group: int = 1,
    chunk: int = 512,
    stream: int = -1,
    /,
) -> None: ...

class CopyJob:
    def __new__(
        cls,
        dst_addrs: npt.NDArray[np.int64],
        src_addrs: npt.NDArray[np.int64],
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
