"""perf/relay_cost.py's fit and perf/planner_validation.py's accounting: the relay term recovered from
steps inside and predicted, the search's bracket, and the cells beside the profile-only prediction."""

from __future__ import annotations

import json

import pytest

from disagg_tools.planner.profile import Fit, Profile
from perf import planner_validation, relay_cost


def test_the_relay_term_is_the_extra_step_time_per_token_a_step_produces():
    rows = [
        {"tokens_per_step": t, "profile_ms": 5.0 + t, "step_ms": 5.0 + t + 0.9 * t} for t in (1.0, 4.0, 8.0)
    ]
    assert relay_cost.fit_relay(rows) == pytest.approx(0.9e-3)
    noisy = [dict(r, step_ms=r["step_ms"] + d) for r, d in zip(rows, (0.2, -0.2, 0.1), strict=True)]
    assert relay_cost.fit_relay(noisy) == pytest.approx(0.9e-3, rel=0.05)
    assert relay_cost.fit_relay([]) == 0.0


def test_relay_costs_are_read_per_deployment_and_absent_without_the_file(tmp_path):
    path = tmp_path / "relay_cost.json"
    found = {
        "colocated": {"relay_s_per_token": 0.0009, "rows": []},
        "disagg": {"relay_s_per_token": 0.0003, "entry_cpu_s_per_token": 0.0005, "rows": []},
    }
    path.write_text(json.dumps({"deployments": found}))
    relay = planner_validation.relay_costs(path)
    assert relay["colocated"] == planner_validation.Relay(0.0009, 0.0), "an older file: no CPU figure"
    assert relay["disagg"] == planner_validation.Relay(0.0003, 0.0005)
    profiles = {1: Profile(Fit((0.1, 0, 0), 0, 0), Fit((0.01, 0, 0), 0, 0))}
    profiles[2] = profiles[1]
    disagg = planner_validation.simulated("disagg", profiles, 0.0, 1e9, relay["disagg"])
    assert (disagg.relay_s_per_token, disagg.prefill_relay_s_per_token) == (0.0003, 0.0005)
    colocated = planner_validation.simulated("colocated", profiles, 0.0, 1e9, relay["colocated"])
    assert (colocated.relay_s_per_token, colocated.prefill_relay_s_per_token) == (0.0009, 0.0)
    assert planner_validation.relay_costs(tmp_path / "missing.json") == {}
    assert planner_validation.relay_costs(None) == {}


def test_the_bracket_is_the_lowest_missed_rate_above_the_goodput():
    run = {"goodput_rps": 2.0, "probes": [[0.5, 1.0], [4.0, 0.3], [2.0, 0.95], [3.0, 0.6], [2.5, 0.91]]}
    assert planner_validation.bracket(run) == 3.0, "2.5 met the target: it is not above the truth"
    assert planner_validation.bracket({"goodput_rps": 2.0, "probes": [[1.0, 1.0], [2.0, 0.9]]}) is None


def _out() -> dict:
    run = {"goodput_rps": 2.0, "ttft_p90_s": 0.7, "tpot_p90_s": 0.05, "probes": [[2.0, 0.95], [2.4, 0.7]]}
    predicted = {
        "goodput_rps": 2.2,
        "ttft_p90_s": 0.9,
        "tpot_p90_s": 0.06,
        "relay_s_per_token": 0.001,
        "profile_only": {"goodput_rps": 3.0, "ttft_p90_s": 0.5, "tpot_p90_s": 0.04},
        "at_measured": {"rate_rps": 2.0, "ttft_p90_s": 0.6, "tpot_p90_s": 0.045},
    }
    return {
        "command": "python -m perf.planner_validation",
        "machine": "2 cores",
        "model": "m",
        "dtype": "bfloat16",
        "runs": 2,
        "duration": 25,
        "requests": 300,
        "transfer": {"fixed_ms": 6.0, "gbps": 10.0},
        "profiles": {"1": {"prefill_error": 0.05, "decode_error": 0.04}},
        "slo_source": "frozen",
        "slos": {"codegen": "TTFT 1626 ms, TPOT 67.6 ms"},
        "predicted": {"colocated": {"codegen": predicted}},
        "measured": {"colocated": {"codegen": [run, dict(run, goodput_rps=2.0)]}},
    }


def test_a_cell_has_both_errors_and_the_p90s_at_the_measured_rate():
    (cell,) = planner_validation.cells(_out())
    assert cell["error"] == pytest.approx(0.1) and cell["profile_only_error"] == pytest.approx(0.5)
    assert cell["ttft_p90"] == (0.6, 0.7) and cell["tpot_p90"] == (0.045, 0.05)
    assert cell["missed_at"] == [2.4, 2.4] and cell["relay_ms"] == pytest.approx(1.0)
    table = planner_validation.markdown(_out())
    assert (
        "| colocated | codegen | 1.00 | 2.20 | 3.00 | 2.00 (<2.40) / 2.00 (<2.40) | 0% | +10% | +50% |"
        in table
    )
    assert "met in 1 of 1 cells (profile only: 0 of 1)" in table
    disagg = _out()
    disagg["predicted"]["colocated"]["codegen"]["prefill_relay_s_per_token"] = 0.0005
    assert "| colocated | codegen | 1.00; prefill 0.50 | 2.20 |" in planner_validation.markdown(disagg)


def test_searches_start_at_an_earlier_runs_goodput_and_the_report_says_how_they_ran(tmp_path):
    earlier = tmp_path / "planner_validation.json"
    out = _out()
    out["measured"]["colocated"]["codegen"][1]["goodput_rps"] = 3.0
    earlier.write_text(json.dumps({"measured": {**out["measured"], "disagg": {"chat": []}}}))
    assert planner_validation.earlier_goodputs(earlier) == {"colocated": {"codegen": 2.5}, "disagg": {}}
    assert planner_validation.earlier_goodputs(None) == {}
    assert "arrivals per probe. Goodput" in planner_validation.markdown(_out()), "older runs: no line"
    out["search"] = {"growth": 1.25, "rel_tol": 0.05, "max_probes": 6, "started_at": str(earlier)}
    assert f"probe (started at {earlier}, steps of x1.25 until one missed, then bisection to 5% or 6 " in (
        planner_validation.markdown(out)
    )
