"""Goodput search (pure): the highest arrival rate whose SLO attainment reaches a target.

`RateSearch` is a small state machine so that the policy is testable without a server: ask `next_rate()`,
measure attainment there, `record(rate, attainment)`, repeat until `next_rate()` returns None.

1. Bracket: from `start`, multiply by `growth` (2) while the rate passes (up to `max_rate`), divide by
   it while it fails (down to `min_rate`). A search started near a known goodput (an earlier run's)
   brackets it in fewer probes with a smaller `growth`.
2. Bisect the bracket [highest pass, lowest fail] at its arithmetic midpoint until its relative width
   is at most `rel_tol` or `max_probes` are spent.

The answer (`best`) is the highest rate that passed, 0.0 if none did. Attainment is assumed to fall
with rate; on a noisy machine it may not quite, so every probe is kept for the report's plot.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class SearchConfig:
    start: float
    target: float = 0.9
    min_rate: float = 0.05
    max_rate: float = 64.0
    rel_tol: float = 0.1
    max_probes: int = 8
    growth: float = 2.0

    def __post_init__(self) -> None:
        if not 0 < self.min_rate <= self.start <= self.max_rate:
            raise ValueError("need 0 < min_rate <= start <= max_rate")
        if not 0 < self.target <= 1:
            raise ValueError("target must be in (0, 1]")
        if not 0 < self.rel_tol < 1:
            raise ValueError("rel_tol must be in (0, 1)")
        if self.max_probes < 1:
            raise ValueError("max_probes must be at least 1")
        if not self.growth > 1:
            raise ValueError("growth must be above 1")


@dataclass
class RateSearch:
    config: SearchConfig
    probes: list[tuple[float, float]] = field(default_factory=list)
    """(rate, attainment) in probe order."""

    @property
    def best(self) -> float:
        """Highest passing rate so far (0.0 if none passed)."""
        passed = [r for r, a in self.probes if a >= self.config.target]
        return max(passed, default=0.0)

    def _lowest_fail(self) -> float | None:
        failed = [r for r, a in self.probes if a < self.config.target and r > self.best]
        return min(failed, default=None)

    def record(self, rate: float, attainment: float) -> None:
        if not 0 <= attainment <= 1:
            raise ValueError("attainment must be in [0, 1]")
        self.probes.append((rate, attainment))

    def next_rate(self) -> float | None:
        """The next rate to measure, or None when done."""
        cfg = self.config
        if not self.probes:
            return cfg.start
        if len(self.probes) >= cfg.max_probes:
            return None
        best, fail = self.best, self._lowest_fail()
        if fail is None:  # everything so far passed: go up
            top = max(r for r, _ in self.probes)
            return None if top >= cfg.max_rate else min(top * cfg.growth, cfg.max_rate)
        if best == 0.0:  # everything so far failed: go down
            low = min(r for r, _ in self.probes)
            return None if low <= cfg.min_rate else max(low / cfg.growth, cfg.min_rate)
        if (fail - best) / best <= cfg.rel_tol:
            return None
        return (best + fail) / 2
