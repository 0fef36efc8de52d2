"""The benchmark's time plan: each part gets its weighted share of the time left when it starts, a part
that ends early leaves its time to the rest, a deployment dropped gives its parts' time back, and a
grid's configurations share the grid's time; run_all plans the parts the cache does not answer."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import pytest
from kv_support import Clock

from perf import run_all
from perf.benchlib.clients import ClientConfig
from perf.benchlib.gridcache import GridCache, GridEntry, machine_key
from perf.benchlib.machine import Machine
from perf.benchlib.timeplan import (
    GOODPUT_WEIGHT,
    GRID_CONFIG_WEIGHT,
    INTERFERENCE_WEIGHT,
    TimePlan,
    goodput_part,
    grid_config_weight,
    grid_part,
    interference_part,
    shares,
)


def test_each_part_gets_its_weighted_share_of_the_time_left() -> None:
    clock = Clock(0.0)
    plan = TimePlan(100.0, clock=clock)
    plan.extend([("a/goodput/x", 1.0), ("a/grid", 2.0), ("b/goodput/x", 1.0)])
    assert plan.start("a/goodput/x") == pytest.approx(25.0)  # 1 of 4
    clock.now = 10.0  # it ended early: its 15 s go to the rest
    assert plan.start("a/grid") == pytest.approx(10.0 + 90.0 * 2 / 3)
    clock.now = 80.0  # the grid overran its share: the last part gets what is left
    assert plan.start("b/goodput/x") == pytest.approx(100.0)
    assert plan.parts == {}


def test_no_time_left_gives_deadlines_already_passed() -> None:
    clock = Clock(0.0)
    plan = TimePlan(50.0, clock=clock)
    plan.extend([("a/goodput/x", 1.0), ("a/interference", 1.0)])
    clock.now = 70.0
    assert plan.start("a/goodput/x") == 70.0 and plan.remaining_s() == 0.0


def test_a_part_not_planned_runs_to_the_end_and_dropping_a_deployment_frees_its_time() -> None:
    clock = Clock(0.0)
    plan = TimePlan(90.0, clock=clock)
    plan.extend([("vllm/grid", 1.0), ("vllm/goodput/x", 1.0), ("vllm-pd/goodput/x", 1.0)])
    assert plan.start("llm/goodput/x") == 90.0  # not planned: nothing after it needs the time
    plan.drop("vllm")  # its prefix is the deployment's name and a slash: vllm-pd's parts stay
    assert list(plan.parts) == ["vllm-pd/goodput/x"]
    assert plan.start("vllm-pd/goodput/x") == 90.0


def test_weights_and_parts_are_checked() -> None:
    plan = TimePlan(10.0)
    with pytest.raises(ValueError, match="positive"):
        plan.add("a/grid", 0)
    plan.add("a/grid", 1)
    with pytest.raises(ValueError, match="twice"):
        plan.add("a/grid", 1)
    with pytest.raises(ValueError):
        shares(10.0, 0, 0.0)
    assert shares(10.0, 4, 2.0) == pytest.approx(4.0) and shares(10.0, 2, 12.0) == 12.0


MACHINE = Machine("AMD EPYC", 2, ("avx2",), None, None)


def _args(tmp_path: Path, *extra: str):
    model = tmp_path / "smollm2"
    model.mkdir(exist_ok=True)
    (model / "tokenizer.json").write_text("{}")
    return run_all.parse_args(["--full", "--model-dir", str(model), "--start-triton", str(tmp_path), *extra])


def test_the_run_plans_every_deployments_parts_and_only_the_grid_configurations_still_to_measure(
    tmp_path: Path,
) -> None:
    args = _args(tmp_path, "--deployments", "vllm,colocated,llamacpp", "--vllm-chunk-grid", "256,512")
    where = machine_key(MACHINE.model, MACHINE.flags)
    cache = GridCache(tmp_path / "grids.json", reuse=True)
    first = run_all.colocated_grid(args.colocated_grid)[0].label
    cache.put(GridEntry("colocated", first, "codegen", "smollm2", where, "2026-12-06T00:00:00+00:00", 1.0,
                        None, "cmd", ""))  # fmt: skip
    profile = run_all.PROFILES["full"]
    plan = run_all.time_plan(["vllm", "colocated", "llamacpp"], args, profile, cache, MACHINE, 1e6)
    workloads = profile.workloads
    expected = {
        grid_part("colocated"): GRID_CONFIG_WEIGHT * (len(run_all.colocated_grid(args.colocated_grid)) - 1),
        **{goodput_part("colocated", w): GOODPUT_WEIGHT for w in workloads},
        interference_part("colocated"): INTERFERENCE_WEIGHT,
        grid_part("llamacpp"): GRID_CONFIG_WEIGHT * len(run_all.llamacpp_grid(args.llamacpp_grid)),
        **{goodput_part("llamacpp", w): GOODPUT_WEIGHT for w in workloads},
        interference_part("llamacpp"): INTERFERENCE_WEIGHT,
        grid_part("vllm"): grid_config_weight("vllm") * len(run_all.vllm_tuning_grid(args)),
        grid_part("vllm", "chunks"): grid_config_weight("vllm") * 2,
        **{goodput_part("vllm", w): GOODPUT_WEIGHT for w in workloads},
        interference_part("vllm"): INTERFERENCE_WEIGHT,
    }
    assert plan.parts == expected
    assert next(iter(plan.parts)) == grid_part("colocated")  # in measuring order


def _tune_timed(tmp_path: Path, monkeypatch, deadline: float, run_end: float | None) -> list[float]:
    """Three vLLM configurations tuned under a fake clock, each taking 10 s: their deadlines."""
    clock = Clock(0.0)
    monkeypatch.setattr(run_all.time, "monotonic", clock)
    deadlines: list[float] = []

    @contextlib.contextmanager
    def running(args, workdir, notes, choice):
        yield ClientConfig("openai", "http://127.0.0.1:1", "m"), None, f"cmd {choice.label}"

    async def search(dep, profile, factory, results, records, plan, experiments, frozen):
        deadlines.append(plan.start("any part"))
        clock.now += 10.0  # each configuration takes 10 s of its share
        results["goodput"].setdefault("codegen", {})[dep.name] = {"goodput_rps": 1.0, "bracket": None}

    grid = [run_all.VllmChoice("bfloat16", "0-1"), run_all.VllmChoice("float32", "0-1"),
            run_all.VllmChoice("float32", "auto")]  # fmt: skip
    results = {
        "meta": {"notes": [], "model": "/m/smollm2", "machine_key": "m"},
        "calibrations": {}, "goodput": {}, "interference": {},
    }  # fmt: skip
    asyncio.run(
        run_all.tune_grid(
            "vllm", grid, running, _args(tmp_path), tmp_path, run_all.PROFILES["quick"], None, results,
            deadline, None, search, run_end=run_end,
        )
    )  # fmt: skip
    return deadlines


def test_a_grids_configurations_share_its_time(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(run_all, "MIN_CONFIG_S", 0.0)
    # 90 s for three: 30 s for the first; the second gets half of the 80 left, the third all of 70
    assert _tune_timed(tmp_path, monkeypatch, 90.0, None) == pytest.approx([30.0, 10.0 + 40.0, 90.0])


def test_a_configuration_gets_its_minimum_and_is_skipped_only_past_the_runs_end(
    tmp_path, monkeypatch
) -> None:
    """A grid whose share is spent still measures its configurations while the run has time: a peer cut
    from its grid would be a peer below its best. Past the run's end nothing more starts."""
    monkeypatch.setattr(run_all, "MIN_CONFIG_S", 25.0)
    assert _tune_timed(tmp_path, monkeypatch, 30.0, 1000.0) == pytest.approx([25.0, 35.0, 45.0])
    assert _tune_timed(tmp_path, monkeypatch, 30.0, 15.0) == pytest.approx([25.0, 35.0])  # third: skipped
