"""The ``disagg_*`` metric families on Triton's own ``/metrics`` (through ``pb_utils.MetricFamily``).

Names and kinds are the contract in ``disagg_tools.autoscaler.contract.METRIC_NAMES`` (dashboards,
KEDA and the autoscaler read them). Per-request families are observed by the orchestrator when a
request ends; pool gauges and transfer counters are refreshed by a reporter thread per pool instance
(every setter is a round trip to the server, so not on the engine's hot path).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from disagg.hot.hotness import GroupRate
from disagg.hot.throttle import DECISIONS as HOT_RATE_DECISIONS
from disagg.procfs import stub_pids
from disagg.protocol.errors import ServingError
from disagg.serving.auth import REFUSALS
from disagg.serving.orchestrator import HOT_ROUTES, Outcome
from disagg.serving.telemetry import TIME_BUCKETS, TOKEN_BUCKETS, SloWindow, attains

if TYPE_CHECKING:
    # Types only: both import torch, and the text models that use this module must not.
    from disagg.engine.loan import LoanStats
    from disagg.kv.transport import Transport
    from disagg.pool.loop import EngineLoop

log = logging.getLogger(__name__)

HOT_RANKS = 4  # disagg_hot_group_requests_per_second series: the hottest groups' rates by rank

DESCRIPTIONS = {
    "disagg_time_to_first_token_seconds": ("HISTOGRAM", "Time to first token: first token - arrival"),
    "disagg_time_per_output_token_seconds": ("HISTOGRAM", "Time per output token: (last - first) / (n - 1)"),
    "disagg_request_latency_seconds": ("HISTOGRAM", "Arrival to last response"),
    "disagg_prompt_tokens": ("HISTOGRAM", "Prompt length in tokens"),
    "disagg_output_tokens": ("HISTOGRAM", "Generated tokens per request"),
    "disagg_kv_transfer_seconds": ("HISTOGRAM", "KV hand-off time on the importing side (verify + copy)"),
    "disagg_prefill_queue_requests": ("GAUGE", "Requests waiting for prefill"),
    "disagg_prefill_pending_tokens": ("GAUGE", "Prompt tokens waiting for prefill"),
    "disagg_decode_active_sequences": ("GAUGE", "Sequences in the decode batch"),
    "disagg_kv_blocks_used": ("GAUGE", "KV cache blocks in use"),
    "disagg_kv_blocks_free": ("GAUGE", "KV cache blocks free"),
    "disagg_prefix_cache_blocks": (
        "GAUGE",
        "Free KV blocks that keep a cached prefix (evicted first-in LRU)",
    ),
    "disagg_prefix_cache_hits_total": ("COUNTER", "Full prompt blocks found in the prefix cache"),
    "disagg_prefix_cache_misses_total": ("COUNTER", "Full prompt blocks looked up and computed"),
    "disagg_prefix_cache_evictions_total": ("COUNTER", "Cached prefix blocks dropped to make room"),
    "disagg_slo_attainment_ratio": (
        "GAUGE",
        "Share of requests in the window meeting both TTFT and TPOT SLOs",
    ),
    "disagg_goodput_requests_per_second": ("GAUGE", "Requests per second meeting both SLOs, over the window"),
    "disagg_engine_info": (
        "GAUGE",
        "1 per live pool instance; labels: the engine's resolved compute and KV dtypes, projection and "
        "attention paths",
    ),
    "disagg_requests_total": ("COUNTER", "Requests ended, by outcome"),
    "disagg_kv_transfer_bytes_total": ("COUNTER", "KV bytes handed off (counted by the importer)"),
    "disagg_kv_exported_bytes_total": ("COUNTER", "KV bytes exported for hand-off (counted by the exporter)"),
    "disagg_kv_transfer_failures_total": ("COUNTER", "KV hand-offs that failed (refused, broken, corrupt)"),
    "disagg_kv_incompatible_total": (
        "COUNTER",
        "KV hand-offs refused because the KV came from another model version (fingerprint mismatch)",
    ),
    "disagg_kv_lease_expired_total": ("COUNTER", "KV leases that expired before the importer acked"),
    "disagg_kv_lease_renewals_total": (
        "COUNTER",
        "KV leases kept past their TTL: the importer still waited for blocks (counted by the exporter)",
    ),
    "disagg_fallbacks_total": (
        "COUNTER",
        "Requests that fell below a ladder rung; labels from, to and reason (the pool and its state)",
    ),
    "disagg_migrations_total": ("COUNTER", "Streams moved to another rung after their pool failed"),
    "disagg_degraded_requests_total": (
        "COUNTER",
        "Requests served on a rung below the entry point's first; capped: under the local output cap",
    ),
    "disagg_pool_health": (
        "GAUGE",
        "A pool's health as one orchestrator sees it: 0 healthy, 1 saturated, 2 gone",
    ),
    "disagg_serving_mode": ("GAUGE", "1 on the ladder rung new requests take now, 0 on the others"),
    "disagg_pool_calls_open": (
        "GAUGE",
        "Calls an entry point instance has open to the pools (waiting for their final response)",
    ),
    "disagg_remote_servers": (
        "GAUGE",
        "Servers of a pool on other hosts as one entry point instance sees them, by state: up (in "
        "rotation), down (failed a call or a ping), unknown (not pinged yet)",
    ),
    "disagg_pool_restarts_total": ("COUNTER", "Restarts of a gone pool through model control"),
    "disagg_pool_recovery_seconds": ("HISTOGRAM", "From a pool found gone to its probes healthy again"),
    "disagg_hot_groups": ("GAUGE", "Hot prompt groups now: prefixes shared by a burst of requests"),
    "disagg_hot_group_requests_per_second": (
        "GAUGE",
        "Requests per second of the rank-th hottest prompt group over the detection window (0: none)",
    ),
    "disagg_similar_prompt_groups": (
        "GAUGE",
        "Near-duplicate prompt groups (MinHash) at the hot threshold in the window; reported, not routed",
    ),
    "disagg_hot_routes_total": (
        "COUNTER",
        "New requests by their hot-prompt routing: cold, hot_shared, hot_pool, hot_delayed, hot_refused",
    ),
    "disagg_hot_group_rate_limit": (
        "GAUGE",
        "Requests per second each hot prompt group may start now (the token buckets' rate; 0: no cap)",
    ),
    "disagg_hot_rate_decisions_total": (
        "COUNTER",
        "Adaptive hot-group cap decisions per probe interval, by action (decrease, increase, hold, "
        "recover) and reason",
    ),
    "disagg_serving_version": (
        "GAUGE",
        "Per entry point instance and pool model: the version new requests are pinned to (rollouts)",
    ),
    "disagg_pinned_requests": (
        "GAUGE",
        "Per entry point instance, pool model and version: requests in flight pinned to that version",
    ),
    "disagg_decode_batch_limit": (
        "GAUGE",
        "Sequences the decode batch may hold now (the batch tuner's limit)",
    ),
    "disagg_batch_tuner_decisions_total": (
        "COUNTER",
        "Decode batch tuner decisions per interval, by action (grow, shrink, hold) and reason",
    ),
    "disagg_borrowed_core_seconds_total": (
        "COUNTER",
        "Seconds a prefill pool's borrowed helpers computed on a core the decode pool lent it",
    ),
    "disagg_lent_core_seconds_total": ("COUNTER", "Seconds a decode pool had a core of its own lent"),
    "disagg_loan_reclaim_waits_total": (
        "COUNTER",
        "Times a decode pool taking a lent core back waited for the borrowed part in flight",
    ),
    "disagg_loan_reclaim_wait_seconds_total": ("COUNTER", "Seconds those reclaims waited"),
    "disagg_engine_steps_total": (
        "COUNTER",
        "Engine calls of a pool instance: prompts prefilled (prefill), batch steps (decode, colocated)",
    ),
    "disagg_pool_auth_refusals_total": (
        "COUNTER",
        "Pool calls refused for their internal token, by reason: malformed (or none), mismatch (forged, "
        "or signed for another job or control message), expired",
    ),
    "disagg_engine_busy_seconds_total": (
        "COUNTER",
        "Seconds a pool instance's engine spent computing; its rate is the instance's utilisation",
    ),
}


class Families:
    """Creates each family once per process.

    Families and their metrics live as long as the process. Deleting them when an instance goes is
    not safe on Triton 2.51: a reloaded model's new instance holds series with the same labels before
    the old one is finalized, and Triton drops a series when any one holder deletes it (seen: the new
    instance's requests and the next reload hung). A retiring pool instance zeroes its gauges
    instead (``PoolReporter.retire``).
    """

    def __init__(self, pb_utils: Any) -> None:
        self._pb = pb_utils
        self._families: dict[str, Any] = {}

    def __getitem__(self, name: str) -> Any:
        if name not in self._families:
            kind, description = DESCRIPTIONS[name]
            self._families[name] = self._pb.MetricFamily(
                name=name, description=description, kind=getattr(self._pb.MetricFamily, kind)
            )
        return self._families[name]

    def histogram(self, name: str, labels: dict[str, str], buckets: tuple[float, ...]) -> SerialMetric:
        return SerialMetric(self[name].Metric(labels=labels, buckets=list(buckets)))

    def metric(self, name: str, labels: dict[str, str]) -> SerialMetric:
        return SerialMetric(self[name].Metric(labels=labels))

    def gauge(self, name: str, labels: dict[str, str]) -> Gauge:
        return Gauge(self.metric(name, labels))


class SerialMetric:
    """A ``pb_utils.Metric`` whose operations run one at a time.

    On Triton 2.51 each operation of a stub-side ``Metric`` (``increment``, ``set``, ``observe``,
    ``value``) rewrites the metric's shared-memory record and releases the GIL while the server reads
    it. Two threads operating on one metric at once (the orchestrator's event loop ending a request and
    the SLO refresher, say) free the record the server is still reading, and the server process dies
    with SIGSEGV in ``libtriton_python.so`` (``ModelInstanceState::ProcessMetricRequest`` ->
    ``Metric::~Metric`` -> ``rbtree_best_fit::priv_deallocate``). ``perf/metric_race.py`` reproduces
    it. Every metric this package creates goes through this lock.
    """

    def __init__(self, metric: Any) -> None:
        self._metric = metric
        self._lock = threading.Lock()

    def increment(self, value: float) -> None:
        with self._lock:
            self._metric.increment(value)

    def observe(self, value: float) -> None:
        with self._lock:
            self._metric.observe(value)

    def value(self) -> float:
        with self._lock:
            return float(self._metric.value())


class Gauge:
    """A Triton gauge moved by increments only.

    On Triton 2.51 ``Metric.set()`` (like ``value()``) holds the GIL across its round trip to the
    server, while ``increment()`` releases it: every set stalls the stub's other Python threads (the
    engine loop, the orchestrator's event loop) for that round trip, and once the server is gone it
    blocks forever with the GIL held, so nothing else in the stub runs again (not even the watch that
    would end it, ``disagg.triton.watchdog``). This keeps the value it published and sends the
    difference, and nothing when unchanged. Several holders of one series (a reloaded instance and
    the one it replaces) then add up: each zeroes its share when it retires. Setters on several
    threads are serialised, so the differences always add up to the last value set.
    """

    def __init__(self, metric: Any) -> None:
        self._metric = metric
        self._value = 0.0  # a new Triton gauge starts at 0
        self._lock = threading.Lock()

    @property
    def value(self) -> float:
        """What this holder has published (no round trip)."""
        return self._value

    def set(self, value: float) -> None:
        value = float(value)
        with self._lock:
            delta = value - self._value
            if delta:
                self._metric.increment(delta)
                self._value = value

    def adopt(self) -> None:
        """Take what the series holds now as this holder's own share: the share of a holder that died
        without retiring (``kill -9``), which nobody else would ever take back. The next ``set`` then
        moves the series to the true value. Only when no other holder lives: a live one zeroes its
        own share when it retires."""
        with self._lock:
            self._value = float(self._metric.value())


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


class PoolReporter:
    """A thread that publishes one pool instance's gauges and KV counters every ``interval_s``."""

    def __init__(
        self,
        pb_utils: Any,
        model: str,
        instance: str,
        loop: EngineLoop,
        transport: Transport | None,
        version: int = 1,
        interval_s: float = 0.25,
    ) -> None:
        fam = self._fam = Families(pb_utils)  # families must outlive their metrics
        role = loop.role.value
        # one series per instance: instances are processes, and a shared series would be overwritten
        # (two versions of a pool, loaded side by side during a rollout, have instances of one name)
        labels = {"model": model, "pool": role, "instance": instance, "version": str(version)}
        self._loop, self._transport, self._interval = loop, transport, interval_s
        self.used = fam.gauge("disagg_kv_blocks_used", labels)
        self.free = fam.gauge("disagg_kv_blocks_free", labels)
        self.cached = fam.gauge("disagg_prefix_cache_blocks", labels)
        self.hits = fam.metric("disagg_prefix_cache_hits_total", labels)
        self.misses = fam.metric("disagg_prefix_cache_misses_total", labels)
        self.evictions = fam.metric("disagg_prefix_cache_evictions_total", labels)
        self.queue = fam.gauge("disagg_prefill_queue_requests", labels) if role == "prefill" else None
        self.pending = fam.gauge("disagg_prefill_pending_tokens", labels) if role == "prefill" else None
        self.active = fam.gauge("disagg_decode_active_sequences", labels) if role != "prefill" else None
        self._labels = labels
        self.limit = fam.gauge("disagg_decode_batch_limit", labels) if role == "decode" else None
        self.series: dict[str, SerialMetric] = {}  # counters made when first seen, by their key in _seen
        self.bytes = fam.metric("disagg_kv_transfer_bytes_total", labels)
        self.exported = fam.metric("disagg_kv_exported_bytes_total", labels)
        self.failures = fam.metric("disagg_kv_transfer_failures_total", labels)
        self.incompatible = fam.metric("disagg_kv_incompatible_total", labels)
        self.expired = fam.metric("disagg_kv_lease_expired_total", labels)
        self.renewals = fam.metric("disagg_kv_lease_renewals_total", labels)
        self.transfer = fam.histogram("disagg_kv_transfer_seconds", labels, TIME_BUCKETS)
        self.steps = fam.metric("disagg_engine_steps_total", labels)
        self.busy = fam.metric("disagg_engine_busy_seconds_total", labels)
        self.refusals = {
            reason: fam.metric("disagg_pool_auth_refusals_total", {**labels, "reason": reason})
            for reason in REFUSALS
        }
        self.info = fam.gauge("disagg_engine_info", {**labels, **loop.engine.describe()})
        self._adopt_orphaned_shares(model)
        self.info.set(1)
        self._seen = {
            "bytes": 0.0,
            "exported": 0.0,
            "failures": 0.0,
            "expired": 0.0,
            "renewals": 0.0,
            "steps": 0.0,
            "busy": 0.0,
            "hits": 0.0,
            "misses": 0.0,
            "evictions": 0.0,
            "incompatible": 0.0,
        }
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"metrics-{role}", daemon=True)

    def _adopt_orphaned_shares(
        self, model: str, live_stubs: Callable[[int, str], list[int]] = stub_pids
    ) -> None:
        """An instance reloaded after its stub was killed registers the same series while the dead
        stub's last published gauges are still in them (it never retired): with no other stub of this
        model alive under this server, whatever the gauges hold is such a share, and this instance
        takes it over so that its first publish corrects it. With another stub alive (a reload
        beside a live instance, or a second instance) nothing is taken: that one retires its own."""
        try:
            if any(pid != os.getpid() for pid in live_stubs(os.getppid(), model)):
                return
            for gauge in self._gauges():
                gauge.adopt()
        except Exception:
            log.warning(
                "could not read the pool's gauges at load; a crashed predecessor's values stay", exc_info=True
            )

    def refused(self, reason: str) -> None:
        """A call refused for its token (a reason of ``disagg.serving.auth.REFUSALS``)."""
        self.refusals[reason].increment(1)

    def start(self) -> PoolReporter:
        self.publish()
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)

    def retire(self) -> None:
        """Stop publishing and zero this instance's gauges: its series stay on /metrics (see
        ``Families``), but an instance removed by a scale-in or an unload no longer adds its last
        queue, sequences or KV blocks to the pool's sums. Counters keep their totals."""
        self.stop()
        try:
            self.publish()  # the counters' last increments
        except Exception:
            log.warning("publishing pool metrics failed", exc_info=True)
        for gauge in self._gauges():
            gauge.set(0)

    def _gauges(self) -> list[Gauge]:
        """This instance's gauges (the ones its role has): what it zeroes when it retires, and takes
        over at load from a predecessor that never retired."""
        gauges = (
            self.used,
            self.free,
            self.cached,
            self.queue,
            self.pending,
            self.active,
            self.limit,
            self.info,
        )
        return [gauge for gauge in gauges if gauge is not None]

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                self.publish()
            except Exception:
                log.warning("publishing pool metrics failed", exc_info=True)

    def publish(self) -> None:
        stats = self._loop.stats()
        self.used.set(stats.blocks_used)
        self.free.set(stats.blocks_free)
        if self.queue is not None:
            self.queue.set(stats.queued)
            self.pending.set(stats.queued_prompt_tokens)
        if self.active is not None:
            self.active.set(stats.active_sequences)
        self._add(self.steps, "steps", stats.engine_steps)
        self._add(self.busy, "busy", stats.owned_busy_s)  # borrowed help counted as own time
        self.cached.set(stats.blocks_cached)
        self._add(self.hits, "hits", stats.prefix_hits)
        self._add(self.misses, "misses", stats.prefix_misses)
        self._add(self.evictions, "evictions", stats.prefix_evictions)
        self._add(self.incompatible, "incompatible", stats.kv_incompatible)
        if self.limit is not None:
            self.limit.set(stats.batch_limit)
        for action, reason, count in stats.batch_decisions:
            labels = {**self._labels, "action": action, "reason": reason}
            name = "disagg_batch_tuner_decisions_total"
            self._add_series(f"decisions/{action}/{reason}", name, labels, count)
        for loan in stats.loans:
            self._publish_loan(loan)
        if self._transport is None:
            return
        snap = self._transport.stats.snapshot()
        self._add(self.bytes, "bytes", snap.bytes_imported)
        self._add(self.exported, "exported", snap.bytes_exported)
        # an import whose checksum did not match is one of its failures already (counted once)
        self._add(self.failures, "failures", snap.failures + snap.refused)
        self._add(self.expired, "expired", snap.lease_expiries)
        self._add(self.renewals, "renewals", snap.lease_renewals)
        while self._loop.transfer_times:
            self.transfer.observe(self._loop.transfer_times.popleft())

    def _publish_loan(self, loan: LoanStats) -> None:
        """A borrower's borrowed core-seconds; a lender's lent seconds and reclaims that waited."""
        if not loan.lender:
            return  # no lender has come yet: nothing was lent
        core = str(loan.core)
        if self._loop.role.value == "prefill":
            labels = {**self._labels, "borrower": self._labels["model"], "lender": loan.lender, "core": core}
            series = {"disagg_borrowed_core_seconds_total": loan.borrowed_s}
        else:
            labels = {**self._labels, "lender": loan.lender, "core": core}
            series = {
                "disagg_lent_core_seconds_total": loan.lent_s,
                "disagg_loan_reclaim_waits_total": float(loan.waits),
                "disagg_loan_reclaim_wait_seconds_total": loan.wait_s,
            }
        for name, total in series.items():
            self._add_series(f"loans/{name}/{loan.lender}/{core}", name, labels, total)

    def _add_series(self, key: str, name: str, labels: dict[str, str], total: float) -> None:
        """``_add`` to a counter of family ``name`` made the first time ``key`` is seen."""
        if key not in self.series:
            self.series[key] = self._fam.metric(name, labels)
            self._seen[key] = 0.0
        self._add(self.series[key], key, total)

    def _add(self, counter: SerialMetric, key: str, total: float) -> None:
        delta = total - self._seen[key]
        if delta > 0:
            counter.increment(delta)
            self._seen[key] = total
