"""The engine's paged KV cache and its block allocator (plain synchronous code, no awaits)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from aiokv import InvalidArgumentError, KVGroup, KVLayout

from ._model import ModelConfig

__all__ = ["AllocatorStats", "BlockAllocator", "PagedKVCache"]


class PagedKVCache:
    """Per layer a K and a V tensor of shape ``(num_blocks, block_size, kv_heads, head_dim)`` (vLLM's layout).

    The tensors start zeroed. :attr:`tensors` is the flat list ``[k0, v0, k1, v1, ...]`` both the model's
    forward and :class:`aiokv.KVLayout` take.
    """

    def __init__(
        self,
        config: ModelConfig,
        num_blocks: int,
        *,
        block_size: int = 16,
        device: torch.device | str = "cpu",
    ) -> None:
        if num_blocks <= 0:
            raise InvalidArgumentError(f"num_blocks must be > 0, got {num_blocks}")
        if block_size <= 0 or block_size & (block_size - 1):
            raise InvalidArgumentError(f"block_size must be a positive power of two, got {block_size}")
        self.config = config
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.device = torch.device(device)
        self.groups = config.cache_groups(num_blocks, block_size)
        if self.grouped:
            # Sliding-window, latent or state layers: each group's tensors have their own per-block shape.
            flat: list[torch.Tensor | None] = [None] * sum(len(g.tensor_indices) for g in self.groups)
            for g in self.groups:
                for i in g.tensor_indices:
                    flat[i] = torch.zeros(g.shape, dtype=config.dtype, device=self.device)
            self.tensors: tuple[torch.Tensor, ...] = tuple(t for t in flat if t is not None)
        else:
            shape = (num_blocks, block_size, config.num_kv_heads, config.head_dim)
            self.tensors = tuple(
                torch.zeros(shape, dtype=config.dtype, device=self.device)
                for _ in range(2 * config.num_layers)
            )

    @property
    def grouped(self) -> bool:
        """Whether the model keeps more than plain K/V per layer (sliding window, latent or state layers):
        :meth:`layout` is then a grouped layout and the engine gives aiokv block ids per group."""
        return self.config.group_kinds != ("full",)

    def layout(self, *, model_id: str | None = None, checkpoint_blocks: int | None = None) -> KVLayout:
        """The :class:`aiokv.KVLayout` describing these tensors (what :class:`aiokv.Offloader` takes): one
        group of K/V tensors, or for a model with sliding-window, latent or state layers one
        :class:`aiokv.KVGroup` per kind (``checkpoint_blocks``: see :meth:`aiokv.KVLayout.from_groups`)."""
        if not self.grouped:
            # One (k, v) pair per model layer: the layout's layers are the model's (layer-wise loads).
            pairs = [(self.tensors[i], self.tensors[i + 1]) for i in range(0, len(self.tensors), 2)]
            return KVLayout(pairs, block_size=self.block_size, block_dim=0, model_id=model_id)
        return KVLayout.from_groups(
            [
                KVGroup(
                    [self.tensors[i] for i in g.tensor_indices],
                    kind=g.kind,
                    window=g.window,
                    token_dim=None if g.kind == "state" else "after_block_dim",
                    name=g.kind,
                )
                for g in self.groups
            ],
            self.block_size,
            model_id=model_id,
            checkpoint_blocks=checkpoint_blocks,
        )

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)

    def read_positions(self, block_table: Iterable[int], start: int, end: int) -> list[torch.Tensor]:
        """Copies of every tensor's KV for token positions ``[start, end)`` of a request (for tests and debug)."""
        table = torch.tensor(list(block_table), dtype=torch.long, device=self.device)
        pos = torch.arange(start, end, device=self.device)
        slots = table[pos // self.block_size] * self.block_size + pos % self.block_size
        return [t.view(-1, *t.shape[2:])[slots].cpu() for t in self.tensors]

    def __repr__(self) -> str:
        return (
            f"<PagedKVCache blocks={self.num_blocks} block_size={self.block_size} layers={self.config.num_layers}"
            f" {self.nbytes / 2**20:.1f} MiB on {self.device}>"
        )


@dataclass(frozen=True, slots=True)
class AllocatorStats:
    num_blocks: int
    free: int
    allocated: int


class BlockAllocator:
    """A free pool of engine block ids. ``allocate`` returns ``None`` when there is no room (never raises for
    that); ``free`` checks for double frees, because a block returned twice would be handed to two requests."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise InvalidArgumentError(f"num_blocks must be > 0, got {num_blocks}")
        self.num_blocks = num_blocks
        # A stack: the most recently freed block is reused first, which makes any reuse-too-early bug loud.
        self._free = list(range(num_blocks - 1, -1, -1))
        self._is_free = [True] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int] | None:
        if n < 0:
            raise InvalidArgumentError(f"n must be >= 0, got {n}")
        if n > len(self._free):
            return None
        out = [self._free.pop() for _ in range(n)]
        for b in out:
            self._is_free[b] = False
        return out

    def free(self, blocks: Iterable[int]) -> None:
        for b in blocks:
            if self._is_free[b]:
                raise AssertionError(f"block {b} freed twice")
            self._is_free[b] = True
            self._free.append(b)

    def stats(self) -> AllocatorStats:
        free = len(self._free)
        return AllocatorStats(num_blocks=self.num_blocks, free=free, allocated=self.num_blocks - free)
