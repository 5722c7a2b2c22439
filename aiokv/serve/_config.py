"""``aiokv serve`` configuration: one frozen record, every field settable by a flag or an ``AIOKV_*``
environment variable, validated before anything is built.

Standard library only at import time: the command line reads :data:`OPTIONS` for ``--help`` without importing
torch or the web stack.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .._errors import InvalidArgumentError

if TYPE_CHECKING:
    from ..engine import ModelConfig
    from ..tiers import BackingTier, CPUTier

__all__ = ["MODEL_PRESETS", "OPTIONS", "Option", "ServeConfig", "TierSpec", "parse_tiers"]

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

TIER_KINDS = ("cpu", "disk", "shm", "redis", "redis-cluster")
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
            return DiskTier(self.path, self.capacity_bytes)
        assert self.url is not None
        return RedisTier(self.url, cluster=self.kind == "redis-cluster")

    def describe(self) -> str:
        from ..replay._model import format_size

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
    or ``redis-cluster=URL`` for a Redis Cluster) may follow, each kind at most once. Sizes take the units of
    ``aiokv replay --tiers`` (``64GiB``, ``500MB``, plain bytes)."""
    from ..cli import _parse_assignments
    from ..replay._model import parse_size

    specs: list[TierSpec] = []
    seen: set[str] = set()
    for i, (name, value) in enumerate(_parse_assignments(text, "tiers")):
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


# ---------------------------------------------------------------------------------------------- options
@dataclass(frozen=True, slots=True)
class Option:
    """One setting: its field in :class:`ServeConfig`, its flag and environment variable, how to read it."""

    field: str
    kind: str  # "str", "int", "float", "bool" (a flag that sets it), "choice"
    help: str
    choices: tuple[str, ...] = ()
    flag: str | None = None  # default: --field-with-dashes

    @property
    def option(self) -> str:
        return self.flag or "--" + self.field.replace("_", "-")

    @property
    def env(self) -> str:
        return "AIOKV_" + self.option.removeprefix("--").replace("-", "_").upper()


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
    Option("default_max_tokens", "int", "max_tokens of a chat request that gives none"),
    Option("tiers", "str", "offload tiers fastest first: cpu=SIZE[,disk=PATH:SIZE][,redis=URL]"),
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
    Option("log_level", "choice", "log level", choices=("critical", "error", "warning", "info", "debug")),
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
    if opt.kind == "bool":  # the variable names the negative flag: AIOKV_NO_OFFLOAD=1 -> offload=False
        if text.lower() in _TRUE:
            return False
        if text.lower() in _FALSE:
            return True
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
    access_log: bool = True
    loop: str = "auto"

    def __post_init__(self) -> None:
        if self.model not in MODEL_PRESETS:
            raise InvalidArgumentError(f"model must be one of {', '.join(MODEL_PRESETS)}, got {self.model!r}")
        if not 0 <= self.port <= 65535:
            raise InvalidArgumentError(f"port must be in [0, 65535], got {self.port}")
        for name in ("num_blocks", "max_num_seqs", "max_num_batched_tokens", "max_queued_requests",
                     "default_max_tokens", "torch_threads"):  # fmt: skip
            value = getattr(self, name)
            if value <= 0:
                raise InvalidArgumentError(f"{name} must be > 0, got {value}")
        if self.block_size < 16 or self.block_size & (self.block_size - 1):
            raise InvalidArgumentError(f"block_size must be a power of two >= 16, got {self.block_size}")
        if self.max_model_len is not None and not 1 < self.max_model_len <= self.pool_tokens:
            raise InvalidArgumentError(
                f"max_model_len must be in [2, {self.pool_tokens}] (num_blocks x block_size), got {self.max_model_len}"
            )
        for name in ("drain_timeout", "request_timeout"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise InvalidArgumentError(f"{name} must be a finite number of seconds >= 0, got {value}")
        if self.served_model_name is not None and not self.served_model_name.strip():
            raise InvalidArgumentError("served_model_name must not be empty")
        if self.api_key is not None and not self.api_key:
            raise InvalidArgumentError("api_key must not be empty")
        for name in ("kv_events_endpoint", "kv_events_replay_endpoint"):
            if getattr(self, name) == "":
                raise InvalidArgumentError(f"{name} must not be empty")
        if self.kv_events_replay_endpoint is not None and self.kv_events_endpoint is None:
            raise InvalidArgumentError("kv_events_replay_endpoint needs kv_events_endpoint")
        if self.kv_events_endpoint is not None and not self.offload:
            raise InvalidArgumentError("kv_events_endpoint needs offloading (drop --no-offload)")
        if self.offload:
            parse_tiers(self.tiers)
            from ..tiers._policies import policy_names

            if self.eviction not in policy_names():
                raise InvalidArgumentError(f"eviction must be one of {policy_names()}, got {self.eviction!r}")
        if self.load_policy not in ("decide", "always"):
            raise InvalidArgumentError(f"load_policy must be 'decide' or 'always', got {self.load_policy!r}")

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
        for opt in OPTIONS:
            raw = flags.get(opt.field)
            if raw is True:
                values[opt.field] = False  # every boolean flag is a --no-...
            elif isinstance(raw, str):
                values[opt.field] = _convert(opt, raw, opt.option)
            elif opt.env in environ:
                values[opt.field] = _convert(opt, environ[opt.env], opt.env)
        return cls(**values)

    def replace(self, **changes: Any) -> ServeConfig:
        return dataclasses.replace(self, **changes)


def describe_option_default(opt: Option) -> str:
    default = ServeConfig.__dataclass_fields__[opt.field].default
    if opt.kind == "bool":
        return ""
    return "" if default is None else f" (default: {default})"
