"""KV-cache groups: layouts whose layers do not all keep the same kind of cache.

A grouped layout (:meth:`KVLayout.from_groups`) is a list of :class:`KVGroup`, each with its own tensors and
block table and one of four kinds:

- ``"full"``: full attention. A prefix hit of ``N`` blocks needs this group's blocks ``[0, N)``.
- ``"sliding_window"`` (``window=W`` tokens, the attention window counting the current token, as in Gemma 3,
  Hugging Face and vLLM: the token at position ``p`` attends to ``p - W + 1 .. p``): resuming after ``N`` blocks
  needs only the blocks holding tokens ``[N * bs - (W - 1), N * bs)``.
- ``"latent"``: an MLA latent cache (one tensor per layer, no K/V split). Needs ``[0, N)`` like ``"full"``;
  every tensor-parallel rank holds the same bytes, so it is replicated by default (stored once, restored by
  every rank).
- ``"state"``: a fixed-size per-request snapshot (Mamba / linear-attention state). The group's block at key
  block ``i`` holds the snapshot *after* tokens ``[0, (i + 1) * bs)``; resuming after ``N`` blocks needs the
  snapshot at ``N``.

**Block sizes.** The layout's ``block_size`` is the key block; a group may have smaller blocks
(``KVGroup(block_size=...)`` dividing it): a key block then covers ``ratio`` of its engine blocks, and a row of
the request's table holds every group's ids for one key block.

**One key per token block.** Hashes are chained over the tokens as for a one-group layout; the layout root
fingerprints every group. What a block stores is split in *parts*: the *base* part (every full and latent
group; stored for every block), one *window* part per sliding-window group and one *state* part per state
group (stored only at the boundaries a hit can use, see :class:`Retention`). Every tier holds fixed-size
payloads, so each part is cut into *units* of :attr:`GroupedLayout.slot_bytes` bytes (the base part is one unit
exactly; the others are padded to whole units). The base unit's key is the block's chained hash itself (one
dictionary probe per block on lookup, however many groups); the other units' keys are derived from it.

**Tensor parallelism.** ``tp_rank``/``tp_size``: a non-replicated part's unit keys mix in the rank (ranks hold
different shards) and the fingerprint mixes in ``tp_size`` (a cache written at one TP size never restores at
another); a replicated part's keys are the same on every rank and its fingerprint leaves ``tp_size`` out, so a
cache of replicated (latent) groups restores at any TP size.
"""

from __future__ import annotations

import enum
import hashlib
import operator
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Final, Literal

import numpy as np
import torch

from ._errors import BlockRangeError, InvalidArgumentError, InvalidLayoutError, InvalidTypeError
from ._grouprule import Retention, longest_hit, window_blocks
from ._hashing import make_root
from ._layout import (
    AFTER_BLOCK_DIM,
    Int64Array,
    KVLayout,
    TensorSpec,
    _check_devices,
    _check_no_aliasing,
    _check_params,
    _check_tokens,
    _flatten_tensors,
    _tensor_specs,
)

__all__ = ["NO_BLOCK", "GroupKind", "GroupedLayout", "KVGroup", "Retention", "longest_hit"]

NO_BLOCK: Final = -1
"""In a grouped layout's per-group block ids: the engine holds no block there (vLLM's null block for a
sliding-window group's blocks outside the window, a state group's boundaries without a snapshot)."""


class GroupKind(str, enum.Enum):
    """What a group's cache holds, and so which of its blocks a prefix hit needs."""

    FULL = "full"
    SLIDING_WINDOW = "sliding_window"
    LATENT = "latent"
    STATE = "state"

    def __str__(self) -> str:
        return self.value


_KIND_NAMES = ", ".join(repr(k.value) for k in GroupKind)

# Part classes, in the order parts are laid out (the base part first: its unit key is the chained hash).
_BASE, _WINDOW, _STATE = 0, 1, 2


