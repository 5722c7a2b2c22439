"""The ``aiokv`` command line. Subcommands register themselves in :data:`_SUBCOMMANDS`: ``replay`` and
``serve``.

    aiokv replay TRACE [--tiers cpu=64GiB,disk=1TiB] [--policy lru,arc,chain-lru] [--sweep cpu=auto] ...
    aiokv serve [--port 8000] [--model tiny] [--tiers cpu=1GiB,disk=/var/cache/aiokv:20GiB] [--no-offload] ...

See docs/replay.md and docs/serving.md. Every option and the whole trace are validated before the first replay: a bad input stops
the command with one ``aiokv replay: error: ...`` line on stderr and exit status 2, never a traceback.

Only the standard library, ``aiokv._errors`` and ``aiokv._units`` are imported at module level; ``--help`` adds the replay
modules (for the model presets) and the serve options (standard library only); rich, matplotlib, torch and
the web stack are imported by the run that uses them.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NoReturn

from ._errors import AiokvError, InvalidArgumentError, MissingDependencyError
from ._units import parse_assignments as _parse_assignments
from ._version import __version__

if TYPE_CHECKING:
    from .replay import CostModel, KVGroups, ModelPreset, ReplayResult, TierConfig, Trace

__all__ = ["main"]

_MAX_BLOCK_TOKENS = 1 << 20
_MAX_KV_BYTES_PER_TOKEN = 1 << 30
_TIER_NAME = re.compile(r"[A-Za-z0-9_.-]+")  # printed in rich tables, where brackets are markup


class _Parser(argparse.ArgumentParser):
    """An argument parser whose usage errors are one line: ``PROG: error: MESSAGE``, exit status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {_one_line(message)}\n")


