"""Layer-wise loads (issue 23): per-layer completion on the host and, on a device, per-layer events the
compute stream waits on; layers copied and completed in layer order; blocks guarded until every layer copy is
done; a failed layer fails the whole load (a miss, never partial KV).

The device tests hold aiokv's load stream until the engine's per-layer readers are enqueued on the compute
stream, so a reader that is not ordered after its layer's copy runs first and reads stale bytes,
deterministically. Planted mutations (a dropped layer wait, layers copied out of order) must be caught.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import random
import threading
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from typing import Any

import pytest
import torch

import aiokv
from aiokv import CPUTier, InvalidArgumentError, InvalidTypeError, KVLayout, Offloader, RequestStateError
from aiokv.transfer import TransferExecutor

from ..core._device import Harness, harness_params

BS = 4
LAYERS = 3
GATE_TIMEOUT_S = 30.0


def _pairs(num_blocks: int, layers: int = LAYERS, width: int = 8) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(torch.zeros(num_blocks, BS, width), torch.zeros(num_blocks, BS, width)) for _ in range(layers)]


def _value(req: int, layer: int, block: int, side: int) -> float:
    return float(1000 * (req + 1) + 100 * side + 10 * layer + block)


def _fill(kv: Sequence[tuple[torch.Tensor, torch.Tensor]], req: int, blocks: Sequence[int]) -> None:
    for layer, pair in enumerate(kv):
        for side, t in enumerate(pair):
            for j, b in enumerate(blocks):
                t[b] = _value(req, layer, j, side)


def _layer_ok(
    kv: Sequence[tuple[torch.Tensor, torch.Tensor]], req: int, layer: int, blocks: Sequence[int]
) -> bool:
    return all(
        bool(torch.all(t[b] == _value(req, layer, j, side)))
        for side, t in enumerate(kv[layer])
        for j, b in enumerate(blocks)
    )


def _clear(kv: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
    for pair in kv:
        for t in pair:
            t.zero_()


# ---------------------------------------------------------------------------------------------- the layout


def test_layers_follow_the_tensors_the_layout_was_built_from() -> None:
    pairs = _pairs(4)
    assert KVLayout(pairs, block_size=BS).layers == (range(0, 2), range(2, 4), range(4, 6))
    flat = [t for p in pairs for t in p]
    assert KVLayout(flat, block_size=BS).layers == tuple(range(i, i + 1) for i in range(6))
    named = {f"layer.{i}": torch.zeros(2, 4, BS, 8) for i in range(3)}  # vLLM's {name: (2, blocks, ...)}
    assert KVLayout(named, block_size=BS, block_dim=1).num_layers == 3
    assert KVLayout(torch.zeros(4, BS, 8), block_size=BS).num_layers == 1


def test_tensors_per_layer_groups_a_flat_list_into_the_models_layers() -> None:
    flat = [t for p in _pairs(4) for t in p]  # the guide's [k0, v0, k1, v1, k2, v2]
    grouped = KVLayout(flat, block_size=BS, tensors_per_layer=2)
    paired = KVLayout(_pairs(4), block_size=BS)
    assert grouped.layers == paired.layers == (range(0, 2), range(2, 4), range(4, 6))
    assert [grouped.layer_span(i) for i in range(3)] == [paired.layer_span(i) for i in range(3)]
    # Only the layers change: the same keys and slots as the flat layout.
    plain = KVLayout(flat, block_size=BS)
    assert (grouped.fingerprint, grouped.slot_bytes) == (plain.fingerprint, plain.slot_bytes)
    assert KVLayout(flat, block_size=BS, tensors_per_layer=1).layers == plain.layers
    assert KVLayout(flat, block_size=BS, tensors_per_layer=6).num_layers == 1


@pytest.mark.parametrize("bad", [0, -2, True, 2.0, "2"])
def test_a_bad_tensors_per_layer_is_a_clear_error(bad: object) -> None:
    flat = [t for p in _pairs(4) for t in p]
    with pytest.raises(InvalidArgumentError, match="tensors_per_layer must be a positive int or None"):
        KVLayout(flat, block_size=BS, tensors_per_layer=bad)  # type: ignore[arg-type]


def test_tensors_per_layer_must_divide_a_flat_list() -> None:
    flat = [t for p in _pairs(4) for t in p]
    with pytest.raises(InvalidArgumentError, match="tensors_per_layer=4 for 6 tensors"):
        KVLayout(flat, block_size=BS, tensors_per_layer=4)
    with pytest.raises(InvalidArgumentError, match="already grouped by layer"):
        KVLayout(_pairs(4), block_size=BS, tensors_per_layer=2)


def test_a_layers_span_and_segments_cover_its_tensors_in_the_slot() -> None:
    layout = KVLayout([torch.zeros(2, 4, BS, 8), torch.zeros(2, 4, BS, 8)], block_size=BS, block_dim=1)
    layout2 = KVLayout(_pairs(4), block_size=BS)
    for lay in (layout, layout2):
        spans = [lay.layer_span(i) for i in range(lay.num_layers)]
        assert spans[0][0] == 0
        assert spans[-1][1] == lay.slot_bytes
        assert all(a[1] == b[0] for a, b in itertools.pairwise(spans))
        segs = [lay.layer_segments(i) for i in range(lay.num_layers)]
        assert segs[0][0] == 0
        assert all(a[1] == b[0] for a, b in itertools.pairwise(segs))
        assert segs[-1][1] == len(lay._segments()[0])
    # vLLM's (2, num_blocks, ...) per layer: a block is two segments (K and V) of each layer's tensor.
    assert [layout.layer_segments(i) for i in range(2)] == [(0, 2), (2, 4)]


# ---------------------------------------------------------------------------------------------- executor, CPU


class LayerGate:
    """Holds the copy of every layer >= ``first`` on the load thread until opened; records the order copies
    ran in."""

    def __init__(self, first: int) -> None:
        self.first = first
        self.event = threading.Event()
        self.ran: list[int | None] = []

    def wrap(self, real: Callable[..., None]) -> Callable[..., None]:
        def copy(
            ex: TransferExecutor, slots: Sequence[int], blocks: Sequence[int], layer: int | None = None
        ) -> None:
            if layer is not None and layer >= self.first:
                assert self.event.wait(GATE_TIMEOUT_S), "gate never opened"
            self.ran.append(layer)
            if layer is None:
                real(ex, slots, blocks)
            else:
                real(ex, slots, blocks, layer)

        return copy


@pytest.fixture
def gate(monkeypatch: pytest.MonkeyPatch) -> Iterator[LayerGate]:
    g = LayerGate(first=1)
    monkeypatch.setattr(TransferExecutor, "_copy_load", g.wrap(TransferExecutor._copy_load))
    yield g
    g.event.set()


async def _executor(kv: Any) -> tuple[TransferExecutor, KVLayout, torch.Tensor]:
    layout = KVLayout(kv, block_size=BS)
    host = torch.zeros(8 * layout.slot_bytes, dtype=torch.uint8)
    return TransferExecutor(layout, host, asyncio.get_running_loop(), copy_threads=1), layout, host


def _host_slots(layout: KVLayout, host: torch.Tensor, slots: Sequence[int], req: int) -> None:
    """Write, into host slots, the bytes of blocks whose KV is :func:`_value` of ``req``."""
    kv = _pairs(len(slots))
    _fill(kv, req, list(range(len(slots))))
    src = KVLayout(kv, block_size=BS)
    flat = host.view(-1, layout.slot_bytes)
    for j, s in enumerate(slots):
        row = torch.cat([t[j].reshape(-1).view(torch.uint8) for t in src.tensors])
        flat[s] = row


@pytest.mark.asyncio
async def test_each_layer_completes_on_its_own_before_the_later_layers_are_copied(gate: LayerGate) -> None:
    kv = _pairs(8)
    ex, layout, host = await _executor(kv)
    try:
        _host_slots(layout, host, [2, 3], req=0)
        lt = ex.submit_load_layers([2, 3], [5, 6])
        assert len(lt.layers) == LAYERS
        assert [tf.layer for tf in lt.layers] == [0, 1, 2]
        assert lt.nbytes == 2 * layout.slot_bytes
        await lt.layers[0]  # the copy of layer 1 is held: layer 0 completes without it
        assert _layer_ok(kv, 0, 0, [5, 6])
        assert not lt.layers[1].done()
        assert not lt.done()
        assert bool(torch.all(kv[1][0][5] == 0))  # not copied yet
        gate.event.set()
        await lt
        assert all(_layer_ok(kv, 0, layer, [5, 6]) for layer in range(LAYERS))
        assert gate.ran == [0, 1, 2]
        assert ex.stats().in_flight == 0
        assert ex.stats().in_flight_bytes == 0
    finally:
        gate.event.set()
        await ex.aclose()


@pytest.mark.asyncio
async def test_layers_of_several_loads_in_one_tick_are_copied_layer_by_layer() -> None:
    kv = _pairs(8)
    ex, layout, host = await _executor(kv)
    order: list[tuple[int, int | None]] = []
    try:
        _host_slots(layout, host, [0, 1], req=0)
        a = ex.submit_load_layers([0], [1])
        whole = ex.submit_load([1], [7])
        b = ex.submit_load_layers([1], [2])
        for name, lt in ((0, a), (1, b)):
            for tf in lt.layers:
                tf.add_done_callback(lambda tf, name=name: order.append((name, tf.layer)))
        whole.add_done_callback(lambda tf: order.append((2, None)))
        await asyncio.gather(a, b, whole)
        # The whole load first, then every request's layer 0, then layer 1, ...
        assert order == [(2, None), (0, 0), (1, 0), (0, 1), (1, 1), (0, 2), (1, 2)]
    finally:
        await ex.aclose()


@pytest.mark.asyncio
async def test_a_failed_layer_fails_the_whole_transfer_and_its_later_layers_are_not_copied(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Layer 1 of one load fails: its layer 2 is never copied (the load is a miss, its blocks are recomputed:
    a copy would only race the recompute), while another load queued behind it copies every layer."""
    real = TransferExecutor._copy_load
    copied: list[tuple[list[int], int | None]] = []

    def copy(
        ex: TransferExecutor, slots: Sequence[int], blocks: Sequence[int], layer: int | None = None
    ) -> None:
        if layer == 1 and 1 in blocks:
            raise RuntimeError("injected")
        copied.append((sorted(blocks), layer))
        real(ex, slots, blocks) if layer is None else real(ex, slots, blocks, layer)

    monkeypatch.setattr(TransferExecutor, "_copy_load", copy)
    kv = _pairs(8)
    ex, layout, host = await _executor(kv)
    try:
        _host_slots(layout, host, [0, 1], req=0)
        lt = ex.submit_load_layers([0], [1])
        await lt.layers[0]
        other = ex.submit_load_layers([1], [5])  # queued behind lt's layers: its own copies, every layer
        with pytest.raises(aiokv.TransferError, match="injected"):
            await lt
        await other
        assert lt.layers[0].exception() is None
        assert isinstance(lt.layers[1].exception(), aiokv.TransferError)
        with pytest.raises(
            aiokv.TransferError, match="layer 2 not copied: an earlier layer of this load failed"
        ):
            lt.layers[2].result()
        assert "injected" in str(lt.exception())  # the whole load's error is the layer that failed
        assert bool(torch.all(kv[2][0][1] == 0))  # layer 2: untouched
        assert bool(torch.all(kv[2][1][1] == 0))
        assert _layer_ok(kv, 0, 0, [1])
        assert all(  # slot 1 holds the second block of _host_slots' request
            bool(torch.all(kv[layer][side][5] == _value(0, layer, 1, side)))
            for layer in range(LAYERS)
            for side in range(2)
        )
        assert copied == [([1], 0), ([5], 0), ([5], 1), ([5], 2)]
        assert ex.stats().failed == 1  # the failed layer; the skipped one is not a second failure
        assert ex.stats().in_flight == 0
        assert ex.stats().in_flight_bytes == 0
        again = ex.submit_load_layers([0], [1])  # a later load of the same blocks copies every layer again
        monkeypatch.setattr(TransferExecutor, "_copy_load", real)
        await again
        assert all(_layer_ok(kv, 0, layer, [1]) for layer in range(LAYERS))
    finally:
        await ex.aclose()


