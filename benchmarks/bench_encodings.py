"""Block encodings of the persistent tiers (issue 24): capacity, disk throughput and accuracy, in one run.

1. **Capacity**: bytes per block on disk and blocks per GiB for ``raw``, ``fp8`` and ``int8``, for a
   llama3-8b-shaped block (32 layers, K and V of 16 tokens x 8 KV heads x 128, bf16: 2 MiB raw) and for
   this benchmark's small model; the ratio to ``raw``. Computed by the tier itself (``DiskTier.stats()``).
2. **Disk throughput**: ``DiskTier.write`` and ``read_into`` of ``--blocks`` llama3-8b-shaped blocks
   (page-cache warm), each encoding against ``raw`` in the same run, alternating ``--repeat`` times; the
   median of the per-pair ratios (encoded / raw GB/s of *engine* bytes moved: what a restore delivers).
3. **Redis throughput**: ``RedisTier.write`` and ``read_into`` of ``--redis-blocks`` llama3-8b-shaped blocks
   (a 2048-token prefix by default: a long-prefix restore) against a ``redis-server`` / ``valkey-server``
   this script starts on a free loopback port (the test extra's wheels ship them) and stops by its PID; each
   encoding against ``raw`` in the same run, alternating ``--repeat`` times, the median of the per-pair
   ratios. Target (issue 24): a restore >= 1.5x faster with ``fp8`` than ``raw``.
4. **Accuracy** on the reference engine (``aiokv.engine.Transformer``, its real attention math over seeded
   weights, ``--dtype``, bf16 by default): a multi-turn workload where each turn's prompt extends the previous turn's context; the
   context's KV is restored from an encoded block (encode then decode, exactly what a tier read gives) and
   the turn is computed over it, against the same turn over the exact KV. Reported: max |delta logit| of
   the first generated position (and relative to the logits' spread), and greedy token agreement over
   ``--gen`` generated tokens per turn. The weights are random (no trained model here), so perplexity is not
   meaningful and is not reported.

Run: ``python benchmarks/bench_encodings.py [--quick]``.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import _common as common

import aiokv
from aiokv.engine import ModelConfig, SeqChunk, Transformer
from aiokv.tiers._base import TierSpec
from aiokv.tiers._codec import _native_codec, make_codec, segments_of
from aiokv.tiers.disk import DiskTier
from aiokv.tiers.redis import RedisTier

ENCODINGS = ("raw", "fp8", "int8")
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
CONTROL = "exact, recomputed"  # the accuracy table's noise floor (see accuracy())
BS = 16


def llama_layout() -> aiokv.KVLayout:
    kv = [torch.zeros(2, BS, 8, 128, dtype=torch.bfloat16) for _ in range(64)]
    return aiokv.KVLayout(kv, block_size=BS, tensors_per_layer=2, model_id="llama3-8b-shaped")


def spec_of(layout: aiokv.KVLayout) -> TierSpec:
    return TierSpec(layout.slot_bytes, layout.fingerprint, layout.block_size, "bench", segments_of(layout))


async def capacity(layout: aiokv.KVLayout, root: Path) -> dict[str, dict[str, float]]:
    out = {}
    for enc in ENCODINGS:
        tier = DiskTier(root / f"cap-{enc}", 1 << 30, encoding=enc, preallocate=False)
        await tier.open(spec_of(layout))
        st = tier.stats()
        await tier.aclose()
        out[enc] = {"entry_bytes": st.entry_bytes, "blocks_per_gib": st.num_slots}
    for enc in ENCODINGS:
        out[enc]["x_raw"] = out[enc]["blocks_per_gib"] / out["raw"]["blocks_per_gib"]
    return out


async def throughput(
    layout: aiokv.KVLayout, root: Path, blocks: int, repeat: int
) -> dict[str, dict[str, float]]:
    g = torch.Generator().manual_seed(1)
    payloads = []
    for _ in range(blocks):
        buf = bytearray(layout.slot_bytes)
        torch.frombuffer(buf, dtype=torch.bfloat16).copy_(torch.randn(layout.slot_bytes // 2, generator=g))
        payloads.append(memoryview(buf))
    outs = [memoryview(bytearray(layout.slot_bytes)) for _ in range(blocks)]
    engine_bytes = blocks * layout.slot_bytes
    figures: dict[str, dict[str, list[float]]] = {e: {"write": [], "read": []} for e in ENCODINGS}
    for rep in range(repeat):
        for enc in ENCODINGS:
            tier = DiskTier(
                root / f"tp-{enc}", 2 * engine_bytes + (64 << 20), encoding=enc, preallocate=False
            )
            await tier.open(spec_of(layout))
            keys = [hashlib.sha256(f"{rep}-{i}".encode()).digest() for i in range(blocks)]
            t0 = time.perf_counter()
            assert await tier.write(keys, payloads) == blocks
            t1 = time.perf_counter()
            assert await tier.read_into(keys, outs) == blocks
            t2 = time.perf_counter()
            await tier.aclose()
            figures[enc]["write"].append(engine_bytes / (t1 - t0) / 1e9)
            figures[enc]["read"].append(engine_bytes / (t2 - t1) / 1e9)
    return _ratios(figures)


def _ratios(figures: dict[str, dict[str, list[float]]]) -> dict[str, dict[str, float]]:
    """Per encoding: the median GB/s of each direction and the median (min, max) of its per-pair ratio to raw."""
    out = {}
    for enc in ENCODINGS:
        row: dict[str, float] = {}
        for what in ("write", "read"):
            row[f"{what}_gbps"] = statistics.median(figures[enc][what])
            ratios = [a / b for a, b in zip(figures[enc][what], figures["raw"][what], strict=True)]
            row[f"{what}_x_raw"] = statistics.median(ratios)
            row[f"{what}_x_raw_min"] = min(ratios)
            row[f"{what}_x_raw_max"] = max(ratios)
        out[enc] = row
    return out


async def redis_throughput(
    layout: aiokv.KVLayout, root: Path, blocks: int, repeat: int
) -> dict[str, dict[str, float]] | str:
    """RedisTier write / read_into of ``blocks`` blocks per encoding (or why it was skipped)."""
    from tests.tiers._servers import LOOKED_FOR, ServerProcess, default_binary

    binary = default_binary()
    if binary is None:
        return f"skipped: no server binary ({LOOKED_FOR['redis']}; {LOOKED_FOR['valkey']})"
    g = torch.Generator().manual_seed(2)
    payloads = []
    for _ in range(blocks):
        buf = bytearray(layout.slot_bytes)
        torch.frombuffer(buf, dtype=torch.bfloat16).copy_(torch.randn(layout.slot_bytes // 2, generator=g))
        payloads.append(memoryview(buf))
    outs = [memoryview(bytearray(layout.slot_bytes)) for _ in range(blocks)]
    engine_bytes = blocks * layout.slot_bytes
    figures: dict[str, dict[str, list[float]]] = {e: {"write": [], "read": []} for e in ENCODINGS}
    workdir = root / "redis"
    workdir.mkdir()
    server = ServerProcess(workdir, binary)
    server.start()
    try:
        tiers = {}
        for enc in ENCODINGS:
            tiers[enc] = RedisTier(server.url, namespace=f"bench-{enc}", encoding=enc, timeout_s=60)
            await tiers[enc].open(spec_of(layout))
        keys = [hashlib.sha256(f"redis-{i}".encode()).digest() for i in range(blocks)]
        for _ in range(repeat):
            for enc in ENCODINGS:
                tier = tiers[enc]
                t0 = time.perf_counter()
                assert await tier.write(keys, payloads) == blocks
                t1 = time.perf_counter()
                assert await tier.read_into(keys, outs) == blocks
                t2 = time.perf_counter()
                figures[enc]["write"].append(engine_bytes / (t1 - t0) / 1e9)
                figures[enc]["read"].append(engine_bytes / (t2 - t1) / 1e9)
        for enc, tier in tiers.items():
            st = tier.stats()
            assert st.errors == st.timeouts == st.corrupt == 0, (enc, st)
            await tier.aclose()
    finally:
        server.stop()
    out: dict[str, object] = dict(_ratios(figures))
    out["server"] = binary.name()
    return out  # type: ignore[return-value]


def _round_trip(
    codec: object, layout: aiokv.KVLayout, kv: list[torch.Tensor], blocks: range
) -> list[torch.Tensor]:
    """The KV an encoded tier would restore into ``blocks``: each block's slot encoded, then decoded."""
    if codec is None:
        return [t.clone() for t in kv]
    out = [t.clone() for t in kv]
    for b in blocks:
        slot = bytearray(layout.slot_bytes)
        view = torch.frombuffer(slot, dtype=torch.uint8)
        for t, spec in zip(kv, layout.specs, strict=True):
            data = t[b].contiguous().view(torch.uint8).reshape(-1)
            view[spec.slot_offset : spec.slot_offset + data.numel()].copy_(data)
        enc = bytearray(codec.encoded_bytes)  # type: ignore[attr-defined]
        codec.encode(memoryview(slot), memoryview(enc))  # type: ignore[attr-defined]
        back = bytearray(layout.slot_bytes)
        codec.decode(enc, memoryview(back))  # type: ignore[attr-defined]
        bview = torch.frombuffer(back, dtype=torch.uint8)
        for t, spec in zip(out, layout.specs, strict=True):
            n = t[b].numel() * t.element_size()
            t[b].view(-1).view(torch.uint8).copy_(bview[spec.slot_offset : spec.slot_offset + n])
    return out


