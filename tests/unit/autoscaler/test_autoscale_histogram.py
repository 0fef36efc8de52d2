"""Windowed percentiles from cumulative histograms: deltas, resets, validation, parsing."""

from __future__ import annotations

import pytest
from autoscale_factory import PENDING, PROMPT, TTFT, FakeExporter, prefill_exporter

from disagg_tools.autoscaler.histogram import (
    Histogram,
    HistogramWindow,
    counter_delta,
    histogram_delta,
    read_histograms,
)
from disagg_tools.autoscaler.snapshot import GarbageMetrics, parse_exposition, parse_prometheus_api


def snap(ex: FakeExporter, t: float = 0.0):
    return parse_exposition(ex.render(), t)


def test_quantile_interpolates_like_histogram_quantile() -> None:
    h = Histogram((0.1, 0.2, float("inf")), (50.0, 100.0, 100.0), 12.0, 100.0)
    assert h.quantile(0.5) == pytest.approx(0.1)
    assert h.quantile(0.75) == pytest.approx(0.15)
    assert Histogram.empty((1.0, float("inf"))).quantile(0.99) is None
    # In the +Inf bucket: the highest finite bound, a lower bound of the truth.
    assert Histogram((0.1, float("inf")), (0.0, 10.0), 50.0, 10.0).quantile(0.99) == 0.1


def test_percentile_comes_from_the_window_not_lifetime_totals() -> None:
    ex = prefill_exporter()
    ex.observe(TTFT, 0.02, n=10_000, model="prefill", path="disaggregated")
    before = snap(ex)
    ex.observe(TTFT, 4.0, n=100, model="prefill", path="disaggregated")
    after = snap(ex)
    lifetime = read_histograms(after, TTFT)
    (whole,) = lifetime.values()
    assert whole.quantile(0.99) < 0.1  # lifetime totals hide the regression
    delta = histogram_delta(before, after, TTFT, model="prefill")
    assert delta is not None and delta.count == 100
    assert delta.quantile(0.99) > 2.5


def test_counter_reset_counts_from_zero_never_negative() -> None:
    ex = prefill_exporter()
    ex.observe(TTFT, 0.5, n=500, model="prefill", path="disaggregated")
    ex.observe(PROMPT, 100, n=500, model="prefill", path="disaggregated")
    before = snap(ex)
    ex.restart()
    ex.observe(TTFT, 0.02, n=7, model="prefill", path="disaggregated")
    ex.observe(PROMPT, 100, n=7, model="prefill", path="disaggregated")
    after = snap(ex)
    delta = histogram_delta(before, after, TTFT, model="prefill")
    assert delta is not None and delta.count == 7
    assert all(c >= 0 for c in delta.cumulative)
    assert counter_delta(before, after, f"{PROMPT}_sum", model="prefill") == pytest.approx(700)


def test_deltas_sum_over_series_of_several_pods_and_paths() -> None:
    ex = prefill_exporter()
    ex.declare(TTFT, (0.1, 1.0), model="prefill", path="colocated")
    ex.declare(TTFT, (0.1, 1.0), model="prefill", path="x")
    before = snap(ex)
    ex.observe(TTFT, 0.05, n=3, model="prefill", path="disaggregated")
    with pytest.raises(GarbageMetrics):  # different bucket layouts cannot be summed
        histogram_delta(before, snap(ex), TTFT, model="prefill")
    delta = histogram_delta(before, snap(ex), TTFT, model="prefill", path="disaggregated")
    assert delta is not None and delta.count == 3


def test_window_keeps_only_recent_deltas() -> None:
    w = HistogramWindow(60.0)
    fast = Histogram((0.1, float("inf")), (10.0, 10.0), 0.5, 10.0)
    slow = Histogram((0.1, float("inf")), (0.0, 10.0), 50.0, 10.0)
    w.add(0.0, fast)
    w.add(30.0, slow)
    merged = w.merged(30.0)
    assert merged is not None and merged.count == 20
    merged = w.merged(61.0)
    assert merged is not None and merged.count == 10 and merged.quantile(0.5) == 0.1


@pytest.mark.parametrize(
    "text",
    [
        "<html>503</html>",
        'disagg_prefill_pending_tokens{model="prefill"} NaN\n',
        'disagg_prefill_pending_tokens{model="prefill"} -3\n',
        'disagg_prefill_pending_tokens{model="prefill" 3\n',
    ],
)
def test_garbage_exposition_is_refused(text: str) -> None:
    with pytest.raises(GarbageMetrics):
        parse_exposition(text, 0.0)


def test_non_cumulative_buckets_and_missing_inf_are_garbage() -> None:
    text = (
        "# TYPE disagg_time_to_first_token_seconds histogram\n"
        'disagg_time_to_first_token_seconds_bucket{model="prefill",le="0.1"} 5\n'
        'disagg_time_to_first_token_seconds_bucket{model="prefill",le="1"} 3\n'
        'disagg_time_to_first_token_seconds_bucket{model="prefill",le="+Inf"} 5\n'
        'disagg_time_to_first_token_seconds_count{model="prefill"} 5\n'
    )
    with pytest.raises(GarbageMetrics):
        read_histograms(parse_exposition(text, 0.0), TTFT)
    no_inf = 'disagg_time_to_first_token_seconds_bucket{model="prefill",le="0.1"} 5\n'
    with pytest.raises(GarbageMetrics):
        read_histograms(parse_exposition(no_inf, 0.0), TTFT)


def test_prometheus_api_answers_give_the_same_samples_and_sample_times() -> None:
    ex = prefill_exporter()
    ex.set(PENDING, 1234, model="prefill")
    values, stamps = ex.prometheus_answers(sample_time=500.0)
    s = parse_prometheus_api(values, stamps, taken_at=520.0)
    assert s.samples == snap(ex).samples
    assert s.oldest_sample_time([PENDING], model="prefill") == 500.0
    with pytest.raises(GarbageMetrics):
        parse_prometheus_api({"status": "error"}, {}, 0.0)
    with pytest.raises(GarbageMetrics):
        parse_prometheus_api({"status": "success", "data": {"resultType": "matrix"}}, {}, 0.0)
