"""The engine's paged KV tensors, described once: shapes, strides, bytes per block, fingerprint.

A *block* is index ``b`` along ``block_dim`` of every tensor. For the CPU tier a block of all tensors is packed
into one contiguous *slot* of :attr:`KVLayout.slot_bytes` bytes: tensor by tensor, and within a tensor the
``outer`` segments (indices of the dimensions before ``block_dim``) in row-major order, each
``inner_bytes`` long. Segments are what the copy kernels move.
"""

from __future__ import annotations

import hashlib
import math
import operator
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, Literal

import numpy as np
import numpy.typing as npt
import torch

from ._errors import BlockRangeError, InvalidArgumentError, InvalidLayoutError, InvalidTypeError
from ._hashing import make_root

__all__ = ["AFTER_BLOCK_DIM", "KVLayout", "TensorSpec"]

Int64Array = npt.NDArray[np.int64]


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """How one engine tensor's block maps into a slot."""

    outer: int  # number of segments per block (product of dims before block_dim)
    inner_bytes: int  # bytes of one segment (product of dims after block_dim, times itemsize)
    slot_offset: int  # where this tensor's segments start within a slot
    block_stride: int  # bytes between block b and b+1
    outer_strides: tuple[int, ...]  # byte strides of the dims before block_dim
    outer_shape: tuple[int, ...]


def _flatten_tensors(tensors: object) -> list[torch.Tensor]:
    return _flatten_layers(tensors)[0]


def _flatten_layers(tensors: object) -> tuple[list[torch.Tensor], list[int]]:
    """The tensors, flattened, and how many of them each top-level item holds: one *layer* per item (a
    tensor, or a layer's ``(k, v)`` pair; a dict's values in order, vLLM's ``{layer_name: kv_cache}``)."""
    if isinstance(tensors, torch.Tensor):
        return [tensors], [1]
    if isinstance(tensors, dict):
        tensors = list(tensors.values())
    if not isinstance(tensors, Iterable):
        raise InvalidTypeError(f"tensors must be a tensor or a list of tensors, got {type(tensors).__name__}")
    out: list[torch.Tensor] = []
    sizes: list[int] = []
    for item in tensors:
        if isinstance(item, torch.Tensor):
            out.append(item)
            sizes.append(1)
        elif isinstance(item, (list, tuple)) and all(isinstance(t, torch.Tensor) for t in item):
            out.extend(item)  # one (k, v) pair per layer
            if item:
                sizes.append(len(item))
        else:
            raise InvalidTypeError(f"tensors must contain torch.Tensor objects, got {type(item).__name__}")
    return out, sizes


