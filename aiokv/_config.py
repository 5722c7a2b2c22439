"""The offloader's options, checked once: :class:`OffloaderConfig` (frozen), built by ``Offloader(...)`` from its
keyword arguments and kept as ``Offloader.config``. Every check names the parameter and the constraint."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ._errors import InvalidArgumentError, InvalidTypeError
from ._groups import GroupedLayout
from ._layout import KVLayout
from .tiers._base import BackingTier
from .tiers._cpu import CPUTier
from .transfer._binding import DeviceBinding

if TYPE_CHECKING:
    from .events._log import KVEventLog
    from .tiers._policies import EvictionPolicy

__all__ = ["OffloaderConfig"]


@dataclass(frozen=True, slots=True)
class OffloaderConfig:
    """An :class:`~aiokv.Offloader`'s options after checking (``Offloader.config``); see ``Offloader`` for what
    each means. ``device`` is resolved (a CUDA layout without one gets its CUDA binding) and
    ``kv_events_endpoints`` is ``(endpoint, replay endpoint or None)`` or ``None``."""

    eviction: str | EvictionPolicy | None
    write_through_max_bytes: int
    close_timeout: float
    store_partial_last_block: bool
    compute_stream: Any
    device: DeviceBinding | None
    staging_bytes: int
    copy_threads: int | None
    kv_events: bool | KVEventLog
    kv_events_endpoints: tuple[str, str | None] | None
    write_through_max_delay_s: float | None
    lower_tier_deadline_s: float | None
    load_policy: str
    prefill_tokens_per_s: float | None

    @property
    def events_on(self) -> bool:
        return self.kv_events is not False or self.kv_events_endpoints is not None

    @classmethod
    def build(
        cls,
        layout: KVLayout,
        tiers: Sequence[CPUTier | BackingTier] | None,
        *,
        eviction: str | EvictionPolicy | None,
        write_through_max_bytes: int,
        close_timeout: float,
        store_partial_last_block: bool,
        compute_stream: Any,
        device: DeviceBinding | None,
        staging_bytes: int,
        copy_threads: int | None,
        kv_events: bool | KVEventLog,
        kv_events_endpoint: str | None,
        kv_events_replay_endpoint: str | None,
        write_through_max_delay_s: float | None,
        lower_tier_deadline_s: float | None,
        load_policy: str,
        prefill_tokens_per_s: float | None,
    ) -> OffloaderConfig:
        """Check ``Offloader``'s arguments (raising ``InvalidTypeError`` / ``InvalidArgumentError`` naming the
        first one that is wrong) and return them as one frozen object."""
        if not isinstance(layout, KVLayout):
            raise InvalidTypeError(f"layout must be an aiokv.KVLayout, got {type(layout).__name__}")
        if tiers is None or len(tiers) == 0:
            raise InvalidArgumentError(
                "tiers must contain at least one tier, e.g. [aiokv.CPUTier(capacity_bytes=8 << 30)]"
            )
        if not isinstance(tiers[0], CPUTier):
            raise InvalidArgumentError(f"tiers[0] must be a CPUTier, got {type(tiers[0]).__name__}")
        for i, t in enumerate(tiers[1:], start=1):
            if not isinstance(t, BackingTier):
                raise InvalidTypeError(
                    f"tiers[{i}] must be a BackingTier (e.g. DiskTier, RedisTier), got {type(t).__name__}"
                )
        if (
            isinstance(write_through_max_bytes, bool)
            or not isinstance(write_through_max_bytes, int)
            or write_through_max_bytes < 0
        ):
            raise InvalidArgumentError(
                f"write_through_max_bytes must be an int >= 0, got {write_through_max_bytes!r}"
            )
        if close_timeout < 0:
            raise InvalidArgumentError(f"close_timeout must be >= 0, got {close_timeout!r}")
        endpoints = _check_event_endpoints(kv_events_endpoint, kv_events_replay_endpoint)
        _check_kv_events(kv_events)
        check_seconds("write_through_max_delay_s", write_through_max_delay_s)
        check_seconds("lower_tier_deadline_s", lower_tier_deadline_s)
        if prefill_tokens_per_s is not None and (
            isinstance(prefill_tokens_per_s, bool) or not isinstance(prefill_tokens_per_s, (int, float))
        ):
            raise InvalidTypeError(
                f"prefill_tokens_per_s must be a number or None, got {type(prefill_tokens_per_s).__name__}"
            )
        device = _resolve_device(layout, device)
        if isinstance(layout, GroupedLayout):
            _check_grouped(device, store_partial_last_block, kv_events, kv_events_endpoint)
        return cls(
            eviction=eviction,
            write_through_max_bytes=write_through_max_bytes,
            close_timeout=close_timeout,
            store_partial_last_block=bool(store_partial_last_block),
            compute_stream=compute_stream,
            device=device,
            staging_bytes=staging_bytes,
            copy_threads=copy_threads,
            kv_events=kv_events,
            kv_events_endpoints=endpoints,
            write_through_max_delay_s=write_through_max_delay_s,
            lower_tier_deadline_s=lower_tier_deadline_s,
            load_policy=load_policy,
            prefill_tokens_per_s=prefill_tokens_per_s,
        )


def _check_grouped(device: object, partial: object, kv_events: object, endpoint: object) -> None:
    """What a grouped layout does not support yet: refused, never silently ignored."""
    if device is not None:
        raise InvalidArgumentError(
            "device must be None for a grouped layout (KVLayout.from_groups): grouped copies run on the "
            "CPU executor only for now"
        )
    if partial:
        raise InvalidArgumentError("store_partial_last_block must be False for a grouped layout")
    if kv_events is not False or endpoint is not None:
        raise InvalidArgumentError("kv_events must be off for a grouped layout (not supported yet)")


def _check_event_endpoints(endpoint: object, replay: object) -> tuple[str, str | None] | None:
    for name, value in (("kv_events_endpoint", endpoint), ("kv_events_replay_endpoint", replay)):
        if value is not None and (not isinstance(value, str) or not value):
            raise InvalidTypeError(f"{name} must be a non-empty str or None, got {value!r}")
    if endpoint is None:
        if replay is not None:
            raise InvalidArgumentError("kv_events_replay_endpoint needs kv_events_endpoint")
        return None
    return endpoint, replay  # type: ignore[return-value]


def _check_kv_events(kv_events: object) -> None:
    if isinstance(kv_events, bool):
        return
    from .events._log import KVEventLog

    if not isinstance(kv_events, KVEventLog):
        raise InvalidTypeError(
            f"kv_events must be a bool or an aiokv.events.KVEventLog, got {type(kv_events).__name__}"
        )


def _resolve_device(layout: KVLayout, device: DeviceBinding | None) -> DeviceBinding | None:
    if device is None:
        if layout.is_cuda:
            from .transfer._cuda import CudaDevice

            return CudaDevice(layout.device)
        return None
    if not isinstance(device, DeviceBinding):
        raise InvalidTypeError(
            f"device must be an aiokv device binding (e.g. aiokv.transfer.SimulatedDevice), got {type(device).__name__}"
        )
    if device.kind == "sim" and layout.is_cuda:
        raise InvalidArgumentError("device=SimulatedDevice needs a cpu layout (its memory is host memory)")
    if device.kind == "cuda" and not layout.is_cuda:
        raise InvalidArgumentError("a cuda device needs a cuda layout")
    return device


def check_seconds(name: str, value: object) -> None:
    """``value`` must be ``None`` or a finite number of seconds > 0."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidTypeError(f"{name} must be a number of seconds or None, got {type(value).__name__}")
    if not math.isfinite(value) or value <= 0:
        raise InvalidArgumentError(f"{name} must be > 0 seconds (or None for no limit), got {value!r}")
