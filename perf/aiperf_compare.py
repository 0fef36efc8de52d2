"""AIPerf's figures beside the project's harness: the same deployment, workload, rate and SLOs, two clients.

For each deployment, one open-loop Poisson run of the project's harness (`benchlib`, its OpenAI client)
and then one run of AIPerf (`aiperf profile`, PyPI `aiperf` in its own venv `.venv-aiperf`) at the same
rate and request count, the same prompt and output length windows, greedy with the end token ignored,
judged by the same frozen SLOs (`perf/slos.json`, AIPerf's `--goodput`). Both clients speak OpenAI
`/v1/completions` with streaming, so they measure the same server path:

  disagg     our OpenAI front end -> Triton `llm`, the project's repository (prefill core 0, decode core 1)
  colocated  the same with the orchestrators in `mode: colocated` (one continuous-batching pool)
  vllm       vLLM CPU's OpenAI server (`.venv-vllm`), `--vllm-dtype` and `--vllm-omp-bind`

    .venv/bin/python -m perf.aiperf_compare --model-dir .models/tiny --rate 2 --count 60

Writes `<out-dir>/aiperf_compare.json` and `.md`; AIPerf's own exports stay in `<out-dir>/aiperf/`.

Where the two clients' definitions differ (the report prints this too):
- TTFT: ours from the scheduled arrival (a late send is charged to the server), AIPerf's from the send.
- TPOT: ours (last - first token) / (n - 1) with n the server's `usage.completion_tokens`; AIPerf's
  inter-token latency is the same quotient, with `--use-server-token-count` so n is the same count.
- Goodput: ours is requests meeting both SLOs over the window from the first scheduled arrival to the
  last completion; AIPerf's is the same count over its own benchmark duration. Errors count as misses
  in both.

Both clients run on the deployment's two cores, so the CPU a client spends is taken from the server: the
CPU seconds of each client's processes and of the deployment's (benchlib.cpuprobe) are measured over each
run, beside its wall time, to show where a difference between the clients comes from.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import math
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from perf.benchlib.clients import ClientConfig, make_client
from perf.benchlib.cliutil import DEFAULT_MODEL_DIR, REPO_ROOT, log, machine, write_json
from perf.benchlib.cpuprobe import CpuProbe, group_members
from perf.benchlib.deploy import (
    VllmConfig,
    VllmServer,
    free_port,
    start_triton,
    vllm_command_line,
    wait_for_health,
    with_orchestrator_parameters,
)
from perf.benchlib.experiment import RunPlan, run_rate
from perf.benchlib.metrics import Slo, Summary
from perf.benchlib.report import with_section
from perf.benchlib.slo import SLO_FILE, load_frozen
from perf.benchlib.workload import WORKLOADS, LengthDist, PromptFactory, Workload

PERF = Path(__file__).resolve().parent
AIPERF_VENV = REPO_ROOT / ".venv-aiperf"
AIPERF_VERSION = "0.13.0"
AIPERF_INSTALL = f"python3 -m venv .venv-aiperf && .venv-aiperf/bin/pip install aiperf=={AIPERF_VERSION}"
DEPLOYMENTS = ("disagg", "colocated", "vllm")
WARMUP_REQUESTS = 4
DIFFERENCE_FLAG = 0.10
"""A figure whose two clients differ by more than this share is flagged for explanation."""


@dataclass(frozen=True)
class Window:
    """AIPerf's uniform length window: integers in [floor(mean (1 - ratio)), ceil(mean (1 + ratio))]."""

    mean: int
    ratio: float


def aiperf_window(dist: LengthDist) -> Window:
    """The AIPerf window that draws the same integers as `dist`; ValueError where none does."""
    if dist.kind == "fixed":
        return Window(int(dist.a), 0.0)
    if dist.kind != "uniform":
        raise ValueError(f"AIPerf cannot draw a {dist.kind} length distribution (only fixed or uniform)")
    low, high = int(dist.a), int(dist.b)
    if (low + high) % 2:
        raise ValueError(f"the window [{low}, {high}] has no integer mean")
    mean = (low + high) // 2
    ratio = (high - low) / (low + high) - 1e-9  # below the exact ratio: floor/ceil land on low and high
    window = Window(mean, ratio)
    if (math.floor(mean * (1 - ratio)), math.ceil(mean * (1 + ratio))) != (low, high):
        raise ValueError(f"no AIPerf window gives [{low}, {high}]")
    return window


