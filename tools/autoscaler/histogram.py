"""Windowed histograms from cumulative Prometheus counters.

A Prometheus histogram is a set of cumulative counters (one per bucket, plus sum and count) that grow
for the life of the process. A percentile over "the last minute" therefore comes from the DIFFERENCE of
two readings, never from the lifetime totals, which would hide a fresh regression under hours of good
history. A counter that goes down means the process restarted: the new value is then the increase
since the restart (the same rule as PromQL's `increase()`).
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from dataclasses import dataclass

from disagg_tools.autoscaler.snapshot import GarbageMetrics, Labels, Snapshot

# Rounding in the exporter's float rendering must not read as a reset or as garbage.
_EPS = 1e-9


@dataclass(frozen=True)
class Histogram:
    """Counts observed in some period: `cumulative[i]` observations <= `bounds[i]`; the last bound is +Inf."""

    bounds: tuple[float, ...]
    cumulative: tuple[float, ...]
    total: float
    count: float

    @staticmethod
    def empty(bounds: tuple[float, ...]) -> Histogram:
        return Histogram(bounds, tuple(0.0 for _ in bounds), 0.0, 0.0)

    def __add__(self, other: Histogram) -> Histogram:
        if self.bounds != other.bounds:
            raise GarbageMetrics("histogram series with different buckets")
        return Histogram(
            self.bounds,
            tuple(a + b for a, b in zip(self.cumulative, other.cumulative, strict=True)),
            self.total + other.total,
            self.count + other.count,
        )

    def mean(self) -> float | None:
        return self.total / self.count if self.count > 0 else None

    def quantile(self, q: float) -> float | None:
        """The q-quantile, interpolated linearly inside its bucket (as PromQL's `histogram_quantile`).

        None when nothing was observed. A quantile that falls in the +Inf bucket is reported as the
        highest finite bound: a lower bound of the truth, which is all the data can say.
        """
        if self.count <= 0:
            return None
        rank = q * self.count
        lower, below = 0.0, 0.0
        for bound, cum in zip(self.bounds, self.cumulative, strict=True):
            if cum >= rank and cum > below:
                if math.isinf(bound):
                    return lower
                return lower + (bound - lower) * (rank - below) / (cum - below)
            if not math.isinf(bound):
                lower = bound
            below = cum
        return lower


def _le(value: str) -> float:
    try:
        return float(value)  # float() reads "+Inf" too
    except ValueError:
        raise GarbageMetrics("bucket bound is not a number") from None


def read_histograms(snapshot: Snapshot, family: str, **match: str) -> dict[Labels, Histogram]:
    """Cumulative histograms of `family` per label set (without `le`), validated."""
    buckets: dict[Labels, dict[float, float]] = {}
    for labels, value in snapshot.select(f"{family}_bucket", **match).items():
        le = dict(labels).get("le")
        if le is None:
            raise GarbageMetrics(f"{family}: bucket without le")
        rest = frozenset(kv for kv in labels if kv[0] != "le")
        buckets.setdefault(rest, {})[_le(le)] = value
    sums = snapshot.select(f"{family}_sum", **match)
    counts = snapshot.select(f"{family}_count", **match)
    out: dict[Labels, Histogram] = {}
    for labels, by_bound in buckets.items():
        bounds = tuple(sorted(by_bound))
        if not bounds or not math.isinf(bounds[-1]):
            raise GarbageMetrics(f"{family}: no +Inf bucket")
        cumulative = tuple(by_bound[b] for b in bounds)
        if any(b + _EPS < a for a, b in itertools.pairwise(cumulative)):
            raise GarbageMetrics(f"{family}: bucket counts not cumulative")
        count = counts.get(labels, cumulative[-1])
        if abs(count - cumulative[-1]) > _EPS * max(1.0, count):
            raise GarbageMetrics(f"{family}: count differs from the +Inf bucket")
        out[labels] = Histogram(bounds, cumulative, sums.get(labels, 0.0), count)
    return out


def _series_delta(prev: Histogram | None, cur: Histogram) -> Histogram:
    if prev is None or prev.bounds != cur.bounds:
        return cur  # a new series (or re-bucketed exporter) counts from zero
    diffs = [c - p for c, p in zip(cur.cumulative, prev.cumulative, strict=True)]
    if cur.count + _EPS < prev.count or any(d < -_EPS for d in diffs):
        return cur  # counter reset: the process restarted, everything since counts
    return Histogram(
        cur.bounds,
        tuple(max(0.0, d) for d in diffs),
        max(0.0, cur.total - prev.total),
        max(0.0, cur.count - prev.count),
    )


def histogram_delta(prev: Snapshot, cur: Snapshot, family: str, **match: str) -> Histogram | None:
    """What `family` observed between two snapshots, summed over all matching series; None if absent."""
    now = read_histograms(cur, family, **match)
    if not now:
        return None
    before = read_histograms(prev, family, **match)
    result: Histogram | None = None
    for labels, hist in now.items():
        delta = _series_delta(before.get(labels), hist)
        result = delta if result is None else result + delta
    return result


def counter_delta(prev: Snapshot, cur: Snapshot, name: str, **match: str) -> float | None:
    """Increase of a counter (or a histogram's `_sum`) between snapshots, summed; None if absent."""
    now = cur.select(name, **match)
    if not now:
        return None
    before = prev.select(name, **match)
    total = 0.0
    for labels, value in now.items():
        old = before.get(labels)
        total += value if old is None or value + _EPS < old else value - old
    return total


class HistogramWindow:
    """Per-interval histogram deltas kept for `window_s` seconds; `merged()` is the windowed histogram."""

    def __init__(self, window_s: float) -> None:
        self._window_s = window_s
        self._entries: deque[tuple[float, Histogram]] = deque()

    def add(self, now: float, delta: Histogram) -> None:
        self._entries.append((now, delta))
        self._prune(now)

    def _prune(self, now: float) -> None:
        while self._entries and self._entries[0][0] <= now - self._window_s:
            self._entries.popleft()

    def merged(self, now: float) -> Histogram | None:
        self._prune(now)
        result: Histogram | None = None
        for _, hist in self._entries:
            result = hist if result is None or result.bounds != hist.bounds else result + hist
        return result
