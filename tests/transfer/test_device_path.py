"""The device data path: ordering captured at the call, device-side load completion, bounded staging,
coalescing, failures that leave nothing untracked. Runs on the simulated device everywhere and on CUDA when
one is present (the same test bodies; see ``_device.Harness``)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import aiokv
from aiokv import CPUTier, DeviceError, KVLayout, Offloader, RequestState

from ..core._device import Harness, harness_params

pytestmark = pytest.mark.asyncio

BS = 4


@pytest.fixture(params=harness_params())
def h(request: pytest.FixtureRequest) -> Iterator[Harness]:
    harness = Harness(request.param)
    yield harness
    harness.close()


def _offloader(h: Harness, layout: KVLayout, slots: int = 32, **kwargs: Any) -> Any:
    return h.offloader(layout, slots, **kwargs)


def _slot_values(off: Offloader, prompt: list[int], index: int) -> torch.Tensor:
    key = aiokv.block_hashes(prompt, BS, root=off.layout.root)[index]
    return off.cpu.slot_tensor(off.cpu.index.slot(key)).view(torch.float32)


async def _cache(h: Harness, off: Offloader, kv: list[torch.Tensor], prompt: list[int], value: float) -> None:
    """Serve ``prompt`` once with every block's KV equal to ``value`` (blocks 0.. of the engine)."""
    n = len(prompt) // BS + 1
    req = off.open(f"seed-{value}", prompt)
    await req.lookup()
    h.fill(kv, list(range(n)), value)
    req.step(len(prompt), new_token_ids=[1], new_block_ids=list(range(n)))
    await req.finish()


async def test_a_store_reads_the_kv_queued_before_its_step(h: Harness) -> None:
    """The forward that writes the KV is still queued on the compute stream when step() is called (the
    engine schedules asynchronously): the store waits for exactly that point, on the device."""
    kv = h.tensors(16, BS)
    async with _offloader(h, KVLayout(kv, block_size=BS)) as off:
        prompt = list(range(2 * BS + 1))
        req = off.open("a", prompt)
        await req.lookup()
        held = h.hold(h.compute)
        h.fill(kv, [0, 1], 3.0)  # the forward, behind the hold
        req.step(len(prompt), new_token_ids=[7], new_block_ids=[0, 1, 2])
        await h.settle(off, req)  # the store is on its stream; all that could run without the forward has run
        h.release(held)
        await req.finish()
        for i in range(2):
            assert torch.all(_slot_values(off, prompt, i) == 3.0)


async def test_a_store_is_not_serialized_behind_compute_queued_after_its_step(h: Harness) -> None:
    """Stores wait for their step's point only: a later forward does not delay them (copies overlap
    compute)."""
    kv = h.tensors(16, BS)
    async with _offloader(h, KVLayout(kv, block_size=BS)) as off:
        prompt = list(range(2 * BS + 1))
        req = off.open("a", prompt)
        await req.lookup()
        h.fill(kv, [0, 1], 5.0)
        req.step(len(prompt), new_token_ids=[7], new_block_ids=[0, 1, 2])
        held = h.hold(h.compute)  # the next forward, queued after the step
        h.fill(kv, [0, 1], -1.0)
        await req.finish()  # completes although the compute stream is held
        assert torch.all(_slot_values(off, prompt, 0) == 5.0)
        h.release(held)


async def test_a_load_writes_only_after_the_blocks_previous_owner_is_done(h: Harness) -> None:
    """Kernels of the blocks' previous owner may still be queued on the compute stream when load() is
    called: the load's writes are ordered after them."""
    kv = h.tensors(16, BS)
    async with _offloader(h, KVLayout(kv, block_size=BS)) as off:
        prompt = list(range(2 * BS + 1))
        await _cache(h, off, kv, prompt, 4.0)
        req = off.open("b", prompt)
        assert await req.lookup() == 2 * BS
        held = h.hold(h.compute)
        h.fill(kv, [9, 10], -2.0)  # the previous owner's last kernel, still queued
        pending = req.load([9, 10])
        assert await pending.wait_submitted() == 2 * BS
        await h.settle(off)
        h.release(held)
        assert await pending == 2 * BS
        h.synchronize()
        assert all(torch.all(t[[9, 10]] == 4.0) for t in kv)
        await req.abort()


