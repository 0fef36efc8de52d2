"""An entry point's metrics: per-request histograms and outcome counters, the live SLO, hot-prompt
and remote-server gauges (``OrchestratorMetrics``), and the versions its requests are pinned to
(``VersionMetrics``). Families come from ``disagg.triton.metrics``."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from typing import Any

from disagg.hot.hotness import GroupRate
from disagg.hot.throttle import DECISIONS as HOT_RATE_DECISIONS
from disagg.protocol.errors import ServingError
from disagg.serving.orchestrator import HOT_ROUTES, Outcome
from disagg.serving.telemetry import TIME_BUCKETS, TOKEN_BUCKETS, SloWindow, attains
from disagg.triton.metrics import Families, Gauge, SerialMetric

log = logging.getLogger(__name__)

HOT_RANKS = 4  # disagg_hot_group_requests_per_second series: the hottest groups' rates by rank

SERVER_STATES = ("up", "down", "unknown")  # disagg_remote_servers' states


def outcome_label(error: ServingError | None) -> str:
    return "ok" if error is None else error.code.lower()


class OrchestratorMetrics:
    """Per-request histograms, outcome counters and the live SLO gauges of one entry point."""

    def __init__(
        self,
        pb_utils: Any,
        model: str,
        path: str,
        window: SloWindow,
        instance: str = "",
        open_calls: Callable[[], int] | None = None,
        hot_groups: Callable[[], tuple[list[GroupRate], int]] | None = None,
        remote_servers: Callable[[], dict[tuple[str, str], int]] | None = None,
        remote_pools: tuple[str, ...] = (),
        hot_rate: Callable[[], tuple[float, Mapping[tuple[str, str], int]]] | None = None,
    ) -> None:
        """``open_calls()``: the instance's calls to the pools still open; ``hot_groups()``: the hot
        prompt groups, hottest first, and the near-duplicate groups' count; ``remote_servers()``: the
        servers of each of ``remote_pools`` by state (``SERVER_STATES``); ``hot_rate()``: the cap on
        each hot group (requests/s, 0: none) and the adaptive cap's decisions so far by (action,
        reason) (``Orchestrator.hot_rate``); all published at each refresh."""
        fam = Families(pb_utils)
        labels = {"model": model, "path": path}
        self._labels = labels
        self._fam = fam
        self.window = window
        self.ttft = fam.histogram("disagg_time_to_first_token_seconds", labels, TIME_BUCKETS)
        self.tpot = fam.histogram("disagg_time_per_output_token_seconds", labels, TIME_BUCKETS)
        self.latency = fam.histogram("disagg_request_latency_seconds", labels, TIME_BUCKETS)
        self.prompt = fam.histogram("disagg_prompt_tokens", labels, TOKEN_BUCKETS)
        self.output = fam.histogram("disagg_output_tokens", labels, TOKEN_BUCKETS)
        # the window is this instance's: one series per instance (dashboards average or sum them)
        own = {**labels, "instance": instance} if instance else labels
        self.attainment = fam.gauge("disagg_slo_attainment_ratio", own)
        self.goodput = fam.gauge("disagg_goodput_requests_per_second", own)
        self._open_calls = open_calls
        self.calls_open = fam.gauge("disagg_pool_calls_open", own)
        self.fallbacks = fam.metric("disagg_fallbacks_total", labels)
        self._hot_groups = hot_groups
        self.hot = fam.gauge("disagg_hot_groups", own)
        self.hot_rates = [
            fam.gauge("disagg_hot_group_requests_per_second", {**own, "rank": str(rank)})
            for rank in range(1, HOT_RANKS + 1)
        ]
        self.similar = fam.gauge("disagg_similar_prompt_groups", own)
        self._remote_servers = remote_servers
        self.remote = {
            (pool, state): fam.gauge("disagg_remote_servers", {**own, "pool": pool, "state": state})
            for pool in remote_pools
            for state in SERVER_STATES
        }
        self.hot_routes = {
            r: fam.metric("disagg_hot_routes_total", {**labels, "route": r}) for r in HOT_ROUTES
        }
        self._hot_rate = hot_rate
        self.hot_rate_limit = fam.gauge("disagg_hot_group_rate_limit", own)
        self.hot_rate_decisions = {
            (action, reason): fam.metric(
                "disagg_hot_rate_decisions_total", {**own, "action": action, "reason": reason}
            )
            for action, reason in HOT_RATE_DECISIONS
        }
        self._decided: dict[tuple[str, str], int] = {}  # the decisions published so far
        self._outcomes: dict[str, SerialMetric] = {}
        self._lock = threading.Lock()
        self._stop: threading.Event | None = None
        self._refresher: threading.Thread | None = None

    def _counter(self, outcome: str) -> SerialMetric:
        with self._lock:
            if outcome not in self._outcomes:
                labels = {**self._labels, "outcome": outcome}
                self._outcomes[outcome] = self._fam.metric("disagg_requests_total", labels)
            return self._outcomes[outcome]

    def observe(self, outcome: Outcome, finished_at: float) -> None:
        self._counter(outcome_label(outcome.error)).increment(1)
        if outcome.hot_route:
            self.hot_routes[outcome.hot_route].increment(1)
        if outcome.error is not None and outcome.error.code == "INVALID_ARG":
            return  # refused requests never ran: they say nothing about latency or SLOs
        if outcome.ttft is not None:
            self.ttft.observe(outcome.ttft)
        if outcome.tpot is not None:
            self.tpot.observe(outcome.tpot)
        self.latency.observe(finished_at - outcome.arrival)
        self.prompt.observe(outcome.prompt_tokens)
        self.output.observe(outcome.output_tokens)
        ok = outcome.error is None and attains(self.window.config, outcome.ttft, outcome.tpot)
        self.window.add(ok, finished_at)
        self.refresh()

    def refused(self, error: ServingError) -> None:
        """A request refused before it reached the orchestrator's path."""
        self._counter(outcome_label(error)).increment(1)

    def start_refresher(self, interval_s: float = 1.0) -> None:
        """Keep the SLO gauges current while no request ends (goodput decays as the window slides).

        Published once at once: a reloaded model's series (same labels) would otherwise show the old
        instance's last values until the first refresh."""
        self.refresh()
        stop = self._stop = threading.Event()

        def run() -> None:
            while not stop.wait(interval_s):
                try:
                    self.refresh()
                except Exception:
                    log.warning("refreshing SLO gauges failed", exc_info=True)

        self._refresher = threading.Thread(target=run, name="metrics-slo", daemon=True)
        self._refresher.start()

    def stop(self) -> None:
        """Stop refreshing and take this instance's share out of its gauges (see ``Gauge``)."""
        if self._stop is not None:
            self._stop.set()
        if self._refresher is not None and self._refresher.is_alive():
            self._refresher.join(timeout=5)
        for gauge in (
            self.attainment,
            self.goodput,
            self.calls_open,
            self.hot,
            self.similar,
            self.hot_rate_limit,
            *self.hot_rates,
            *self.remote.values(),
        ):
            gauge.set(0)

    def refresh(self) -> None:
        """Publish the window's attainment (1.0 while empty: nothing missed) and goodput."""
        attainment = self.window.attainment()
        self.attainment.set(1.0 if attainment is None else attainment)
        self.goodput.set(self.window.goodput())
        if self._open_calls is not None:
            self.calls_open.set(self._open_calls())
        if self._remote_servers is not None:
            counts = self._remote_servers()
            for key, gauge in self.remote.items():
                gauge.set(counts.get(key, 0))
        if self._hot_groups is not None:
            groups, similar = self._hot_groups()
            self.hot.set(len(groups))
            for rank, gauge in enumerate(self.hot_rates):
                gauge.set(groups[rank].rate if rank < len(groups) else 0.0)
            self.similar.set(similar)
        if self._hot_rate is not None:
            self._publish_hot_rate(*self._hot_rate())

    def _publish_hot_rate(self, limit: float, decisions: Mapping[tuple[str, str], int]) -> None:
        self.hot_rate_limit.set(limit)
        with self._lock:  # refreshed by the event loop and the refresher thread
            for key, total in decisions.items():
                delta = total - self._decided.get(key, 0)
                counter = self.hot_rate_decisions.get(key)
                if counter is not None and delta > 0:
                    counter.increment(delta)
                    self._decided[key] = total


