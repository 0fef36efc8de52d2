"""TTFT/TPOT/attainment/goodput/throughput arithmetic on a hand-written trace.

Times are binary fractions so that every expected value below is exact in floating point.
"""

from __future__ import annotations

import pytest

from perf.benchlib.metrics import RequestRecord, Slo, percentile, summarize

SLO = Slo(ttft_s=0.5, tpot_s=0.125)


def rec(i, arrival, sent, first, last, n, error=None):
    return RequestRecord(i, arrival, sent, first, last, n, n, 10, n, error)


TRACE = [
    rec(0, 0.0, 0.0, 0.25, 1.25, 5),  # TTFT 0.25, TPOT 1.0/4 = 0.25: misses TPOT
    rec(1, 0.5, 0.5, 0.75, 1.5, 7),  # TTFT 0.25, TPOT 0.75/6 = 0.125: meets (bounds inclusive)
    rec(2, 1.0, 1.25, 1.75, 2.0, 3),  # TTFT 0.75 (sent late: charged to the system): misses TTFT
    rec(3, 1.5, 1.5, 1.75, 1.75, 1),  # TTFT 0.25, one token: TPOT undefined, meets
    rec(4, 2.0, None, None, None, 0, error="boom"),  # failed: a miss
]


def test_per_request_figures():
    assert [r.ttft for r in TRACE] == [0.25, 0.25, 0.75, 0.25, None]
    assert [r.tpot for r in TRACE] == [0.25, 0.125, 0.125, None, None]
    assert [r.meets(SLO) for r in TRACE] == [False, True, False, True, False]
    assert [r.send_lag for r in TRACE] == [0.0, 0.0, 0.25, 0.0, None]


def test_summary_matches_hand_computed_values():
    s = summarize(TRACE, SLO)
    assert (s.n_requests, s.n_ok, s.n_errors, s.n_meeting) == (5, 4, 1, 2)
    assert s.attainment == 0.4
    assert s.window_s == 2.0  # latest completion (2.0) = last arrival (2.0)
    assert s.throughput_rps == 2.0  # 4 finished / 2 s
    assert s.goodput_rps == 1.0  # 2 meeting / 2 s
    assert s.token_throughput == 8.0  # (5 + 7 + 3 + 1) tokens / 2 s
    assert s.ttft_p50 == 0.25
    assert s.ttft_p90 == pytest.approx(0.6)  # sorted [.25 .25 .25 .75], position 2.7
    assert s.tpot_p50 == 0.125
    assert s.tpot_p99 == pytest.approx(0.2475)  # sorted [.125 .125 .25], position 1.98
    assert s.ttft_attainment == 0.6
    assert s.tpot_attainment == 0.6
    assert s.max_send_lag_s == 0.25


def test_window_extends_to_last_arrival_when_requests_fail():
    trace = [rec(0, 0.0, 0.0, 0.25, 0.5, 3), rec(1, 4.0, 4.0, None, None, 0, error="x")]
    s = summarize(trace, SLO)
    assert s.window_s == 4.0
    assert s.goodput_rps == 0.25


def test_percentile_and_validation():
    assert percentile([], 50) is None
    assert percentile([3.0], 99) == 3.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    with pytest.raises(ValueError):
        percentile([1.0], 101)
    with pytest.raises(ValueError):
        summarize([], SLO)
    with pytest.raises(ValueError):
        Slo(ttft_s=0.0, tpot_s=1.0)
