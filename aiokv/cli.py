"""The ``aiokv`` command line. Subcommands register themselves in :data:`_SUBCOMMANDS`; today: ``replay``.

    aiokv replay TRACE [--tiers cpu=64GiB,disk=1TiB] [--policy lru,arc,chain-lru] [--sweep cpu=auto] ...

See docs/replay.md.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import Any

from ._errors import AiokvError, InvalidArgumentError, MissingDependencyError

__all__ = ["main"]


# ------------------------------------------------------------------------------------------------- replay
def _parse_assignments(text: str, what: str) -> list[tuple[str, str]]:
    """``"cpu=64GiB,disk=1TiB"`` -> ``[("cpu", "64GiB"), ("disk", "1TiB")]``."""
    out: list[tuple[str, str]] = []
    for part in text.split(","):
        name, sep, value = part.partition("=")
        if not sep or not name.strip() or not value.strip():
            raise InvalidArgumentError(f"{what} must look like name=value[,name=value...], got {text!r}")
        out.append((name.strip(), value.strip()))
    return out


def _synthetic_kwargs(spec: str) -> dict[str, Any]:
    """``synthetic:sessions=100,turns=4,seed=1`` -> keyword arguments of :func:`synthetic_trace`."""
    _, _, rest = spec.partition(":")
    if not rest:
        return {}
    kwargs: dict[str, Any] = {}
    ints = {"sessions", "turns", "system_prompts", "system_blocks", "seed"}
    floats = {"sessions_per_s", "think_s"}
    for name, value in _parse_assignments(rest, "synthetic trace options"):
        if name not in ints | floats:
            raise InvalidArgumentError(
                f"synthetic trace option must be one of {sorted(ints | floats)}, got {name!r}"
            )
        try:
            kwargs[name] = int(value) if name in ints else float(value)
        except ValueError:
            raise InvalidArgumentError(
                f"synthetic trace option {name} must be a number, got {value!r}"
            ) from None
    return kwargs


def _add_replay(sub: Any) -> None:
    from .replay import MODEL_PRESETS

    p = sub.add_parser(
        "replay",
        help="replay a request trace through the tier index to plan capacities",
        description=(
            "Replay a request trace through aiokv's block index and eviction policies (one index per tier, "
            "transfers replaced by a bandwidth model) and report hit ratios, bytes moved and an estimated "
            "TTFT saving. TRACE is a JSONL file (rows with hash_ids, token_ids or prompt) or "
            "'synthetic[:sessions=N,turns=N,seed=N,...]'."
        ),
    )
    p.add_argument("trace", metavar="TRACE")
    p.add_argument(
        "--tiers", default="cpu=64GiB", help="tiers fastest first, NAME=SIZE,... (default: %(default)s)"
    )
    p.add_argument("--policy", default="lru", help="eviction policy, or a comma-separated list to compare")
    p.add_argument("--block-tokens", type=int, default=512, help="tokens per block (default: %(default)s)")
    p.add_argument(
        "--model",
        choices=sorted(MODEL_PRESETS),
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
        "--bandwidth", default=None, help="tier read bandwidths, NAME=25GB/s,... (defaults by name)"
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
        "--plot", default=None, metavar="PNG", help="save hit ratio vs capacity per policy (matplotlib)"
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=_run_replay)


def _parse_sweep(text: str, first_tier: str) -> tuple[str, list[str]]:
    if "=" in text:
        tier, _, values = text.partition("=")
    else:
        tier, values = first_tier, text
    items = [v.strip() for v in values.split(",") if v.strip()]
    if not tier.strip() or not items:
        raise InvalidArgumentError(f"sweep must look like TIER=SIZE,SIZE... or TIER=auto, got {text!r}")
    return tier.strip(), items


def _run_replay(args: argparse.Namespace) -> int:
    from .replay import (
        MODEL_PRESETS,
        TTFT_FORMULA,
        CostModel,
        TierConfig,
        auto_capacities,
        format_size,
        load_trace,
        max_prefix_reuse,
        parse_bandwidth,
        parse_size,
        sweep,
        synthetic_trace,
    )
    from .replay._report import require_matplotlib, results_json, results_table, save_plot, tier_table
    from .tiers._policies import policy_names

    try:
        import rich  # noqa: F401

        have_rich = True
    except ImportError:
        have_rich = False
    if not have_rich and not args.json:
        raise MissingDependencyError(
            "aiokv replay needs rich for its tables; pip install 'aiokv[cli]' or pass --json"
        )
    if args.plot:
        require_matplotlib()

    policies = [p.strip() for p in args.policy.split(",") if p.strip()]
    for name in policies:
        if name not in policy_names():
            raise InvalidArgumentError(f"policy must be one of {policy_names()}, got {name!r}")
    if not policies:
        raise InvalidArgumentError("policy must name at least one policy")
    if args.limit is not None and args.limit < 1:
        raise InvalidArgumentError(f"limit must be >= 1, got {args.limit}")

    model_name = args.model or "llama3-8b"
    model = MODEL_PRESETS[model_name]
    kv = args.kv_bytes_per_token if args.kv_bytes_per_token is not None else model.kv_bytes_per_token
    if kv <= 0:
        raise InvalidArgumentError(f"kv-bytes-per-token must be > 0, got {kv}")
    cost = CostModel(args.prefill_tokens_per_s or model.prefill_tokens_per_s)

    bandwidths: dict[str, float] = {}
    if args.bandwidth:
        for name, value in _parse_assignments(args.bandwidth, "bandwidth"):
            bandwidths[name] = parse_bandwidth(value, what=f"bandwidth of tier {name!r}")
    tiers = [
        TierConfig(name, parse_size(value, what=f"capacity of tier {name!r}"), bandwidths.get(name))
        for name, value in _parse_assignments(args.tiers, "tiers")
    ]
    unknown = set(bandwidths) - {t.name for t in tiers}
    if unknown:
        raise InvalidArgumentError(f"bandwidth names tiers that are not in --tiers: {sorted(unknown)}")
    for t in tiers:
        t.resolved_bandwidth()  # fail before a long run

    if args.trace == "synthetic" or args.trace.startswith("synthetic:"):
        trace = synthetic_trace(block_tokens=args.block_tokens, **_synthetic_kwargs(args.trace))
        if args.limit is not None:
            trace = type(trace).from_requests(trace.name, trace.block_tokens, trace.requests[: args.limit])
    else:
        trace = load_trace(args.trace, block_tokens=args.block_tokens, limit=args.limit)
    block_bytes = trace.block_tokens * kv

    sweep_tier = tiers[0].name
    capacities: list[int | None]
    if args.sweep:
        sweep_tier, items = _parse_sweep(args.sweep, tiers[0].name)
        if items == ["auto"]:
            capacities = list(auto_capacities(trace, block_bytes))
        else:
            capacities = [parse_size(v, what=f"sweep capacity of tier {sweep_tier!r}") for v in items]
    else:
        capacities = [next((t.capacity_bytes for t in tiers if t.name == sweep_tier), None)]

    reuse = max_prefix_reuse(trace.requests)
    reuse_ratio = reuse / trace.block_refs if trace.block_refs else 0.0
    total_refs = trace.block_refs * len(policies) * len(capacities)

    def run(progress: Callable[[int], None] | None) -> list[Any]:
        return sweep(
            trace,
            tiers,
            policies=policies,
            sweep_tier=sweep_tier,
            capacities=capacities,
            kv_bytes_per_token=kv,
            cost=cost,
            inflight=args.inflight,
            progress=progress,
        )

    show_progress = have_rich and not args.no_progress
    if show_progress:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        with Progress(
            TextColumn("replaying {task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("block refs"),
            TimeRemainingColumn(),
            console=Console(stderr=True),
            transient=True,
        ) as bar:
            task = bar.add_task(trace.name, total=total_refs)
            results = run(lambda n: bar.advance(task, n))
    else:
        results = run(None)

    model_desc = (
        f"{model_name}" + (" (default)" if args.model is None else "")
        if args.kv_bytes_per_token is None
        else f"{kv} KV bytes/token"
    )
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
            "model": model_name if args.kv_bytes_per_token is None else None,
            "kv_bytes_per_token": kv,
            "block_bytes": block_bytes,
            "prefill_tokens_per_s": cost.prefill_tokens_per_s,
            "inflight": args.inflight,
            "sweep_tier": sweep_tier,
            "ttft_formula": TTFT_FORMULA,
        }
        sys.stdout.write(results_json(results, **meta) + "\n")
    else:
        from rich.console import Console

        console = Console(width=None if sys.stdout.isatty() else 160)
        console.print(
            f"[bold]{trace.name}[/]: {len(trace):,} requests, {trace.block_refs:,} block refs, "
            f"{trace.unique_blocks:,} unique blocks ({format_size(trace.unique_blocks * block_bytes)}), "
            f"max prefix reuse {100 * reuse_ratio:.1f}%"
        )
        console.print(
            f"model {model_desc}: {kv:,} KV bytes/token, {trace.block_tokens}-token blocks of "
            f"{format_size(block_bytes)}, prefill {cost.prefill_tokens_per_s:,.0f} tokens/s; "
            f"bandwidths "
            + ", ".join(f"{t.name}={t.resolved_bandwidth() / 1e9:g} GB/s" for t in tiers)
            + (f"; {args.inflight} in flight" if args.inflight else "")
        )
        console.print(results_table(results))
        if len(results) == 1:
            console.print(tier_table(results[0]))
        refs_per_s = sum(r.block_refs for r in results) / max(sum(r.elapsed_s for r in results), 1e-9)
        console.print(f"[dim]{len(results)} run(s), {refs_per_s:,.0f} block refs/s through the index[/]")
    if args.plot:
        title = f"{trace.name}, {model_name if args.kv_bytes_per_token is None else model_desc}" + (
            f", {args.inflight} in flight" if args.inflight else ""
        )
        save_plot(results, args.plot, sweep_tier=sweep_tier, max_reuse=reuse_ratio, title=title)
        if not args.json:
            print(f"plot written to {args.plot}", file=sys.stderr)
    return 0


# --------------------------------------------------------------------------------------------------- main
_SUBCOMMANDS: list[Callable[[Any], None]] = [_add_replay]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="aiokv", description="aiokv command line tools")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for add in _SUBCOMMANDS:
        add(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        code: int = args.func(args)
    except AiokvError as exc:
        print(f"aiokv {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # pragma: no cover - e.g. piped into head
        return 1
    return code


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
