"""The native scatter/gather copy kernel: both paths (plain memcpy, streaming + interleaved) are exact, and it
takes buffers plus offsets, never addresses: every segment is checked against its buffer before any byte moves."""

from __future__ import annotations

import os
import threading
from typing import Any

import numpy as np
import pytest
import torch

from aiokv import KVLayout
from aiokv.transfer import _cpu as cpu_mod
from aiokv.transfer._cpu import (
    HAVE_NATIVE,
    CopyPlanner,
    CopyPool,
    GroupTuner,
    Segments,
    copy_segments,
    tensor_bytes,
)

if HAVE_NATIVE:
    from aiokv._native._copy import CopyJob


def seg(buf: Any, offs: Any) -> Segments:
    """One side of a copy: segments at byte offsets ``offs`` of ``buf``."""
    return Segments((buf,), np.asarray(offs, dtype=np.int64))


def make_job(dst: Segments, src: Segments, lens: Any, *args: Any, **kwargs: Any) -> Any:
    """A native CopyJob over two sides."""
    return CopyJob(
        dst.buffers, dst.index, dst.offsets, src.buffers, src.index, src.offsets, lens, *args, **kwargs
    )


def _segments(rng: np.random.Generator, total: int, max_len: int) -> tuple[np.ndarray, np.ndarray]:
    """About ``total`` bytes of segments of 1..max_len bytes: lengths and their offsets in a packed source."""
    lens = rng.integers(1, max_len, size=total // (max_len // 2) + 1).astype(np.int64)
    return lens, np.cumsum(lens) - lens


@pytest.mark.parametrize(("total", "max_len"), [(64 << 10, 700), (6 << 20, 20000), (6 << 20, 70)])
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("group", [1, 6, 16])
def test_scattered_segments_copy_exactly(total: int, max_len: int, seed: int, group: int) -> None:
    """Random lengths (odd, tiny, not multiples of 16) at random, unaligned offsets, in random order; some
    segments adjacent on both sides so they merge. Batches over 4 MiB take the streaming path."""
    rng = np.random.default_rng(seed)
    lens, offs = _segments(rng, total, max_len)
    n = len(lens)
    src = rng.integers(0, 256, size=int(lens.sum()) + 64, dtype=np.uint8)
    dst = np.zeros(int(lens.sum()) * 2 + 4096, dtype=np.uint8)
    # Destination: a random permutation of the segments, each at an unaligned gap; keep runs of neighbours
    # adjacent on both sides for a few of them (exercises run merging).
    order = rng.permutation(n)
    dst_offs = np.empty(n, np.int64)
    pos = 3
    for k, idx in enumerate(order):
        if k and order[k - 1] == idx - 1 and rng.random() < 0.5:
            dst_offs[idx] = dst_offs[idx - 1] + lens[idx - 1]
            pos = max(pos, int(dst_offs[idx] + lens[idx]))
            continue
        pos += int(rng.integers(0, 3))
        dst_offs[idx] = pos
        pos += int(lens[idx])
    assert pos <= len(dst)
    copy_segments(
        seg(dst, dst_offs[order]),
        seg(src, (1 + offs)[order]),  # unaligned
        lens[order].astype(np.int64),
        group,
    )
    expect = np.zeros_like(dst)
    for i in range(n):
        expect[dst_offs[i] : dst_offs[i] + lens[i]] = src[1 + offs[i] : 1 + offs[i] + lens[i]]
    assert np.array_equal(dst, expect)


@pytest.mark.skipif(os.environ.get("AIOKV_NATIVE_COPY") == "0", reason="AIOKV_NATIVE_COPY=0: the Python copy")
def test_native_kernel_is_built() -> None:
    """CI builds the C kernel; the Python fallback exists for machines without a compiler (and the CI leg
    that turns every native path off)."""
    assert HAVE_NATIVE


def test_rejects_mismatched_lengths_and_bad_groups() -> None:
    buf = np.zeros(64, np.uint8)
    a = seg(buf, [0, 8])
    with pytest.raises(ValueError, match="same length"):
        copy_segments(a, a, np.zeros(3, np.int64))
    with pytest.raises(ValueError, match=r"group must be in \[1, 16\], got 17"):
        copy_segments(a, a, np.zeros(2, np.int64), 17)


@pytest.mark.parametrize("threads", [2, 3])
def test_a_copy_split_over_threads_is_exact(threads: int) -> None:
    """CopyPool cuts a large plan at segment boundaries into parts of about equal bytes, one per thread."""
    rng = np.random.default_rng(threads)
    lens, offs = _segments(rng, 8 << 20, 40000)
    src = rng.integers(0, 256, size=int(lens.sum()), dtype=np.uint8)
    dst = np.zeros_like(src)
    order = rng.permutation(len(lens))
    pool = CopyPool(threads)
    try:
        pool.copy(seg(dst, offs[order]), seg(src, offs[order]), lens[order].astype(np.int64))
    finally:
        pool.close()
    assert np.array_equal(dst, src)


def test_a_split_copy_with_a_bad_segment_copies_nothing() -> None:
    """The whole plan is validated before any thread copies a byte: a bad last segment (a helper's part under
    the old static split) fails the copy and leaves the destination untouched."""
    pool = CopyPool(2)
    try:
        n = 64
        src = np.full(n * (64 << 10), 7, np.uint8)
        dst = np.zeros_like(src)
        offs = np.arange(n, dtype=np.int64) * (64 << 10)
        lens = np.full(n, 64 << 10, np.int64)
        lens[-1] = -1
        with pytest.raises(ValueError, match=r"nbytes\[63\] must be >= 0, got -1"):
            pool.copy(seg(dst, offs), seg(src, offs), lens)
        assert not dst.any()
        lens[-1] = (64 << 10) + 1  # one byte past the end of both buffers
        with pytest.raises(ValueError, match=r"dst_offsets\[63\] = .* out of bounds of dst\[0\]"):
            pool.copy(seg(dst, offs), seg(src, offs), lens)
        assert not dst.any()
    finally:
        pool.close()


def _packed_plan(seed: int, total: int, max_len: int) -> tuple[Any, ...]:
    """Segments of random lengths in random order from ``src`` to the same offsets of ``dst``."""
    rng = np.random.default_rng(seed)
    lens, offs = _segments(rng, total, max_len)
    src = rng.integers(1, 256, size=int(lens.sum()), dtype=np.uint8)
    dst = np.zeros_like(src)
    order = rng.permutation(len(lens))
    return src, dst, seg(dst, offs[order]), seg(src, offs[order]), lens[order]


needs_native = pytest.mark.skipif(not HAVE_NATIVE, reason="the CopyJob kernel is native only")


@needs_native
@pytest.mark.parametrize("group", [1, 6])
@pytest.mark.parametrize("threads", [1, 2, 4])
def test_a_job_shared_by_threads_copies_every_part_once(group: int, threads: int) -> None:
    """Threads take parts from one counter: together they copy every byte exactly (streaming path, > 4 MiB),
    and the bytes each run() reports add up to the plan."""
    src, dst, d, s, lens = _packed_plan(threads * 10 + group, 6 << 20, 40000)
    job = make_job(d, s, lens, group, 512, 64 << 10)
    assert job.parts > threads
    assert job.nbytes == int(lens.sum())
    copied: list[int] = []
    start = threading.Barrier(threads)

    def worker() -> None:
        start.wait()
        copied.append(job.run())

    others = [threading.Thread(target=worker) for _ in range(threads - 1)]
    for t in others:
        t.start()
    worker()
    job.wait()
    for t in others:
        t.join()
    assert job.done
    assert sum(copied) == job.nbytes
    assert np.array_equal(dst, src)


@needs_native
def test_a_late_run_of_a_finished_job_copies_nothing() -> None:
    """A helper that wakes after the owner copied every part finds none left: it returns 0 and writes
    nothing (the engine may already be writing into the blocks the copy reported done)."""
    src, dst, d, s, lens = _packed_plan(3, 1 << 20, 5000)
    job = make_job(d, s, lens, 1, 512, 64 << 10)
    assert not job.done
    assert job.run() == job.nbytes
    job.wait()
    assert job.done
    assert np.array_equal(dst, src)
    dst[:] = 0  # the destination is reused after completion
    assert job.run() == 0
    job.wait()
    assert not dst.any()


@needs_native
def test_parts_are_cut_at_segment_boundaries() -> None:
    buf = np.zeros(1 << 16, np.uint8)
    at = seg(buf, np.arange(10) * 1000)
    lens = np.full(10, 300, np.int64)
    assert make_job(at, at, lens, part_bytes=1000).parts == 3  # 4 + 4 + 2 segments
    assert make_job(at, at, lens, part_bytes=1).parts == 10  # a longer segment is a part of its own
    assert make_job(at, at, lens, part_bytes=1 << 20).parts == 1
    empty = seg(buf, [])
    job = make_job(empty, empty, np.zeros(0, np.int64))
    assert job.parts == 0
    assert job.done
    assert job.run() == 0
    job.wait()
    with pytest.raises(ValueError, match="part_bytes must be >= 1, got 0"):
        make_job(at, at, lens, part_bytes=0)
    with pytest.raises(ValueError, match=r"group must be in \[1, 16\], got 0"):
        make_job(at, at, lens, 0)


@needs_native
def test_a_split_copy_does_not_wait_for_a_helper_that_has_not_started() -> None:
    """Regression: the pool's helper is busy (on a VM, a woken thread can wait milliseconds for a core); the
    caller copies every part itself and returns, instead of waiting for the helper's half of a static split."""
    pool = CopyPool(2)
    release = threading.Event()
    busy = threading.Event()

    class Blocker:
        def run(self) -> int:
            busy.set()
            release.wait()
            return 0

    try:
        pool._queues[0].put(Blocker())
        assert busy.wait(30)
        src, dst, d, s, lens = _packed_plan(5, 8 << 20, 40000)
        pool.copy(d, s, lens)
        assert np.array_equal(dst, src)
    finally:
        release.set()
        pool.close()


def test_group_tuner_follows_the_measured_cost() -> None:
    tuner = GroupTuner((1, 6), sample_bytes=1 << 20, warmup=2, window=3, explore_every=4)
    assert tuner.trial(1 << 20) is None  # too small to carry a trial
    costs = {1: 2.0, 6: 1.0}  # seconds per byte: interleaving wins on this imaginary machine

    def one_copy() -> int | None:
        best = tuner.best
        group = tuner.trial(8 << 20)
        if group is not None:  # the candidate and the best, on two prefixes of the same copy
            tuner.record(group, costs[group], costs[best])
        return group

    assert one_copy() == 6
    assert tuner.best == 1  # one ratio is not enough
    assert one_copy() == 6
    assert tuner.best == 6
    trials = [one_copy() for _ in range(8)]
    assert trials.count(1) >= 2  # the loser is still tried now and then
    assert tuner.best == 6
    costs[1] = 0.5  # conditions change: the loser becomes the winner once measured a few times
    for _ in range(24):
        one_copy()
    assert tuner.best == 1


def test_group_tuner_ignores_one_outlier() -> None:
    """Paired ratios and a median: one trial whose candidate prefix lost its core does not flip the choice,
    and neither does one where the best's prefix did."""
    tuner = GroupTuner((6, 1), sample_bytes=1 << 20, warmup=3, window=5, explore_every=1)
    for candidate_cost in (1.5, 1.4, 0.1, 1.6, 1.5):  # the third: the best's prefix was preempted
        assert tuner.trial(8 << 20) == 1
        tuner.record(1, candidate_cost, 1.0)
    assert tuner.best == 6


# ------------------------------------------------------------------------------ bounds: checked, nothing written
def _both_paths() -> list[Any]:
    return ["native", "python"] if HAVE_NATIVE else ["python"]


@pytest.fixture(params=_both_paths())
def kernel(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The C kernel, and the Python fallback (same checks, same messages) with the C kernel hidden."""
    if request.param == "python":
        monkeypatch.setattr(cpu_mod, "_native_copy", None)
        monkeypatch.setattr(cpu_mod, "_CopyJob", None)
    return str(request.param)


BAD_SEGMENTS = [
    # (dst offsets, src offsets, nbytes, message): the last segment is bad, so a kernel that copied before
    # checking would have written the first ones.
    (
        [0, 4096],
        [0, 4096],
        [4096, 4097],
        r"dst_offsets\[1\] = 4096 with nbytes\[1\] = 4097 is out of bounds of dst\[0\]",
    ),
    (
        [0, 0],
        [0, 8192],
        [4096, 1],
        r"src_offsets\[1\] = 8192 with nbytes\[1\] = 1 is out of bounds of src\[0\]",
    ),
    ([0, -1], [0, 0], [4096, 1], r"dst_offsets\[1\] = -1 "),
    ([0, 0], [0, -8], [4096, 8], r"src_offsets\[1\] = -8 "),
    ([0, 8193], [0, 0], [4096, 0], r"dst_offsets\[1\] = 8193 with nbytes\[1\] = 0 is out of bounds"),
    ([0, 2**62], [0, 0], [4096, 2**62], r"dst_offsets\[1\] = 4611686018427387904 "),  # no overflow
    ([0, 0], [0, 0], [4096, -1], r"nbytes\[1\] must be >= 0, got -1"),
]


@pytest.mark.parametrize(("d", "s", "n", "message"), BAD_SEGMENTS)
def test_an_out_of_bounds_segment_is_refused_and_nothing_is_written(
    kernel: str, d: list[int], s: list[int], n: list[int], message: str
) -> None:
    src = np.full(8192, 7, np.uint8)
    dst = np.zeros(8192, np.uint8)
    with pytest.raises(ValueError, match=message):
        copy_segments(seg(dst, d), seg(src, s), np.asarray(n, np.int64))
    assert not dst.any()
    if HAVE_NATIVE and kernel == "native":
        with pytest.raises(ValueError, match=message):
            make_job(seg(dst, d), seg(src, s), np.asarray(n, np.int64))
        assert not dst.any()


def test_a_read_only_destination_is_refused(kernel: str) -> None:
    src = np.full(4096, 7, np.uint8)
    frozen = np.zeros(4096, np.uint8)
    frozen.flags.writeable = False
    for dst in (frozen, bytes(4096)):
        with pytest.raises(ValueError, match=r"dst\[0\] is a read-only buffer"):
            copy_segments(seg(dst, [0]), seg(src, [0]), np.asarray([16], np.int64))
    assert not frozen.any()
    copy_segments(
        seg(src.copy(), [0]), seg(bytes(range(16)), [0]), np.asarray([16], np.int64)
    )  # a read-only source is fine


def test_segments_name_their_buffer_by_index_and_a_bad_index_is_refused(kernel: str) -> None:
    a, b = np.zeros(64, np.uint8), np.zeros(32, np.uint8)
    src = np.arange(64, dtype=np.uint8)
    two = Segments((a, b), np.asarray([0, 16], np.int64), np.asarray([1, 0], np.int64))
    copy_segments(two, seg(src, [0, 8]), np.asarray([8, 8], np.int64))
    assert b[:8].tolist() == list(range(8))
    assert a[16:24].tolist() == list(range(8, 16))
    bad = Segments((a, b), np.asarray([0, 0], np.int64), np.asarray([0, 2], np.int64))
    with pytest.raises(ValueError, match=r"dst_index\[1\] = 2 is not a buffer of dst \(it has 2\)"):
        copy_segments(bad, seg(src, [0, 0]), np.asarray([1, 1], np.int64))
    # 24 bytes fit a but not b: checked against the buffer the index names
    into_b = Segments((a, b), np.asarray([16], np.int64), np.asarray([1], np.int64))
    with pytest.raises(ValueError, match=r"out of bounds of dst\[1\] \(32 bytes\)"):
        copy_segments(into_b, seg(src, [0]), np.asarray([24], np.int64))
    assert not b[16:].any()


@needs_native
def test_the_kernel_takes_no_addresses() -> None:
    """An int64 array of addresses where a buffer is expected is not a buffer of bytes: refused."""
    buf = np.zeros(64, np.uint8)
    addrs = np.asarray([buf.ctypes.data], np.int64)
    from aiokv._native._copy import copy_segments as native

    with pytest.raises(ValueError, match="dst_index is required when dst has more than one buffer"):
        native((buf, buf), None, addrs, buf, None, np.zeros(1, np.int64), np.ones(1, np.int64))
    with pytest.raises(ValueError, match="out of bounds of dst"):  # an address as an offset: far outside
        native(buf, None, addrs, buf, None, np.zeros(1, np.int64), np.ones(1, np.int64))
    with pytest.raises(TypeError, match=r"src\[0\] must be a contiguous buffer, got int"):
        native(
            buf,
            None,
            np.zeros(1, np.int64),
            buf.ctypes.data,
            None,
            np.zeros(1, np.int64),
            np.ones(1, np.int64),
        )


def test_the_planner_bounds_the_engine_side_by_the_tensors_it_spans() -> None:
    """Views of one storage (K and V interleaved along a leading dimension) are one buffer over what they
    span; a plan naming a block past the end is refused by the kernel, not copied from foreign memory."""
    kv = torch.arange(2 * 6 * 4 * 8, dtype=torch.float32).reshape(6, 2, 4, 8)
    k, v = kv[:, 0], kv[:, 1]  # non-contiguous views, interleaved in one storage
    layout = KVLayout([k, v], block_size=4)
    host = torch.zeros(3 * layout.slot_bytes, dtype=torch.uint8)
    planner = CopyPlanner(layout, host)
    assert len(planner._engine) == 1
    engine, slots, nbytes = planner.plan([5, 0], [0, 2])
    copy_segments(slots, engine, nbytes)
    back = torch.zeros_like(kv)
    restore = CopyPlanner(KVLayout([back[:, 0], back[:, 1]], block_size=4), host)
    e2, s2, n2 = restore.plan([5, 0], [0, 2])
    copy_segments(e2, s2, n2)
    assert torch.equal(back[5], kv[5])
    assert torch.equal(back[0], kv[0])
    assert not back[1:5].any()
    engine.offsets[1] += 1  # block 5 of v, the last bytes v spans: one byte further is outside
    with pytest.raises(ValueError, match="out of bounds of src"):
        copy_segments(slots, engine, nbytes)
    with pytest.raises(ValueError, match="CPU memory only"):
        tensor_bytes(torch.zeros(1, device="meta"))


@pytest.mark.skipif(
    cpu_mod._native_plan is None, reason="aiokv._native._copy is not built (or AIOKV_NATIVE_COPY=0)"
)
@pytest.mark.parametrize("shape", ["one-storage", "two-storages", "interleaved-views"])
def test_the_c_plan_is_the_layouts_plan_in_slot_order(shape: str) -> None:
    """plan(slot_order=True) in C (aiokv/_native/_copy.c plan_blocks) against KVLayout.copy_plan of the pairs
    sorted by (slot, block): the same segments, buffers and lengths, on random batches (repeats included),
    and a copy through it moves the same bytes."""
    rng = np.random.default_rng(7)
    if shape == "one-storage":
        tensors = [torch.arange(12 * 4 * 6, dtype=torch.float32).reshape(12, 4, 6)]
    elif shape == "two-storages":
        tensors = [torch.rand(12, 4, 6), torch.rand(12, 4, 3).to(torch.float16)]
    else:
        kv = torch.rand(12, 2, 4, 6)
        tensors = [kv[:, 0], kv[:, 1]]
    layout = KVLayout(tensors, block_size=4)
    host = torch.zeros(20 * layout.slot_bytes, dtype=torch.uint8)
    planner = CopyPlanner(layout, host)
    assert planner._fast is not None
    for _ in range(200):
        n = int(rng.integers(0, 30))
        blocks = [int(b) for b in rng.integers(0, 12, n)]
        slots = [int(s) for s in rng.integers(0, 20, n)]
        engine, side, nbytes = planner.plan(blocks, slots, slot_order=True)
        pairs = sorted(zip(slots, blocks, strict=True))
        addrs, host_offs, want_n = layout.copy_plan([p[1] for p in pairs], [p[0] for p in pairs], 0)
        starts = planner._starts
        idx = np.searchsorted(starts, addrs, side="right") - 1
        assert np.array_equal(nbytes, want_n)
        assert np.array_equal(side.offsets, host_offs)
        assert np.array_equal(engine.offsets, addrs - starts[idx])
        if len(starts) == 1:
            assert engine.index is None
        else:
            assert np.array_equal(engine.index, idx)
    blocks, slots = [3, 11, 0, 3], [9, 2, 5, 0]
    engine, side, nbytes = planner.plan(blocks, slots, slot_order=True)
    copy_segments(side, engine, nbytes)
    for b, s in zip(blocks, slots, strict=True):
        for t, spec in zip(tensors, layout.specs, strict=True):
            got = host[s * layout.slot_bytes + spec.slot_offset :][: t[b].numel() * t.element_size()]
            assert torch.equal(got, t[b].contiguous().view(-1).view(torch.uint8))
    engine, side, nbytes = planner.plan([12, 1], [0, 1], slot_order=True)  # block 12: past every tensor
    before = host.clone()
    with pytest.raises(ValueError, match="out of bounds of src"):
        copy_segments(side, engine, nbytes)
    assert torch.equal(host, before)
    with pytest.raises(TypeError, match="block_ids and slot_ids"):
        cpu_mod._native_plan(iter(blocks), slots, *planner._fast, 0, planner._fast_index)
    with pytest.raises(ValueError, match="same length"):
        cpu_mod._native_plan(blocks, slots[:1], *planner._fast, 0, planner._fast_index)
    with pytest.raises(OverflowError):
        cpu_mod._native_plan([2**62], [0], *planner._fast, 0, planner._fast_index)


@pytest.mark.skipif(
    cpu_mod._native_plan is None, reason="aiokv._native._copy is not built (or AIOKV_NATIVE_COPY=0)"
)
def test_a_block_id_whose_index_shrinks_the_batch_is_refused() -> None:
    """plan_blocks converts int-likes through ``__index__`` (Python code): a batch shrunk meanwhile is a
    RuntimeError, never a read past the list."""
    layout = KVLayout([torch.zeros(4, 4, 2)], block_size=4)
    planner = CopyPlanner(layout, torch.zeros(4 * layout.slot_bytes, dtype=torch.uint8))
    assert planner._fast is not None
    blocks: list[Any] = []

    class Shrinks:
        def __index__(self) -> int:
            del blocks[1:]
            return 0

    blocks.extend([Shrinks(), 1, 2])
    with pytest.raises(RuntimeError, match="changed size"):
        planner.plan(blocks, [0, 1, 2], slot_order=True)
    assert planner.plan([np.int64(3)], [1], slot_order=True)[0].offsets.tolist() == [3 * 4 * 2 * 4]
