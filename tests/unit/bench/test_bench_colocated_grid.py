"""Our colocated baseline at its best: the grid of the colocated pool's cores and prompt tokens per step
(whole prompts or chunks), each configuration on a repository copy of its own, tuned like vLLM's grid,
the best measured in full as "colocated", and the report printing every configuration tried."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import pytest
from test_bench_vllm_grid import args_for, minimal_results

from perf import run_all
from perf.benchlib import report
from perf.benchlib.clients import ClientConfig
from perf.benchlib.deploy import DeployError, with_pool_parameters

REPOSITORY = Path(__file__).resolve().parents[3] / "model_repository"


def test_the_default_grid_is_the_repositorys_own_chunks_of_512_and_one_core(tmp_path: Path) -> None:
    grid = run_all.colocated_grid(args_for(tmp_path).colocated_grid)
    assert grid == [
        run_all.ColocatedChoice("0,1", 4096, False),
        run_all.ColocatedChoice("0,1", 512, True),
        run_all.ColocatedChoice("0", 4096, False),
    ]
    assert grid[1].label == "cores 0,1, chunks, 512 tokens per step"
    assert grid[1].parameters() == {"cores": "0,1", "max_prefill_tokens": "512", "chunked_prefill": "true"}


@pytest.mark.parametrize("text", ["0,1", "0,1@many", "0,1@8", "@512", "0@512+fast", "x@512", " ; "])
def test_a_malformed_grid_is_refused_naming_the_item(text: str) -> None:
    with pytest.raises(SystemExit, match="colocated-grid"):
        run_all.colocated_grid(text)


def test_the_pool_gets_the_parameters_and_nothing_else_changes(tmp_path: Path) -> None:
    params = run_all.ColocatedChoice("0", 512, True).parameters()
    copy = with_pool_parameters(REPOSITORY, tmp_path, "colocated", params)
    text = (copy / "colocated" / "config.pbtxt").read_text()
    assert text.count('key: "cores"') == 1 and '{ key: "cores", value: { string_value: "0" } }' in text
    assert '{ key: "chunked_prefill", value: { string_value: "true" } }' in text
    assert '{ key: "max_prefill_tokens", value: { string_value: "512" } }' in text
    for model in ("decode", "prefill", "llm"):
        assert (copy / model / "config.pbtxt").read_text() == (
            REPOSITORY / model / "config.pbtxt"
        ).read_text()
    with pytest.raises(DeployError, match="no model 'colocate'"):
        with_pool_parameters(REPOSITORY, tmp_path / "other", "colocate", params)


def test_tuning_takes_the_best_colocated_configuration_and_the_report_lists_them(tmp_path: Path) -> None:
    args = args_for(tmp_path, "--colocated-grid", "0,1@4096;0,1@512+chunked;0@4096")
    goodput = {
        "cores 0,1, whole prompts, 4096 tokens per step": 1.0,
        "cores 0, whole prompts, 4096 tokens per step": 1.4,
    }

    @contextlib.contextmanager
    def running(args, workdir, notes, choice):
        yield ClientConfig("triton", "127.0.0.1:1", "ensemble_colocated"), None, f"cmd {choice.label}"

    async def search(dep, profile, factory, results, records, deadline, experiments, frozen):
        label = dep.name.removeprefix("colocated (").removesuffix(")")
        if label not in goodput:
            raise RuntimeError("the pool did not load")
        results["goodput"].setdefault("codegen", {})[dep.name] = {"goodput_rps": goodput[label]}

    results = {"meta": {"notes": []}, "calibrations": {}, "goodput": {}, "interference": {}}
    grid = run_all.colocated_grid(args.colocated_grid)
    best = asyncio.run(
        run_all.tune_grid(
            "colocated",
            grid,
            running,
            args,
            tmp_path,
            run_all.PROFILES["quick"],
            None,
            results,
            1e18,
            None,
            search,
        )
    )
    assert best == run_all.ColocatedChoice("0", 4096, False)
    tried = results["colocated_grid"]["tried"]
    assert [e["goodput_rps"] for e in tried] == [1.0, None, 1.4] and "did not load" in tried[1]["error"]
    text = report.render({**minimal_results(), "colocated_grid": results["colocated_grid"]}, {}, None)
    assert "## Our colocated baseline at its best" in text
    label = "cores 0, whole prompts, 4096 tokens per step"
    assert f"| {label} | 1.400 | – | this run | `cmd {label}` |" in text
