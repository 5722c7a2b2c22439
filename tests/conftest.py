"""Test configuration shared by the whole suite.

Every async test runs twice: on the default asyncio loop and on uvloop (when installed).

Hypothesis profiles, chosen by ``HYPOTHESIS_PROFILE`` (default ``dev``): ``dev`` explores new examples on every
run (and replays failures from the local database); ``ci`` (what ``.ci/run`` selects) is derandomized, so a CI
run draws the same examples every time and a red build is reproducible with the same command (the seeded
random schedules of the race tests are fixed the same way); it prints the failing example's blob. Neither has
a deadline: timings on a shared 2-core machine are not a property of the code.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Mapping
from typing import Any

import pytest
import torch
from hypothesis import settings

from aiokv.transfer._cuda import cuda_available

torch.set_num_threads(1)

settings.register_profile("dev", deadline=None)
settings.register_profile("ci", deadline=None, derandomize=True, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))

try:
    import uvloop
except ImportError:  # pragma: no cover
    uvloop = None


# AIOKV_ASYNCIO_DEBUG=1 (a CI leg, `make test-python`): every loop of this process runs in asyncio's debug
# mode, which raises on a loop method called from another thread, reports coroutines never awaited with where
# they were made, and logs callbacks that hold the loop over 100 ms. Set here rather than through
# PYTHONASYNCIODEBUG so the servers and engines the tests start in subprocesses run as users run them.
ASYNCIO_DEBUG = os.environ.get("AIOKV_ASYNCIO_DEBUG") == "1"
if ASYNCIO_DEBUG:
    asyncio.coroutines._is_debug_mode = lambda: True  # type: ignore[attr-defined]  # asyncio.run, new loops


def _debugged(factory: Callable[[], asyncio.AbstractEventLoop]) -> Callable[[], asyncio.AbstractEventLoop]:
    def make() -> asyncio.AbstractEventLoop:
        loop = factory()
        loop.set_debug(True)
        return loop

    return make


def pytest_asyncio_loop_factories(
    config: Any, item: Any
) -> Mapping[str, Callable[[], asyncio.AbstractEventLoop]]:
    factories: dict[str, Callable[[], asyncio.AbstractEventLoop]] = {"asyncio": asyncio.new_event_loop}
    if uvloop is not None:
        factories["uvloop"] = uvloop.new_event_loop
    if ASYNCIO_DEBUG:
        return {name: _debugged(f) for name, f in factories.items()}
    return factories


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if cuda_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