def _regroup(layer_sizes: list[int], per_layer: object) -> list[int]:
    """``KVLayout(tensors_per_layer=n)``: a flat list of tensors, ``n`` consecutive tensors per layer."""
    if isinstance(per_layer, bool) or not isinstance(per_layer, int) or per_layer <= 0:
        raise InvalidArgumentError(f"tensors_per_layer must be a positive int or None, got {per_layer!r}")
    if any(n != 1 for n in layer_sizes):
        raise InvalidArgumentError(
            "tensors_per_layer applies to a flat list of tensors ([k0, v0, k1, v1, ...]); these tensors are "
            "already grouped by layer (pairs or lists): leave tensors_per_layer out"
        )
    total = len(layer_sizes)
    if total % per_layer:
        raise InvalidArgumentError(
            f"tensors_per_layer must divide the number of tensors, got tensors_per_layer={per_layer} for "
            f"{total} tensors"
        )
    return [per_layer] * (total // per_layer)


def _check_params(block_size: object, block_dim: object, token_dim: object, model_id: object) -> int | None:
    """Validate the scalar arguments; return ``token_dim`` resolved to an index (or ``None``)."""
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
        raise InvalidArgumentError(f"block_size must be a positive int, got {block_size!r}")
    if isinstance(block_dim, bool) or not isinstance(block_dim, int) or block_dim < 0:
        raise InvalidArgumentError(f"block_dim must be a non-negative int, got {block_dim!r}")
    if model_id is not None and not isinstance(model_id, str):
        raise InvalidTypeError(f"model_id must be a str or None, got {type(model_id).__name__}")
    if token_dim is None:
        return None
    if token_dim == AFTER_BLOCK_DIM:
        return block_dim + 1
    if isinstance(token_dim, bool) or not isinstance(token_dim, int):
        raise InvalidTypeError(
            f"token_dim must be an int, None or {AFTER_BLOCK_DIM!r}, got {type(token_dim).__name__}"
        )
    if token_dim < 0:
        raise InvalidArgumentError(f"token_dim must be a non-negative int, got {token_dim}")
    if token_dim == block_dim:
        raise InvalidArgumentError(f"token_dim must differ from block_dim, got {token_dim} for both")
    return token_dim


def _check_devices(flat: list[torch.Tensor]) -> torch.device:
    if not flat:
        raise InvalidLayoutError("tensors must contain at least one tensor")
    device = flat[0].device
    if device.type not in ("cpu", "cuda"):
        raise InvalidLayoutError(f"tensors must be on a cpu or cuda device, got {device}")
    for i, t in enumerate(flat):
        if t.device != device:
            raise InvalidLayoutError(
                f"tensors must share one device: tensors[{i}] is on {t.device}, tensors[0] on {device}"
            )
    return device


def _tensor_specs(flat: list[torch.Tensor], block_dim: int) -> tuple[int, list[TensorSpec]]:
    """Check each tensor's structure against ``block_dim``; return the number of blocks and the slot packing."""
    num_blocks = -1
    specs: list[TensorSpec] = []
    offset = 0
    for i, t in enumerate(flat):
        if t.dim() <= block_dim:
            raise InvalidLayoutError(
                f"tensors[{i}] has {t.dim()} dims; block_dim={block_dim} needs at least {block_dim + 1}"
            )
        if t.is_sparse or t.is_quantized or t.dtype == torch.bool:
            raise InvalidLayoutError(f"tensors[{i}] must be a dense numeric tensor, got {t.dtype}")
        n = int(t.shape[block_dim])
        if num_blocks < 0:
            num_blocks = n
        elif n != num_blocks:
            raise InvalidLayoutError(
                f"tensors must have the same number of blocks along block_dim={block_dim}: "
                f"tensors[{i}] has {n}, tensors[0] has {num_blocks}"
            )
        if any(size == 0 for d, size in enumerate(t.shape) if d != block_dim):
            raise InvalidLayoutError(
                f"tensors[{i}] must have no dimension of size 0, got shape {list(t.shape)}: "
                "a block must hold at least one byte of every tensor"
            )
        spec = _tensor_spec(i, t, block_dim, offset)
        specs.append(spec)
        offset += spec.outer * spec.inner_bytes
    if num_blocks <= 0:
        raise InvalidLayoutError("tensors must have at least one block")
    if offset == 0:
        raise InvalidLayoutError("a block must hold at least one byte")
    for i, t in enumerate(flat):
        _check_no_overlap(i, t)
    return num_blocks, specs


def _tensor_spec(i: int, t: torch.Tensor, block_dim: int, offset: int) -> TensorSpec:
    esize = t.element_size()
    shape = tuple(int(s) for s in t.shape)
    strides = tuple(int(s) for s in t.stride())
    # The part of a block after block_dim must be one contiguous run of bytes.
    expect = 1
    for d in range(t.dim() - 1, block_dim, -1):
        if shape[d] != 1 and strides[d] != expect:
            raise InvalidLayoutError(
                f"tensors[{i}] must be contiguous in the dims after block_dim={block_dim} "
                f"(shape {list(shape)}, stride {list(strides)})"
            )
        expect *= shape[d]
    inner_elems = math.prod(shape[block_dim + 1 :])
    inner_bytes = inner_elems * esize
    if shape[block_dim] > 1 and strides[block_dim] * esize < inner_bytes:
        raise InvalidLayoutError(
            f"tensors[{i}] blocks must not overlap: stride {strides[block_dim]} along block_dim={block_dim} "
            f"is smaller than a block's {inner_elems} elements (an expanded view?)"
        )
    return TensorSpec(
        outer=math.prod(shape[:block_dim]),
        inner_bytes=inner_bytes,
        slot_offset=offset,
        block_stride=strides[block_dim] * esize,
        outer_strides=tuple(s * esize for s in strides[:block_dim]),
        outer_shape=shape[:block_dim],
    )


def _check_no_overlap(i: int, t: torch.Tensor) -> None:
    """Refuse a tensor whose elements share memory (an expanded or otherwise self-overlapping view): a load
    would write one byte for several positions. Sufficient test: sorted by stride, each dimension steps over
    everything the smaller ones span."""
    dims = sorted((int(st), int(sz)) for st, sz in zip(t.stride(), t.shape, strict=True) if sz > 1)
    span = 1
    for stride, size in dims:
        if stride < span:
            raise InvalidLayoutError(
                f"tensors[{i}] must not have overlapping elements (shape {list(t.shape)}, stride "
                f"{list(t.stride())}): an expanded view?"
            )
        span = stride * size


def _check_no_aliasing(flat: list[torch.Tensor]) -> None:
    """Refuse the same memory passed twice (e.g. ``[k0, k0]`` instead of ``[k0, v0]``)."""
    seen: dict[int, int] = {}
    for i, t in enumerate(flat):
        first = seen.setdefault(t.data_ptr(), i)
        if first != i:
            raise InvalidLayoutError(
                f"tensors[{i}] must not share memory with tensors[{first}] (the same tensor passed twice?)"
            )


def _check_tokens(flat: list[torch.Tensor], block_size: int, token_dim: int) -> None:
    for i, t in enumerate(flat):
        if t.dim() <= token_dim:
            raise InvalidLayoutError(
                f"tensors[{i}] has {t.dim()} dims; token_dim={token_dim} needs at least {token_dim + 1} "
                "(pass token_dim=None for a layout without a token dimension)"
            )
        tokens = int(t.shape[token_dim])
        if tokens != block_size:
            raise InvalidLayoutError(
                f"block_size must equal the size of the token dimension (token_dim={token_dim}) of every "
                f"tensor, got block_size={block_size} and tensors[{i}] of shape {list(t.shape)} holding "
                f"{tokens} tokens per block (pass the right token_dim, or token_dim=None to skip this check)"
            )


def _fingerprint(flat: list[torch.Tensor], block_size: int, block_dim: int, model_id: str | None) -> bytes:
    """Block size, block dim, and each tensor's dtype and per-block shape (never the number of blocks)."""
    fp = hashlib.sha256(b"aiokv/layout/v1")
    fp.update(f"block_size={block_size};block_dim={block_dim};n={len(flat)};".encode())
    for t in flat:
        shape = tuple(int(s) for s in t.shape)
        per_block_shape = shape[:block_dim] + shape[block_dim + 1 :]
        fp.update(f"[{t.dtype}:{list(per_block_shape)}]".encode())
    if model_id is not None:
        fp.update(b"model=" + model_id.encode())
    return fp.digest()


AFTER_BLOCK_DIM: Final = "after_block_dim"
"""``KVLayout(token_dim=...)`` default: the tokens of a block are indexed by the dimension right after
``block_dim`` (vLLM's ``(num_blocks, block_size, heads, head_dim)``)."""


class KVLayout:
    """The engine's paged KV cache: one or more tensors per layer sharing a block dimension.

    >>> k = torch.zeros(64, 16, 8, 128); v = torch.zeros_like(k)
    >>> layout = KVLayout([k, v], block_size=16)          # vLLM layout: (num_blocks, block_size, heads, dim)

    ``block_size`` is the number of tokens per block; ``block_dim`` the dimension indexing blocks (0 for vLLM's
    per-layer K and V tensors, 1 for a stacked ``(2, num_blocks, ...)`` tensor). ``token_dim`` is the dimension
    indexing a block's tokens: every tensor must have exactly ``block_size`` entries along it, so a
    ``block_size`` that does not match the tensors (which would store and restore the wrong tokens' KV) is
    refused. It defaults to the dimension right after ``block_dim`` (``"after_block_dim"``, vLLM's layouts);
    give its index for other layouts (e.g. 2 for ``(num_blocks, heads, block_size, dim)``), or ``None`` for a
    layout without a token dimension of its own (tokens fused with other dimensions): the check is then
    skipped and ``block_size`` is taken on trust. ``model_id`` is mixed into the hash root so caches of
    different models never match; under tensor parallelism include the rank in it (ranks hold different heads
    with identical shapes).

    ``tensors_per_layer``: for a flat list ``[k0, v0, k1, v1, ...]``, how many consecutive tensors make one
    model layer (2 here), so :attr:`layers` matches the model's layers for layer-wise loads. Without it a flat
    list is one layer per tensor (right for one tensor per layer, e.g. MLA's latent cache); a list of
    ``(k, v)`` pairs or vLLM's ``{layer_name: kv_cache}`` is one layer per item. It changes neither the
    fingerprint nor the slots: only how :attr:`layers` groups the tensors.

    Also refused: tensors on different devices or with different numbers of blocks, a block that is not one
    contiguous run of bytes per segment, tensors whose elements overlap (an expanded view), the same memory
    passed twice (e.g. ``[k0, k0]`` instead of ``[k0, v0]``: V would never be offloaded), and dimensions of
    size 0.
    """

    def __init__(
        self,
        tensors: Sequence[torch.Tensor | Sequence[torch.Tensor]] | Mapping[str, torch.Tensor] | torch.Tensor,
        block_size: int = 16,
        block_dim: int = 0,
        *,
        token_dim: int | Literal["after_block_dim"] | None = AFTER_BLOCK_DIM,
        model_id: str | None = None,
        tensors_per_layer: int | None = None,
    ) -> None:
        token_dim = _check_params(block_size, block_dim, token_dim, model_id)
        flat, layer_sizes = _flatten_layers(tensors)
        if tensors_per_layer is not None:
            layer_sizes = _regroup(layer_sizes, tensors_per_layer)
        device = _check_devices(flat)
        num_blocks, specs = _tensor_specs(flat, block_dim)
        _check_no_aliasing(flat)
        if token_dim is not None:
            _check_tokens(flat, block_size, token_dim)
        self.tensors: tuple[torch.Tensor, ...] = tuple(flat)
        self.block_size = block_size
        self.block_dim = block_dim
        self.token_dim = token_dim
        self.num_blocks = num_blocks
        self.device = device
        self.model_id = model_id
        self.specs: tuple[TensorSpec, ...] = tuple(specs)
        self.slot_bytes = sum(spec.outer * spec.inner_bytes for spec in specs)
        self.fingerprint = _fingerprint(flat, block_size, block_dim, model_id)
        self.root = make_root(self.fingerprint, model_id)
        self._seg_cache: tuple[Int64Array, Int64Array, Int64Array] | None = None
        layers: list[range] = []
        first = 0
        for n in layer_sizes:
            layers.append(range(first, first + n))
            first += n
        self._layers: tuple[range, ...] = tuple(layers)

    @classmethod
    def from_groups(
        cls,
        groups: Sequence[Any],
        block_size: int = 16,
        *,
        model_id: str | None = None,
        tp_rank: int = 0,
        tp_size: int = 1,
        checkpoint_blocks: int | None = None,
        pp_rank: int = 0,
        pp_size: int = 1,
    ) -> KVLayout:
        """A layout made of several KV-cache groups (:class:`aiokv.KVGroup`): full attention, sliding window,
        MLA latent, recurrent state; see :class:`aiokv.GroupedLayout`. ``block_size`` is every group's tokens
        per block. ``tp_rank``/``tp_size``: this rank under tensor parallelism (keys of non-replicated groups
        are per rank, and a cache written at another TP size never restores). ``checkpoint_blocks``: a
        sliding-window or state group's parts are kept at every multiple of it (default ``max(4 * w, 16)``
        blocks for a window of ``w`` blocks), at the prompt's end and at a request's final boundary.
        ``pp_rank``/``pp_size``: this pipeline stage (stages hold different layers, often of identical
        shapes: each stage's cache is its own)."""
        from ._groups import GroupedLayout

        return GroupedLayout(
            groups,
            block_size,
            model_id=model_id,
            tp_rank=tp_rank,
            tp_size=tp_size,
            checkpoint_blocks=checkpoint_blocks,
            pp_rank=pp_rank,
            pp_size=pp_size,
        )

    @property
    def is_grouped(self) -> bool:
        """Whether this layout is made of several KV-cache groups (block ids are then given per group)."""
        return False

    @property
    def layers(self) -> tuple[range, ...]:
        """The layers, in the order the engine's forward computes them: for each, the indices of its tensors
        in :attr:`tensors`. One layer per item of the ``tensors`` the layout was built from (a tensor, or a
        layer's ``(k, v)`` pair; a dict's values in order). Layer-wise loads (``Request.load(...,
        layerwise=True)``) copy and complete one layer at a time, in this order."""
        return self._layers

    @property
    def num_layers(self) -> int:
        return len(self._layers)

    def layer_span(self, layer: int) -> tuple[int, int]:
        """Bytes ``[lo, hi)`` of a slot that hold layer ``layer`` (a layer's tensors are adjacent in a slot)."""
        r = self._layers[layer]
        lo = self.specs[r.start].slot_offset
        last = self.specs[r.stop - 1]
        return lo, last.slot_offset + last.outer * last.inner_bytes

    def layer_segments(self, layer: int) -> tuple[int, int]:
        """Segments ``[a, b)`` of a block's copy plan (:meth:`copy_plan`'s per-block order) that are layer
        ``layer``'s."""
        r = self._layers[layer]
        a = sum(spec.outer for spec in self.specs[: r.start])
        return a, a + sum(spec.outer for spec in self.specs[r.start : r.stop])

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def bytes_per_token(self) -> int:
        return self.slot_bytes // self.block_size

    def describe(self) -> str:
        dtypes = sorted({str(t.dtype) for t in self.tensors})
        return (
            f"{len(self.tensors)} tensors x {self.num_blocks} blocks of {self.block_size} tokens, "
            f"{self.slot_bytes} bytes/block, {','.join(dtypes)} on {self.device}"
        )

    def __repr__(self) -> str:
        return f"KVLayout({self.describe()})"

    # ----------------------------------------------------------------- validation
    def check_block_ids(self, block_ids: Any, name: str = "block_ids") -> list[int]:
        """Validate engine block ids: ints in ``[0, num_blocks)``, no duplicates. Returns a list of ints."""
        if isinstance(block_ids, (torch.Tensor, np.ndarray)):
            block_ids = block_ids.tolist()
        if isinstance(block_ids, (str, bytes)) or not isinstance(block_ids, Iterable):
            raise InvalidTypeError(f"{name} must be a sequence of ints, got {type(block_ids).__name__}")
        ids: list[int] = []
        num_blocks = self.num_blocks
        for raw in block_ids:
            # operator.index accepts int-like values only (numpy ints, 0-d tensors), never floats or strings.
            try:
                if isinstance(raw, bool):
                    raise TypeError
                b = operator.index(raw)
            except TypeError:
                raise InvalidTypeError(f"{name} must contain ints, got {raw!r}") from None
            if b < 0 or b >= num_blocks:
                raise BlockRangeError(f"{name} must be in [0, {num_blocks}), got {b}")
            ids.append(b)
        if len(set(ids)) != len(ids):
            raise InvalidArgumentError(f"{name} must not contain duplicates, got {ids}")
        return ids

    # ------------------------------------------------------------ CPU copy plans
    def _segments(self) -> tuple[Int64Array, Int64Array, Int64Array]:
        """Per segment of a block: address of block 0's segment, its length, its offset in a slot."""
        if self._seg_cache is None:
            bases: list[int] = []
            lens: list[int] = []
            offs: list[int] = []
            for t, spec in zip(self.tensors, self.specs, strict=True):
                base = t.data_ptr()
                off = spec.slot_offset
                for outer_idx in np.ndindex(*spec.outer_shape) if spec.outer_shape else [()]:
                    seg = base + sum(i * s for i, s in zip(outer_idx, spec.outer_strides, strict=True))
                    bases.append(seg)
                    lens.append(spec.inner_bytes)
                    offs.append(off)
                    off += spec.inner_bytes
            self._seg_cache = (
                np.asarray(bases, dtype=np.int64),
                np.asarray(lens, dtype=np.int64),
                np.asarray(offs, dtype=np.int64),
            )
        return self._seg_cache

    def block_strides(self) -> Int64Array:
        """Per segment: bytes between consecutive blocks."""
        strides: list[int] = []
        for spec in self.specs:
            strides.extend([spec.block_stride] * spec.outer)
        return np.asarray(strides, dtype=np.int64)

    def copy_plan(
        self, block_ids: Sequence[int], slot_ids: Sequence[int], buffer_addr: int
    ) -> tuple[Int64Array, Int64Array, Int64Array]:
        """Addresses for copying engine blocks ``block_ids[i]`` <-> host slots ``slot_ids[i]``.

        Returns ``(engine_addrs, slot_addrs, nbytes)``, ordered slot by slot so the host side is sequential.
        """
        bases, lens, offs = self._segments()
        strides = self.block_strides()
        blocks = np.asarray(block_ids, dtype=np.int64)
        slots = np.asarray(slot_ids, dtype=np.int64)
        engine = (bases[None, :] + blocks[:, None] * strides[None, :]).ravel()
        host = (buffer_addr + slots[:, None] * self.slot_bytes + offs[None, :]).ravel()
        nbytes = np.broadcast_to(lens, (len(blocks), len(lens))).ravel().copy()
        return engine, host, nbytes
