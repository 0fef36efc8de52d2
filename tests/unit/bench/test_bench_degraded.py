"""perf/degraded.py's accounting: phases by arrival, and per phase the served rate, attainment and
goodput against the SLOs (a failed or late request is served or not, but never good)."""

from __future__ import annotations

from perf import degraded
from perf.benchlib.metrics import RequestRecord, Slo

SLO = Slo(ttft_s=0.5, tpot_s=0.02)


def _record(
    arrival: float, ttft: float | None, tpot: float = 0.01, error: str | None = None
) -> RequestRecord:
    first = None if ttft is None else arrival + ttft
    last = None if first is None else first + tpot * 9
    return RequestRecord(0, arrival, arrival, first, last, 10, 10, 300, 10, error)


def test_phases_split_at_each_kill_and_at_each_recovery():
    outages = [(40.0, 55.0), (80.0, 92.0)]
    assert degraded.phase_of(39.9, outages) == "normal"
    assert degraded.phase_of(40.0, outages) == "degraded"
    assert degraded.phase_of(55.0, outages) == "recovered"
    assert degraded.phase_of(85.0, outages) == "degraded"
    assert degraded.phase_of(92.0, outages) == "recovered"
    assert degraded.phase_of(100.0, [(40.0, None)]) == "degraded", "never healthy again: degraded to the end"
    assert degraded.phase_of(100.0, []) == "normal", "no kill: all normal"


def test_an_outage_never_healthy_again_ends_at_the_next_kill():
    """A pool seen gone but not healthy again before the next kill: its outage ends at that kill, so
    the degraded span counts no second twice."""
    outages, spans = degraded.outage_spans([40.0, 80.0, 120.0], [(40.4, None), (120.3, 128.0)], 160.0)
    assert outages == [(40.0, 40.4, None), (80.0, None, None), (120.0, 120.3, 128.0)]
    assert spans == [(40.0, 80.0), (80.0, 120.0), (120.0, 128.0)]
    assert degraded.outage_spans([40.0], [(40.5, None)], 100.0)[1] == [(40.0, 100.0)]


def test_the_watch_records_each_outage_from_gone_to_healthy_again(monkeypatch):
    watch = degraded.HealthWatch("http://unused", "decode")
    views = iter([[0, 0], [0, 2], [2, 2], [0, 1], [0, 0], [0, 0], [2, 0], [0, 0]])
    monkeypatch.setattr(degraded, "pool_health", lambda url, pool: next(views))
    for _ in range(8):
        watch.sample()
    assert [[g is not None, b is not None] for g, b in watch.outages] == [[True, True], [True, True]]
    first, second = watch.outages
    assert first[0] < first[1] <= second[0] < second[1]


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
        "slo": {"ttft_s": 0.5, "tpot_s": 0.02},
        "kills": [
            {"killed_at_s": 40.0, "gone_seen_at_s": 42.5, "healthy_again_at_s": 48.0, "recovery_s": 8.0,
             "requests": 24, "degraded_over_normal_goodput": 0.7},
            {"killed_at_s": 80.0, "gone_seen_at_s": None, "healthy_again_at_s": None, "recovery_s": None,
             "requests": 30, "degraded_over_normal_goodput": 0.8},
        ],
        "machine": "test", "degraded_over_normal_goodput": 0.75,
        "phases": {name: {**phase, "span_s": 10.0} for name in ("normal", "degraded", "recovered")},
        "windows": [{"start_s": 0, "phase": "normal", **phase}],
    }  # fmt: skip
    text = degraded.markdown(out, "python -m perf.degraded --rate 1")
    assert "- normal: 2 x `UNAVAILABLE: retry after 5 s`" in text
    assert "**0.75**" in text and "| 0–10 | normal | 10 | 10 | 0.90 |" in text
    assert "| 1 | 40.0 | 42.5 | 48.0 | 8.0 | 24 | 0.70 |" in text
    assert "| 2 | 80.0 | never | never | never | 30 | 0.80 |" in text
