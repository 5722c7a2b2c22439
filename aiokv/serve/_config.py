"""``aiokv serve`` configuration: one frozen record, every field settable by a flag or an ``AIOKV_*``
environment variable, validated before anything is built.

Standard library only at import time: the command line reads :data:`OPTIONS` for ``--help`` without importing
torch or the web stack.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .._errors import InvalidArgumentError
from .._log import get_logger
from .._units import format_size, parse_assignments, parse_size

if TYPE_CHECKING:
    from ..engine import ModelConfig
    from ..tiers import BackingTier, CPUTier

__all__ = ["MODEL_PRESETS", "OPTIONS", "Option", "ServeConfig", "TierSpec", "check_tier_paths", "parse_tiers"]

_log = get_logger("serve")

# Keyword arguments of aiokv.engine.ModelConfig (kept as plain data: no torch import to list them).
MODEL_PRESETS: dict[str, dict[str, int]] = {
    # ~0.1M parameters, 512 B of KV per token: tests and quick tries (a step takes about a millisecond).
    "tiny": dict(
        num_layers=2,
        hidden_size=64,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        intermediate_size=128,
        vocab_size=512,
        max_position=8192,
    ),
    # ModelConfig's defaults: 4 layers, hidden 256, 3.5M parameters, 2 KiB of KV per token.
    "default": {},
}

# ModelConfig's defaults for its KV shape (float32): the pool's size is checked without importing torch; a test
# keeps these equal to ModelConfig.bytes_per_token.
_KV_SHAPE_DEFAULTS = {"num_layers": 4, "num_kv_heads": 2, "head_dim": 32}
_KV_ITEMSIZE = 4

TIER_KINDS = ("cpu", "disk", "shm", "redis", "redis-cluster")
_SHM_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


def _kv_bytes_per_token(preset: str) -> int:
    shape = {**_KV_SHAPE_DEFAULTS, **MODEL_PRESETS[preset]}
    return 2 * shape["num_layers"] * shape["num_kv_heads"] * shape["head_dim"] * _KV_ITEMSIZE


def _usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _physical_memory() -> int | None:
    """This machine's memory in bytes (``None`` where the platform does not say)."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return None


_URL_SCHEMES = ("redis://", "rediss://", "unix://", "valkey://", "valkeys://")


@dataclass(frozen=True, slots=True)
class TierSpec:
    """One parsed entry of ``--tiers``: ``cpu=SIZE``, ``disk=PATH:SIZE``, ``shm=NAME:SIZE``, ``redis=URL`` or
    ``redis-cluster=URL`` (a ``valkey://`` / ``valkeys://`` URL is the same as ``redis://`` / ``rediss://``)."""

    kind: str
    capacity_bytes: int | None = None
    path: str | None = None
    url: str | None = None

    def build(self) -> CPUTier | BackingTier:
        """The real tier object (not opened)."""
        from ..tiers import CPUTier, DiskTier, RedisTier, SharedMemoryTier

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
            return DiskTier(path, self.capacity_bytes)
        assert self.url is not None
        return RedisTier(self.url, cluster=self.kind == "redis-cluster")

    def describe(self) -> str:
        if self.kind == "cpu":
            return f"cpu={format_size(self.capacity_bytes or 0)}"
        if self.kind in ("disk", "shm"):
            return f"{self.kind}={self.path}:{format_size(self.capacity_bytes or 0)}"
        return f"{self.kind}={_redact(self.url or '')}"


def _redact(url: str) -> str:
    scheme, sep, rest = url.partition("://")
    _creds, at, host = rest.rpartition("@")
    return f"{scheme}{sep}***@{host}" if sep and at else url


