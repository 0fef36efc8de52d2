"""The grid cache: tuned configurations kept with their date and machine, reused only when asked and
only for the same machine, model and workload; a staged grid (vLLM's chunk budgets) never measures a
configuration twice; a run in parts carries the earlier run's other figures, marked."""

from __future__ import annotations

import asyncio
import contextlib
import json
from pathlib import Path

import pytest

from perf import run_all
from perf.benchlib import report
from perf.benchlib.clients import ClientConfig
from perf.benchlib.gridcache import GridCache, GridEntry, machine_key

MACHINE = machine_key("AMD EPYC", ("avx2",))


def entry(config: str, goodput: float | None, machine: str = MACHINE, error: str = "") -> GridEntry:
    return GridEntry("vllm", config, "codegen", "smollm2", machine, "2026-12-01T00:00:00+00:00", goodput,
                     {"low": goodput, "high": None} if goodput else None, f"cmd {config}", error)  # fmt: skip


def test_entries_are_reused_only_when_asked_and_only_on_the_same_machine(tmp_path: Path) -> None:
    path = tmp_path / "grids.json"
    writer = GridCache(path)
    writer.put(entry("bfloat16, bind 0-1", 2.0))
    writer.put(entry("float32, bind auto", None, error="RuntimeError: would not start"))
    assert json.loads(path.read_text())["entries"][0]["machine"] == MACHINE  # written as it comes
    # in the run that measured it, an entry is always found (a later stage never measures it again)
    assert writer.lookup("vllm", "bfloat16, bind 0-1", "codegen", "smollm2", MACHINE) is not None
    fresh_run = GridCache(path)
    assert fresh_run.lookup("vllm", "bfloat16, bind 0-1", "codegen", "smollm2", MACHINE) is None
    reusing = GridCache(path, reuse=True)
    found = reusing.lookup("vllm", "bfloat16, bind 0-1", "codegen", "smollm2", MACHINE)
    assert found is not None and found.goodput_rps == 2.0 and not reusing.is_fresh(found)
    other = machine_key("Intel Xeon", ("amx_bf16", "amx_int8", "amx_tile", "avx512_bf16", "avx512f", "avx2"))
    assert reusing.lookup("vllm", "bfloat16, bind 0-1", "codegen", "smollm2", other) is None
    assert reusing.lookup("vllm", "bfloat16, bind 0-1", "chat", "smollm2", MACHINE) is None
    assert reusing.lookup("vllm", "float32, bind auto", "codegen", "smollm2", MACHINE) is None  # failed


def _args(tmp_path: Path, *extra: str):
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    (model / "tokenizer.json").write_text("{}")
    return run_all.parse_args(["--quick", "--model-dir", str(model), *extra])


def _tune(
    tmp_path: Path, cache: GridCache, grid: list, goodput: dict, started: list, extend=False, results=None
):
    @contextlib.contextmanager
    def running(args, workdir, notes, choice):
        started.append(choice.label)
        yield ClientConfig("openai", "http://127.0.0.1:1", "m"), None, f"cmd {choice.label}"

    async def search(dep, profile, factory, results, records, deadline, experiments, frozen):
        label = dep.name.removeprefix("vllm (").removesuffix(")")
        rate = goodput[label]
        found = {"goodput_rps": rate, "bracket": {"low": rate, "high": rate * 1.1}}
        results["goodput"].setdefault("codegen", {})[dep.name] = found

    results = results or {
        "meta": {"notes": [], "model": "/m/smollm2", "machine_key": MACHINE},
        "calibrations": {}, "goodput": {}, "interference": {},
    }  # fmt: skip
    best = asyncio.run(
        run_all.tune_grid(
            "vllm", grid, running, _args(tmp_path), tmp_path, run_all.PROFILES["quick"], None, results,
            1e18, None, search, cache=cache, extend=extend,
        )
    )  # fmt: skip
    return best, results


