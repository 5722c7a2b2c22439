"""The in-process engine harness (tests/vllm/_harness.py) with vLLM's hybrid KV-cache manager: two KV-cache groups,
layer 0 with a sliding window (``SlidingWindowSpec``) and layer 1 with full attention, as Gemma 3 alternates them.

vLLM's real scheduler runs its ``HybridKVCacheCoordinator`` over the two groups; the KV tensors come from vLLM's
``allocate_kv_cache``, so the groups overlay each other as in the engine (block ``b`` of layer 0 and of layer 1 are
the same bytes; a block id belongs to one group at a time). :class:`HybridWorker` is the harness's ``FakeWorker``
with a block table per group: each layer writes its scheduled tokens' KV through its own group's table, and before
attention checks every position it attends (all of them for full attention, the window for the sliding layer:
query ``p`` attends ``p - W + 1 .. p``) holds exactly what a recompute writes. A sliding block that vLLM reused
under a store still reading it, or a restore of wrong window KV, fails the check byte-exactly.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.v1.core.kv_cache_utils import (
    get_block_hash,
    get_group_id,
    get_kv_cache_config_from_groups,
    resolve_cache_hit_alignment_tokens,
    resolve_kv_cache_block_sizes,
)
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, SlidingWindowSpec
from vllm.v1.worker.utils import allocate_kv_cache, copy_kv_cache_blocks_inplace

from tests.vllm._harness import (
    EOS_TOKEN_ID,
    EngineHarness,
    FakeAttentionLayer,
    FakeWorker,
    KVViolation,
    _ReqState,
    kv_pattern,
    layer_names,
    make_scheduler,
    make_vllm_config,
    prefix_keys,
)

__all__ = ["HybridEngine", "HybridWorker", "hybrid_kv_cache_config", "make_hybrid_engine"]


def hybrid_kv_cache_config(vllm_config: Any, num_blocks: int, window: int) -> KVCacheConfig:
    """Group 0: layer 0 with a ``window``-token sliding window; group 1: layer 1, full attention (Gemma 3's shape)."""
    mc = vllm_config.model_config
    common = {
        "block_size": vllm_config.cache_config.block_size,
        "num_kv_heads": mc.get_num_kv_heads(vllm_config.parallel_config),
        "head_size": mc.get_head_size(),
        "dtype": mc.dtype,
    }
    names = layer_names(2)
    groups = [
        KVCacheGroupSpec([names[0]], SlidingWindowSpec(sliding_window=window, **common)),
        KVCacheGroupSpec([names[1]], FullAttentionSpec(**common)),
    ]
    vllm_config.cache_config.num_gpu_blocks_override = num_blocks
    page = groups[0].kv_cache_spec.page_size_bytes
    config = get_kv_cache_config_from_groups(vllm_config, groups, available_memory=num_blocks * page)
    config.kv_cache_layout = vllm_config.cache_config.kv_cache_layout
    scheduler_block_size, hash_block_size = resolve_kv_cache_block_sizes(config, vllm_config)
    config.hash_block_size = hash_block_size
    config.cache_hit_alignment_tokens = resolve_cache_hit_alignment_tokens(
        config, vllm_config, scheduler_block_size, hash_block_size
    )
    vllm_config.cache_config.num_gpu_blocks = num_blocks
    return config


class HybridWorker(FakeWorker):
    """``FakeWorker`` over a two-group config: per-group block tables (``_ReqState.block_ids`` holds one list per
    group here), sliding-window attention checks in the sliding layer."""

    def __init__(
        self,
        vllm_config: Any,
        kv_cache_config: KVCacheConfig,
        *,
        eos_every: int | None = None,
        strict: bool = True,
    ) -> None:
        self.vllm_config = vllm_config
        self.kv_cache_config = kv_cache_config
        self.block_size = vllm_config.cache_config.block_size
        self.num_blocks = kv_cache_config.num_blocks
        self.vocab_size = vllm_config.model_config.get_vocab_size()
        self.eos_every = eos_every
        self.eos_token_id = EOS_TOKEN_ID
        self.strict = strict
        self.async_scheduling = bool(vllm_config.scheduler_config.async_scheduling)
        self.layer_names = layer_names(2)
        self.layer_group: dict[str, int] = {}
        self.windows: list[int | None] = []
        for gi, group in enumerate(kv_cache_config.kv_cache_groups):
            spec = group.kv_cache_spec
            self.windows.append(spec.sliding_window if isinstance(spec, SlidingWindowSpec) else None)
            for name in group.layer_names:
                self.layer_group[name] = gi
            self.dtype = spec.dtype
            self.num_kv_heads = spec.num_kv_heads
            self.content = spec.head_size + spec.head_size_v
        self.kv_caches: dict[str, torch.Tensor] = allocate_kv_cache(
            kv_cache_config, torch.device("cpu"), vllm_config.cache_config.get_resolved_kv_cache_layout()
        )
        assert (
            self.kv_caches[self.layer_names[0]].data_ptr() == self.kv_caches[self.layer_names[1]].data_ptr()
        )
        self.layers = {name: FakeAttentionLayer(name, self.kv_caches[name]) for name in self.layer_names}
        self.connector = None
        if vllm_config.kv_transfer_config is not None:
            self.connector = KVConnectorFactory.create_connector(
                config=vllm_config, role=KVConnectorRole.WORKER, kv_cache_config=kv_cache_config
            )
            self.connector.register_kv_caches(self.kv_caches)
        self.requests: dict[str, _ReqState] = {}
        self._prev_scheduled: set[str] = set()
        self.step_count = 0
        self.violations: list[KVViolation] = []
        self.tolerated_violations: list[KVViolation] = []
        self.hook_log: list[str] = []
        self.last_kv_connector_output = None

    # ------------------------------------------------------------------ checks
    def attended(self, gi: int, start: int, end: int) -> range:
        """Positions a chunk ``[start, end)`` attends in group ``gi``."""
        window = self.windows[gi]
        return range(0 if window is None else max(0, start - window + 1), end)

    def check_group_block(
        self, gi: int, block_id: int, token_ids: Sequence[int], block_index: int
    ) -> list[int]:
        """Positions of block ``block_index`` of ``token_ids`` whose KV in block ``block_id`` of group ``gi``'s
        layers is not a recompute's."""
        start = block_index * self.block_size
        end = min(start + self.block_size, len(token_ids))
        keys = prefix_keys(token_ids[:end])[start:end]
        bad: set[int] = set()
        for idx, name in enumerate(self.layer_names):
            if self.layer_group[name] != gi:
                continue
            exp = kv_pattern(keys, idx, self.num_kv_heads, self.content, self.dtype)
            got = self.kv_caches[name][block_id, :, : end - start].transpose(0, 1)
            bad.update(start + m for m in (got != exp).flatten(1).any(1).nonzero().flatten().tolist())
        return sorted(bad)

    # ------------------------------------------------------------------ step
    def _update_states(self, so: SchedulerOutput) -> None:
        for req_id in so.finished_req_ids:
            self.requests.pop(req_id, None)
        if so.new_block_ids_to_zero:
            for kv in self.kv_caches.values():
                kv[torch.as_tensor(so.new_block_ids_to_zero, dtype=torch.int64)] = 0
        if so.kv_cache_block_copies:
            copy_kv_cache_blocks_inplace(self.kv_caches.values(), self.num_blocks, so.kv_cache_block_copies)
        for new in so.scheduled_new_reqs:
            assert new.prompt_token_ids is not None
            self.requests[new.req_id] = _ReqState(
                req_id=new.req_id,
                prompt_token_ids=list(new.prompt_token_ids),
                block_ids=[list(g) for g in new.block_ids],
                num_computed_tokens=new.num_computed_tokens,
            )
        cached = so.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            st = self.requests[req_id]
            st.num_computed_tokens = cached.num_computed_tokens[i]
            num_output_tokens = cached.num_output_tokens[i]
            if num_output_tokens < len(st.output_token_ids):
                del st.output_token_ids[num_output_tokens:]
            new_block_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                assert new_block_ids is not None
                st.block_ids = [list(g) for g in new_block_ids]
            elif new_block_ids is not None:
                for table, ids in zip(st.block_ids, new_block_ids, strict=True):
                    table.extend(ids)
            if self.async_scheduling and num_output_tokens > 0 and req_id in cached.all_token_ids:
                st.output_token_ids = list(cached.all_token_ids[req_id][-num_output_tokens:])

    def _prepare(self, so: SchedulerOutput, batch: list, violations: list[KVViolation]):  # type: ignore[no-untyped-def]
        bs = self.block_size
        plan = []
        for req_id, st, n in batch:
            start, end = st.num_computed_tokens, st.num_computed_tokens + n
            assert end <= len(st.token_ids), (req_id, start, n)
            for gi, table in enumerate(st.block_ids):
                need = self.attended(gi, start, end)
                if len(table) * bs < end or any(table[p // bs] == 0 for p in need):
                    violations.append(
                        KVViolation(
                            self.step_count,
                            req_id,
                            f"group {gi}",
                            "block_table",
                            list(need),
                            list(table),
                            f"needs real blocks for positions {need.start}..{need.stop - 1}, table {table}",
                        )
                    )
                    raise AssertionError(str(violations[-1]))
            plan.append((req_id, st, start, end))
        return {name: None for name in self.layer_names}, {}, plan

    def _forward(self, plan: list, attn_metadata: dict[str, Any], violations: list[KVViolation]) -> None:
        bs = self.block_size
        for layer_idx, name in enumerate(self.layer_names):
            gi = self.layer_group[name]
            kv = self.kv_caches[name]
            for _req_id, st, start, end in plan:
                table = st.block_ids[gi]
                pos = torch.arange(start, end, dtype=torch.int64)
                blk = torch.as_tensor([table[p // bs] for p in range(start, end)], dtype=torch.int64)
                keys = st.keys(end)
                kv[blk, :, pos % bs] = kv_pattern(
                    keys[start:end], layer_idx, self.num_kv_heads, self.content, self.dtype
                )
            if self.connector is not None:
                self._call("wait_for_layer_load", name)
            for req_id, st, start, end in plan:
                table = st.block_ids[gi]
                need = list(self.attended(gi, start, end))
                pos = torch.as_tensor(need, dtype=torch.int64)
                blk = torch.as_tensor([table[p // bs] for p in need], dtype=torch.int64)
                got = kv[blk, :, pos % bs]
                exp = kv_pattern(
                    st.keys(end)[need[0] :], layer_idx, self.num_kv_heads, self.content, self.dtype
                )
                if not torch.equal(got, exp):
                    bad = (got != exp).flatten(1).any(1).nonzero().flatten().tolist()
                    violations.append(
                        KVViolation(
                            self.step_count,
                            req_id,
                            name,
                            "context",
                            [need[b] for b in bad],
                            [table[need[b] // bs] for b in bad],
                            f"group {gi}, num_computed_tokens={st.num_computed_tokens}, seq_len={end}",
                        )
                    )
            if self.connector is not None:
                self._call("save_kv_layer", name, kv, attn_metadata[name])


class HybridEngine(EngineHarness):
    """``EngineHarness`` whose prefix-cache check knows which group each cached block belongs to."""

    worker: HybridWorker

    def verify_cached_blocks(self) -> list[str]:
        problems = []
        bs = self.worker.block_size
        for block in self.scheduler.kv_cache_manager.block_pool.blocks:
            if block.block_hash is None or block.is_null:
                continue
            prefix = self._hash_registry.get(get_block_hash(block.block_hash))
            if prefix is None:
                problems.append(f"block {block.block_id}: hash of an unknown request")
                continue
            n = block.block_hash_num_tokens or len(prefix)
            index = (n - 1) // bs
            gi = get_group_id(block.block_hash)
            bad = self.worker.check_group_block(gi, block.block_id, prefix[:n], index)
            if bad:
                problems.append(
                    f"group {gi} block {block.block_id} (block #{index} of {n} tokens): {bad[:8]}"
                )
        return problems


def make_hybrid_engine(
    num_blocks: int, *, window: int, block_size: int = 16, **config_kw: Any
) -> HybridEngine:
    """A two-group engine harness (``config_kw``: :func:`make_vllm_config`'s, e.g. the connector)."""
    vllm_config = make_vllm_config(block_size=block_size, num_gpu_blocks=num_blocks, **config_kw)
    config = hybrid_kv_cache_config(vllm_config, num_blocks, window)
    scheduler = make_scheduler(vllm_config, num_blocks, kv_cache_config=config)
    assert len(scheduler.kv_cache_config.kv_cache_groups) == 2
    return HybridEngine(scheduler, HybridWorker(vllm_config, scheduler.kv_cache_config))