def aiperf_command(
    aiperf: Path,
    url: str,
    model_id: str,
    tokenizer: Path,
    workload: Workload,
    rate: float,
    count: int,
    slo: Slo,
    artifact_dir: Path,
    seed: int = 0,
) -> list[str]:
    """The `aiperf profile` command line for one run (see the module contract)."""
    prompt, output = aiperf_window(workload.prompt), aiperf_window(workload.output)
    extra = {"ignore_eos": True, "temperature": 0}
    return [
        str(aiperf), "profile",
        "--model", model_id,
        "--tokenizer", str(tokenizer),
        "--url", url,
        "--endpoint-type", "completions",
        "--streaming",
        "--use-server-token-count",
        "--isl", str(prompt.mean),
        "--osl", str(output.mean),
        "--random-range-ratio", json.dumps({"input": prompt.ratio, "output": output.ratio}),
        "--extra-inputs", json.dumps(extra),
        "--request-rate", f"{rate:g}",
        "--arrival-pattern", "poisson",
        "--request-count", str(count),
        "--random-seed", str(seed),
        "--goodput", f"time_to_first_token:{slo.ttft_s * 1e3:.3f} inter_token_latency:{slo.tpot_s * 1e3:.3f}",
        "--workers-max", "1",
        "--record-processors", "1",
        "--ui-type", "none",
        "--no-server-metrics",
        "--artifact-dir", str(artifact_dir),
    ]  # fmt: skip


@dataclass(frozen=True)
class Figures:
    """One client's figures of one run (times in ms, rates in requests/s)."""

    client: str
    requests: int
    errors: int
    ttft_p50_ms: float | None
    ttft_p90_ms: float | None
    tpot_p50_ms: float | None
    tpot_p90_ms: float | None
    throughput_rps: float | None
    goodput_rps: float | None
    output_tokens_mean: float | None
    cpu: Usage | None = None
    """CPU seconds of the client and of the deployment while this client's run lasted."""


@dataclass(frozen=True)
class Usage:
    """CPU seconds spent by a client's processes and by the deployment's over a run of `wall_s`."""

    wall_s: float
    client_cpu_s: float
    server_cpu_s: float


def cpu_seconds(usage: Mapping[str, Mapping[str, float]]) -> float:
    """The total of a `CpuProbe.stop()` result."""
    return round(sum(sum(per.values()) for per in usage.values()), 3)


@contextlib.contextmanager
def metered(client: Callable[[], list[int]], server: Callable[[], list[int]]) -> Iterator[list[Usage]]:
    """Probes the client's and the server's processes while the block runs; the list it yields gets the
    Usage when the block ends."""
    probes = CpuProbe(client).start(), CpuProbe(server).start()
    started = time.monotonic()
    out: list[Usage] = []
    try:
        yield out
    finally:
        wall = time.monotonic() - started
        client_usage, server_usage = (probe.stop() for probe in probes)
        out.append(Usage(round(wall, 3), cpu_seconds(client_usage), cpu_seconds(server_usage)))


def ours(summary: Summary) -> Figures:
    def ms(value: float | None) -> float | None:
        return None if value is None else value * 1e3

    tokens = None if summary.n_ok == 0 else summary.token_throughput * summary.window_s / summary.n_ok
    return Figures(
        "harness",
        summary.n_requests,
        summary.n_errors,
        ms(summary.ttft_p50),
        ms(summary.ttft_p90),
        ms(summary.tpot_p50),
        ms(summary.tpot_p90),
        summary.throughput_rps,
        summary.goodput_rps,
        tokens,
    )