def test_vllms_chunk_budgets_are_a_second_stage_on_the_best_and_nothing_is_measured_twice(tmp_path) -> None:
    cache = GridCache(tmp_path / "grids.json")
    first = [run_all.VllmChoice("bfloat16", "0-1"), run_all.VllmChoice("float32", "auto")]
    chunked = "bfloat16, bind 0-1, {} batched tokens"
    goodput = {"bfloat16, bind 0-1": 2.0, "float32, bind auto": 1.0, chunked.format(256): 1.8,
               chunked.format(512): 2.4, chunked.format(2048): 2.1}  # fmt: skip
    started: list[str] = []
    best, results = _tune(tmp_path, cache, first, goodput, started)
    assert best == run_all.VllmChoice("bfloat16", "0-1")
    second = run_all.vllm_chunk_grid(best, "256,512,2048")
    assert [c.extra_args() for c in second] == [
        (), ("--max-num-batched-tokens", "256"), ("--max-num-batched-tokens", "512"),
        ("--max-num-batched-tokens", "2048"),
    ]  # fmt: skip
    best, results = _tune(tmp_path, cache, second, goodput, started, extend=True, results=results)
    assert best == run_all.VllmChoice("bfloat16", "0-1", 512)
    assert started == [
        "bfloat16, bind 0-1", "float32, bind auto", "bfloat16, bind 0-1, 256 batched tokens",
        "bfloat16, bind 0-1, 512 batched tokens", "bfloat16, bind 0-1, 2048 batched tokens",
    ]  # the first stage's best is not started again  # fmt: skip
    tried = results["vllm_grid"]["tried"]
    assert [e["config"] for e in tried] == started and results["vllm_grid"]["best"] == best.label
    assert "--max-num-batched-tokens 512" in " ".join(
        run_all.vllm_config(_args(tmp_path), tmp_path, best).command()
    )


def test_a_reused_configuration_is_not_started_and_the_report_says_so(tmp_path: Path) -> None:
    path = tmp_path / "grids.json"
    GridCache(path).put(entry("bfloat16, bind 0-1", 2.0))
    started: list[str] = []
    grid = [run_all.VllmChoice("bfloat16", "0-1"), run_all.VllmChoice("float32", "auto")]
    best, results = _tune(tmp_path, GridCache(path, reuse=True), grid, {"float32, bind auto": 1.0}, started)
    assert started == ["float32, bind auto"] and best == grid[0]
    res = {**minimal(), "vllm_grid": results["vllm_grid"]}
    text = report.render(res, {})
    assert (
        "| bfloat16, bind 0-1 | 2.000 | [2.000, –) | reused, 2026-12-01T00:00 | `cmd bfloat16, bind 0-1` |"
        in text
    )
    assert "| float32, bind auto | 1.000 | [1.000, 1.100) | this run |" in text
    assert "- vllm: bfloat16, bind 0-1: measured 2026-12-01T00:00" in text
    # the cache now holds both, the new one with this run's date
    saved = {e["config"]: e for e in json.loads(path.read_text())["entries"]}
    assert (
        saved["float32, bind auto"]["goodput_rps"] == 1.0
        and saved["float32, bind auto"]["measured"] > "2026-12-01"
    )


def minimal() -> dict:
    return {
        "meta": {"command": "c", "mode": "quick", "finished": "now", "started": "2026-12-06T10:00:00+00:00",
                 "elapsed_s": 1.0, "machine": "m", "model": "x", "token_counting": "t", "notes": []},
        "slo_rule": "r", "target_attainment": 0.9, "calibrations": {}, "deployments": {}, "goodput": {},
        "interference": {},
    }  # fmt: skip