async def test_a_load_can_be_awaited_on_the_device(h: Harness) -> None:
    """wait_submitted() + order_before(): the engine's next kernel waits for the load on the device, with no
    host round trip; awaiting the load still resolves on the host once the KV is in place."""
    kv = h.tensors(16, BS)
    async with _offloader(h, KVLayout(kv, block_size=BS)) as off:
        prompt = list(range(2 * BS + 1))
        await _cache(h, off, kv, prompt, 6.0)
        load_stream = off.executor._dev._pipes[1].stream  # type: ignore[union-attr]
        held = h.hold(load_stream)  # the copy cannot finish before we let it
        req = off.open("b", prompt)
        assert await req.lookup() == 2 * BS
        pending = req.load([11, 12])
        assert await pending.wait_submitted() == 2 * BS
        pending.order_before()  # the offloader's compute stream
        probe = [torch.empty_like(t[[11, 12]]) for t in kv]

        def read() -> None:
            for p, t in zip(probe, kv, strict=True):
                p.copy_(t[[11, 12]])

        h.launch(h.compute, read)  # the engine's forward reading the restored KV
        await h.settle(off)
        h.release(held)
        assert await pending == 2 * BS
        h.synchronize()
        assert all(torch.all(p == 6.0) for p in probe)
        await req.abort()


async def test_order_before_needs_a_submitted_load_and_a_device() -> None:
    layout = KVLayout([torch.zeros(8, BS, 2)], block_size=BS)
    async with Offloader(layout, tiers=[CPUTier(capacity_bytes=8 * layout.slot_bytes)]) as off:
        req = off.open("a", list(range(2 * BS + 1)))
        await req.lookup()
        req.step(2 * BS + 1, new_token_ids=[1], new_block_ids=[0, 1, 2])
        await req.finish()
        req = off.open("b", list(range(2 * BS + 1)))
        await req.lookup()
        pending = req.load([3, 4])
        with pytest.raises(aiokv.InvalidArgumentError, match=r"order_before\(\) needs a device backend"):
            pending.order_before()
        assert await pending.wait_submitted() == 2 * BS
        assert await pending == 2 * BS
        await req.abort()


