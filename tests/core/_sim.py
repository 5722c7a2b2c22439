"""A tiny simulated engine for core tests: deterministic KV per prefix, a block pool that poisons freed blocks.

The KV written for token position ``p`` of a sequence is a pure function of ``tokens[: p + 1]`` (a running
hash, exactly representable in fp32), so any block loaded back can be checked against what a recomputation
would have produced. Freed blocks are overwritten with garbage the instant the engine may reuse them.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch

import aiokv
import aiokv.transfer

GARBAGE = -7.0
MOD = 1 << 23


def running_hashes(tokens: Sequence[int]) -> list[float]:
    out: list[float] = []
    h = 17
    for t in tokens:
        h = (h * 1000003 + int(t) + 1) % MOD
        out.append(float(h))
    return out


class SimEngine:
    """Paged KV tensors plus a free-block pool."""

    def __init__(
        self, num_blocks: int = 64, block_size: int = 16, num_tensors: int = 4, width: int = 4
    ) -> None:
        self.block_size = block_size
        self.tensors = [torch.full((num_blocks, block_size, width), GARBAGE) for _ in range(num_tensors)]
        self.layout = aiokv.KVLayout(self.tensors, block_size=block_size)
        self.free: list[int] = list(range(num_blocks))

    def alloc(self, n: int) -> list[int] | None:
        if n > len(self.free):
            return None
        out = self.free[:n]
        del self.free[:n]
        return out

    def release(self, blocks: Sequence[int]) -> None:
        """Return blocks to the pool and poison them, as a reusing engine would overwrite them."""
        for b in blocks:
            for i, t in enumerate(self.tensors):
                t[b].fill_(GARBAGE - i)
        self.free.extend(blocks)

    def compute(
        self, tokens: Sequence[int], hashes: Sequence[float], blocks: Sequence[int], start: int, end: int
    ) -> None:
        """Write the KV of positions ``start..end-1`` into the request's blocks."""
        bs = self.block_size
        for p in range(start, end):
            b = blocks[p // bs]
            for i, t in enumerate(self.tensors):
                t[b, p % bs].fill_(hashes[p] + i)

    def check_block(self, hashes: Sequence[float], block: int, index: int) -> None:
        """Assert engine block ``block`` holds the KV of the sequence's block ``index``."""
        bs = self.block_size
        for i, t in enumerate(self.tensors):
            expect = torch.tensor(hashes[index * bs : (index + 1) * bs]) + i
            got = t[block, :, 0]
            assert torch.equal(got, expect), (
                f"block {index} (engine block {block}) tensor {i}: {got} != {expect}"
            )
            assert torch.equal(t[block], got[:, None].expand_as(t[block]))

    def check_tokens(self, hashes: Sequence[float], blocks: Sequence[int], num_tokens: int) -> None:
        """Assert the first ``num_tokens`` positions held by ``blocks`` carry the sequence's KV."""
        bs = self.block_size
        for p in range(num_tokens):
            b = blocks[p // bs]
            for i, t in enumerate(self.tensors):
                got = t[b, p % bs]
                assert torch.all(got == hashes[p] + i), f"position {p} (engine block {b}) tensor {i}: {got}"


class Gate:
    """Holds the executor's worker threads before each copy until the test lets them go.

    Installed by wrapping ``TransferExecutor._copy_store`` / ``_copy_load``; ``allow(k)`` lets ``k`` copies
    through, ``open()`` lets everything through from now on.
    """

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._permits = 0
        self._open = False

    def allow(self, k: int = 1) -> None:
        with self._cv:
            self._permits += k
            self._cv.notify_all()

    def open(self) -> None:
        with self._cv:
            self._open = True
            self._cv.notify_all()

    def close(self) -> None:
        with self._cv:
            self._open = False
            self._permits = 0

    def wait(self) -> None:
        with self._cv:
            while not self._open and self._permits == 0:
                self._cv.wait()
            if not self._open:
                self._permits -= 1

    def install(self, monkeypatch: object, executor_cls: type = aiokv.transfer.TransferExecutor) -> None:
        orig_store = executor_cls._copy_store
        orig_load = executor_cls._copy_load
        gate = self

        def store(self_: object, a: object, b: object) -> None:
            gate.wait()
            orig_store(self_, a, b)

        def load(self_: object, a: object, b: object) -> None:
            gate.wait()
            orig_load(self_, a, b)

        monkeypatch.setattr(executor_cls, "_copy_store", store)  # type: ignore[attr-defined]
        monkeypatch.setattr(executor_cls, "_copy_load", load)  # type: ignore[attr-defined]


class DeviceSimEngine(SimEngine):
    """The same engine on a simulated device: its KV writes, block reuse and checks are kernels on the
    compute stream, so they land *after* the calls that enqueue them return, as on a GPU with asynchronous
    scheduling. Check failures are collected (a kernel must not raise) and asserted with :meth:`verify`."""

    def __init__(self, device: object, compute: object, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.device = device
        self.stream = compute
        self.failures: list[str] = []

    def _launch(self, fn: object) -> None:
        self.device.launch(self.stream, fn)  # type: ignore[attr-defined]

    def release(self, blocks: Sequence[int]) -> None:
        blocks = list(blocks)
        self._launch(lambda: self._poison(blocks))
        self.free.extend(blocks)

    def _poison(self, blocks: list[int]) -> None:
        for b in blocks:
            for i, t in enumerate(self.tensors):
                t[b].fill_(GARBAGE - i)

    def compute(
        self, tokens: Sequence[int], hashes: Sequence[float], blocks: Sequence[int], start: int, end: int
    ) -> None:
        args = (list(tokens), list(hashes), list(blocks), start, end)
        self._launch(lambda: SimEngine.compute(self, *args))

    def check_tokens(self, hashes: Sequence[float], blocks: Sequence[int], num_tokens: int) -> None:
        args = (list(hashes), list(blocks), num_tokens)

        def check() -> None:
            try:
                SimEngine.check_tokens(self, *args)
            except AssertionError as exc:
                self.failures.append(str(exc))

        self._launch(check)

    def verify(self) -> None:
        self.device.synchronize_stream(self.stream)  # type: ignore[attr-defined]
        assert not self.failures, self.failures[:3]