def parse_tiers(text: str) -> tuple[TierSpec, ...]:
    """``cpu=1GiB,disk=/var/cache/aiokv:20GiB,redis=redis://host:6379/0`` -> tier specs, fastest first.

    The CPU tier comes first and is required; a disk (``disk=PATH:SIZE``), a shared-memory
    (``shm=NAME:SIZE``, see :class:`~aiokv.tiers.SharedMemoryTier`) and a Redis/Valkey tier (``redis=URL``,
    or ``redis-cluster=URL`` for a Redis Cluster) may follow, each kind at most once. Sizes are in bytes, in
    the grammar of :func:`aiokv.replay.parse_size` (``64GiB``, ``500MB``, plain bytes; ``64Gb`` is refused as
    ambiguous). Only the text is checked here: :func:`check_tier_paths` checks the disk tier's directory."""
    specs: list[TierSpec] = []
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
        if name == "cpu":
            size = parse_size(value, what="capacity of tier 'cpu'")
            if size is None:
                raise InvalidArgumentError("capacity of tier 'cpu' must be finite: it is allocated up front")
            specs.append(TierSpec("cpu", capacity_bytes=size))
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
            specs.append(TierSpec(name, capacity_bytes=size, path=path))
        else:
            if not value.startswith(_URL_SCHEMES):
                raise InvalidArgumentError(
                    f"{name} tier must be a redis://, rediss://, valkey://, valkeys:// or unix:// URL, "
                    f"got {_redact(value)!r}"
                )
            if value.startswith("valkey"):  # the same protocol: redis-py speaks it under its own schemes
                value = "redis" + value[len("valkey") :]
            specs.append(TierSpec(name, url=value))
    return tuple(specs)


def check_tier_paths(specs: Sequence[TierSpec], *, create_dirs: bool, how_to_create: str) -> None:
    """Refuse a disk tier whose directory is not one: a path that is a file, or (unless ``create_dirs``) a
    directory that does not exist yet, which is most often a typo that would start a new, empty cache
    elsewhere. ``how_to_create`` says in the error how to allow that ("pass --create-dirs").
    With ``create_dirs``, :meth:`TierSpec.build` creates the directory (and its parents) and logs it."""
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


# ---------------------------------------------------------------------------------------------- options
@dataclass(frozen=True, slots=True)
class Option:
    """One setting: its field in :class:`ServeConfig`, its flag and environment variable, how to read it."""

    field: str
    kind: str  # "str", "int", "float", "bool" (a flag that sets it; --no-...: clears it), "choice"
    help: str
    choices: tuple[str, ...] = ()
    flag: str | None = None  # default: --field-with-dashes

    @property
    def option(self) -> str:
        return self.flag or "--" + self.field.replace("_", "-")

    @property
    def env(self) -> str:
        return "AIOKV_" + self.option.removeprefix("--").replace("-", "_").upper()

    @property
    def negative(self) -> bool:
        """A ``--no-...`` flag: given (or its variable true), the field is False."""
        return self.option.startswith("--no-")


