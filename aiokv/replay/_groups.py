"""KV-cache groups of a replayed model: what each key block stores, in the offloader's units.

A model whose layers do not all keep the same cache (Gemma 3's sliding-window layers, gpt-oss's alternating
ones, DeepSeek's MLA latent cache, hybrid Mamba / linear-attention models) is described as a list of
:class:`GroupSpec` (kind, layers, bytes per token and layer) in a :class:`KVGroups`, or, on the command line,
``--kv-groups "full:layers=10:bytes=8KiB,sliding_window:layers=52:bytes=8KiB:window=1024"`` or a preset name
(:data:`GROUP_PRESETS`). The kinds are :class:`aiokv.KVGroup`'s: ``full`` and ``latent`` keep every block, a
``sliding_window`` group only the blocks the window reaches back to, a ``state`` group one fixed-size snapshot
per kept boundary.

:meth:`KVGroups.plan` cuts a key block into *parts* and *units* exactly as :class:`aiokv.GroupedLayout` does:
the base part (the full groups, then the latent ones as a second base part when both are present: latent
groups are replicated across tensor-parallel ranks, full ones are not), one part per sliding-window group and
one per state group; a unit is the first base part's bytes (the largest part's without a base part) and every
part is padded to whole units. ``tests/replay/test_replay_groups.py`` checks the plan against a real
``GroupedLayout``. Which parts are stored and which hit a lookup finds are :class:`aiokv._grouprule.Retention`
and :func:`aiokv._grouprule.longest_hit` themselves (see ``_sim.py``).

Standard library only (the rules come from the torch-free :mod:`aiokv._grouprule`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import Any

from .._errors import InvalidArgumentError, InvalidTypeError
from .._units import parse_size
from ..rules import window_blocks

__all__ = [
    "GROUP_KINDS",
    "GROUP_PRESETS",
    "GroupPlan",
    "GroupPreset",
    "GroupSpec",
    "KVGroups",
    "PartPlan",
    "group_rows",
    "parse_kv_groups",
]

GROUP_KINDS = ("full", "sliding_window", "latent", "state")
"""The kinds of :class:`aiokv.GroupKind`, by value."""

_TOKEN_KINDS = ("full", "sliding_window", "latent")
_KEYS = ("layers", "bytes", "window", "name")
_MAX_LAYERS = 1 << 12
_MAX_BYTES = 1 << 40


def _window_blocks(window: int, block_tokens: int) -> int:
    """:func:`aiokv._grouprule.window_blocks` (torch-free, as this module)."""
    return window_blocks(window, block_tokens)


@dataclass(frozen=True, slots=True)
class GroupSpec:
    """One KV-cache group of a replayed model: ``layers`` layers of one ``kind`` (see :data:`GROUP_KINDS`).

    ``bytes``: what one layer keeps per token (``full``, ``sliding_window``: K and V of every KV head,
    ``kv_heads * head_dim * 2 * dtype_bytes``; ``latent``: the latent vector and its rope part) or per snapshot
    (``state``: the whole recurrent state of one layer). ``window``: the attention window in tokens, for a
    ``sliding_window`` group only. ``name`` appears in the report (default: the kind and the group's index).
    """

    kind: str
    layers: int
    bytes: int
    window: int | None = None
    name: str | None = None


def _check_int(value: object, what: str, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidTypeError(f"{what} must be an int, got {type(value).__name__}")
    if not lo <= value <= hi:
        raise InvalidArgumentError(f"{what} must be in [{lo}, {hi}], got {value}")
    return value


def _check_spec(i: int, g: object) -> GroupSpec:
    if not isinstance(g, GroupSpec):
        raise InvalidTypeError(f"groups[{i}] must be an aiokv.replay.GroupSpec, got {type(g).__name__}")
    if g.kind not in GROUP_KINDS:
        raise InvalidArgumentError(
            f"groups[{i}].kind must be one of {', '.join(map(repr, GROUP_KINDS))}, got {g.kind!r}"
        )
    _check_int(g.layers, f"groups[{i}].layers", 1, _MAX_LAYERS)
    _check_int(g.bytes, f"groups[{i}].bytes", 1, _MAX_BYTES)
    if g.kind == "sliding_window":
        if g.window is None:
            raise InvalidArgumentError(
                f"groups[{i}].window must be given for a sliding_window group (tokens)"
            )
        _check_int(g.window, f"groups[{i}].window", 1, 1 << 30)
    elif g.window is not None:
        raise InvalidArgumentError(
            f"groups[{i}].window must be None for a {g.kind} group (only sliding_window groups have one), "
            f"got {g.window!r}"
        )
    name = g.name if g.name is not None else f"{g.kind}{i}"
    if not isinstance(name, str) or not name or not name.replace("_", "").replace("-", "").isalnum():
        raise InvalidArgumentError(f"groups[{i}].name must be letters, digits, '_' or '-', got {g.name!r}")
    return replace(g, name=name)


@dataclass(frozen=True, slots=True)
class PartPlan:
    """One part of a key block (see the module docstring): ``cls`` is ``"base"``, ``"window"`` or
    ``"state"``; ``groups`` the indices of its groups; ``nbytes`` its bytes per key block; ``units`` the
    units it is cut into (padded); ``window_blocks`` the blocks before a boundary it is needed for (window
    parts)."""

    cls: str
    groups: tuple[int, ...]
    nbytes: int
    units: int
    first_unit: int
    window_blocks: int = 0


@dataclass(frozen=True, slots=True)
class GroupPlan:
    """A key block of ``block_tokens`` tokens, as the offloader stores it: parts, units, retention."""

    block_tokens: int
    groups: tuple[GroupSpec, ...]
    group_bytes: tuple[int, ...]  # bytes of one key block of each group (a snapshot for a state group)
    parts: tuple[PartPlan, ...]
    unit_bytes: int
    checkpoint_blocks: int

    @property
    def units(self) -> int:
        """Units of a key block with every part kept."""
        return sum(p.units for p in self.parts)

    @property
    def block_bytes(self) -> int:
        """Bytes of a key block with every part kept, unpadded."""
        return sum(p.nbytes for p in self.parts)

    @property
    def padding_bytes(self) -> int:
        """Padding of a key block with every part kept."""
        return self.units * self.unit_bytes - self.block_bytes

    @property
    def base_units(self) -> int:
        return sum(p.units for p in self.parts if p.cls == "base")

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes per token of every token group (state snapshots left out): the one-group figure."""
        return sum(b for g, b in zip(self.groups, self.group_bytes, strict=True) if g.kind != "state") // (
            self.block_tokens
        )

    def part_units(self, part: int) -> range:
        p = self.parts[part]
        return range(p.first_unit, p.first_unit + p.units)


