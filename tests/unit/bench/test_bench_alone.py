"""Before a goodput search, a deployment serves requests alone: one that misses an SLO alone gets goodput 0
without a search. A workload `<name>@<source>` sends `<name>`'s prompts and is judged by SLOs given from
outside the rule, never frozen."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import pytest

from perf import run_all
from perf.benchlib import report
from perf.benchlib.clients import ClientConfig
from perf.benchlib.experiment import GoodputResult
from perf.benchlib.metrics import Slo
from perf.benchlib.slo import FIXED_SLOS, Calibration, FrozenSlo, base_workload, slo_from_idle
from perf.benchlib.timeplan import TimePlan

FROZEN = {
    name: FrozenSlo(0.8, 0.06, 0.2, 0.03, 300, "colocated", "2026-12-03T00:00:00", "cmd")
    for name in ("codegen", "chat", "decode")
}


class Idle:
    """A fake `calibrate`: idle figures per (deployment, workload), and who was asked."""

    def __init__(self, figures: dict[tuple[str, str], tuple[float, float]]) -> None:
        self.figures = figures
        self.asked: list[tuple[str, str]] = []

    async def __call__(self, client, workload, factory, reference, reps=5, **_) -> Calibration:
        key = (reference.partition(" (")[0], workload.name)
        self.asked.append(key)
        ttft, tpot = self.figures[key]
        return Calibration(workload.name, reference, 300, ttft, tpot, slo_from_idle(ttft, tpot), reps)


class NoClient:
    async def open(self) -> None: ...

    async def close(self) -> None: ...


def measure(
    monkeypatch, idle: Idle, name: str, workloads: tuple[str, ...], results: dict | None = None
) -> tuple[dict, list]:
    searched = []

    async def search(client, workload, factory, slo, search, plan, cores, log, deadline):
        searched.append((workload.name, slo))
        return GoodputResult(workload.name, 1.0, cores, [])

    monkeypatch.setattr(run_all, "calibrate", idle)
    monkeypatch.setattr(run_all, "search_goodput", search)
    monkeypatch.setattr(run_all, "make_client", lambda config: NoClient())
    if results is None:
        results = {"meta": {"notes": []}, "calibrations": {}, "goodput": {}, "interference": {}}
    records: dict = {"goodput": {}, "interference": {}}
    profile = dataclasses.replace(run_all.PROFILES["quick"], workloads=workloads)
    dep = run_all.Deployment(name, ClientConfig("openai", "http://127.0.0.1:1", "m"), 2, "", available=True)
    asyncio.run(run_all.measure(dep, profile, None, results, records, TimePlan(1e18), ("goodput",), FROZEN))
    return results, searched


def test_a_deployment_that_misses_an_slo_alone_is_not_searched(monkeypatch) -> None:
    # the stand-in reference calibrates codegen and decode; alone, its codegen TPOT (70 ms) misses 60 ms
    idle = Idle({("vllm-pd", "codegen"): (0.3, 0.07), ("vllm-pd", "decode"): (0.05, 0.02)})
    results, searched = measure(monkeypatch, idle, "vllm-pd", ("codegen",))
    assert searched == []
    entry = results["goodput"]["codegen"]["vllm-pd"]
    assert entry["goodput_rps"] == 0.0 and entry["misses_alone"] and entry["probes"] == []
    assert results["alone"]["codegen"]["vllm-pd"] == {"ttft_s": 0.3, "tpot_s": 0.07, "requests": 3}
    assert any("already miss the SLOs (800 / 60.0 ms)" in n for n in results["meta"]["notes"])
    text = report.render({**minimal(results), "goodput": results["goodput"]}, {}, None)
    assert "| vllm-pd | **0.000** (misses alone) |" in text and "| 300.0 / 70.0 |" in text


def test_a_deployment_that_meets_the_slos_alone_is_searched(monkeypatch) -> None:
    idle = Idle({("disagg", "codegen"): (0.3, 0.02), ("disagg", "decode"): (0.05, 0.02)})
    results, searched = measure(monkeypatch, idle, "disagg", ("codegen",))
    assert searched == [("codegen", FROZEN["codegen"].slo)]
    assert results["goodput"]["codegen"]["disagg"]["goodput_rps"] == 1.0
    assert results["alone"]["codegen"]["disagg"]["tpot_s"] == 0.02
    # 300 ms alone: prompts back to back at 3.33/s at most, so goodput 1.0 is 30 % of that bound
    text = report.render({**minimal(results), "goodput": results["goodput"]}, {}, None)
    assert "| codegen | disagg | 300.0 | 20.0 | 3.33 | 1.000 | 30% |" in text


def test_given_slos_judge_the_base_workloads_prompts_and_are_never_frozen(monkeypatch) -> None:
    fixed = FIXED_SLOS["codegen@article"]
    assert base_workload("codegen@article") == "codegen" and base_workload("chat") == "chat"
    assert fixed.slo == Slo(0.5, 0.05)
    # alone, 300 ms / 40 ms: within the frozen 800 / 60 and the article's 500 / 50, so both are searched
    idle = Idle({("disagg", "codegen"): (0.3, 0.04), ("disagg", "decode"): (0.05, 0.02)})
    results, searched = measure(monkeypatch, idle, "disagg", ("codegen", "codegen@article"))
    assert searched == [("codegen", FROZEN["codegen"].slo), ("codegen", fixed.slo)]
    cal = results["calibrations"]["codegen@article"]
    assert cal["slo"] == dataclasses.asdict(fixed.slo) and cal["fixed"] == fixed.source
    assert "frozen" not in cal
    # the article's prompts are codegen's: calibrated once (the stand-in reference), then alone per search
    assert idle.asked.count(("disagg", "codegen")) == 3 and ("disagg", "codegen@article") not in idle.asked
    text = report.render({**minimal(results), "goodput": results["goodput"]}, {}, None)
    assert f"given: {fixed.source}" in text and "### codegen@article (SLOs 500.0 ms / 50.0 ms)" in text


def test_workloads_a_grids_tuning_left_out_are_calibrated_by_the_first_full_measurement(
    monkeypatch,
) -> None:
    figures = {(d, w): (0.3, 0.02) for d in ("colocated", "disagg") for w in ("codegen", "chat", "decode")}
    idle = Idle(figures)
    # a grid's tuning run measures codegen only, and calibrates it (and decode)
    results, _ = measure(monkeypatch, idle, "colocated", ("codegen",))
    assert set(results["calibrations"]) == {"codegen", "decode"}
    results["goodput"] = {}
    # the full measurement calibrates chat, and only chat, on the deployment measured first
    results, searched = measure(monkeypatch, idle, "colocated", ("codegen", "chat"), results)
    assert set(results["calibrations"]) == {"codegen", "decode", "chat"}
    assert results["calibrations"]["chat"]["reference"].startswith("colocated")
    assert [w for w, _ in searched] == ["codegen", "chat"]
    assert idle.asked.count(("colocated", "chat")) == 2  # calibrated once, then served alone once
    results, searched = measure(monkeypatch, idle, "disagg", ("codegen", "chat"), results)
    assert ("disagg", "chat") in idle.asked
    assert results["calibrations"]["chat"]["reference"][:9] == "colocated", "not recalibrated"


def test_measuring_order_puts_the_reference_first_and_vllms_own_pd_last() -> None:
    names = ["vllm-pd", "vllm", "disagg", "colocated"]
    assert sorted(names, key=run_all.MEASURING_ORDER.index) == ["colocated", "disagg", "vllm", "vllm-pd"]


@pytest.mark.parametrize(
    ("workloads", "missing"), [("codegen@article", "decode"), ("codegen,codegen@article", "codegen, decode")]
)
def test_given_slo_workloads_are_accepted_by_name(tmp_path: Path, workloads: str, missing: str) -> None:
    model = tmp_path / "smollm2-135m-instruct"
    model.mkdir()
    args = run_all.parse_args(["--full", "--model-dir", str(model), "--workloads", "chat,nope"])
    with pytest.raises(SystemExit, match="unknown workloads: \\['nope'\\]"):
        asyncio.run(run_all.main_async(args))
    args = run_all.parse_args(["--full", "--model-dir", str(model), "--workloads", workloads])
    args.slo_file = tmp_path / "slos.json"  # no frozen SLOs: refused before anything starts
    with pytest.raises(SystemExit, match=f"no frozen SLOs for smollm2-135m-instruct: {missing}\\."):
        asyncio.run(run_all.main_async(args))


def minimal(results: dict) -> dict:
    return {
        "meta": {
            "command": "c", "mode": "quick", "finished": "now", "elapsed_s": 1.0, "machine": "m",
            "model": "tiny", "token_counting": "t", "notes": [],
        },
        "slo_rule": "rule", "target_attainment": 0.9, "calibrations": results["calibrations"],
        "deployments": {}, "goodput": {}, "interference": {}, "alone": results.get("alone", {}),
    }  # fmt: skip
