"""perf/burst.py's accounting: each burst's refusals apart from the admitted and the failed, their
latency from send to error, the measured bursts pooled without the first (cold) one, and the report."""

from __future__ import annotations

import pytest

from perf import burst
from perf.benchlib.metrics import RequestRecord

UNAVAILABLE = "triton: [StatusCode.UNAVAILABLE] server is over capacity"


def _refused(wait_s: float) -> RequestRecord:
    return RequestRecord(0, 0.0, 1.0, None, None, 0, 0, 300, 10, UNAVAILABLE, ended=1.0 + wait_s)


def _served() -> RequestRecord:
    return RequestRecord(0, 0.0, 1.0, 1.3, 1.6, 10, 10, 300, 10, ended=1.6)


def _burst(*waits_ms: float, served: int = 1) -> list[RequestRecord]:
    return [_refused(w / 1000) for w in waits_ms] + [_served() for _ in range(served)]


def test_a_burst_counts_its_refusals_apart_and_times_them_from_send_to_error():
    broken = RequestRecord(0, 0.0, 1.0, 1.1, None, 1, 1, 300, 10, "triton: INTERNAL broken", ended=1.2)
    lost = RequestRecord(0, 0.0, None, None, None, 0, 0, 300, 10, "timeout")
    out = burst.burst_summary([*_burst(10, 20, 30, 40, served=2), broken, lost])
    assert (out["refused"], out["admitted"], out["failed_otherwise"]) == (4, 2, 2)
    assert out["refusal_ms"] == pytest.approx([10, 20, 30, 40])
    assert out["refusal_ms_p50"] == pytest.approx(25)
    assert out["refusal_ms_max"] == pytest.approx(40)
    assert out["refusal_ms_p99"] == pytest.approx(39.7)


def test_the_first_burst_is_left_out_of_the_pooled_figures():
    bursts = [
        burst.burst_summary(_burst(500, 900)),  # cold: admission had no measured speed
        burst.burst_summary(_burst(10, 20)),
        burst.burst_summary(_burst(30, 60)),
        burst.burst_summary(_burst(15, 25)),
    ]
    out = burst.pooled(bursts)
    assert (out["bursts"], out["refused"]) == (3, 6)
    assert out["refusal_ms_p50"] == pytest.approx(22.5)
    assert out["burst_p99_ms_range"] == pytest.approx([19.9, 59.7])
    assert out["burst_p99_ms_median"] == pytest.approx(24.9)


def test_a_burst_without_refusals_has_no_latency_and_the_report_says_so():
    bursts = [burst.burst_summary(_burst(served=3)), burst.burst_summary(_burst(served=3))]
    total = burst.pooled(bursts)
    assert total["refusal_ms_p99"] is None and total["burst_p99_ms_range"] is None
    floor = [burst.burst_summary(_burst(5, 7, served=0)), burst.burst_summary(_burst(9, served=0))]
    report = burst.markdown(
        {
            "command": "python -m perf.burst",
            "bursts_sent": 2,
            "clients": 3,
            "workload": "codegen",
            "entry_point": "ensemble",
            "admission_margin": "2",
            "machine": "2 cores",
            "bursts": bursts,
            "pooled": total,
            "floor": burst.pooled(floor, skip_first=False),
        }
    )
    assert "| 1 (cold pool) | 0 | 3 | 0 | – / – / – |" in report
    assert "| bursts 2-2 (measured pools) | 1 | 0 | – | – | – |" in report
    floor_row = "| the floor: empty prompts, refused before any work | 2 | 3 | 7.0 | 9.0 | 9.0 (7.0-9.0) |"
    assert floor_row in report


def test_the_floor_pools_every_one_of_its_bursts():
    floor = [burst.burst_summary(_burst(5, 7, served=0)), burst.burst_summary(_burst(9, served=0))]
    assert burst.pooled(floor, skip_first=False)["refused"] == 3
    assert burst.pooled(floor)["refused"] == 1


def test_bad_arguments_are_refused():
    with pytest.raises(SystemExit):
        burst.parse_args(["--bursts", "1"])
    with pytest.raises(SystemExit):
        burst.parse_args(["--clients", "0"])
    assert burst.parse_args([]).bursts == 10