class VersionMetrics:
    """The versions an entry point pins its requests to (``disagg.serving.routing``): the version new
    requests take per pool model, and the requests in flight per pool model and version, which a
    rollout waits to fall to zero before it unloads a version. Called on the event loop only."""

    def __init__(self, pb_utils: Any, model: str, instance: str) -> None:
        self._fam = Families(pb_utils)
        self._labels = {"model": model, "instance": instance}
        self._serving: dict[str, Gauge] = {}
        self._pinned: dict[tuple[str, int], Gauge] = {}
        self._counts: dict[tuple[str, int], int] = {}

    def pin(self, versions: Mapping[str, int]) -> None:
        """A request pinned to ``versions`` (pool model -> version) starts."""
        for pool, version in versions.items():
            if pool not in self._serving:
                self._serving[pool] = self._fam.gauge(
                    "disagg_serving_version", {**self._labels, "pool": pool}
                )
            self._serving[pool].set(version)
            self._move((pool, version), 1)

    def unpin(self, versions: Mapping[str, int]) -> None:
        """A request pinned to ``versions`` ended."""
        for key in versions.items():
            self._move(key, -1)

    def _move(self, key: tuple[str, int], delta: int) -> None:
        if key not in self._pinned:
            labels = {**self._labels, "pool": key[0], "version": str(key[1])}
            self._pinned[key] = self._fam.gauge("disagg_pinned_requests", labels)
        self._counts[key] = self._counts.get(key, 0) + delta
        self._pinned[key].set(self._counts[key])

    def retire(self) -> None:
        for gauge in (*self._serving.values(), *self._pinned.values()):
            gauge.set(0)