def parse_export(data: Mapping[str, Any]) -> Figures:
    """AIPerf's summary export (`profile_export_aiperf.json`) as Figures; ValueError when a figure the
    comparison needs is missing (an AIPerf whose schema changed must not give a silent blank)."""

    def metric(name: str, stat: str, required: bool = True) -> float | None:
        entry = data.get(name)
        if not isinstance(entry, Mapping) or entry.get(stat) is None:
            if required:
                raise ValueError(f"AIPerf's export has no {name}.{stat}")
            return None
        return float(entry[stat])

    counted = metric("request_count", "avg")  # requests that completed without error
    errors = metric("error_request_count", "avg", required=False) or 0.0
    return Figures(
        "aiperf",
        int(counted or 0) + int(errors),
        int(errors),
        metric("time_to_first_token", "p50"),
        metric("time_to_first_token", "p90"),
        metric("inter_token_latency", "p50"),
        metric("inter_token_latency", "p90"),
        metric("request_throughput", "avg"),
        metric("goodput", "avg", required=False) or 0.0,
        metric("output_sequence_length", "avg", required=False),
    )


def differences(base: Figures, other: Figures) -> dict[str, float | None]:
    """`other` relative to `base` per figure: other / base - 1 (None where either is missing or 0)."""
    out: dict[str, float | None] = {}
    for name in ("ttft_p50_ms", "ttft_p90_ms", "tpot_p50_ms", "tpot_p90_ms", "throughput_rps", "goodput_rps"):
        a, b = getattr(base, name), getattr(other, name)
        out[name] = None if a is None or b is None or a == 0 else b / a - 1
    return out


def read_export(artifact_dir: Path) -> dict[str, Any]:
    found = sorted(artifact_dir.rglob("profile_export_aiperf.json"))
    if not found:
        raise RuntimeError(f"AIPerf wrote no profile_export_aiperf.json under {artifact_dir}")
    return json.loads(found[-1].read_text())


@contextlib.contextmanager
def deployment(
    name: str, args: argparse.Namespace, scratch: Path
) -> Iterator[tuple[str, str, Callable[[], list[int]]]]:
    """Start `name`; yields (OpenAI base URL without /v1, the exact command that started it, the live
    processes serving it)."""
    if name == "vllm":
        config = VllmConfig(
            model_dir=args.model_dir.resolve(),
            omp_bind=args.vllm_omp_bind,
            dtype=args.vllm_dtype,
            log_path=scratch / "vllm.log",
            served_name=args.model_dir.name,
            extra_args=(
                ("--max-num-batched-tokens", str(args.vllm_max_batched_tokens))
                if args.vllm_max_batched_tokens
                else ()
            ),
        )
        command = vllm_command_line(config)
        log(f"starting vLLM: {command}")
        with VllmServer(config).start() as server:
            server.wait_healthy()
            yield config.url, command, lambda: group_members(server.pid)
        return
    from disagg.openai.launcher import FrontendLaunch, FrontendProcess

    repository = REPO_ROOT / "model_repository"
    if name == "colocated":
        repository = with_orchestrator_parameters(repository, scratch / name, {"mode": "colocated"})
    log(f"starting Triton ({name}) on {repository} ...")
    server = start_triton(repository, scratch / name, args.model_dir, exit_timeout_s=10)
    frontend = FrontendProcess(
        FrontendLaunch("127.0.0.1", free_port(), server.config.grpc_url, args.model_dir.resolve())
    )
    try:
        frontend.start()
        url = frontend.url.removesuffix("/v1")
        wait_for_health(f"{url}/health", frontend, "the OpenAI front end")

        def serving() -> list[int]:
            return [*group_members(server.pid), *([frontend.pid] if frontend.pid else [])]

        yield url, f"disagg serve on {repository.name} ({name}), OpenAI front end {url}", serving
    finally:
        frontend.stop()
        server.stop(grace_s=5)