@dataclass(frozen=True, slots=True, eq=False)
class KVGroup:
    """One KV-cache group: tensors sharing a block table, with a kind (see the module docs).

    ``tensors`` are validated like :class:`KVLayout`'s (same device, same number of blocks along ``block_dim``,
    contiguous after it, no overlap, no aliasing); ``token_dim`` likewise (``None`` for a state group, which
    has no token dimension). ``window`` is required for, and only allowed on, a sliding-window group.
    ``block_size`` (tokens per engine block of this group) defaults to the layout's and must divide it. ``replicated``: the bytes are identical on every tensor-parallel
    rank (default: true for latent groups, false otherwise). ``name`` appears in messages and stats.
    """

    tensors: Any
    kind: GroupKind | str = GroupKind.FULL
    window: int | None = None
    block_size: int | None = None
    block_dim: int = 0
    token_dim: int | Literal["after_block_dim"] | None = AFTER_BLOCK_DIM
    replicated: bool | None = None
    name: str | None = None


@dataclass(frozen=True, slots=True)
class _Group:
    """A validated group."""

    index: int
    name: str
    kind: GroupKind
    window: int | None
    replicated: bool
    tensors: tuple[torch.Tensor, ...]
    specs: tuple[TensorSpec, ...]
    num_blocks: int
    block_bytes: int  # bytes of one of its blocks (all its tensors)
    block_dim: int
    block_size: int  # tokens per engine block of this group (divides the layout's)
    ratio: int  # engine blocks of this group per key block (layout block_size // block_size)


@dataclass(frozen=True, slots=True)
class _Part:
    cls: int  # _BASE, _WINDOW or _STATE
    groups: tuple[int, ...]  # group indices, in slot order
    columns: tuple[int, ...]  # the row columns (engine block ids) its groups read
    replicated: bool
    nbytes: int  # bytes of the part for one key block
    units: int  # units it is cut into
    first_unit: int  # index of its first unit kind in GroupedLayout.unit_parts


def _kind(value: object, i: int) -> GroupKind:
    try:
        return GroupKind(value)
    except ValueError:
        raise InvalidArgumentError(f"groups[{i}].kind must be one of {_KIND_NAMES}, got {value!r}") from None


