"""The autoscaler's own `/metrics`: sizes, decisions, fail-static holds, failures, last error, and
the sizes the schedule and the planner ask for (and the instances the schedule releases).

A private registry per instance (tests create many). prometheus_client's metrics lock internally; the
last-error text, read by the runner and by whoever asks for status, sits behind our own lock.
"""

from __future__ import annotations

import threading
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

from disagg_tools.autoscaler.governor import Decision
from disagg_tools.autoscaler.recommender import Recommendation, Recommender


class Telemetry:
    """Counters and gauges named in contract.AUTOSCALER_METRIC_NAMES."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.current = Gauge("disagg_autoscaler_current_size", "Pool size as last read", ["pool"], registry=r)
        self.desired = Gauge("disagg_autoscaler_desired_size", "Pool size last decided", ["pool"], registry=r)
        self.decisions = Counter(
            "disagg_autoscaler_decisions", "Decisions by kind", ["pool", "kind"], registry=r
        )
        self.fail_static = Counter(
            "disagg_autoscaler_fail_static",
            "Holds on untrusted input, by reason",
            ["pool", "reason"],
            registry=r,
        )
        self.scrape_failures = Counter(
            "disagg_autoscaler_scrape_failures", "Failed or garbage reads of the metrics source", registry=r
        )
        self.actuator_failures = Counter(
            "disagg_autoscaler_actuator_failures", "Failed size reads or changes", ["pool"], registry=r
        )
        self.scheduled = Gauge(
            "disagg_autoscaler_scheduled_size",
            "Pool size the schedule's window in force asks for, within the pool's bounds",
            ["pool"],
            registry=r,
        )
        self.released = Gauge(
            "disagg_autoscaler_released_size",
            "Instances of the window's size handed to other work (released) now",
            ["pool"],
            registry=r,
        )
        self.planned_size = Gauge(
            "disagg_autoscaler_planned_size",
            "Pool size the planner last recommended (NaN: no recommendation)",
            ["pool"],
            registry=r,
        )
        self.last_error_ts = Gauge(
            "disagg_autoscaler_last_error_timestamp_seconds",
            "Wall time of the last error, by reason",
            ["reason"],
            registry=r,
        )
        self._lock = threading.Lock()
        self._last_error: dict[str, Any] | None = None
        self._server: Any = None

    def error(self, reason: str, message: str, wall: float) -> None:
        # `reason` is one of a few fixed words (label cardinality stays bounded); `message` is free text.
        self.last_error_ts.labels(reason=reason).set(wall)
        with self._lock:
            self._last_error = {"reason": reason, "message": message, "at": wall}

    @property
    def last_error(self) -> dict[str, Any] | None:
        with self._lock:
            return None if self._last_error is None else dict(self._last_error)

    def record(self, decision: Decision) -> None:
        if decision.current is not None:
            self.current.labels(pool=decision.pool).set(decision.current)
        if decision.desired is not None:
            self.desired.labels(pool=decision.pool).set(decision.desired)
        self.decisions.labels(pool=decision.pool, kind=decision.kind).inc()
        schedule = decision.detail.get("schedule") or {}
        if "scheduled_size" in schedule:
            self.scheduled.labels(pool=decision.pool).set(schedule["scheduled_size"])
            self.released.labels(pool=decision.pool).set(schedule.get("released", 0))
        if decision.fail_static:
            reason = decision.reason.split(":", 1)[0]  # "missing:<family>" -> "missing"
            self.fail_static.labels(pool=decision.pool, reason=reason).inc()

    def record_plan(self, rec: Recommendation, recommender: Recommender | None) -> None:
        """The planner's counts per pool (NaN when it had too little traffic to recommend)."""
        if recommender is None:
            return
        for pool in (recommender.prefill, recommender.decode):
            size = rec.size(pool.role)
            self.planned_size.labels(pool=pool.name).set(float("nan") if size is None else size)

    def serve(self, port: int, address: str) -> int:
        """Start the HTTP endpoint; returns the bound port (useful with port 0 in tests)."""
        server, _thread = start_http_server(port, addr=address, registry=self.registry)
        self._server = server
        return int(server.server_port)

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
