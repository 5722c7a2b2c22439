"""The native scatter/gather copy kernel: both paths (plain memcpy, streaming + interleaved) are exact."""

from __future__ import annotations

import numpy as np
import pytest

from aiokv.transfer._cpu import HAVE_NATIVE, CopyPool, GroupTuner, copy_segments


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


def test_a_split_copy_reports_a_part_failing() -> None:
    pool = CopyPool(2)
    try:
        good = np.zeros(4 << 20, np.uint8)
        n = 64
        dst = (good.ctypes.data + np.arange(n, dtype=np.int64) * (64 << 10)).astype(np.int64)
        src = dst.copy()
        lens = np.full(n, 64 << 10, np.int64)
        lens[-1] = -1  # the helper thread's part is refused by the kernel
        with pytest.raises(ValueError, match="nbytes must be >= 0"):
            pool.copy(dst, src, lens)
    finally:
        pool.close()


def test_group_tuner_follows_the_measured_cost() -> None:
    tuner = GroupTuner((1, 6), sample_bytes=1 << 20, warmup=2, explore_every=4)
    assert tuner.trial(1 << 20) is None  # too small to carry a trial
    costs = {1: 2.0, 6: 1.0}  # seconds per MiB: interleaving wins on this imaginary machine

    def one_copy() -> int | None:
        best = tuner.best
        group = tuner.trial(8 << 20)
        if group is not None:  # the candidate and the best, on two prefixes of the same copy
            tuner.record(group, 1 << 20, costs[group])
            tuner.record(best, 1 << 20, costs[best])
        return group

    assert one_copy() == 6
    assert tuner.best == 6
    trials = [one_copy() for _ in range(8)]
    assert trials.count(1) >= 2  # the loser is still tried now and then
    assert tuner.best == 6
    costs[1] = 0.5  # conditions change: the loser becomes the winner once measured a few times
    for _ in range(24):
        one_copy()
    assert tuner.best == 1
