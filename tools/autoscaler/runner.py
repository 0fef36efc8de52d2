"""The long-running loop: read sizes and metrics, decide, act, report; once per interval.

All I/O sits here and in the source/actuator objects it is given; time comes from an injected clock,
so a test drives `run_once()` directly.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from typing import Any

from disagg_tools.autoscaler.actuator import Actuator, ActuatorError, DrainTimeout
from disagg_tools.autoscaler.clock import Clock
from disagg_tools.autoscaler.config import AutoscalerConfig, ScaledPool
from disagg_tools.autoscaler.controller import Controller, MissingMetric, inflight
from disagg_tools.autoscaler.governor import HOLD, Decision
from disagg_tools.autoscaler.recommender import Recommendation, Recommender
from disagg_tools.autoscaler.snapshot import GarbageMetrics, Snapshot
from disagg_tools.autoscaler.source import Source, SourceError
from disagg_tools.autoscaler.telemetry import Telemetry


def print_json_line(record: dict[str, Any]) -> None:
    print(json.dumps(record, sort_keys=True), file=sys.stdout, flush=True)


def inflight_probe(source: Source) -> Callable[[ScaledPool], float | None]:
    """A fresh read of a pool's in-flight gauge for scale-in draining; None when it cannot be read."""

    def probe(pool: ScaledPool) -> float | None:
        try:
            return inflight(source.fetch(), pool)
        except (SourceError, GarbageMetrics, MissingMetric):
            return None  # unknown is not drained

    return probe


class Runner:
    """Wires a source, a controller and an actuator; `emit` receives one record per decision, and one
    per planner run (``{"planner": <mode>, ...}``: what it recommends and what that would change)."""

    def __init__(
        self,
        config: AutoscalerConfig,
        source: Source,
        actuator: Actuator,
        clock: Clock,
        telemetry: Telemetry | None = None,
        emit: Callable[[dict[str, Any]], None] = print_json_line,
        dry_run: bool = False,
        recommender: Recommender | None = None,
    ) -> None:
        self._config = config
        self._source = source
        self._actuator = actuator
        self._clock = clock
        self.telemetry = telemetry or Telemetry()
        self._emit = emit
        self._dry_run = dry_run
        self._controller = Controller(config, recommender)
        self._recommender = recommender

    def _sizes(self) -> dict[str, int | None]:
        sizes: dict[str, int | None] = {}
        for pool in self._config.pools:
            try:
                sizes[pool.name] = self._actuator.current(pool)
            except ActuatorError as exc:
                sizes[pool.name] = None
                self.telemetry.actuator_failures.labels(pool=pool.name).inc()
                self.telemetry.error("actuator", str(exc), self._clock.time())
        return sizes

    def _read(self) -> tuple[Snapshot | None, str]:
        try:
            return self._source.fetch(), ""
        except SourceError as exc:
            reason, message = "scrape_failed", str(exc)
        except GarbageMetrics as exc:
            reason, message = "garbage", str(exc)
        self.telemetry.scrape_failures.inc()
        self.telemetry.error(reason, message, self._clock.time())
        return None, reason

    def _apply(self, decision: Decision) -> dict[str, Any]:
        record = decision.as_record()
        record["at"] = self._clock.time()
        if decision.fail_static and decision.reason != "warmup":  # the first reading is no error
            self.telemetry.error(decision.reason.split(":", 1)[0], decision.reason, record["at"])
        if decision.kind == HOLD or decision.current is None or decision.desired is None:
            record["applied"] = False
            return record
        pool = next(p for p in self._config.pools if p.name == decision.pool)
        try:
            self._actuator.apply(pool, decision.current, decision.desired)
            record["applied"] = not self._dry_run
            record["dry_run"] = self._dry_run
        except DrainTimeout as exc:
            record.update(applied=False, deferred=True, error=str(exc))
            self.telemetry.error("drain_timeout", str(exc), record["at"])
        except ActuatorError as exc:
            record.update(applied=False, error=str(exc))
            self.telemetry.actuator_failures.labels(pool=pool.name).inc()
            self.telemetry.error("actuator", str(exc), record["at"])
        return record

    def _plan_record(
        self, recommender: Recommender, rec: Recommendation, sizes: dict[str, int | None]
    ) -> dict[str, Any]:
        """The planner's answer beside the pools' sizes now, and what following it would do to each
        (in floor mode only the raises happen: the count is a lower bound)."""
        record: dict[str, Any] = {"planner": recommender.config.mode, **rec.as_record()}
        record["at"] = self._clock.time()
        current, would = {}, {}
        for pool in (recommender.prefill, recommender.decode):
            size, planned = sizes.get(pool.name), rec.size(pool.role)
            current[pool.name] = size
            if size is None or planned is None:
                would[pool.name] = HOLD
            else:
                would[pool.name] = "scale_out" if planned > size else "scale_in" if planned < size else HOLD
        record.update(current=current, would=would)
        return record

    def run_once(self) -> list[Decision]:
        """One interval: sizes, snapshot, decisions, actions, records."""
        now = self._clock.monotonic()
        sizes = self._sizes()
        snapshot, failure = self._read()
        decisions = self._controller.step(
            snapshot, sizes, now, failure or "scrape_failed", wall=self._clock.time()
        )
        rec = self._controller.recommendation
        if rec is not None and self._recommender is not None:
            self.telemetry.record_plan(rec, self._recommender)
            self._emit(self._plan_record(self._recommender, rec, sizes))
        for decision in decisions:
            self.telemetry.record(decision)
            self._emit(self._apply(decision))
        return decisions

    def run(self, iterations: int | None = None) -> None:
        """Loop until the clock's wait reports a stop (or `iterations` ran); one step per interval,
        scheduled from the start of each step so slow scrapes do not stretch the period."""
        done = 0
        while iterations is None or done < iterations:
            started = self._clock.monotonic()
            self.run_once()
            done += 1
            if iterations is not None and done >= iterations:
                return
            spent = self._clock.monotonic() - started
            if self._clock.wait(self._config.interval_s - spent):
                return
