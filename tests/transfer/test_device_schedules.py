"""The reuse race on a simulated device: seeded random schedules where the engine's KV writes, block reuse
and checks are kernels on a compute stream that is held at random, aiokv's copy streams are paused at random,
and loads are ordered on the host or on the device. Every restored block must equal a recomputation."""

from __future__ import annotations

import pytest

from ..core._schedules import run_schedule

pytestmark = pytest.mark.asyncio


@pytest.mark.parametrize("chunk", range(4))
async def test_reuse_race_random_schedules_on_a_simulated_device(chunk: int) -> None:
    loads = evictions = 0
    for seed in range(chunk * 60, (chunk + 1) * 60):
        out = await run_schedule(seed, device=True)
        loads += out["loads"]
        evictions += out["evictions"]
    assert loads > 40  # the schedules really exercised restores
    assert evictions > 0  # ...and eviction pressure
