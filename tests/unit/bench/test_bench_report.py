"""Report and plots rendered from a results dict made of hand-written records."""

from __future__ import annotations

import pytest

from perf.benchlib import report
from perf.benchlib.experiment import GoodputResult, InterferenceResult, RateRun
from perf.benchlib.metrics import RequestRecord, Slo, summarize
from perf.benchlib.slo import Calibration

SLO = Slo(0.5, 0.05)


def run(rate: float, tpot: float, kinds: tuple[str, ...] = ("short",) * 4) -> RateRun:
    records = [
        RequestRecord(
            i, i / rate, i / rate, i / rate + 0.1, i / rate + 0.1 + 9 * tpot, 10, 10, 10, 10, None, k
        )
        for i, k in enumerate(kinds)
    ]
    return RateRun(rate, summarize(records, SLO), records)


def results() -> tuple[dict, dict]:
    cal = Calibration("codegen", "colocated", 300, 0.1, 0.02, SLO, 3)
    goodput = {
        "colocated": GoodputResult("codegen", 1.0, 2, [run(1.0, 0.02), run(2.0, 0.08)]),
        "vllm": GoodputResult("codegen", 2.0, 2, [run(1.0, 0.02), run(2.0, 0.03), run(4.0, 0.09)]),
    }
    mixed = run(4.0, 0.05, ("short", "long", "short", "short"))
    mixed = RateRun(mixed.rate, mixed.summary, mixed.records, {"stub:decode": {"cpu1": 3.0, "cpu0": 0.5}})
    inter = InterferenceResult(4.0, 4, 0.2, 300, run(4.0, 0.02), mixed)
    res = {
        "meta": {
            "command": "python -m perf.run_all --quick", "mode": "quick", "finished": "now",
            "elapsed_s": 60.0, "machine": "test", "model": "tiny", "token_counting": "pieces", "notes": ["n"],
        },
        "slo_rule": "rule",
        "target_attainment": 0.9,
        "calibrations": {"codegen": cal.to_dict()},
        "deployments": {
            "colocated": {"endpoint": "x", "cores": 2, "note": "c", "available": True, "reason": ""},
            "disagg": {"endpoint": "x", "cores": 2, "note": "d", "available": False, "reason": "not ready"},
        },
        "goodput": {"codegen": {n: g.to_dict() for n, g in goodput.items()}},
        "interference": {"colocated": inter.to_dict(with_records=False)},
    }  # fmt: skip
    records = {"goodput": {"codegen": {n: g.runs[0].to_dict() for n, g in goodput.items()}}}
    return res, records


def test_interference_figures_use_short_requests_only():
    inter = InterferenceResult(4.0, 4, 0.2, 300, run(4.0, 0.02), run(4.0, 0.05, ("long",) * 3 + ("short",)))
    assert len(inter.short_tpots(inter.mixed)) == 1
    fig = inter.figures()
    assert fig["ratio_p99"] == fig["mixed_tpot_p99"] / fig["decode_only_tpot_p99"]
    assert abs(fig["ratio_p99"] - 2.5) < 1e-9


def test_plots_are_written(tmp_path):
    # matplotlib comes with the `bench` extra, which a plain test install may lack.
    plots = pytest.importorskip("perf.benchlib.plots", exc_type=ImportError)
    res, records = results()
    written = [
        *plots.attainment_plots(res, tmp_path),
        *plots.cdf_plots(res, records, tmp_path),
        *plots.interference_plot(res, tmp_path),
    ]
    assert [p.name for p in written] == ["attainment_codegen.png", "cdf_codegen.png", "interference.png"]
    assert all(p.stat().st_size > 10_000 and p.read_bytes()[:4] == b"\x89PNG" for p in written)


def test_an_earlier_runs_workload_without_calibration_is_not_plotted(tmp_path):
    """--keep-earlier carries records of workloads this run did not calibrate: no CDF for those."""
    plots = pytest.importorskip("perf.benchlib.plots", exc_type=ImportError)
    res, records = results()
    records["goodput"]["summarize"] = records["goodput"]["codegen"]
    assert [p.name for p in plots.cdf_plots(res, records, tmp_path)] == ["cdf_codegen.png"]


def test_report_states_slos_ratios_and_unique_prompts():
    res, _ = results()
    names = {"attainment": ["attainment_codegen.png"], "cdf": ["cdf_codegen.png"], "interference": ["i.png"]}
    text = report.render(res, names)
    assert report.UNIQUE_PROMPTS_NOTE in text
    assert "**500.0**" in text and "**50.0**" in text  # the SLOs in ms
    # goodput, its bracket (from the probes: 4.0 missed), how the search stopped, disagg vs it, vs colocated
    assert "| vllm | **2.000** | [2.000, 4.000) (100.0%) | – | – | 2.00× |" in text
    assert "**2.50×**" in text  # interference p99 ratio
    assert "not measured: not ready" in text
    assert "| colocated | stub:decode | 0.5 | 3.0 | 3.5 |" in text  # CPU placement, cores in order
    assert "![attainment_codegen.png](attainment_codegen.png)" in text


