"""Goodput search (pure): the highest arrival rate whose SLO attainment reaches a target.

`RateSearch` is a small state machine so that the policy is testable without a server: ask `next_rate()`,
measure attainment there, `record(rate, attainment)`, repeat until `next_rate()` returns None.

1. Bracket: from `start`, multiply by `growth` (2) while the rate passes (up to `max_rate`), divide by
   it while it fails (down to `min_rate`, or until attainment stops rising as the rate falls, at rates
   the deployment's prompts alone leave mostly idle: FLAT).
   A search started near a known goodput (an earlier run's) brackets it in fewer probes with a
   smaller `growth`.
2. Bisect the bracket [highest pass, lowest fail] at its arithmetic midpoint until its relative width
   is at most `rel_tol` or `max_probes` are spent.

The answer is a `Bracket`: the highest rate that passed (`low`, 0.0 if none did) and the lowest rate
above it that missed (`high`, None if none did). `stop_reason` says why the search ended: the bracket
is narrow enough, or which bound or budget stopped it. Attainment is assumed to fall with rate; on a
noisy machine it may not quite, so every probe is kept for the report's plot.

`Bracket.at_least(other, ratio)` is the comparison rule every target uses: ours beats `ratio` x the
other's goodput only when the low end of ours is at least `ratio` x the high end of the other's, so a
difference inside the search's resolution is never called a win; overlapping brackets are a tie.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

NARROW = "narrow"
PROBES = "probe limit"
TOP = "no miss up to the highest rate"
BOTTOM = "no pass down to the lowest rate"
FLAT = "attainment does not rise at lower rates"
BUDGET = "time budget"
STOP_REASONS = (NARROW, PROBES, TOP, BOTTOM, FLAT, BUDGET)
FLAT_GAIN = 0.05
"""Going down with every probe missing: when the last of three probes' attainment is less than this
above the first's, lower rates do not help (the requests already miss served alone, or nearly so), and
the search stops rather than spend ever longer probes (16 requests at a few hundredths of a request/s).
The three probes must span about 2x in rate (FLAT_SPAN; two x1.4 steps): small steps (a search
started near a known goodput) are inside the noise of one another."""
FLAT_SPAN = 1.9
FLAT_LOAD = 0.5
"""With the deployment's TTFT alone known (`SearchConfig.alone_s`), FLAT is called only at rates where
back-to-back prompts would keep it busy at most this share of the time (rate x alone_s): above that, a
slow server's queue alone explains the misses, and lower rates still help. Without it, a peer whose
prompt takes 1.1 s was stopped as flat at 0.84 req/s, a rate its prompts alone could not sustain."""


@dataclass(frozen=True)
class Bracket:
    """A goodput measured by a search: the highest rate that met the target (`low`; 0.0 if none did)
    and the lowest rate above it that missed (`high`; None if none was found)."""

    low: float
    high: float | None

    def __post_init__(self) -> None:
        if self.low < 0 or (self.high is not None and self.high < self.low):
            raise ValueError(f"not a bracket: [{self.low}, {self.high}]")

    @property
    def width(self) -> float | None:
        """(high - low) / low; None when an end is open (no miss found, or no pass)."""
        if self.high is None or self.low <= 0:
            return None
        return (self.high - self.low) / self.low

    def at_least(self, other: Bracket, ratio: float = 1.0) -> bool:
        """The bracket rule: this low end >= `ratio` x the other's high end (an open-ended other, one
        that never missed, can never be beaten)."""
        if other.high is None:
            return False
        return self.low > 0 and self.low >= ratio * other.high

    def overlaps(self, other: Bracket) -> bool:
        """A tie: neither bracket lies wholly above the other."""
        return not (self.at_least(other) or other.at_least(self))

    def text(self) -> str:
        high = "–" if self.high is None else f"{self.high:.3f}"
        return f"[{self.low:.3f}, {high})"

    def to_dict(self) -> dict[str, Any]:
        return {"low": self.low, "high": self.high, "width": self.width}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Bracket:
        return cls(float(d["low"]), None if d.get("high") is None else float(d["high"]))

    @classmethod
    def of(cls, result: dict[str, Any]) -> Bracket:
        """A goodput entry of the report's JSON as a bracket: its own, or for an entry without one (an
        older run, or a deployment that missed alone) what its probes show."""
        if result.get("bracket"):
            return cls.from_dict(result["bracket"])
        if result.get("misses_alone"):
            return cls(0.0, 0.0)
        low = float(result.get("goodput_rps") or 0.0)
        misses = [p["rate"] for p in result.get("probes", []) if p["rate"] > low and not _met(p)]
        return cls(low, min(misses, default=None))


def _met(probe: dict[str, Any], target: float = 0.9) -> bool:
    return bool(probe.get("summary", {}).get("attainment", 0.0) >= target)


@dataclass(frozen=True)
class SearchConfig:
    start: float
    target: float = 0.9
    min_rate: float = 0.05
    max_rate: float = 64.0
    rel_tol: float = 0.03
    max_probes: int = 10
    growth: float = 2.0
    alone_s: float | None = None
    """The TTFT of one request served alone, when measured: FLAT waits for rates below FLAT_LOAD / it."""

    def __post_init__(self) -> None:
        if self.alone_s is not None and not self.alone_s > 0:
            raise ValueError("alone_s must be positive")
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

    @property
    def bracket(self) -> Bracket:
        return Bracket(self.best, self._lowest_fail())

    @property
    def stop_reason(self) -> str | None:
        """Why `next_rate` returns None (one of STOP_REASONS but BUDGET), or None while it goes on."""
        cfg = self.config
        if not self.probes:
            return None
        best, fail = self.best, self._lowest_fail()
        if fail is not None and best > 0 and (fail - best) / best <= cfg.rel_tol:
            return NARROW
        if fail is None and max(r for r, _ in self.probes) >= cfg.max_rate:
            return TOP
        if best == 0.0 and min(r for r, _ in self.probes) <= cfg.min_rate:
            return BOTTOM
        if best == 0.0 and len(self.probes) >= 3:
            (high, first), _, (low, last) = self.probes[-3:]
            idle_enough = cfg.alone_s is None or low * cfg.alone_s <= FLAT_LOAD
            if last - first < FLAT_GAIN and high >= FLAT_SPAN * low and idle_enough:
                return FLAT
        if len(self.probes) >= cfg.max_probes:
            return PROBES
        return None

    def record(self, rate: float, attainment: float) -> None:
        if not 0 <= attainment <= 1:
            raise ValueError("attainment must be in [0, 1]")
        self.probes.append((rate, attainment))

    def next_rate(self) -> float | None:
        """The next rate to measure, or None when done."""
        cfg = self.config
        if not self.probes:
            return cfg.start
        if self.stop_reason is not None:
            return None
        best, fail = self.best, self._lowest_fail()
        if fail is None:  # everything so far passed: go up
            return min(max(r for r, _ in self.probes) * cfg.growth, cfg.max_rate)
        if best == 0.0:  # everything so far failed: go down
            return max(min(r for r, _ in self.probes) / cfg.growth, cfg.min_rate)
        return (best + fail) / 2