@pytest.mark.asyncio
async def test_a_grouped_layout_refuses_layerwise_loads() -> None:
    group = aiokv.KVGroup([torch.zeros(8, BS, 8)], "full")
    layout = KVLayout.from_groups([group], block_size=BS)
    assert layout.layers == ()
    host = torch.zeros(4 * layout.slot_bytes, dtype=torch.uint8)
    ex = TransferExecutor(layout, host, asyncio.get_running_loop())
    try:
        with pytest.raises(InvalidArgumentError, match="plain KVLayout"):
            ex._submit_layers([0], [0])
    finally:
        await ex.aclose()
    async with Offloader(layout, [CPUTier(capacity_bytes=8 * layout.slot_bytes)]) as off:
        req = off.open("g", list(range(2 * BS)))
        await req.lookup()
        with pytest.raises(InvalidArgumentError, match="layerwise=True needs a plain KVLayout"):
            req.load([], layerwise=True)


# ---------------------------------------------------------------------------------------------- request, CPU


async def _seed(off: Offloader, kv: Any, prompt: list[int], req: int, blocks: list[int]) -> None:
    r = off.open(f"seed-{req}", prompt)
    await r.lookup()
    _fill(kv, req, blocks)
    r.step(len(prompt), new_token_ids=[1], new_block_ids=[*blocks, max(blocks) + 1])
    await r.finish()


