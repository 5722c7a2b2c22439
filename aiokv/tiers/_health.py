"""The health breaker shared by the tiers that can fail (disk, Redis): a synchronous state machine, no I/O.

States (:class:`aiokv.TierHealth`): ``UP``; ``DEGRADED`` (calls failed but the tier keeps trying on every call);
``DOWN`` (calls are answered locally, without touching the medium, until a backoff interval has passed; then
exactly one call, the *probe*, may try; its failure doubles the interval up to a maximum, its success brings
the tier back up and resets the interval).

A tier goes down either by counting (``failures_to_down`` consecutive failures: the Redis tier's server
stopped answering) or at once (:meth:`Breaker.trip`: the disk tier could not set up its directory). With
``failures_to_down=None`` only :meth:`trip` takes it down; failures then only degrade it.

The tier decides what counts as a call, a success and a failure; the breaker only decides when the medium may
be touched. Logging stays with the tier (it knows what to tell the operator), from the state before and after.
"""

from __future__ import annotations

from collections.abc import Callable

from ._base import TierHealth

__all__ = ["Breaker"]


class Breaker:
    """Counts consecutive failures and decides when a tier may touch its medium (see the module docstring).

    ``backoff`` is the current wait before the next probe while down; ``retry_at`` (on ``clock``'s scale) is
    when that probe may go; ``reconnects`` counts the probes that brought the tier back up."""

    __slots__ = (
        "_backoff0",
        "_backoff_max",
        "_clock",
        "backoff",
        "failures",
        "failures_to_down",
        "probing",
        "reconnects",
        "retry_at",
        "state",
    )

    def __init__(
        self,
        failures_to_down: int | None,
        backoff_s: float,
        backoff_max_s: float,
        clock: Callable[[], float],
    ) -> None:
        if failures_to_down is not None and failures_to_down < 1:
            raise ValueError(f"failures_to_down must be None or >= 1, got {failures_to_down}")
        self.failures_to_down = failures_to_down
        self._backoff0 = backoff_s
        self._backoff_max = backoff_max_s
        self._clock = clock
        self.state = TierHealth.UP
        self.failures = 0
        self.backoff = backoff_s
        self.retry_at = 0.0
        self.probing = False
        self.reconnects = 0

    def allow(self) -> bool | None:
        """Whether a call may touch the medium now: ``None`` no (answer locally), ``False`` yes, ``True`` yes
        as the probe of a down tier (exactly one per backoff interval, one at a time)."""
        if self.state is not TierHealth.DOWN:
            return False
        if self.probing or self._clock() < self.retry_at:
            return None
        self.probing = True
        return True

    def success(self, probe: bool) -> None:
        """A call that touched the medium worked. While down only the probe's success counts."""
        if self.state is TierHealth.DOWN:
            if not probe:
                # An answer to a call sent before the tier was declared down: it says nothing about the medium
                # now, and only the probe may bring the tier back up.
                return
            self.reconnects += 1
        self.state = TierHealth.UP
        self.failures = 0
        self.backoff = self._backoff0
        self.probing = False

    def failure(self, probe: bool) -> None:
        """A call that touched the medium failed."""
        self.failures += 1
        if probe:  # still gone: wait longer before the next probe
            self.backoff = min(self.backoff * 2, self._backoff_max)
            self.retry_at = self._clock() + self.backoff
            self.probing = False
        elif self.state is TierHealth.DOWN:
            pass  # a call already in flight when the tier was declared down
        elif self.failures_to_down is not None and self.failures >= self.failures_to_down:
            self.state = TierHealth.DOWN
            self.retry_at = self._clock() + self.backoff
        else:
            self.state = TierHealth.DEGRADED

    def trip(self) -> None:
        """Down now, whatever the count (the medium cannot be used at all); the first probe may go after the
        current backoff."""
        self.failures += 1
        self.state = TierHealth.DOWN
        self.retry_at = self._clock() + self.backoff
        self.probing = False

    def abandoned(self, probe: bool) -> None:
        """The call was cancelled before it could tell: let the next call probe."""
        if probe:
            self.probing = False
