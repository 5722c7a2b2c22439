"""aiokv's loggers (stdlib :mod:`logging`), quiet unless the application configures logging.

Everything aiokv logs goes to the ``"aiokv"`` logger or one of its children (``"aiokv.tiers.disk"``,
``"aiokv.tiers.redis"``, ...). The package adds a :class:`logging.NullHandler` and nothing else: records
propagate to whatever handlers the application installed, and nothing is printed when it installed none.

Levels: WARNING for what loses data or service (a tier degrading or going down, corrupt entries dropped,
failed I/O), INFO for recoveries and notable but expected events (a tier back up, entries recovered at open),
DEBUG for per-call detail. Events that can come in floods go through :class:`Throttled`, which logs the first
of a run and then at most one line per interval with the number of those in between; health changes go
through :class:`Transitions`, which logs each change but at most a few per interval (a flapping tier gives a
summary line with the count and the state it ended in).

Configuring handlers is the application's business. Only aiokv's own entry points do it: ``aiokv serve`` and
``aiokv replay`` (:func:`configured`: one handler on stderr for aiokv's loggers and uvicorn's, timestamps,
text or JSON lines) and the vLLM connector (:func:`adopt_vllm_handlers`: aiokv's lines in vLLM's format,
unless the application configured logging itself).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from typing import IO, Any

__all__ = [
    "FORMATS",
    "LEVELS",
    "THROTTLE_INTERVAL_S",
    "JsonFormatter",
    "TextFormatter",
    "Throttled",
    "Transitions",
    "adopt_vllm_handlers",
    "configured",
    "get_logger",
    "logger",
]

logger = logging.getLogger("aiokv")
logger.addHandler(logging.NullHandler())

THROTTLE_INTERVAL_S = 60.0


def get_logger(name: str) -> logging.Logger:
    """The child logger ``aiokv.<name>``."""
    return logger.getChild(name)


class Throttled:
    """One kind of event that may come in floods (corrupt entries, failed writes), logged sparingly.

    The first event is logged as given; later ones within ``interval_s`` are only counted, and the first event
    after the interval is logged with the count of those suppressed since the last line ("... (and 41 more
    since the last report)"). :meth:`flush` logs the count still pending (call it when the owner closes).
    Counting never depends on the logger's level; formatting only happens for lines that are emitted.
    """

    __slots__ = ("_clock", "_interval", "_level", "_log", "_next_at", "_summary", "suppressed", "total")

    def __init__(
        self,
        log: logging.Logger,
        level: int,
        summary: str,
        *,
        interval_s: float = THROTTLE_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._log = log
        self._level = level
        self._summary = (
            summary  # what flush() says the suppressed events were, e.g. "corrupt entries dropped"
        )
        self._interval = interval_s
        self._clock = clock
        self._next_at: float | None = None
        self.suppressed = 0  # events counted but not logged since the last line
        self.total = 0  # events seen

    def event(self, msg: str, *args: object) -> bool:
        """Record one event; log it (``msg % args``) unless a line was logged less than ``interval_s`` ago.
        Returns whether a line was emitted."""
        self.total += 1
        now = self._clock()
        if self._next_at is not None and now < self._next_at:
            self.suppressed += 1
            return False
        self._next_at = now + self._interval
        suppressed, self.suppressed = self.suppressed, 0
        if suppressed:
            self._log.log(self._level, msg + " (and %d more since the last report)", *args, suppressed)
        else:
            self._log.log(self._level, msg, *args)
        return True

    def flush(self) -> None:
        """Log how many events were suppressed since the last line, if any."""
        if self.suppressed:
            self._log.log(self._level, "%s: %d more not reported", self._summary, self.suppressed)
            self.suppressed = 0


class Transitions:
    """The health changes of one component (a tier), each logged as given, but at most ``burst`` lines per
    ``interval_s``: a component flapping faster has its further changes counted, and one summary line says how
    many were not logged and the state it is in now. The summary comes at the end of the interval (a timer on
    the running event loop, when there is one), else with the next change after it, and at :meth:`flush`.
    """

    __slots__ = (
        "_burst",
        "_clock",
        "_interval",
        "_lines",
        "_log",
        "_state",
        "_timer",
        "_what",
        "_window",
        "suppressed",
        "total",
    )

    def __init__(
        self,
        log: logging.Logger,
        what: str,
        *,
        burst: int = 5,
        interval_s: float = THROTTLE_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._log = log
        self._what = what  # names the component in the summary line, e.g. "redis tier 'redis://h:6379/0'"
        self._burst = burst
        self._interval = interval_s
        self._clock = clock
        self._window: float | None = None  # when the current interval began
        self._lines = 0  # lines logged in the current interval
        self._state = ""  # the state after the last change
        self._timer: asyncio.TimerHandle | None = None
        self.suppressed = 0  # changes counted but not logged since the last line
        self.total = 0  # changes seen

    def changed(self, state: str, level: int, msg: str, *args: object) -> bool:
        """The component is now in ``state``: log ``msg % args`` at ``level`` unless ``burst`` lines were
        logged in this interval. Returns whether a line was emitted."""
        self.total += 1
        self._state = state
        now = self._clock()
        if self._window is None or now >= self._window + self._interval:
            self._window, self._lines = now, 0
        if self._lines >= self._burst:
            self.suppressed += 1
            self._arm(self._window + self._interval - now)
            return False
        self._lines += 1
        suppressed, self.suppressed = self.suppressed, 0
        if suppressed:
            self._log.log(level, msg + " (after %d more changes not logged)", *args, suppressed)
        else:
            self._log.log(level, msg, *args)
        return True

    def flush(self) -> None:
        """Log the summary of the changes not logged, if any (call it when the owner closes)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if not self.suppressed:
            return
        n, self.suppressed = self.suppressed, 0
        self._window, self._lines = self._clock(), 1
        self._log.log(
            logging.INFO if self._state == "up" else logging.WARNING,
            "%s changed health %d more times than logged (flapping); it is %s now",
            self._what,
            n,
            self._state,
        )

    def _arm(self, delay: float) -> None:
        if self._timer is not None:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no loop in this thread: the summary comes with a later change or flush()
            return
        self._timer = loop.call_later(max(delay, 0.0), self._due)

    def _due(self) -> None:
        self._timer = None
        self.flush()