@pytest.mark.asyncio
async def test_request_layer_waits_on_the_cpu_backend(gate: LayerGate) -> None:
    kv = _pairs(16)
    layout = KVLayout(kv, block_size=BS)
    async with Offloader(layout, [CPUTier(capacity_bytes=16 * layout.slot_bytes)]) as off:
        prompt = list(range(2 * BS + 1))
        gate.event.set()
        await _seed(off, kv, prompt, 0, [0, 1])
        gate.event.clear()
        _clear(kv)
        req = off.open("b", prompt)
        assert await req.lookup() == 2 * BS
        pending = req.load([8, 9], layerwise=True)
        assert pending.layerwise
        assert await pending.layer(0) == 2 * BS
        assert _layer_ok(kv, 0, 0, [8, 9])
        assert not _layer_ok(kv, 0, 1, [8, 9])
        # Computing past the restored tokens is refused while a layer is still being copied.
        with pytest.raises(RequestStateError, match="until the load resolved"):
            req.step(len(prompt), new_token_ids=[5], new_block_ids=[10])
        gate.event.set()
        for layer in range(LAYERS):
            assert await pending.layer(layer) == 2 * BS
            assert _layer_ok(kv, 0, layer, [8, 9])
        # Every layer awaited: the forward may go on at once, before the load's own await.
        req.step(len(prompt), new_token_ids=[5], new_block_ids=[10])
        assert await pending == 2 * BS
        await req.finish()
        assert off.stats().load_errors == 0


