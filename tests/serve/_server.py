"""A real uvicorn bound to 127.0.0.1 on a free port, serving a :class:`Service` in its own thread and event
loop, so tests can use synchronous clients (the official ``openai`` client, httpx) and async ones alike."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import anyio
import torch

from aiokv._bridge import call_in_loop
from aiokv.engine import ModelConfig, SeqChunk, Transformer
from aiokv.serve import ENGINE_PRESETS, ServeConfig, ServerHandle, Service
from aiokv.serve._runner import bind, serve

T = TypeVar("T")

TINY = ModelConfig(**ENGINE_PRESETS["tiny"])  # the model `aiokv serve --model tiny` runs
START_TIMEOUT = 60.0


def config(**changes: Any) -> ServeConfig:
    """A small, quiet server: the tiny model, a 64 MiB CPU tier, every cached prefix restored (with
    ``load_policy="decide"`` the tiny model's recompute can beat a copy, so cached tokens would depend on the
    machine's timing)."""
    base = ServeConfig(
        host="127.0.0.1",
        port=0,
        model="tiny",
        num_blocks=256,
        tiers="cpu=64MiB",
        load_policy="always",
        log_level="warning",
        access_log=False,
        drain_timeout=10.0,
    )
    return base.replace(**changes)


class Gate:
    """Holds the engine's forwards (in its worker thread) until the test lets them go: ``allow(k)`` lets
    ``k`` forwards through, ``open()`` everything from now on. ``wait_blocked()`` waits (on a condition)
    until a forward is held."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._permits = 0
        self._open = False
        self.blocked = 0
        self.passed = 0

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

    def wait(self) -> None:
        with self._cv:
            self.blocked += 1
            self._cv.notify_all()
            while not self._open and self._permits == 0:
                self._cv.wait()
            if not self._open:
                self._permits -= 1
            self.blocked -= 1
            self.passed += 1
            self._cv.notify_all()

    def wait_blocked(self, timeout: float = 30.0) -> None:
        with self._cv:
            assert self._cv.wait_for(lambda: self.blocked > 0, timeout), "no forward reached the gate"

    def wait_passed(self, n: int, timeout: float = 30.0) -> None:
        with self._cv:
            assert self._cv.wait_for(lambda: self.passed >= n, timeout), (
                f"{self.passed} of {n} forwards passed"
            )


class GatedTransformer(Transformer):
    """The tiny model, whose forwards wait at ``gate`` first."""

    def __init__(self, gate: Gate) -> None:
        super().__init__(TINY)
        self.gate = gate

    def forward(self, chunks: Sequence[SeqChunk], kv: Sequence[torch.Tensor]) -> torch.Tensor:
        self.gate.wait()
        return super().forward(chunks, kv)


class ServerThread:
    """``serve()`` in a thread with its own loop (``loop``: "asyncio" or "uvloop")."""

    def __init__(self, cfg: ServeConfig, *, model: Transformer | None = None, loop: str = "asyncio") -> None:
        self.config = cfg
        self.service = Service(cfg, model=model)
        self.handle = ServerHandle()
        self._loop_kind = loop
        self._error: BaseException | None = None
        self.leaked: list[str] = []
        self.loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=self._main, name="aiokv-test-server", daemon=True)

    @property
    def url(self) -> str:
        assert self.handle.url is not None
        return self.handle.url

    def start(self) -> ServerThread:
        self._thread.start()
        self.handle.listening.wait(START_TIMEOUT)
        if self._error is not None:
            raise self._error
        assert self.handle.listening.is_set(), "server did not start"
        return self

    def _main(self) -> None:
        async def main() -> None:
            self.loop = asyncio.get_running_loop()
            sock = bind("127.0.0.1", 0)
            try:
                async with self.service:
                    await serve(self.config, sock=sock, service=self.service, handle=self.handle)
            finally:
                me = asyncio.current_task()
                self.leaked = [t.get_name() for t in asyncio.all_tasks() if t is not me]

        try:
            anyio.run(main, backend="asyncio", backend_options={"use_uvloop": self._loop_kind == "uvloop"})
        except BaseException as exc:  # reported by start()/stop()
            self._error = exc
            self.handle.listening.set()

    def call(self, fn: Callable[[], T | Awaitable[T]], timeout: float = 30.0) -> T:
        """Run ``fn`` on the server's loop (awaiting it if it returns an awaitable)."""
        assert self.loop is not None
        return call_in_loop(self.loop, fn).result(timeout)

    def stop(self, *, hurry: bool = False, timeout: float = 60.0) -> None:
        self.handle.shutdown(hurry=hurry)
        self._thread.join(timeout)
        assert not self._thread.is_alive(), "server did not stop"
        if self._error is not None:
            raise self._error

    def engine_idle_stats(self) -> Any:
        """Engine stats once it is idle (every request gone, every block back in the pool)."""
        engine = self.service.engine
        assert engine is not None

        async def idle() -> Any:
            await engine.wait_idle()
            return engine.stats()

        return self.call(idle)