async def test_a_large_transfer_is_chunked_through_a_fixed_staging_area(h: Harness) -> None:
    kv = h.tensors(32, BS)
    layout = KVLayout(kv, block_size=BS)
    rows = 2
    before = h.sim.allocated_bytes if h.sim is not None else torch.cuda.memory_allocated()
    async with _offloader(h, layout, slots=32, staging_bytes=2 * rows * layout.slot_bytes) as off:
        dev = off.executor.stats().device
        assert dev is not None
        assert dev.chunk_blocks == rows
        # Each direction's rows and their index; the load side's window for layer-wise index uploads too.
        window = max(rows, rows * layout.slot_bytes // 64)
        assert dev.staging_bytes == 2 * rows * (layout.slot_bytes + 8) + window * 8
        assert dev.staging_bytes <= 2 * rows * layout.slot_bytes * 1.2
        if h.sim is not None:
            assert h.sim.allocated_bytes - before == dev.staging_bytes  # allocated once, at start
        prompt = list(range(7 * BS + 1))
        req = off.open("a", prompt)
        await req.lookup()
        blocks = [3, 17, 5, 30, 1, 22, 9, 12]
        for i, b in enumerate(blocks):
            h.fill(kv, [b], float(10 + i))
        req.step(len(prompt), new_token_ids=[1], new_block_ids=blocks)
        await req.finish()
        dev = off.executor.stats().device
        assert dev is not None
        assert dev.chunks == 4  # 7 full blocks, 2 per chunk
        if h.sim is not None:
            assert h.sim.allocated_bytes - before == dev.staging_bytes  # never grew
        # ...and the chunks carried the right blocks to the right slots, and back.
        req = off.open("b", prompt)
        assert await req.lookup() == 7 * BS
        dst = [31, 30, 29, 28, 27, 26, 25]
        assert await req.load(dst) == 7 * BS
        h.synchronize()
        for i, b in enumerate(dst):
            assert all(torch.all(t[b] == float(10 + i)) for t in kv)
        await req.abort()


async def test_stores_of_one_tick_are_one_submission(h: Harness) -> None:
    kv = h.tensors(32, BS)
    async with _offloader(h, KVLayout(kv, block_size=BS)) as off:
        reqs = []
        for i in range(4):
            r = off.open(f"r{i}", [100 * i + j for j in range(BS + 1)])
            await r.lookup()
            reqs.append(r)
        batches = off.executor.stats().batches
        held = None
        for i, r in enumerate(reqs):  # one engine step: every request completes a block
            h.fill(kv, [i], float(i))
            r.step(BS + 1, new_token_ids=[1], new_block_ids=[i, 8 + i])
            if i == 0:
                held = h.hold(h.compute)  # the later requests' KV is queued behind a hold
        await h.settle(
            off, *reqs
        )  # the one submission waits for the newest mark, which covers every earlier one
        h.release(held)
        for r in reqs:
            await r.finish()
        stats = off.executor.stats()
        assert stats.batches == batches + 1
        assert stats.device is not None
        assert stats.device.marks >= 4
        for i in range(4):
            assert torch.all(_slot_values(off, [100 * i + j for j in range(BS + 1)], 0) == float(i))


async def test_runs_of_consecutive_slots_are_one_host_copy(h: Harness) -> None:
    kv = h.tensors(32, BS)
    async with _offloader(h, KVLayout(kv, block_size=BS), slots=32) as off:
        prompt = list(range(6 * BS + 1))
        req = off.open("a", prompt)
        await req.lookup()
        h.fill(kv, [20, 3, 11, 7, 25, 14, 0], 1.0)
        req.step(len(prompt), new_token_ids=[1], new_block_ids=[20, 3, 11, 7, 25, 14, 0])
        await req.finish()
        dev = off.executor.stats().device
        assert dev is not None
        assert (dev.chunks, dev.host_copies) == (1, 1)  # fresh slots 0..5: one copy, whatever the blocks


async def test_completion_waits_do_not_spin(h: Harness, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every event the host blocks on was created blocking (a CUDA blocking-sync event sleeps)."""
    waited: list[Any] = []
    binding = h.device
    real = type(binding).synchronize

    def spy(self: Any, event: Any) -> None:
        waited.append(event)
        real(self, event)

    monkeypatch.setattr(type(binding), "synchronize", spy)
    kv = h.tensors(16, BS)
    async with _offloader(h, KVLayout(kv, block_size=BS)) as off:
        prompt = list(range(2 * BS + 1))
        await _cache(h, off, kv, prompt, 2.0)
    assert waited
    if h.sim is not None:
        assert all(ev.blocking for ev in waited)


async def test_step_during_graph_capture_is_refused_and_changes_nothing() -> None:
    h = Harness("sim")
    try:
        kv = h.tensors(16, BS)
        async with _offloader(h, KVLayout(kv, block_size=BS)) as off:
            req = off.open("a", list(range(2 * BS + 1)))
            await req.lookup()
            assert h.sim is not None
            with h.sim.capturing(h.compute):
                with pytest.raises(DeviceError, match="being captured into a graph"):
                    req.step(2 * BS + 1, new_token_ids=[1], new_block_ids=[0, 1, 2])
                req.step(BS - 1, new_block_ids=[0])  # completes no block: nothing to order, accepted
            assert (req.num_computed_tokens, req.block_ids) == (BS - 1, (0,))
            req.step(2 * BS + 1, new_token_ids=[1], new_block_ids=[1, 2])
            await req.finish()
            assert off.stats().blocks_stored == 2
    finally:
        h.close()


async def test_a_submission_failing_part_way_still_waits_for_what_it_queued() -> None:
    h = Harness("sim")
    try:
        kv = h.tensors(16, BS)
        layout = KVLayout(kv, block_size=BS)
        async with _offloader(h, layout, staging_bytes=2 * 2 * layout.slot_bytes) as off:
            sim = h.sim
            assert sim is not None
            store_stream = off.executor._dev._pipes[0].stream  # type: ignore[union-attr]
            prompt = list(range(5 * BS + 1))
            req = off.open("a", prompt)
            await req.lookup()
            store_stream.pause()
            sim.fail_next_enqueue(after=4)  # chunk 1 is queued (upload, gather, copy), chunk 2 fails
            h.fill(kv, [0, 1, 2, 3, 4], 1.0)
            req.step(len(prompt), new_token_ids=[1], new_block_ids=[0, 1, 2, 3, 4, 5])
            finishing = asyncio.ensure_future(req.finish())
            await h.settle(off)
            # The batch failed part-way, yet its completion waits on the device for chunk 1's queued copies:
            # the waiter thread is blocked on the paused stream, and the blocks are not reusable yet.
            assert await asyncio.to_thread(sim.wait_host_waiters, 1, 10.0)
            assert not finishing.done()
            assert store_stream.pending > 0
            store_stream.resume()
            await finishing
            stats = off.stats()
            assert stats.store_errors == 5
            assert stats.blocks_stored == 0
            cpu = off.cpu.stats()
            assert (cpu.pending, cpu.used_slots, cpu.pinned) == (0, 0, 0)
            off.cpu.index.check_invariants()
            # The stream survived: the next store goes through.
            req = off.open("b", prompt)
            assert await req.lookup() == 0
            req.step(len(prompt), new_token_ids=[1], new_block_ids=[0, 1, 2, 3, 4, 5])
            await req.finish()
            assert off.stats().blocks_stored == 5
    finally:
        h.close()


async def test_a_copy_failing_on_the_device_is_reported_and_nothing_hangs() -> None:
    h = Harness("sim")
    try:
        kv = h.tensors(16, BS)
        async with _offloader(h, KVLayout(kv, block_size=BS)) as off:
            assert h.sim is not None
            h.sim.fail_next("gather")  # a sticky device error: the store stream is broken for good
            prompt = list(range(2 * BS + 1))
            req = off.open("a", prompt)
            await req.lookup()
            req.step(len(prompt), new_token_ids=[1], new_block_ids=[0, 1, 2])
            await req.finish()
            assert off.stats().store_errors == 2
            req = off.open("b", prompt)
            assert await req.lookup() == 0  # nothing half-written is ever visible
            req.step(len(prompt), new_token_ids=[1], new_block_ids=[0, 1, 2])
            await req.finish()  # still resolves
            assert off.stats().store_errors == 4
    finally:
        h.close()


async def test_abort_resolves_only_after_a_queued_copy_completes(h: Harness) -> None:
    kv = h.tensors(16, BS)
    async with _offloader(h, KVLayout(kv, block_size=BS)) as off:
        prompt = list(range(2 * BS + 1))
        await _cache(h, off, kv, prompt, 8.0)
        load_stream = off.executor._dev._pipes[1].stream  # type: ignore[union-attr]
        held = h.hold(load_stream)
        req = off.open("b", prompt)
        await req.lookup()
        pending = req.load([13, 14])
        await pending.wait_submitted()
        loading = asyncio.ensure_future(_await(pending))
        aborting = asyncio.ensure_future(req.abort())
        await h.settle(off)
        if h.sim is not None:
            assert not aborting.done()
        h.release(held)
        await aborting
        assert req.state is RequestState.ABORTED
        assert loading.done()
        h.synchronize()
        assert all(torch.all(t[[13, 14]] == 8.0) for t in kv)  # the copy completed before abort resolved


async def _await(aw: Any) -> Any:
    return await aw


async def test_a_device_layout_needs_pinned_host_memory() -> None:
    h = Harness("sim")
    try:
        layout = KVLayout(h.tensors(8, BS), block_size=BS)
        with pytest.raises(aiokv.InvalidArgumentError, match=r"pinned=False cannot serve a sim layout"):
            Offloader(layout, [CPUTier(capacity_bytes=8 * layout.slot_bytes, pinned=False)], device=h.device)
        cpu = CPUTier(capacity_bytes=8 * layout.slot_bytes)
        async with Offloader(layout, [cpu], device=h.device) as off:
            assert off.cpu.stats().pinned_memory
            assert h.sim is not None
            assert h.sim.is_pinned(off.cpu.buffer)
            buffer = off.cpu.buffer
        assert not h.sim.is_pinned(buffer)  # released with the tier
        assert not off.cpu.stats().pinned_memory
    finally:
        h.close()
    layout = KVLayout([torch.zeros(8, BS, 2)], block_size=BS)
    with pytest.raises(aiokv.InvalidArgumentError, match=r"pinned=True needs a device layout"):
        Offloader(layout, [CPUTier(capacity_bytes=8 * layout.slot_bytes, pinned=True)])
    off = Offloader(layout, [CPUTier(capacity_bytes=8 * layout.slot_bytes)])
    assert not off.cpu.stats().pinned_memory  # a cpu layout is never pinned, and says so
    await off.aclose()


async def test_staging_must_hold_a_block_per_direction() -> None:
    h = Harness("sim")
    try:
        layout = KVLayout(h.tensors(8, BS), block_size=BS)
        off = Offloader(
            layout,
            [CPUTier(capacity_bytes=8 * layout.slot_bytes)],
            device=h.device,
            staging_bytes=layout.slot_bytes,
        )
        with pytest.raises(
            aiokv.InvalidArgumentError, match=r"staging_bytes must hold at least one block per"
        ):
            await off.start()
        await off.aclose()
    finally:
        h.close()


async def test_device_kind_must_match_the_layout() -> None:
    h = Harness("sim")
    try:
        with pytest.raises(aiokv.InvalidTypeError, match=r"device must be an aiokv device binding"):
            Offloader(
                KVLayout([torch.zeros(8, BS, 2)], block_size=BS),
                [CPUTier(capacity_bytes=1 << 20)],
                device="sim",
            )  # type: ignore[arg-type]
    finally:
        h.close()


async def test_a_failed_load_submission_reports_through_both_awaitables(h: Harness) -> None:
    kv = h.tensors(16, BS)
    async with _offloader(h, KVLayout(kv, block_size=BS)) as off:
        prompt = list(range(2 * BS + 1))
        await _cache(h, off, kv, prompt, 1.0)
        req = off.open("b", prompt)
        await req.lookup()
        await off.executor.aclose()  # the executor is gone under the request
        pending = req.load([3, 4])
        with pytest.raises(aiokv.ClosedError):
            await pending.wait_submitted()
        with pytest.raises(aiokv.ClosedError):
            await pending
        await req.abort()
