"""perf/degraded.py's accounting: phases by arrival, and per phase the served rate, attainment and
goodput against the SLOs (a failed or late request is served or not, but never good)."""

from __future__ import annotations

import degraded
from benchlib.metrics import RequestRecord, Slo

SLO = Slo(ttft_s=0.5, tpot_s=0.02)


def _record(
    arrival: float, ttft: float | None, tpot: float = 0.01, error: str | None = None
) -> RequestRecord:
    first = None if ttft is None else arrival + ttft
    last = None if first is None else first + tpot * 9
    return RequestRecord(0, arrival, arrival, first, last, 10, 10, 300, 10, error)


def test_phases_split_at_the_kill_and_at_recovery():
    assert degraded.phase_of(39.9, 40.0, 55.0) == "normal"
    assert degraded.phase_of(40.0, 40.0, 55.0) == "degraded"
    assert degraded.phase_of(55.0, 40.0, 55.0) == "recovered"
    assert degraded.phase_of(100.0, 40.0, None) == "degraded", "never healthy again: degraded to the end"


def test_figures_count_good_requests_only_toward_goodput():
    records = [
        _record(1.0, 0.2),  # good
        _record(2.0, 0.9),  # served, too late
        _record(3.0, 0.2, tpot=0.05),  # served, tokens too slow
        _record(4.0, None, error="UNAVAILABLE"),  # failed
    ]
    got = degraded.figures(records, SLO, span_s=10.0)
    latencies = {k: got.pop(k) for k in ("ttft_p50_s", "ttft_p90_s", "tpot_p50_s", "tpot_p90_s")}
    assert abs(latencies["ttft_p50_s"] - 0.2) < 1e-9 and abs(latencies["tpot_p90_s"] - 0.042) < 1e-9
    assert got == {
        "ttft_met": 2 / 3,  # of the served: which target the misses missed
        "tpot_met": 2 / 3,
        "errors": {"UNAVAILABLE": 1},
        "requests": 4,
        "served": 3,
        "failed": 1,
        "served_rps": 0.3,
        "attainment": 0.25,
        "goodput_rps": 0.1,
    }
    assert degraded.figures([], SLO, 10.0)["attainment"] is None


def test_the_report_states_the_ratio_and_each_window():
    phase = {
        "errors": {"UNAVAILABLE: retry after 5 s": 2},
        "requests": 10,
        "served": 10,
        "failed": 0,
        "served_rps": 1.0,
        "attainment": 0.9,
        "goodput_rps": 0.9,
    }
    out = {
        "kill": "decode", "workload": "codegen", "entry_point": "ensemble", "rate_rps": 1.0,
        "slo": {"ttft_s": 0.5, "tpot_s": 0.02}, "killed_at_s": 40.0, "gone_seen_at_s": 42.5,
        "healthy_again_at_s": 48.0,
        "recovery_s": 8.0, "machine": "test", "degraded_over_normal_goodput": 0.75,
        "phases": {name: {**phase, "span_s": 10.0} for name in ("normal", "degraded", "recovered")},
        "windows": [{"start_s": 0, "phase": "normal", **phase}],
    }  # fmt: skip
    text = degraded.markdown(out, "python perf/degraded.py --rate 1")
    assert "- normal: 2 x `UNAVAILABLE: retry after 5 s`" in text
    assert "**0.75**" in text and "| 0–10 | normal | 10 | 10 | 0.90 |" in text
    assert "an entry point saw it gone at 42.5 s" in text and "at 48.0 s (8.0 s after the kill)" in text