@pytest.mark.asyncio
async def test_a_whole_loads_layers_resolve_with_it() -> None:
    kv = _pairs(16)
    layout = KVLayout(kv, block_size=BS)
    async with Offloader(layout, [CPUTier(capacity_bytes=16 * layout.slot_bytes)]) as off:
        prompt = list(range(2 * BS + 1))
        await _seed(off, kv, prompt, 0, [0, 1])
        req = off.open("b", prompt)
        await req.lookup()
        pending = req.load([8, 9])
        assert not pending.layerwise
        assert [await pending.layer(i) for i in range(LAYERS)] == [2 * BS] * LAYERS
        assert await pending == 2 * BS
        with pytest.raises(InvalidArgumentError, match=r"index must be in \[0, 3\)"):
            await pending.layer(3)
        with pytest.raises(InvalidTypeError, match="index must be an int"):
            await pending.layer("0")  # type: ignore[arg-type]
        with pytest.raises(InvalidArgumentError, match="needs a device backend"):
            pending.order_layer_before(0)
        await req.abort()


@pytest.mark.asyncio
async def test_bad_layerwise_argument_is_a_clear_error() -> None:
    kv = _pairs(8)
    layout = KVLayout(kv, block_size=BS)
    async with Offloader(layout, [CPUTier(capacity_bytes=8 * layout.slot_bytes)]) as off:
        req = off.open("a", list(range(2 * BS)))
        await req.lookup()
        with pytest.raises(InvalidTypeError, match="layerwise must be a bool"):
            req.load([], layerwise=1)  # type: ignore[arg-type]
        await req.abort()