async def harness_run(url: str, args: argparse.Namespace, workload: Workload, slo: Slo) -> Summary:
    client = make_client(ClientConfig(kind="openai", url=url, model=args.model_dir.name))
    factory = PromptFactory.from_model_dir(args.model_dir)
    await client.open()
    try:
        warm = RunPlan(WARMUP_REQUESTS / args.rate, WARMUP_REQUESTS, WARMUP_REQUESTS, seed=args.seed + 1)
        await run_rate(client, workload, factory, args.rate, slo, warm)
        plan = RunPlan(args.count / args.rate, args.count, args.count, seed=args.seed)
        run = await run_rate(client, workload, factory, args.rate, slo, plan)
    finally:
        await client.close()
    return run.summary


def measure(
    name: str, args: argparse.Namespace, workload: Workload, slo: Slo, scratch: Path
) -> dict[str, Any]:
    with deployment(name, args, scratch) as (url, started, serving):
        log(f"{name}: the harness, {args.count} requests at {args.rate:g}/s ...")
        with metered(lambda: [os.getpid()], serving) as harness_cpu:
            summary = asyncio.run(harness_run(url, args, workload, slo))
        artifacts = args.out_dir / "aiperf" / name
        command = aiperf_command(
            args.aiperf, url, args.model_dir.name, args.model_dir.resolve(), workload, args.rate,
            args.count, slo, artifacts, args.seed,
        )  # fmt: skip
        log(f"{name}: AIPerf: {shlex.join(command)}")
        process = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, process_group=0
        )
        with metered(lambda: group_members(process.pid), serving) as aiperf_cpu:
            output, _ = process.communicate()
        if process.returncode != 0:
            tail = "\n".join(output.splitlines()[-15:])
            raise RuntimeError(f"AIPerf exited with {process.returncode}:\n{tail}")
        theirs = dataclasses.replace(parse_export(read_export(artifacts)), cpu=aiperf_cpu[0])
    mine = dataclasses.replace(ours(summary), cpu=harness_cpu[0])
    return {
        "deployment": name,
        "started": started,
        "aiperf_command": shlex.join(command),
        "harness": asdict(mine),
        "aiperf": asdict(theirs),
        "difference": differences(mine, theirs),
    }


