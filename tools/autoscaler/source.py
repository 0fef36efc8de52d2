"""Metric sources: read one :class:`~.snapshot.Snapshot` per call, over HTTP.

`TritonSource` scrapes Triton's `/metrics` directly; `PrometheusSource` asks a Prometheus server, which
also sums naturally over several Triton pods (the controller sums series per pool). Errors are
:class:`SourceError` (endpoint down, HTTP error, timeout) or :class:`~.snapshot.GarbageMetrics`
(it answered, but not with metrics).
"""

from __future__ import annotations

import json
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from typing import Any, Protocol

from disagg_tools.autoscaler.config import SourceConfig
from disagg_tools.autoscaler.controller import GAUGES_BY_ROLE
from disagg_tools.autoscaler.snapshot import (
    PREFIX,
    GarbageMetrics,
    Snapshot,
    parse_exposition,
    parse_prometheus_api,
)

MAX_BODY = 64 * 1024 * 1024  # a /metrics page this big is garbage, not a reason to run out of memory


class SourceError(RuntimeError):
    """The source could not be read; the message is safe to log."""


class Source(Protocol):
    def fetch(self) -> Snapshot: ...


def http_get(url: str, timeout_s: float) -> bytes:
    """GET `url`; SourceError on any transport or HTTP failure."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            body = resp.read(MAX_BODY + 1)
    except urllib.error.HTTPError as exc:
        raise SourceError(f"HTTP {exc.code} from metrics source") from None
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise SourceError(f"metrics source unreachable ({type(exc).__name__})") from None
    if len(body) > MAX_BODY:
        raise GarbageMetrics("metrics body too large")
    return body


class TritonSource:
    """Scrapes a Prometheus text endpoint (Triton's `/metrics`)."""

    def __init__(self, config: SourceConfig, wall: Callable[[], float]) -> None:
        self._config = config
        self._wall = wall

    def fetch(self) -> Snapshot:
        body = http_get(self._config.url, self._config.timeout_s)
        try:
            text = body.decode("utf-8")
        except UnicodeDecodeError:
            raise GarbageMetrics("metrics body is not UTF-8") from None
        return parse_exposition(text, self._wall())


class PrometheusSource:
    """Reads the raw `disagg_*` series from a Prometheus server's `/api/v1/query`.

    One query for the values, plus `timestamp(<family>)` for the gauges each role reads, whose answers
    show how old the newest sample of each series is (staleness).
    """

    def __init__(self, config: SourceConfig, wall: Callable[[], float]) -> None:
        self._config = config
        self._wall = wall
        extra = f",{config.label_matchers}" if config.label_matchers else ""
        self._values = f'{{__name__=~"{PREFIX}.+"{extra}}}'
        self._families = sorted({g for gauges in GAUGES_BY_ROLE.values() for g in gauges})
        self._matchers = f"{{{config.label_matchers}}}" if config.label_matchers else ""

    def _query(self, promql: str) -> Any:
        url = self._config.url.rstrip("/") + "/api/v1/query?" + urllib.parse.urlencode({"query": promql})
        body = http_get(url, self._config.timeout_s)
        try:
            return json.loads(body)
        except ValueError:
            raise GarbageMetrics("Prometheus answer is not JSON") from None

    def fetch(self) -> Snapshot:
        values = self._query(self._values)
        stamps = {f: self._query(f"timestamp({f}{self._matchers})") for f in self._families}
        return parse_prometheus_api(values, stamps, self._wall())


def make_source(config: SourceConfig, wall: Callable[[], float]) -> Source:
    """The source `config.kind` names."""
    if config.kind == "prometheus":
        return PrometheusSource(config, wall)
    return TritonSource(config, wall)
