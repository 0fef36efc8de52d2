"""One reading of the metrics: flat samples keyed by name and labels, from either input format.

Both inputs end up in the same shape so the rest of the autoscaler has one code path:

- Triton's `/metrics` text exposition, parsed with `prometheus_client.parser`;
- a Prometheus server's `/api/v1/query` answer for the raw series (`{__name__=~"disagg_.+"}`), where a
  histogram arrives as its `_bucket`/`_sum`/`_count` series, exactly as in the text format.

Anything that does not parse, or holds a value no metric can hold (NaN, negative counts), raises
:class:`GarbageMetrics`; the controller turns that into a fail-static hold.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

Labels = frozenset[tuple[str, str]]
SeriesKey = tuple[str, Labels]

PREFIX = "disagg_"


class GarbageMetrics(ValueError):
    """The input is not a valid exposition / API answer; the message says what, never the raw body."""


@dataclass(frozen=True)
class Snapshot:
    """Samples read at `taken_at` (wall-clock seconds).

    `sample_times` holds, where the source knows it (Prometheus), the wall-clock time of each series'
    newest sample; a direct scrape is fresh by construction and leaves it empty.
    """

    taken_at: float
    samples: Mapping[SeriesKey, float]
    sample_times: Mapping[SeriesKey, float] = field(default_factory=dict)

    def select(self, name: str, **match: str) -> dict[Labels, float]:
        """Series of sample `name` whose labels include all of `match`."""
        want = set(match.items())
        return {labels: v for (n, labels), v in self.samples.items() if n == name and want <= labels}

    def oldest_sample_time(self, names: Iterable[str], **match: str) -> float | None:
        """Wall time of the oldest newest-sample among the matching series, or None if not known."""
        wanted = set(names)
        want = set(match.items())
        times = [t for (n, labels), t in self.sample_times.items() if n in wanted and want <= labels]
        return min(times) if times else None


def _labels(raw: Mapping[str, str]) -> Labels:
    return frozenset((k, str(v)) for k, v in raw.items() if k != "__name__")


def _check_value(name: str, value: float) -> float:
    if not isinstance(value, (int, float)) or math.isnan(value):
        raise GarbageMetrics(f"{name}: not a number")
    # Every family in the contract is a count, a size or a duration: none can be negative.
    if value < 0:
        raise GarbageMetrics(f"{name}: negative value")
    return float(value)


def parse_exposition(text: str, taken_at: float, prefix: str = PREFIX) -> Snapshot:
    """Parse Prometheus text exposition, keeping only samples whose name starts with `prefix`."""
    samples: dict[SeriesKey, float] = {}
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if not sample.name.startswith(prefix):
                    continue
                samples[(sample.name, _labels(sample.labels))] = _check_value(sample.name, sample.value)
    except GarbageMetrics:
        raise
    except (ValueError, TypeError, KeyError, IndexError) as exc:
        # The parser's messages may quote the body; keep only the exception kind.
        raise GarbageMetrics(f"unparseable exposition ({type(exc).__name__})") from None
    return Snapshot(taken_at=taken_at, samples=samples)


def _vector(answer: Any, what: str) -> list[tuple[dict[str, str], float, float]]:
    if not isinstance(answer, dict) or answer.get("status") != "success":
        raise GarbageMetrics(f"{what}: query did not succeed")
    data = answer.get("data")
    if not isinstance(data, dict) or data.get("resultType") != "vector":
        raise GarbageMetrics(f"{what}: not an instant vector")
    out = []
    for item in data.get("result", []):
        try:
            metric = item["metric"]
            ts, raw = item["value"]
            out.append(({str(k): str(v) for k, v in metric.items()}, float(ts), float(raw)))
        except (KeyError, TypeError, ValueError, AttributeError):
            raise GarbageMetrics(f"{what}: malformed result") from None
    return out


def parse_prometheus_api(values: Any, timestamps: Mapping[str, Any], taken_at: float) -> Snapshot:
    """Build a snapshot from `/api/v1/query` answers (decoded JSON).

    `values` answers the raw selector. `timestamps` maps a family name to the answer of
    `timestamp(<family>)`, whose value per series is the wall time of its newest sample: that is how
    staleness is seen through Prometheus. One query per family, because `timestamp()` drops the metric
    name and two families with equal label sets in one answer would collide.
    """
    samples: dict[SeriesKey, float] = {}
    for metric, _ts, value in _vector(values, "values"):
        name = metric.get("__name__", "")
        if not name:
            raise GarbageMetrics("values: series without a name")
        samples[(name, _labels(metric))] = _check_value(name, value)
    sample_times: dict[SeriesKey, float] = {}
    for family, answer in timestamps.items():
        for metric, _ts, value in _vector(answer, f"timestamp({family})"):
            sample_times[(family, _labels(metric))] = value
    return Snapshot(taken_at=taken_at, samples=samples, sample_times=sample_times)