def _positive(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidTypeError(f"{name} must be an int, got {type(value).__name__}")
    if value <= 0:
        raise InvalidArgumentError(f"{name} must be > 0, got {value}")
    return value


def _check_group(i: int, g: object, block_size: int) -> _Group:
    if not isinstance(g, KVGroup):
        raise InvalidTypeError(f"groups[{i}] must be an aiokv.KVGroup, got {type(g).__name__}")
    kind = _kind(g.kind, i)
    name = g.name if g.name is not None else f"{kind.value}{i}"
    if not isinstance(name, str) or not name:
        raise InvalidTypeError(f"groups[{i}].name must be a non-empty str, got {g.name!r}")
    window = g.window
    if kind is GroupKind.SLIDING_WINDOW:
        if window is None:
            raise InvalidArgumentError(
                f"groups[{i}].window must be given for a sliding_window group (tokens)"
            )
        window = _positive(f"groups[{i}].window", window)
    elif window is not None:
        raise InvalidArgumentError(
            f"groups[{i}].window must be None for a {kind.value} group (only sliding_window groups have one), "
            f"got {window!r}"
        )
    gbs = block_size
    if g.block_size is not None:
        gbs = _positive(f"groups[{i}].block_size", g.block_size)
        if block_size % gbs:
            raise InvalidArgumentError(
                f"groups[{i}].block_size must divide the layout's block_size={block_size} (a key block covers "
                f"whole engine blocks of every group), got {gbs}"
            )
    replicated = g.replicated
    if replicated is None:
        replicated = kind is GroupKind.LATENT
    elif not isinstance(replicated, bool):
        raise InvalidTypeError(
            f"groups[{i}].replicated must be a bool or None, got {type(replicated).__name__}"
        )
    token_dim = None if kind is GroupKind.STATE else g.token_dim
    if kind is GroupKind.STATE and g.token_dim not in (None, AFTER_BLOCK_DIM):
        raise InvalidArgumentError(
            f"groups[{i}].token_dim must be None for a state group (no token dimension)"
        )
    try:
        tdim = _check_params(gbs, g.block_dim, token_dim, None)
        flat = _flatten_tensors(g.tensors)
        _check_devices(flat)
        num_blocks, specs = _tensor_specs(flat, g.block_dim)
        if tdim is not None:
            _check_tokens(flat, gbs, tdim)
    except InvalidArgumentError as exc:  # InvalidLayoutError included
        raise type(exc)(f"groups[{i}] ({name}): {exc}") from None
    except InvalidTypeError as exc:
        raise InvalidTypeError(f"groups[{i}] ({name}): {exc}") from None
    return _Group(
        index=i,
        name=name,
        kind=kind,
        window=window,
        replicated=replicated,
        tensors=tuple(flat),
        specs=tuple(specs),
        num_blocks=num_blocks,
        block_bytes=sum(s.outer * s.inner_bytes for s in specs),
        block_dim=g.block_dim,
        block_size=gbs,
        ratio=block_size // gbs,
    )


def _memory_classes(gs: Sequence[_Group]) -> tuple[int, ...]:
    """Groups that share tensors (vLLM's hybrid allocator gives a sliding-window layer and a full-attention
    layer one buffer, each group using its own block ids of it): one class per set of groups sharing memory.
    A tensor shared across groups must be the very same view (pointer, shape, strides, dtype); any other
    overlap, and any tensor twice in one group, is refused."""
    owner: dict[tuple[Any, ...], int] = {}
    parent = list(range(len(gs)))

    def find(i: int) -> int:
        while parent[i] != i:
            i = parent[i]
        return i

    spans: list[tuple[int, int, int]] = []
    for g in gs:
        try:
            _check_no_aliasing(list(g.tensors))
        except InvalidLayoutError as exc:
            raise InvalidLayoutError(f"groups[{g.index}] ({g.name}): {exc}") from None
        for t in g.tensors:
            ident = (t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.dtype)
            first = owner.get(ident)
            if first is None:
                owner[ident] = g.index
                spans.append((t.data_ptr(), t.data_ptr() + _extent(t), g.index))
            else:
                parent[find(g.index)] = find(first)
    spans.sort()
    for i, (lo1, hi1, g1) in enumerate(spans):  # sorted by start: only the spans starting before hi1
        for lo2, _hi2, g2 in spans[i + 1 :]:
            if lo2 >= hi1:
                break
            if (
                g1 != g2
            ):  # (views of one tensor within a group, like K and V of a stacked tensor, may interleave)
                raise InvalidLayoutError(
                    f"groups must not share memory except as the very same tensor: groups[{g1}] and "
                    f"groups[{g2}] hold overlapping tensors at {lo1:#x} and {lo2:#x}"
                )
    return tuple(find(i) for i in range(len(gs)))


def _extent(t: torch.Tensor) -> int:
    """Bytes from a tensor's first element to one past its last."""
    if t.numel() == 0:
        return 0
    return (sum((s - 1) * st for s, st in zip(t.shape, t.stride(), strict=True)) + 1) * t.element_size()


def _unit_key_prefix(part: int, chunk: int, rank: int | None) -> bytes:
    return b"aiokv/unit/v1" + struct.pack("<HHi", part, chunk, -1 if rank is None else rank)


class GroupedLayout(KVLayout):
    """A :class:`KVLayout` made of several :class:`KVGroup` (built by :meth:`KVLayout.from_groups`).

    Everything the tiers see is as for a one-group layout: fixed-size payloads of :attr:`slot_bytes` (one
    *unit*) under 32-byte keys. Engine block ids are given per group: a tuple with one sequence per group
    (vLLM's per-group block ids), :data:`NO_BLOCK` where the engine holds no block.
    """

    groups: tuple[_Group, ...]
    parts: tuple[_Part, ...]

    def __init__(
        self,
        groups: Sequence[KVGroup],
        block_size: int = 16,
        *,
        model_id: str | None = None,
        tp_rank: int = 0,
        tp_size: int = 1,
        checkpoint_blocks: int | None = None,
        pp_rank: int = 0,
        pp_size: int = 1,
    ) -> None:
        if isinstance(groups, KVGroup) or not isinstance(groups, Iterable):
            raise InvalidTypeError(f"groups must be a sequence of aiokv.KVGroup, got {type(groups).__name__}")
        groups = list(groups)
        if not groups:
            raise InvalidArgumentError("groups must contain at least one KVGroup")
        _positive("block_size", block_size)
        if model_id is not None and not isinstance(model_id, str):
            raise InvalidTypeError(f"model_id must be a str or None, got {type(model_id).__name__}")
        tp_size = _positive("tp_size", tp_size)
        if isinstance(tp_rank, bool) or not isinstance(tp_rank, int):
            raise InvalidTypeError(f"tp_rank must be an int, got {type(tp_rank).__name__}")
        if not 0 <= tp_rank < tp_size:
            raise InvalidArgumentError(f"tp_rank must be in [0, tp_size={tp_size}), got {tp_rank}")
        pp_size = _positive("pp_size", pp_size)
        if isinstance(pp_rank, bool) or not isinstance(pp_rank, int):
            raise InvalidTypeError(f"pp_rank must be an int, got {type(pp_rank).__name__}")
        if not 0 <= pp_rank < pp_size:
            raise InvalidArgumentError(f"pp_rank must be in [0, pp_size={pp_size}), got {pp_rank}")
        self.pp_rank = pp_rank
        self.pp_size = pp_size
        gs = tuple(_check_group(i, g, block_size) for i, g in enumerate(groups))
        names = [g.name for g in gs]
        for i, nm in enumerate(names):
            if names.index(nm) != i:
                raise InvalidArgumentError(f"groups[{i}].name must be unique, got {nm!r} twice")
        device = gs[0].tensors[0].device
        for g in gs:
            if g.tensors[0].device != device:
                raise InvalidLayoutError(
                    f"groups must share one device: groups[{g.index}] is on {g.tensors[0].device}, "
                    f"groups[0] on {device}"
                )
        everything = [t for g in gs for t in g.tensors]
        self.memory_class = _memory_classes(gs)
        self.groups = gs
        self.block_size = block_size
        self.block_dim = 0
        self.token_dim = None
        self.device = device
        self.model_id = model_id
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        self.tensors = tuple(everything)
        self.specs = tuple(s for g in gs for s in g.specs)
        # Parts: the base part (full + latent; split in two when some are replicated and some not), then one
        # per window and one per state group.
        base_sharded = tuple(
            g.index for g in gs if g.kind in (GroupKind.FULL, GroupKind.LATENT) and not g.replicated
        )
        base_repl = tuple(
            g.index for g in gs if g.kind in (GroupKind.FULL, GroupKind.LATENT) and g.replicated
        )
        raw: list[tuple[int, tuple[int, ...], bool]] = []
        if base_sharded:
            raw.append((_BASE, base_sharded, False))
        if base_repl:
            raw.append((_BASE, base_repl, True))
        raw += [(_WINDOW, (g.index,), g.replicated) for g in gs if g.kind is GroupKind.SLIDING_WINDOW]
        raw += [(_STATE, (g.index,), g.replicated) for g in gs if g.kind is GroupKind.STATE]
        sizes = [sum(gs[i].block_bytes * gs[i].ratio for i in members) for _c, members, _r in raw]
        # A key block's row: each group's engine block ids for it (``ratio`` of them), group after group.
        offsets: list[int] = []
        for g in gs:
            offsets.append(sum(x.ratio for x in gs[: g.index]))
        self.columns: tuple[tuple[int, ...], ...] = tuple(
            tuple(range(offsets[g.index], offsets[g.index] + g.ratio)) for g in gs
        )
        self.row_width = sum(g.ratio for g in gs)
        self.column_group: tuple[int, ...] = tuple(g.index for g in gs for _ in range(g.ratio))
        # One unit: the first base part exactly (one probe per block), else the largest part.
        unit = sizes[0] if raw[0][0] == _BASE else max(sizes)
        parts: list[_Part] = []
        unit_parts: list[tuple[int, int]] = []
        for p, ((cls, members, repl), nbytes) in enumerate(zip(raw, sizes, strict=True)):
            units = -(-nbytes // unit)
            columns = tuple(c for gi in members for c in self.columns[gi])
            parts.append(_Part(cls, members, columns, repl, nbytes, units, len(unit_parts)))
            unit_parts.extend((p, c) for c in range(units))
        self.parts = tuple(parts)
        self.unit_parts: tuple[tuple[int, int], ...] = tuple(unit_parts)
        self.slot_bytes = unit
        self.num_blocks = min(g.num_blocks for g in gs)
        self.padding_bytes = sum(p.units * unit - p.nbytes for p in parts)  # per key block, all parts kept
        self.block_bytes = sum(sizes)  # a key block with every part kept, unpadded
        self._windows = tuple(
            (p, window_blocks(gs[part.groups[0]].window or 1, block_size))
            for p, part in enumerate(parts)
            if part.cls == _WINDOW
        )
        self._states = tuple(p for p, part in enumerate(parts) if part.cls == _STATE)
        self._bases = tuple(p for p, part in enumerate(parts) if part.cls == _BASE)
        self.base_units: tuple[int, ...] = tuple(u for p in self._bases for u in self.part_units(p))
        if checkpoint_blocks is None:
            w = max((w for _p, w in self._windows), default=1)
            checkpoint_blocks = max(4 * w, 16)
        self.retention = Retention(_positive("checkpoint_blocks", checkpoint_blocks))
        self.fingerprint = self._grouped_fingerprint()
        self.root = make_root(self.fingerprint, model_id)
        self._prefixes = tuple(
            _unit_key_prefix(p, c, None if parts[p].replicated or tp_size == 1 else tp_rank)
            for p, c in unit_parts
        )
        # The first base unit's key is the chained hash itself when it is the same on every rank.
        self._identity_first = bool(parts[0].cls == _BASE and (parts[0].replicated or tp_size == 1))
        self._seg_cache = None
        self._layers = ()  # layer-wise loads are for plain layouts (see KVLayout.layers)
        self._plans: list[tuple[Int64Array, ...]] = [self._unit_plan(u) for u in range(len(unit_parts))]

    # --------------------------------------------------------------- description
    def _grouped_fingerprint(self) -> bytes:
        fp = hashlib.sha256(b"aiokv/layout/groups/v1")
        fp.update(f"block_size={self.block_size};groups={len(self.groups)};".encode())
        if self.pp_size > 1:  # pipeline stages hold different layers, often of identical shapes
            fp.update(f"pp={self.pp_rank}/{self.pp_size};".encode())
        for g in self.groups:
            fp.update(f"<{g.kind.value}:w={g.window}:repl={g.replicated}:bd={g.block_dim}:".encode())
            if not g.replicated:
                fp.update(f"tp={self.tp_size}:".encode())
            for t in g.tensors:
                shape = tuple(int(s) for s in t.shape)
                per_block = shape[: g.block_dim] + shape[g.block_dim + 1 :]
                fp.update(f"[{t.dtype}:{list(per_block)}]".encode())
            fp.update(b">")
        return fp.digest()

    @property
    def is_grouped(self) -> bool:
        return True

    @property
    def bytes_per_token(self) -> int:
        return self.block_bytes // self.block_size

    @property
    def has_base(self) -> bool:
        return bool(self._bases)

    def describe(self) -> str:
        kinds = ",".join(
            f"{g.name}={g.kind.value}" + (f"/{g.window}" if g.window else "") for g in self.groups
        )
        tp = f", tp {self.tp_rank}/{self.tp_size}" if self.tp_size > 1 else ""
        return (
            f"{len(self.groups)} groups ({kinds}) of {self.block_size}-token blocks, {self.block_bytes} bytes/block "
            f"in {len(self.unit_parts)} units of {self.slot_bytes} bytes{tp} on {self.device}"
        )

    def __repr__(self) -> str:
        return f"GroupedLayout({self.describe()})"

    # ------------------------------------------------------------------- keys
    def unit_key(self, block_key: bytes, unit: int) -> bytes:
        """The key unit ``unit`` of a block is stored under (the block's chained hash for the first base
        unit when it is rank-independent)."""
        if unit == 0 and self._identity_first:
            return block_key
        return hashlib.sha256(self._prefixes[unit] + block_key).digest()

    def retain_keys(self, chain: Sequence[bytes]) -> list[bytes]:
        """The unit keys a hit at the end of ``chain`` needs: every base unit of its blocks, the window units
        before its end and the state units at it (what ``retain_s`` keeps for a conversation's next turn)."""
        out = [self.unit_key(k, u) for k in chain for u in self.base_units]
        out += [self.unit_key(chain[j], u) for j, u in self.needed_units(len(chain))]
        return out

    def part_units(self, part: int) -> range:
        p = self.parts[part]
        return range(p.first_unit, p.first_unit + p.units)

    # ------------------------------------------------------------- validation
    def check_block_ids(self, block_ids: Any, name: str = "block_ids") -> list[Any]:
        """Validate per-group engine block ids covering whole key blocks: a sequence with one sequence of ids
        per group, group ``g`` giving ``ratio`` ids per key block (1 when it shares the layout's block size),
        each id in ``[0, num_blocks)`` of its group or :data:`NO_BLOCK`, no id twice (within a group, or
        within groups sharing tensors). Returns one row per key block: every group's ids for it, in order."""
        return self.check_rows(block_ids, name, None)

    def check_rows(self, block_ids: Any, name: str, held: set[tuple[int, int]] | None) -> list[Any]:
        cols = self.check_columns(block_ids, name, held)
        gs = self.groups
        n = len(cols[0]) // gs[0].ratio
        for g, col in zip(gs, cols, strict=True):
            if len(col) != n * g.ratio:
                raise InvalidArgumentError(
                    f"{name} must cover the same key blocks in every group ({gs[0].name}: {len(cols[0])} blocks "
                    f"of {gs[0].block_size} tokens), got {len(col)} blocks of {g.block_size} tokens for {g.name}"
                    + ("" if g.ratio == 1 else f" (a multiple of {g.ratio})")
                )
        return self._rows(cols, n)

    def take_rows(
        self, block_ids: Any, name: str, held: set[tuple[int, int]], pending: list[list[int]]
    ) -> list[Any]:
        """:meth:`check_rows` for an engine handing blocks out in each group's own granularity: the new ids
        are appended to ``pending`` (one list per group, the ids not yet forming a whole key block, which the
        caller keeps); the key blocks every group now covers are returned as rows and leave ``pending``."""
        cols = self.check_columns(block_ids, name, held, pending)
        for p, col in zip(pending, cols, strict=True):
            p.extend(col)
        gs = self.groups
        n = min(len(p) // g.ratio for g, p in zip(gs, pending, strict=True))
        if n == 0:
            return []
        rows = self._rows(pending, n)
        for g, p in zip(gs, pending, strict=True):
            del p[: n * g.ratio]
        return rows

    def pending_tokens(self, rows: int, pending: Sequence[Sequence[int]]) -> int:
        """Tokens the engine blocks cover: ``rows`` whole key blocks plus, per group, its pending blocks; the
        least over the groups."""
        return rows * self.block_size + min(
            len(p) * g.block_size for g, p in zip(self.groups, pending, strict=True)
        )

    def _rows(self, cols: Sequence[Sequence[int]], n: int) -> list[Any]:
        gs = self.groups
        if all(g.ratio == 1 for g in gs):
            return list(zip(*(c[:n] for c in cols), strict=True))
        return [
            tuple(b for g, c in zip(gs, cols, strict=True) for b in c[i * g.ratio : (i + 1) * g.ratio])
            for i in range(n)
        ]

    def check_columns(
        self,
        block_ids: Any,
        name: str,
        held: set[tuple[int, int]] | None,
        pending: Sequence[Sequence[int]] | None = None,
    ) -> list[list[int]]:
        """Validate per-group id sequences (see :meth:`check_block_ids`); no row assembly."""
        gs = self.groups
        if isinstance(block_ids, (str, bytes, torch.Tensor, np.ndarray)) or not isinstance(
            block_ids, Sequence
        ):
            raise InvalidTypeError(
                f"{name} must be a sequence with one sequence of block ids per group ({len(gs)}), "
                f"got {type(block_ids).__name__}"
            )
        if len(block_ids) != len(gs):
            raise InvalidArgumentError(
                f"{name} must have one sequence of block ids per group ({len(gs)}: "
                f"{', '.join(g.name for g in gs)}), got {len(block_ids)}"
            )
        cols: list[list[int]] = []
        mem = self.memory_class
        seen_in: dict[int, set[int]] = {}  # per memory class: groups sharing tensors share block ids
        if pending is not None:
            for gi, ids in enumerate(pending):
                seen_in.setdefault(mem[gi], set()).update(b for b in ids if b >= 0)
        for gi, (g, raw_ids) in enumerate(zip(gs, block_ids, strict=True)):
            if isinstance(raw_ids, (torch.Tensor, np.ndarray)):
                raw_ids = raw_ids.tolist()
            if isinstance(raw_ids, (str, bytes)) or not isinstance(raw_ids, Iterable):
                raise InvalidTypeError(
                    f"{name}[{gi}] must be a sequence of ints, got {type(raw_ids).__name__}"
                )
            col: list[int] = []
            seen = seen_in.setdefault(mem[gi], set())
            base = g.kind in (GroupKind.FULL, GroupKind.LATENT)
            for raw in raw_ids:
                try:
                    if isinstance(raw, bool):
                        raise TypeError
                    b = operator.index(raw)
                except TypeError:
                    raise InvalidTypeError(f"{name}[{gi}] must contain ints, got {raw!r}") from None
                if b != NO_BLOCK:
                    if b < 0 or b >= g.num_blocks:
                        raise BlockRangeError(
                            f"{name}[{gi}] ({g.name}) must be in [0, {g.num_blocks}) or {NO_BLOCK} (no block), got {b}"
                        )
                    if b in seen or (held is not None and (mem[gi], b) in held):
                        shared = "" if mem.count(mem[gi]) == 1 else " (or one of a group sharing its tensors)"
                        raise InvalidArgumentError(
                            f"{name}[{gi}] ({g.name}) must not repeat a block the request holds{shared}, got {b}"
                        )
                    seen.add(b)
                elif base:
                    raise InvalidArgumentError(
                        f"{name}[{gi}] ({g.name}) must hold a block at every position ({g.kind.value} groups keep "
                        f"every block), got {NO_BLOCK} at {len(col)}"
                    )
                col.append(b)
            cols.append(col)
        return cols

    def held(self, rows: Iterable[Any]) -> set[tuple[int, int]]:
        """The engine memory ``rows`` hold: ``(memory class, block id)`` pairs (``NO_BLOCK`` holds none)."""
        mem = self.memory_class
        owner = self.column_group
        return {(mem[owner[c]], b) for row in rows for c, b in enumerate(row) if b >= 0}

    # ------------------------------------------------------------ copy plans
    def _unit_plan(self, unit: int) -> tuple[Int64Array, ...]:
        """Per segment piece of unit ``unit``: its row column (which engine block id it reads), address of
        block 0's piece, length, offset within the unit's slot, and the group tensor's block stride. A part
        packs its groups in order, each group's engine blocks of the key block in order, tensor by tensor."""
        p, c = self.unit_parts[unit]
        part = self.parts[p]
        lo, hi = c * self.slot_bytes, (c + 1) * self.slot_bytes
        cols: list[int] = []
        bases: list[int] = []
        lens: list[int] = []
        offs: list[int] = []
        strides: list[int] = []
        pos = 0  # offset within the part
        for gi in part.groups:
            g = self.groups[gi]
            for column in self.columns[gi]:
                for t, spec in zip(g.tensors, g.specs, strict=True):
                    base = t.data_ptr()
                    for outer_idx in np.ndindex(*spec.outer_shape) if spec.outer_shape else [()]:
                        seg = base + sum(i * s for i, s in zip(outer_idx, spec.outer_strides, strict=True))
                        a, b = max(pos, lo), min(pos + spec.inner_bytes, hi)
                        if a < b:
                            cols.append(column)
                            bases.append(seg + (a - pos))
                            lens.append(b - a)
                            offs.append(a - lo)
                            strides.append(spec.block_stride)
                        pos += spec.inner_bytes
        return tuple(np.asarray(x, dtype=np.int64) for x in (cols, bases, lens, offs, strides))

    def copy_plan(
        self, block_ids: Sequence[Any], slot_ids: Sequence[int], buffer_addr: int
    ) -> tuple[Int64Array, Int64Array, Int64Array]:
        """Addresses for copying units ``block_ids[i] = (unit, row)`` (``row``: the key block's engine id per
        group) <-> host slots ``slot_ids[i]``; ordered by unit kind, then slot."""
        by_unit: dict[int, tuple[list[Any], list[int]]] = {}
        for ref, slot in zip(block_ids, slot_ids, strict=True):
            rows, slots = by_unit.setdefault(ref[0], ([], []))
            rows.append(ref[1])
            slots.append(slot)
        engines: list[Int64Array] = []
        hosts: list[Int64Array] = []
        sizes: list[Int64Array] = []
        ub = self.slot_bytes
        for unit, (rows, slots) in by_unit.items():
            cols, bases, lens, offs, strides = self._plans[unit]
            ids = np.asarray(rows, dtype=np.int64)[:, cols]  # (n, pieces): each piece's engine block
            if (ids < 0).any():
                raise BlockRangeError(f"a copy of unit {unit} names no engine block ({NO_BLOCK})")
            sl = np.asarray(slots, dtype=np.int64)
            engines.append((bases[None, :] + ids * strides[None, :]).ravel())
            hosts.append((buffer_addr + sl[:, None] * ub + offs[None, :]).ravel())
            sizes.append(np.broadcast_to(lens, (len(sl), len(lens))).ravel())
        if not engines:
            empty = np.zeros(0, dtype=np.int64)
            return empty, empty.copy(), empty.copy()
        return np.concatenate(engines), np.concatenate(hosts), np.concatenate(sizes).copy()

    def block_strides(
        self,
    ) -> Int64Array:  # pragma: no cover - the one-group plan; grouped plans are per unit
        raise NotImplementedError("a grouped layout's copies are planned per unit (copy_plan)")

    # ------------------------------------------------------------- hit rule
    @property
    def windows(self) -> tuple[tuple[int, int], ...]:
        """``(part, w)`` of every window part: ``w`` blocks before a boundary are needed."""
        return self._windows

    @property
    def state_parts(self) -> tuple[int, ...]:
        return self._states

    @property
    def base_parts(self) -> tuple[int, ...]:
        return self._bases

    def needed_units(self, boundary: int) -> list[tuple[int, int]]:
        """``(block, unit)`` pairs beyond the base parts that resuming after ``boundary`` blocks needs:
        window units of the blocks before it, state units at it. Ordered from the latest block down (so the
        first missing one says how far to back off)."""
        out: list[tuple[int, int]] = []
        if boundary <= 0:
            return out
        for p in self._states:
            out.extend((boundary - 1, u) for u in self.part_units(p))
        reach = max((w for _p, w in self._windows), default=0)
        for j in range(boundary - 1, max(0, boundary - reach) - 1, -1):
            for p, w in self._windows:
                if j >= boundary - w:
                    out.extend((j, u) for u in self.part_units(p))
        return out

    def back_off(self, boundary: int, block: int, unit: int) -> int:
        """The largest boundary below ``boundary`` not ruled out by unit ``unit`` of ``block`` missing."""
        part = self.parts[self.unit_parts[unit][0]]
        if part.cls == _STATE:
            return boundary - 1
        return block  # every boundary N with N - w <= block < N needs it
