"""The degradation families of one entry point: pool health, the serving mode, fallbacks, migrations,
requests served below the first rung, and pool restarts with their recovery time.

Every series is created when the entry point loads, so the families are on ``/metrics`` before the first
fault (the contract test reads them on an idle server).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

from disagg.serving.health import Change, PoolState
from disagg.serving.orchestrator import Outcome
from disagg.serving.telemetry import TIME_BUCKETS
from disagg.triton.metrics import Families, Gauge, SerialMetric

HEALTH_VALUES = {PoolState.HEALTHY: 0, PoolState.SATURATED: 1, PoolState.GONE: 2}
"""``disagg_pool_health``: 0 healthy, 1 saturated, 2 gone."""


class DegradationMetrics:
    def __init__(
        self,
        pb_utils: Any,
        model: str,
        path: str,
        instance: str,
        rungs: Sequence[str],
        pools: Sequence[str],
        recovery: bool,
    ) -> None:
        """``rungs``: the entry point's ladder; ``pools``: those it watches; ``recovery``: this one
        restarts gone pools (it exports the restart families)."""
        fam = self._fam = Families(pb_utils)
        self._labels = {"model": model, "path": path}
        own = {**self._labels, "instance": instance}
        self.health = {pool: fam.gauge("disagg_pool_health", {**own, "pool": pool}) for pool in pools}
        self.mode = {rung: fam.gauge("disagg_serving_mode", {**own, "mode": rung}) for rung in rungs}
        self.migrations = fam.metric("disagg_migrations_total", self._labels)
        self._lock = threading.Lock()
        self._fallbacks: dict[tuple[str, str, str], SerialMetric] = {}
        self._degraded: dict[tuple[str, bool], SerialMetric] = {}
        for rung in rungs[1:]:
            self._counter(self._degraded, (rung, False), "disagg_degraded_requests_total")
        self.restarts: dict[str, SerialMetric] = {}
        self.recovery: dict[str, SerialMetric] = {}
        if recovery:
            for pool in pools:
                self.restarts[pool] = fam.metric("disagg_pool_restarts_total", {"pool": pool})
                self.recovery[pool] = fam.histogram(
                    "disagg_pool_recovery_seconds", {"pool": pool}, TIME_BUCKETS
                )
        self.serving(rungs[0])

    def _counter(self, table: dict, key: tuple, name: str) -> SerialMetric:
        with self._lock:
            if key not in table:
                if name == "disagg_fallbacks_total":
                    labels = dict(zip(("from", "to", "reason"), key, strict=True))
                else:
                    labels = {"rung": key[0], "capped": "true" if key[1] else "false"}
                table[key] = self._fam.metric(name, {**self._labels, **labels})
            return table[key]

    def changed(self, change: Change) -> None:
        gauge: Gauge | None = self.health.get(change.pool)
        if gauge is not None:
            gauge.set(HEALTH_VALUES[change.new])

    def serving(self, mode: str) -> None:
        """The rung new requests take now: 1 on its series, 0 on the others."""
        for rung, gauge in self.mode.items():
            gauge.set(1 if rung == mode else 0)

    def observe(self, outcome: Outcome, first_rung: str) -> None:
        for route in outcome.fallbacks:
            key = (route.fell_from or "", route.rung, route.reason)
            self._counter(self._fallbacks, key, "disagg_fallbacks_total").increment(1)
        if outcome.migrations:
            self.migrations.increment(outcome.migrations)
        if outcome.error is None and outcome.rung and outcome.rung != first_rung:
            self._counter(
                self._degraded, (outcome.rung, outcome.capped), "disagg_degraded_requests_total"
            ).increment(1)

    def restarted(self, pool: str) -> None:
        if pool in self.restarts:
            self.restarts[pool].increment(1)

    def recovered(self, pool: str, seconds: float) -> None:
        if pool in self.recovery:
            self.recovery[pool].observe(seconds)

    def retire(self) -> None:
        """Take this instance's share out of its gauges (see ``metrics.Gauge``)."""
        for gauge in (*self.health.values(), *self.mode.values()):
            gauge.set(0)
