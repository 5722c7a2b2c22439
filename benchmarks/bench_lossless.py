"""Lossless compression of KV-cache blocks (issue 24): which compressor, filter and level for the disk and Redis tiers.

For every candidate encoding and every data set it measures

* the **compression ratio**: raw bytes / encoded bytes (headers included), summed over all blocks, at two
  granularities: a *layer block* (one layer's K then V for one 16-token block; 64 KiB in bf16 for the default
  8 KV heads x 128) and a *whole block* (every layer's K and V of one block back to back, as
  :class:`aiokv.KVLayout` packs a slot; 1 MiB in bf16 for the default 16 layers);
* single-thread **compress and decompress throughput**, in GB/s of *raw* bytes, best and median of
  ``--repeat`` passes over all blocks. A filter's cost is included (shuffle + compress; decompress +
  unshuffle), and decompression always ends with the bytes in a preallocated destination buffer (what a tier's
  ``read_into`` has to deliver), so a codec that returns a new ``bytes`` pays for that copy;
* whether the library **releases the GIL**: the same work on two threads (own compressor objects each) against
  one thread doing both halves (on two free cores a speed-up near 2 means the GIL is released, unless the work
  is memory-bound), and how much pure-Python work the main thread gets done while another thread loops the
  call (about 1.0: released; well below: held). python-blosc2 holds the GIL unless ``blosc2.set_releasegil(True)``;
  both settings are measured;
* the cost of the numpy filters alone (shuffle, unshuffle, bit rotation).

Every encoding is checked to round-trip bit-exactly on every block.

Data sets:

* **engine**: KV caches filled by the reference engine (:class:`aiokv.engine.Transformer`: real attention math and
  RoPE over *seeded random weights*, no trained model) for a multi-turn workload (``--turns`` turns of
  ``--prompt`` new prompt tokens followed by ``--gen`` greedy-decoded tokens, each turn extending the
  conversation's context), block size 16. bf16 and float32 are the engine running in that dtype; fp16 is the
  float32 engine's KV rounded to fp16 (the CPU fp16 matmul is ~300x slower than bf16 here; ``--native-fp16``
  runs the fp16 engine instead). Only completely filled blocks are used; the conversation's last, partially
  filled block is its own data set (**engine padded**, zeros after the last token).
* **synthetic** (labelled as such): Gaussian K and V with per-channel log-normal scales, K with a few outlier
  channels per head (as trained models' K caches have; the engine's random weights give none), cast to bf16 and
  fp16, in the engine's shapes.
* **zero**: an all-zero block (e.g. padding).

Candidates (the tables' names):

* ``zstd-1``, ``zstd-3``, ``lz4``: the codec on plain bytes (lz4: ``lz4.block``);
* ``shuf+zstd-1``, ``shuf+zstd-3``, ``shuf+lz4``: a numpy byte shuffle (all bytes ``i`` of the values
  together), then one frame over all planes;
* ``shuf+zstd-N/plane``: the byte shuffle, then each plane its own zstd frame (so the exponent plane gets its own
  entropy table even when the block fits in one 128 KiB zstd block);
* ``rot+zstd-1/plane``: the values rotated left by one bit first (the sign moves below the mantissa: for bf16 and
  float32 the top byte plane is then exactly the 8 exponent bits), then as ``shuf+zstd-1/plane``;
  ``rot+zstd-1 exp-only``: the same, but only the exponent plane is compressed, the others stored raw;
* ``b2 F+C cN``: blosc2 with filter F (SHUFFLE or BITSHUFFLE, typesize = the value size), codec C, clevel N, one
  thread (blosc2's clevel N runs zstd level 2N - 1: c1 is zstd 1, c2 zstd 3); ``split``: ``ALWAYS_SPLIT``
  instead of the default ``AUTO_SPLIT``.

Also printed per data set: the order-0 entropy bound of an ideal per-byte-plane coder and of an ideal coder of
whole values (a global histogram over the data set, so slightly optimistic for per-block coding).

For scale: the tiers' ``fp8`` encoding stores 2.0x fewer bytes than bf16 ``raw``, but is lossy.

Needs numpy, zstandard, lz4 and blosc2 (not in the project's venv: the benchmark skips with a message without
them). Run: ``python benchmarks/bench_lossless.py [--quick]``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import struct
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as common

try:
    import blosc2
    import lz4.block
    import numpy as np
    import zstandard
except ImportError as exc:  # the project's own venv has none of these
    print(
        f"bench_lossless: {exc.name} is not installed (needs numpy, zstandard, lz4 and blosc2: "
        "pip install numpy zstandard lz4 blosc2); skipped"
    )
    raise SystemExit(0) from None

import torch

BS = 16
UINT = {2: np.uint16, 4: np.uint32}

Encode = Callable[[np.ndarray], bytes]
Decode = Callable[[bytes, np.ndarray], None]


# -- candidates ----------------------------------------------------------------------------------------------


def _shuffle(raw: np.ndarray, w: int) -> np.ndarray:
    """``(w, n)`` byte planes of ``n`` little-endian values of ``w`` bytes: plane ``i`` holds every byte ``i``.

    The same result as ``raw.reshape(-1, w).T.copy()``, but with shifts and truncating casts, which numpy runs
    ~1.7x faster than that strided copy (see the shuffle table)."""
    u = raw.view(UINT[w])
    planes = np.empty((w, u.size), np.uint8)
    np.copyto(planes[0], u, casting="unsafe")
    for i in range(1, w):
        np.copyto(planes[i], u >> (8 * i), casting="unsafe")
    return planes


def _shuffle_strided(raw: np.ndarray, w: int) -> np.ndarray:
    return raw.reshape(-1, w).T.copy()


def _unshuffle_into(planes: list[np.ndarray] | np.ndarray, out: np.ndarray, w: int) -> None:
    """The inverse of :func:`_shuffle`, written into ``out`` (shifts and ors: ~8x numpy's strided copy)."""
    u = out.view(UINT[w])
    np.left_shift(planes[w - 1], 8 * (w - 1), out=u, dtype=UINT[w])
    for i in range(w - 2, -1, -1):
        u |= np.left_shift(planes[i], 8 * i, dtype=UINT[w]) if i else planes[i]


def _unshuffle_strided(planes: np.ndarray, out: np.ndarray, w: int) -> None:
    out.reshape(-1, w)[:] = planes.T


def _rotl1(raw: np.ndarray, w: int) -> np.ndarray:
    """The values rotated left by one bit: the sign becomes bit 0, so bf16's / float32's top byte is the
    exponent."""
    u = raw.view(UINT[w])
    return ((u << 1) | (u >> (8 * w - 1))).view(np.uint8)


def _rotr1_into(rot: np.ndarray, out: np.ndarray, w: int) -> None:
    r, o = rot.view(UINT[w]), out.view(UINT[w])
    np.right_shift(r, 1, out=o)
    o |= r << (8 * w - 1)


def _pack(parts: list[bytes]) -> bytes:
    return b"".join([struct.pack(f"<{len(parts)}I", *(len(p) for p in parts)), *parts])


def _unpack(payload: bytes, count: int) -> list[memoryview]:
    lens = struct.unpack_from(f"<{count}I", payload)
    mv, off, out = memoryview(payload), 4 * count, []
    for n in lens:
        out.append(mv[off : off + n])
        off += n
    return out


def plain_zstd(level: int) -> Callable[[int], tuple[Encode, Decode]]:
    def make(w: int) -> tuple[Encode, Decode]:
        cctx, dctx = zstandard.ZstdCompressor(level=level), zstandard.ZstdDecompressor()

        def enc(raw: np.ndarray) -> bytes:
            return cctx.compress(raw)

        def dec(payload: bytes, out: np.ndarray) -> None:
            out[:] = np.frombuffer(dctx.decompress(payload), np.uint8)

        return enc, dec

    return make


def plain_lz4(w: int) -> tuple[Encode, Decode]:
    def enc(raw: np.ndarray) -> bytes:
        return lz4.block.compress(raw)

    def dec(payload: bytes, out: np.ndarray) -> None:
        out[:] = np.frombuffer(lz4.block.decompress(payload), np.uint8)

    return enc, dec


def shuf_frame(codec: str, level: int = 0) -> Callable[[int], tuple[Encode, Decode]]:
    """Byte shuffle, then one zstd / lz4 frame over all planes."""

    def make(w: int) -> tuple[Encode, Decode]:
        if codec == "zstd":
            cctx, dctx = zstandard.ZstdCompressor(level=level), zstandard.ZstdDecompressor()
            comp, decomp = cctx.compress, dctx.decompress
        else:
            comp, decomp = lz4.block.compress, lz4.block.decompress

        def enc(raw: np.ndarray) -> bytes:
            return comp(_shuffle(raw, w))

        def dec(payload: bytes, out: np.ndarray) -> None:
            _unshuffle_into(np.frombuffer(decomp(payload), np.uint8).reshape(w, -1), out, w)

        return enc, dec

    return make


def shuf_planes(
    level: int, rotate: bool = False, exp_only: bool = False
) -> Callable[[int], tuple[Encode, Decode]]:
    """(Rotate,) byte shuffle, then each plane its own zstd frame (``exp_only``: only the top plane, the exponent
    after rotating, is compressed; the other planes are stored as they are)."""

    def make(w: int) -> tuple[Encode, Decode]:
        cctx, dctx = zstandard.ZstdCompressor(level=level), zstandard.ZstdDecompressor()
        squeezed = [w - 1] if exp_only else list(range(w))

        def enc(raw: np.ndarray) -> bytes:
            planes = _shuffle(_rotl1(raw, w) if rotate else raw, w)
            return _pack([cctx.compress(p) if i in squeezed else p.tobytes() for i, p in enumerate(planes)])

        def dec(payload: bytes, out: np.ndarray) -> None:
            dst = np.empty_like(out) if rotate else out
            planes = [
                np.frombuffer(dctx.decompress(part) if i in squeezed else part, np.uint8)
                for i, part in enumerate(_unpack(payload, w))
            ]
            _unshuffle_into(planes, dst, w)
            if rotate:
                _rotr1_into(dst, out, w)

        return enc, dec

    return make


def blosc(
    filt: blosc2.Filter,
    codec: blosc2.Codec,
    clevel: int,
    split: blosc2.SplitMode = blosc2.SplitMode.AUTO_SPLIT,
) -> Callable[[int], tuple[Encode, Decode]]:
    def make(w: int) -> tuple[Encode, Decode]:
        kw: dict[str, Any] = dict(
            codec=codec,
            clevel=clevel,
            typesize=w,
            nthreads=1,
            filters=[filt],
            filters_meta=[0],
            splitmode=split,
        )

        def enc(raw: np.ndarray) -> bytes:
            return blosc2.compress2(raw, **kw)

        def dec(payload: bytes, out: np.ndarray) -> None:
            blosc2.decompress2(payload, dst=out, nthreads=1)

        return enc, dec

    return make


S, B = blosc2.Filter.SHUFFLE, blosc2.Filter.BITSHUFFLE
CANDIDATES: dict[str, Callable[[int], tuple[Encode, Decode]]] = {
    "zstd-1": plain_zstd(1),
    "zstd-3": plain_zstd(3),
    "lz4": plain_lz4,
    "shuf+zstd-1": shuf_frame("zstd", 1),
    "shuf+zstd-3": shuf_frame("zstd", 3),
    "shuf+lz4": shuf_frame("lz4"),
    "shuf+zstd-1/plane": shuf_planes(1),
    "shuf+zstd-3/plane": shuf_planes(3),
    "rot+zstd-1/plane": shuf_planes(1, rotate=True),
    "rot+zstd-1 exp-only": shuf_planes(1, rotate=True, exp_only=True),
    "b2 shuf+zstd c1": blosc(S, blosc2.Codec.ZSTD, 1),
    "b2 shuf+zstd c2": blosc(S, blosc2.Codec.ZSTD, 2),
    "b2 shuf+zstd c1 split": blosc(S, blosc2.Codec.ZSTD, 1, blosc2.SplitMode.ALWAYS_SPLIT),
    "b2 shuf+lz4 c5": blosc(S, blosc2.Codec.LZ4, 5),
    "b2 bitshuf+zstd c1": blosc(B, blosc2.Codec.ZSTD, 1),
    "b2 bitshuf+lz4 c5": blosc(B, blosc2.Codec.LZ4, 5),
}
GIL_CANDIDATES = ("zstd-1", "lz4", "shuf+zstd-1", "shuf+zstd-1/plane", "b2 shuf+zstd c1", "b2 bitshuf+lz4 c5")


# -- data ----------------------------------------------------------------------------------------------------


@dataclass
class DataSet:
    name: str
    itemsize: int
    layer_blocks: list[np.ndarray]  # one layer's K then V of one block, bytes
    whole_blocks: list[np.ndarray]  # every layer's K and V of one block, bytes


def _blocks_of(kv: list[torch.Tensor], blocks: range) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Per block: (layer blocks, whole block) as contiguous uint8 arrays; ``kv`` is ``[k0, v0, k1, v1, ...]``."""
    layer, whole = [], []
    for b in blocks:
        parts = [t[b].contiguous().reshape(-1).view(torch.uint8) for t in kv]
        whole.append(torch.cat(parts).numpy().copy())
        layer += [torch.cat(parts[i : i + 2]).numpy().copy() for i in range(0, len(parts), 2)]
    return layer, whole


def engine_kv(args: argparse.Namespace, dtype: torch.dtype) -> tuple[list[torch.Tensor], int]:
    """The KV caches of a multi-turn conversation on the reference engine, and how many tokens they hold."""
    from aiokv.engine import ModelConfig, SeqChunk, Transformer

    cfg = ModelConfig(
        num_layers=args.layers,
        hidden_size=1024,
        num_heads=8,
        num_kv_heads=args.kv_heads,
        head_dim=args.head_dim,
        intermediate_size=2048,
        vocab_size=4096,
        dtype=dtype,
        seed=args.seed,
    )
    model = Transformer(cfg)
    tokens = args.turns * (args.prompt + args.gen)
    nblocks = tokens // BS + 1
    kv = list(model.allocate_kv_caches(nblocks, BS))
    table = list(range(nblocks))
    rng = torch.Generator().manual_seed(args.seed + 1)
    pos = 0
    for _ in range(args.turns):
        new = torch.randint(0, cfg.vocab_size, (args.prompt,), generator=rng).tolist()
        logits = model.forward([SeqChunk(new, pos, table)], kv)
        pos += len(new)
        for _ in range(args.gen):  # greedy decode; each generated token's KV joins the context
            nxt = int(logits[0].float().argmax())
            logits = model.forward([SeqChunk([nxt], pos, table)], kv)
            pos += 1
    assert pos == tokens
    return kv, tokens


def engine_sets(args: argparse.Namespace) -> list[DataSet]:
    out = []
    runs = {"bf16": torch.bfloat16, "fp32": torch.float32}
    if args.native_fp16:
        runs["fp16"] = torch.float16
    kvs = {}
    for name, dt in runs.items():
        common.status(f"bench_lossless: running the reference engine in {name}")
        kvs[name] = engine_kv(args, dt)
    fp16_label = "fp16"
    if not args.native_fp16:
        kv32, n = kvs["fp32"]
        kvs["fp16"] = ([t.to(torch.float16) for t in kv32], n)
        fp16_label = "fp16 (fp32 engine's KV rounded)"
    for name, label, w in (("bf16", "bf16", 2), ("fp16", fp16_label, 2), ("fp32", "fp32", 4)):
        kv, tokens = kvs[name]
        full = tokens // BS
        out.append(DataSet(f"engine {label}", w, *_blocks_of(kv, range(full))))
        if name == "bf16" and tokens % BS:
            out.append(
                DataSet(
                    f"engine bf16 padded ({tokens % BS}/{BS} tokens filled)",
                    w,
                    *_blocks_of(kv, range(full, full + 1)),
                )
            )
    return out


def synthetic_sets(args: argparse.Namespace, nblocks: int) -> list[DataSet]:
    """Gaussian K and V with per-channel log-normal scales; K has ``--outliers`` outlier channels per head."""
    g = torch.Generator().manual_seed(args.seed + 2)
    L, H, D = args.layers, args.kv_heads, args.head_dim
    kv32 = []
    for _ in range(L):
        k_scale = torch.exp(0.5 * torch.randn(H, D, generator=g))
        for h in range(H):
            idx = torch.randperm(D, generator=g)[: args.outliers]
            k_scale[h, idx] *= 10 + 20 * torch.rand(len(idx), generator=g)
        v_scale = torch.exp(0.3 * torch.randn(H, D, generator=g))
        kv32.append(torch.randn(nblocks, BS, H, D, generator=g) * k_scale)
        kv32.append(torch.randn(nblocks, BS, H, D, generator=g) * v_scale)
    out = []
    for label, dt in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
        kv = [t.to(dt) for t in kv32]
        out.append(
            DataSet(
                f"SYNTHETIC gaussian {label}, {args.outliers} K outlier ch/head",
                2,
                *_blocks_of(kv, range(nblocks)),
            )
        )
    return out


def zero_set(args: argparse.Namespace) -> DataSet:
    kv = [
        torch.zeros(1, BS, args.kv_heads, args.head_dim, dtype=torch.bfloat16) for _ in range(2 * args.layers)
    ]
    return DataSet("all-zero bf16 block", 2, *_blocks_of(kv, range(1)))


def entropy_bounds(ds: DataSet) -> tuple[float, float]:
    """Order-0 bound ratios: (per byte plane, per whole value), from global histograms over the data set."""
    data = np.concatenate(ds.whole_blocks)
    w = ds.itemsize

    def h(x: np.ndarray, nbins: int) -> float:
        p = np.bincount(x, minlength=nbins).astype(np.float64)
        p = p[p > 0] / x.size
        return float(-(p * np.log2(p)).sum())

    cols = data.reshape(-1, w)
    planes = sum(h(cols[:, i], 256) for i in range(w))
    # Whole values: a 65536-bin histogram for 16-bit ones; for 32-bit ones the data set has far fewer values
    # than possible symbols, so their empirical entropy is meaningless (NaN).
    whole = h(data.view(np.uint16), 1 << 16) if w == 2 else math.nan
    return (8 * w / planes if planes else math.inf), (8 * w / whole if whole else math.inf)


# -- measurement ---------------------------------------------------------------------------------------------


def _min_reps(items: list[np.ndarray], min_bytes: int) -> list[np.ndarray]:
    """``items`` repeated so that one timed pass moves at least ``min_bytes`` (tiny data sets)."""
    total = sum(x.nbytes for x in items)
    return items * max(1, math.ceil(min_bytes / total))


def measure(
    make: Callable[[int], tuple[Encode, Decode]], ds: DataSet, items: list[np.ndarray], repeat: int
) -> dict[str, float]:
    enc, dec = make(ds.itemsize)
    payloads = [enc(x) for x in items]
    outs = [np.empty_like(x) for x in items]
    for x, p, o in zip(items, payloads, outs, strict=True):  # also the warm-up
        dec(p, o)
        if not np.array_equal(x, o):
            raise AssertionError(f"round trip failed on {ds.name}")
    raw = sum(x.nbytes for x in items)
    ratio = raw / sum(len(p) for p in payloads)
    timed = _min_reps(items, 8 << 20)
    t_payloads = payloads * (len(timed) // len(items))
    t_outs = outs * (len(timed) // len(items))
    tbytes = sum(x.nbytes for x in timed)
    comp, decomp = [], []
    for _ in range(repeat):
        t0 = time.perf_counter()
        for x in timed:
            enc(x)
        t1 = time.perf_counter()
        for p, o in zip(t_payloads, t_outs, strict=True):
            dec(p, o)
        t2 = time.perf_counter()
        comp.append(tbytes / (t1 - t0) / 1e9)
        decomp.append(tbytes / (t2 - t1) / 1e9)
    return {
        "ratio": ratio,
        "comp_best": max(comp),
        "comp_median": statistics.median(comp),
        "dec_best": max(decomp),
        "dec_median": statistics.median(decomp),
        "bytes_per_item": items[0].nbytes,
        "items": len(items),
    }


def _spin(seconds: float) -> int:
    n, end = 0, time.perf_counter() + seconds
    while time.perf_counter() < end:
        n += 1
    return n


def gil_check(make: Callable[[int], tuple[Encode, Decode]], ds: DataSet, repeat: int) -> dict[str, float]:
    """Two signs of a released GIL, per direction: the speed-up of two threads (own codec objects, half the
    blocks each) over one thread doing both halves; and how much pure-Python work the main thread gets done
    while a second thread loops the call (1.0: as much as alone; well below 1: the call holds the GIL)."""
    items = _min_reps(ds.whole_blocks, 16 << 20)
    halves = [items[0::2], items[1::2]]
    codecs = [make(ds.itemsize) for _ in halves]
    payloads = [[c[0](x) for x in h] for c, h in zip(codecs, halves, strict=True)]
    outs = [[np.empty_like(x) for x in h] for h in halves]
    nbytes = sum(x.nbytes for x in items)

    def comp(i: int) -> None:
        enc = codecs[i][0]
        for x in halves[i]:
            enc(x)

    def decomp(i: int) -> None:
        dec = codecs[i][1]
        for p, o in zip(payloads[i], outs[i], strict=True):
            dec(p, o)

    res = {}
    alone = max(_spin(0.3) for _ in range(2))
    for what, fn in (("comp", comp), ("dec", decomp)):
        seq, par = [], []
        for _ in range(repeat):
            t0 = time.perf_counter()
            fn(0)
            fn(1)
            seq.append(time.perf_counter() - t0)
            threads = [threading.Thread(target=fn, args=(i,)) for i in range(2)]
            t0 = time.perf_counter()
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            par.append(time.perf_counter() - t0)
        res[f"{what}_gbps_1thread"] = nbytes / min(seq) / 1e9
        res[f"{what}_speedup"] = min(seq) / min(par)
        stop = threading.Event()

        def loop(fn: Callable[[int], None] = fn, stop: threading.Event = stop) -> None:
            while not stop.is_set():
                fn(0)

        worker = threading.Thread(target=loop)
        worker.start()
        progress = _spin(0.3)
        stop.set()
        worker.join()
        res[f"{what}_python_progress"] = progress / alone
    return res


def shuffle_costs(ds: DataSet, repeat: int) -> dict[str, float]:
    """GB/s of the numpy filters alone over ``ds``'s whole blocks (one thread)."""
    w, items = ds.itemsize, _min_reps(ds.whole_blocks, 8 << 20)
    nbytes = sum(x.nbytes for x in items)
    planes = [_shuffle(x, w) for x in items]
    rotated = [_rotl1(x, w) for x in items]
    outs = [np.empty_like(x) for x in items]
    jobs: dict[str, Callable[[], None]] = {
        "shuffle, strided copy (reshape(-1, w).T.copy())": lambda: [_shuffle_strided(x, w) for x in items],
        "shuffle, shifts + casts (used here)": lambda: [_shuffle(x, w) for x in items],
        "unshuffle, strided copy": lambda: [
            _unshuffle_strided(p, o, w) for p, o in zip(planes, outs, strict=True)
        ],
        "unshuffle, shifts + ors (used here)": lambda: [
            _unshuffle_into(p, o, w) for p, o in zip(planes, outs, strict=True)
        ],
        "rotate left 1 bit": lambda: [_rotl1(x, w) for x in items],
        "rotate right 1 bit, into dst": lambda: [
            _rotr1_into(r, o, w) for r, o in zip(rotated, outs, strict=True)
        ],
    }
    res = {}
    for name, job in jobs.items():
        best = math.inf
        for _ in range(repeat):
            t0 = time.perf_counter()
            job()
            best = min(best, time.perf_counter() - t0)
        res[name] = nbytes / best / 1e9
    return res


# -- main ----------------------------------------------------------------------------------------------------


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--layers", type=int, default=16, help="reference-engine layers (a whole block spans them)"
    )
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--prompt", type=int, default=96, help="new prompt tokens per turn")
    ap.add_argument("--gen", type=int, default=24, help="greedy-decoded tokens per turn")
    ap.add_argument("--outliers", type=int, default=4, help="synthetic K outlier channels per head")
    ap.add_argument("--repeat", type=int, default=7, help="timed passes per measurement")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--native-fp16", action="store_true", help="run the fp16 engine (very slow on CPU)")
    ap.add_argument("--no-gil", action="store_true", help="skip the two-thread GIL check")
    ap.add_argument("--no-save", action="store_true", help="do not write benchmarks/results/lossless.json")
    ap.add_argument("--json", type=Path, help="write the results there instead of benchmarks/results/")
    ap.add_argument("--quick", action="store_true", help="8 layers, 2 short turns, 3 repeats")
    args = ap.parse_args()
    if args.quick:
        args.layers, args.turns, args.prompt, args.gen, args.repeat = 8, 2, 40, 12, 3
    blosc2.set_nthreads(1)

    sets = engine_sets(args)
    nblocks = len(sets[0].whole_blocks)
    sets += synthetic_sets(args, nblocks)
    sets.append(zero_set(args))

    results: dict[str, Any] = {}
    for ds in sets:
        common.status(f"bench_lossless: {ds.name}")
        plane_bound, value_bound = entropy_bounds(ds)
        row: dict[str, Any] = {"order0_bound_per_plane": plane_bound, "order0_bound_per_value": value_bound}
        for cand, make in CANDIDATES.items():
            row[cand] = {
                "layer": measure(make, ds, ds.layer_blocks, args.repeat),
                "whole": measure(make, ds, ds.whole_blocks, args.repeat),
            }
        results[ds.name] = row
        lb, wb = ds.layer_blocks[0].nbytes, ds.whole_blocks[0].nbytes
        common.print_table(
            f"{ds.name}: {len(ds.whole_blocks)} block(s); layer block {lb // 1024} KiB, whole block "
            f"{wb / (1 << 20):.2f} MiB; order-0 bound {plane_bound:.3f}x per byte plane, {value_bound:.3f}x per value",
            [
                "candidate",
                "ratio layer",
                "ratio whole",
                "comp GB/s layer best/med",
                "dec GB/s layer best/med",
                "comp GB/s whole best/med",
                "dec GB/s whole best/med",
            ],
            [
                [
                    cand,
                    f"{r['layer']['ratio']:.3f}",
                    f"{r['whole']['ratio']:.3f}",
                    f"{r['layer']['comp_best']:.2f} / {r['layer']['comp_median']:.2f}",
                    f"{r['layer']['dec_best']:.2f} / {r['layer']['dec_median']:.2f}",
                    f"{r['whole']['comp_best']:.2f} / {r['whole']['comp_median']:.2f}",
                    f"{r['whole']['dec_best']:.2f} / {r['whole']['dec_median']:.2f}",
                ]
                for cand in CANDIDATES
                for r in [row[cand]]
            ],
            f"single thread; GB/s of raw bytes, best / median of {args.repeat} passes; ratio = raw / encoded bytes",
        )

    summary = []
    for ds in sets:
        row = results[ds.name]
        best = {g: max(CANDIDATES, key=lambda c, g=g: row[c][g]["ratio"]) for g in ("layer", "whole")}
        summary.append(
            [
                ds.name,
                f"{row['order0_bound_per_plane']:.3f}",
                f"{row['order0_bound_per_value']:.3f}",
                f"{row['zstd-1']['whole']['ratio']:.3f}",
                f"{row['shuf+zstd-1/plane']['layer']['ratio']:.3f}",
                f"{row['b2 shuf+zstd c1']['whole']['ratio']:.3f}",
                f"{row[best['layer']]['layer']['ratio']:.3f} {best['layer']}",
                f"{row[best['whole']]['whole']['ratio']:.3f} {best['whole']}",
                f"{8 * ds.itemsize / 8:.1f}",
            ]
        )
    common.print_table(
        "lossless ratio per data set, against the order-0 bound and fp8",
        [
            "data set",
            "bound/plane",
            "bound/value",
            "zstd-1 whole",
            "shuf+zstd-1/plane layer",
            "b2 shuf+zstd c1 whole",
            "best layer",
            "best whole",
            "fp8 (lossy)",
        ],
        summary,
        "fp8: the tiers' lossy fp8 encoding stores 1 byte per value (2.0x for 16-bit values, 4.0x for float32)",
    )

    ds = sets[0]
    shuf = shuffle_costs(ds, args.repeat)
    common.print_table(
        f"numpy filters alone ({ds.name}, whole blocks, one thread)",
        ["filter", "GB/s (best)"],
        [[k, f"{v:.2f}"] for k, v in shuf.items()],
        "for scale: blosc2's shuffle runs in SIMD C inside the codec call",
    )

    gil: dict[str, Any] = {}
    if not args.no_gil:
        common.status("bench_lossless: GIL check")
        for cand in GIL_CANDIDATES:
            gil[cand] = gil_check(CANDIDATES[cand], ds, max(3, args.repeat // 2))
            if cand.startswith("b2 "):  # python-blosc2 keeps the GIL unless told otherwise
                old = blosc2.set_releasegil(True)
                try:
                    gil[f"{cand}, set_releasegil(True)"] = gil_check(
                        CANDIDATES[cand], ds, max(3, args.repeat // 2)
                    )
                finally:
                    blosc2.set_releasegil(old)
        common.print_table(
            f"GIL: two threads vs one ({ds.name}, whole blocks; {os.cpu_count()} CPUs)",
            [
                "candidate",
                "comp GB/s 1 thread",
                "comp 2-thread speed-up",
                "comp: python progress",
                "dec GB/s 1 thread",
                "dec 2-thread speed-up",
                "dec: python progress",
            ],
            [
                [
                    c,
                    f"{g['comp_gbps_1thread']:.2f}",
                    f"{g['comp_speedup']:.2f}",
                    f"{g['comp_python_progress']:.2f}",
                    f"{g['dec_gbps_1thread']:.2f}",
                    f"{g['dec_speedup']:.2f}",
                    f"{g['dec_python_progress']:.2f}",
                ]
                for c, g in gil.items()
            ],
            "speed-up ~2 on two free cores: the call runs without the GIL (unless memory-bound); python progress: "
            "the main thread's pure-Python work while another thread loops the call, relative to alone (~1: GIL "
            "released; well below 1: held)",
        )

    versions = {
        "zstandard": zstandard.__version__,
        "libzstd": ".".join(map(str, zstandard.ZSTD_VERSION)),
        "lz4": lz4.__version__,
        "blosc2": blosc2.__version__,
        "c-blosc2": blosc2.blosclib_version,
    }
    print(f"\nmachine: {common.machine()}\nlibraries: {versions}; load average at the end: {os.getloadavg()}")
    data = {"args": {k: str(v) for k, v in vars(args).items()}, "versions": versions, "data_sets": results}
    data.update(gil=gil, filters=shuf)
    if args.json is not None:
        args.json.write_text(json.dumps({"machine": common.machine(), **data}, indent=2) + "\n")
        print(f"results: {args.json}")
    elif not args.no_save:
        print(f"results: {common.write_result('lossless', data)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
