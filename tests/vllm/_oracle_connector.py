"""A test-only KV connector whose "external store" is an oracle for the harness's fake KV.

It exists to prove the harness handles every connector flow vLLM 0.32 has before a real
connector is plugged in.  Load via ``kv_connector="OracleConnector",
kv_connector_module_path="tests.vllm._oracle_connector"``; extra config keys:

- ``load_async`` (bool): loads finish between steps (WAITING_FOR_REMOTE_KVS) instead of
  synchronously in ``start_load_kv`` before the forward.
- ``async_delay`` (int, default 1): steps before an async load is reported in
  ``finished_recving``.
- ``fail_first_block`` (bool): the first block of a request's first load is not written
  and is reported through ``get_block_ids_with_load_errors``.
- ``corrupt_load`` (bool): write wrong KV into the first loaded block and report success
  (the harness must catch this).
- ``delay_free_steps`` (int, default 0): ``request_finished`` keeps the blocks and the worker
  reports ``finished_sending`` that many steps later, after checking the blocks still hold the
  request's KV (i.e. vLLM did not reuse them early).

Requests opt in to external hits with ``kv_transfer_params={"oracle": True}``; the store
"has" every full block of the prompt except the last token's block boundary.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
)

from ._harness import kv_pattern, prefix_keys


@dataclass
class _Load:
    token_ids: list[int]
    block_ids: list[int]
    start: int
    end: int


@dataclass
class OracleMetadata(KVConnectorMetadata):
    loads: dict[str, _Load] = field(default_factory=dict)
    held: dict[str, _Load] = field(default_factory=dict)  # finished requests whose blocks we hold


class OracleConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any):
        super().__init__(vllm_config, role, kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config
        self.load_async = bool(extra.get("load_async", False))
        self.async_delay = int(extra.get("async_delay", 1))
        self.fail_first_block = bool(extra.get("fail_first_block", False))
        self.corrupt_load = bool(extra.get("corrupt_load", False))
        self.delay_free_steps = int(extra.get("delay_free_steps", 0))
        self.block_size = vllm_config.cache_config.block_size
        # scheduler side
        self._local: dict[str, int] = {}
        self._pending: dict[str, _Load] = {}
        self._held: dict[str, _Load] = {}
        self.num_loads = 0
        # worker side
        self.kv_caches: dict[str, torch.Tensor] = {}
        self._inflight: dict[str, int] = {}  # req_id -> steps left
        self._sending: dict[str, tuple[int, _Load]] = {}
        self._errors: set[int] = set()
        self._failed_once: set[str] = set()
        self.sent_ok: list[str] = []

    # ---------------------------------------------------------------- scheduler side

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        params = request.kv_transfer_params or {}
        if not params.get("oracle"):
            return 0, False
        available = (len(request.prompt_token_ids) - 1) // self.block_size * self.block_size
        n = max(0, available - num_computed_tokens)
        self._local[request.request_id] = num_computed_tokens
        return n, self.load_async and n > 0

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        if num_external_tokens <= 0:
            return
        start = self._local.pop(request.request_id)
        end = start + num_external_tokens
        self._pending[request.request_id] = _Load(
            list(request.all_token_ids[:end]), list(blocks.get_block_ids()[0]), start, end
        )
        self.num_loads += 1

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        meta = OracleMetadata(loads=self._pending, held=self._held)
        self._pending, self._held = {}, {}
        return meta

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        if self.delay_free_steps <= 0 or not block_ids:
            return False, None
        n = min(request.num_computed_tokens, len(block_ids) * self.block_size)
        self._held[request.request_id] = _Load(list(request.all_token_ids[:n]), list(block_ids), 0, n)
        return True, None

    # ---------------------------------------------------------------- worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.kv_caches = kv_caches

    def _write(self, req_id: str, load: _Load, corrupt: bool) -> set[int]:
        bs = self.block_size
        keys = prefix_keys(load.token_ids[: load.end])
        failed: set[int] = set()
        pos = list(range(load.start, load.end))
        if self.fail_first_block and pos and req_id not in self._failed_once:
            self._failed_once.add(req_id)
            first = load.block_ids[load.start // bs]
            failed.add(first)
            pos = [p for p in pos if load.block_ids[p // bs] != first]
        if not pos:
            return failed
        p = torch.as_tensor(pos, dtype=torch.int64)
        b = torch.as_tensor([load.block_ids[i // bs] for i in pos], dtype=torch.int64)
        for layer_idx, kv in enumerate(self.kv_caches.values()):
            _, heads, _, content = kv.shape
            val = kv_pattern([keys[i] for i in pos], layer_idx, heads, content, kv.dtype)
            if corrupt:
                val[: bs - load.start % bs] += 1
            kv[b, :, p % bs] = val
        return failed

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, OracleMetadata)
        for req_id, load in meta.loads.items():
            # Errors are reported in this pass: for sync loads that is required, for async
            # loads it is allowed (any pass up to the one reporting finished_recving).
            self._errors |= self._write(req_id, load, self.corrupt_load)
            if self.load_async:
                self._inflight[req_id] = self.async_delay
        for req_id, held in meta.held.items():
            self._sending[req_id] = (self.delay_free_steps, held)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return None

    def wait_for_save(self) -> None:
        return None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        out = KVConnectorTransferResults()
        for req_id in list(self._inflight):
            self._inflight[req_id] -= 1
            if self._inflight[req_id] <= 0:
                del self._inflight[req_id]
                out.finished_recving.add(req_id)
        for req_id in list(self._sending):
            left, held = self._sending[req_id]
            if left > 1:
                self._sending[req_id] = (left - 1, held)
                continue
            del self._sending[req_id]
            self._check_held(req_id, held)
            out.finished_sending.add(req_id)
        return out

    def _check_held(self, req_id: str, held: _Load) -> None:
        """The blocks of a finished request we hold must still contain its KV."""
        bs = self.block_size
        keys = prefix_keys(held.token_ids)
        pos = torch.arange(held.end, dtype=torch.int64)
        b = torch.as_tensor([held.block_ids[i // bs] for i in range(held.end)], dtype=torch.int64)
        for layer_idx, kv in enumerate(self.kv_caches.values()):
            _, heads, _, content = kv.shape
            exp = kv_pattern(keys, layer_idx, heads, content, kv.dtype)
            if not torch.equal(kv[b, :, pos % bs], exp):
                raise AssertionError(f"held blocks of finished request {req_id} were overwritten")
        self.sent_ok.append(req_id)

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._errors = self._errors, set()
        return errors
