"""The metric contract between the serving models and everything that reads their `/metrics`.

The serving side exports these families on Triton's own `/metrics` (port 8002 by default) through
`pb_utils.MetricFamily`; the autoscaler, the Grafana dashboard and the KEDA objects under `deploy/`
read them. A test on each side checks its half: `tests/unit/test_deploy.py` that every `disagg_*` name
the readers use is listed here, and the serving side's integration test that the server exports them.

Labels: `model` is the Triton model name of the pool (`prefill`, `decode`, `colocated`, ...); `path`
(`disaggregated` / `colocated` / `fallback`) on the request-level families; `pool` on the KV block
gauges; `outcome` on `disagg_requests_total`. Units are seconds and bytes.

What the autoscaler assumes about meaning (checked against backends/disagg/triton/metrics.py):

- `disagg_prefill_pending_tokens` / `disagg_prefill_queue_requests`: prompt tokens / requests queued
  for prefill (not yet executing). A burst is visible here at admission, before any first token;
- `disagg_prompt_tokens` is observed when a request ends, so the windowed prompt-length distribution
  lags by a request's lifetime; it sizes the "own prefill" part of the TTFT budget, not the burst;
- `disagg_decode_active_sequences`: sequences in the decode batch; zero means the pool is drained;
- pool gauges are summed over series, which is right only if each instance (or pod) exports its own
  series; equal label sets from several instances would overwrite each other.
"""

from __future__ import annotations

from types import MappingProxyType

HISTOGRAM = "histogram"
GAUGE = "gauge"
COUNTER = "counter"

METRIC_NAMES: MappingProxyType[str, str] = MappingProxyType(
    {
        # histograms (seconds buckets span 1 ms .. 10 min)
        "disagg_time_to_first_token_seconds": HISTOGRAM,
        "disagg_time_per_output_token_seconds": HISTOGRAM,
        "disagg_request_latency_seconds": HISTOGRAM,
        "disagg_prompt_tokens": HISTOGRAM,
        "disagg_output_tokens": HISTOGRAM,
        "disagg_kv_transfer_seconds": HISTOGRAM,
        "disagg_pool_recovery_seconds": HISTOGRAM,  # exported by the entry point that restarts pools
        # gauges
        "disagg_prefill_queue_requests": GAUGE,
        "disagg_prefill_pending_tokens": GAUGE,
        "disagg_decode_active_sequences": GAUGE,
        "disagg_kv_blocks_used": GAUGE,
        "disagg_kv_blocks_free": GAUGE,  # cached prefix blocks included: they are evicted on demand
        "disagg_prefix_cache_blocks": GAUGE,  # of the free blocks, those keeping a prefix
        "disagg_slo_attainment_ratio": GAUGE,
        "disagg_goodput_requests_per_second": GAUGE,
        "disagg_engine_info": GAUGE,  # 1 per pool instance; labels say its dtypes and kernels
        "disagg_pool_load_seconds": GAUGE,  # per pool instance: from its load to serving
        "disagg_pool_health": GAUGE,  # per entry point instance and pool: 0 healthy, 1 saturated, 2 gone
        "disagg_serving_mode": GAUGE,  # per entry point instance: 1 on the rung new requests take
        "disagg_pool_calls_open": GAUGE,  # per entry point instance: calls to pools not yet ended
        "disagg_hot_groups": GAUGE,  # per entry point instance: hot prompt (prefix) groups now
        "disagg_hot_group_requests_per_second": GAUGE,  # + label rank (1..4): the hottest groups' rates
        "disagg_similar_prompt_groups": GAUGE,  # near-duplicate (MinHash) groups; not routed on
        "disagg_hot_group_rate_limit": GAUGE,  # per entry point instance: req/s per hot group (0: no cap)
        # counters (full sample names, `_total` included)
        "disagg_requests_total": COUNTER,
        "disagg_kv_transfer_bytes_total": COUNTER,
        "disagg_kv_exported_bytes_total": COUNTER,  # per prefill pool instance: the exporter's count
        "disagg_kv_transfer_failures_total": COUNTER,
        "disagg_kv_lease_expired_total": COUNTER,
        "disagg_kv_incompatible_total": COUNTER,  # per decode pool instance: KV of another version
        "disagg_kv_lease_renewals_total": COUNTER,
        "disagg_fallbacks_total": COUNTER,  # + labels from, to, reason
        "disagg_migrations_total": COUNTER,
        "disagg_degraded_requests_total": COUNTER,  # labels rung, capped
        "disagg_pool_restarts_total": COUNTER,
        "disagg_engine_steps_total": COUNTER,
        "disagg_engine_busy_seconds_total": COUNTER,
        "disagg_prefix_cache_hits_total": COUNTER,  # in blocks, per pool instance
        "disagg_prefix_cache_misses_total": COUNTER,
        "disagg_prefix_cache_evictions_total": COUNTER,
        "disagg_hot_routes_total": COUNTER,  # label route: cold, hot_shared, hot_pool, hot_delayed, ...
        "disagg_hot_rate_decisions_total": COUNTER,  # labels action, reason: the adaptive hot-group cap
        "disagg_decode_batch_limit": GAUGE,  # per decode pool instance: the batch tuner's limit, or fixed
        # core loans (labels lender, core; borrower on the borrowed seconds): a default deployment's
        "disagg_lent_core_seconds_total": COUNTER,
        "disagg_borrowed_core_seconds_total": COUNTER,
        "disagg_loan_reclaim_waits_total": COUNTER,
        "disagg_loan_reclaim_wait_seconds_total": COUNTER,
    }
)
"""Every family the server must export: name -> kind. The serving side may import this."""

AUTOSCALER_METRIC_NAMES: MappingProxyType[str, str] = MappingProxyType(
    {
        "disagg_autoscaler_current_size": GAUGE,
        "disagg_autoscaler_desired_size": GAUGE,
        "disagg_autoscaler_decisions_total": COUNTER,
        "disagg_autoscaler_fail_static_total": COUNTER,
        "disagg_autoscaler_scrape_failures_total": COUNTER,
        "disagg_autoscaler_actuator_failures_total": COUNTER,
        "disagg_autoscaler_last_error_timestamp_seconds": GAUGE,
        "disagg_autoscaler_scheduled_size": GAUGE,  # with a schedule: its window's size, bounded
        "disagg_autoscaler_released_size": GAUGE,  # with a schedule: instances released now
        "disagg_autoscaler_planned_size": GAUGE,  # with the planner: its last recommended size
    }
)
"""The autoscaler's own families on its `/metrics` (label `pool`; `kind` on decisions, `reason` on
fail-static and last error)."""

HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")


def family_of(sample_name: str) -> str:
    """The family a sample name belongs to: `x_bucket`/`x_sum`/`x_count` -> `x` for contract histograms."""
    for suffix in HISTOGRAM_SUFFIXES:
        base = sample_name.removesuffix(suffix)
        if base != sample_name and METRIC_NAMES.get(base) == HISTOGRAM:
            return base
    return sample_name
