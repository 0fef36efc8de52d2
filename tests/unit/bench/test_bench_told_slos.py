"""Our deployments told the SLOs they are judged by: each workload's search, and the interference pair,
on a server of its own whose orchestrators carry that workload's SLOs, as `disagg repository --set
entry_points.slo.ttft_s=... --set entry_points.slo.tpot_s=...` writes them."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import pytest
from test_bench_alone import FROZEN
from test_bench_disagg_grid import REPOSITORY, parameters

from disagg_tools.repository import Layout, write
from perf import run_all
from perf.benchlib.metrics import Slo
from perf.benchlib.slo import FIXED_SLOS
from perf.benchlib.timeplan import TimePlan


def test_the_told_repository_carries_what_the_spec_writes_for_its_slo(tmp_path: Path) -> None:
    told = run_all.told_repository(REPOSITORY, tmp_path / "told", Slo(1.626, 0.0676))
    generated = tmp_path / "generated"
    write(generated, Layout(slo_ttft_s=1.626, slo_tpot_s=0.0676, decode_lend_tpot_s=0.05))
    default = tmp_path / "default"
    write(default, Layout())
    assert parameters(told) == parameters(generated)
    assert parameters(told)["orchestrator"]["slo.ttft_s"] == "1.626"
    assert parameters(told)["orchestrator_colocated"]["slo.tpot_s"] == "0.0676"
    assert parameters(told)["decode"] == parameters(default)["decode"]  # the pools' loans as tuned


def test_a_margin_the_repository_says_is_kept_when_told(tmp_path: Path) -> None:
    """Told an SLO, the untold default margin (2) becomes the told one (1), as the spec's default does;
    a repository that says another margin keeps it."""
    said = tmp_path / "said"
    write(said, Layout(admission_margin=3.0))
    told = run_all.told_repository(said, tmp_path / "told", Slo(1.626, 0.0676))
    assert parameters(told)["orchestrator"]["admission.margin"] == "3"
    assert (
        parameters(run_all.told_repository(REPOSITORY, tmp_path / "t2", Slo(1.0, 0.1)))["llm"][
            "admission.margin"
        ]
        == "1"
    )


def test_the_judging_slo_is_the_given_one_or_the_frozen_one() -> None:
    assert run_all.judging_slo("codegen@article", None) == FIXED_SLOS["codegen@article"].slo
    assert run_all.judging_slo("chat", FROZEN) == FROZEN["chat"].slo
    assert run_all.judging_slo("summarize", FROZEN) is None  # derived by the run


class Server:
    """A fake running Triton: its repository, and whether it was stopped."""

    def __init__(self, repository: Path) -> None:
        self.repository, self.stopped = repository, False
        self.pid = 4242
        self.config = dataclasses.make_dataclass("C", [("grpc_url", str)])("127.0.0.1:1")

    def stop(self) -> None:
        self.stopped = True


def test_each_part_runs_on_a_server_told_its_workloads_slo(monkeypatch: pytest.MonkeyPatch) -> None:
    servers: list[Server] = []
    parts: list[tuple[tuple[str, ...], tuple[str, ...], list[bool]]] = []

    def start(repository, workdir, model_dir, cpus=()):
        servers.append(Server(repository))
        return servers[-1]

    async def measure(dep, profile, factory, results, records, plan, experiments, frozen, starts):
        parts.append((profile.workloads, experiments, [s.stopped for s in servers]))
        assert dep.config.url == "127.0.0.1:1" and dep.pgid == 4242

    monkeypatch.setattr(run_all, "start_triton", start)
    monkeypatch.setattr(run_all, "measure", measure)
    args = run_all.parse_args(["--quick", "--model-dir", "/m"])
    profile = dataclasses.replace(run_all.PROFILES["quick"], workloads=("codegen", "codegen@article"))
    dep = run_all.Deployment("disagg", None, 2, "", available=True)
    experiments = ("goodput", "interference")
    asyncio.run(
        run_all.measure_told(
            dep, REPOSITORY, args, profile, None, {}, {}, TimePlan(1e18), experiments, FROZEN, None
        )
    )
    assert parts == [
        (("codegen",), ("goodput",), [False]),
        (("codegen@article",), ("goodput",), [True, False]),
        (("codegen", "codegen@article"), ("interference",), [True, True, False]),
    ]
    told = [parameters(s.repository)["orchestrator"] for s in servers]
    assert [(p["slo.ttft_s"], p["slo.tpot_s"]) for p in told] == [
        ("0.8", "0.06"),
        ("0.5", "0.05"),
        ("0.8", "0.06"),
    ]
    assert all(s.stopped for s in servers)


def test_a_workload_without_an_slo_yet_is_refused_before_any_server_starts(monkeypatch) -> None:
    monkeypatch.setattr(run_all, "start_triton", lambda *a, **k: pytest.fail("a server was started"))
    args = run_all.parse_args(["--quick", "--model-dir", "/m"])
    profile = dataclasses.replace(run_all.PROFILES["quick"], workloads=("summarize",))
    dep = run_all.Deployment("colocated", None, 2, "", available=True)
    with pytest.raises(ValueError, match="summarize: no SLO to tell"):
        asyncio.run(
            run_all.measure_told(
                dep, REPOSITORY, args, profile, None, {}, {}, TimePlan(1e18), ("goodput",), FROZEN, None
            )
        )


def test_telling_is_the_default_and_can_be_switched_off() -> None:
    assert run_all.parse_args(["--quick"]).tell_slos is True
    assert run_all.parse_args(["--quick", "--no-tell-slos"]).tell_slos is False
