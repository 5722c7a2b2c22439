"""Device harness: the same ordering tests on the simulated device (always) and on CUDA (when present).

A test holds a stream back (the simulator pauses it; CUDA queues a long sleep kernel on it), enqueues engine
work behind the hold, drives aiokv, lets everything that *could* run without the held work run
(:meth:`Harness.settle`), and only then releases the hold. A copy that is not ordered after the held work has
then already read or written stale bytes, deterministically on the simulator.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
import torch

import aiokv
from aiokv.transfer import SimulatedDevice

HOLD_CYCLES = 1 << 31  # CUDA: ~1 s of a spinning kernel at ~2 GHz, far longer than any test step


class Harness:
    def __init__(self, kind: str, seed: int = 0, jitter_s: float = 0.0) -> None:
        self.kind = kind
        self._holds: list[Any] = []
        if kind == "sim":
            self.sim: SimulatedDevice | None = SimulatedDevice(seed=seed, jitter_s=jitter_s)
            self.device: Any = self.sim
            self.compute: Any = self.sim.new_stream("compute")
            self.torch_device = torch.device("cpu")
        else:
            from aiokv.transfer._cuda import CudaDevice

            self.sim = None
            self.device = CudaDevice()
            self.compute = torch.cuda.Stream()
            self.torch_device = torch.device("cuda")

    def tensors(self, num_blocks: int, block_size: int, n: int = 4, width: int = 8) -> list[torch.Tensor]:
        gen = torch.Generator().manual_seed(7)
        return [
            torch.randn(num_blocks, block_size, width, generator=gen).to(self.torch_device) for _ in range(n)
        ]

    def launch(self, stream: Any, fn: Callable[[], Any]) -> None:
        self.device.launch(stream, fn)

    def fill(self, tensors: list[torch.Tensor], blocks: list[int], value: float, stream: Any = None) -> None:
        """Engine work on ``stream`` (default: compute) writing ``value`` into ``blocks`` of every tensor."""

        # Slices of consecutive blocks, never an index list: on CUDA ``t[[0, 1]] = v`` uploads the list with a
        # synchronous copy on the compute stream, so the host would wait behind a hold and the work would no
        # longer be queued behind it (the test would time the host, not the stream order).
        runs: list[tuple[int, int]] = []
        for b in sorted(set(blocks)):
            if runs and runs[-1][1] == b:
                runs[-1] = (runs[-1][0], b + 1)
            else:
                runs.append((b, b + 1))

        def write() -> None:
            for t in tensors:
                for lo, hi in runs:
                    t[lo:hi].fill_(value)

        self.launch(self.compute if stream is None else stream, write)

    def hold(self, stream: Any) -> Any:
        """Stream-ordered: work enqueued on ``stream`` after this call waits for :meth:`release`."""
        if self.sim is not None:
            token = stream.hold()
            self._holds.append(token)
            return token
        with torch.cuda.stream(stream):
            torch.cuda._sleep(HOLD_CYCLES)
        return None

    def release(self, token: Any) -> None:
        if token is not None:
            token.set()

    def release_all(self) -> None:
        """Let every held stream go (a failing test must not leave the offloader waiting forever)."""
        for token in self._holds:
            token.set()
        if self.sim is not None:
            for s in list(self.sim._streams):
                s.resume()

    async def settle(self, off: aiokv.Offloader, *requests: aiokv.Request) -> None:
        """``requests`` have processed their events (their copies are accepted), every accepted copy is on its
        stream, and all device work that is not behind a hold has run."""
        for r in requests:
            await r.wait_processed()
        await off.executor.wait_submitted()
        if self.sim is not None:
            await asyncio.to_thread(self.sim.wait_quiescent)

    def synchronize(self) -> None:
        if self.sim is not None:
            self.sim.synchronize_all()
        else:
            torch.cuda.synchronize()

    @contextlib.asynccontextmanager
    async def offloader(
        self, layout: aiokv.KVLayout, slots: int = 32, **kwargs: Any
    ) -> AsyncIterator[aiokv.Offloader]:
        """An offloader on this device whose holds are released before it closes, even when a test fails."""
        off = aiokv.Offloader(
            layout,
            tiers=[aiokv.CPUTier(capacity_bytes=slots * layout.slot_bytes)],
            device=self.device,
            compute_stream=self.compute,
            **kwargs,
        )
        async with off:
            try:
                yield off
            finally:
                self.release_all()

    def close(self) -> None:
        self.release_all()
        if self.sim is not None:
            self.sim.close()


def harness_params() -> list[Any]:
    return ["sim", pytest.param("cuda", marks=pytest.mark.gpu)]
