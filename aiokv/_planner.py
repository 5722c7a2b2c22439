"""Load or recompute: decide, per request and per tier, from measured costs.

Restoring a prefix is not always faster than computing it: a slow tier (a throttled disk, a remote Redis
behind a congested link) can take longer to deliver a block than the engine takes to prefill its tokens.
The planner keeps, for every tier, a model of what a transfer costs (``seconds = latency + bytes /
bandwidth``, fitted online to completed transfers) and a model of the engine's prefill speed (given, or
measured from the engine's own steps), and answers one question on lookup: given the run of blocks each tier
holds, fastest tier first, how many leading blocks are worth restoring?

The answer walks the tiers fastest first and stops at the first tier whose run costs more to restore (its
staging plus the final copy into the engine) than recomputing its tokens would. The cost fits are weighted
least squares with exponential forgetting, so they follow a tier whose speed changes; a tier that is skipped
gets no new samples, so every ``explore_every``-th decision that would skip a tier restores it anyway to
measure it again. Until a tier has ``min_samples`` measurements the planner trusts it (restores), which is
also how it learns. ``mode="always"`` restores every hit, as before.

Pure bookkeeping: no awaits, no clocks of its own (callers pass durations), deterministic.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from ._errors import InvalidArgumentError, InvalidTypeError

__all__ = ["CostFit", "LoadPlanner", "PlannerStats", "PrefillMeter", "TierRun"]

MODES = ("always", "decide")


class CostFit:
    """``seconds ~= latency_s + nbytes / bytes_per_s``, fitted online by exponentially weighted least squares.

    ``half_life`` is the number of samples after which an old sample weighs half as much as a new one. With
    samples of a single size the two terms cannot be told apart; the fit then reports the mean rate through the
    origin (no latency), which predicts that size exactly and other sizes proportionally.
    """

    __slots__ = ("_decay", "_fixed", "_w", "_x", "_xx", "_xy", "_y", "samples")

    def __init__(self, half_life: float = 32.0) -> None:
        if not half_life > 0:
            raise InvalidArgumentError(f"half_life must be > 0, got {half_life!r}")
        self._decay = 0.5 ** (1.0 / half_life)
        self._w = self._x = self._y = self._xx = self._xy = 0.0
        self._fixed: tuple[float, float] | None = None
        self.samples = 0

    @classmethod
    def fixed(cls, latency_s: float, bytes_per_s: float, *, samples: int = 1) -> CostFit:
        """A fit that ignores samples and predicts ``latency_s + nbytes / bytes_per_s`` (a model's figures)."""
        if not (latency_s >= 0 and math.isfinite(latency_s)):
            raise InvalidArgumentError(f"latency_s must be a finite number >= 0, got {latency_s!r}")
        if not bytes_per_s > 0:
            raise InvalidArgumentError(f"bytes_per_s must be > 0, got {bytes_per_s!r}")
        fit = cls()
        fit._fixed = (float(latency_s), 0.0 if math.isinf(bytes_per_s) else 1.0 / bytes_per_s)
        fit.samples = samples
        return fit

    def record(self, nbytes: float, seconds: float) -> None:
        if self._fixed is not None:
            return
        if not (nbytes > 0 and seconds >= 0 and math.isfinite(nbytes) and math.isfinite(seconds)):
            return  # nothing to learn from an empty or broken measurement
        d = self._decay
        self._w = self._w * d + 1.0
        self._x = self._x * d + nbytes
        self._y = self._y * d + seconds
        self._xx = self._xx * d + nbytes * nbytes
        self._xy = self._xy * d + nbytes * seconds
        self.samples += 1

    def coefficients(self) -> tuple[float, float]:
        """``(latency_s, seconds_per_byte)``, both >= 0. (0, 0) before any sample."""
        if self._fixed is not None:
            return self._fixed
        if self._w == 0.0:
            return 0.0, 0.0
        w, x, y, xx, xy = self._w, self._x, self._y, self._xx, self._xy
        var = xx * w - x * x
        if var > 1e-9 * xx * w:  # sizes vary enough to separate latency from bandwidth
            slope = (xy * w - x * y) / var
            intercept = (y - slope * x) / w
            if slope > 0 and intercept >= 0:
                return intercept, slope
        through_origin = xy / xx if xx > 0 else 0.0
        return 0.0, max(0.0, through_origin)

    def predict(self, nbytes: float) -> float:
        latency, per_byte = self.coefficients()
        return latency + per_byte * nbytes

    @property
    def bytes_per_s(self) -> float:
        per_byte = self.coefficients()[1]
        return 1.0 / per_byte if per_byte > 0 else math.inf

    @property
    def latency_s(self) -> float:
        return self.coefficients()[0]


class PrefillMeter:
    """The engine's prefill speed in tokens per second: given, or an exponentially weighted mean of measured
    (tokens, seconds) samples (one per request prefill)."""

    __slots__ = ("_decay", "_given", "_s", "_t", "samples")

    def __init__(self, tokens_per_s: float | None = None, half_life: float = 32.0) -> None:
        if tokens_per_s is not None and not (tokens_per_s > 0 and math.isfinite(tokens_per_s)):
            raise InvalidArgumentError(
                f"prefill_tokens_per_s must be a finite number > 0, got {tokens_per_s!r}"
            )
        self._given = tokens_per_s
        self._decay = 0.5 ** (1.0 / half_life)
        self._t = 0.0
        self._s = 0.0
        self.samples = 0

    def record(self, tokens: int, seconds: float) -> None:
        if tokens <= 0 or not (seconds > 0 and math.isfinite(seconds)):
            return
        d = self._decay
        self._t = self._t * d + tokens
        self._s = self._s * d + seconds
        self.samples += 1

    @property
    def tokens_per_s(self) -> float | None:
        """The rate in use: the given one, else the measured one, else ``None`` (unknown yet)."""
        if self._given is not None:
            return self._given
        if self._s > 0:
            return self._t / self._s
        return None


@dataclass(frozen=True, slots=True)
class TierRun:
    """``blocks`` consecutive blocks a tier holds, continuing the runs of the faster tiers before it."""

    tier: str
    blocks: int


@dataclass(frozen=True, slots=True)
class PlannerStats:
    mode: str
    prefill_tokens_per_s: float | None
    decisions: int  # runs decided (restore or recompute), one per tier run of a lookup
    skipped_blocks: int  # hits left to recompute because restoring them would have been slower
    explored: int  # decisions that restored a losing tier anyway, to measure it again
    tiers: tuple[tuple[str, float, float, int], ...]  # (tier, latency_s, bytes_per_s, samples)
    skipped_lookups: int = 0  # lower-tier lookups not made: no run that tier could hold would be worth it


class LoadPlanner:
    """Decides how many leading hit blocks to restore (see the module docstring).

    ``block_bytes`` is the size of one block on the wire (a CPU slot); ``block_tokens`` the tokens it holds.
    ``load_tier`` names the final copy into the engine (CPU tier -> engine blocks), paid by every restored
    block; each other tier's run also pays its own staging. ``min_samples`` measurements make a model
    trusted; ``explore_every``: every so many losing runs, one is restored anyway to measure its tier again.
    """

    def __init__(
        self,
        block_bytes: int,
        block_tokens: int,
        *,
        mode: str = "decide",
        prefill_tokens_per_s: float | None = None,
        load_tier: str = "load",
        min_samples: int = 2,
        explore_every: int = 32,
    ) -> None:
        if not isinstance(mode, str):
            raise InvalidTypeError(f"load_policy must be a str, got {type(mode).__name__}")
        if mode not in MODES:
            raise InvalidArgumentError(f"load_policy must be one of {list(MODES)}, got {mode!r}")
        if block_bytes <= 0 or block_tokens <= 0:
            raise InvalidArgumentError("block_bytes and block_tokens must be > 0")
        if isinstance(min_samples, bool) or not isinstance(min_samples, int) or min_samples < 1:
            raise InvalidArgumentError(f"min_samples must be an int >= 1, got {min_samples!r}")
        if isinstance(explore_every, bool) or not isinstance(explore_every, int) or explore_every < 1:
            raise InvalidArgumentError(f"explore_every must be an int >= 1, got {explore_every!r}")
        self.mode = mode
        self.block_bytes = block_bytes
        self.block_tokens = block_tokens
        self.prefill = PrefillMeter(prefill_tokens_per_s)
        self.load_tier = load_tier
        self._min_samples = min_samples
        self._explore_every = explore_every
        self._fits: dict[str, CostFit] = {}
        self._decisions = 0
        self._skipped_blocks = 0
        self._explored = 0
        self._would_skip = 0
        self._skipped_lookups = 0

    def fit(self, tier: str) -> CostFit:
        fit = self._fits.get(tier)
        if fit is None:
            fit = self._fits[tier] = CostFit()
        return fit

    def record_transfer(self, tier: str, nbytes: int, seconds: float) -> None:
        """A completed transfer of ``nbytes`` from ``tier`` took ``seconds`` (end to end, as a request waits)."""
        self.fit(tier).record(nbytes, seconds)

    def record_prefill(self, tokens: int, seconds: float) -> None:
        self.prefill.record(tokens, seconds)

    def _cost(self, tier: str, blocks: int) -> float | None:
        """Predicted seconds to restore ``blocks`` from ``tier`` (its staging + the copy into the engine), or
        ``None`` when its model is not trustworthy yet. The copy into the engine counts for a lower tier once
        it is measured (a device backend cannot time it apart from the forward it waits for: there it counts
        as free, and a lower tier's staging is compared alone)."""
        nbytes = blocks * self.block_bytes
        load = self._fits.get(self.load_tier)
        trusted_load = load is not None and load.samples >= self._min_samples
        if tier == self.load_tier:
            return load.predict(nbytes) if trusted_load and load is not None else None
        fit = self._fits.get(tier)
        if fit is None or fit.samples < self._min_samples:
            return None
        cost = fit.predict(nbytes)
        if trusted_load and load is not None:
            cost += load.predict(nbytes)
        return cost

    def _loses(self, tier: str, lo: int, hi: int) -> bool:
        """Whether restoring a run of any length in ``lo..hi`` blocks from ``tier`` is predicted to take longer
        than recomputing its tokens. False while a model is untrusted or the prefill rate unknown (restore,
        and measure). The cost minus the recompute time is linear in the length: checking both ends is
        checking every length."""
        rate = self.prefill.tokens_per_s
        if rate is None:
            return False
        for blocks in {lo, hi}:
            cost = self._cost(tier, blocks)
            if cost is None or cost <= blocks * self.block_tokens / rate:
                return False
        return True

    def _explore(self) -> bool:
        """A losing run: True every ``explore_every``-th time (restore it anyway, to measure it again)."""
        self._would_skip += 1
        if self._would_skip % self._explore_every == 0:
            self._explored += 1
            return True
        return False

    def worth(self, tier: str, blocks: int) -> bool:
        """Whether to restore a run of ``blocks`` blocks that ``tier`` holds (one decision, counted). A run
        left to recompute is counted in ``skipped_blocks``."""
        self._decisions += 1
        if self.mode == "always" or blocks <= 0:
            return True
        if self._loses(tier, blocks, blocks) and not self._explore():
            self._skipped_blocks += blocks
            return False
        return True

    def worth_asking(self, tier: str, max_blocks: int) -> bool:
        """Before asking ``tier`` which of the next ``max_blocks`` blocks it holds: False when no run it could
        answer (1 to ``max_blocks`` blocks) would be worth restoring, so the question (a lookup, which costs
        a round trip on a remote tier) is not asked at all. Counted in ``skipped_lookups``."""
        if self.mode == "always" or max_blocks <= 0:
            return True
        # A losing tier is asked anyway when its next losing run is due to be explored (worth() explores it).
        if self._loses(tier, 1, max_blocks) and (self._would_skip + 1) % self._explore_every:
            self._would_skip += 1
            self._skipped_lookups += 1
            return False
        return True

    def plan(self, runs: Sequence[TierRun]) -> int:
        """How many leading blocks of the concatenated ``runs`` to restore: every run up to the first that is
        not :meth:`worth` restoring (the blocks from there on are counted as skipped)."""
        use = 0
        for i, r in enumerate(runs):
            if r.blocks <= 0:
                continue
            if not self.worth(r.tier, r.blocks):
                self._skipped_blocks += sum(x.blocks for x in runs[i + 1 :] if x.blocks > 0)
                break
            use += r.blocks
        return use

    def assume(self, tier: str, latency_s: float, bytes_per_s: float) -> None:
        """Replace ``tier``'s measurements with a given cost (a model's figures, e.g. in ``aiokv replay``)."""
        self._fits[tier] = CostFit.fixed(latency_s, bytes_per_s, samples=self._min_samples)

    def stats(self) -> PlannerStats:
        return PlannerStats(
            mode=self.mode,
            prefill_tokens_per_s=self.prefill.tokens_per_s,
            decisions=self._decisions,
            skipped_blocks=self._skipped_blocks,
            explored=self._explored,
            skipped_lookups=self._skipped_lookups,
            tiers=tuple(
                (name, fit.latency_s, fit.bytes_per_s, fit.samples)
                for name, fit in sorted(self._fits.items())
            ),
        )