# --------------------------------------------------------------------------------- configuring (entry points)
LEVELS = ("critical", "error", "warning", "info", "debug")
"""The levels ``--log-level`` takes (``AIOKV_LOG_LEVEL``)."""
FORMATS = ("text", "json")
"""The line formats ``--log-format`` takes (``AIOKV_LOG_FORMAT``)."""


def _timestamp(created: float) -> str:
    """``2025-06-01T12:34:56.789Z``: UTC, milliseconds."""
    seconds = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(created))
    return f"{seconds}.{int(created % 1 * 1000):03d}Z"


class TextFormatter(logging.Formatter):
    """``2025-06-01T12:34:56.789Z WARNING aiokv.tiers.disk: message``: one line per record (a traceback, when
    there is one, follows on the next lines)."""

    def format(self, record: logging.LogRecord) -> str:
        line = f"{_timestamp(record.created)} {record.levelname} {record.name}: {record.getMessage()}"
        detail = _exception_text(self, record)
        return f"{line}\n{detail}" if detail else line


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ``ts`` (as :class:`TextFormatter` writes it), ``level``, ``logger``,
    ``msg``, and ``exc`` (the traceback) when there is one."""

    def format(self, record: logging.LogRecord) -> str:
        obj: dict[str, Any] = {
            "ts": _timestamp(record.created),
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        detail = _exception_text(self, record)
        if detail:
            obj["exc"] = detail
        return json.dumps(obj, ensure_ascii=False)


def _exception_text(formatter: logging.Formatter, record: logging.LogRecord) -> str:
    parts = []
    if record.exc_info:
        parts.append(formatter.formatException(record.exc_info))
    if record.stack_info:
        parts.append(formatter.formatStack(record.stack_info))
    return "\n".join(parts)


class _Handler(logging.StreamHandler):  # type: ignore[type-arg]
    """The handler :func:`configured` installs (recognised by its class)."""


@contextlib.contextmanager
def configured(
    level: str | int = "info",
    fmt: str = "text",
    *,
    loggers: Sequence[str] = ("aiokv",),
    stream: IO[str] | None = None,
) -> Iterator[logging.Handler]:
    """For aiokv's entry points only, for as long as they run: one handler writing ``stream`` (default: stderr)
    in ``fmt`` (``"text"``: :class:`TextFormatter`, ``"json"``: :class:`JsonFormatter`) for each of
    ``loggers`` (their records stop propagating, so they are not printed twice), which log at ``level`` and
    above. The root logger is left alone. On exit the loggers are restored as they were."""
    if fmt not in FORMATS:
        raise ValueError(f"fmt must be one of {', '.join(FORMATS)}, got {fmt!r}")
    levelno = level if isinstance(level, int) else logging.getLevelName(level.upper())
    if not isinstance(levelno, int):
        raise ValueError(f"level must be one of {', '.join(LEVELS)}, got {level!r}")
    handler = _Handler(sys.stderr if stream is None else stream)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    saved = []
    for name in loggers:
        lg = logging.getLogger(name)
        saved.append((lg, lg.level, lg.propagate, list(lg.handlers)))
        for old in lg.handlers:
            if isinstance(old, _Handler):  # configured by an outer call: replaced
                lg.removeHandler(old)
        lg.addHandler(handler)
        lg.setLevel(levelno)
        lg.propagate = False
    try:
        yield handler
    finally:
        for lg, old_level, propagate, handlers in saved:
            lg.removeHandler(handler)
            for old in handlers:
                if old not in lg.handlers:
                    lg.addHandler(old)
            lg.setLevel(old_level)
            lg.propagate = propagate
        handler.close()


def _configured_by_application(lg: logging.Logger) -> bool:
    """Whether the application set ``lg`` up: a handler of its own, a level, or no propagation."""
    own = [h for h in lg.handlers if not isinstance(h, logging.NullHandler)]
    return bool(own) or lg.level != logging.NOTSET or not lg.propagate


def adopt_vllm_handlers(level: str | None = None) -> bool:
    """In the vLLM connector: when neither the ``"aiokv"`` logger nor the root logger was configured by the
    application and vLLM configured its ``"vllm"`` logger (its default), give aiokv's loggers a handler on
    vLLM's stream with vLLM's formatter, so aiokv's lines appear in vLLM's output in its format, at ``level``
    (default: the ``"vllm"`` logger's level). With the root logger configured, aiokv's records reach its
    handlers already and only ``level`` (when given) is set. Returns whether a handler was added."""
    aiokv = logging.getLogger("aiokv")
    if _configured_by_application(aiokv) or any(isinstance(h, _VllmCopy) for h in aiokv.handlers):
        return False
    levelno = logging.getLevelName(level.upper()) if level is not None else None
    vllm = logging.getLogger("vllm")
    source = next((h for h in vllm.handlers if isinstance(h, logging.StreamHandler)), None)
    if logging.getLogger().handlers or source is None:
        # The application configured logging (aiokv's records propagate to its handlers), or vLLM did not
        # (VLLM_CONFIGURE_LOGGING=0: then the application owns logging).
        if isinstance(levelno, int):
            aiokv.setLevel(levelno)
        return False
    handler = _VllmCopy(source.stream)
    handler.setFormatter(source.formatter)
    aiokv.addHandler(handler)
    aiokv.setLevel(levelno if isinstance(levelno, int) else vllm.getEffectiveLevel())
    aiokv.propagate = False
    return True


class _VllmCopy(logging.StreamHandler):  # type: ignore[type-arg]
    """The handler :func:`adopt_vllm_handlers` adds: vLLM's stream and formatter."""