OPTIONS: tuple[Option, ...] = (
    Option("host", "str", "address to bind"),
    Option("port", "int", "port to bind (0: any free port, printed at start)"),
    Option("model", "choice", "model size preset (random weights, seeded)", choices=tuple(MODEL_PRESETS)),
    Option("served_model_name", "str", "the model name clients pass (default: aiokv-<preset>)"),
    Option("model_seed", "int", "seed of the model weights"),
    Option("device", "str", "torch device of the model and its KV cache (cpu, cuda, cuda:1, ...)"),
    Option(
        "num_blocks", "int", "KV blocks in the engine's pool (its memory: blocks x block size x KV/token)"
    ),
    Option("block_size", "int", "tokens per KV block"),
    Option("max_num_seqs", "int", "requests batched into one forward at most"),
    Option("max_num_batched_tokens", "int", "tokens in one forward at most (longer prefills are chunked)"),
    Option("max_model_len", "int", "prompt + completion tokens per request at most (default: what fits)"),
    Option("max_queued_requests", "int", "requests waiting for the engine at most; beyond it: 429"),
    Option("max_request_bytes", "int", "request body size at most, in bytes; beyond it: 413"),
    Option("default_max_tokens", "int", "max_tokens of a chat request that gives none"),
    Option("tiers", "str", "offload tiers fastest first: cpu=SIZE[,disk=PATH:SIZE][,redis=URL]"),
    Option("create_dirs", "bool", "create the disk tier's directory if it does not exist (default: refuse)"),
    Option("eviction", "str", "CPU tier eviction policy (lru, arc, chain-lru, session, ...)"),
    Option(
        "load_policy",
        "choice",
        "decide: restore a cached prefix only where that beats recomputing it (measured); always: every hit",
        choices=("decide", "always"),
    ),
    Option(
        "offload", "bool", "no KV offloading: recompute every prompt (for comparison)", flag="--no-offload"
    ),
    Option(
        "kv_events_endpoint",
        "str",
        "publish KV events (vLLM's ZMQ wire format) on this endpoint, e.g. tcp://*:5557",
    ),
    Option("kv_events_replay_endpoint", "str", "the KV events' replay socket, e.g. tcp://*:5558"),
    Option("drain_timeout", "float", "seconds shutdown waits for in-flight requests before aborting them"),
    Option("request_timeout", "float", "seconds a request may take before it is aborted (0: no limit)"),
    Option("api_key", "str", "require 'Authorization: Bearer KEY' on /v1 routes"),
    Option("torch_threads", "int", "torch intra-op threads (process-wide)"),
    Option(
        "log_level",
        "choice",
        "level of the log lines on stderr (aiokv's and uvicorn's; debug adds aiokv's per-request lines)",
        choices=("critical", "error", "warning", "info", "debug"),
    ),
    Option(
        "log_format",
        "choice",
        "log lines as text, or as one JSON object per line (keys ts, level, logger, msg)",
        choices=("text", "json"),
    ),
    Option("access_log", "bool", "no per-request access log lines", flag="--no-access-log"),
    Option("loop", "choice", "event loop", choices=("auto", "asyncio", "uvloop")),
)
OPTIONS_BY_FIELD = {o.field: o for o in OPTIONS}

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off", "")


def _convert(opt: Option, raw: str, source: str) -> Any:
    """Convert one raw string (from a flag or the environment) to the field's type."""
    text = raw.strip()
    if opt.kind == "int":
        try:
            return int(text)
        except ValueError:
            raise InvalidArgumentError(f"{source} must be an integer, got {raw!r}") from None
    if opt.kind == "float":
        try:
            value = float(text)
        except ValueError:
            raise InvalidArgumentError(f"{source} must be a number, got {raw!r}") from None
        return value
    if opt.kind == "bool":  # the variable names the flag: AIOKV_NO_OFFLOAD=1 -> offload=False
        if text.lower() in _TRUE:
            return not opt.negative
        if text.lower() in _FALSE:
            return opt.negative
        raise InvalidArgumentError(f"{source} must be one of 1/0, true/false, yes/no, got {raw!r}")
    if opt.kind == "choice" and text not in opt.choices:
        raise InvalidArgumentError(f"{source} must be one of {', '.join(opt.choices)}, got {raw!r}")
    return text