def test_report_checks_the_targets_and_splits_the_orchestration_cost():
    res, _ = results()
    disagg = GoodputResult("codegen", 2.5, 2, [run(2.5, 0.02)])
    res["goodput"]["codegen"]["disagg"] = disagg.to_dict()
    mixed = run(4.0, 0.0236)
    cpu = {"stub:decode": {"cpu1": 20.0, "cpu0": 0.2}, "tritonserver": {"cpu1": 1.0, "cpu0": 2.0}}
    mixed = RateRun(mixed.rate, mixed.summary, mixed.records, {**cpu, "load generator": {"cpu1": 2.0}})
    inter = InterferenceResult(4.0, 4, 0.2, 300, run(4.0, 0.02), mixed)
    res["interference"]["disagg"] = inter.to_dict(with_records=False)
    orchestration = {
        "finished": "t",
        "tokens": 64,
        "reps": 3,
        "tpot_ms": {"engine step": 10.0, "engine loop": 10.2, "ensemble": 11.0, "llm": 10.6},
        "decode_engine_step_ms": {"engine loop": 10.0, "ensemble": 10.5, "llm": 10.4},
        "overhead_vs_engine_loop": {"ensemble": 11.0 / 10.2 - 1, "llm": 10.6 / 10.2 - 1},
    }
    text = report.render(res, {}, orchestration)
    # disagg [2.5, open) against vLLM's [2.0, 4.0), the best other: 2.5 < 1.3 x 4.0, and they overlap
    row = "| codegen goodput, disaggregated vs the best other | ≥ 1.3× |"
    assert (
        f"{row} [2.500, –) vs vllm [2.000, 4.000): low / high 0.62× | **missed (tie: brackets overlap)** |"
        in text
    )
    assert "| disagg | **2.500** | [2.500, –) | – | – |" in text
    assert "| vllm | **2.000** | [2.000, 4.000) (100.0%) | – | tie (overlap) |" in text
    # interference 1.18x (colocated's 2.50x beside it): met at <= 1.2x
    assert "| ≤ 1.2× | 1.18× (colocated 2.50×) | met |" in text
    assert "ensemble +7.8%, llm +3.9% | **missed** |" in text  # the worse path decides
    # ensemble: +0.80 ms over the loop = the step 0.50 ms slower in the server + 0.30 ms more between steps
    assert "`ensemble`: +0.80 ms per token over the engine loop" in text
    assert "is +0.50 ms slower inside the server, and 0.50 ms pass between steps" in text
    assert "(engine loop: 0.20 ms)" in text
    # what shared the decode core in the mixed run, measured
    assert "the decode engine ran on cpu1 (20.0 s); other processes took 3.0 s of that core" in text
    assert "(15% of decode's time; most: load generator 2.0 s, tritonserver 1.0 s)" in text


def test_the_orchestration_cost_reports_the_colocated_step_inside_against_alone():
    orchestration = {
        "tokens": 64,
        "reps": 3,
        "tpot_ms": {"engine step": 10.0, "engine loop": 10.2},
        "colocated": {"engine_step_ms": 8.0, "tpot_ms": 10.5, "server_step_ms": 10.0},
    }
    text = "\n".join(report.orchestration_section(orchestration))
    assert "| engine step, both cores | 8.00 | 8.00 | 1.00 |" in text
    assert "| ensemble_colocated | 10.50 | 10.00 | 1.25 |" in text
    no_metrics = {**orchestration, "colocated": {**orchestration["colocated"], "server_step_ms": None}}
    assert "| ensemble_colocated | 10.50 | – | – |" in "\n".join(report.orchestration_section(no_metrics))
    assert "both cores" not in "\n".join(report.orchestration_section({**orchestration, "colocated": None}))


def test_a_full_run_keeps_the_sections_other_benchmarks_wrote():
    from perf.benchlib.report import keeping_sections, sections, with_section

    old = with_section(with_section("# old table\n", "hot_prompts", "## Hot\nrows"), "rollout", "## Roll")
    assert sections(old) == {"hot_prompts": "## Hot\nrows", "rollout": "## Roll"}
    new = keeping_sections("# new table\n", old)
    assert new.startswith("# new table") and "old table" not in new
    assert sections(new) == sections(old)
    assert keeping_sections(new, old) == new, "idempotent"


def test_publish_writes_the_report_and_its_section_one_level_down(tmp_path):
    results = tmp_path / "RESULTS.md"
    results.write_text("# Results\n\nkept\n")
    report.publish("# Tuner\n\nfirst\n", tmp_path / "tuner.md", results, "tuner")
    report.publish("# Tuner\n\nsecond\n", tmp_path / "tuner.md", results, "tuner")
    assert (tmp_path / "tuner.md").read_text() == "# Tuner\n\nsecond\n"
    text = results.read_text()
    assert "kept" in text and "## Tuner\n\nsecond" in text and "first" not in text
    report.publish("# Alone\n", tmp_path / "alone.md", tmp_path / "missing.md", "alone")
    assert not (tmp_path / "missing.md").exists(), "a results file that is not there is not created"


