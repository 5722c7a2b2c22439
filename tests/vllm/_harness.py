"""In-process vLLM engine harness for KV-connector tests (CPU only, no model weights).

It drives vLLM's *real* ``Scheduler`` / ``AsyncScheduler`` and a ``FakeWorker``
that owns real per-layer KV-cache tensors and runs the worker-side connector hooks
in the order vLLM 0.32's V1 model runner does (the runner the CPU platform uses:
``CPUModelRunner`` subclasses ``GPUModelRunner``).

The "model" is fake but its KV is checkable: the KV of position ``p`` in layer
``l`` is a deterministic function of ``(l, token_ids[: p + 1])``
(:func:`kv_pattern` over :func:`prefix_keys`), and the sampled token is a
deterministic function of the prefix too.  Before attention "reads" the context,
the fake forward verifies every attended position holds exactly the value a
recompute would write, so a connector that restores wrong KV, loads into the
wrong block, or lets a block be overwritten is caught byte-exactly.

Per-step hook order (``FakeWorker.execute_model``), as in vLLM 0.32:

1. ``handle_preemptions(metadata)``            gpu_model_runner.py:3968-3971
2. ``_update_states``: drop finished requests, zero ``new_block_ids_to_zero``,
   apply ``kv_cache_block_copies``, update block tables    gpu_model_runner.py:1172-1430
3. inside ``_get_kv_connector_output`` (kv_connector_model_runner_mixin.py:62-107):
   ``bind_connector_metadata`` -> ``start_load_kv`` *before* the forward iff
   ``scheduler_output.has_sync_kv_loads`` -> forward -> ``start_load_kv`` after the
   forward otherwise -> ``wait_for_save`` -> ``get_transfer_results(finished_req_ids)``
   -> ``get_block_ids_with_load_errors`` -> ``get_kv_connector_stats`` ->
   ``get_kv_connector_kv_cache_events`` -> ``build_connector_worker_meta`` ->
   ``clear_connector_metadata``.  With no scheduled tokens the same sequence runs
   with an empty body and ``attn_metadata=None`` (``kv_connector_no_forward``).
4. forward, per layer, in model order (attention.py:540-560, kv_transfer_utils.py):
   KV write of the scheduled tokens (``unified_kv_cache_update``, which runs
   *before* the decorated attention op on the CPU backend) -> ``wait_for_layer_load``
   -> attention (here: the context check) -> ``save_kv_layer``.

``finish_forward`` is not called: only Model Runner V2 calls it.
"""

from __future__ import annotations

import functools
import itertools
import os
import tempfile
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch
from vllm import SamplingParams
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.forward_context import ForwardContext, override_forward_context
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_utils import (
    get_block_hash,
    get_kv_cache_config_from_groups,
    get_request_block_hasher,
    init_none_hash,
    resolve_cache_hit_alignment_tokens,
    resolve_kv_cache_block_sizes,
)
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager
from vllm.v1.worker.utils import allocate_kv_cache, copy_kv_cache_blocks_inplace

try:  # the metadata type the CPU attention backend builds
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend, CPUAttentionMetadata
except Exception:  # pragma: no cover - CPU backend unavailable
    CPUAttentionBackend = None  # type: ignore[assignment,misc]
    CPUAttentionMetadata = None  # type: ignore[assignment,misc]

__all__ = [
    "DEFAULT_VOCAB_SIZE",
    "EOS_TOKEN_ID",
    "EngineHarness",
    "FakeAttentionLayer",
    "FakeWorker",
    "KVViolation",
    "RequestResult",
    "assert_scheduler_empty",
    "kv_pattern",
    "layer_names",
    "make_engine",
    "make_kv_cache_config",
    "make_request",
    "make_scheduler",
    "make_vllm_config",
    "prefix_keys",
    "run_engine_steps",
]

DEFAULT_VOCAB_SIZE = 1024
EOS_TOKEN_ID = DEFAULT_VOCAB_SIZE - 1
#: The physical layout vLLM 0.32 resolves for the CPU attention backend
#: (``CPUAttentionBackend.supported_kv_cache_layouts() == (LBHNC,)``).
CPU_KV_CACHE_LAYOUT = "LBHNC"


# --------------------------------------------------------------------------- config


def layer_names(num_layers: int) -> list[str]:
    """Attention-layer names as a Llama model registers them (``extract_layer_index`` works)."""
    return [f"model.layers.{i}.self_attn.attn" for i in range(num_layers)]


@functools.cache
def _tiny_model_dir(
    num_layers: int, num_kv_heads: int, head_size: int, vocab_size: int, max_model_len: int
) -> str:
    """A directory holding only a tiny Llama ``config.json`` (no weights, no tokenizer)."""
    from transformers import LlamaConfig

    path = tempfile.mkdtemp(prefix="aiokv-vllm-tiny-llama-")
    LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=num_kv_heads * head_size,
        intermediate_size=2 * num_kv_heads * head_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_kv_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_size,
        max_position_embeddings=max_model_len,
        eos_token_id=vocab_size - 1,
        bos_token_id=0,
    ).save_pretrained(path)
    return path


