"""Token-length distributions, shared by the planner's simulator and the benchmarks' workloads."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

CONTEXT_LEN = 2048
"""Context of the default model: prompt + output never exceed it."""


KINDS = ("fixed", "uniform", "lognormal", "buckets")


@dataclass(frozen=True)
class LengthDist:
    """Token-length distribution: `fixed` (a), `uniform` integers in [a, b], `lognormal` with median a
    and shape sigma b, or `buckets`: a histogram's buckets, each `(low, high, count)` (lengths in
    (low, high]; build one with :func:`from_buckets`); every draw is clipped to [lo, hi].

    A `buckets` draw picks a bucket with probability count / total, then a length uniformly among the
    integers of (low, high]: the histogram says how many requests fell in each range and nothing of
    where inside it, so the shape of the distribution (two modes, a long tail) survives, its detail
    below a bucket's width does not. `a` and `b` are unused by it.
    """

    kind: str
    a: float
    b: float = 0.0
    lo: int = 1
    hi: int = CONTEXT_LEN
    buckets: tuple[tuple[float, float, float], ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError("kind must be fixed, uniform, lognormal or buckets")
        if not 1 <= self.lo <= self.hi <= CONTEXT_LEN:
            raise ValueError(f"need 1 <= lo <= hi <= {CONTEXT_LEN}")
        if self.kind == "uniform" and not self.a <= self.b:
            raise ValueError("uniform needs a <= b")
        if self.kind == "lognormal" and not (self.a > 0 and self.b > 0):
            raise ValueError("lognormal needs a positive median and sigma")
        if self.kind == "buckets":
            _check_buckets(self.buckets)
        elif self.buckets:
            raise ValueError("buckets: only for kind buckets")

    def sample(self, rng: np.random.Generator, count: int) -> list[int]:
        """`count` lengths drawn with `rng` (deterministic for a seeded generator)."""
        if self.kind == "fixed":
            raw = np.full(count, self.a)
        elif self.kind == "uniform":
            raw = rng.integers(int(self.a), int(self.b), size=count, endpoint=True)
        elif self.kind == "buckets":
            raw = self._sample_buckets(rng, count)
        else:
            raw = rng.lognormal(math.log(self.a), self.b, size=count)
        return [int(x) for x in np.clip(np.rint(raw), self.lo, self.hi)]

    def _sample_buckets(self, rng: np.random.Generator, count: int) -> np.ndarray:
        weights = np.array([c for _, _, c in self.buckets], dtype=float)
        picks = rng.choice(len(self.buckets), size=count, p=weights / weights.sum())
        # integers in (low, high]: floor(low) + 1 .. floor(high)
        low = np.array([math.floor(lo) + 1 for lo, _, _ in self.buckets])[picks]
        high = np.array([max(math.floor(hi), math.floor(lo) + 1) for lo, hi, _ in self.buckets])[picks]
        return rng.integers(low, high, endpoint=True)

    def median(self) -> int:
        """The distribution's median (before any joint clipping), used to calibrate idle TTFT."""
        if self.kind == "buckets":
            centre = self._bucket_median()
        else:
            centre = {"fixed": self.a, "uniform": (self.a + self.b) / 2, "lognormal": self.a}[self.kind]
        return int(min(max(round(centre), self.lo), self.hi))

    def _bucket_median(self) -> float:
        half = sum(c for _, _, c in self.buckets) / 2
        below = 0.0
        for low, high, c in self.buckets:
            if c > 0 and below + c >= half:
                return low + (high - low) * (half - below) / c
            below += c
        return self.buckets[-1][1]


def _check_buckets(buckets: tuple[tuple[float, float, float], ...]) -> None:
    if not buckets:
        raise ValueError("buckets: at least one bucket")
    previous = 0.0
    for low, high, count in buckets:
        if not (math.isfinite(low) and math.isfinite(high) and previous <= low < high):
            raise ValueError("buckets: need finite, ordered ranges 0 <= low < high")
        if not (math.isfinite(count) and count >= 0):
            raise ValueError("buckets: counts must be finite and >= 0")
        previous = high
    if sum(c for _, _, c in buckets) <= 0:
        raise ValueError("buckets: nothing observed")


def from_buckets(
    bounds: Sequence[float], cumulative: Sequence[float], lo: int = 1, hi: int = CONTEXT_LEN
) -> LengthDist:
    """A `buckets` distribution from a Prometheus histogram: its upper bounds (`le`, ascending, the last
    may be +Inf) and cumulative counts. Lengths above the highest finite bound (the +Inf bucket) are
    drawn between that bound and `hi` (the most a request can hold); empty buckets are left out.
    ValueError when nothing was observed."""
    if len(bounds) != len(cumulative):
        raise ValueError("buckets: bounds and counts differ in length")
    buckets: list[tuple[float, float, float]] = []
    low, below = 0.0, 0.0
    for bound, cum in zip(bounds, cumulative, strict=True):
        high = float(hi) if math.isinf(bound) else float(bound)
        count = cum - below
        if count > 0 and high > low:
            buckets.append((low, high, float(count)))
        elif count > 0 and buckets:  # +Inf bucket at or above hi: those lengths are clipped to hi
            last_low, last_high, last_count = buckets[-1]
            buckets[-1] = (last_low, last_high, last_count + count)
        low, below = max(low, high), max(below, cum)
    if not buckets:
        raise ValueError("buckets: nothing observed")
    return LengthDist("buckets", 0.0, lo=lo, hi=hi, buckets=tuple(buckets))


def parse_lengths(text: str) -> LengthDist:
    """``fixed:300``, ``uniform:100:500`` or ``lognormal:300:0.5`` (median, sigma)."""
    kind, _, rest = text.partition(":")
    try:
        values = [float(v) for v in rest.split(":") if v]
        return LengthDist(kind, *values)
    except (TypeError, ValueError) as exc:
        raise ValueError(
            f"lengths {text!r}: fixed:N, uniform:LO:HI or lognormal:MEDIAN:SIGMA ({exc})"
        ) from None
