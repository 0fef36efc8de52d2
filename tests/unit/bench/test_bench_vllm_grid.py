"""The vLLM grid: every configuration tuned on the first workload, failures reported, the best taken as
"vllm", and the report printing each configuration's goodput and exact command line."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import pytest

from perf import run_all
from perf.benchlib import report
from perf.benchlib.clients import ClientConfig


def args_for(tmp_path: Path, *extra: str):
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    (model / "tokenizer.json").write_text("{}")
    return run_all.parse_args(["--quick", "--model-dir", str(model), *extra])


def test_the_grid_defaults_to_bf16_and_fp32_on_both_cores_and_vllms_own_binding(tmp_path: Path) -> None:
    grid = run_all.vllm_grid(args_for(tmp_path))
    assert [c.label for c in grid] == [
        "bfloat16, bind 0-1", "bfloat16, bind auto", "float32, bind 0-1", "float32, bind auto",
    ]  # fmt: skip
    assert [c.label for c in run_all.vllm_grid(args_for(tmp_path, "--vllm-dtype", "float32"))] == [
        "float32, bind auto"
    ]
    with pytest.raises(SystemExit, match="not dtype:bind"):
        run_all.vllm_grid(args_for(tmp_path, "--vllm-grid", "bfloat16"))


def test_the_command_line_names_the_environment_and_every_argument(tmp_path: Path) -> None:
    args = args_for(tmp_path)
    line = run_all.vllm_command_line(
        run_all.vllm_config(args, tmp_path, run_all.VllmChoice("float32", "0-1"))
    )
    assert line.startswith("VLLM_CPU_KVCACHE_SPACE=2 VLLM_CPU_OMP_THREADS_BIND=0-1 taskset -c 0,1 ")
    assert "--dtype float32" in line and "vllm.entrypoints.openai.api_server" in line


def test_tuning_measures_every_configuration_and_takes_the_best(tmp_path: Path) -> None:
    args = args_for(tmp_path)
    goodput = {"bfloat16, bind 0-1": 4.0, "bfloat16, bind auto": 3.0, "float32, bind 0-1": 2.5}
    started = []

    @contextlib.contextmanager
    def running(args, workdir, notes, choice):
        started.append(choice.label)
        yield ClientConfig("openai", "http://127.0.0.1:1", "m"), None, f"cmd {choice.label}"

    async def search(dep, profile, factory, results, records, deadline, experiments, frozen):
        assert experiments == ("goodput",) and profile.workloads == ("codegen",)
        label = dep.name.removeprefix("vllm (").removesuffix(")")
        if label not in goodput:
            raise RuntimeError("vLLM would not start")
        results["goodput"].setdefault("codegen", {})[dep.name] = {"goodput_rps": goodput[label]}

    results = {"meta": {"notes": []}, "calibrations": {}, "goodput": {}, "interference": {}}
    profile = run_all.PROFILES["quick"]
    best = asyncio.run(
        run_all.tune_grid(
            "vllm",
            run_all.vllm_tuning_grid(args),
            running,
            args,
            tmp_path,
            profile,
            None,
            results,
            1e18,
            None,
            search,
        )
    )
    assert best == run_all.VllmChoice("bfloat16", "0-1")
    assert started == [c.label for c in run_all.vllm_grid(args)]
    grid = results["vllm_grid"]
    assert grid["best"] == "bfloat16, bind 0-1" and grid["workload"] == "codegen"
    failed = [e for e in grid["tried"] if e["goodput_rps"] is None]
    assert [e["config"] for e in failed] == ["float32, bind auto"] and "would not start" in failed[0]["error"]
    assert results["goodput"] == {}, "tuning runs stay out of the report's goodput tables"
    text = report.render({**minimal_results(), "vllm_grid": grid}, {}, None)
    assert "| float32, bind 0-1 | 2.500 | – | this run | `cmd float32, bind 0-1` |" in text
    assert "failed: RuntimeError: vLLM would not start" in text
    assert "tied with" not in text


def tuned(tmp_path: Path, grid_text: str, goodput: dict[str, float]) -> tuple[object, dict]:
    """The vLLM grid `grid_text` tuned with each configuration scoring `goodput[label]` (none: the
    search measured nothing, as when the time budget is spent); (best choice, results)."""
    args = args_for(tmp_path, "--vllm-grid", grid_text)

    @contextlib.contextmanager
    def running(args, workdir, notes, choice):
        yield ClientConfig("openai", "http://127.0.0.1:1", "m"), None, f"cmd {choice.label}"

    async def search(dep, profile, factory, results, records, deadline, experiments, frozen):
        label = dep.name.removeprefix("vllm (").removesuffix(")")
        if label in goodput:
            results["goodput"].setdefault("codegen", {})[dep.name] = {"goodput_rps": goodput[label]}

    results = {"meta": {"notes": []}, "calibrations": {}, "goodput": {}, "interference": {}}
    grid = run_all.vllm_tuning_grid(args)
    profile = run_all.PROFILES["quick"]
    best = asyncio.run(
        run_all.tune_grid("vllm", grid, running, args, tmp_path, profile, None, results, 1e18, None, search)
    )
    return best, results


def test_a_tie_is_reported_and_the_first_listed_taken(tmp_path: Path) -> None:
    goodput = {"bfloat16, bind 0-1": 1.6, "float32, bind auto": 1.6, "float32, bind 0-1": 1.0}
    best, results = tuned(tmp_path, "bfloat16:0-1,float32:auto,float32:0-1", goodput)
    assert best == run_all.VllmChoice("bfloat16", "0-1")
    text = report.render({**minimal_results(), "vllm_grid": results["vllm_grid"]}, {}, None)
    assert (
        "It tied with float32, bind auto (overlapping brackets at the quick plan's resolution); the first "
        "listed is taken." in text
    )


def test_a_configuration_the_time_budget_left_out_is_reported_as_skipped(tmp_path: Path) -> None:
    # the second finds the budget spent and measures nothing
    best, results = tuned(tmp_path, "bfloat16:0-1,float32:auto", {"bfloat16, bind 0-1": 1.5})
    assert best == run_all.VllmChoice("bfloat16", "0-1")
    skipped = results["vllm_grid"]["tried"][1]
    assert skipped["goodput_rps"] is None and skipped["error"] == "skipped: the run's time budget was spent"


def minimal_results() -> dict:
    return {
        "meta": {
            "command": "c", "mode": "quick", "finished": "now", "elapsed_s": 1.0, "machine": "m",
            "model": "tiny", "token_counting": "t", "notes": [],
        },
        "slo_rule": "rule", "target_attainment": 0.9, "calibrations": {}, "deployments": {},
        "goodput": {}, "interference": {},
    }  # fmt: skip
