"""``aiokv serve`` as a user runs it: ``python -m aiokv serve`` in a subprocess on a free loopback port, found by
the URL its ready line prints, its stderr collected line by line, stopped with SIGTERM (and killed by its PID
if a test leaves it running)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO

ROOT = Path(__file__).resolve().parents[2]
URL = re.compile(r"on (http://\S+) ")


def env(**extra: str) -> dict[str, str]:
    """This process's environment without any ``AIOKV_*`` variable, unbuffered, plus ``extra``."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("AIOKV_")}
    return {**base, "PYTHONUNBUFFERED": "1", **extra}


class ServeProcess:
    """``python -m aiokv serve --model tiny --port 0 --num-blocks 128 ARGS...``; waits for its ready line."""

    def __init__(self, *args: str, **extra_env: str) -> None:
        self.p = subprocess.Popen(
            [sys.executable, "-m", "aiokv", "serve", "--model", "tiny", "--port", "0", "--num-blocks", "128",
             *args],
            cwd=ROOT, env=env(**extra_env), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        self.lines: list[str] = []
        self._cv = threading.Condition()
        self._reader = threading.Thread(target=self._read, args=(self.p.stderr,), daemon=True)
        self._reader.start()
        assert self.p.stdout is not None
        ready = self.p.stdout.readline()  # blocks until the ready line (or exit)
        m = URL.search(ready)
        assert m, f"no ready line: {ready!r} {self.err}"
        self.url = m.group(1)

    def _read(self, f: IO[str] | None) -> None:
        assert f is not None
        for line in f:
            with self._cv:
                self.lines.append(line.rstrip("\n"))
                self._cv.notify_all()

    @property
    def err(self) -> str:
        """Its stderr so far."""
        with self._cv:
            return "\n".join(self.lines)

    def wait_line(self, pattern: str, timeout: float = 30) -> str:
        """The first stderr line matching ``pattern`` (waits for it, up to ``timeout`` seconds)."""
        rx = re.compile(pattern)
        deadline = time.monotonic() + timeout
        with self._cv:
            while True:
                found = next((line for line in self.lines if rx.search(line)), None)
                if found is not None:
                    return found
                left = deadline - time.monotonic()
                assert left > 0, f"no line matching {pattern!r} in:\n" + "\n".join(self.lines)
                self._cv.wait(left)

    def wait(self, timeout: float = 30) -> int:
        """The exit status once the process and its stderr have ended."""
        rc = self.p.wait(timeout)
        self._reader.join(10)
        return rc

    def stop(self, timeout: float = 30) -> int:
        """SIGTERM, then :meth:`wait`."""
        self.p.send_signal(signal.SIGTERM)
        return self.wait(timeout)

    def close(self) -> None:
        """Kill it if it still runs; close its pipes."""
        if self.p.poll() is None:
            self.p.kill()
            self.p.wait(10)
        for f in (self.p.stdout, self.p.stderr):
            if f is not None:
                f.close()
