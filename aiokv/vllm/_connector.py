"""``AiokvConnector``: aiokv as a vLLM v1 KV connector (``kv_connector="AiokvConnector"``,
``kv_connector_module_path="aiokv.vllm"``). See docs/vllm.md."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

from .._log import adopt_vllm_handlers
from ._config import ConnectorConfig
from ._meta import AiokvConnectorMetadata
from ._scheduler import SchedulerSide
from ._worker import WorkerSide

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

__all__ = ["AiokvConnector", "AiokvConnectorStats", "AiokvPromMetrics"]

_log = logging.getLogger("aiokv.vllm")


class AiokvConnectorStats(KVConnectorStats):
    """aiokv's counters for vLLM's connector stats (``data``: counter name -> value since the last
    report, summed over workers)."""

    data: dict[str, Any]

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for key, value in other.data.items():
            self.data[key] = self.data.get(key, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        return dict(self.data)

    def reset(self) -> None:
        self.data = {}

    def is_empty(self) -> bool:
        return not any(self.data.values())


_STAT_FIELDS = (
    "hits",
    "misses",
    "hit_tokens",
    "blocks_stored",
    "blocks_loaded",
    "bytes_stored",
    "bytes_loaded",
    "load_errors",
    "store_errors",
    "evictions",
    "staged_blocks",
    "write_through_blocks",
    "write_through_dropped",
)
_STAT_HELP = {
    "hits": "blocks found by lookups (all tiers)",
    "misses": "blocks looked up and not found",
    "hit_tokens": "tokens found by lookups",
    "blocks_stored": "blocks stored into the CPU tier",
    "blocks_loaded": "blocks restored into vLLM's KV cache",
    "load_errors": "blocks whose restore failed (vLLM recomputed them)",
    "staged_blocks": "blocks brought from lower tiers into the CPU tier",
    "write_through_blocks": "blocks written through to lower tiers",
    "write_through_dropped": "blocks not written through (bounds or a slow tier)",
}
_STATS_INTERVAL_S = 1.0  # read the offloader's counters at most this often (one hand-over to its loop)


class AiokvPromMetrics(KVConnectorPromMetrics):
    """One Prometheus counter per aiokv counter, ``vllm:aiokv_<counter>_total`` with vLLM's engine labels,
    fed from the connector stats the workers report (summed over workers)."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        metric_types: dict[Any, Any],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters: dict[tuple[int, str], Any] = {}
        for name in _STAT_FIELDS:
            counter = self._counter_cls(
                name=f"vllm:aiokv_{name}_total",
                documentation=f"aiokv: {_STAT_HELP.get(name, name.replace('_', ' '))}",
                labelnames=labelnames,
            )
            for engine_idx, values in per_engine_labelvalues.items():
                self._counters[(engine_idx, name)] = counter.labels(*values)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, value in transfer_stats_data.items():
            counter = self._counters.get((engine_idx, name))
            if counter is not None and value > 0:
                counter.inc(value)