def make_vllm_config(
    *,
    block_size: int = 16,
    num_gpu_blocks: int | None = None,
    max_num_batched_tokens: int = 64,
    max_num_seqs: int = 16,
    max_model_len: int = 1024,
    num_layers: int = 2,
    num_kv_heads: int = 2,
    head_size: int = 32,
    dtype: str = "float32",
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    enable_prefix_caching: bool = True,
    enable_chunked_prefill: bool = True,
    async_scheduling: bool = False,
    kv_cache_layout: str = CPU_KV_CACHE_LAYOUT,
    kv_connector: str | None = None,
    kv_connector_module_path: str | None = None,
    kv_role: str = "kv_both",
    kv_connector_extra_config: dict[str, Any] | None = None,
    kv_load_failure_policy: str | None = None,
    kv_transfer_config: KVTransferConfig | None = None,
) -> VllmConfig:
    """VllmConfig for a tiny weightless Llama on CPU (nothing is downloaded).

    ``kv_connector=None`` (and no ``kv_transfer_config``) means no connector.
    ``num_gpu_blocks`` is only recorded; :func:`make_scheduler` decides the pool size.
    ``async_scheduling`` selects ``AsyncScheduler`` and a batch queue of
    ``vllm_config.max_concurrent_batches`` (2) in :class:`EngineHarness`.
    """
    model_dir = _tiny_model_dir(num_layers, num_kv_heads, head_size, vocab_size, max_model_len)
    model_config = ModelConfig(
        model=model_dir,
        tokenizer=model_dir,
        skip_tokenizer_init=True,
        dtype=dtype,
        seed=0,
        max_model_len=max_model_len,
    )
    scheduler_config = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        enable_chunked_prefill=enable_chunked_prefill,
        is_encoder_decoder=False,
    )
    cache_config = CacheConfig(block_size=block_size, enable_prefix_caching=enable_prefix_caching)
    # The engine core resolves the layout once before allocating (see CacheConfig.kv_cache_layout);
    # pre-setting it is what vLLM's own connector tests do.
    cache_config.kv_cache_layout = kv_cache_layout
    if num_gpu_blocks is not None:
        cache_config.num_gpu_blocks_override = num_gpu_blocks
    if kv_transfer_config is None and kv_connector is not None:
        kwargs: dict[str, Any] = {}
        if kv_load_failure_policy is not None:
            kwargs["kv_load_failure_policy"] = kv_load_failure_policy
        kv_transfer_config = KVTransferConfig(
            kv_connector=kv_connector,
            kv_connector_module_path=kv_connector_module_path,
            kv_role=kv_role,
            kv_connector_extra_config=dict(kv_connector_extra_config or {}),
            **kwargs,
        )
    vllm_config = VllmConfig(
        model_config=model_config,
        scheduler_config=scheduler_config,
        cache_config=cache_config,
        device_config=DeviceConfig("cpu"),
        kv_transfer_config=kv_transfer_config,
    )
    # VllmConfig.__post_init__ decides async scheduling from the executor; force it like
    # vLLM's tests do (tests/v1/kv_connector/unit/offloading_connector/utils.py).
    vllm_config.scheduler_config.async_scheduling = async_scheduling
    if vllm_config.use_v2_model_runner:
        raise RuntimeError(
            "FakeWorker emulates the V1 model runner (what the CPU platform uses); "
            "unset VLLM_USE_V2_MODEL_RUNNER."
        )
    return vllm_config


def make_kv_cache_config(vllm_config: VllmConfig, num_blocks: int) -> KVCacheConfig:
    """One full-attention KV-cache group over all layers, with real ``kv_cache_tensors``.

    Built with vLLM's own ``get_kv_cache_config_from_groups`` so the per-layer tensors
    :class:`FakeWorker` allocates have the exact shapes/strides the engine would use.
    """
    model_config = vllm_config.model_config
    parallel_config = vllm_config.parallel_config
    spec = FullAttentionSpec(
        block_size=vllm_config.cache_config.block_size,
        num_kv_heads=model_config.get_num_kv_heads(parallel_config),
        head_size=model_config.get_head_size(),
        dtype=model_config.dtype,
    )
    names = layer_names(model_config.get_num_layers(parallel_config))
    groups = [KVCacheGroupSpec(list(names), spec)]
    vllm_config.cache_config.num_gpu_blocks_override = num_blocks
    kv_cache_config = get_kv_cache_config_from_groups(
        vllm_config, groups, available_memory=num_blocks * len(names) * spec.page_size_bytes
    )
    assert kv_cache_config.num_blocks == num_blocks
    kv_cache_config.kv_cache_layout = vllm_config.cache_config.kv_cache_layout
    # EngineCore._initialize_kv_caches resolves these for scheduler and workers alike.
    scheduler_block_size, hash_block_size = resolve_kv_cache_block_sizes(kv_cache_config, vllm_config)
    kv_cache_config.hash_block_size = hash_block_size
    kv_cache_config.cache_hit_alignment_tokens = resolve_cache_hit_alignment_tokens(
        kv_cache_config, vllm_config, scheduler_block_size, hash_block_size
    )
    vllm_config.cache_config.num_gpu_blocks = num_blocks
    return kv_cache_config


