"""The scheduler side of the connector: translates vLLM's scheduling decisions into worker jobs.

It holds no cache and no index: every block lives with the workers, each of which runs an
:class:`aiokv.Offloader` over its own KV tensors. This side only keeps, per request, what it has told the
workers (tokens and blocks sent, the lookup asked and its answer, whether stores may be in flight), so that
each engine step produces one :class:`AiokvConnectorMetadata`:

- ``get_num_new_matched_tokens`` answers from a worker lookup: the first call for an admission queues a
  :class:`LookupJob` and returns ``None`` ("ask again"), vLLM's protocol for an asynchronous lookup; once every
  worker has answered (the fewest tokens wins), the hit beyond vLLM's own prefix cache is returned, to be
  loaded asynchronously (with ``layerwise``: synchronously, in the step that schedules the request).
- ``update_state_after_alloc`` turns a hit into a :class:`LoadJob` into the blocks vLLM allocated.
- ``build_connector_meta`` adds one :class:`StepJob` per scheduled request and one preemption job per
  preempted request (the workers finish those before the step's forward may write the freed blocks).
- ``request_finished`` queues the end of a request and, when stores may still read its blocks, tells vLLM to
  keep them until the workers name the request in ``finished_sending``.

Several KV-cache groups (vLLM's hybrid KV-cache manager, e.g. Gemma 3's sliding-window and full-attention layers):
every job carries block ids per group (:data:`aiokv.NO_BLOCK` for vLLM's null block), and a
:class:`~aiokv.vllm._block_table.GroupBlockTables` follows each request's tables. vLLM frees a sliding-window
group's blocks silently as they leave the window and may hand them out again in the same step: each step, the
blocks it allocates (scheduler output and loads) that a sliding position of some request still names become a
:class:`DropJob` (or the ``drops`` of a preemption), and at the end of a request the blocks vLLM freed are the
``drops`` of its :class:`EndJob`; the workers wait for every copy that may read them before the step's forward.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .. import NO_BLOCK
from ._block_table import GroupBlockTables, block_ids_of, from_vllm_ids, vllm_groups
from ._meta import AiokvConnectorMetadata, AiokvWorkerMetadata, DropJob, EndJob, LoadJob, LookupJob, StepJob

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

    from ._config import ConnectorConfig

__all__ = ["SchedulerSide"]

_log = logging.getLogger("aiokv.vllm")


@dataclass(slots=True, eq=False)
class _Tracked:
    request: Request
    sent_tokens: int = 0  # leading tokens of request.all_token_ids the workers were sent
    sent_blocks: int = 0  # blocks of the current admission the workers were sent
    computed: int = 0  # num_computed_tokens of the last step sent
    seq: int = 0  # the current admission's lookup
    admission: int = -1  # request.num_preemptions when that lookup was asked
    votes: int = 0  # workers that answered it
    fewest: int = 0  # the fewest tokens any of them found
    hit: int | None = None  # the answer, once every worker gave one
    local: int = 0  # vLLM's own prefix-cache hit, as last passed to get_num_new_matched_tokens
    opened: bool = False  # a metadata carrying its lookup (or a step) was built: the workers know it
    running: bool = False  # scheduled since its last admission: its stores may be in flight


class SchedulerSide:
    """Scheduler-role half of :class:`~aiokv.vllm.AiokvConnector` (one per engine)."""

    def __init__(
        self, vllm_config: VllmConfig, config: ConnectorConfig, kv_cache_config: KVCacheConfig | None = None
    ) -> None:
        self.config = config
        self.block_size = int(vllm_config.cache_config.block_size)
        self.world_size = int(vllm_config.parallel_config.world_size)
        # Several KV-cache groups: per-group tables (None: one group, block ids as one list).
        groups = vllm_groups(kv_cache_config) if kv_cache_config is not None else None
        self.tables: GroupBlockTables | None = None
        self.num_groups = 1
        if groups is not None:
            self.block_size = groups[0].block_size
            self.num_groups = len(groups)
            sliding = [g.index for g in groups if g.kind == "sliding_window"]
            self.tables = GroupBlockTables(len(groups), sliding, self.block_size)
        self._allocated: set[int] = (
            set()
        )  # several groups: blocks allocated for loads since the last metadata
        self.blocks_dropped = 0  # several groups: sliding-window blocks reported freed to the workers
        self._reqs: dict[str, _Tracked] = {}
        self._lookups: dict[str, LookupJob] = {}
        self._loads: list[LoadJob] = []
        self._ended: list[EndJob] = []
        self._holding: set[str] = set()  # requests whose blocks vLLM keeps until we report them
        self.lookups_asked = 0
        self.tokens_offered = 0
        # Layer-wise mode: hits are loaded synchronously, in the step that schedules the request (the worker
        # submits them layer by layer in start_load_kv). Several groups: aiokv loads those whole, asynchronously.
        self.sync_loads = config.layerwise and self.tables is None
        if config.layerwise and self.tables is not None:
            _log.warning(
                "aiokv: kv_connector_extra_config['layerwise'] is ignored with several KV-cache groups: "
                "their loads stay asynchronous and whole"
            )

    # ------------------------------------------------------------------ admission
    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        rid = request.request_id
        t = self._reqs.get(rid)
        if t is None:
            t = self._reqs[rid] = _Tracked(request)
        if t.admission != request.num_preemptions:
            # A new admission (the first, or after a preemption): ask the workers; vLLM asks again next step.
            t.admission = request.num_preemptions
            t.seq += 1
            t.votes, t.fewest, t.hit = 0, 0, None
            tokens = request.all_token_ids
            new = list(tokens[t.sent_tokens :])
            t.sent_tokens = len(tokens)
            salt = request.cache_salt
            if self.config.salt is not None:
                salt = self.config.salt if salt is None else f"{self.config.salt}/{salt}"
            self._lookups[rid] = LookupJob(rid, t.seq, new, salt, _extra_keys(request))
            self.lookups_asked += 1
            return None, False
        if t.hit is None:
            return None, False
        t.local = num_computed_tokens
        if getattr(request, "skip_reading_prefix_cache", False):
            return 0, False
        ext = max(0, t.hit - num_computed_tokens)
        # Asynchronous loads: vLLM holds the request (WAITING_FOR_REMOTE_KVS) until finished_recving. Layer-wise
        # mode: a synchronous load, scheduled with the rest of the prompt in this very step.
        return ext, ext > 0 and not self.sync_loads

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        if num_external_tokens <= 0:
            return
        t = self._reqs[request.request_id]
        total = (t.local + num_external_tokens) // self.block_size
        present = t.local // self.block_size
        if self.tables is not None:
            groups = block_ids_of(blocks)
            # Written by the load (and this request's forwards): a sliding position still naming one is gone.
            self._allocated.update(b for g in groups for b in g[present:] if b != NO_BLOCK)
            self._loads.append(LoadJob(request.request_id, tuple(g[:total] for g in groups), present))
        else:
            ids = blocks.get_block_ids()[0]
            self._loads.append(LoadJob(request.request_id, list(ids[:total]), present))
        t.sent_blocks = total
        self.tokens_offered += num_external_tokens

    # ------------------------------------------------------------------ each step
    def build_connector_meta(self, so: SchedulerOutput) -> AiokvConnectorMetadata:
        meta = AiokvConnectorMetadata(
            lookups=list(self._lookups.values()),
            loads=self._loads,
            ended=self._ended,
            num_scheduled_tokens=so.total_num_scheduled_tokens,
        )
        for job in meta.lookups:
            tracked = self._reqs.get(job.req_id)
            if tracked is not None:
                tracked.opened = True
        self._lookups, self._loads, self._ended = {}, [], []
        if self.tables is not None:
            self._grouped_steps(meta, so)
            return meta
        for rid in so.preempted_req_ids or ():
            t = self._reqs.get(rid)
            if t is None:
                continue
            meta.preempted.append(EndJob(rid, "preempt", self._new_tokens(t), t.computed, False))
            t.running = False
            t.sent_blocks = 0
        nst = so.num_scheduled_tokens
        prefill = 0
        for nr in so.scheduled_new_reqs:
            t = self._tracked(nr.req_id)
            if t is None:
                continue
            ids = nr.block_ids[0]
            full = t.sent_blocks == 0
            prefill += self._step(meta, t, list(ids[t.sent_blocks :]), nst[nr.req_id], full)
            t.sent_blocks = len(ids)
        cached = so.scheduled_cached_reqs
        resumed = cached.resumed_req_ids
        for i, rid in enumerate(cached.req_ids):
            t = self._tracked(rid)
            if t is None:
                continue
            per_group = cached.new_block_ids[i]
            ids = per_group[0] if per_group else []
            full = False
            if rid in resumed:  # the whole table of the new admission
                full = t.sent_blocks == 0
                new = list(ids[t.sent_blocks :])
                t.sent_blocks = len(ids)
            else:
                new = list(ids)
                t.sent_blocks += len(new)
            prefill += self._step(meta, t, new, nst[rid], full)
        meta.num_prefill_tokens = prefill
        return meta

    def _grouped_steps(self, meta: AiokvConnectorMetadata, so: SchedulerOutput) -> None:
        """``build_connector_meta`` for several groups: per-group block ids, and the sliding-window blocks this
        step reallocates dropped from the requests that held them."""
        tables = self.tables
        assert tables is not None
        allocated, self._allocated = self._allocated, set()
        group_steps, released = tables.apply(so, allocated)
        preempted = set(so.preempted_req_ids or ())
        for rid in preempted:
            t = self._reqs.get(rid)
            if t is None:
                continue
            drops = released.pop(rid, None)
            meta.preempted.append(EndJob(rid, "preempt", self._new_tokens(t), t.computed, False, drops))
            t.running = False
            t.sent_blocks = 0
        for rid, ids in released.items():
            if rid in self._reqs and self._reqs[rid].opened:
                meta.drops.append(DropJob(rid, ids))
                self.blocks_dropped += sum(len(g) for g in ids)
        nst = so.num_scheduled_tokens
        prefill = 0
        for gs in group_steps:
            t = self._tracked(gs.req_id)
            if t is None:
                continue
            ids = gs.new_block_ids
            if gs.full_table:  # the whole table: a new request, or one resumed after a preemption
                full = t.sent_blocks == 0
                new = tuple(list(g[t.sent_blocks :]) for g in ids)
                t.sent_blocks = len(ids[0])
            else:
                full = False
                new = ids
                t.sent_blocks += len(ids[0])
            prefill += self._step(meta, t, new, nst[gs.req_id], full)
        meta.num_prefill_tokens = prefill

    def _tracked(self, rid: str) -> _Tracked | None:
        return self._reqs.get(rid)

    def _new_tokens(self, t: _Tracked) -> list[int]:
        tokens = t.request.all_token_ids
        if len(tokens) == t.sent_tokens:
            return []
        new = list(tokens[t.sent_tokens :])
        t.sent_tokens = len(tokens)
        return new

    def _step(
        self,
        meta: AiokvConnectorMetadata,
        t: _Tracked,
        new_blocks: list[int] | tuple[list[int], ...],
        scheduled: int,
        full: bool,
    ) -> int:
        req = t.request
        before = req.num_computed_tokens
        t.computed = before + scheduled
        t.running = True
        t.opened = True
        meta.steps.append(StepJob(req.request_id, self._new_tokens(t), new_blocks, t.computed, full))
        prompt = req.num_prompt_tokens
        return min(scheduled, prompt - before) if before < prompt else 0

    # ------------------------------------------------------------------ workers' answers
    def update_connector_output(self, output: KVConnectorOutput) -> None:
        wm = output.kv_connector_worker_meta
        if isinstance(wm, AiokvWorkerMetadata):
            for (rid, seq), (count, tokens) in wm.lookups.items():
                t = self._reqs.get(rid)
                if t is None or t.seq != seq or t.hit is not None:
                    continue
                t.fewest = tokens if t.votes == 0 else min(t.fewest, tokens)
                t.votes += count
                if t.votes >= self.world_size:
                    t.hit = t.fewest
        for rid in output.finished_sending or ():
            self._holding.discard(rid)
        for rid in getattr(output, "failed_recving", None) or ():
            t = self._reqs.get(rid)
            if t is not None:
                # vLLM recomputes from the first failed block (and frees the blocks if none before it was
                # valid): this admission is offered nothing more, and its next step sends the whole table.
                t.hit = 0
                t.sent_blocks = 0

    # ------------------------------------------------------------------ the end
    def request_finished(
        self, request: Request, block_ids: Iterable[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """One KV-cache group (vLLM's ``request_finished``)."""
        return self._finished(request, block_ids, None)

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """vLLM's ``SupportsHMA.request_finished_all_groups``: the request's blocks per group (vLLM freed the
        sliding-window blocks out of the window right before, and nulled them here)."""
        if self.tables is None:
            (ids,) = block_ids
            return self._finished(request, ids, None)
        groups = from_vllm_ids(block_ids, self.num_groups)
        drops = self.tables.finished(request.request_id, groups)
        held = [b for g in groups for b in g if b != NO_BLOCK]
        return self._finished(request, held, drops)

    def _finished(
        self, request: Request, block_ids: Iterable[int], drops: tuple[list[int], ...] | None
    ) -> tuple[bool, dict[str, Any] | None]:
        rid = request.request_id
        t = self._reqs.pop(rid, None)
        if t is None:
            return False, None
        if not t.opened:
            # Its lookup never left this process: the workers never heard of it.
            self._lookups.pop(rid, None)
            return False, None
        from vllm.v1.request import RequestStatus

        kind = "abort" if request.status == RequestStatus.FINISHED_ABORTED else "finish"
        # Only a request scheduled since its last admission can have stores reading its blocks; an async load
        # into them is fenced by vLLM itself (it frees them on finished_recving).
        report = t.running and any(True for _ in block_ids)
        computed = min(t.computed, request.num_computed_tokens) if t.running else 0
        if drops is not None and t.running and any(drops):
            self.blocks_dropped += sum(len(g) for g in drops)
        else:
            drops = None
        self._ended.append(EndJob(rid, kind, self._new_tokens(t), computed, report, drops))
        if report:
            self._holding.add(rid)
        return report, None

    def has_pending_block_frees(self) -> bool:
        return bool(self._holding)


def _extra_keys(request: Request) -> tuple[object, ...]:
    """Hash inputs beyond the tokens: the LoRA adapter and multimodal content (placeholder tokens alone
    would let two images share KV)."""
    keys: list[object] = []
    lora = request.lora_request
    if lora is not None:
        keys.append(("lora", str(lora.lora_name), int(lora.lora_int_id)))
    for feature in getattr(request, "mm_features", None) or ():
        ident = getattr(feature, "identifier", None) or getattr(feature, "mm_hash", None)
        pos = getattr(feature, "mm_position", None)
        offset = getattr(pos, "offset", None)
        keys.append(("mm", str(ident), -1 if offset is None else int(offset)))
    return tuple(keys)
