"""The worker side of the connector: an :class:`aiokv.Offloader` over this worker's KV tensors.

The offloader and its event loop run in a thread of their own, owned by an anyio blocking portal for the
worker's lifetime (started in ``register_kv_caches``, closed in ``shutdown``). vLLM's thread hands each
step's jobs to that loop with one ``call_soon_threadsafe`` (``aiokv._bridge.call_in_loop``, the one path from
a thread to the loop), in order, and blocks only where vLLM's contract needs it: a preempted request's
blocks are free in the scheduler already, so the step that follows may not run its forward before every copy
reading them is done. Everything else (lookups, loads, stores, the end of requests) runs on the loop, and its
outcomes come back through thread-safe queues that the step's ``get_transfer_results``,
``get_block_ids_with_load_errors`` and ``build_connector_worker_meta`` drain without waiting.

What vLLM is told, and when:

- a lookup's answer (tokens found across every tier) in the worker metadata of the step it completed in;
- a load in ``finished_recving`` once the copy into vLLM's blocks has ended, with every block of a load that
  did not restore everything in ``get_block_ids_with_load_errors`` of the same step (vLLM recomputes them);
- a finished or aborted request in ``finished_sending`` once aiokv's ``finish()``/``abort()`` resolved, i.e.
  once every copy reading its blocks ended (vLLM frees them only then);
- a preemption before ``handle_preemptions`` returns.

Several KV-cache groups (vLLM's hybrid KV-cache manager): the layout is an :meth:`aiokv.KVLayout.from_groups`
with one aiokv group per vLLM group (:func:`build_grouped_layout`), every job's block ids are per group, and the
sliding-window blocks vLLM freed (a :class:`DropJob`, the ``drops`` of an end or a preemption) are dropped from
the aiokv request (``Request.drop_blocks``) before anything else of the step; ``handle_preemptions`` returns
only once every copy that may still read them is done (vLLM may write them in this step's forward), and this
step's loads are submitted only after that. A failed load is reported in ``failed_recving`` only (vLLM refuses
block-level load errors with several groups; it recomputes the request).

Layer-wise mode (``layerwise``, one KV-cache group): loads are vLLM's synchronous loads. ``handle_preemptions``
hands the step's other jobs over as above; ``start_load_kv`` (after vLLM zeroed and copied blocks, before the
forward) submits the step's loads with ``Request.load(..., layerwise=True)``, and a watcher on the loop follows
them layer by layer (:class:`_LayerLoads`). ``wait_for_layer_load(name)`` blocks vLLM's thread until that layer
(its index in the layout: the order ``register_kv_caches`` got the caches in) of every one of them is in place,
at most ``layerwise_timeout_s``. ``wait_for_save`` waits for them to resolve; every block of a load that failed
(a layer's copy, or the wait past the timeout) is in ``get_block_ids_with_load_errors`` of that same step, so
vLLM discards the step's output for the request and recomputes those blocks, and nothing the forward computed
over them is stored: the worker stores nothing more for that request. A load that ran past the timeout is
waited for (up to the preemption bound) before the next step's forward may write its blocks. Such loads are
never in ``finished_recving`` (vLLM did not wait for them).
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import logging
import threading
import time
from collections import deque
from typing import TYPE_CHECKING, Any, cast

from ..bridge import call_in_loop
from ._block_table import VllmGroup, vllm_groups
from ._meta import AiokvConnectorMetadata, AiokvWorkerMetadata, EndJob, LoadJob, LookupJob, StepJob

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

    from .. import Offloader, Request
    from ._config import ConnectorConfig

__all__ = ["WorkerSide", "build_grouped_layout", "build_layout", "layer_indices"]

_log = logging.getLogger("aiokv.vllm")

# A preemption waits at most this long for the copies reading the request's blocks (they are memcpys or
# device copies already queued; only a hung device could take this long, and then reuse would be unsafe).
_PREEMPT_TIMEOUT_S = 300.0


class _LayerLoads:
    """One step's layer-wise loads: followed on the loop (``_watch_layers``), waited for on vLLM's thread.

    ``jobs``: request -> the vLLM blocks its load writes (reported as load errors if it fails). The loop
    advances ``layers`` (layers of every load in place), records ``failed`` loads and sets ``settled`` once
    every load resolved; vLLM's thread may give up on the whole step (``expired``: its loads still unsettled
    count as failed)."""

    __slots__ = ("cond", "expired", "failed", "jobs", "layers", "settled")

    def __init__(self, jobs: dict[str, list[int]]) -> None:
        self.cond = threading.Condition()
        self.jobs = jobs
        self.layers = 0
        self.failed: set[str] = set()
        self.settled = False
        self.expired = False

    # loop thread
    def fail(self, rid: str) -> None:
        with self.cond:
            self.failed.add(rid)

    def advance(self, layers: int) -> None:
        with self.cond:
            self.layers = layers
            self.cond.notify_all()

    def settle(self) -> None:
        with self.cond:
            self.settled = True
            self.cond.notify_all()

    # vLLM's thread
    def wait_layer(self, index: int, timeout: float) -> bool:
        """Wait until layer ``index`` of every load is in place (or failed); False on the timeout, after which
        every load not already failed counts as failed (the step is given up on)."""
        with self.cond:
            if self.expired or self.cond.wait_for(lambda: self.layers > index or self.settled, timeout):
                return True
            self._expire()
            return False

    def wait_settled(self, timeout: float) -> bool:
        with self.cond:
            if self.expired or self.cond.wait_for(lambda: self.settled, timeout):
                return True
            self._expire()
            return False

    def wait_copies(self, timeout: float) -> bool:
        """Wait until every load resolved (their copies ended), past any expiry; False on the timeout."""
        with self.cond:
            return self.cond.wait_for(lambda: self.settled, timeout)

    def outcome(self) -> set[str]:
        """The loads that failed (final once settled or expired)."""
        with self.cond:
            return set(self.failed)

    def _expire(self) -> None:
        self.expired = True
        self.failed.update(self.jobs)


def build_layout(kv_caches: dict[str, torch.Tensor], num_blocks: int, block_size: int, model_id: str) -> Any:
    """An :class:`aiokv.KVLayout` over vLLM's per-layer KV caches, whatever the attention backend's layout:
    each layer's cache is viewed as ``(num_blocks, bytes per block)`` raw bytes (vLLM's offloading worker
    reads them the same way), so a block's KV is one contiguous run of bytes per layer. Layers that alias
    the same bytes (caches overlaid by vLLM) are taken once."""
    from .. import KVLayout
    from .._errors import InvalidLayoutError

    views: list[torch.Tensor] = []
    seen: set[tuple[int, tuple[int, ...]]] = set()
    for name, cache in kv_caches.items():
        key, raw = _raw_view(name, cache, num_blocks)
        if key in seen:
            continue
        seen.add(key)
        views.append(raw)
    if not views:
        raise InvalidLayoutError("register_kv_caches got no KV cache tensors")
    return KVLayout(views, block_size=block_size, token_dim=None, model_id=model_id)


def build_grouped_layout(
    kv_caches: dict[str, torch.Tensor],
    groups: tuple[VllmGroup, ...],
    num_blocks: int,
    model_id: str,
) -> Any:
    """An :meth:`aiokv.KVLayout.from_groups` over vLLM's KV caches with several groups: one aiokv group per vLLM
    group (its kind and window), each over its own layers' caches viewed as raw bytes per block (as in
    :func:`build_layout`). vLLM's hybrid allocator overlays the groups (a sliding-window layer and a
    full-attention layer share one buffer, each group using its own block ids of it): such layers get the very
    same view in both groups, which aiokv allows (it keeps each group's block ids apart)."""
    from .. import KVGroup, KVLayout
    from .._errors import InvalidLayoutError

    shared: dict[tuple[int, tuple[int, int]], torch.Tensor] = {}
    kv_groups: list[KVGroup] = []
    for g in groups:
        views: list[torch.Tensor] = []
        seen: set[tuple[int, tuple[int, int]]] = set()
        for name in g.layer_names:
            cache = kv_caches.get(name)
            if cache is None:
                continue
            key, raw = _raw_view(name, cache, num_blocks)
            if key in seen:  # layers sharing one cache within the group (vLLM's cross-layer KV sharing)
                continue
            seen.add(key)
            views.append(shared.setdefault(key, raw))
        if not views:
            raise InvalidLayoutError(
                f"register_kv_caches got no KV cache tensor for kv_cache_groups[{g.index}] (layers "
                f"{', '.join(g.layer_names[:3])}{', ...' if len(g.layer_names) > 3 else ''})"
            )
        kv_groups.append(KVGroup(views, g.kind, window=g.window, token_dim=None, name=f"{g.kind}{g.index}"))
    return KVLayout.from_groups(kv_groups, groups[0].block_size, model_id=model_id)


def layer_indices(kv_caches: dict[str, torch.Tensor], num_blocks: int) -> dict[str, int]:
    """Each layer name's layer index in :func:`build_layout`'s layout (the order ``register_kv_caches`` got
    them in); a layer aliasing an earlier one's bytes has that layer's index."""
    first: dict[tuple[int, tuple[int, int]], int] = {}
    return {
        name: first.setdefault(_raw_view(name, cache, num_blocks)[0], len(first))
        for name, cache in kv_caches.items()
    }


def _raw_view(
    name: str, cache: torch.Tensor, num_blocks: int
) -> tuple[tuple[int, tuple[int, int]], torch.Tensor]:
    """One layer's cache as ``(num_blocks, bytes per block)`` raw bytes, and a key naming those bytes."""
    import torch

    from .._errors import InvalidLayoutError

    if cache.shape[0] % num_blocks:
        raise InvalidLayoutError(
            f"KV cache of layer {name!r} has {cache.shape[0]} blocks in dimension 0, not a multiple of the "
            f"engine's {num_blocks} blocks: this attention backend's layout is not supported"
        )
    ref = cache if cache.shape[0] == num_blocks else cache.view(num_blocks, -1, *cache.shape[1:])
    elem = ref.element_size()
    block = ref[0]
    page = block.numel() * elem
    if not block.is_contiguous():
        # A permuted view: its bytes per block must still form one dense run.
        span = 1 + sum((d - 1) * s for d, s in zip(block.shape, block.stride()) if d > 1)
        if span != block.numel():
            raise InvalidLayoutError(
                f"KV cache of layer {name!r} does not hold each block in one contiguous run of bytes"
            )
    stride = ref.stride(0) * elem
    key = (ref.data_ptr(), (stride, page))
    raw = torch.empty(0, dtype=torch.uint8, device=ref.device).set_(
        ref.untyped_storage(), ref.storage_offset() * elem, (num_blocks, page), (stride, 1)
    )
    return key, raw


class WorkerSide:
    """Worker-role half of :class:`~aiokv.vllm.AiokvConnector` (one per worker process / rank)."""

    def __init__(
        self, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, config: ConnectorConfig
    ) -> None:
        self.config = config
        self.vllm_config = vllm_config
        self.kv_cache_config = kv_cache_config
        self.block_size = int(vllm_config.cache_config.block_size)
        # Several KV-cache groups (vLLM's hybrid KV-cache manager): None for one group of full attention.
        self.groups = vllm_groups(kv_cache_config)
        if self.groups is not None:
            self.block_size = self.groups[0].block_size
        self.off: Offloader | None = None
        self._portal_cm: Any = None
        self._portal: Any = None
        self._loop: asyncio.AbstractEventLoop | None = None
        # Loop-thread state.
        self._reqs: dict[str, Request] = {}
        self._pending: set[asyncio.Future[Any]] = set()
        # Outcomes, appended on the loop thread, drained on vLLM's (deque append/popleft are atomic).
        self._lookups_done: deque[tuple[str, int, int]] = deque()
        # (request, failed, vLLM blocks to recompute)
        self._loads_done: deque[tuple[str, bool, list[int]]] = deque()
        self._sent_done: deque[str] = deque()
        self._outcome = threading.Condition()
        self._outstanding = 0  # lookups, loads and ends not yet reported (vLLM's thread)
        self._load_errors: set[int] = set()
        self._step_started = 0.0
        self._prepared: AiokvConnectorMetadata | None = None
        self.step_errors = 0
        self.blocks_dropped = 0  # sliding-window blocks vLLM freed that aiokv was told of (several groups)
        # Layer-wise mode (one group only: aiokv loads a grouped layout whole).
        self.layerwise = config.layerwise and self.groups is None
        self._layer_index: dict[str, int] = {}
        self._num_layers = 0
        self._layer_loads: _LayerLoads | None = None  # this step's (vLLM's thread)
        self._loads_meta: AiokvConnectorMetadata | None = None  # the metadata whose loads were submitted
        self._unsettled: list[_LayerLoads] = []  # given up on past their timeout, copies maybe still running
        self._given_up: set[str] = set()  # a layer-wise load failed: nothing more is stored (loop thread)
        self.layerwise_failed = 0  # layer-wise loads that failed (copy, or past layerwise_timeout_s)

    # ------------------------------------------------------------------ lifetime
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from anyio.from_thread import start_blocking_portal

        num_blocks = self.kv_cache_config.num_blocks
        if self.groups is None:
            layout = build_layout(kv_caches, num_blocks, self.block_size, self._model_id())
            if self.layerwise:
                self._layer_index = layer_indices(kv_caches, num_blocks)
                self._num_layers = layout.num_layers
        else:
            if self.config.layerwise:
                _log.warning(
                    "aiokv: kv_connector_extra_config['layerwise'] is ignored with several KV-cache groups: "
                    "their loads stay asynchronous and whole"
                )
            layout = build_grouped_layout(kv_caches, self.groups, num_blocks, self._model_id())
        options: dict[str, Any] = {}
        with contextlib.suppress(ImportError):
            import uvloop  # noqa: F401

            options["use_uvloop"] = True
        self._portal_cm = start_blocking_portal("asyncio", options)
        self._portal = self._portal_cm.__enter__()
        compute_stream = None
        if layout.is_cuda:  # pragma: no cover - needs a GPU
            from ..transfer import CudaDevice

            # vLLM's forward runs on this thread's current stream: aiokv's copies are ordered against it.
            compute_stream = CudaDevice(layout.device).current_stream()
        try:
            self._portal.call(self._start, layout, compute_stream)
        except BaseException:
            self._portal_cm.__exit__(None, None, None)
            self._portal = self._portal_cm = None
            raise
        # A worker process that exits without vLLM calling shutdown() still closes the offloader (queued
        # write-through gets close_timeout_s) while its loop thread runs: atexit handlers run before daemon
        # threads stop, and a portal left open at interpreter exit would wait for a dead loop forever.
        atexit.register(self.shutdown)
        _log.info("aiokv worker ready: %s, tiers %s", layout.describe(), self.config.tiers)

    async def _start(self, layout: Any, compute_stream: Any) -> None:
        from .. import Offloader
        from ..tiers import parse_tiers

        cfg = self.config
        tiers = [spec.build() for spec in parse_tiers(cfg.tiers)]
        off = Offloader(
            layout,
            tiers,
            eviction=cfg.eviction,
            write_through_max_bytes=cfg.write_through_max_bytes,
            write_through_max_delay_s=cfg.write_through_max_delay_s,
            lower_tier_deadline_s=cfg.lower_tier_deadline_s,
            close_timeout=cfg.close_timeout_s,
            load_policy=cfg.load_policy,
            prefill_tokens_per_s=cfg.prefill_tokens_per_s,
            copy_threads=cfg.copy_threads,
            kv_events_endpoint=cfg.kv_events_endpoint,
            kv_events_replay_endpoint=cfg.kv_events_replay_endpoint,
            compute_stream=compute_stream,
        )
        await off.start()
        self.off = off
        self._loop = asyncio.get_running_loop()

    def _model_id(self) -> str:
        if self.config.model_id is not None:
            base = self.config.model_id
        else:
            mc = self.vllm_config.model_config
            base = (
                f"vllm/{mc.model}@{getattr(mc, 'revision', None) or 'main'}/{mc.dtype}/"
                f"{self.vllm_config.cache_config.cache_dtype}"
            )
        tp_rank, tp_size, pp_rank, pp_size = _ranks(self.vllm_config)
        return f"{base}/tp{tp_rank}of{tp_size}/pp{pp_rank}of{pp_size}"

    def shutdown(self) -> None:
        """Close the offloader (queued write-through to persistent tiers gets ``close_timeout_s``), then the
        loop thread. Idempotent."""
        portal, cm = self._portal, self._portal_cm
        if portal is None:
            return
        self._portal = self._portal_cm = None
        atexit.unregister(self.shutdown)
        try:
            if self.off is not None:
                with contextlib.suppress(Exception):
                    _log.info("aiokv worker closing: %s", self.stats())
                portal.call(self.off.aclose)
        finally:
            cm.__exit__(None, None, None)

    # ------------------------------------------------------------------ each step (vLLM's thread)
    def handle_preemptions(self, meta: AiokvConnectorMetadata) -> None:
        """Start the step: the end of finished requests, lookups and loads are handed to the loop, and the
        preempted requests are waited for (their blocks may be written by this step's forward)."""
        self._step_started = time.perf_counter()
        self._prepare(meta)

    def start_load_kv(self, meta: AiokvConnectorMetadata) -> None:
        self._prepare(meta)  # a model runner that did not call handle_preemptions
        if not self.layerwise or self._loads_meta is meta:
            return
        self._loads_meta = meta
        if not meta.loads:
            return
        # vLLM's synchronous loads of this step, before its forward (after vLLM zeroed and copied blocks in
        # _update_states): submitted layer by layer, after the jobs _prepare handed over (same FIFO).
        # One group: each job's block ids are one list; the blocks its load writes are past the present ones.
        jobs = {job.req_id: cast("list[int]", job.block_ids)[job.present_blocks :] for job in meta.loads}
        step = self._layer_loads = _LayerLoads(jobs)
        loads = list(meta.loads)
        call_in_loop(self._running_loop(), lambda: self._on_layer_loads(step, loads))

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Layer-wise mode: block until layer ``layer_name`` of every load of this step is in the engine blocks
        (or failed: then vLLM is told in this step's load errors), at most ``layerwise_timeout_s``."""
        step = self._layer_loads
        if step is None:
            return
        # A name register_kv_caches did not get (a layer without KV of its own): every layer.
        index = self._layer_index.get(layer_name, self._num_layers - 1)
        if not step.wait_layer(index, self.config.layerwise_timeout_s):
            _log.error(
                "aiokv: layer %r of this step's loads not in place after layerwise_timeout_s=%s s: loads of %s "
                "failed, vLLM recomputes their blocks",
                layer_name,
                self.config.layerwise_timeout_s,
                ", ".join(map(repr, sorted(step.jobs))),
            )

    def _finish_layer_loads(self) -> set[str]:
        """After the forward: wait for this step's layer-wise loads to resolve (at most ``layerwise_timeout_s``);
        every block of a failed one becomes a load error of this step. Returns the failed loads' requests."""
        step, self._layer_loads = self._layer_loads, None
        if step is None:
            return set()
        step.wait_settled(self.config.layerwise_timeout_s)
        failed = step.outcome()
        for rid in failed:
            self._load_errors.update(step.jobs[rid])
        self.layerwise_failed += len(failed)
        if not step.settled:
            self._unsettled.append(step)  # its copies may still write: the next forward waits for them
        return failed

    def _conclude_layer_loads(self) -> None:
        failed = self._finish_layer_loads()
        if failed:
            # The forward computed these requests over blocks that hold no valid KV: vLLM discards that and
            # recomputes; aiokv stores nothing more for them (handed over before this step's steps).
            call_in_loop(self._running_loop(), lambda: self._give_up(failed))

    def _wait_unsettled(self) -> None:
        """Before a forward: the copies of loads given up on past their timeout must have ended (vLLM
        recomputes into their blocks), bounded like a preemption (only a hung copy takes that long)."""
        while self._unsettled:
            step = self._unsettled[0]
            if not step.wait_copies(_PREEMPT_TIMEOUT_S):
                raise TimeoutError(
                    f"aiokv: layer-wise loads of {sorted(step.jobs)} still copying after {_PREEMPT_TIMEOUT_S} s"
                )
            self._unsettled.pop(0)

    def _prepare(self, meta: AiokvConnectorMetadata) -> None:
        if self._prepared is meta:
            return
        self._prepared = meta
        if self._layer_loads is not None:  # a step that never reached wait_for_save
            self._conclude_layer_loads()
        if self._unsettled:
            self._wait_unsettled()
        if not (meta.lookups or meta.loads or meta.ended or meta.preempted or meta.drops):
            return
        # Layer-wise loads are not reported in finished_recving: not outstanding.
        loads = 0 if self.layerwise else len(meta.loads)
        self._outstanding += len(meta.lookups) + loads + sum(e.report for e in meta.ended)
        submit_loads = not self.layerwise
        waited: concurrent.futures.Future[None] = call_in_loop(
            self._running_loop(), lambda: self._on_prepare(meta, submit_loads)
        )
        if meta.preempted:
            self._wait_preempted(waited)
        elif meta.drops or any(e.drops for e in meta.ended):
            self._wait_dropped(waited)

    def _wait_preempted(self, preempted: concurrent.futures.Future[None]) -> None:
        """Block vLLM's thread until every preempted request's copies have ended: vLLM freed their blocks
        already, and this step's forward may write them."""
        preempted.result(_PREEMPT_TIMEOUT_S)

    def _wait_dropped(self, dropped: concurrent.futures.Future[None]) -> None:
        """Several groups: block vLLM's thread until every copy that may read the sliding-window blocks vLLM
        freed (and may write in this step's forward) has ended."""
        dropped.result(_PREEMPT_TIMEOUT_S)

    def wait_for_save(self, meta: AiokvConnectorMetadata) -> None:
        """After the forward: this step's tokens and blocks, in one hand-over; stores follow on the loop."""
        if self._layer_loads is not None:
            self._conclude_layer_loads()
        if not meta.steps:
            return
        sample: tuple[int, float] | None = None
        n, pre = meta.num_scheduled_tokens, meta.num_prefill_tokens
        # A forward that was mostly prefill is a sample of the engine's prefill rate (the planner's input).
        # Not on CUDA: there the forward is only launched by now, not done.
        mostly_prefill = self._step_started and pre >= 2 * self.block_size and 5 * pre >= 4 * n
        if mostly_prefill and self.off is not None and not self.off.layout.is_cuda:
            sample = (pre, time.perf_counter() - self._step_started)
        call_in_loop(self._running_loop(), lambda: self._on_steps(meta.steps, sample))

    def get_transfer_results(self, idle: bool) -> tuple[set[str], set[str], set[str]]:
        if idle and self._outstanding and not (self._lookups_done or self._loads_done or self._sent_done):
            with self._outcome:
                self._outcome.wait_for(
                    lambda: bool(self._lookups_done or self._loads_done or self._sent_done),
                    timeout=self.config.lookup_wait_s,
                )
        sending: set[str] = set()
        while self._sent_done:
            sending.add(self._sent_done.popleft())
        recving: set[str] = set()
        failed: set[str] = set()
        while self._loads_done:
            rid, load_failed, bad = self._loads_done.popleft()
            recving.add(rid)
            if load_failed:
                failed.add(rid)
                self._load_errors.update(bad)
        self._outstanding -= len(sending) + len(recving)
        return sending, recving, failed

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def build_connector_worker_meta(self) -> AiokvWorkerMetadata | None:
        if not self._lookups_done:
            return None
        answers: dict[tuple[str, int], tuple[int, int]] = {}
        while self._lookups_done:
            rid, seq, tokens = self._lookups_done.popleft()
            answers[(rid, seq)] = (1, tokens)
            self._outstanding -= 1
        return AiokvWorkerMetadata(lookups=answers)

    def _running_loop(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            from .._errors import ClosedError

            raise ClosedError("the aiokv connector's worker is not running (register_kv_caches not called)")
        return self._loop

    # ------------------------------------------------------------------ the loop thread
    def _report(self, queue: deque[Any], item: Any) -> None:
        queue.append(item)
        with self._outcome:
            self._outcome.notify_all()

    def _spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    def _on_prepare(self, meta: AiokvConnectorMetadata, submit_loads: bool = True) -> Any:
        """The step's jobs, in one loop callback (so a later hand-over of this step runs after all of them);
        returns an awaitable resolving once the preempted and dropped blocks may be reused, or ``None``."""
        fences: list[Any] = [self._drop(job.req_id, job.block_ids) for job in meta.drops]
        for job in meta.ended:
            fences.append(self._end(job))
        for lookup in meta.lookups:
            self._lookup(lookup)
        fences += [self._preempt(job) for job in meta.preempted]
        fences = [f for f in fences if f is not None]
        if self.groups is not None and fences:
            # A load may write a block vLLM just freed from a sliding-window position: only once every copy
            # that may still read it is done.
            return self._load_after(fences, meta.loads)
        if submit_loads:
            for load in meta.loads:
                self._load(load)
        return asyncio.gather(*fences) if fences else None

    async def _load_after(self, fences: list[Any], loads: list[LoadJob]) -> None:
        await asyncio.gather(*fences)
        for load in loads:
            self._load(load)

    def _on_layer_loads(self, step: _LayerLoads, loads: list[LoadJob]) -> None:
        """Layer-wise mode: submit the step's loads, layer by layer, and follow them."""
        watched: list[tuple[str, Any, int]] = []
        for job in loads:
            req = self._reqs.get(job.req_id)
            try:
                if req is None:
                    raise LookupError(f"load of unknown request {job.req_id!r}")
                pending = req.load(job.block_ids, present_blocks=job.present_blocks, layerwise=True)  # type: ignore[arg-type]
            except Exception:
                _log.exception("aiokv: load of request %r refused; its blocks are recomputed", job.req_id)
                step.fail(job.req_id)
                continue
            watched.append((job.req_id, pending, len(job.block_ids) * self.block_size))
        self._spawn(self._watch_layers(step, watched))

    async def _watch_layers(self, step: _LayerLoads, watched: list[tuple[str, Any, int]]) -> None:
        """Advance ``step`` layer by layer as every load's layer is in place; then await the loads themselves
        (the aiokv requests' state is final once they resolved)."""
        complete = False
        try:
            for index in range(self._num_layers):
                for rid, pending, expected in watched:
                    if rid in step.failed:
                        continue
                    try:
                        ok = await pending.layer(index) >= expected
                    except Exception:
                        _log.exception("aiokv: layer-wise load of request %r failed", rid)
                        ok = False
                    if not ok:
                        step.fail(rid)
                step.advance(index + 1)
            for rid, pending, expected in watched:
                try:
                    ok = await pending >= expected
                except Exception:
                    _log.exception("aiokv: layer-wise load of request %r failed", rid)
                    ok = False
                if not ok:
                    step.fail(rid)
            complete = True
        finally:
            if not complete:  # cancelled (the loop is closing): nothing of this step may be served
                for rid in step.jobs:
                    step.fail(rid)
            step.settle()

    def _give_up(self, rids: set[str]) -> None:
        """Layer-wise loads of these requests failed while vLLM's forward computed over their blocks: store
        nothing more for them (aborted in aiokv; vLLM recomputes and goes on; a later lookup is a miss)."""
        for rid in rids:
            _log.warning(
                "aiokv: layer-wise load of request %r failed; its blocks are recomputed and nothing more of it "
                "is stored",
                rid,
            )
            self._given_up.add(rid)
            req = self._reqs.get(rid)
            if req is not None and not req.done:
                self._spawn(_quietly(req.abort()))

    def _drop(self, rid: str, block_ids: tuple[list[int], ...] | None) -> Any:
        """Several groups: vLLM freed these sliding-window blocks of the request; tell aiokv (the ones its table
        still names). Returns an awaitable resolving once no copy may read them, or ``None``."""
        req = self._reqs.get(rid)
        if req is None or req.done or not block_ids:
            return None
        rows: Any = req.block_ids  # a grouped request's rows: one id per group
        held = {(g, b) for row in rows for g, b in enumerate(row) if b >= 0}
        ids = tuple([b for b in group if (g, b) in held] for g, group in enumerate(block_ids))
        if not any(ids):
            return None
        try:
            pending = req.drop_blocks(ids)
        except Exception:
            # Cannot happen for a request in step with vLLM; then nothing more is stored from it.
            self._poison(req, rid)
            return _quietly(req.abort())
        self.blocks_dropped += sum(len(g) for g in ids)
        return _quietly(pending)

    def _on_steps(self, steps: list[StepJob], sample: tuple[int, float] | None) -> None:
        off = self.off
        assert off is not None
        for job in steps:
            if job.req_id in self._given_up:
                continue
            req = self._reqs.get(job.req_id)
            try:
                if req is None:  # never looked up (vLLM skipped the connector): open it now
                    if not job.new_tokens:
                        continue
                    req = self._reqs[job.req_id] = off.open(job.req_id, job.new_tokens)
                    self._catch_up(req, [], job.num_computed_tokens, job.new_blocks)
                else:
                    if job.full_table and req.block_ids and not req.done:
                        # A new table for a request still holding one (a load that failed on some worker):
                        # give the old one up first; nothing reads it (a failed load stores nothing).
                        self._spawn(_quietly(req.preempt()))
                    self._catch_up(req, job.new_tokens, job.num_computed_tokens, job.new_blocks)
            except Exception:
                self._poison(req, job.req_id)
        if sample is not None:
            with contextlib.suppress(Exception):
                off.record_prefill(*sample)

    def _catch_up(self, req: Request, tokens: list[int], computed: int, blocks: Any) -> None:
        """Apply a step, claiming no more computed tokens than the worker knows tokens of (vLLM's asynchronous
        scheduling reports a step before its sampled token: that block is stored by a later step)."""
        from .. import RequestState

        if req.state in (RequestState.FINISHING, RequestState.FINISHED, RequestState.ABORTED):
            return
        known = len(req.token_ids) + len(tokens)
        n = min(computed, known)
        if req.state is RequestState.RUNNING:
            n = max(n, req.num_computed_tokens)
        req.step(n, tokens, blocks)

    def _poison(self, req: Request | None, rid: str) -> None:
        """The worker's view of a request and vLLM's disagree (a bug): store nothing more for it."""
        self.step_errors += 1
        _log.exception("aiokv: step of request %r refused; nothing more is stored for it", rid)
        if req is not None and not req.done:
            self._spawn(_quietly(req.abort()))

    def _lookup(self, job: LookupJob) -> None:
        off = self.off
        assert off is not None
        if job.req_id in self._given_up:  # nothing more of it is stored, nor restored
            self._report(self._lookups_done, (job.req_id, job.seq, 0))
            return
        req = self._reqs.get(job.req_id)
        try:
            if req is None:
                req = self._reqs[job.req_id] = off.open(
                    job.req_id, job.new_tokens, job.salt, extra_keys=job.extra_keys
                )
            elif job.new_tokens:
                req.append_tokens(job.new_tokens)
            pending = req.lookup()
        except Exception:
            _log.exception("aiokv: lookup of request %r failed; answered as a miss", job.req_id)
            self._report(self._lookups_done, (job.req_id, job.seq, 0))
            return

        async def answer() -> None:
            try:
                tokens = await pending
            except Exception:
                _log.exception("aiokv: lookup of request %r failed; answered as a miss", job.req_id)
                tokens = 0
            self._report(self._lookups_done, (job.req_id, job.seq, tokens))

        self._spawn(answer())

    def _load(self, job: LoadJob) -> None:
        req = self._reqs.get(job.req_id)
        if self.groups is None:
            ids: Any = job.block_ids
            expected = len(ids) * self.block_size
            failed: list[int] = ids[job.present_blocks :]
        else:
            # vLLM refuses block-level load errors with several groups: a failed load is failed_recving only
            # (vLLM recomputes the request).
            expected = len(job.block_ids[0]) * self.block_size  # type: ignore[arg-type]
            failed = []
        try:
            if req is None:
                raise LookupError(f"load of unknown request {job.req_id!r}")
            pending = req.load(job.block_ids, present_blocks=job.present_blocks)  # type: ignore[arg-type]
        except Exception:
            _log.exception("aiokv: load of request %r refused; its blocks are recomputed", job.req_id)
            self._report(self._loads_done, (job.req_id, self.groups is not None or bool(failed), failed))
            return

        async def done() -> None:
            try:
                restored = await pending
            except Exception:
                _log.exception("aiokv: load of request %r failed; its blocks are recomputed", job.req_id)
                restored = 0
            ok = restored >= expected
            bad = [] if ok else failed
            self._report(
                self._loads_done, (job.req_id, not ok and (self.groups is not None or bool(bad)), bad)
            )

        self._spawn(done())

    async def _preempt(self, job: EndJob) -> None:
        req = self._reqs.get(job.req_id)
        if req is None or req.done:
            return
        if job.req_id in self._given_up:
            await _quietly(req.abort())  # resolves once its copies are done
            return
        dropped = self._drop(job.req_id, job.drops)
        if dropped is not None:
            await dropped  # the preemption's final store skips them
        try:
            self._catch_up(req, job.new_tokens, job.num_computed_tokens, [])
        except Exception:
            self._poison(req, job.req_id)
        from .. import RequestState

        if req.state in (RequestState.FINISHING, RequestState.FINISHED, RequestState.ABORTED):
            await _quietly(req.abort())  # resolves once its copies are done
        else:
            await _quietly(req.preempt())

    def _end(self, job: EndJob) -> Any:
        """Finish or abort the request; returns an awaitable resolving once no copy may read the blocks vLLM
        freed at the end (several groups, ``job.drops``), or ``None``."""
        fence = self._drop(job.req_id, job.drops)
        req = self._reqs.pop(job.req_id, None)
        if job.req_id in self._given_up:
            self._given_up.discard(job.req_id)
            if req is not None:
                ending0 = req.abort()  # idempotent: resolves once its copies are done

                async def released() -> None:
                    await _quietly(ending0)
                    if job.report:
                        self._report(self._sent_done, job.req_id)

                self._spawn(released())
                return fence
        if req is None or req.done:
            if job.report:
                self._report(self._sent_done, job.req_id)
            return fence
        from .. import RequestState

        ending: Any
        try:
            if job.kind == "finish" and req.state is RequestState.RUNNING:
                self._catch_up(req, job.new_tokens, job.num_computed_tokens, [])
            ending = req.finish() if job.kind == "finish" else req.abort()
        except Exception:
            _log.exception("aiokv: end of request %r refused; aborting it", job.req_id)
            ending = req.abort()

        async def done() -> None:
            await _quietly(ending)
            if job.report:
                self._report(self._sent_done, job.req_id)

        self._spawn(done())
        return fence

    # ------------------------------------------------------------------ observability
    def stats(self) -> Any:
        """The offloader's stats snapshot, read on its loop (``None`` before ``register_kv_caches``)."""
        if self.off is None or self._loop is None:
            return None
        return call_in_loop(self._loop, self.off.stats).result(10)


async def _quietly(awaitable: Any) -> None:
    with contextlib.suppress(Exception):
        await awaitable


def _ranks(vllm_config: VllmConfig) -> tuple[int, int, int, int]:
    pc = vllm_config.parallel_config
    tp_size, pp_size = int(pc.tensor_parallel_size), int(pc.pipeline_parallel_size)
    tp_rank = pp_rank = 0
    try:
        from vllm.distributed.parallel_state import get_pp_group, get_tp_group

        tp_rank = get_tp_group().rank_in_group
        pp_rank = get_pp_group().rank_in_group
    except Exception:  # no distributed state (a test driving the worker directly)
        tp_rank = int(getattr(pc, "rank", 0)) % max(tp_size, 1)
    return tp_rank, tp_size, pp_rank, pp_size