class AiokvConnector(KVConnectorBase_V1, SupportsHMA):
    """Offloads vLLM's full KV blocks to aiokv's tiers and restores cached prefixes from them.

    ``kv_connector_extra_config`` takes the keys of :class:`~aiokv.vllm.ConnectorConfig` (``tiers``,
    ``load_policy``, ...); an unknown key or a bad value fails engine start-up with an error naming it.

    It supports vLLM's hybrid KV-cache manager (``SupportsHMA``): a model with several KV-cache groups (Gemma 3's
    sliding-window and full-attention layers) keeps them, each stored as an aiokv group
    (:meth:`aiokv.KVLayout.from_groups`); a group kind aiokv does not store (Mamba state, ...) fails start-up
    with an error naming it. One group of full attention (Llama, MLA models) is stored as before."""

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config
        self.config = ConnectorConfig.from_extra_config(extra)
        if self.config.layerwise and vllm_config.scheduler_config.async_scheduling:
            from aiokv.errors import InvalidArgumentError

            # vLLM schedules step N+1 before it learns that a synchronous load of step N failed: that step's
            # forward computes over the failed blocks and vLLM 0.32 keeps the token it samples (observed).
            raise InvalidArgumentError(
                "kv_connector_extra_config['layerwise'] needs vLLM's synchronous scheduling "
                "(async_scheduling=False, --no-async-scheduling): with asynchronous scheduling vLLM runs the "
                "next step over a failed layer-wise load before it hears of the failure"
            )
        # aiokv's lines in vLLM's output, in its format (unless the application configured logging itself).
        adopt_vllm_handlers(self.config.log_level)
        self.scheduler: SchedulerSide | None = None
        self.worker: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            self.scheduler = SchedulerSide(vllm_config, self.config, kv_cache_config)
            if self._kv_transfer_config.kv_load_failure_policy != "recompute":
                # A cache's failed restore is a miss: vLLM recomputes those blocks. vLLM's default ("fail")
                # would end the request with an error instead; the scheduler reads this after creating us.
                _log.info("aiokv: kv_load_failure_policy set to 'recompute' (a failed restore is a miss)")
                self._kv_transfer_config.kv_load_failure_policy = "recompute"
        else:
            self.worker = WorkerSide(vllm_config, kv_cache_config, self.config)
        self._last_stats: dict[str, int] = {}
        self._stats_read = 0.0

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        """vLLM 0.33's sleep mode unmaps the KV cache while aiokv's copies hold views of it: refused (vLLM then
        refuses ``enable_sleep_mode`` with this connector at start-up)."""
        return False

    @property
    def requires_kv_delivery(self) -> bool:
        # A best-effort cache: a dropped store is a later miss, never a request that must wait.
        return False

    # ------------------------------------------------------------------ scheduler side
    def _sched(self) -> SchedulerSide:
        assert self.scheduler is not None, "a scheduler-side method called on a worker connector"
        return self.scheduler

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return self._sched().get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        self._sched().update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self._sched().build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self._sched().update_connector_output(connector_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._sched().request_finished(request, block_ids)

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self._sched().request_finished_all_groups(request, block_ids)

    def has_pending_block_frees(self) -> bool:
        return self.scheduler is not None and self.scheduler.has_pending_block_frees()

    # ------------------------------------------------------------------ worker side
    def _work(self) -> WorkerSide:
        assert self.worker is not None, "a worker-side method called on the scheduler connector"
        return self.worker

    def _meta(self) -> AiokvConnectorMetadata:
        meta = self._get_connector_metadata()
        assert isinstance(meta, AiokvConnectorMetadata)
        return meta

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._work().register_kv_caches(kv_caches)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        assert isinstance(kv_connector_metadata, AiokvConnectorMetadata)
        self._work().handle_preemptions(kv_connector_metadata)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        self._work().start_load_kv(self._meta())

    def wait_for_layer_load(self, layer_name: str) -> None:
        # Asynchronous loads (the default) completed before vLLM scheduled the request: nothing to wait for.
        # Layer-wise mode: this step's loads, layer by layer (WorkerSide.wait_for_layer_load).
        if self.worker is not None:
            self.worker.wait_for_layer_load(layer_name)

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata, **kwargs: Any
    ) -> None:
        # Stores stay whole blocks of every layer, submitted after the forward (wait_for_save), in layer-wise
        # mode too: a block is stored once it is full and computed, which a per-layer save would not make
        # sooner, and one copy per block batch costs less than one per layer.
        return None

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        # Layer-wise loads wait in each attention layer (wait_for_layer_load): a full CUDA graph would skip
        # those waits on replay.
        return bool(extra_config and extra_config.get("layerwise") is True)

    def wait_for_save(self) -> None:
        self._work().wait_for_save(self._meta())

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        meta = self._connector_metadata
        idle = isinstance(meta, AiokvConnectorMetadata) and meta.num_scheduled_tokens == 0
        sending, recving, failed = self._work().get_transfer_results(idle)
        return KVConnectorTransferResults(
            finished_sending=sending, finished_recving=recving, failed_recving=failed
        )

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending or None, results.finished_recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._work().get_block_ids_with_load_errors()

    def build_connector_worker_meta(self) -> Any:
        return None if self.worker is None else self.worker.build_connector_worker_meta()

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        if self.worker is None:
            return None
        now_s = time.monotonic()
        if now_s - self._stats_read < _STATS_INTERVAL_S:
            return None
        self._stats_read = now_s
        stats = self.worker.stats()
        if stats is None:
            return None
        now = {name: int(getattr(stats, name, 0) or 0) for name in _STAT_FIELDS}
        delta = {name: now[name] - self._last_stats.get(name, 0) for name in _STAT_FIELDS}
        self._last_stats = now
        if not any(delta.values()):
            return None
        return AiokvConnectorStats(data=delta)

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return AiokvConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[Any, Any],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics | None:
        return AiokvPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.shutdown()

    def take_events(self) -> Iterable[Any]:
        return ()
