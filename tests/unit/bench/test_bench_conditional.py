"""perf/conditional.py's accounting: each kind judged by its own SLOs, the goodput summed over the
kinds, the share the rule routed, and a report that names both variants."""

from __future__ import annotations

from perf import conditional
from perf.benchlib.metrics import RequestRecord, Slo

SLOS = {"short": Slo(ttft_s=0.1, tpot_s=0.02), "long": Slo(ttft_s=0.5, tpot_s=0.02)}


def _served(kind: str, ttft: float) -> RequestRecord:
    first = 1.0 + ttft
    return RequestRecord(0, 1.0, 1.0, first, first + 0.09, 10, 10, 10, 10, kind=kind, ended=first + 0.09)


def test_each_kind_is_judged_by_its_own_slo_and_goodput_adds_up():
    records = [_served("short", 0.05), _served("short", 0.3), _served("long", 0.3), _served("long", 0.6)]
    summary = conditional.variant_summary(records, routed=1, slos=SLOS, duration_s=2.0)
    assert summary["short"]["attainment"] == 0.5, "0.3 s misses the short kind's 0.1 s"
    assert summary["long"]["attainment"] == 0.5, "0.3 s meets the long kind's 0.5 s, 0.6 s does not"
    assert summary["goodput_rps"] == 1.0 and summary["conditional_share"] == 0.25


def test_the_report_shows_both_variants_per_kind():
    variant = conditional.variant_summary([_served("short", 0.05), _served("long", 0.3)], 1, SLOS, 1.0)
    out = {
        "rate_rps": 6.0,
        "duration_s": 30.0,
        "threshold": 64,
        "rounds": 2,
        "slo": {k: {"ttft_s": s.ttft_s, "tpot_s": s.tpot_s} for k, s in SLOS.items()},
        "machine": "test",
        "off": variant,
        "on": variant,
    }
    report = conditional.markdown(out, "python -m perf.conditional --rate 6")
    assert report.count("| off |") == 2 and report.count("| on |") == 2
    assert "50% of requests prefilled on the decode pool" in report
