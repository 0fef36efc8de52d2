"""perf/aiperf_compare.py: AIPerf is asked for the workload's exact length windows and the frozen SLOs,
its export is read into the same figures as the harness's (or refused when a figure is missing), and
the report flags where the two clients differ by more than 10 %."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from perf import aiperf_compare as ac
from perf.benchlib.metrics import RequestRecord, Slo, summarize
from perf.benchlib.report import section_markers, with_section
from perf.benchlib.workload import WORKLOADS, LengthDist

SLO = Slo(ttft_s=0.5, tpot_s=0.02)

# The figures of a real `aiperf profile` export (AIPerf 0.13.0, 12 requests), trimmed to what is read.
EXPORT = {
    "request_throughput": {"unit": "requests/sec", "avg": 1.68},
    "request_count": {"unit": "requests", "avg": 12.0},
    "time_to_first_token": {"unit": "ms", "avg": 136.7, "p50": 136.8, "p90": 171.0},
    "inter_token_latency": {"unit": "ms", "avg": 4.91, "p50": 4.885, "p90": 5.414},
    "output_sequence_length": {"unit": "tokens", "avg": 44.17},
    "goodput": {"unit": "requests/sec", "avg": 1.68},
}


def window_bounds(window: ac.Window) -> tuple[int, int]:
    return math.floor(window.mean * (1 - window.ratio)), math.ceil(window.mean * (1 + window.ratio))


def test_windows_draw_the_workloads_own_integers() -> None:
    codegen = WORKLOADS["codegen"]
    assert ac.aiperf_window(codegen.prompt).mean == 300
    assert window_bounds(ac.aiperf_window(codegen.prompt)) == (270, 330)
    assert window_bounds(ac.aiperf_window(codegen.output)) == (16, 64)
    assert window_bounds(ac.aiperf_window(WORKLOADS["summarize"].prompt)) == (800, 1500)
    assert ac.aiperf_window(WORKLOADS["decode"].output) == ac.Window(64, 0.0)


def test_windows_refuse_what_aiperf_cannot_draw() -> None:
    with pytest.raises(ValueError, match="lognormal"):
        ac.aiperf_window(WORKLOADS["chat"].prompt)
    with pytest.raises(ValueError, match="no integer mean"):
        ac.aiperf_window(LengthDist("uniform", 16, 63))


def test_the_command_carries_the_windows_slos_rate_and_ignore_eos(tmp_path: Path) -> None:
    argv = ac.aiperf_command(
        Path("aiperf"),
        "http://127.0.0.1:9",
        "tiny",
        tmp_path,
        WORKLOADS["codegen"],
        2.5,
        40,
        SLO,
        tmp_path / "a",
    )

    def value(flag: str) -> str:
        return argv[argv.index(flag) + 1]

    assert argv[:2] == ["aiperf", "profile"]
    assert (value("--isl"), value("--osl"), value("--request-rate"), value("--request-count")) == (
        "300",
        "40",
        "2.5",
        "40",
    )
    ratios = json.loads(value("--random-range-ratio"))
    assert window_bounds(ac.Window(40, ratios["output"])) == (16, 64)
    assert json.loads(value("--extra-inputs")) == {"ignore_eos": True, "temperature": 0}
    assert value("--goodput") == "time_to_first_token:500.000 inter_token_latency:20.000"  # ms
    assert "--use-server-token-count" in argv and value("--endpoint-type") == "completions"


def test_the_export_is_read_into_figures() -> None:
    figures = ac.parse_export(EXPORT)
    assert (figures.requests, figures.errors) == (12, 0)
    assert (figures.ttft_p50_ms, figures.ttft_p90_ms, figures.tpot_p90_ms) == (136.8, 171.0, 5.414)
    assert (figures.throughput_rps, figures.goodput_rps, figures.output_tokens_mean) == (1.68, 1.68, 44.17)
    with_errors = ac.parse_export({**EXPORT, "error_request_count": {"avg": 3.0}})
    assert (with_errors.requests, with_errors.errors) == (15, 3)


def test_an_export_without_a_needed_figure_is_refused() -> None:
    broken = {k: v for k, v in EXPORT.items() if k != "inter_token_latency"}
    with pytest.raises(ValueError, match=r"inter_token_latency\.p50"):
        ac.parse_export(broken)


def record(i: int, ttft: float, tpot: float) -> RequestRecord:
    arrival = float(i)
    first = arrival + ttft
    return RequestRecord(i, arrival, arrival, first, first + tpot * 9, 10, 10, 300, 10, None)


def test_the_harness_figures_and_the_differences() -> None:
    mine = ac.ours(summarize([record(0, 0.1, 0.01), record(1, 0.2, 0.01), record(2, 0.9, 0.01)], SLO))
    assert (mine.requests, mine.errors, mine.output_tokens_mean) == (3, 0, 10)
    assert mine.ttft_p50_ms == pytest.approx(200.0) and mine.tpot_p50_ms == pytest.approx(10.0)
    theirs = ac.Figures("aiperf", 3, 0, 220.0, None, 10.5, 10.0, 0.0, mine.goodput_rps, 10)
    diff = ac.differences(mine, theirs)
    assert diff["ttft_p50_ms"] == pytest.approx(0.1) and diff["tpot_p50_ms"] == pytest.approx(0.05)
    assert diff["ttft_p90_ms"] is None and diff["goodput_rps"] == pytest.approx(0.0)


def test_the_report_flags_differences_over_ten_percent() -> None:
    figures = ac.parse_export(EXPORT)
    row = {
        "deployment": "disagg",
        "started": "disagg serve",
        "aiperf_command": "aiperf profile",
        "harness": figures.__dict__ | {"client": "harness", "ttft_p50_ms": 100.0},
        "aiperf": figures.__dict__,
        "difference": ac.differences(ac.Figures(**(figures.__dict__ | {"ttft_p50_ms": 100.0})), figures),
    }
    out = {
        "workload": "codegen", "model": "tiny", "machine": "2 cores", "count": 12, "rate": 2.0,
        "slo": {"ttft_s": 0.5, "tpot_s": 0.02}, "aiperf_version": "0.13.0", "command": "c", "runs": [row],
    }  # fmt: skip
    text = ac.markdown(out)
    assert "| disagg | AIPerf vs harness |  |  | +37 % **!** |" in text
    assert "| +0 % |" in text  # goodput equal, no flag


def test_rate_and_vllm_come_from_the_bench_results() -> None:
    bench = {
        "goodput": {"codegen": {"disagg": {"goodput_rps": 2.34}}},
        "vllm_grid": {"best": "float32, bind auto"},
    }
    assert ac.from_bench(bench, "codegen") == (2.3, "float32", "auto", 0, "disagg")
    chunked = {**bench, "vllm_grid": {"best": "bfloat16, bind 0-1, 512 batched tokens"}}
    assert ac.from_bench(chunked, "codegen") == (2.3, "bfloat16", "0-1", 512, "disagg")
    with pytest.raises(ValueError, match="no disagg goodput"):
        ac.from_bench(bench, "chat")
    # the disaggregated deployment missed its SLOs at every rate: the best other's goodput is the rate
    goodputs = {"disagg": 0.0, "colocated": 0.452, "vllm": 0.21}
    missed = {**bench, "goodput": {"codegen": {n: {"goodput_rps": g} for n, g in goodputs.items()}}}
    assert ac.from_bench(missed, "codegen") == (0.5, "float32", "auto", 0, "colocated")
    none = {**bench, "goodput": {"codegen": {"disagg": {"goodput_rps": 0.0}, "vllm": {"goodput_rps": 0.01}}}}
    with pytest.raises(ValueError, match="no deployment reached"):
        ac.from_bench(none, "codegen")


def test_the_report_section_is_replaced_not_repeated() -> None:
    once = with_section("# Results\n\nbody\n", ac.SECTION, "## AIPerf\nfirst\n")
    twice = with_section(once + "\n## later\n", ac.SECTION, "## AIPerf\nsecond\n")
    assert twice.count(section_markers(ac.SECTION)[0]) == 1 and "first" not in twice and "second" in twice
    assert twice.startswith("# Results\n\nbody\n") and "## later" in twice


def test_a_runs_cpu_is_metered_for_the_client_and_the_server_apart() -> None:
    import subprocess
    import sys

    spin = "import time\nend = time.process_time() + 0.4\nwhile time.process_time() < end: pass\n"
    busy = subprocess.Popen([sys.executable, "-c", spin])
    try:
        with ac.metered(lambda: [busy.pid], lambda: []) as usage:
            busy.wait(timeout=30)
    finally:
        busy.kill()
    (used,) = usage
    # the client spun 0.4 s of CPU (its start-up adds a little); the idle server spent none
    assert 0.3 <= used.client_cpu_s <= used.wall_s + 0.2 and used.server_cpu_s == 0.0
    figures = ac.parse_export(EXPORT)
    row = {
        "deployment": "disagg", "started": "s", "aiperf_command": "a",
        "harness": figures.__dict__ | {"client": "harness", "cpu": {"wall_s": 10.0, "client_cpu_s": 2.0,
                                                                    "server_cpu_s": 15.0}},
        "aiperf": figures.__dict__ | {"cpu": {"wall_s": 20.0, "client_cpu_s": 24.0, "server_cpu_s": 16.0}},
        "difference": ac.differences(figures, figures),
    }  # fmt: skip
    out = {
        "workload": "codegen", "model": "tiny", "machine": "2 cores", "count": 12, "rate": 2.0,
        "slo": {"ttft_s": 0.5, "tpot_s": 0.02}, "aiperf_version": "0.13.0", "command": "c", "runs": [row],
    }  # fmt: skip
    lines = ac.markdown(out).splitlines()
    assert next(x for x in lines if x.startswith("| disagg | harness |")).endswith("| 0.20 | 1.50 |")
    assert next(x for x in lines if x.startswith("| disagg | aiperf |")).endswith("| 1.20 | 0.80 |")
