"""A small reference inference engine built on aiokv: a seeded Llama-shaped transformer, a paged KV cache in
vLLM's layout, and an asyncio continuous-batching scheduler that offloads and restores KV through
:class:`aiokv.Offloader` (or recomputes everything when given none). See docs/engine.md."""

from ._cache import AllocatorStats, BlockAllocator, PagedKVCache
from ._engine import BlockEvent, Engine, EngineState, EngineStats, GenerationResult, TokenStream
from ._model import ModelConfig, SeqChunk, Transformer

__all__ = [
    "AllocatorStats",
    "BlockAllocator",
    "BlockEvent",
    "Engine",
    "EngineState",
    "EngineStats",
    "GenerationResult",
    "ModelConfig",
    "PagedKVCache",
    "SeqChunk",
    "TokenStream",
    "Transformer",
]