@pytest.mark.asyncio
async def test_a_failed_layer_is_a_miss_and_the_request_recomputes(monkeypatch: pytest.MonkeyPatch) -> None:
    real = TransferExecutor._copy_load

    def copy(
        ex: TransferExecutor, slots: Sequence[int], blocks: Sequence[int], layer: int | None = None
    ) -> None:
        if layer == 2:
            raise RuntimeError("injected layer failure")
        real(ex, slots, blocks) if layer is None else real(ex, slots, blocks, layer)

    kv = _pairs(16)
    layout = KVLayout(kv, block_size=BS)
    async with Offloader(layout, [CPUTier(capacity_bytes=16 * layout.slot_bytes)]) as off:
        prompt = list(range(2 * BS + 1))
        await _seed(off, kv, prompt, 0, [0, 1])
        monkeypatch.setattr(TransferExecutor, "_copy_load", copy)
        req = off.open("b", prompt)
        await req.lookup()
        pending = req.load([8, 9], layerwise=True)
        assert await pending.layer(0) == 2 * BS
        assert await pending.layer(2) == 0
        assert await pending == 0  # never partial KV: the whole restore is a miss
        assert req.num_computed_tokens == 0
        assert off.stats().load_errors == 2
        _fill(kv, 0, [8, 9])  # the engine recomputes the prefix
        req.step(len(prompt), new_token_ids=[5], new_block_ids=[10])
        await req.finish()


@pytest.mark.asyncio
async def test_abort_waits_for_every_layer_copy(gate: LayerGate) -> None:
    kv = _pairs(16)
    layout = KVLayout(kv, block_size=BS)
    async with Offloader(layout, [CPUTier(capacity_bytes=16 * layout.slot_bytes)]) as off:
        prompt = list(range(2 * BS + 1))
        gate.event.set()
        await _seed(off, kv, prompt, 0, [0, 1])
        gate.event.clear()
        req = off.open("b", prompt)
        await req.lookup()
        pending = req.load([8, 9], layerwise=True)
        await pending.layer(0)
        released = req.abort()
        for _ in range(20):
            await asyncio.sleep(0)
        assert not released.done()  # layers 1 and 2 are still held on the load thread: blocks not reusable
        gate.event.set()
        await released
        assert all(_layer_ok(kv, 0, layer, [8, 9]) for layer in range(LAYERS))


# ---------------------------------------------------------------------------------------------- device


@pytest.fixture(params=harness_params())
def h(request: pytest.FixtureRequest) -> Iterator[Harness]:
    harness = Harness(request.param)
    yield harness
    harness.close()