def markdown(out: Mapping[str, Any]) -> str:
    def num(value: float | None, digits: int = 1) -> str:
        return "–" if value is None else f"{value:.{digits}f}"

    def cores(usage: Mapping[str, float] | None) -> list[str]:
        if not usage or not usage["wall_s"]:
            return ["–", "–"]
        return [f"{usage[k] / usage['wall_s']:.2f}" for k in ("client_cpu_s", "server_cpu_s")]

    def share(value: float | None) -> str:
        if value is None:
            return "–"
        flag = " **!**" if abs(value) > DIFFERENCE_FLAG else ""
        return f"{value * 100:+.0f} %{flag}"

    slo = out["slo"]
    lines = [
        f"# AIPerf beside the harness: `{out['workload']}` on {out['model']}",
        "",
        f"{out['machine']}. {out['count']} requests at {out['rate']:g} req/s "
        f"({out.get('rate_from', '--rate')}; Poisson) per client and "
        f"deployment, frozen SLOs TTFT {slo['ttft_s'] * 1e3:.0f} ms, TPOT {slo['tpot_s'] * 1e3:.1f} ms. "
        f"The harness ran first, then AIPerf {out['aiperf_version']}, on the same warm server.",
        "",
        "| deployment | client | requests | errors | TTFT p50 | TTFT p90 | TPOT p50 | TPOT p90 | "
        "output tokens | throughput | goodput | client CPU (cores) | server CPU (cores) |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in out["runs"]:
        for side in ("harness", "aiperf"):
            f = row[side]
            cells = [row["deployment"], side, str(f["requests"]), str(f["errors"])]
            cells += [num(f["ttft_p50_ms"], 0), num(f["ttft_p90_ms"], 0)]
            cells += [num(f["tpot_p50_ms"], 2), num(f["tpot_p90_ms"], 2), num(f["output_tokens_mean"])]
            cells += [num(f["throughput_rps"], 2), num(f["goodput_rps"], 2), *cores(f.get("cpu"))]
            lines.append("| " + " | ".join(cells) + " |")
        d = row["difference"]
        cells = [row["deployment"], "AIPerf vs harness", "", ""]
        cells += [share(d[k]) for k in ("ttft_p50_ms", "ttft_p90_ms", "tpot_p50_ms", "tpot_p90_ms")]
        cells += ["", share(d["throughput_rps"]), share(d["goodput_rps"]), "", ""]
        lines.append("| " + " | ".join(cells) + " |")
    lines += [
        "",
        "CPU (cores): CPU seconds over the run's wall time, of the client's processes and of the "
        "deployment's (Triton, its stubs and the OpenAI front end; vLLM's processes), sampled from /proc. "
        "Both clients share the machine's cores with the deployment.",
        "",
        f"**!**: the clients differ by more than {DIFFERENCE_FLAG:.0%}. Definitions:",
        "",
    ]
    lines += [f"- {line}" for line in DEFINITIONS]
    lines += ["", "Commands:", ""]
    for row in out["runs"]:
        lines += [f"- {row['deployment']}: `{row['started']}`", f"  - AIPerf: `{row['aiperf_command']}`"]
    lines += [f"- this report: `{out['command']}`", ""]
    return "\n".join(lines)


DEFINITIONS = (
    "TTFT: the harness's from the scheduled arrival (a late send is charged to the server), AIPerf's from "
    "the send.",
    "TPOT: both (last - first token) / (n - 1), n the server's `usage.completion_tokens` "
    "(AIPerf: `--use-server-token-count`); AIPerf calls it inter-token latency.",
    "goodput: requests meeting both SLOs per second; the harness's window runs from the first scheduled "
    "arrival to the last completion, AIPerf's over its own benchmark duration. Errors are misses in both.",
    "prompts: the harness's are unique from their first token (a nonce); AIPerf's are drawn from its "
    "corpus, lengths from the same windows (AIPerf's `--random-range-ratio`).",
)


_VLLM_LABEL = re.compile(r"^(\w+), bind ([^,]+)(?:, (\d+) batched tokens)?$")


MIN_RATE = 0.1
"""The lowest rate taken from a bench run: 60 requests at it take 10 minutes per client and deployment."""


def from_bench(bench: Mapping[str, Any], workload: str) -> tuple[float, str, str, int, str]:
    """(rate, vLLM dtype, vLLM bind, its --max-num-batched-tokens or 0, whose goodput the rate is) from
    run_all's bench.json: the disaggregated goodput of `workload` (rounded to 0.1 req/s), or, where it
    is below MIN_RATE (its SLOs missed at every rate: a machine slower than the one they were frozen
    on), the highest goodput any deployment reached on it; and the vLLM grid's best configuration
    (`run_all.VllmChoice.label`). ValueError where no deployment reached MIN_RATE."""
    try:
        goodputs = {name: entry["goodput_rps"] for name, entry in bench["goodput"][workload].items()}
        goodput = goodputs["disagg"]
        best = bench["vllm_grid"]["best"]
    except (KeyError, TypeError):
        raise ValueError(f"no disagg goodput for {workload} or no vllm_grid.best in it") from None
    match = _VLLM_LABEL.match(str(best))
    if match is None or not isinstance(goodput, int | float):
        raise ValueError(f"unreadable vLLM choice {best!r} or goodput {goodput!r}")
    dtype, bind, batched = match.groups()
    source = "disagg"
    if round(float(goodput), 1) < MIN_RATE:
        measured = {n: g for n, g in goodputs.items() if isinstance(g, int | float)}
        source = max(measured, key=lambda n: measured[n])
        goodput = measured[source]
        if round(float(goodput), 1) < MIN_RATE:
            raise ValueError(f"no deployment reached {MIN_RATE} req/s on {workload}: no rate to compare at")
    return round(float(goodput), 1), dtype, bind, int(batched or 0), source


SECTION = "aiperf_compare"  # the name of its section in perf/RESULTS.md (benchlib.report.with_section)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model-dir", type=Path, default=DEFAULT_MODEL_DIR)
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="codegen")
    parser.add_argument("--rate", type=float, default=2.0, help="requests/s (Poisson), both clients")
    parser.add_argument("--count", type=int, default=60, help="requests per client and deployment")
    parser.add_argument("--deployments", default=",".join(DEPLOYMENTS))
    parser.add_argument("--vllm-dtype", default="bfloat16")
    parser.add_argument("--vllm-omp-bind", default="0-1", help="VLLM_CPU_OMP_THREADS_BIND")
    parser.add_argument(
        "--vllm-max-batched-tokens",
        type=int,
        default=0,
        help="vLLM's --max-num-batched-tokens (0: its default)",
    )
    parser.add_argument(
        "--from-bench",
        type=Path,
        default=None,
        help="perf/run_all.py's bench.json: vLLM as the best of its grid, the rate as the disaggregated "
        "goodput of --workload (overrides --rate, --vllm-dtype, --vllm-omp-bind and "
        "--vllm-max-batched-tokens)",
    )
    parser.add_argument(
        "--append-to",
        type=Path,
        default=None,
        help="a report (perf/RESULTS.md) whose AIPerf section is replaced",
    )
    parser.add_argument("--aiperf", type=Path, default=AIPERF_VENV / "bin" / "aiperf")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out-dir", type=Path, default=PERF / "results" / "aiperf")
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.deployments.split(",") if n.strip()]
    unknown = sorted(set(names) - set(DEPLOYMENTS))
    if unknown or not names:
        parser.error(f"--deployments: choose from {', '.join(DEPLOYMENTS)} (got {args.deployments!r})")
    args.deployments = names
    if args.from_bench is not None:
        try:
            chosen = from_bench(json.loads(args.from_bench.read_text()), args.workload)
            args.rate, args.vllm_dtype, args.vllm_omp_bind, args.vllm_max_batched_tokens, source = chosen
            args.rate_from = f"the `{source}` goodput of the bench run"
        except (OSError, ValueError) as exc:
            parser.error(f"--from-bench {args.from_bench}: {exc}")
    if not args.rate > 0 or args.count < 1:
        parser.error("--rate must be > 0 and --count >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not args.aiperf.exists():
        log(f"no AIPerf at {args.aiperf}; install it with: {AIPERF_INSTALL}")
        return 2
    workload = WORKLOADS[args.workload]
    try:
        aiperf_window(workload.prompt), aiperf_window(workload.output)
    except ValueError as exc:
        log(f"workload {workload.name}: {exc}")
        return 2
    frozen = load_frozen(SLO_FILE, args.model_dir.name).get(workload.name)
    if frozen is None:
        log(f"no frozen SLO for {args.model_dir.name}/{workload.name} in {SLO_FILE}: run make bench-slos")
        return 2
    out: dict[str, Any] = {
        "machine": machine(),
        "model": args.model_dir.name,
        "workload": workload.name,
        "rate": args.rate,
        "rate_from": getattr(args, "rate_from", "--rate"),
        "count": args.count,
        "slo": asdict(frozen.slo),
        "aiperf_version": AIPERF_VERSION,
        "command": "python -m perf.aiperf_compare " + shlex.join(argv if argv is not None else sys.argv[1:]),
        "runs": [],
    }
    with tempfile.TemporaryDirectory(prefix="aiperf-compare-") as scratch:
        for name in args.deployments:
            out["runs"].append(measure(name, args, workload, frozen.slo, Path(scratch)))
    args.out_dir.mkdir(parents=True, exist_ok=True)
    write_json(args.out_dir / "aiperf_compare.json", out)
    (args.out_dir / "aiperf_compare.md").write_text(markdown(out))
    if args.append_to is not None:
        report = args.append_to.read_text() if args.append_to.exists() else ""
        body = markdown(out).replace("# AIPerf", "## AIPerf", 1)
        args.append_to.write_text(with_section(report, SECTION, body))
    log(markdown(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
