"""The connector's configuration: ``kv_connector_extra_config`` parsed into one frozen record.

Standard library only (plus aiokv's own parsers): the record is built and checked in the scheduler process
and in every worker before anything is allocated, so a bad key or value stops the engine at start-up with an
error that names the key and the constraint.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from .._errors import InvalidArgumentError
from .._log import LEVELS as _LOG_LEVELS

__all__ = ["ConnectorConfig"]

_LOAD_POLICIES = ("decide", "always")


@dataclass(frozen=True, slots=True)
class ConnectorConfig:
    """Every key of ``kv_connector_extra_config`` that ``AiokvConnector`` understands (docs/vllm.md).

    Each field is the key of the same name; a key the connector does not know is refused, never ignored."""

    tiers: str = "cpu=4GiB"
    """The tier hierarchy in the grammar of ``aiokv serve --tiers``: ``cpu=SIZE`` first, then any of
    ``disk=PATH:SIZE``, ``shm=NAME:SIZE``, ``redis=URL`` / ``redis-cluster=URL`` (``valkey://`` too). Sizes
    are per worker (per tensor-parallel rank), in bytes (``64GiB``, ``500MB``; ``64Gb`` is refused as
    ambiguous). A disk tier's directory must exist unless ``create_dirs`` is true."""
    load_policy: str = "decide"
    """``"decide"``: restore a cached prefix only where that is measured to beat recomputing it (the engine's
    prefill rate is measured from its forwards); ``"always"``: restore every hit."""
    eviction: str = "lru"
    """The CPU tier's eviction policy (``lru``, ``arc``, ``chain-lru``, ``session``, ...)."""
    write_through_max_bytes: int = 256 << 20
    """Bytes queued towards each lower tier at most (beyond it writes are dropped and counted)."""
    write_through_max_delay_s: float | None = 5.0
    """A block queued longer than this towards a lower tier is dropped (``None``: no time bound)."""
    lower_tier_deadline_s: float | None = 10.0
    """A lower tier's lookup and read of one run taking longer is a miss (``None``: no deadline)."""
    close_timeout_s: float = 30.0
    """At engine shutdown: how long queued write-through to the persistent tiers may still run."""
    kv_events_endpoint: str | None = None
    """Publish aiokv's KV events (vLLM's ZMQ wire format) on this endpoint, e.g. ``tcp://*:5557``."""
    kv_events_replay_endpoint: str | None = None
    """The KV events' replay socket, e.g. ``tcp://*:5558`` (needs ``kv_events_endpoint``)."""
    salt: str | None = None
    """A tenant salt mixed into every block hash of this engine (caches with different salts never match);
    a request's own ``cache_salt`` is mixed in as well."""
    model_id: str | None = None
    """The model identity mixed into every block hash. Default: vLLM's model name, dtype, KV cache dtype,
    block size and the worker's tensor/pipeline-parallel rank, so different models never share blocks. Set
    it to share one cache between engines that load the same model from different paths."""
    prefill_tokens_per_s: float | None = None
    """The engine's prefill speed for ``load_policy="decide"``; default: measured from the forwards."""
    copy_threads: int | None = None
    """CPU copies: threads one large copy is split over (default: the usable cores, at most 4)."""
    lookup_wait_s: float = 0.002
    """How long a worker step with nothing to compute waits for a lookup or load still in progress before
    it returns (saves the engine from spinning on empty steps while a slow tier answers)."""
    create_dirs: bool = False
    """Create a disk tier's directory (and its parents) when it does not exist; by default a missing directory
    is refused, as most often it is a typo that would start a new, empty cache elsewhere."""
    layerwise: bool = False
    """Layer-wise loads: a hit is loaded in the step that computes the rest of its prompt (vLLM's synchronous
    loads), one layer at a time, and the forward's attention of layer ``i`` waits only for layer ``i`` of that
    step's loads (``wait_for_layer_load``), so the copy of the later layers overlaps the earlier layers'
    compute. Default: the whole restore completes before vLLM schedules the request (asynchronous loads).
    Needs vLLM's synchronous scheduling (``async_scheduling=False``); ignored with several KV-cache groups
    (their loads stay asynchronous, whole)."""
    layerwise_timeout_s: float = 10.0
    """With ``layerwise``: how long the forward waits for one layer of its step's loads; a load still missing
    that layer then fails (its blocks are reported to vLLM, which recomputes them, never reads them)."""
    log_level: str | None = None
    """Level of aiokv's lines in vLLM's output (``"debug"``, ``"info"``, ``"warning"``, ``"error"``,
    ``"critical"``); default: vLLM's (``VLLM_LOGGING_LEVEL``). Ignored when the application configured the
    ``"aiokv"`` logger itself."""

    def __post_init__(self) -> None:
        from ..tiers import check_tier_paths, parse_tiers, policy_names

        _check_str("tiers", self.tiers)
        for name in ("create_dirs", "layerwise"):
            if not isinstance(getattr(self, name), bool):
                raise _bad(name, f"must be true or false, got {getattr(self, name)!r}")
        try:
            check_tier_paths(
                parse_tiers(self.tiers),
                create_dirs=self.create_dirs,
                how_to_create="set kv_connector_extra_config['create_dirs'] = true",
            )
        except InvalidArgumentError as exc:
            raise InvalidArgumentError(f"kv_connector_extra_config['tiers']: {exc}") from None
        if self.load_policy not in _LOAD_POLICIES:
            raise _bad("load_policy", f"must be 'decide' or 'always', got {self.load_policy!r}")
        if self.eviction not in policy_names():
            raise _bad("eviction", f"must be one of {policy_names()}, got {self.eviction!r}")
        _check_int("write_through_max_bytes", self.write_through_max_bytes, minimum=0)
        for name in ("write_through_max_delay_s", "lower_tier_deadline_s"):
            value = getattr(self, name)
            if value is not None:
                _check_seconds(name, value, positive=True)
        _check_seconds("close_timeout_s", self.close_timeout_s, positive=False)
        _check_seconds("lookup_wait_s", self.lookup_wait_s, positive=False)
        _check_seconds("layerwise_timeout_s", self.layerwise_timeout_s, positive=True)
        for name in ("kv_events_endpoint", "kv_events_replay_endpoint", "salt", "model_id"):
            value = getattr(self, name)
            if value is not None:
                _check_str(name, value)
        if self.kv_events_replay_endpoint is not None and self.kv_events_endpoint is None:
            raise _bad("kv_events_replay_endpoint", "needs kv_events_endpoint")
        if self.prefill_tokens_per_s is not None:
            _check_seconds("prefill_tokens_per_s", self.prefill_tokens_per_s, positive=True, what="a number")
        if self.copy_threads is not None:
            _check_int("copy_threads", self.copy_threads, minimum=1)
        if self.log_level is not None and self.log_level not in _LOG_LEVELS:
            raise _bad("log_level", f"must be one of {', '.join(_LOG_LEVELS)}, got {self.log_level!r}")

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None) -> ConnectorConfig:
        """Build from vLLM's ``kv_connector_extra_config`` (``None``: all defaults). Unknown keys are refused."""
        if extra is None:
            return cls()
        if not isinstance(extra, Mapping):
            raise InvalidArgumentError(
                f"kv_connector_extra_config must be a mapping of options, got {type(extra).__name__}"
            )
        known = {f.name for f in fields(cls)}
        unknown = sorted(str(k) for k in extra if k not in known)
        if unknown:
            raise InvalidArgumentError(
                f"kv_connector_extra_config has unknown key(s) {', '.join(map(repr, unknown))} for "
                f"AiokvConnector; known keys: {', '.join(sorted(known))}"
            )
        values = dict(extra)
        if isinstance(values.get("write_through_max_bytes"), str):
            from .._units import parse_size

            key = "kv_connector_extra_config['write_through_max_bytes']"
            size = parse_size(values["write_through_max_bytes"], what=key)
            if size is None:
                raise _bad("write_through_max_bytes", "must be finite")
            values["write_through_max_bytes"] = size
        return cls(**values)


def _bad(key: str, constraint: str) -> InvalidArgumentError:
    return InvalidArgumentError(f"kv_connector_extra_config['{key}'] {constraint}")


def _check_str(key: str, value: object) -> None:
    if not isinstance(value, str) or not value.strip():
        raise _bad(key, f"must be a non-empty string, got {value!r}")


def _check_int(key: str, value: object, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise _bad(key, f"must be an int >= {minimum}, got {value!r}")


def _check_seconds(key: str, value: object, *, positive: bool, what: str = "a number of seconds") -> None:
    ok = (
        not isinstance(value, bool)
        and isinstance(value, (int, float))
        and math.isfinite(value)
        and (value > 0 if positive else value >= 0)
    )
    if not ok:
        raise _bad(key, f"must be {what} {'> 0' if positive else '>= 0'}, got {value!r}")
