"""perf/overload.py's accounting (refusals apart from failures, their latency from send to error, the
admitted requests' percentiles and goodput) and the repository rewrite its run and perf/degraded.py's
use (orchestrator parameters set, replacing any of the same name, pools untouched)."""

from __future__ import annotations

from pathlib import Path

import pytest

from perf import overload
from perf.benchlib.deploy import with_orchestrator_parameters
from perf.benchlib.metrics import RequestRecord, Slo

SLO = Slo(ttft_s=0.5, tpot_s=0.02)
REPOSITORY = Path(__file__).resolve().parents[3] / "model_repository"


def _served(arrival: float, ttft: float, tpot: float = 0.01) -> RequestRecord:
    first = arrival + ttft
    return RequestRecord(
        0, arrival, arrival, first, first + tpot * 9, 10, 10, 300, 10, ended=first + tpot * 9
    )


def _refused(
    arrival: float, wait_s: float, error: str = "triton: [StatusCode.UNAVAILABLE] full"
) -> RequestRecord:
    return RequestRecord(0, arrival, arrival, None, None, 0, 0, 300, 10, error, ended=arrival + wait_s)


def test_refusals_are_counted_apart_and_timed_from_send_to_error():
    records = [_served(0.0, 0.2), _served(1.0, 0.9), _refused(2.0, 0.004), _refused(3.0, 0.040)]
    records.append(RequestRecord(0, 4.0, 4.0, 4.1, None, 1, 1, 300, 10, "triton: INTERNAL broken"))
    records.append(RequestRecord(0, 5.0, 5.0, None, None, 0, 0, 300, 10, "timeout"))
    out = overload.summary(records, SLO, duration_s=10.0)
    assert (out["requests"], out["admitted"], out["refused"], out["failed_otherwise"]) == (6, 2, 2, 2)
    assert 4.0 <= out["refusal_ms_p50"] <= 40.0 and abs(out["refusal_ms_p99"] - 40.0) < 1.0
    assert abs(out["admitted_ttft_ms_p99"] - 900.0) < 10.0
    assert out["admitted_attainment"] == 0.5 and out["goodput_rps"] == 0.1  # the 0.9 s TTFT misses


def test_the_opening_bursts_refusals_are_also_reported_apart():
    """Every client's first request goes out at once; the refusals sent in the first second are left
    out of the second figure, those after it are in."""
    records = [_refused(0.01, 0.200), _refused(0.02, 0.150), _refused(2.0, 0.010), _refused(3.0, 0.020)]
    out = overload.summary(records, SLO, duration_s=10.0)
    assert out["refused"] == 4 and out["refused_after_opening"] == 2
    assert out["refusal_ms_p99"] > 140.0 and 10.0 <= out["refusal_after_opening_ms_p99"] <= 20.0


def test_a_stream_that_failed_after_its_first_token_is_not_a_refusal():
    broken = RequestRecord(0, 0.0, 0.0, 0.1, 0.1, 1, 1, 300, 10, "triton: UNAVAILABLE pool lost", ended=0.2)
    assert not overload.refused(broken)
    assert overload.refused(_refused(0.0, 0.01))
    assert overload.refused(_refused(0.0, 0.01, "triton: in ensemble 'ensemble', server is over capacity"))


def test_orchestrators_get_the_parameters_and_pools_keep_theirs(tmp_path: Path):
    copy = with_orchestrator_parameters(REPOSITORY, tmp_path, {"admission.margin": "1", "mode": "colocated"})
    llm = (copy / "llm" / "config.pbtxt").read_text()
    assert '{ key: "admission.margin", value: { string_value: "1" } }' in llm
    assert llm.count('key: "mode"') == 1 and '{ key: "mode", value: { string_value: "colocated" } }' in llm
    assert "admission.margin" not in (copy / "decode" / "config.pbtxt").read_text()
    assert (REPOSITORY / "llm" / "config.pbtxt").read_text() != llm, "the original is left as it was"


def test_machine_stalls_are_counted_from_the_probe_output():
    assert overload.stall_summary(b"[0.03, 0.07, 0.2]") == {"stalls_over_50ms": 2, "stall_max_ms": 200.0}
    assert overload.stall_summary(b"[]") == {"stalls_over_50ms": 0, "stall_max_ms": 0.0}


def test_refusals_group_by_cause_with_their_wait():
    records = [
        _refused(0.0, 0.010, "over capacity: predicted 1.2 s; retry after 2 s"),
        _refused(1.0, 0.030, "over capacity: predicted 3.4 s; retry after 4 s"),
        _refused(2.0, 0.005, "warming up: 900 tokens wait; retry after 1 s"),
    ]
    kinds = overload.refusal_kinds(records)
    assert list(kinds) == [
        "over capacity: predicted N s; retry after N s",
        "warming up: N tokens wait; retry after N s",
    ]
    assert kinds["over capacity: predicted N s; retry after N s"]["count"] == 2
    assert kinds["over capacity: predicted N s; retry after N s"]["ms_p99"] == pytest.approx(29.8)