def make_scheduler(
    vllm_config: VllmConfig,
    num_blocks: int,
    *,
    kv_cache_config: KVCacheConfig | None = None,
    log_stats: bool = True,
) -> Scheduler:
    """The real vLLM scheduler (``AsyncScheduler`` when async scheduling is on).

    ``num_blocks`` includes vLLM's reserved null block (block 0), as in the engine.
    The KV-cache config is available as ``scheduler.kv_cache_config``.
    """
    if kv_cache_config is None:
        kv_cache_config = make_kv_cache_config(vllm_config, num_blocks)
    _init_none_hash_once(get_hash_fn_by_name(vllm_config.cache_config.prefix_caching_hash_algo))
    scheduler_block_size, hash_block_size = resolve_kv_cache_block_sizes(kv_cache_config, vllm_config)
    scheduler_cls = AsyncScheduler if vllm_config.scheduler_config.async_scheduling else Scheduler
    return scheduler_cls(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=scheduler_block_size,
        hash_block_size=hash_block_size,
        log_stats=log_stats,
    )


# --------------------------------------------------------------------------- requests

_arrival = itertools.count()
_none_hash_fn: list[Callable[[Any], bytes]] = []


def _init_none_hash_once(hash_fn: Callable[[Any], bytes]) -> None:
    """``init_none_hash`` as ``EngineCore`` does at start-up, but once per process and hash
    function: with a non-cryptographic hash it draws a random seed each call, which would
    make block hashes of requests created before and after disagree."""
    if not _none_hash_fn or _none_hash_fn[0] is not hash_fn:
        init_none_hash(hash_fn)
        _none_hash_fn[:] = [hash_fn]


def make_request(
    request_id: str,
    prompt_token_ids: Sequence[int],
    max_tokens: int = 16,
    *,
    hash_block_size: int = 16,
    hash_algo: str = "sha256",
    eos_token_id: int | None = EOS_TOKEN_ID,
    ignore_eos: bool = False,
    min_tokens: int = 0,
    kv_transfer_params: dict[str, Any] | None = None,
    priority: int = 0,
    cache_salt: str | None = None,
) -> Request:
    """A ``vllm.v1.request.Request`` with a block hasher, as ``EngineCore.add_request`` builds it."""
    hash_fn = get_hash_fn_by_name(hash_algo)
    _init_none_hash_once(hash_fn)
    sampling_params = SamplingParams(max_tokens=max_tokens, min_tokens=min_tokens, ignore_eos=ignore_eos)
    sampling_params.update_from_generation_config({}, eos_token_id)
    request = Request(
        request_id=request_id,
        prompt_token_ids=list(prompt_token_ids),
        sampling_params=sampling_params,
        pooling_params=None,
        arrival_time=float(next(_arrival)),  # deterministic ordering
        priority=priority,
        cache_salt=cache_salt,
        block_hasher=get_request_block_hasher(hash_block_size, hash_fn),
    )
    if kv_transfer_params is not None:
        request.kv_transfer_params = kv_transfer_params
    return request


# --------------------------------------------------------------------------- fake KV

_M61 = (1 << 61) - 1


def prefix_keys(token_ids: Iterable[int], key: int = 0) -> list[int]:
    """Rolling hash: ``out[p]`` identifies ``token_ids[: p + 1]`` (and so position ``p``)."""
    out = []
    for token in token_ids:
        key = (key * 1_000_003 + int(token) + 1) % _M61
        out.append(key)
    return out


_EXACT_BITS = {torch.float32: 24, torch.float16: 11, torch.bfloat16: 8, torch.float64: 53}


def kv_pattern(
    keys: torch.Tensor | Sequence[int], layer_idx: int, num_heads: int, content: int, dtype: torch.dtype
) -> torch.Tensor:
    """The KV ``[P, H, C]`` a recompute writes for positions with prefix keys ``keys`` in a layer.

    Every element is an integer exactly representable in ``dtype``, and elements differ
    across heads/content so transposed or shifted copies are detected too.
    """
    if dtype not in _EXACT_BITS:
        raise ValueError(f"kv_pattern supports {list(_EXACT_BITS)}, not {dtype}")
    k = torch.as_tensor(keys, dtype=torch.int64).reshape(-1, 1)
    j = torch.arange(num_heads * content, dtype=torch.int64).reshape(1, -1)
    x = k * 2654435761 + j * 40503 + (layer_idx + 1) * 2246822519
    x = x ^ (x >> 29)
    x = x * 3266489917
    x = x ^ (x >> 32)
    x = x & ((1 << _EXACT_BITS[dtype]) - 1)
    return x.to(dtype).reshape(-1, num_heads, content)


@dataclass
class KVViolation:
    """A position whose KV differs from what a recompute would have written."""

    step: int
    req_id: str
    layer: str
    kind: str  # "context" (attended KV wrong) | "cached_block" | "block_table"
    positions: list[int]
    block_ids: list[int]
    detail: str = ""

    def __str__(self) -> str:
        pos = self.positions[:8]
        more = "" if len(self.positions) <= 8 else f" (+{len(self.positions) - 8} more)"
        return (
            f"[step {self.step}] {self.kind}: request {self.req_id!r} layer {self.layer}: "
            f"KV at positions {pos}{more} (blocks {sorted(set(self.block_ids))}) "
            f"differs from a recompute. {self.detail}"
        )


class FakeAttentionLayer:
    """Stands in for ``vllm.model_executor.layers.attention.Attention`` in the forward context."""

    def __init__(self, layer_name: str, kv_cache: torch.Tensor):
        self.layer_name = layer_name
        self.kv_cache = kv_cache

    def get_attn_backend(self) -> Any:
        return CPUAttentionBackend