def _device_pairs(
    h: Harness, num_blocks: int, layers: int = LAYERS
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [
        (
            torch.zeros(num_blocks, BS, 8, device=h.torch_device),
            torch.zeros(num_blocks, BS, 8, device=h.torch_device),
        )
        for _ in range(layers)
    ]


async def _device_seed(
    h: Harness, off: Offloader, kv: Any, prompt: list[int], req: int, blocks: list[int]
) -> None:
    r = off.open(f"seed-{req}", prompt)
    await r.lookup()
    h.launch(h.compute, lambda: _fill(kv, req, blocks))
    r.step(len(prompt), new_token_ids=[1], new_block_ids=[*blocks, max(blocks) + 1])
    await r.finish()


@contextlib.asynccontextmanager
async def _seeded_device(h: Harness) -> AsyncIterator[tuple[Offloader, Any, list[int]]]:
    """An offloader on ``h`` whose CPU tier holds a two-block prefix (request 0's values), its KV and prompt."""
    kv = _device_pairs(h, 16)
    layout = KVLayout(kv, block_size=BS)
    async with h.offloader(layout, slots=16) as off:
        prompt = list(range(2 * BS + 1))
        await _device_seed(h, off, kv, prompt, 0, [0, 1])
        yield off, kv, prompt


class Readers:
    """The engine's per-layer attention reads, enqueued on the compute stream: each checks, when it runs on
    the device, that its layer of its request's blocks holds the restored KV."""

    def __init__(self, h: Harness, kv: Any) -> None:
        self.h = h
        self.kv = kv
        self.stale: list[tuple[int, int]] = []
        self.ran = 0

    def enqueue(self, req: int, layer: int, blocks: list[int]) -> None:
        def read() -> None:
            self.ran += 1
            if not _layer_ok(self.kv, req, layer, blocks):
                self.stale.append((req, layer))

        self.h.launch(self.h.compute, read)


async def _forward_layerwise(
    h: Harness,
    seeds: Sequence[int],
    skip_wait: tuple[int, int] | None = None,
    layerwise: bool = True,
    jitter_seed: int | None = None,
    hold_layer: int | None = None,
    monkeypatch: pytest.MonkeyPatch | None = None,
) -> Readers:
    """Seed one cached prefix per request, then restore them all (layer-wise) into fresh blocks with aiokv's
    load stream held, enqueue every request's per-layer readers after ``order_layer_before`` (except
    ``skip_wait``: (request, layer)), and only then release the load stream.

    ``hold_layer`` (simulator): the load stream also stops right before that layer's copy, until everything
    that can run without it has run, so the readers of that layer run only if nothing orders them after it."""
    rng = random.Random(jitter_seed)
    layer_holds: list[Any] = []
    if hold_layer is not None:
        assert monkeypatch is not None
        assert h.sim is not None
        import aiokv.transfer._device as device_mod

        real_chunk = device_mod._Pipe._chunk

        def chunk(pipe: Any, pairs: Any, layer: int | None = None, *rest: Any) -> None:
            if layer == hold_layer:
                layer_holds.append(pipe.stream.hold())
            real_chunk(pipe, pairs, layer, *rest)

        monkeypatch.setattr(device_mod._Pipe, "_chunk", chunk)
    n_req = len(seeds)
    kv = _device_pairs(h, 8 * n_req + 8)
    layout = KVLayout(kv, block_size=BS)
    async with h.offloader(layout, slots=4 * n_req + 4) as off:
        prompts = []
        for r, s in enumerate(seeds):
            nblk = 1 + s % 3
            prompt = [10_000 * (r + 1) + t for t in range(nblk * BS + 1)]
            prompts.append(prompt)
            await _device_seed(h, off, kv, prompt, r, list(range(4 * r, 4 * r + nblk)))
        h.synchronize()
        h.launch(h.compute, lambda: _clear(kv))
        readers = Readers(h, kv)
        reqs, pendings, targets = [], [], []
        for r, prompt in enumerate(prompts):
            req = off.open(f"r{r}", prompt)
            hit = await req.lookup()
            nblk = hit // BS
            target = list(range(4 * n_req + 4 * r, 4 * n_req + 4 * r + nblk))
            reqs.append(req)
            targets.append(target)
        load_stream = off.executor._dev._pipes[1].stream  # type: ignore[union-attr]
        held = h.hold(load_stream)
        order = list(range(n_req))
        rng.shuffle(order)
        for r in order:
            pendings.append((r, reqs[r].load(targets[r], layerwise=layerwise)))
        for _r, p in pendings:
            await p.wait_submitted()
        # The engine's forward: layer by layer, every request of the batch.
        for layer in range(LAYERS):
            for r, p in sorted(pendings):
                if skip_wait != (r, layer):
                    p.order_layer_before(layer)
                readers.enqueue(r, layer, targets[r])
        await h.settle(off)
        h.release(held)
        if hold_layer is not None:
            await h.settle(off)  # the layers before hold_layer copied, the readers not behind a wait ran
            for token in layer_holds:
                h.release(token)
        for r, p in pendings:
            assert await p == len(targets[r]) * BS
        h.synchronize()
        assert readers.ran == n_req * LAYERS
        for req in reqs:
            await req.abort()
    return readers


@pytest.mark.asyncio
async def test_each_layers_attention_waits_for_exactly_its_layer_on_the_device(h: Harness) -> None:
    readers = await _forward_layerwise(h, seeds=[0, 1, 2])
    assert readers.stale == []


@pytest.mark.asyncio
@pytest.mark.parametrize("seed", range(6))
async def test_seeded_schedules_of_layerwise_and_whole_loads_never_read_stale_kv(seed: int) -> None:
    h = Harness("sim", seed=seed, jitter_s=0.0003)
    try:
        rng = random.Random(seed)
        seeds = [rng.randrange(100) for _ in range(rng.randrange(1, 5))]
        readers = await _forward_layerwise(h, seeds, layerwise=bool(seed % 2 == 0), jitter_seed=seed)
        assert readers.stale == []
    finally:
        h.close()


@pytest.mark.asyncio
@pytest.mark.parametrize("layer", range(LAYERS))
async def test_with_a_layer_held_its_readers_wait_for_it(layer: int, monkeypatch: pytest.MonkeyPatch) -> None:
    h = Harness("sim")
    try:
        readers = await _forward_layerwise(h, seeds=[0, 1, 5], hold_layer=layer, monkeypatch=monkeypatch)
        assert readers.stale == []
    finally:
        h.close()


@pytest.mark.asyncio
async def test_mutation_a_dropped_layer_wait_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Planted bug: the forward skips layer 1's wait (before the first of its requests' reads; a later wait on
    the same stream would order the rest). With layer 1's copy held, that reader runs before it: stale."""
    h = Harness("sim")
    try:
        readers = await _forward_layerwise(
            h, seeds=[0, 1], skip_wait=(0, 1), hold_layer=1, monkeypatch=monkeypatch
        )
        assert readers.stale == [(0, 1)]
    finally:
        h.close()


