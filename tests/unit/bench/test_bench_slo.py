"""Frozen SLOs: derived once by the rule, committed, read back strictly, and what every run judges by."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from perf.benchlib.metrics import Slo
from perf.benchlib.slo import SLO_FILE, Calibration, freeze, judged_by, load_frozen, slo_from_idle


def calibration(workload: str, ttft: float, tpot: float) -> Calibration:
    return Calibration(workload, "colocated", 300, ttft, tpot, slo_from_idle(ttft, tpot), 3)


def test_frozen_slos_round_trip_and_a_rederivation_replaces_only_its_workloads(tmp_path: Path) -> None:
    path = tmp_path / "slos.json"
    freeze(path, "tiny", {"codegen": calibration("codegen", 0.1, 0.01)}, "2026-12-01T00:00:00", "cmd a")
    freeze(path, "tiny", {"decode": calibration("decode", 0.02, 0.008)}, "2026-12-02T00:00:00", "cmd b")
    frozen = load_frozen(path, "tiny")
    assert set(frozen) == {"codegen", "decode"}
    assert frozen["codegen"].slo == slo_from_idle(0.1, 0.01) and frozen["codegen"].command == "cmd a"
    assert frozen["decode"].derived == "2026-12-02T00:00:00"
    assert load_frozen(path, "smollm2-135m-instruct") == {}
    # a faster reference today does not tighten the SLO a run is judged by
    today = calibration("codegen", 0.05, 0.005)
    judged = judged_by(today, frozen["codegen"])
    assert judged.slo == Slo(0.4, 0.02) and judged.idle_ttft_s == 0.05


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ({"ttft_s": 0.4}, "exactly the fields"),
        ({"unknown": 1}, "exactly the fields"),
        ({"tpot_s": -1.0}, "tpot_s: a positive number"),
        ({"reference": ""}, "reference: a non-empty string"),
    ],
)
def test_a_malformed_entry_is_refused_naming_its_place(tmp_path: Path, entry: dict, message: str) -> None:
    path = tmp_path / "slos.json"
    freeze(path, "tiny", {"codegen": calibration("codegen", 0.1, 0.01)}, "2026-12-01T00:00:00", "cmd")
    data = json.loads(path.read_text())
    good = data["models"]["tiny"]["codegen"]
    data["models"]["tiny"]["codegen"] = {**good, **entry} if "ttft_s" not in entry else entry
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=message) as refused:
        load_frozen(path, "tiny")
    assert "models.tiny.codegen" in str(refused.value)


def test_the_committed_file_freezes_the_quick_benchmarks_slos() -> None:
    """`make bench-quick` (tiny, codegen + the interference pair's decode workload) runs on frozen SLOs."""
    frozen = load_frozen(SLO_FILE, "tiny")
    assert {"codegen", "decode"} <= set(frozen)
    for entry in frozen.values():
        assert entry.slo == slo_from_idle(entry.idle_ttft_s, entry.idle_tpot_s)  # derived by the rule
        assert entry.reference == "colocated" and entry.command.startswith("python perf/run_all.py")


def test_a_run_without_frozen_slos_for_its_model_stops_before_starting_anything(tmp_path: Path) -> None:
    from perf import run_all

    model = tmp_path / "my-model"
    model.mkdir()
    with pytest.raises(SystemExit, match=r"no frozen SLOs for my-model: codegen, decode.*--derive-slos"):
        run_all.main(["--quick", "--model-dir", str(model), "--slo-file", str(tmp_path / "none.json")])