@dataclass
class _ReqState:
    """What the model runner caches per request (``CachedRequestState``)."""

    req_id: str
    prompt_token_ids: list[int]
    block_ids: list[int]
    num_computed_tokens: int
    output_token_ids: list[int] = field(default_factory=list)
    _keys: list[int] = field(default_factory=list)

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def keys(self, n: int) -> list[int]:
        """Prefix keys of the first ``n`` tokens (cached; recomputed after truncation)."""
        tokens = self.token_ids
        assert n <= len(tokens)
        if len(self._keys) > len(tokens):
            del self._keys[len(tokens) :]
        if len(self._keys) < n:
            start = len(self._keys)
            self._keys.extend(prefix_keys(tokens[start:n], self._keys[-1] if self._keys else 0))
        return self._keys[:n]


class FakeWorker:
    """Worker side: real KV tensors, the WORKER-role connector, and a checkable fake forward.

    KV tensors (``self.kv_caches``, also what ``register_kv_caches`` receives) are built by
    vLLM's ``allocate_kv_cache``: one int8 backing buffer, and per layer a standardized
    ``[num_blocks, num_kv_heads, block_size, 2 * head_size]`` view (K then V in the last dim)
    of dtype ``model_config.dtype``; memory order follows ``cache_config.kv_cache_layout``
    (LBHNC, the CPU backend's layout, by default).  Token ``t`` of block ``b`` is
    ``kv[b, :, t, :]`` (the same indexing vLLM's ExampleConnector uses).

    Sampling: when a scheduled chunk reaches the end of the request's known tokens, the
    sampled token is ``key % (vocab_size - 1)`` of the prefix key (never EOS), or EOS if
    ``eos_every`` is set and ``key % eos_every == 0``.  ``max_tokens`` is enforced by the
    scheduler, as in vLLM.
    """

    def __init__(
        self,
        vllm_config: VllmConfig,
        kv_cache_config: KVCacheConfig,
        *,
        connector: Any | None = None,
        create_connector: bool = True,
        eos_every: int | None = None,
        eos_token_id: int = EOS_TOKEN_ID,
        strict: bool = True,
    ):
        self.vllm_config = vllm_config
        self.kv_cache_config = kv_cache_config
        self.block_size = vllm_config.cache_config.block_size
        self.num_blocks = kv_cache_config.num_blocks
        self.vocab_size = vllm_config.model_config.get_vocab_size()
        self.eos_every = eos_every
        self.eos_token_id = eos_token_id
        self.strict = strict
        self.async_scheduling = bool(vllm_config.scheduler_config.async_scheduling)
        (group,) = kv_cache_config.kv_cache_groups
        spec = group.kv_cache_spec
        assert isinstance(spec, FullAttentionSpec)
        self.layer_names = list(group.layer_names)
        self.dtype = spec.dtype
        self.num_kv_heads = spec.num_kv_heads
        self.content = spec.head_size + spec.head_size_v

        self.kv_caches: dict[str, torch.Tensor] = allocate_kv_cache(
            kv_cache_config, torch.device("cpu"), vllm_config.cache_config.get_resolved_kv_cache_layout()
        )
        for name, kv in self.kv_caches.items():
            assert tuple(kv.shape) == (self.num_blocks, self.num_kv_heads, self.block_size, self.content), (
                name,
                kv.shape,
            )
        self.layers = {name: FakeAttentionLayer(name, self.kv_caches[name]) for name in self.layer_names}

        if connector is None and create_connector and vllm_config.kv_transfer_config is not None:
            connector = KVConnectorFactory.create_connector(
                config=vllm_config, role=KVConnectorRole.WORKER, kv_cache_config=kv_cache_config
            )
        self.connector = connector
        if self.connector is not None:
            # GPUModelRunner.initialize_kv_cache -> register_kv_caches(kv_caches)
            self.connector.register_kv_caches(self.kv_caches)

        self.requests: dict[str, _ReqState] = {}
        self._prev_scheduled: set[str] = set()
        self.step_count = 0
        self.violations: list[KVViolation] = []
        self.tolerated_violations: list[KVViolation] = []  # on blocks the connector reported invalid
        self.hook_log: list[str] = []  # connector hooks called, in order, for the last step
        self.last_kv_connector_output: KVConnectorOutput | None = None

    # ------------------------------------------------------------------ helpers

    def expected_kv(self, token_ids: Sequence[int], layer_idx: int) -> torch.Tensor:
        """KV ``[len(token_ids), H, C]`` a recompute writes for these tokens in layer ``layer_idx``."""
        return kv_pattern(prefix_keys(token_ids), layer_idx, self.num_kv_heads, self.content, self.dtype)

    def read_kv(self, layer: str | int, block_ids: Sequence[int], positions: Sequence[int]) -> torch.Tensor:
        """KV ``[P, H, C]`` at logical ``positions`` of a request with block table ``block_ids``."""
        name = self.layer_names[layer] if isinstance(layer, int) else layer
        pos = torch.as_tensor(list(positions), dtype=torch.int64)
        blocks = torch.as_tensor([block_ids[p // self.block_size] for p in positions], dtype=torch.int64)
        return self.kv_caches[name][blocks, :, pos % self.block_size]

    def check_block(self, block_id: int, token_ids: Sequence[int], block_index: int) -> list[int]:
        """Check block ``block_id`` holds the KV of block ``block_index`` of ``token_ids``.

        ``token_ids`` is the prefix up to (at least) the covered part of that block.
        Returns the mismatching positions (empty if the block is exact in every layer).
        """
        start = block_index * self.block_size
        end = min(start + self.block_size, len(token_ids))
        keys = prefix_keys(token_ids[:end])[start:end]
        bad: set[int] = set()
        for idx, name in enumerate(self.layer_names):
            exp = kv_pattern(keys, idx, self.num_kv_heads, self.content, self.dtype)
            got = self.kv_caches[name][block_id, :, : end - start].transpose(0, 1)
            mism = (got != exp).flatten(1).any(1).nonzero().flatten().tolist()
            bad.update(start + m for m in mism)
        return sorted(bad)

    def reference_generation(self, prompt_token_ids: Sequence[int], max_tokens: int) -> list[int]:
        """The output a request gets with no preemption/connector effects (stops at EOS)."""
        tokens = list(prompt_token_ids)
        key = prefix_keys(tokens)[-1]
        out: list[int] = []
        while len(out) < max_tokens:
            tok = self._sample(key)
            out.append(tok)
            if tok == self.eos_token_id:
                break
            key = prefix_keys([tok], key)[0]
        return out

    def _sample(self, key: int) -> int:
        if self.eos_every and key % self.eos_every == 0:
            return self.eos_token_id
        tok = key % (self.vocab_size - 1)
        if tok == self.eos_token_id:
            tok = (tok + 1) % (self.vocab_size - 1)
        return tok

    def _log(self, name: str) -> None:
        self.hook_log.append(name)

    def _call(self, name: str, *args: Any, **kwargs: Any) -> Any:
        self._log(name)
        return getattr(self.connector, name)(*args, **kwargs)

    # ------------------------------------------------------------------ step

    def _update_states(self, so: SchedulerOutput) -> None:
        """GPUModelRunner._update_states, reduced to what a KV test observes."""
        for req_id in so.finished_req_ids:
            self.requests.pop(req_id, None)
        if so.new_block_ids_to_zero:
            for kv in self.kv_caches.values():
                kv[torch.as_tensor(so.new_block_ids_to_zero, dtype=torch.int64)] = 0
        if so.kv_cache_block_copies:
            copy_kv_cache_blocks_inplace(self.kv_caches.values(), self.num_blocks, so.kv_cache_block_copies)
        for new in so.scheduled_new_reqs:
            if new.req_id in self.requests:
                raise NotImplementedError("streaming-input requests are not emulated")
            assert new.prompt_token_ids is not None, "prompt embeds are not emulated"
            self.requests[new.req_id] = _ReqState(
                req_id=new.req_id,
                prompt_token_ids=list(new.prompt_token_ids),
                block_ids=list(new.block_ids[0]),
                num_computed_tokens=new.num_computed_tokens,
            )
        cached = so.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            st = self.requests[req_id]
            st.num_computed_tokens = cached.num_computed_tokens[i]
            num_output_tokens = cached.num_output_tokens[i]
            if num_output_tokens < len(st.output_token_ids):
                # Tokens the scheduler discarded (e.g. after a sync KV-load failure).
                del st.output_token_ids[num_output_tokens:]
            new_block_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                assert new_block_ids is not None
                st.block_ids = list(new_block_ids[0])
            elif new_block_ids is not None:
                st.block_ids.extend(new_block_ids[0])
            if self.async_scheduling and num_output_tokens > 0 and req_id in cached.all_token_ids:
                # Not in the persistent batch: the runner recovers outputs from the scheduler.
                st.output_token_ids = list(cached.all_token_ids[req_id][-num_output_tokens:])

    def _forward_context(self, attn_metadata: dict[str, Any] | None, slot_mapping: dict) -> ForwardContext:
        return ForwardContext(
            no_compile_layers=dict(self.layers), attn_metadata=attn_metadata, slot_mapping=slot_mapping
        )

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        """One model-runner step; returns the ``ModelRunnerOutput`` the scheduler consumes."""
        self.step_count += 1
        self.hook_log = []
        step_violations: list[KVViolation] = []
        if so.scheduled_spec_decode_tokens:
            raise NotImplementedError("speculative decoding is not emulated")
        conn = self.connector
        meta = so.kv_connector_metadata
        if conn is not None:
            assert meta is not None, "scheduler produced no kv_connector_metadata"
            self._call("handle_preemptions", meta)
        self._update_states(so)

        batch = [(req_id, self.requests[req_id], n) for req_id, n in so.num_scheduled_tokens.items() if n > 0]
        attn_metadata, slot_mapping, plan = self._prepare(so, batch, step_violations)
        ctx = self._forward_context(attn_metadata if batch else None, slot_mapping if batch else {})

        kv_out: KVConnectorOutput | None = None
        with override_forward_context(ctx):
            if conn is not None:
                kv_out = KVConnectorOutput()
                self._call("bind_connector_metadata", meta)
                if so.has_sync_kv_loads:
                    self._call("start_load_kv", ctx)
            try:
                if batch:
                    self._forward(plan, attn_metadata, step_violations)
            finally:
                if conn is not None:
                    if not so.has_sync_kv_loads:
                        self._call("start_load_kv", ctx)
                    self._call("wait_for_save")
                    results = self._call("get_transfer_results", so.finished_req_ids)
                    kv_out.finished_sending = results.finished_sending
                    kv_out.finished_recving = results.finished_recving
                    kv_out.failed_recving = results.failed_recving
                    kv_out.invalid_block_ids = self._call("get_block_ids_with_load_errors")
                    kv_out.kv_connector_stats = self._call("get_kv_connector_stats")
                    kv_out.kv_cache_events = self._call("get_kv_connector_kv_cache_events")
                    kv_out.kv_connector_worker_meta = self._call("build_connector_worker_meta")
                    self._call("clear_connector_metadata")
        self.last_kv_connector_output = kv_out

        invalid = set(kv_out.invalid_block_ids) if kv_out is not None else set()
        for v in step_violations:
            # A sync-load failure reported this step: vLLM discards that output and recomputes.
            if invalid and set(v.block_ids) <= invalid:
                self.tolerated_violations.append(v)
            else:
                self.violations.append(v)
        self._prev_scheduled = set(so.num_scheduled_tokens)
        if self.strict and self.violations:
            raise AssertionError(f"{len(self.violations)} KV violation(s); first: {self.violations[0]}")

        if not batch:
            if conn is None:
                return EMPTY_MODEL_RUNNER_OUTPUT
            return ModelRunnerOutput.with_kv_conn_output_only(kv_out)

        req_ids, sampled = [], []
        for req_id, st, n in batch:
            end = st.num_computed_tokens + n
            tokens = []
            if end >= len(st.token_ids):  # not a partial-prefill chunk: keep the sample
                tokens = [self._sample(st.keys(end)[-1])]
                st.output_token_ids.extend(tokens)
            req_ids.append(req_id)
            sampled.append(tokens)
        return ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=sampled,
            logprobs=None,
            prompt_logprobs_dict={},
            pooler_output=None,
            kv_connector_output=kv_out,
        )

    def _prepare(self, so: SchedulerOutput, batch: list, violations: list[KVViolation]):
        """Slot mapping and CPU attention metadata, like ``_prepare_inputs`` builds them."""
        bs = self.block_size
        plan = []
        slots: list[int] = []
        query_start = [0]
        seq_lens = []
        max_blocks = max((len(st.block_ids) for _, st, _ in batch), default=1) or 1
        block_table = torch.zeros((len(batch), max_blocks), dtype=torch.int32)
        for row, (req_id, st, n) in enumerate(batch):
            start, end = st.num_computed_tokens, st.num_computed_tokens + n
            if end > len(st.token_ids):
                raise AssertionError(
                    f"[step {self.step_count}] request {req_id!r}: {n} tokens scheduled from position "
                    f"{start} but the worker only knows {len(st.token_ids)} tokens"
                )
            needed = -(-end // bs)
            if len(st.block_ids) < needed or 0 in st.block_ids[:needed]:
                violations.append(
                    KVViolation(
                        self.step_count,
                        req_id,
                        "*",
                        "block_table",
                        list(range(start, end)),
                        list(st.block_ids),
                        f"needs {needed} real blocks, block table {st.block_ids}",
                    )
                )
                raise AssertionError(str(violations[-1]))
            block_table[row, : len(st.block_ids)] = torch.as_tensor(st.block_ids, dtype=torch.int32)
            positions = list(range(end))
            blocks = [st.block_ids[p // bs] for p in positions]
            plan.append((req_id, st, start, end, positions, blocks))
            slots.extend(blocks[p] * bs + p % bs for p in range(start, end))
            query_start.append(query_start[-1] + n)
            seq_lens.append(end)
        slot_mapping = torch.as_tensor(slots, dtype=torch.int64)
        attn_metadata: dict[str, Any] = {}
        if batch:
            meta = self._attn_metadata(
                num_actual_tokens=len(slots),
                max_query_len=max(n for _, _, n in batch),
                query_start_loc=torch.as_tensor(query_start, dtype=torch.int32),
                max_seq_len=max(seq_lens),
                seq_lens=torch.as_tensor(seq_lens, dtype=torch.int32),
                block_table=block_table,
                slot_mapping=slot_mapping,
            )
            attn_metadata = {name: meta for name in self.layer_names}
        return attn_metadata, {name: slot_mapping for name in self.layer_names}, plan

    @staticmethod
    def _attn_metadata(**kw: Any) -> Any:
        if CPUAttentionMetadata is not None:
            return CPUAttentionMetadata(scheduler_metadata=None, **kw)
        from types import SimpleNamespace  # pragma: no cover

        return SimpleNamespace(**kw)  # pragma: no cover

    def _forward(self, plan: list, attn_metadata: dict[str, Any], violations: list[KVViolation]) -> None:
        bs = self.block_size
        conn = self.connector
        for layer_idx, name in enumerate(self.layer_names):
            kv = self.kv_caches[name]
            # unified_kv_cache_update: write this step's tokens (before wait_for_layer_load).
            for _req_id, st, start, end, _positions, blocks in plan:
                keys = st.keys(end)
                pos = torch.arange(start, end, dtype=torch.int64)
                blk = torch.as_tensor(blocks[start:end], dtype=torch.int64)
                kv[blk, :, pos % bs] = kv_pattern(
                    keys[start:end], layer_idx, self.num_kv_heads, self.content, self.dtype
                )
            if conn is not None:
                self._call("wait_for_layer_load", name)
            # attention: every attended position must hold what a recompute writes.
            for req_id, st, _start, end, positions, blocks in plan:
                pos = torch.as_tensor(positions, dtype=torch.int64)
                blk = torch.as_tensor(blocks, dtype=torch.int64)
                got = kv[blk, :, pos % bs]
                exp = kv_pattern(st.keys(end), layer_idx, self.num_kv_heads, self.content, self.dtype)
                if not torch.equal(got, exp):
                    bad = (got != exp).flatten(1).any(1).nonzero().flatten().tolist()
                    violations.append(
                        KVViolation(
                            self.step_count,
                            req_id,
                            name,
                            "context",
                            bad,
                            [blocks[p] for p in bad],
                            f"num_computed_tokens={st.num_computed_tokens}, seq_len={end}",
                        )
                    )
            if conn is not None:
                self._call("save_kv_layer", name, kv, attn_metadata[name])

    def shutdown(self) -> None:
        if self.connector is not None:
            self.connector.shutdown()


# --------------------------------------------------------------------------- engine loop


@dataclass
class RequestResult:
    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int] = field(default_factory=list)
    finish_reason: Any = None  # vllm.v1.engine.FinishReason, or "abort"
    stop_reason: Any = None
    kv_transfer_params: dict[str, Any] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class EngineHarness:
    """``EngineCore.step`` / ``step_with_batch_queue`` over a real scheduler and a FakeWorker.

    With async scheduling (``vllm_config.max_concurrent_batches == 2``) step N+1 is scheduled
    and executed by the worker before ``update_from_output`` sees step N, exactly the order
    ``EngineCore.step_with_batch_queue`` produces (v1/engine/core.py:698-812); the worker runs
    each batch to completion when it is submitted (its "future" is already resolved).
    """

    def __init__(self, scheduler: Scheduler, worker: FakeWorker):
        self.scheduler = scheduler
        self.worker = worker
        self.vllm_config = scheduler.vllm_config
        self.batch_queue_size = self.vllm_config.max_concurrent_batches
        self.batch_queue: deque[tuple[ModelRunnerOutput, SchedulerOutput]] = deque()
        self.results: dict[str, RequestResult] = {}
        self.steps = 0
        self._preemptions: dict[str, int] = {}
        self.scheduler_outputs: list[SchedulerOutput] = []
        self.keep_scheduler_outputs = False
        #: ``num_computed_tokens`` when each request was first sent to the worker (prefix hits).
        self.num_computed_at_start: dict[str, int] = {}
        kv_cache_config = scheduler.kv_cache_config
        self.hash_block_size = kv_cache_config.hash_block_size or self.vllm_config.cache_config.block_size
        self._hash_registry: dict[Any, tuple[int, ...]] = {}
        self._hashes_seen: dict[str, int] = {}

    # -- requests

    def make_request(
        self, request_id: str, prompt_token_ids: Sequence[int], max_tokens: int = 16, **kw: Any
    ) -> Request:
        kw.setdefault("hash_block_size", self.hash_block_size)
        kw.setdefault("hash_algo", self.vllm_config.cache_config.prefix_caching_hash_algo)
        kw.setdefault("eos_token_id", self.worker.eos_token_id)
        return make_request(request_id, prompt_token_ids, max_tokens, **kw)

    def add_request(
        self,
        request_id: str | Request,
        prompt_token_ids: Sequence[int] | None = None,
        max_tokens: int = 16,
        **kw: Any,
    ) -> Request:
        request = (
            request_id
            if isinstance(request_id, Request)
            else self.make_request(request_id, prompt_token_ids or [], max_tokens, **kw)
        )
        self.scheduler.add_request(request)
        self.results[request.request_id] = RequestResult(
            request.request_id, list(request.prompt_token_ids or [])
        )
        self._register_hashes(request)
        return request

    def abort(self, request_ids: str | Iterable[str]) -> None:
        """``EngineCore.abort_requests`` (aborts are applied between steps)."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        for req in self.scheduler.finish_requests(ids, RequestStatus.FINISHED_ABORTED):
            res = self.results.get(req.request_id)
            if res is not None and res.finish_reason is None:
                res.finish_reason = "abort"

    # -- stepping

    def has_work(self) -> bool:
        return self.scheduler.has_requests() or bool(self.batch_queue)

    def step(self) -> list[Any]:
        """One engine-core step; returns the ``EngineCoreOutput``s it produced."""
        self.steps += 1
        if self.batch_queue_size <= 1:
            if not self.scheduler.has_requests():
                return []
            so = self._schedule()
            mro = self.worker.execute_model(so)
            return self._update(so, mro)
        # step_with_batch_queue
        if self.scheduler.has_requests():
            so = self._schedule()
            mro = self.worker.execute_model(so)
            model_executed = so.total_num_scheduled_tokens > 0
            if so.pending_structured_output_tokens:
                raise NotImplementedError("structured output is not emulated")
            self.batch_queue.appendleft((mro, so))
            if len(self.batch_queue) < self.batch_queue_size and (
                model_executed or self.scheduler.has_requests()
            ):
                return []
        elif not self.batch_queue:
            return []
        mro, so = self.batch_queue.pop()
        return self._update(so, mro)

    def _schedule(self) -> SchedulerOutput:
        so = self.scheduler.schedule()
        for new in so.scheduled_new_reqs:
            self.num_computed_at_start.setdefault(new.req_id, new.num_computed_tokens)
        for req in self.scheduler.requests.values():
            self._preemptions[req.request_id] = req.num_preemptions
        if self.keep_scheduler_outputs:
            self.scheduler_outputs.append(so)
        return so

    @property
    def num_preemptions(self) -> int:
        """Preemptions the scheduler performed so far (all requests)."""
        return sum(self._preemptions.values())

    def _update(self, so: SchedulerOutput, mro: ModelRunnerOutput) -> list[Any]:
        engine_outputs = self.scheduler.update_from_output(so, mro)
        outs = []
        for eco in engine_outputs.values():
            for o in eco.outputs:
                outs.append(o)
                res = self.results.setdefault(o.request_id, RequestResult(o.request_id, []))
                res.output_token_ids.extend(o.new_token_ids)
                if o.finish_reason is not None:
                    res.finish_reason = o.finish_reason
                    res.stop_reason = o.stop_reason
                    res.kv_transfer_params = o.kv_transfer_params
        for req in self.scheduler.requests.values():
            self._register_hashes(req)
        return outs

    def run(
        self, max_steps: int = 10_000, *, until: Callable[[], bool] | None = None
    ) -> dict[str, RequestResult]:
        """Step until the engine is idle (or ``until()``); fail after ``max_steps``."""
        for _ in range(max_steps):
            if until is not None and until():
                return self.results
            if not self.has_work():
                return self.results
            self.step()
        raise AssertionError(f"engine still busy after {max_steps} steps: {self.describe()}")

    def shutdown(self) -> None:
        self.scheduler.shutdown()
        self.worker.shutdown()

    def describe(self) -> str:
        s = self.scheduler
        return (
            f"running={[r.request_id for r in s.running]} waiting={[r.request_id for r in s.waiting]} "
            f"requests={list(s.requests)} batch_queue={len(self.batch_queue)}"
        )

    # -- checks

    def _register_hashes(self, req: Request) -> None:
        seen = self._hashes_seen.get(req.request_id, 0)
        hashes = req.block_hashes
        if len(hashes) <= seen:
            return
        tokens = req.all_token_ids
        for i in range(seen, len(hashes)):
            self._hash_registry.setdefault(hashes[i], tuple(tokens[: (i + 1) * self.hash_block_size]))
        self._hashes_seen[req.request_id] = len(hashes)

    def verify_cached_blocks(self) -> list[str]:
        """Every block in vLLM's prefix cache (in use or free) must hold its hash's KV.

        Call between steps. Returns problems (empty = OK). Blocks a connector reported
        invalid under the "recompute" policy legitimately stay cached until recomputed.
        """
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
            block_index = (n - 1) // bs
            bad = self.worker.check_block(block.block_id, prefix[:n], block_index)
            if bad:
                problems.append(
                    f"block {block.block_id} (block #{block_index} of a {n}-token prefix): positions {bad[:8]}"
                )
        return problems

    def assert_ok(self) -> None:
        """No KV violation seen by the fake forward and the prefix cache is consistent."""
        assert not self.worker.violations, "\n".join(map(str, self.worker.violations[:10]))
        problems = self.verify_cached_blocks()
        assert not problems, "cached blocks with wrong KV:\n" + "\n".join(problems[:10])


def assert_scheduler_empty(scheduler: Scheduler) -> None:
    """No request, block or connector state leaked (after all requests finished)."""
    assert not scheduler.requests, list(scheduler.requests)
    assert len(scheduler.waiting) == 0
    assert len(scheduler.running) == 0
    assert not scheduler.finished_req_ids
    assert not scheduler.finished_recving_kv_req_ids
    mgr = scheduler.kv_cache_manager.coordinator.single_type_managers[0]
    assert not mgr.req_to_blocks, list(mgr.req_to_blocks)
    pool = scheduler.kv_cache_manager.block_pool
    assert pool.free_block_queue.num_free_blocks == pool.num_gpu_blocks - 1
    assert all(b.ref_cnt == 0 for b in pool.blocks if not b.is_null)


# --------------------------------------------------------------------------- shortcuts


def make_engine(
    num_blocks: int = 64,
    *,
    eos_every: int | None = None,
    strict: bool = True,
    worker_connector: Any | None = None,
    **config_kw: Any,
) -> EngineHarness:
    """``make_vllm_config(**config_kw)`` + ``make_scheduler`` + ``FakeWorker`` + ``EngineHarness``."""
    vllm_config = make_vllm_config(num_gpu_blocks=num_blocks, **config_kw)
    scheduler = make_scheduler(vllm_config, num_blocks)
    worker = FakeWorker(
        vllm_config, scheduler.kv_cache_config, connector=worker_connector, eos_every=eos_every, strict=strict
    )
    return EngineHarness(scheduler, worker)


def run_engine_steps(
    scheduler: Scheduler, worker: FakeWorker, max_steps: int = 10_000
) -> dict[str, RequestResult]:
    """Run a fresh ``EngineHarness`` over already-added requests until idle."""
    return EngineHarness(scheduler, worker).run(max_steps)


def connector_worker(engine: Any) -> Any:
    """The aiokv worker side of an engine harness's (or hybrid harness's) connector."""
    from aiokv.vllm import AiokvConnector

    conn = engine.worker.connector
    assert isinstance(conn, AiokvConnector)
    assert conn.worker is not None
    return conn.worker


def connector_stats(engine: Any) -> Any:
    """The worker side's offloader statistics (``aiokv.OffloaderStats``)."""
    stats = connector_worker(engine).stats()
    assert stats is not None
    return stats


def spread_prompt(seed: int, n: int) -> list[int]:
    """``n`` token ids in [1, 1000], spread by ``seed``."""
    return [(seed * 7919 + i * 104729) % 1000 + 1 for i in range(n)]