def accuracy(turns: int, prompt: int, gen: int, seed: int, dtype: torch.dtype) -> dict[str, dict[str, float]]:
    cfg = ModelConfig(
        num_layers=4,
        hidden_size=512,
        num_heads=8,
        num_kv_heads=4,
        head_dim=64,
        intermediate_size=1024,
        vocab_size=4096,
        dtype=dtype,
        seed=seed,
    )
    model = Transformer(cfg)
    rng = torch.Generator().manual_seed(seed)
    ctx_blocks = (turns * (prompt + gen)) // BS + 4
    base_kv = list(model.allocate_kv_caches(ctx_blocks, BS))
    layout = aiokv.KVLayout(base_kv, block_size=BS, tensors_per_layer=2)
    table = list(range(ctx_blocks))
    variants = (*ENCODINGS[1:], CONTROL)
    results: dict[str, dict[str, list[float]]] = {e: {"dlogit": [], "rel": [], "agree": []} for e in variants}
    context: list[int] = []
    for _turn in range(turns):
        new = torch.randint(0, cfg.vocab_size, (prompt,), generator=rng).tolist()
        full_blocks = len(context) // BS  # the restored prefix: whole blocks of the context so far
        start = full_blocks * BS
        for enc in variants:
            ref_kv = [t.clone() for t in base_kv]
            if enc == CONTROL:
                # Exact KV of the same prefix, computed in one forward instead of turn by turn: only the order
                # of bf16 arithmetic differs. How far greedy decoding of this model drifts from that alone.
                lossy_kv = [torch.zeros_like(t) for t in base_kv]
                if start:
                    model.forward([SeqChunk(context[:start], 0, table)], lossy_kv)
            else:
                codec = make_codec(enc, segments_of(layout), layout.slot_bytes)
                lossy_kv = _round_trip(codec, layout, base_kv, range(full_blocks))
            runs = []
            for kv in (ref_kv, lossy_kv):
                toks = context[start:] + new
                logits = model.forward([SeqChunk(toks, start, table)], kv)
                first = logits[0].float()
                out_tokens = []
                pos = start + len(toks)
                nxt = int(first.argmax())
                for _ in range(gen):
                    out_tokens.append(nxt)
                    step = model.forward([SeqChunk([nxt], pos, table)], kv)
                    pos += 1
                    nxt = int(step[0].float().argmax())
                runs.append((first, out_tokens))
            (ref_first, ref_toks), (lossy_first, lossy_toks) = runs
            d = float((ref_first - lossy_first).abs().max())
            spread = float(ref_first.max() - ref_first.min())
            agree = 0
            for a, b in zip(ref_toks, lossy_toks, strict=True):
                if a != b:
                    break
                agree += 1
            results[enc]["dlogit"].append(d)
            results[enc]["rel"].append(d / spread if spread else 0.0)
            results[enc]["agree"].append(agree / gen)
        # The next turn's context: this turn's prompt and the exact model's answer.
        ctx_kv = base_kv
        toks = context[start:] + new
        logits = model.forward([SeqChunk(toks, start, table)], ctx_kv)
        context = context + new
        nxt = int(logits[0].float().argmax())
        for _ in range(gen):
            context.append(nxt)
            step = model.forward([SeqChunk([nxt], len(context) - 1, table)], ctx_kv)
            nxt = int(step[0].float().argmax())
    return {
        enc: {
            "max_dlogit": max(r["dlogit"]),
            "max_dlogit_rel": max(r["rel"]),
            "greedy_prefix_agreement_min": min(r["agree"]),
            "greedy_prefix_agreement_mean": statistics.fmean(r["agree"]),
        }
        for enc, r in results.items()
    }