def test_a_run_in_parts_carries_the_earlier_figures_marked_with_their_run() -> None:
    def cell(rate: float) -> dict:
        return {"goodput_rps": rate, "goodput_rps_per_core": rate / 2, "cores": 2, "probes": [],
                "bracket": {"low": rate, "high": rate * 1.02}}  # fmt: skip

    earlier = minimal()
    earlier["meta"]["started"] = "2026-12-05T03:00:00+00:00"
    earlier["goodput"] = {"codegen": {"disagg": cell(1.0), "vllm": cell(2.0)}, "chat": {"disagg": cell(0.5)}}
    earlier["interference"] = {
        "disagg": {"rate": 2.0, "count": 100, "seeds": [1, 2, 3], "long_share": 0.2,
                   "long_prompt_tokens": 300, "decode_only_tpot_p50": 0.02, "decode_only_tpot_p99": 0.03,
                   "mixed_tpot_p50": 0.021, "mixed_tpot_p99": 0.033, "ratio_p50": 1.05, "ratio_p99": 1.1,
                   "per_seed": []}
    }  # fmt: skip
    earlier["llamacpp_grid"] = {"tried": [], "best": "16 slots"}
    now = minimal()
    now["goodput"] = {"codegen": {"disagg": cell(1.5)}}
    merged = run_all.carry_earlier(now, earlier)
    assert merged["goodput"]["codegen"]["disagg"] == cell(1.5)  # this run's own figure wins
    assert merged["goodput"]["codegen"]["vllm"]["from_run"] == "2026-12-05T03:00:00+00:00"
    assert merged["goodput"]["chat"]["disagg"]["from_run"] == "2026-12-05T03:00:00+00:00"
    assert merged["interference"]["disagg"]["from_run"] == "2026-12-05T03:00:00+00:00"
    assert merged["llamacpp_grid"]["best"] == "16 slots"
    assert "from_run" not in now["goodput"]["codegen"]["disagg"]  # the input is left alone
    text = report.render(merged, {})
    assert "This run (2026-12-06T10:00) measured: `codegen × disagg`." in text
    assert "- `codegen × vllm`: run of 2026-12-05T03:00" in text
    assert "| vllm | **2.000** | [2.000, 2.040) (2.0%) |" in text and "earlier run 2026-12-05T03:00 |" in text
    # carried again by a later run, a figure keeps the run it was measured in
    again = run_all.carry_earlier(minimal(), merged)
    assert again["goodput"]["codegen"]["vllm"]["from_run"] == "2026-12-05T03:00:00+00:00"


def test_a_full_search_starts_where_the_grid_found_the_best() -> None:
    results = {"vllm_grid": {"workload": "codegen", "best": "b", "tried": [
        {"config": "a", "goodput_rps": 1.0}, {"config": "b", "goodput_rps": 2.2}]}}  # fmt: skip
    starts: dict = {}
    run_all.grid_start(starts, results, "vllm")
    assert starts == {"codegen": {"vllm": 2.2}}
    earlier = {"codegen": {"vllm": 2.0}}
    run_all.grid_start(earlier, results, "vllm")  # --start-at's figure takes precedence
    assert earlier == {"codegen": {"vllm": 2.0}}
    run_all.grid_start(starts, {"llamacpp_grid": {"workload": None, "tried": [], "best": "x"}}, "llamacpp")
    assert "llamacpp" not in starts.get("codegen", {})  # a grid of one is not tuned: no figure


def test_no_configuration_is_started_once_the_budget_is_spent(tmp_path: Path) -> None:
    started: list[str] = []

    @contextlib.contextmanager
    def running(args, workdir, notes, choice):
        started.append(choice.label)
        yield ClientConfig("openai", "http://127.0.0.1:1", "m"), None, "cmd"

    results = {
        "meta": {"notes": [], "model": "/m/smollm2"},
        "calibrations": {},
        "goodput": {},
        "interference": {},
    }
    grid = [run_all.VllmChoice("bfloat16", "0-1"), run_all.VllmChoice("float32", "0-1")]
    with pytest.raises(RuntimeError, match="no configuration"):
        asyncio.run(
            run_all.tune_grid(
                "vllm", grid, running, _args(tmp_path), tmp_path, run_all.PROFILES["quick"], None, results,
                0.0, None, cache=GridCache(tmp_path / "grids.json"),
            )
        )  # fmt: skip
    assert started == []