@dataclass(frozen=True, slots=True)
class KVGroups:
    """The KV-cache groups of a replayed model (``groups``, in the order of the engine's groups) and the
    retention's ``checkpoint_blocks`` (a window or state part is kept for every multiple of it, the prompt's
    end and the request's end; ``None``: the offloader's default, ``max(4 * w, 16)`` for the widest window
    of ``w`` blocks). ``name`` is shown in the report (a preset's name, or the spec as written)."""

    groups: tuple[GroupSpec, ...]
    checkpoint_blocks: int | None = None
    name: str | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        groups = self.groups
        if isinstance(groups, GroupSpec) or not isinstance(groups, Iterable):
            raise InvalidTypeError(
                f"groups must be a sequence of aiokv.replay.GroupSpec, got {type(groups).__name__}"
            )
        checked = tuple(_check_spec(i, g) for i, g in enumerate(groups))
        if not checked:
            raise InvalidArgumentError("groups must contain at least one GroupSpec")
        names = [g.name for g in checked]
        for i, nm in enumerate(names):
            if names.index(nm) != i:
                raise InvalidArgumentError(f"groups[{i}].name must be unique, got {nm!r} twice")
        if self.checkpoint_blocks is not None:
            _check_int(self.checkpoint_blocks, "checkpoint_blocks", 1, 1 << 30)
        object.__setattr__(self, "groups", checked)

    @property
    def kinds(self) -> frozenset[str]:
        return frozenset(g.kind for g in self.groups)

    @property
    def has_retention(self) -> bool:
        """Some group keeps less than every block (a sliding-window or a state group)."""
        return bool(self.kinds & {"sliding_window", "state"})

    @property
    def layers(self) -> int:
        return sum(g.layers for g in self.groups)

    def as_full(self) -> KVGroups:
        """The same model with every sliding-window group counted as full attention (what a cache that
        ignores the window stores): the baseline the report compares with."""
        groups = tuple(
            replace(g, kind="full", window=None) if g.kind == "sliding_window" else g for g in self.groups
        )
        return KVGroups(groups, self.checkpoint_blocks, name=f"{self.name or 'groups'} as all-full")

    def describe(self) -> str:
        return ", ".join(
            f"{g.name}: {g.layers} {g.kind}" + (f"/{g.window}" if g.window else "") + f" x {g.bytes:,} B"
            for g in self.groups
        )

    def plan(self, block_tokens: int) -> GroupPlan:
        """Parts and units of a key block of ``block_tokens`` tokens (as :class:`aiokv.GroupedLayout`)."""
        _check_int(block_tokens, "block_tokens", 1, 1 << 30)
        gs = self.groups
        sizes = [g.layers * g.bytes * (1 if g.kind == "state" else block_tokens) for g in gs]
        raw: list[tuple[str, tuple[int, ...]]] = []
        sharded = tuple(i for i, g in enumerate(gs) if g.kind == "full")
        replicated = tuple(i for i, g in enumerate(gs) if g.kind == "latent")
        if sharded:
            raw.append(("base", sharded))
        if replicated:
            raw.append(("base", replicated))
        raw += [("window", (i,)) for i, g in enumerate(gs) if g.kind == "sliding_window"]
        raw += [("state", (i,)) for i, g in enumerate(gs) if g.kind == "state"]
        part_bytes = [sum(sizes[i] for i in members) for _cls, members in raw]
        unit = part_bytes[0] if raw[0][0] == "base" else max(part_bytes)
        parts: list[PartPlan] = []
        first = 0
        for (cls, members), nbytes in zip(raw, part_bytes, strict=True):
            units = -(-nbytes // unit)
            w = _window_blocks(gs[members[0]].window or 1, block_tokens) if cls == "window" else 0
            parts.append(PartPlan(cls, members, nbytes, units, first, w))
            first += units
        checkpoint = self.checkpoint_blocks
        if checkpoint is None:
            checkpoint = max(max((p.window_blocks for p in parts if p.cls == "window"), default=1) * 4, 16)
        return GroupPlan(block_tokens, gs, tuple(sizes), tuple(parts), unit, checkpoint)


@dataclass(frozen=True, slots=True)
class GroupPreset:
    """A model's KV-cache groups and a rough prefill speed (as :class:`ModelPreset`: 40% of one H100's dense
    bf16 peak per GPU over ``2 * active_params`` FLOPs per token). Approximations of the named families, to
    compare tiers and policies, not their exact configurations."""

    name: str
    groups: tuple[GroupSpec, ...]
    active_params: float
    gpus: int
    about: str

    def kv_groups(self, checkpoint_blocks: int | None = None) -> KVGroups:
        return KVGroups(self.groups, checkpoint_blocks, name=self.name)

    @property
    def prefill_tokens_per_s(self) -> float:
        from ._model import _GPU_FLOPS, _PREFILL_MFU

        return self.gpus * _GPU_FLOPS * _PREFILL_MFU / (2 * self.active_params)


def _kv(kv_heads: int, head_dim: int, dtype_bytes: int = 2) -> int:
    return kv_heads * head_dim * 2 * dtype_bytes


GROUP_PRESETS: dict[str, GroupPreset] = {
    p.name: p
    for p in (
        GroupPreset(
            "gemma3-like",
            (
                GroupSpec("full", 10, _kv(16, 128), name="global"),
                GroupSpec("sliding_window", 52, _kv(16, 128), window=1024, name="local"),
            ),
            27e9,
            1,
            "Gemma 3 27B: 62 layers, 5 local (1024-token window) per global, 16 KV heads of 128",
        ),
        GroupPreset(
            "gpt-oss-like",
            (
                GroupSpec("full", 18, _kv(8, 64), name="full"),
                GroupSpec("sliding_window", 18, _kv(8, 64), window=128, name="sliding"),
            ),
            5.1e9,
            1,
            "gpt-oss-120b: 36 layers alternating full and 128-token sliding window, 8 KV heads of 64",
        ),
        GroupPreset(
            "mla-like",
            (GroupSpec("latent", 61, (512 + 64) * 2, name="latent"),),
            37e9,
            8,
            "DeepSeek-V3: 61 MLA layers, a 512 + 64 latent per token, bf16",
        ),
        GroupPreset(
            "hybrid-state",
            (
                GroupSpec("full", 12, _kv(2, 256), name="attention"),
                GroupSpec("state", 36, 32 * 128 * 128 * 2, name="linear"),
            ),
            3e9,
            1,
            "Qwen3-Next-80B-A3B: 12 attention layers (2 KV heads of 256) and 36 linear-attention layers "
            "with a 1 MiB state each",
        ),
    )
}


def parse_kv_groups(
    text: str,
    *,
    default_bytes: int | None = None,
    checkpoint_blocks: int | None = None,
    what: str = "kv-groups",
) -> KVGroups:
    """``--kv-groups``: a preset name (:data:`GROUP_PRESETS`) or groups separated by commas, each
    ``KIND[:layers=N][:bytes=SIZE][:window=TOKENS][:name=NAME]`` (``layers`` defaults to 1; ``bytes``, per
    token and layer or per state snapshot and layer, defaults to ``default_bytes`` for full and sliding-window
    groups and is required for latent and state groups; ``window`` is required for sliding-window groups)."""
    if not isinstance(text, str):
        raise InvalidTypeError(f"{what} must be a string, got {type(text).__name__}")
    stripped = text.strip()
    if stripped in GROUP_PRESETS:
        return GROUP_PRESETS[stripped].kv_groups(checkpoint_blocks)
    form = "KIND:layers=N:bytes=SIZE[:window=TOKENS],... or a preset"
    if not stripped:
        raise InvalidArgumentError(f"{what} must look like {form} ({', '.join(GROUP_PRESETS)}), got {text!r}")
    specs: list[GroupSpec] = []
    for i, item in enumerate(stripped.split(",")):
        kind, *fields = [f.strip() for f in item.split(":")]
        where = f"{what} group {i + 1} ({item.strip()!r})"
        if kind not in GROUP_KINDS:
            hint = f" or a preset ({', '.join(GROUP_PRESETS)})" if i == 0 and not fields else ""
            raise InvalidArgumentError(
                f"{where}: kind must be one of {', '.join(GROUP_KINDS)}{hint}, got {kind!r}"
            )
        values: dict[str, str] = {}
        for f in fields:
            key, sep, value = f.partition("=")
            key, value = key.strip(), value.strip()
            if not sep or not value:
                raise InvalidArgumentError(f"{where}: options must look like key=value, got {f!r}")
            if key not in _KEYS:
                raise InvalidArgumentError(f"{where}: option must be one of {', '.join(_KEYS)}, got {key!r}")
            if key in values:
                raise InvalidArgumentError(f"{where}: {key} must be given once")
            values[key] = value
        layers = _parse_int(values.get("layers", "1"), f"{where}: layers", 1, _MAX_LAYERS)
        if "bytes" in values:
            nbytes = parse_size(values["bytes"], what=f"{where}: bytes")
            if nbytes is None:
                raise InvalidArgumentError(f"{where}: bytes must be finite, got {values['bytes']!r}")
        elif kind in ("full", "sliding_window") and default_bytes is not None:
            nbytes = default_bytes
        else:
            per = "per state snapshot and layer" if kind == "state" else "per token and layer"
            raise InvalidArgumentError(f"{where}: bytes must be given for a {kind} group ({per})")
        window: int | None = None
        if kind == "sliding_window":
            if "window" not in values:
                raise InvalidArgumentError(
                    f"{where}: window must be given for a sliding_window group (tokens)"
                )
            window = _parse_int(values["window"], f"{where}: window", 1, 1 << 30)
        elif "window" in values:
            raise InvalidArgumentError(f"{where}: window is only for sliding_window groups")
        if nbytes > _MAX_BYTES:
            raise InvalidArgumentError(f"{where}: bytes must be at most 1TiB, got {values['bytes']!r}")
        specs.append(GroupSpec(kind, layers, nbytes, window, values.get("name")))
    try:
        return KVGroups(tuple(specs), checkpoint_blocks, name=stripped)
    except InvalidArgumentError as exc:  # a duplicate or malformed name
        raise InvalidArgumentError(f"{what}: {exc}") from None


def _parse_int(text: str, what: str, lo: int, hi: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise InvalidArgumentError(f"{what} must be an int, got {text!r}") from None
    if not lo <= value <= hi:
        raise InvalidArgumentError(f"{what} must be in [{lo}, {hi}], got {value}")
    return value


def group_rows(plan: GroupPlan) -> list[dict[str, Any]]:
    """One row per group for the report: its kind, layers, window, bytes per key block, and the part it is
    stored in (units, padding, and which blocks are kept)."""
    rows: list[dict[str, Any]] = []
    for p_index, part in enumerate(plan.parts):
        for gi in part.groups:
            g = plan.groups[gi]
            rows.append(
                {
                    "name": g.name,
                    "kind": g.kind,
                    "layers": g.layers,
                    "window": g.window,
                    "bytes_per_layer": g.bytes,
                    "block_bytes": plan.group_bytes[gi],
                    "part": p_index,
                    "part_units": part.units,
                    "part_padding_bytes": part.units * plan.unit_bytes - part.nbytes,
                    "window_blocks": part.window_blocks if part.cls == "window" else None,
                }
            )
    return rows
