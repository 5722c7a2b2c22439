import numpy as np
import numpy.typing as npt

def copy_segments(
    dst_addrs: npt.NDArray[np.int64],
    src_addrs: npt.NDArray[np.int64],
    nbytes: npt.NDArray[np.int64],
    group: int = 1,
    chunk: int = 512,
    /,
) -> None: ...
