"""The ``disagg_*`` metric families on Triton's own ``/metrics`` (through ``pb_utils.MetricFamily``):
their descriptions, and the one place metrics are created (``Families``), each wrapped so that Triton
2.51's stub-side metrics are used safely (``SerialMetric``, ``Gauge``).

Names and kinds are the contract in ``disagg_tools.autoscaler.contract.METRIC_NAMES`` (dashboards,
KEDA and the autoscaler read them). Per-request families are observed by the orchestrator when a
request ends (``disagg.triton.request_metrics``); pool gauges and transfer counters are refreshed by a
reporter thread per pool instance (``disagg.triton.pool_metrics``: every setter is a round trip to the
server, so not on the engine's hot path).
"""

from __future__ import annotations

import threading
from typing import Any

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
    "disagg_pool_load_seconds": (
        "GAUGE",
        "Seconds a live pool instance took from its load to serving: engine and KV cache, probe, warm-up "
        "prompt and (on a GPU, with cuda_graphs) graph capture; 0 once retired",
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
    ``Metric::~Metric`` -> ``rbtree_best_fit::priv_deallocate``). ``disagg_tools.repro.metric_race``
    reproduces it. Every metric this package creates goes through this lock.
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