async def main_async(args: argparse.Namespace) -> dict[str, object]:
    layout = llama_layout()
    with tempfile.TemporaryDirectory(prefix="aiokv-bench-enc-") as tmp:
        root = Path(tmp)
        cap = await capacity(layout, root)
        tp = await throughput(layout, root, args.blocks, args.repeat)
        red = await redis_throughput(layout, root, args.redis_blocks, args.repeat)
    acc = accuracy(args.turns, args.prompt, args.gen, args.seed, DTYPES[args.dtype])
    return {
        "capacity": cap,
        "disk": tp,
        "redis": red,
        "accuracy": acc,
        "native_codec": _native_codec is not None,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--blocks", type=int, default=64, help="blocks per disk write/read (2 MiB each raw)")
    ap.add_argument("--redis-blocks", type=int, default=128, help="blocks per Redis write/read (2048 tokens)")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=96)
    ap.add_argument("--gen", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16", help="the reference model's dtype")
    ap.add_argument("--quick", action="store_true", help="16 blocks, 2 repeats, 2 turns, 8 generated tokens")
    args = ap.parse_args()
    if args.quick:
        args.blocks, args.redis_blocks, args.repeat, args.turns, args.gen = 16, 16, 2, 2, 8
    res = asyncio.run(main_async(args))
    cap, tp, acc = res["capacity"], res["disk"], res["accuracy"]
    common.print_table(
        "encodings: capacity (llama3-8b-shaped block, 2 MiB raw) and disk throughput (warm, engine bytes)",
        [
            "encoding",
            "entry bytes",
            "blocks/GiB",
            "x raw",
            "write GB/s",
            "write x raw",
            "read GB/s",
            "read x raw",
        ],
        [
            [
                e,
                f"{cap[e]['entry_bytes']:,}",  # type: ignore[index]
                f"{cap[e]['blocks_per_gib']:,}",  # type: ignore[index]
                f"{cap[e]['x_raw']:.2f}",  # type: ignore[index]
                f"{tp[e]['write_gbps']:.2f}",  # type: ignore[index]
                f"{tp[e]['write_x_raw']:.2f} ({tp[e]['write_x_raw_min']:.2f}-{tp[e]['write_x_raw_max']:.2f})",  # type: ignore[index]
                f"{tp[e]['read_gbps']:.2f}",  # type: ignore[index]
                f"{tp[e]['read_x_raw']:.2f} ({tp[e]['read_x_raw_min']:.2f}-{tp[e]['read_x_raw_max']:.2f})",  # type: ignore[index]
            ]
            for e in ENCODINGS
        ],
        f"median of {args.repeat} alternating repetitions (range); {args.blocks} blocks per call; codec in "
        f"{'C' if res['native_codec'] else 'torch (AIOKV_NATIVE_CODEC=0 or not built)'}",
    )
    red = res["redis"]
    if isinstance(red, str):
        print(f"\nencodings: Redis tier {red}")
    else:
        common.print_table(
            "encodings: Redis tier throughput (loopback, engine bytes; target: fp8 restore >= 1.5x raw)",
            ["encoding", "write GB/s", "write x raw", "restore GB/s", "restore x raw"],
            [
                [
                    e,
                    f"{red[e]['write_gbps']:.2f}",  # type: ignore[index]
                    f"{red[e]['write_x_raw']:.2f} ({red[e]['write_x_raw_min']:.2f}-{red[e]['write_x_raw_max']:.2f})",  # type: ignore[index]
                    f"{red[e]['read_gbps']:.2f}",  # type: ignore[index]
                    f"{red[e]['read_x_raw']:.2f} ({red[e]['read_x_raw_min']:.2f}-{red[e]['read_x_raw_max']:.2f})",  # type: ignore[index]
                ]
                for e in ENCODINGS
            ],
            f"{red['server']}; median of {args.repeat} alternating repetitions (range); {args.redis_blocks} "
            "blocks of 2 MiB per call",
        )
    common.print_table(
        f"encodings: accuracy of restored turns on the reference engine ({args.dtype}, seeded weights)",
        ["encoding", "max |d logit|", "rel. to logit spread", "greedy agreement min", "mean"],
        [
            [
                e,
                f"{acc[e]['max_dlogit']:.4f}",  # type: ignore[index]
                f"{acc[e]['max_dlogit_rel']:.4f}",  # type: ignore[index]
                f"{acc[e]['greedy_prefix_agreement_min']:.2f}",  # type: ignore[index]
                f"{acc[e]['greedy_prefix_agreement_mean']:.2f}",  # type: ignore[index]
            ]
            for e in ("fp8", "int8", CONTROL)
        ],
        f"{args.turns} turns of {args.prompt} new tokens and {args.gen} generated; agreement: the fraction of "
        "generated tokens before the first that differs from the exact KV's; 'exact, recomputed': the same prefix "
        "recomputed in one forward (bf16 arithmetic order only), the noise floor of this seeded model",
    )
    common.write_result("encodings", res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
