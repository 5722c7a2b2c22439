"""``aiokv serve`` configuration: one frozen record, every field settable by a flag or an ``AIOKV_*``
environment variable, validated before anything is built.

Standard library only at import time: the command line reads :data:`OPTIONS` for ``--help`` without importing
torch or the web stack.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .._errors import InvalidArgumentError
from .._log import get_logger
from .._units import format_size
from ..tiers import TierSetting, check_tier_paths, parse_tiers

# The old name of TierSetting (aiokv.serve.TierSpec warns; this private alias does not).
TierSpec = TierSetting

if TYPE_CHECKING:
    from ..engine import ModelConfig

__all__ = [
    "ENGINE_PRESETS",
    "OPTIONS",
    "Option",
    "ServeConfig",
    "TierSetting",
    "TierSpec",
    "check_tier_paths",
    "parse_tiers",
]

_log = get_logger("serve")

# The reference engine's model sizes (``aiokv serve --model``): keyword arguments of aiokv.engine.ModelConfig,
# kept as plain data (no torch import to list them). Not replay's cost-model presets of real models
# (aiokv.replay.COST_PRESETS).
ENGINE_PRESETS: dict[str, dict[str, int]] = {
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


def _kv_bytes_per_token(preset: str) -> int:
    shape = {**_KV_SHAPE_DEFAULTS, **ENGINE_PRESETS[preset]}
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
    Option("model", "choice", "model size preset (random weights, seeded)", choices=tuple(ENGINE_PRESETS)),
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
        if self.model not in ENGINE_PRESETS:
            raise _refuse("model", f"must be one of {', '.join(ENGINE_PRESETS)}, got {self.model!r}")
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
            from ..tiers import policy_names

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
            from ..transfer import check_device

            try:
                check_device(self.device)
            except InvalidArgumentError as exc:
                raise _refuse("device", str(exc).removeprefix("device "), sentence=False) from None

    def _check_memory(self, specs: Sequence[TierSetting]) -> None:
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
    def tier_specs(self) -> tuple[TierSetting, ...]:
        return parse_tiers(self.tiers) if self.offload else ()

    def model_config(self) -> ModelConfig:
        from ..engine import ModelConfig

        return ModelConfig(**ENGINE_PRESETS[self.model], seed=self.model_seed)  # type: ignore[arg-type]

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
