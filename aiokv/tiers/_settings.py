"""The ``--tiers`` setting: text such as ``cpu=64GiB,disk=/var/cache/aiokv:1TiB,redis=redis://host:6379/0``
parsed into :class:`TierSetting` records that build the tiers, for every front end that takes it (``aiokv
serve``, the vLLM connector's ``tiers`` option, your own). One grammar of sizes (:mod:`aiokv._units`).

Standard library only at import time (the tier classes are imported by :meth:`TierSetting.build`).
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from .._errors import InvalidArgumentError
from .._log import get_logger
from .._units import format_size, parse_assignments, parse_size

if TYPE_CHECKING:
    from ._base import BackingTier
    from ._cpu import CPUTier

__all__ = ["TIER_KINDS", "TierSetting", "check_tier_paths", "parse_tiers"]

_log = get_logger("tiers")

TIER_KINDS = ("cpu", "disk", "shm", "redis", "redis-cluster")
_SHM_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")

_URL_SCHEMES = ("redis://", "rediss://", "unix://", "valkey://", "valkeys://")
_ENCODING_SUFFIX = re.compile(r"^(?P<rest>.*):encoding=(?P<encoding>[^:]*)$")


@dataclass(frozen=True, slots=True)
class TierSetting:
    """One parsed entry of ``--tiers``: ``cpu=SIZE``, ``disk=PATH:SIZE``, ``shm=NAME:SIZE``, ``redis=URL`` or
    ``redis-cluster=URL`` (a ``valkey://`` / ``valkeys://`` URL is the same as ``redis://`` / ``rediss://``);
    a disk or Redis entry may end in ``:encoding=NAME`` (``DiskTier(encoding=...)``)."""

    kind: str
    capacity_bytes: int | None = None
    path: str | None = None
    url: str | None = None
    encoding: str = "raw"

    def build(self) -> CPUTier | BackingTier:
        """The real tier object (not opened)."""
        from . import CPUTier, DiskTier, RedisTier, SharedMemoryTier

        if self.kind == "cpu":
            assert self.capacity_bytes is not None
            return CPUTier(capacity_bytes=self.capacity_bytes)
        if self.kind in ("disk", "shm"):
            assert self.path is not None
            assert self.capacity_bytes is not None
            if self.kind == "shm":
                return SharedMemoryTier(self.path, self.capacity_bytes)
            path = Path(self.path)
            if not path.exists():  # allowed by check_tier_paths(create_dirs=True)
                try:
                    path.mkdir(parents=True)
                    _log.info("created the disk tier directory %s", path)
                except OSError:
                    pass  # DiskTier.open retries and explains the failure
            return DiskTier(path, self.capacity_bytes, encoding=self.encoding)
        assert self.url is not None
        return RedisTier(self.url, cluster=self.kind == "redis-cluster", encoding=self.encoding)

    def describe(self) -> str:
        suffix = "" if self.encoding == "raw" else f":encoding={self.encoding}"
        if self.kind == "cpu":
            return f"cpu={format_size(self.capacity_bytes or 0)}"
        if self.kind in ("disk", "shm"):
            return f"{self.kind}={self.path}:{format_size(self.capacity_bytes or 0)}{suffix}"
        return f"{self.kind}={_redact(self.url or '')}{suffix}"


def _redact(url: str) -> str:
    scheme, sep, rest = url.partition("://")
    _creds, at, host = rest.rpartition("@")
    return f"{scheme}{sep}***@{host}" if sep and at else url


def parse_tiers(text: str) -> tuple[TierSetting, ...]:
    """``cpu=1GiB,disk=/var/cache/aiokv:20GiB,redis=redis://host:6379/0`` -> tier specs, fastest first.

    The CPU tier comes first and is required; a disk (``disk=PATH:SIZE``), a shared-memory
    (``shm=NAME:SIZE``, see :class:`~aiokv.tiers.SharedMemoryTier`) and a Redis/Valkey tier (``redis=URL``,
    or ``redis-cluster=URL`` for a Redis Cluster) may follow, each kind at most once. Sizes are in bytes, in
    the grammar of :func:`aiokv.replay.parse_size` (``64GiB``, ``500MB``, plain bytes; ``64Gb`` is refused as
    ambiguous). A disk or Redis entry may end in ``:encoding=NAME``, how that tier stores blocks (``raw``, the
    default; ``fp8`` or ``int8``, lossy: see docs/tiers.md), e.g. ``disk=/var/cache/aiokv:1TiB:encoding=fp8``.
    Only the text is checked here: :func:`check_tier_paths` checks the disk tier's directory."""
    specs: list[TierSetting] = []
    seen: set[str] = set()
    for i, (name, value) in enumerate(parse_assignments(text, "tiers")):
        if name not in TIER_KINDS:
            raise InvalidArgumentError(
                f"tiers must name cpu, disk, shm, redis or redis-cluster, got {name!r} in {text!r}"
            )
        if (name == "cpu") != (i == 0):
            raise InvalidArgumentError(f"tiers must start with cpu=SIZE (and name it once), got {text!r}")
        family = "redis" if name.startswith("redis") else name
        if family in seen:
            raise InvalidArgumentError(f"tiers must name each kind of tier at most once, got {text!r}")
        seen.add(family)
        encoding = "raw"
        suffix = _ENCODING_SUFFIX.match(value)
        if suffix is not None:
            if name in ("cpu", "shm"):
                raise InvalidArgumentError(
                    f"encoding applies to the disk and redis tiers only (the {name} tier holds the engine's "
                    f"bytes), got {name}={value!r}"
                )
            from ._codec import check_encoding  # torch: only when an encoding is asked for

            value, encoding = suffix["rest"], check_encoding(suffix["encoding"])
        if name == "cpu":
            size = parse_size(value, what="capacity of tier 'cpu'")
            if size is None:
                raise InvalidArgumentError("capacity of tier 'cpu' must be finite: it is allocated up front")
            specs.append(TierSetting("cpu", capacity_bytes=size))
        elif name in ("disk", "shm"):
            path, sep, size_text = value.rpartition(":")
            what = "PATH" if name == "disk" else "NAME"
            if not sep or not path:
                raise InvalidArgumentError(f"{name} tier must look like {name}={what}:SIZE, got {value!r}")
            if name == "shm" and not _SHM_NAME.fullmatch(path):  # aiokv.tiers.SharedMemoryTier's rule
                raise InvalidArgumentError(
                    "shm tier NAME must be 1-64 letters, digits, '.', '_' or '-' (not starting with one of the "
                    f"last three), got {path!r}"
                )
            size = parse_size(size_text, what=f"capacity of tier {name!r}")
            if size is None:
                raise InvalidArgumentError(f"capacity of tier {name!r} must be finite, got 'inf'")
            specs.append(TierSetting(name, capacity_bytes=size, path=path, encoding=encoding))
        else:
            if not value.startswith(_URL_SCHEMES):
                raise InvalidArgumentError(
                    f"{name} tier must be a redis://, rediss://, valkey://, valkeys:// or unix:// URL, "
                    f"got {_redact(value)!r}"
                )
            if value.startswith("valkey"):  # the same protocol: redis-py speaks it under its own schemes
                value = "redis" + value[len("valkey") :]
            specs.append(TierSetting(name, url=value, encoding=encoding))
    return tuple(specs)


def check_tier_paths(specs: Sequence[TierSetting], *, create_dirs: bool, how_to_create: str) -> None:
    """Refuse a disk tier whose directory is not one: a path that is a file, or (unless ``create_dirs``) a
    directory that does not exist yet, which is most often a typo that would start a new, empty cache
    elsewhere. ``how_to_create`` says in the error how to allow that ("pass --create-dirs").
    With ``create_dirs``, :meth:`TierSetting.build` creates the directory (and its parents) and logs it."""
    for spec in specs:
        if spec.kind != "disk" or spec.path is None:
            continue
        path = Path(spec.path)
        if path.exists() and not path.is_dir():
            raise InvalidArgumentError(f"disk tier path {spec.path!r} exists and is not a directory")
        fs = next((p for p in (path, *path.parents) if p.is_dir()), None)
        if fs is not None and spec.capacity_bytes is not None:
            st = os.statvfs(fs)
            if 0 < st.f_blocks * st.f_frsize < spec.capacity_bytes:  # 0: a pseudo-filesystem, no size
                raise InvalidArgumentError(
                    f"capacity of tier 'disk' ({format_size(spec.capacity_bytes)}) is more than the filesystem "
                    f"holding {spec.path!r} ({format_size(st.f_blocks * st.f_frsize)})"
                )
        if not path.exists() and not create_dirs:
            missing = (
                "its parent directory does not exist" if not path.parent.is_dir() else "it does not exist"
            )
            raise InvalidArgumentError(
                f"disk tier directory {spec.path!r} is missing ({missing}): check the path, or "
                f"{how_to_create} to create it"
            )
