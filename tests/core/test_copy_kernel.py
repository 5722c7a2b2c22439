"""The native scatter/gather copy kernel: both paths (plain memcpy, streaming + interleaved) are exact."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest

from aiokv.transfer._cpu import HAVE_NATIVE, CopyPool, GroupTuner, copy_segments

if HAVE_NATIVE:
    from aiokv._native._copy import CopyJob


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
    src_base = src.ctypes.data + 1  # unaligned
    dst_base = dst.ctypes.data
    copy_segments(
        (dst_base + dst_offs)[order].astype(np.int64),
        (src_base + offs)[order].astype(np.int64),
        lens[order].astype(np.int64),
        group,
    )
    expect = np.zeros_like(dst)
    for i in range(n):
        expect[dst_offs[i] : dst_offs[i] + lens[i]] = src[1 + offs[i] : 1 + offs[i] + lens[i]]
    assert np.array_equal(dst, expect)


def test_native_kernel_is_built() -> None:
    """CI builds the C kernel; the Python fallback exists only for machines without a compiler."""
    assert HAVE_NATIVE


def test_rejects_mismatched_lengths_and_bad_groups() -> None:
    a = np.zeros(2, np.int64)
    with pytest.raises(ValueError, match="same length"):
        copy_segments(a, a, np.zeros(3, np.int64))
    with pytest.raises(ValueError, match=r"group must be in \[1, 16\], got 17"):
        copy_segments(a, a, a, 17)


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
        pool.copy(
            (dst.ctypes.data + offs)[order].astype(np.int64),
            (src.ctypes.data + offs)[order].astype(np.int64),
            lens[order].astype(np.int64),
        )
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
        with pytest.raises(ValueError, match="nbytes must be >= 0"):
            pool.copy(dst.ctypes.data + offs, src.ctypes.data + offs, lens)
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
    return src, dst, (dst.ctypes.data + offs)[order], (src.ctypes.data + offs)[order], lens[order]


needs_native = pytest.mark.skipif(not HAVE_NATIVE, reason="the CopyJob kernel is native only")


@needs_native
@pytest.mark.parametrize("group", [1, 6])
@pytest.mark.parametrize("threads", [1, 2, 4])
def test_a_job_shared_by_threads_copies_every_part_once(group: int, threads: int) -> None:
    """Threads take parts from one counter: together they copy every byte exactly (streaming path, > 4 MiB),
    and the bytes each run() reports add up to the plan."""
    src, dst, d, s, lens = _packed_plan(threads * 10 + group, 6 << 20, 40000)
    job = CopyJob(d, s, lens, group, 512, 64 << 10)
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
    job = CopyJob(d, s, lens, 1, 512, 64 << 10)
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
    addrs = buf.ctypes.data + np.arange(10, dtype=np.int64) * 1000
    lens = np.full(10, 300, np.int64)
    assert CopyJob(addrs, addrs, lens, part_bytes=1000).parts == 3  # 4 + 4 + 2 segments
    assert CopyJob(addrs, addrs, lens, part_bytes=1).parts == 10  # a longer segment is a part of its own
    assert CopyJob(addrs, addrs, lens, part_bytes=1 << 20).parts == 1
    empty = np.zeros(0, np.int64)
    job = CopyJob(empty, empty, empty)
    assert job.parts == 0
    assert job.done
    assert job.run() == 0
    job.wait()
    with pytest.raises(ValueError, match="part_bytes must be >= 1, got 0"):
        CopyJob(addrs, addrs, lens, part_bytes=0)
    with pytest.raises(ValueError, match=r"group must be in \[1, 16\], got 0"):
        CopyJob(addrs, addrs, lens, 0)


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