@dataclass(frozen=True, slots=True)
class ServeConfig:
    """Everything ``aiokv serve`` and :func:`aiokv.serve.create_app` need. Each field is also the flag
    ``--field-name`` and the environment variable ``AIOKV_FIELD_NAME`` (see :data:`OPTIONS`)."""

    host: str = "127.0.0.1"
    port: int = 8000
    model: str = "default"
    served_model_name: str | None = None
    model_seed: int = 0
    device: str = "cpu"
    num_blocks: int = 512
    block_size: int = 16
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 512
    max_model_len: int | None = None
    max_queued_requests: int = 128
    max_request_bytes: int = 8 << 20
    default_max_tokens: int = 256
    tiers: str = "cpu=256MiB"
    eviction: str = "lru"
    load_policy: str = "decide"
    offload: bool = True
    kv_events_endpoint: str | None = None
    kv_events_replay_endpoint: str | None = None
    drain_timeout: float = 30.0
    request_timeout: float = 600.0
    api_key: str | None = None
    torch_threads: int = 1
    log_level: str = "info"
    log_format: str = "text"
    access_log: bool = True
    loop: str = "auto"
    create_dirs: bool = False  # last: fields keep their positions

    def __post_init__(self) -> None:
        """Every check names the field; :meth:`from_sources` turns the field into the flag or variable that
        set it. Cross-field constraints are reported against the field the user is most likely to change."""
        if self.model not in MODEL_PRESETS:
            raise _refuse("model", f"must be one of {', '.join(MODEL_PRESETS)}, got {self.model!r}")
        if not 0 <= self.port <= 65535:
            raise _refuse("port", f"must be in [0, 65535], got {self.port}")
        if not 0 <= self.model_seed < 1 << 64:
            raise _refuse("model_seed", f"must be in [0, 2**64) (a 64-bit seed), got {self.model_seed}")
        for name in ("num_blocks", "max_num_seqs", "max_num_batched_tokens", "max_queued_requests",
                     "max_request_bytes", "default_max_tokens", "torch_threads"):  # fmt: skip
            value = getattr(self, name)
            if value <= 0:
                raise _refuse(name, f"must be > 0, got {value}")
        cores = _usable_cores()
        if self.torch_threads > cores:
            raise _refuse(
                "torch_threads",
                f"must be at most {cores} (the cores this process may use), got {self.torch_threads}",
            )
        if self.block_size < 16 or self.block_size & (self.block_size - 1):
            raise _refuse("block_size", f"must be a power of two >= 16, got {self.block_size}")
        if self.max_model_len is not None and not 1 < self.max_model_len <= self.pool_tokens:
            raise _refuse(
                "max_model_len",
                f"must be in [2, {self.pool_tokens}] (num_blocks x block_size), got {self.max_model_len}",
            )
        for name in ("drain_timeout", "request_timeout"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise _refuse(name, f"must be a finite number of seconds >= 0, got {value}")
        if self.served_model_name is not None and not self.served_model_name.strip():
            raise _refuse("served_model_name", "must not be empty")
        if self.api_key is not None and not self.api_key:
            raise _refuse("api_key", "must not be empty")
        for name in ("host", "kv_events_endpoint", "kv_events_replay_endpoint"):
            if getattr(self, name) == "":
                raise _refuse(name, "must not be empty")
        if self.kv_events_replay_endpoint is not None and self.kv_events_endpoint is None:
            raise _refuse("kv_events_replay_endpoint", "needs kv_events_endpoint")
        if self.kv_events_endpoint is not None and not self.offload:
            raise _refuse("kv_events_endpoint", "needs offloading (drop --no-offload)")
        if self.offload:
            try:
                specs = parse_tiers(self.tiers)
                check_tier_paths(
                    specs,
                    create_dirs=self.create_dirs,
                    how_to_create="pass --create-dirs (AIOKV_CREATE_DIRS=1)",
                )
            except InvalidArgumentError as exc:
                raise _refuse("tiers", str(exc), sentence=True) from None
            from ..tiers._policies import policy_names

            if self.eviction not in policy_names():
                raise _refuse("eviction", f"must be one of {policy_names()}, got {self.eviction!r}")
        self._check_memory(parse_tiers(self.tiers) if self.offload else ())
        if self.load_policy not in ("decide", "always"):
            raise _refuse("load_policy", f"must be 'decide' or 'always', got {self.load_policy!r}")
        for name in ("log_level", "log_format"):
            choices = OPTIONS_BY_FIELD[name].choices
            if getattr(self, name) not in choices:
                raise _refuse(name, f"must be one of {', '.join(choices)}, got {getattr(self, name)!r}")
        if self.device != "cpu":  # the default needs no torch to check
            from ..transfer._cuda import check_device

            try:
                check_device(self.device)
            except InvalidArgumentError as exc:
                raise _refuse("device", str(exc).removeprefix("device "), sentence=False) from None

    def _check_memory(self, specs: Sequence[TierSpec]) -> None:
        """The CPU tier, and the KV pool on the CPU, must fit in this machine's memory (both are allocated at
        start: an impossible size is a bad value, not an allocator traceback)."""
        memory = _physical_memory()
        if memory is None:
            return
        pool = self.pool_tokens * _kv_bytes_per_token(self.model) if self.device.startswith("cpu") else 0
        if pool > memory:
            raise _refuse(
                "num_blocks",
                f"{self.num_blocks} (x {self.block_size}-token blocks) makes a KV pool of {format_size(pool)}: "
                f"more than this machine's memory "
                f"({format_size(memory)})",
            )
        cpu = next((s.capacity_bytes or 0 for s in specs if s.kind == "cpu"), 0)
        if cpu + pool > memory:
            also = f" plus the KV pool ({format_size(pool)})" if pool else ""
            raise _refuse(
                "tiers",
                f"capacity of tier 'cpu' ({format_size(cpu)}){also} is more than this machine's memory "
                f"({format_size(memory)})",
                sentence=True,
            )

    # ------------------------------------------------------------------ derived
    @property
    def model_name(self) -> str:
        """The name clients pass as ``model``."""
        return self.served_model_name or f"aiokv-{self.model}"

    @property
    def pool_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def tier_specs(self) -> tuple[TierSpec, ...]:
        return parse_tiers(self.tiers) if self.offload else ()

    def model_config(self) -> ModelConfig:
        from ..engine import ModelConfig

        return ModelConfig(**MODEL_PRESETS[self.model], seed=self.model_seed)  # type: ignore[arg-type]

    def context_len(self, max_position: int) -> int:
        """Prompt plus completion tokens one request may have."""
        fits = min(max_position, self.pool_tokens)
        return min(fits, self.max_model_len) if self.max_model_len is not None else fits

    # ------------------------------------------------------------------ sources
    @classmethod
    def from_sources(
        cls, flags: Mapping[str, str | bool | None] | None = None, environ: Mapping[str, str] | None = None
    ) -> ServeConfig:
        """Flags first, then ``AIOKV_*`` variables, then defaults. ``flags`` maps field names to the raw
        string of a flag (``None``: not given; ``True``: a given boolean flag)."""
        environ = os.environ if environ is None else environ
        flags = flags or {}
        values: dict[str, Any] = {}
        sources: dict[str, str] = {}
        for opt in OPTIONS:
            raw = flags.get(opt.field)
            if raw is True:
                values[opt.field] = not opt.negative
                sources[opt.field] = opt.option
            elif isinstance(raw, str):
                values[opt.field] = _convert(opt, raw, opt.option)
                sources[opt.field] = opt.option
            elif opt.env in environ:
                values[opt.field] = _convert(opt, environ[opt.env], opt.env)
                sources[opt.field] = opt.env
        try:
            return cls(**values)
        except _OptionError as exc:  # name the flag or variable that set the field (a default: its flag)
            source = sources.get(exc.field) or OPTIONS_BY_FIELD[exc.field].option
            raise InvalidArgumentError(exc.with_source(source)) from None

    def replace(self, **changes: Any) -> ServeConfig:
        return dataclasses.replace(self, **changes)


class _OptionError(InvalidArgumentError):
    """A bad value of one :class:`ServeConfig` field: ``field constraint`` (``port must be in ...``), or a
    whole sentence about it (``sentence=True``: ``capacity of tier 'cpu' must be ...``)."""

    def __init__(self, field: str, constraint: str, *, sentence: bool) -> None:
        self.field = field
        self.constraint = constraint
        self.sentence = sentence
        super().__init__(constraint if sentence else f"{field} {constraint}")

    def with_source(self, source: str) -> str:
        """The message naming ``source`` (``--port``, ``AIOKV_PORT``) instead of the field."""
        if not self.sentence:
            return f"{source} {self.constraint}"
        if self.constraint.startswith(self.field + " "):
            return source + self.constraint[len(self.field) :]
        return f"{source}: {self.constraint}"


def _refuse(field: str, constraint: str, *, sentence: bool = False) -> _OptionError:
    return _OptionError(field, constraint, sentence=sentence)


def describe_option_default(opt: Option) -> str:
    default = ServeConfig.__dataclass_fields__[opt.field].default
    if opt.kind == "bool":
        return ""
    return "" if default is None else f" (default: {default})"