@pytest.mark.asyncio
async def test_mutation_layers_copied_out_of_order_are_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Planted bug: the device pipe enqueues a batch's layers in reverse. The host sees the layers complete
    out of order, which the completion-order check catches."""
    import aiokv.transfer._device as device_mod

    real = device_mod.split_layers
    monkeypatch.setattr(device_mod, "split_layers", lambda jobs: real(jobs)[::-1])
    h = Harness("sim")
    try:
        with pytest.raises(AssertionError, match="layers completed in order"):
            await _completion_order(h)
    finally:
        h.close()


async def _completion_order(h: Harness) -> None:
    async with _seeded_device(h) as (off, _kv, prompt):
        req = off.open("b", prompt)
        await req.lookup()
        order: list[int] = []
        load_stream = off.executor._dev._pipes[1].stream  # type: ignore[union-attr]
        held = h.hold(load_stream)  # nothing completes before the callbacks are in place
        pending = req.load([8, 9], layerwise=True)
        await pending.wait_submitted()
        tf = pending._ticket.result()
        for part in tf.layers:
            assert not part.done()
            part.add_done_callback(lambda t: order.append(t.layer))
        h.release(held)
        assert await pending == 2 * BS
        assert order == sorted(order), f"layers completed in order: got {order}"
        await req.abort()


@pytest.mark.asyncio
async def test_device_layers_complete_in_layer_order(h: Harness) -> None:
    await _completion_order(h)


@pytest.mark.asyncio
async def test_a_failed_device_layer_copy_is_a_miss() -> None:
    h = Harness("sim")
    try:
        async with _seeded_device(h) as (off, _kv, prompt):
            req = off.open("b", prompt)
            await req.lookup()
            assert h.sim is not None
            h.sim.fail_next("scatter", after=1)  # layer 1's scatter fails on the device
            pending = req.load([8, 9], layerwise=True)
            await pending.wait_submitted()
            assert await pending == 0
            assert await pending.layer(1) == 0
            assert req.num_computed_tokens == 0
            assert off.stats().load_errors == 2
            await req.abort()
    finally:
        h.close()


@pytest.mark.asyncio
async def test_a_layer_can_be_ordered_after_as_soon_as_it_is_submitted(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The submitter is held before layer 1's copy is queued: layer 0 is already submitted (and announced to
    the loop), so the forward can order its first layer; ordering layer 1 is refused until it is queued."""
    import aiokv.transfer._device as device_mod

    real_chunk = device_mod._Pipe._chunk
    gate = threading.Event()
    reached = threading.Event()

    def chunk(pipe: Any, pairs: Any, layer: int | None = None, *rest: Any) -> None:
        if layer == 1:
            reached.set()
            assert gate.wait(GATE_TIMEOUT_S), "gate never opened"
        real_chunk(pipe, pairs, layer, *rest)

    h = Harness("sim")
    try:
        async with _seeded_device(h) as (off, _kv, prompt):
            monkeypatch.setattr(device_mod._Pipe, "_chunk", chunk)
            req = off.open("b", prompt)
            await req.lookup()
            pending = req.load([8, 9], layerwise=True)
            assert await pending.wait_submitted(layer=0) == 2 * BS
            pending.order_layer_before(0)
            assert await asyncio.to_thread(reached.wait, GATE_TIMEOUT_S)
            with pytest.raises(RequestStateError, match="submitted first"):
                pending.order_layer_before(1)
            gate.set()
            assert await pending.wait_submitted(layer=1) == 2 * BS
            pending.order_layer_before(1)
            assert await pending.wait_submitted() == 2 * BS
            assert await pending == 2 * BS
            with pytest.raises(InvalidArgumentError, match="index must be in"):
                await pending.wait_submitted(layer=LAYERS)
            await req.abort()
    finally:
        gate.set()
        h.close()