def test_targets_apply_the_bracket_rule():
    from perf.benchlib.search import Bracket

    res, _ = results()

    def entry(low: float, high: float | None) -> dict:
        return GoodputResult("codegen", low, 2, [run(low, 0.02)], Bracket(low, high), "narrow").to_dict()

    def verdict(ours: tuple, vllm: tuple, workload: str = "codegen") -> str:
        res["goodput"] = {
            workload: {"disagg": entry(*ours), "vllm": entry(*vllm), "colocated": entry(0.5, 0.51)}
        }
        text = report.render(res, {})
        row = next(line for line in text.splitlines() if line.startswith(f"| {workload} goodput"))
        return row.rsplit("|", 2)[1].strip()

    assert verdict((2.6, 2.65), (1.9, 2.0)) == "met"  # 2.6 >= 1.3 x 2.0
    assert verdict((2.59, 2.65), (1.9, 2.0)) == "**missed**"  # 2.59 < 2.6, and no overlap
    assert verdict((1.95, 2.05), (1.9, 2.0)) == "**missed (tie: brackets overlap)**"
    assert verdict((1.0, 1.1), (1.9, 2.0)) == "**missed (below)**"
    assert verdict((3.9, 4.0), (1.9, 2.0), "summarize") == "**missed**"  # 2x wanted: 3.9 < 4.0
    assert verdict((4.0, 4.1), (1.9, 2.0), "summarize") == "met"
    # another deployment whose search never missed (an open bracket) can never be beaten
    assert verdict((9.0, 9.5), (1.9, None)) == "**missed (tie: brackets overlap)**"
    # the best other is the one that reaches highest, not the first listed
    res["goodput"] = {
        "codegen": {"disagg": entry(2.6, 2.7), "vllm": entry(1.0, 1.1), "llamacpp": entry(1.9, 2.1)}
    }
    text = report.render(res, {})
    assert "vs llamacpp [1.900, 2.100): low / high 1.24× | **missed** |" in text


def test_interference_is_pooled_over_seeds_with_each_seeds_ratio_kept():
    from perf.benchlib.experiment import PooledInterference

    def pair(base: float, mixed: float) -> InterferenceResult:
        return InterferenceResult(4.0, 4, 0.2, 300, run(4.0, base), run(4.0, mixed, ("short", "long") * 2))

    pooled = PooledInterference((1, 2, 3), (pair(0.02, 0.022), pair(0.02, 0.030), pair(0.04, 0.044)))
    assert [round(r, 3) for r in pooled.seed_ratios("p99")] == [1.1, 1.5, 1.1]
    fig = pooled.figures()
    # pooled: 12 decode-only TPOTs (8 of 0.02, 4 of 0.04) against 6 mixed short ones (0.022, 0.030, 0.044)
    assert fig["decode_only_tpot_p50"] == pytest.approx(0.02)
    assert fig["mixed_tpot_p99"] == pytest.approx(0.044, rel=0.01)
    assert fig["ratio_p99"] == fig["mixed_tpot_p99"] / fig["decode_only_tpot_p99"]
    d = pooled.to_dict(with_records=True)
    assert d["seeds"] == [1, 2, 3] and [e["seed"] for e in d["per_seed"]] == [1, 2, 3]
    assert len(d["mixed"]["records"]) == 12 and len(d["mixed"]["summaries"]) == 3
    assert "records" not in pooled.to_dict(with_records=False)["mixed"]
    res, _ = results()
    res["interference"] = {"disagg": pooled.to_dict(with_records=False)}
    text = report.render(res, {})
    assert "| disagg | 4.00 | 4 | 3 |" in text and "| 1: 1.10×, 2: 1.50×, 3: 1.10× | this run |" in text
    assert "3 seeds pooled" in text


def test_the_full_runs_orchestration_cost_is_read_where_it_is_written(tmp_path) -> None:
    """`make bench` writes the orchestration cost into its committed folder and its report reads it
    there (it once read a file that folder had replaced, so the report lost the table); a run into a
    scratch folder writes and reads its own, leaving the committed results alone."""
    from perf import orchestration_cost, run_all

    default = run_all.parse_args(["--full"])
    assert run_all.orchestration_dir(default) == orchestration_cost.RESULTS
    assert (run_all.orchestration_dir(default) / "orchestration_cost.json").is_file()  # committed
    scratch = run_all.parse_args(["--full", "--out-dir", str(tmp_path)])
    assert run_all.orchestration_dir(scratch) == tmp_path / "orchestration_cost"