class _VersionAction(argparse.Action):
    """``--version``: the package's version."""

    def __init__(self, option_strings: Sequence[str], dest: str = argparse.SUPPRESS, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> None:
        print(f"aiokv {__version__}")
        parser.exit()


def _one_line(text: str) -> str:
    return " ".join(text.split("\n"))


# ------------------------------------------------------------------------------------------------- replay
_SYNTHETIC_OPTIONS: dict[str, dict[str, type]] = {
    "chat": {
        "sessions": int,
        "turns": int,
        "system_prompts": int,
        "system_blocks": int,
        "seed": int,
        "sessions_per_s": float,
        "think_s": float,
    },
    "agentic": {
        "sessions": int,
        "turns": int,
        "system_prompts": int,
        "system_blocks": int,
        "context_blocks": int,
        "seed": int,
        "sessions_per_s": float,
        "think_s": float,
    },
    "retrieval": {
        "questions": int,
        "docs": int,
        "system_blocks": int,
        "seed": int,
        "questions_per_s": float,
        "follow_up": float,
    },
    "mix": {"then": str, "sessions": int, "seed": int},
}
"""Per shape, the options ``synthetic:`` takes and their types (the range options stay API-only); kept here,
not read from the generators, so the command line imports no replay module to parse its arguments."""
_SYNTHETIC_SHAPES = sorted(_SYNTHETIC_OPTIONS)


def _synthetic_kwargs(spec: str) -> dict[str, Any]:
    """``synthetic:shape=agentic,sessions=20,seed=3`` -> keyword arguments of :func:`synthetic_trace` (which
    validates their values). ``shape`` may come anywhere in the list and defaults to chat; each shape has
    its own options, and an unknown one is refused with that shape's list."""
    _, _, rest = spec.partition(":")
    if not rest:
        return {}
    pairs = dict(_parse_assignments(rest, "synthetic trace options"))
    shape = pairs.pop("shape", "chat")
    if shape not in _SYNTHETIC_OPTIONS:
        raise InvalidArgumentError(f"shape must be one of {_SYNTHETIC_SHAPES}, got {shape!r}")
    types = _SYNTHETIC_OPTIONS[shape]
    names = sorted(types)
    kwargs: dict[str, Any] = {} if shape == "chat" else {"shape": shape}
    for name, value in pairs.items():
        if name not in types:
            which = "" if shape == "chat" else f" for shape {shape}"
            raise InvalidArgumentError(f"synthetic trace option{which} must be one of {names}, got {name!r}")
        kind = types[name]
        try:
            kwargs[name] = kind(value)
        except ValueError:
            what = "an int" if kind is int else "a number"
            raise InvalidArgumentError(
                f"synthetic trace option {name} must be {what}, got {value!r}"
            ) from None
    return kwargs


def _add_replay(sub: Any) -> None:
    from .replay._groups import GROUP_PRESETS
    from .replay._model import COST_PRESETS

    p = sub.add_parser(
        "replay",
        help="replay a request trace through the tier index to plan capacities",
        description=(
            "Replay a request trace through aiokv's block index and eviction policies (one index per tier, "
            "transfers replaced by a bandwidth model) and report hit ratios, bytes moved and an estimated "
            "TTFT saving. TRACE is a JSONL file (rows with hash_ids, token_ids or prompt; at most 1 MiB per "
            "line and 65,536 hash_ids per row) or 'synthetic[:shape=SHAPE,option=value,...]': SHAPE is chat (the "
            "default), agentic (meant for --block-tokens 64), retrieval or mix, each with its own options "
            "(docs/replay.md; an unknown option's error lists the shape's)."
        ),
        epilog=(
            "Options and the whole trace are checked before replaying: a bad value or a bad trace line "
            "stops the command with one error line (file:line for the trace) and exit status 2."
        ),
    )
    p.add_argument("trace", metavar="TRACE")
    p.add_argument(
        "--tiers",
        action="append",
        default=None,
        metavar="NAME=SIZE[:encoding=ENC],...",
        help="tiers fastest first, NAME=SIZE,... (default: cpu=64GiB); a disk or redis tier may end in "
        ":encoding=raw|fp8|int8 to be sized as the real tier in that encoding (disk=PATH:SIZE is accepted, the "
        "path ignored); give --tiers more than once to compare configurations, e.g. encodings, in one run",
    )
    p.add_argument("--policy", default="lru", help="eviction policy, or a comma-separated list to compare")
    p.add_argument(
        "--block-tokens",
        type=int,
        default=512,
        help=f"tokens per block, 1 to {_MAX_BLOCK_TOKENS} (default: %(default)s)",
    )
    p.add_argument(
        "--model",
        choices=sorted(COST_PRESETS),
        default=None,
        help="model preset for KV bytes per token and prefill speed (default: llama3-8b)",
    )
    p.add_argument(
        "--kv-bytes-per-token", type=int, default=None, help="override the model's KV bytes per token"
    )
    p.add_argument(
        "--prefill-tokens-per-s", type=float, default=None, help="override the model's prefill speed"
    )
    p.add_argument(
        "--kv-groups",
        default=None,
        metavar="PRESET|KIND:layers=N:bytes=SIZE[:window=TOKENS],...",
        help="the model's KV-cache groups, stored as the offloader stores a grouped layout: a preset ("
        + ", ".join(GROUP_PRESETS)
        + ") or groups of kind full, sliding_window, latent or state with bytes per token and layer (per "
        "snapshot and layer for state; default for full and sliding_window: --model's)",
    )
    p.add_argument(
        "--checkpoint-blocks",
        type=int,
        default=None,
        help="with --kv-groups: keep sliding-window and state parts every N blocks (default: the "
        "offloader's, max(4 * window blocks, 16))",
    )
    p.add_argument(
        "--target-hit-rate",
        default=None,
        metavar="RATIO|PCT%",
        help="also find the smallest capacity of the swept tier (the first by default) reaching this token "
        "hit ratio, e.g. 0.3 or 30%%",
    )
    p.add_argument(
        "--bandwidth",
        default=None,
        help="tier read bandwidths, NAME=25GB/s or NAME=10Gbit/s,... (defaults by name)",
    )
    p.add_argument(
        "--load-policy",
        choices=("decide", "always"),
        default="decide",
        help="decide (default, as the Offloader): a tier whose load is slower than recomputing its hits is "
        "not loaded from (its hits and those of slower tiers are recomputed); always: load every hit",
    )
    p.add_argument(
        "--inflight",
        type=int,
        default=0,
        help="concurrent prefills: a request's blocks are stored after N later lookups (default: 0)",
    )
    p.add_argument(
        "--sweep",
        default=None,
        metavar="TIER=SIZE,SIZE...|TIER=auto",
        help="replay once per capacity of one tier (auto: 1/256 of the trace's footprint up to all of it)",
    )
    p.add_argument("--limit", type=int, default=None, help="replay only the first N requests")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    p.add_argument(
        "--plot",
        default=None,
        metavar="FILE",
        help="save hit ratio vs capacity per policy (matplotlib; .png, .svg, .pdf, ...)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    _add_log_arguments(p)
    p.set_defaults(func=_run_replay)


@dataclass(frozen=True, slots=True)
class _ReplayPlan:
    """What ``aiokv replay`` runs, derived from validated options before the trace is read."""

    policies: list[str]
    tier_sets: list[list[TierConfig]]  # one per --tiers, each replayed (and swept) in turn
    sweep_tier: str
    sweep_sizes: list[int | None] | None  # None: auto, from the trace's footprint
    kv_bytes_per_token: int
    model_name: str
    model_desc: str
    cost: CostModel
    have_rich: bool
    groups: KVGroups | None = None
    target: float | None = None
    model: ModelPreset | None = None  # the KV shape, when known (--model without --kv-bytes-per-token)

    @property
    def tiers(self) -> list[TierConfig]:
        """Every tier of the tier sets, once by name (the first set's first)."""
        seen: dict[str, TierConfig] = {}
        for tiers in self.tier_sets:
            for t in tiers:
                seen.setdefault(t.name, t)
        return list(seen.values())


def _check_numbers(args: argparse.Namespace) -> None:
    """Range checks of the numeric options (each bound keeps every derived figure a finite float)."""
    if not 1 <= args.block_tokens <= _MAX_BLOCK_TOKENS:
        raise InvalidArgumentError(
            f"block-tokens must be in [1, {_MAX_BLOCK_TOKENS}], got {args.block_tokens}"
        )
    kv = args.kv_bytes_per_token
    if kv is not None and not 1 <= kv <= _MAX_KV_BYTES_PER_TOKEN:
        raise InvalidArgumentError(f"kv-bytes-per-token must be in [1, {_MAX_KV_BYTES_PER_TOKEN}], got {kv}")
    speed = args.prefill_tokens_per_s
    if speed is not None and not (math.isfinite(speed) and speed > 0):
        raise InvalidArgumentError(
            f"prefill-tokens-per-s must be > 0 and finite, got {repr(speed).removesuffix('.0')}"
        )
    if args.inflight < 0:
        raise InvalidArgumentError(f"inflight must be >= 0, got {args.inflight}")
    if args.limit is not None and args.limit < 1:
        raise InvalidArgumentError(f"limit must be >= 1, got {args.limit}")
    if args.checkpoint_blocks is not None:
        if args.kv_groups is None:
            raise InvalidArgumentError("checkpoint-blocks needs --kv-groups (it sets their retention)")
        if not 1 <= args.checkpoint_blocks <= 1 << 30:
            raise InvalidArgumentError(
                f"checkpoint-blocks must be in [1, {1 << 30}], got {args.checkpoint_blocks}"
            )
    if args.kv_groups is not None and kv is not None:
        raise InvalidArgumentError(
            "kv-bytes-per-token must not be given with --kv-groups (the groups give the bytes per token)"
        )


def _parse_target(text: str) -> float:
    """``--target-hit-rate``: ``0.3`` or ``30%`` -> 0.3, in (0, 1]."""
    raw = text.strip()
    try:
        value = float(raw[:-1]) / 100 if raw.endswith("%") else float(raw)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and 0 < value <= 1):
        raise InvalidArgumentError(
            f"target-hit-rate must be a ratio in (0, 1] or a percentage in (0%, 100%], got {text!r}"
        )
    return value


def _parse_policies(text: str) -> list[str]:
    from .tiers import policy_names

    policies = [p.strip() for p in text.split(",") if p.strip()]
    if not policies:
        raise InvalidArgumentError(f"policy must name at least one policy, got {text!r}")
    for name in policies:
        if name not in policy_names():
            raise InvalidArgumentError(f"policy must be one of {policy_names()}, got {name!r}")
        if policies.count(name) > 1:
            raise InvalidArgumentError(f"policy must name {name!r} only once, got {text!r}")
    return policies


_ENCODING_SUFFIX = re.compile(r"^(?P<rest>.*):encoding=(?P<encoding>[^:]*)$")  # as aiokv.tiers._settings


def _parse_tier(name: str, value: str, bandwidth: float | None) -> TierConfig:
    """One ``--tiers`` entry: ``NAME=SIZE``, ``NAME=SIZE:encoding=ENC`` or, for disk, ``disk=PATH:SIZE[...]``
    (the form ``aiokv serve`` takes; the replay reads and writes no file, so the path is not used)."""
    from .replay import TierConfig, parse_size

    if not _TIER_NAME.fullmatch(name):
        raise InvalidArgumentError(f"tier name must be letters, digits, '_', '-' or '.', got {name!r}")
    encoding = None
    suffix = _ENCODING_SUFFIX.match(value)
    if suffix is not None:
        value, encoding = suffix["rest"], suffix["encoding"]
    if name == "disk" and ":" in value:
        path, _, size = value.rpartition(":")
        if not path:
            raise InvalidArgumentError(f"disk tier must look like disk=SIZE or disk=PATH:SIZE, got {value!r}")
        value = size
    return TierConfig(
        name, parse_size(value, what=f"capacity of tier {name!r}"), bandwidth, encoding=encoding
    )


def _parse_tiers(tiers_texts: Sequence[str], bandwidth_text: str | None) -> list[list[TierConfig]]:
    """Every ``--tiers`` (each a tier set, replayed in turn) with the ``--bandwidth`` of its tiers."""
    from .replay import parse_bandwidth

    bandwidths: dict[str, float] = {}
    if bandwidth_text is not None:
        for name, value in _parse_assignments(bandwidth_text, "bandwidth"):
            bandwidths[name] = parse_bandwidth(value, what=f"bandwidth of tier {name!r}")
    tier_sets: list[list[TierConfig]] = []
    for text in tiers_texts:
        tiers = [_parse_tier(n, v, bandwidths.get(n)) for n, v in _parse_assignments(text, "tiers")]
        if tiers in tier_sets:
            raise InvalidArgumentError(f"tiers must differ when given more than once, got {text!r} twice")
        tier_sets.append(tiers)
    unknown = set(bandwidths) - {t.name for tiers in tier_sets for t in tiers}
    if unknown:
        raise InvalidArgumentError(f"bandwidth names tiers that are not in --tiers: {sorted(unknown)}")
    for tiers in tier_sets:
        for t in tiers:
            t.resolved_bandwidth()
    return tier_sets


def _check_encodings(args: argparse.Namespace, tier_sets: Sequence[Sequence[TierConfig]]) -> None:
    """Refuse, in the command line's terms, an encoding the replay cannot size: with --kv-groups (the tiers
    store units raw) or with --kv-bytes-per-token (no KV shape)."""
    from .replay import COST_PRESETS

    for t in (t for tiers in tier_sets for t in tiers):
        if t.encoding in (None, "raw"):
            continue
        if args.kv_groups is not None:
            raise InvalidArgumentError(
                f"encoding of tier {t.name!r} must be raw with --kv-groups, got {t.encoding!r}: the real tiers "
                "store a grouped layout's units raw (make_codec refuses encodings for KVLayout.from_groups "
                "layouts)"
            )
        if args.kv_bytes_per_token is not None:
            raise InvalidArgumentError(
                f"encoding of tier {t.name!r} must be raw with --kv-bytes-per-token, got {t.encoding!r}: an "
                "encoded block's size depends on the model's layers, KV heads, head dim and dtype, which "
                f"--kv-bytes-per-token does not give; use --model ({', '.join(sorted(COST_PRESETS))}) instead"
            )


def _parse_sweep(text: str, tiers: Sequence[TierConfig]) -> tuple[str, list[int | None] | None]:
    """``TIER=SIZE,SIZE...`` or ``TIER=auto`` (``TIER=`` may be left out for the first tier) -> the tier and
    its capacities, ``None`` for auto."""
    from .replay import parse_size

    names = [t.name for t in tiers]
    if "=" in text:
        tier, _, values = text.partition("=")
        tier = tier.strip()
    else:
        tier, values = names[0], text
    items = [v.strip() for v in values.split(",")]
    if not tier or not all(items):
        raise InvalidArgumentError(f"sweep must look like TIER=SIZE,SIZE... or TIER=auto, got {text!r}")
    if tier not in names:
        raise InvalidArgumentError(f"sweep tier must be one of the tiers {names}, got {tier!r}")
    if items == ["auto"]:
        return tier, None
    if "auto" in items:
        raise InvalidArgumentError(f"sweep must be TIER=auto alone or TIER=SIZE,SIZE..., got {text!r}")
    sizes: list[int | None] = []
    for item in items:
        size = parse_size(item, what=f"sweep capacity of tier {tier!r}")
        if size in sizes:
            raise InvalidArgumentError(f"sweep must list each capacity once, got {item!r} again in {text!r}")
        sizes.append(size)
    return tier, sizes


def _check_output(args: argparse.Namespace) -> bool:
    """Check the output dependencies and the plot path; returns whether rich is installed."""
    from .replay._report import check_plot_path, require_matplotlib

    try:
        import rich  # noqa: F401

        have_rich = True
    except ImportError:
        have_rich = False
    if not have_rich and not args.json:
        raise MissingDependencyError(
            "aiokv replay needs rich for its tables; pip install 'aiokv[cli]' or pass --json"
        )
    if args.plot is not None:
        require_matplotlib()
        check_plot_path(args.plot)
    return have_rich


def _plan_replay(args: argparse.Namespace) -> _ReplayPlan:
    """Validate every option (nothing is read or replayed yet)."""
    from dataclasses import replace

    from .replay import COST_PRESETS, CostModel
    from .replay._sim import check_capacity

    have_rich = _check_output(args)
    _check_numbers(args)
    policies = _parse_policies(args.policy)
    model_name = args.model or "llama3-8b"
    model = COST_PRESETS[model_name]
    kv = args.kv_bytes_per_token if args.kv_bytes_per_token is not None else model.kv_bytes_per_token
    speed = args.prefill_tokens_per_s if args.prefill_tokens_per_s is not None else model.prefill_tokens_per_s
    groups = None
    if args.kv_groups is not None:
        from .replay import GROUP_PRESETS, parse_kv_groups

        groups = parse_kv_groups(
            args.kv_groups, default_bytes=kv // model.layers, checkpoint_blocks=args.checkpoint_blocks
        )
        preset = GROUP_PRESETS.get(args.kv_groups.strip())
        if preset is not None and args.model is None and args.prefill_tokens_per_s is None:
            speed = preset.prefill_tokens_per_s
        kv = groups.plan(args.block_tokens).kv_bytes_per_token
    target = None if args.target_hit_rate is None else _parse_target(args.target_hit_rate)
    tier_sets = _parse_tiers(args.tiers or ["cpu=64GiB"], args.bandwidth)
    _check_encodings(args, tier_sets)
    # The KV shape sizes encoded blocks: the preset's, unless --kv-bytes-per-token or --kv-groups replace it.
    shape = model if args.kv_bytes_per_token is None and groups is None else None
    sweep_tier, sweep_sizes = tier_sets[0][0].name, None
    for tiers in tier_sets:
        if tiers[0].name != tier_sets[0][0].name:
            raise InvalidArgumentError(
                "tiers must start with the same tier when given more than once, got "
                f"{tier_sets[0][0].name!r} and {tiers[0].name!r}"
            )
        if args.sweep is not None:  # the same tier in every set (the first, or one each of them names)
            sweep_tier, sweep_sizes = _parse_sweep(args.sweep, tiers)
        fixed = [t for t in tiers if args.sweep is None or t.name != sweep_tier]
        swept = [
            replace(t, capacity_bytes=size)
            for t in tiers
            if t.name == sweep_tier
            for size in sweep_sizes or ()
        ]
        for t in fixed + swept:
            check_capacity(
                t, block_tokens=args.block_tokens, kv_bytes_per_token=kv, groups=groups, model=shape
            )
    if groups is not None:
        model_desc = f"groups {groups.name}"
    elif args.kv_bytes_per_token is None:
        model_desc = model_name + (" (default)" if args.model is None else "")
    else:
        model_desc = f"{kv} KV bytes/token"
    return _ReplayPlan(
        policies=policies,
        tier_sets=tier_sets,
        sweep_tier=sweep_tier,
        sweep_sizes=sweep_sizes,
        kv_bytes_per_token=kv,
        model_name=model_name,
        model_desc=model_desc,
        cost=CostModel(speed, load_policy=args.load_policy),
        have_rich=have_rich,
        groups=groups,
        target=target,
        model=shape,
    )


def _load_trace(args: argparse.Namespace) -> Trace:
    """Read (or generate) the trace; refuse one without a single block to replay."""
    from .replay import Trace, load_trace, synthetic_trace

    if args.trace == "synthetic" or args.trace.startswith("synthetic:"):
        trace = synthetic_trace(block_tokens=args.block_tokens, **_synthetic_kwargs(args.trace))
        if args.limit is not None:
            trace = Trace.from_requests(trace.name, trace.block_tokens, trace.requests[: args.limit])
        shown = trace.name
    else:
        trace = load_trace(args.trace, block_tokens=args.block_tokens, limit=args.limit)
        shown = args.trace if args.trace.isprintable() else repr(args.trace)
    if trace.block_refs == 0:
        raise InvalidArgumentError(
            f"trace {shown} holds no full block of {trace.block_tokens} tokens (see --block-tokens)"
        )
    return trace


def _execute(args: argparse.Namespace, plan: _ReplayPlan, trace: Trace) -> list[ReplayResult]:
    """One replay per (tier set, policy, capacity), under a progress bar on stderr unless ``--no-progress``."""
    from .replay import auto_capacities, sweep
    from .replay._encoding import tier_sizing

    block_bytes = trace.block_tokens * plan.kv_bytes_per_token
    if plan.groups is not None:
        gp = plan.groups.plan(trace.block_tokens)
        block_bytes = gp.units * gp.unit_bytes

    # --sweep TIER=auto: the same capacities for every tier set (in engine bytes: comparable), each holding at
    # least one block in every set's encoding of the tier (an entry: header, padding).
    at_least = 0
    for tiers in plan.tier_sets if plan.sweep_sizes is None else ():
        t = next(t for t in tiers if t.name == plan.sweep_tier)
        slot = block_bytes if plan.groups is None else gp.unit_bytes
        sizing = tier_sizing(
            t.name,
            t.encoding,
            slot,
            block_tokens=trace.block_tokens,
            model=plan.model,
            grouped=plan.groups is not None,
        )
        at_least = max(at_least, sizing.entry_bytes * (1 if plan.groups is None else gp.units))
    auto = list(auto_capacities(trace, block_bytes, at_least=at_least))

    def capacities(tiers: Sequence[TierConfig]) -> list[int | None]:
        if args.sweep is None:
            return [next(t.capacity_bytes for t in tiers if t.name == plan.sweep_tier)]
        return list(auto) if plan.sweep_sizes is None else plan.sweep_sizes

    def run(progress: Callable[[int], None] | None) -> list[ReplayResult]:
        results: list[ReplayResult] = []
        for tiers in plan.tier_sets:
            results += sweep(
                trace,
                tiers,
                policies=plan.policies,
                sweep_tier=plan.sweep_tier,
                capacities=capacities(tiers),
                kv_bytes_per_token=plan.kv_bytes_per_token if plan.groups is None else None,
                groups=plan.groups,
                model=plan.model,
                cost=plan.cost,
                inflight=args.inflight,
                progress=progress,
            )
        return results

    if not plan.have_rich or args.no_progress:
        return run(None)
    from rich.console import Console
    from rich.markup import escape
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    runs = len(plan.policies) * sum(len(capacities(tiers)) for tiers in plan.tier_sets)
    with Progress(
        TextColumn("replaying {task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("block refs"),
        TimeRemainingColumn(),
        console=Console(stderr=True),
        transient=True,
    ) as bar:
        task = bar.add_task(escape(trace.name), total=trace.block_refs * runs)
        return run(lambda n: bar.advance(task, n))


@dataclass(frozen=True, slots=True)
class _Extras:
    """What ``--kv-groups`` and ``--target-hit-rate`` add: each run again with the model counted as all-full
    (when it has sliding-window groups), and the capacity reaching the target per policy."""

    as_full: list[ReplayResult | None]
    targets: list[dict[str, Any]]


def _extras(
    args: argparse.Namespace, plan: _ReplayPlan, trace: Trace, results: list[ReplayResult]
) -> _Extras:
    from ._errors import CapacityError
    from .replay import TierConfig, capacity_for_hit_ratio, replay

    full = (
        plan.groups.as_full() if plan.groups is not None and "sliding_window" in plan.groups.kinds else None
    )
    as_full: list[ReplayResult | None] = []
    if full is not None:
        for r in results:
            try:
                as_full.append(
                    replay(
                        trace,
                        [
                            TierConfig(t.name, t.capacity_bytes, t.bandwidth, t.policy, encoding=t.encoding)
                            for t in r.tiers
                        ],
                        policy=r.tiers[0].policy,
                        groups=full,
                        cost=plan.cost,
                        inflight=args.inflight,
                    )
                )
            except CapacityError:  # a swept capacity below one all-full key block
                as_full.append(None)
    targets: list[dict[str, Any]] = []
    if plan.target is not None:
        kv = plan.kv_bytes_per_token if plan.groups is None else None
        for text, tiers in zip(args.tiers or ["cpu=64GiB"], plan.tier_sets, strict=True):
            for pol in plan.policies:
                entry: dict[str, Any] = {"policy": pol, "tier": plan.sweep_tier, "target": plan.target}
                if len(plan.tier_sets) > 1:
                    entry["tiers"] = text
                for key, groups in (("groups", plan.groups), ("as_full", full)):
                    if key == "as_full" and groups is None:
                        continue
                    cap, r = capacity_for_hit_ratio(
                        trace,
                        tiers,
                        plan.target,
                        tier=plan.sweep_tier,
                        policy=pol,
                        kv_bytes_per_token=kv if key == "groups" else None,
                        groups=groups,
                        model=plan.model if key == "groups" else None,
                        cost=plan.cost,
                        inflight=args.inflight,
                    )
                    found = {
                        "capacity_bytes": cap,
                        "token_hit_ratio": r.token_hit_ratio,
                        "stored_bytes": r.stored_bytes,
                    }
                    if key == "groups":
                        entry.update(found)
                    else:
                        entry["as_full"] = found
                targets.append(entry)
    return _Extras(as_full, targets)


def _report(
    args: argparse.Namespace,
    plan: _ReplayPlan,
    trace: Trace,
    results: list[ReplayResult],
    extras: _Extras | None = None,
) -> int:
    from .replay import TTFT_FORMULA, format_size, max_prefix_reuse
    from .replay._report import (
        encodings_table,
        groups_table,
        results_json,
        results_table,
        save_plot,
        tier_table,
    )

    kv = plan.kv_bytes_per_token
    block_bytes = trace.block_tokens * kv
    reuse = max_prefix_reuse(trace.requests)
    reuse_ratio = reuse / trace.block_refs
    if args.json:
        meta = {
            "trace": {
                "name": trace.name,
                "requests": len(trace),
                "block_refs": trace.block_refs,
                "unique_blocks": trace.unique_blocks,
                "input_tokens": trace.input_tokens,
                "block_tokens": trace.block_tokens,
                "max_prefix_reuse_blocks": reuse,
                "max_prefix_reuse_ratio": reuse_ratio,
            },
            "model": plan.model_name if args.kv_bytes_per_token is None else None,
            "kv_bytes_per_token": kv,
            "block_bytes": block_bytes,
            "prefill_tokens_per_s": plan.cost.prefill_tokens_per_s,
            "load_policy": plan.cost.load_policy,
            "inflight": args.inflight,
            "sweep_tier": plan.sweep_tier,
            "tiers": list(
                args.tiers or ["cpu=64GiB"]
            ),  # each --tiers as given: its runs follow in that order
            "ttft_formula": TTFT_FORMULA,
        }
        if plan.groups is not None:
            meta["kv_groups"] = plan.groups.name
        if extras is not None and extras.as_full:
            meta["as_full_runs"] = [None if r is None else r.to_dict() for r in extras.as_full]
        if extras is not None and plan.target is not None:
            meta["targets"] = extras.targets
        sys.stdout.write(results_json(results, **meta) + "\n")
    else:
        from rich.console import Console
        from rich.markup import escape

        console = Console(width=None if sys.stdout.isatty() else 160)
        console.print(
            f"[bold]{escape(trace.name)}[/]: {len(trace):,} requests, {trace.block_refs:,} block refs, "
            f"{trace.unique_blocks:,} unique blocks ({format_size(trace.unique_blocks * block_bytes)}), "
            f"max prefix reuse {100 * reuse_ratio:.1f}%"
        )
        console.print(
            f"model {plan.model_desc}: {kv:,} KV bytes/token, {trace.block_tokens}-token blocks of "
            f"{format_size(block_bytes)}, prefill {plan.cost.prefill_tokens_per_s:,.0f} tokens/s; "
            f"bandwidths "
            + ", ".join(f"{t.name}={t.resolved_bandwidth() / 1e9:g} GB/s" for t in plan.tiers)
            + f"; load policy {plan.cost.load_policy}"
            + (f"; {args.inflight} in flight" if args.inflight else "")
        )
        skipped = {t.name for r in results for t in r.tiers if t.skipped_blocks}
        if skipped:
            console.print(
                f"[dim]load policy decide: hits in {', '.join(sorted(skipped))} are recomputed (loading them is "
                "slower than recomputing; --load-policy always loads them)[/]"
            )
        if plan.groups is not None:
            console.print(
                groups_table(
                    plan.groups.plan(trace.block_tokens),
                    title=f"KV-cache groups: {escape(plan.groups.name or '')}",
                )
            )
        console.print(results_table(results))
        if len(results) == 1:
            console.print(tier_table(results[0]))
        else:
            encoded = encodings_table(results)
            if encoded is not None:
                console.print(encoded)
        if extras is not None:
            _print_extras(console, plan, results, extras)
        refs_per_s = sum(r.block_refs for r in results) / max(sum(r.elapsed_s for r in results), 1e-9)
        console.print(f"[dim]{len(results)} run(s), {refs_per_s:,.0f} block refs/s through the index[/]")
    if args.plot is not None:
        title = f"{trace.name}, {plan.model_desc.removesuffix(' (default)')}" + (
            f", {args.inflight} in flight" if args.inflight else ""
        )
        try:
            save_plot(results, args.plot, sweep_tier=plan.sweep_tier, max_reuse=reuse_ratio, title=title)
        except OSError as exc:  # checked up front; the disk filled or the directory went away since
            reason = (exc.strerror or str(exc)).lower()
            print(f"aiokv replay: error: cannot write plot {args.plot!r} ({reason})", file=sys.stderr)
            return 1
        if not args.json:
            print(f"plot written to {args.plot}", file=sys.stderr)
    return 0


def _print_extras(console: Any, plan: _ReplayPlan, results: list[ReplayResult], extras: _Extras) -> None:
    from .replay import format_size

    def pct(x: float) -> str:
        return f"{100 * x:.1f}%"

    for r, f in zip(results, extras.as_full, strict=False):
        caps = ", ".join(f"{t.name}={format_size(t.capacity_bytes)}" for t in r.tiers)
        line = (
            f"{r.policy} ({caps}): stored {format_size(r.stored_bytes)}, retention saved "
            f"{format_size(r.retention_saved_bytes)}, token hits {pct(r.token_hit_ratio)}"
        )
        if f is not None:
            ratio = f"{f.stored_bytes / r.stored_bytes:.1f}x" if r.stored_bytes else "-"
            line += f"; as all-full: stored {format_size(f.stored_bytes)} ({ratio}), token hits {pct(f.token_hit_ratio)}"
        console.print(line)
    if plan.groups is not None and not extras.as_full:
        for r in results:
            console.print(
                f"{r.policy}: stored {format_size(r.stored_bytes)}, retention saved {format_size(r.retention_saved_bytes)}"
            )
    for t in extras.targets:
        which = t["policy"] + (f", --tiers {t['tiers']}" if "tiers" in t else "")
        head = f"capacity of {t['tier']} for {pct(t['target'])} token hits ({which}): "
        cap = t["capacity_bytes"]
        line = head + (
            format_size(cap)
            if cap is not None
            else f"not reached (at most {pct(t['token_hit_ratio'])} with unlimited capacity)"
        )
        full = t.get("as_full")
        if full is not None:
            cap = full["capacity_bytes"]
            line += "; as all-full: " + (
                format_size(cap)
                if cap is not None
                else f"not reached (at most {pct(full['token_hit_ratio'])})"
            )
        console.print(line)


def _run_replay(args: argparse.Namespace) -> int:
    import time

    from ._log import configured, get_logger

    level, fmt = _log_settings(args)
    with configured(level, fmt):
        log = get_logger("replay")
        plan = _plan_replay(args)
        started = time.perf_counter()
        trace = _load_trace(args)
        log.info(
            "trace %s: %d requests, %d block refs, %d unique blocks (read in %.2f s)",
            trace.name,
            len(trace),
            trace.block_refs,
            trace.unique_blocks,
            time.perf_counter() - started,
        )
        started = time.perf_counter()
        results = _execute(args, plan, trace)
        extras = (
            _extras(args, plan, trace, results)
            if plan.groups is not None or plan.target is not None
            else None
        )
        log.info("%d replays in %.2f s", len(results), time.perf_counter() - started)
        return _report(args, plan, trace, results, extras)


# ------------------------------------------------------------------------------------------------ logging
def _add_log_arguments(p: argparse.ArgumentParser) -> None:
    """``--log-level`` and ``--log-format`` of ``aiokv replay`` (``aiokv serve`` has them in its OPTIONS)."""
    from ._log import FORMATS, LEVELS

    p.add_argument(
        "--log-level",
        choices=LEVELS,
        default=None,
        help="log level of the lines on stderr (default: warning) [AIOKV_LOG_LEVEL]",
    )
    p.add_argument(
        "--log-format",
        choices=FORMATS,
        default=None,
        help="log lines as text or one JSON object per line (default: text) [AIOKV_LOG_FORMAT]",
    )


def _log_settings(args: argparse.Namespace, default_level: str = "warning") -> tuple[str, str]:
    """The log level and format: the flag, else its ``AIOKV_*`` variable, else the default."""
    from ._log import FORMATS, LEVELS

    chosen = []
    for field, env, choices, default in (
        ("log_level", "AIOKV_LOG_LEVEL", LEVELS, default_level),
        ("log_format", "AIOKV_LOG_FORMAT", FORMATS, "text"),
    ):
        value = getattr(args, field)
        if value is None:
            raw = os.environ.get(env)
            value = default if raw is None else raw.strip()
            if value not in choices:
                raise InvalidArgumentError(f"{env} must be one of {', '.join(choices)}, got {raw!r}")
        chosen.append(value)
    return chosen[0], chosen[1]


# -------------------------------------------------------------------------------------------------- serve
def _add_serve(sub: Any) -> None:
    from .serve._config import OPTIONS, describe_option_default

    p = sub.add_parser(
        "serve",
        help="serve the reference engine over an OpenAI-compatible HTTP API",
        description=(
            "Serve the reference engine (random weights, nothing downloaded) with aiokv offloading over an "
            "OpenAI-compatible HTTP API: POST /v1/completions, POST /v1/chat/completions (streaming or not), "
            "GET /v1/models, /health, /ready and /metrics (Prometheus). SIGTERM or Ctrl-C drains: in-flight "
            "requests get --drain-timeout seconds, then the rest are aborted."
        ),
        epilog=(
            "Every option is also read from the environment variable shown in brackets (a flag wins over the "
            "variable). Needs the serve extra: pip install 'aiokv[serve]'. See docs/serving.md."
        ),
    )
    for opt in OPTIONS:
        text = f"{opt.help}{describe_option_default(opt)} [{opt.env}]"
        if opt.kind == "bool":
            p.add_argument(opt.option, dest=opt.field, action="store_true", default=None, help=text)
        else:
            metavar = "{" + ",".join(opt.choices) + "}" if opt.choices else opt.field.upper()
            p.add_argument(opt.option, dest=opt.field, default=None, metavar=metavar, help=text)
    p.set_defaults(func=_run_serve)


def _run_serve(args: argparse.Namespace) -> int:
    from .serve._config import OPTIONS, ServeConfig

    config = ServeConfig.from_sources({o.field: getattr(args, o.field) for o in OPTIONS})
    for module in ("starlette", "uvicorn", "anyio", "prometheus_client"):
        try:
            __import__(module)
        except ImportError:
            raise MissingDependencyError(f"aiokv serve needs {module}: pip install 'aiokv[serve]'") from None
    from ._log import configured
    from .serve._runner import run

    def ready(url: str) -> None:
        offload = ", ".join(s.describe() for s in config.tier_specs) if config.offload else "off"
        print(
            f"aiokv serve: model {config.model_name!r} on {url} (offload: {offload}); try: "
            f"curl {url}/v1/models",
            flush=True,
        )

    # One handler on stderr for aiokv's loggers and uvicorn's (uvicorn then leaves logging alone).
    with configured(config.log_level, config.log_format, loggers=("aiokv", "uvicorn")):
        try:
            run(config, on_ready=ready, log_config=None)
        except OSError as exc:  # a tier's files or server could not be set up
            print(f"aiokv serve: error: {_one_line(str(exc))}", file=sys.stderr)
            return 1
    return 0


# --------------------------------------------------------------------------------------------------- main
_SUBCOMMANDS: list[Callable[[Any], None]] = [_add_replay, _add_serve]


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="aiokv", description="aiokv command line tools")
    parser.add_argument("--version", action=_VersionAction, help="print the version and exit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for add in _SUBCOMMANDS:
        add(sub)
    return parser


def _silence_stdout() -> None:
    """After a broken pipe (``aiokv replay ... | head``), send the rest of stdout to /dev/null so the
    interpreter's final flush does not complain."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):  # stdout has no file descriptor (captured)
        pass


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status (usage errors exit 2 through argparse)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    try:
        code: int = args.func(args)
    except AiokvError as exc:
        print(f"aiokv {args.command}: error: {_one_line(str(exc))}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        _silence_stdout()
        return 1
    except KeyboardInterrupt:
        print(f"aiokv {args.command}: interrupted", file=sys.stderr)
        return 130
    return code


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
