"""A host-memory tier shared by every engine process of one machine: a shared DiskTier in ``/dev/shm``.

Engines that run one process per GPU (or ``uvicorn --workers N``) each have their own CPUTier, so a prefix
used by all of them would be cached N times and a conversation that moves to another process would miss. A
:class:`SharedMemoryTier` placed after the CPU tier holds one copy per machine: its segment files live in a
memory filesystem (tmpfs), every process maps the same catalog, and a block stored by one process is staged
by the others with one memcpy (``preadv`` from the page cache) and the usual verification. Everything else --
set-associative LRU across processes, reclaiming slots of writers that died, never serving a torn entry -- is
the shared DiskTier's (see :mod:`aiokv.tiers.disk` and :mod:`aiokv.tiers._catalog`).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from .._errors import InvalidArgumentError, InvalidTypeError
from .disk import DiskTier

__all__ = ["SharedMemoryTier"]

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


class SharedMemoryTier(DiskTier):
    """Host-memory tier shared by the processes of one machine that use the same ``name`` (and layout).

    ``capacity_bytes`` of ``directory`` (a tmpfs, ``/dev/shm`` by default) is reserved at open, as
    ``directory/aiokv-{name}``; it outlives the processes (a restarted engine finds the cache warm) until it is
    deleted or the machine reboots. Where the memory filesystem is too small (containers mount a 64 MiB
    ``/dev/shm`` unless told otherwise: ``--shm-size``, ``--ipc=host``) the tier starts degraded and logs it,
    like a full disk. Stats are :class:`~aiokv.tiers.DiskTierStats` (``shared`` is true).
    """

    name = "shm"

    def __init__(
        self,
        name: str,
        capacity_bytes: int,
        *,
        directory: str | os.PathLike[str] = "/dev/shm",
        io_threads: int = 2,
        segment_bytes: int = 256 << 20,
    ) -> None:
        if not isinstance(name, str):
            raise InvalidTypeError(f"name must be a str, got {type(name).__name__}")
        if not _NAME.fullmatch(name):
            raise InvalidArgumentError(
                f"name must be 1-64 letters, digits, '.', '_' or '-' (not starting with one of the last "
                f"three), got {name!r}"
            )
        if not isinstance(directory, (str, os.PathLike)):
            raise InvalidTypeError(f"directory must be a str or os.PathLike, got {type(directory).__name__}")
        super().__init__(
            Path(directory) / f"aiokv-{name}",
            capacity_bytes,
            segment_bytes=segment_bytes,
            io_threads=io_threads,
            preallocate=True,
            fsync=False,
            shared=True,
        )
        self.shm_name = name