@pytest.mark.parametrize("strided", [True, False], ids=["simulator", "row-by-row default"])
def test_copy_rows_copies_a_layer_of_consecutive_slots(strided: bool) -> None:
    """The layer-wise device path's host copy: rows of a 2-d view whose rows are not adjacent (a layer's
    bytes of consecutive slots), as one strided copy on the simulator and one copy per row by default."""
    from aiokv.transfer._binding import DeviceBinding

    sim = aiokv.transfer.SimulatedDevice()
    try:
        stream = sim.new_stream("s")
        host = torch.arange(4 * 64, dtype=torch.int64).to(torch.uint8)
        sim.pin(host)
        dev = sim.alloc(4 * 64)
        src = host.view(4, 64)[1:3, 16:48]
        dst = dev.view(4, 64)[0:2, 16:48]
        copy = sim.copy_rows if strided else (lambda *a: DeviceBinding.copy_rows(sim, *a))
        dev.zero_()
        copy(stream, dst, src)
        sim.synchronize_stream(stream)
        assert torch.equal(dst, src)
        assert not torch.any(dev.view(4, 64)[0:2, :16])
        assert not torch.any(dev.view(4, 64)[2:])
        with pytest.raises(InvalidArgumentError, match="copy_rows needs two 2-d tensors"):
            copy(stream, dst, src[:1])
        unpinned = torch.zeros(4, 64, dtype=torch.uint8)
        with pytest.raises(InvalidArgumentError, match="must be pinned"):
            copy(stream, dst, unpinned[1:3, 16:48])
    finally:
        sim.close()
