"""aiokv's loggers (stdlib :mod:`logging`), quiet unless the application configures logging.

Everything aiokv logs goes to the ``"aiokv"`` logger or one of its children (``"aiokv.tiers.disk"``,
``"aiokv.tiers.redis"``, ...). The package adds a :class:`logging.NullHandler` and nothing else: records
propagate to whatever handlers the application installed, and nothing is printed when it installed none.

Levels: WARNING for what loses data or service (a tier degrading or going down, corrupt entries dropped,
failed I/O), INFO for recoveries and notable but expected events (a tier back up, entries recovered at open),
DEBUG for per-call detail. Events that can come in floods go through :class:`Throttled`, which logs the first
of a run and then at most one line per interval with the number of those in between.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

__all__ = ["THROTTLE_INTERVAL_S", "Throttled", "get_logger", "logger"]

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
