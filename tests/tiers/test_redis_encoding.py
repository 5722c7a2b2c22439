"""Encoded Redis tiers (``RedisTier(encoding="fp8" | "int8")``): restores close to the original KV in the
engine's dtype, smaller values, entries of another encoding never served, corrupt, undecodable or
unencodable blocks a miss, the codec's work off the event loop."""

from __future__ import annotations

import asyncio
import math
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio
import redis.asyncio as aioredis
import torch

import aiokv
from aiokv import CPUTier, InvalidArgumentError, Offloader
from aiokv.tiers import FaultyTier
from aiokv.tiers._base import TierSpec
from aiokv.tiers._codec import Codec, make_codec, segments_of
from aiokv.tiers._format import HEADER_SIZE, TierHealth, pack_header
from aiokv.tiers.redis import RedisTier

from . import _entries as entries

BS = 16
HEADS, DIM = 4, 32
# Relative to the largest |value| of a tensor (and of a head's block): e4m3 keeps 3 mantissa bits, int8 127
# levels.
TOLERANCE = {"fp8": 0.07, "int8": 0.01}


def _kv(num_blocks: int, dtype: torch.dtype, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    # Heads of very different magnitudes: one scale per block would crush the small ones.
    scale = torch.tensor([0.01, 1.0, 30.0, 500.0]).view(HEADS, 1)
    return [(torch.randn(num_blocks, BS, HEADS, DIM, generator=g) * scale).to(dtype) for _ in range(4)]


class Engine:
    def __init__(self, dtype: torch.dtype, num_blocks: int = 32, seed: int = 0) -> None:
        self.kv = _kv(num_blocks, dtype, seed)
        self.layout = aiokv.KVLayout(self.kv, block_size=BS, model_id="redis-encoding", tensors_per_layer=2)
        self.original = [t.clone() for t in self.kv]

    def wipe(self) -> None:
        for t in self.kv:
            t.fill_(-3.0)

    def spec(self) -> TierSpec:
        """The spec an Offloader opens its tiers with (segments included)."""
        layout = self.layout
        return TierSpec(layout.slot_bytes, layout.fingerprint, BS, "test layout", segments_of(layout))

    def codec(self, encoding: str) -> Codec:
        codec = make_codec(encoding, segments_of(self.layout), self.layout.slot_bytes)
        assert codec is not None
        return codec

    def slot(self, block: int) -> memoryview:
        """Block ``block`` as one CPU slot (the tensors back to back)."""
        layout = self.layout
        slot = bytearray(layout.slot_bytes)
        view = torch.frombuffer(slot, dtype=torch.uint8)
        for t, spec in zip(layout.tensors, layout.specs, strict=True):
            data = t.select(layout.block_dim, block).contiguous().view(torch.uint8).reshape(-1)
            view[spec.slot_offset : spec.slot_offset + data.numel()].copy_(data)
        return memoryview(slot)

    def outs(self, n: int) -> list[memoryview]:
        return entries.outs(n, self.layout.slot_bytes)


def _tensor_error(want: torch.Tensor, got: torch.Tensor) -> float:
    """The largest error of a tensor relative to its largest |value|."""
    want, got = want.float(), got.float()
    return float((want - got).abs().max() / want.abs().max())


def _per_head_error(want: torch.Tensor, got: torch.Tensor) -> float:
    """The largest error of a head's block relative to that head's largest |value|."""
    want, got = want.float(), got.float()
    amax = want.abs().amax(dim=(-3, -1), keepdim=True).clamp_min(1e-30)
    return float(((want - got).abs() / amax).max())


async def _store(off: Offloader, tokens: list[int], blocks: list[int]) -> None:
    req = off.open("store", tokens)
    assert await req.lookup() == 0
    req.step(len(blocks) * BS, (), blocks)
    await req.finish()
    await off.flush()


async def _restore(off: Offloader, tokens: list[int], blocks: list[int]) -> int:
    req = off.open("restore", tokens)
    hit = await req.lookup()
    restored = await req.load(blocks[: hit // BS])
    await req.abort()
    return int(restored)


def _tokens(n_blocks: int) -> list[int]:
    return [(7 * i + 3) % 1000 for i in range(n_blocks * BS + 1)]


@pytest_asyncio.fixture
async def client(redis_server: Any) -> AsyncIterator[aioredis.Redis]:
    """A plain redis-py client of the session's server (to look at and tamper with values)."""
    conn = aioredis.Redis.from_url(redis_server.url)
    yield conn
    await conn.aclose()


async def _get(client: aioredis.Redis, rkey: bytes) -> bytes:
    value = await client.get(rkey)
    assert isinstance(value, bytes)
    return value


async def _open(url: str, namespace: str, spec: TierSpec, **kw: Any) -> RedisTier:
    tier = RedisTier(url, namespace=namespace, **kw)
    await tier.open(spec)
    return tier


# --------------------------------------------------------------------------------------------- round trips


@pytest.mark.asyncio
@pytest.mark.parametrize("encoding", ["fp8", "int8"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
async def test_a_restore_from_an_encoded_redis_tier_is_close_in_the_engines_dtype(
    redis_server: Any, namespace: str, encoding: str, dtype: torch.dtype
) -> None:
    eng = Engine(dtype)
    tokens, blocks = _tokens(8), list(range(8))
    encoded_bytes = eng.codec(encoding).encoded_bytes
    redis = RedisTier(redis_server.url, namespace=namespace, encoding=encoding)
    async with Offloader(eng.layout, [CPUTier(capacity_bytes=1 << 20), redis]) as off:
        await _store(off, tokens, blocks)
    stats = redis.stats()
    assert (stats.encoding, stats.stored_blocks, stats.dropped) == (encoding, 8, 0)
    assert stats.stored_bytes == 8 * encoded_bytes  # the bytes sent, not the engine's
    eng.wipe()
    # A new offloader: its CPU tier is empty, the restore comes from Redis.
    redis2 = RedisTier(redis_server.url, namespace=namespace, encoding=encoding)
    async with Offloader(eng.layout, [CPUTier(capacity_bytes=1 << 20), redis2]) as off:
        assert await _restore(off, tokens, blocks) == 8 * BS
    stats = redis2.stats()
    assert (stats.read_blocks, stats.read_bytes, stats.corrupt) == (8, 8 * encoded_bytes, 0)
    for want, got in zip(eng.original, eng.kv, strict=True):
        assert got.dtype == dtype
        assert _tensor_error(want[:8], got[:8]) <= TOLERANCE[encoding]
        assert _per_head_error(want[:8], got[:8]) <= TOLERANCE[encoding]
        assert torch.all(got[8:] == -3.0)  # nothing written outside the loaded blocks


@pytest.mark.asyncio
@pytest.mark.parametrize("encoding", ["fp8", "int8"])
@pytest.mark.parametrize("max_value_bytes", [None, 4096])
async def test_a_read_is_exactly_the_codecs_decoding_also_of_split_values(
    redis_server: Any, namespace: str, encoding: str, max_value_bytes: int | None
) -> None:
    eng = Engine(torch.bfloat16)
    codec = eng.codec(encoding)
    tier = await _open(
        redis_server.url, namespace, eng.spec(), encoding=encoding, max_value_bytes=max_value_bytes
    )
    try:
        parts = tier.stats().parts_per_block
        assert parts == (1 if max_value_bytes is None else -(-(HEADER_SIZE + codec.encoded_bytes) // 4096))
        keys = entries.keys(5)
        slots = [eng.slot(b) for b in range(5)]
        assert await tier.write(keys, slots) == 5
        assert await tier.lookup(keys) == 5
        outs = eng.outs(5)
        assert await tier.read_into(keys, outs) == 5
        for slot, out in zip(slots, outs, strict=True):
            enc = bytearray(codec.encoded_bytes)
            codec.encode(slot, memoryview(enc))
            expected = bytearray(eng.layout.slot_bytes)
            codec.decode(enc, memoryview(expected))
            assert bytes(out) == bytes(expected)
        assert tier.stats().corrupt == 0
    finally:
        await tier.aclose()


@pytest.mark.asyncio
async def test_values_are_the_encoded_entry_about_half_the_bytes_of_raw(
    redis_server: Any, namespace: str, client: aioredis.Redis
) -> None:
    eng = Engine(torch.bfloat16)
    spec = eng.spec()
    codec = eng.codec("fp8")
    raw = await _open(redis_server.url, namespace, spec)
    fp8 = await _open(redis_server.url, namespace, spec, encoding="fp8")
    try:
        keys = entries.keys(2)
        slots = [eng.slot(0), eng.slot(1)]
        assert await raw.write(keys, slots) == 2
        assert await fp8.write(keys, slots) == 2
        raw_len = await client.strlen(raw.redis_key(keys[0]))
        fp8_len = await client.strlen(fp8.redis_key(keys[0]))
        assert raw_len == HEADER_SIZE + eng.layout.slot_bytes
        assert fp8_len == HEADER_SIZE + codec.encoded_bytes
        assert raw_len / fp8_len >= 1.9
        assert raw.stats().stored_bytes / fp8.stats().stored_bytes >= 1.9
        # The header names the encoded payload and the encoding's fingerprint, the key prefix too.
        value = await _get(client, fp8.redis_key(keys[0]))
        fingerprint = codec.fingerprint(eng.layout.fingerprint)
        assert value[:HEADER_SIZE] == pack_header(keys[0], fingerprint, value[HEADER_SIZE:])
        assert fp8.redis_key(keys[0]) == f"{namespace}:{fingerprint[:8].hex()}:{keys[0].hex()}".encode()
    finally:
        await raw.aclose()
        await fp8.aclose()


# ----------------------------------------------------------------------------------- foreign or corrupt


@pytest.mark.asyncio
async def test_raw_and_encoded_tiers_on_one_namespace_never_serve_each_others_entries(
    redis_server: Any, namespace: str, client: aioredis.Redis
) -> None:
    eng = Engine(torch.bfloat16)
    spec = eng.spec()
    tiers = {
        encoding: await _open(redis_server.url, namespace, spec, encoding=encoding)
        for encoding in ("raw", "fp8", "int8")
    }
    try:
        written = {}
        for n, (encoding, tier) in enumerate(tiers.items()):
            keys = entries.keys(3, tag=f"by-{encoding}")
            assert await tier.write(keys, [eng.slot(n + b) for b in range(3)]) == 3
            written[encoding] = keys
        for reader_encoding, reader in tiers.items():
            for writer_encoding, keys in written.items():
                if writer_encoding == reader_encoding:
                    continue
                assert await reader.lookup(keys) == 0
                outs = eng.outs(3)
                assert await reader.read_into(keys, outs) == 0
        # Even a value copied under the other's key is never decoded: foreign (fingerprint, length), a miss.
        fp8, raw = tiers["fp8"], tiers["raw"]
        for reader, writer in ((fp8, raw), (raw, fp8)):
            key = written[writer.encoding][0]
            await client.set(reader.redis_key(key), await _get(client, writer.redis_key(key)))
            assert await reader.read_into([key], eng.outs(1)) == 0
            assert reader.stats().corrupt == 1
            assert await client.exists(reader.redis_key(key)) == 0  # dropped
            assert await writer.read_into([key], eng.outs(1)) == 1  # the writer's own entry is intact
        for tier in tiers.values():
            assert tier.stats().health is TierHealth.UP
    finally:
        for tier in tiers.values():
            await tier.aclose()


@pytest.mark.asyncio
@pytest.mark.parametrize(
    "damage", ["flipped-payload-byte", "flipped-header-byte", "truncated", "zero-scales"]
)
async def test_a_corrupt_or_undecodable_encoded_value_is_a_miss_and_deleted(
    redis_server: Any, namespace: str, client: aioredis.Redis, damage: str
) -> None:
    eng = Engine(torch.float16)
    codec = eng.codec("int8")
    tier = await _open(redis_server.url, namespace, eng.spec(), encoding="int8")
    try:
        keys = entries.keys(3)
        assert await tier.write(keys, [eng.slot(b) for b in range(3)]) == 3
        rkey = tier.redis_key(keys[1])
        good = await _get(client, rkey)
        assert len(good) == HEADER_SIZE + codec.encoded_bytes
        if damage == "flipped-payload-byte":
            bad = bytearray(good)
            bad[HEADER_SIZE + 100] ^= 0x20
        elif damage == "flipped-header-byte":
            bad = bytearray(good)
            bad[50] ^= 1
        elif damage == "truncated":
            bad = bytearray(good[:-1])
        else:  # passes every check (header, fingerprint, key, length, checksum) but does not decode
            payload = bytes(codec.encoded_bytes)
            bad = bytearray(
                pack_header(keys[1], codec.fingerprint(eng.layout.fingerprint), payload) + payload
            )
        await client.set(rkey, bytes(bad))
        outs = eng.outs(3)
        assert await tier.read_into(keys, outs) == 1
        stats = tier.stats()
        assert (stats.corrupt, stats.read_blocks, stats.read_misses, stats.health) == (1, 1, 1, TierHealth.UP)
        assert await client.exists(rkey) == 0
        assert await tier.lookup(keys) == 1
    finally:
        await tier.aclose()


@pytest.mark.asyncio
async def test_faulty_tier_damage_hits_the_encoded_entry(redis_server: Any, namespace: str) -> None:
    # FaultyTier draws offsets in an entry of the engine's slot size; the tier folds them into its shorter,
    # encoded entry: every block is stored corrupt at rest and every read of one is a miss.
    eng = Engine(torch.bfloat16)
    inner = RedisTier(redis_server.url, namespace=namespace, encoding="fp8")
    faulty = FaultyTier(inner, corrupt_rate=1.0, seed=3)
    await faulty.open(eng.spec())
    try:
        keys = entries.keys(6)
        assert await faulty.write(keys, [eng.slot(b) for b in range(6)]) == 6
        assert faulty.stats().corrupted == 6
        assert await inner.lookup(keys) == 6  # stored ...
        for j, key in enumerate(keys):
            assert await faulty.read_into([key], eng.outs(1)) == 0  # ... but none verifies
            assert inner.stats().corrupt == j + 1
        # The hook's own offsets: inside the encoded entry as given, past its end folded into the payload.
        size = HEADER_SIZE + eng.codec("fp8").encoded_bytes
        more = entries.keys(3, tag="hook")
        stored, hurt = await inner._write_damaged(
            more, [eng.slot(b) for b in range(3)], [None, (size - 1, 0x01), (size + 5000, 0x80)]
        )
        assert (stored, hurt) == (3, 2)
        assert await inner.read_into(more, eng.outs(3)) == 1
        assert await inner.read_into(more[2:], eng.outs(1)) == 0
        assert inner.stats().corrupt == 8
    finally:
        await faulty.aclose()


# --------------------------------------------------------------------------------------- what is stored


@pytest.mark.asyncio
async def test_a_block_that_cannot_be_encoded_is_not_stored(redis_server: Any, namespace: str) -> None:
    eng = Engine(torch.float16)
    tier = await _open(redis_server.url, namespace, eng.spec(), encoding="fp8")
    try:
        keys = entries.keys(4)
        slots = [eng.slot(b) for b in range(4)]
        torch.frombuffer(slots[1], dtype=torch.float16)[5] = math.inf
        torch.frombuffer(slots[3], dtype=torch.float16)[-1] = math.nan
        assert await tier.write(keys, slots) == 2
        stats = tier.stats()
        assert (stats.stored_blocks, stats.dropped, stats.dropped_unencodable) == (2, 2, 2)
        assert stats.health is TierHealth.UP  # the server did nothing wrong
        assert await tier.lookup(keys) == 1
        assert await tier.lookup(keys[2:]) == 1
        assert await tier.read_into(keys[1:], eng.outs(3)) == 0
        # A batch of which no block can be encoded sends nothing.
        assert await tier.write([keys[1]], [slots[1]]) == 0
        assert tier.stats().dropped_unencodable == 3
    finally:
        await tier.aclose()


@pytest.mark.asyncio
async def test_encoding_and_decoding_run_off_the_event_loop(redis_server: Any, namespace: str) -> None:
    eng = Engine(torch.bfloat16)
    tier = await _open(redis_server.url, namespace, eng.spec(), encoding="int8")
    try:
        codec = tier._codec
        assert codec is not None
        threads: dict[str, set[int]] = {"encode": set(), "decode": set()}
        encode, decode = codec.encode, codec.decode

        def traced_encode(src: Any, dst: Any) -> None:
            threads["encode"].add(threading.get_ident())
            encode(src, dst)

        def traced_decode(src: Any, dst: Any) -> None:
            threads["decode"].add(threading.get_ident())
            decode(src, dst)

        codec.encode = traced_encode  # type: ignore[method-assign]
        codec.decode = traced_decode  # type: ignore[method-assign]
        keys = entries.keys(3)
        assert await tier.write(keys, [eng.slot(b) for b in range(3)]) == 3
        assert await tier.read_into(keys, eng.outs(3)) == 3
        loop_thread = threading.get_ident()
        for kind in ("encode", "decode"):
            assert threads[kind]
            assert loop_thread not in threads[kind]
    finally:
        await tier.aclose()


@pytest.mark.asyncio
@pytest.mark.parametrize("op", ["write", "read_into"])
async def test_a_cancelled_call_returns_only_after_the_codec_is_done_with_the_buffers(
    redis_server: Any, namespace: str, op: str
) -> None:
    eng = Engine(torch.bfloat16)
    tier = await _open(redis_server.url, namespace, eng.spec(), encoding="fp8")
    try:
        keys = entries.keys(2)
        slots = [eng.slot(b) for b in range(2)]
        assert await tier.write(keys, slots) == 2
        codec = tier._codec
        assert codec is not None
        started, finished = threading.Event(), threading.Event()
        slow = codec.encode if op == "write" else codec.decode

        def slowly(src: Any, dst: Any) -> None:
            started.set()
            time.sleep(0.3)
            slow(src, dst)
            finished.set()

        setattr(codec, "encode" if op == "write" else "decode", slowly)
        call = (
            tier.write(entries.keys(1, tag="new"), slots[:1])
            if op == "write"
            else tier.read_into(keys[:1], eng.outs(1))
        )
        task = asyncio.ensure_future(call)
        assert await asyncio.to_thread(started.wait, 10.0)  # cancelled while the codec's thread runs
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert finished.is_set()  # the thread was done with the caller's buffers before the call returned
    finally:
        await tier.aclose()


# -------------------------------------------------------------------------------------------- arguments


def test_a_bad_encoding_is_a_clear_error() -> None:
    for bad in ("fp4", "", "FP8", None, 8):
        with pytest.raises(InvalidArgumentError, match="encoding must be one of"):
            RedisTier("redis://127.0.0.1:1/0", encoding=bad)  # type: ignore[arg-type]


def test_the_encoding_is_read_only_and_shown() -> None:
    tier = RedisTier("redis://127.0.0.1:1/0", encoding="int8")
    assert tier.encoding == "int8"
    assert "encoding='int8'" in repr(tier)
    assert RedisTier("redis://127.0.0.1:1/0").encoding == "raw"
    with pytest.raises(AttributeError):
        tier.encoding = "fp8"  # type: ignore[misc]


@pytest.mark.asyncio
@pytest.mark.parametrize("encoding", ["fp8", "int8"])
async def test_an_encoding_without_the_layouts_shapes_is_refused_at_open(
    redis_server: Any, namespace: str, encoding: str
) -> None:
    tier = RedisTier(redis_server.url, namespace=namespace, encoding=encoding)
    with pytest.raises(InvalidArgumentError, match="needs the layout's tensor shapes"):
        await tier.open(TierSpec(4096, entries.FP, BS, "hand-made"))  # segments=()
    await tier.aclose()
    # raw needs no shapes
    raw = await _open(redis_server.url, namespace, TierSpec(4096, entries.FP, BS, "hand-made"))
    assert raw.stats().encoding == "raw"
    await raw.aclose()


# ------------------------------------------------------------------------ decoding overlaps the next transfer


def _left_over_tasks() -> set[asyncio.Task[Any]]:
    return {t for t in asyncio.all_tasks() if t is not asyncio.current_task() and not t.done()}


@pytest.mark.asyncio
async def test_a_read_of_many_round_trips_prefetches_and_stops_at_a_miss(
    redis_server: Any, namespace: str, client: aioredis.Redis
) -> None:
    """Two blocks per round trip: while a chunk decodes, the next one is fetched. Every block comes back as
    the codec decodes it; a read that stops at a missing block returns no more than the blocks before it
    and leaves no prefetch running."""
    eng = Engine(torch.bfloat16)
    codec = eng.codec("fp8")
    tier = await _open(
        redis_server.url,
        namespace,
        eng.spec(),
        encoding="fp8",
        max_batch_bytes=2 * (HEADER_SIZE + codec.encoded_bytes),
    )
    try:
        keys = entries.keys(7)
        slots = [eng.slot(b % 8) for b in range(7)]
        assert await tier.write(keys, slots) == 7
        outs = eng.outs(7)
        assert await tier.read_into(keys, outs) == 7
        for slot, out in zip(slots, outs, strict=True):
            enc = bytearray(codec.encoded_bytes)
            codec.encode(slot, memoryview(enc))
            expected = bytearray(eng.layout.slot_bytes)
            codec.decode(enc, memoryview(expected))
            assert bytes(out) == bytes(expected)
        for rkey in tier.redis_keys(keys[3]):
            await client.delete(rkey)
        assert await tier.read_into(keys, eng.outs(7)) == 3  # chunk [2, 3]: block 3 missing
        assert not _left_over_tasks()
        stats = tier.stats()
        assert (stats.corrupt, stats.errors, stats.read_misses) == (0, 0, 1)
    finally:
        await tier.aclose()


@pytest.mark.asyncio
async def test_a_read_cancelled_while_decoding_with_a_prefetch_in_flight_leaves_nothing_running(
    redis_server: Any, namespace: str
) -> None:
    eng = Engine(torch.bfloat16)
    codec_bytes = eng.codec("fp8").encoded_bytes
    tier = await _open(
        redis_server.url, namespace, eng.spec(), encoding="fp8", max_batch_bytes=HEADER_SIZE + codec_bytes
    )
    try:
        keys = entries.keys(4)
        assert await tier.write(keys, [eng.slot(b) for b in range(4)]) == 4
        codec = tier._codec
        assert codec is not None
        started, release, finished = threading.Event(), threading.Event(), threading.Event()
        decode = codec.decode

        def held(src: Any, dst: Any) -> None:
            started.set()
            release.wait(10.0)
            decode(src, dst)
            finished.set()

        codec.decode = held
        task = asyncio.ensure_future(tier.read_into(keys, eng.outs(4)))
        assert await asyncio.to_thread(started.wait, 10.0)  # the first block decodes; the second is fetched
        task.cancel()
        release.set()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert finished.is_set()
        assert not _left_over_tasks()
    finally:
        await tier.aclose()
