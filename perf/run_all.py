"""The whole serving benchmark in one command: SLO calibration, goodput search per workload and deployment,
the interference experiment, then perf/RESULTS.md, JSON and PNG plots.

    python -m perf.run_all --quick   # first look, <= 10 min: codegen only, short runs
    python -m perf.run_all --full    # ~90 min: codegen, chat, summarize, codegen@article

A workload named `<workload>@<source>` (benchlib.slo.FIXED_SLOS) sends the workload's prompts and is
judged by SLOs given from outside the rule (`codegen@article`: the source article's 500 ms / 50 ms).

Before each goodput search, a deployment serves three requests of the workload alone; one whose median
already misses an SLO alone cannot reach the target attainment at any rate, so it is reported with goodput
0 and its figures alone, and not searched (a search would probe ever lower rates, each minutes long).

Deployments (all on the same two cores, measured one after another):
  disagg     Triton `ensemble`  (prefill pool core 0, decode pool core 1, BLS orchestrator)
  colocated  Triton `ensemble_colocated` (continuous batching): the SLO reference
  llm        Triton `llm` (the orchestrator called directly; opt-in with --deployments)
  vllm       vLLM CPU (`.venv-vllm`), started here under `taskset -c 0,1`, stopped at the end
  llamacpp   llama.cpp's server (`make llamacpp`) on the GGUF file the model was converted from
  vllm-pd    vLLM's own prefill/decode disaggregation (NIXL), prefill on core 0, decode on core 1

Every deployment is measured at its best: each configuration of its grid is tuned on the first
workload (the quick plan), and the best is measured in full. Tuning results go to a cache file
(--grid-cache) with their date and machine; --reuse-grids takes them instead of tuning again.
Our deployments are told the SLOs they are judged by, as a user sets them in the spec
(`entry_points.slo`, which admission judges by): each workload's search runs on a server of its own
(--no-tell-slos: one server, with the repository's own SLOs, as `make serve` starts).

Every goodput is a bracket: the highest rate that met the target attainment and the lowest that
missed; a full run refines it to 3 % (or says why it stopped). A target is met only when the low end
of ours is at least the ratio times the high end of the other's.

A run can measure part of the benchmark (--workloads, --deployments); with --keep-earlier, the report
carries the earlier run's other figures, each marked with the run it comes from.
Triton deployments need a running server: --triton-url HOST:PORT (started elsewhere, e.g. `make serve`)
or --start-triton (the project's launcher on model_repository/). Those whose model is not ready are
reported as not measured, with the reason, and the run goes on.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import datetime
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from disagg.serverconfig import parse_cpus
from disagg_tools.repository import MARGIN_GUESSED, MARGIN_TOLD
from perf.benchlib import machine as machine_facts
from perf.benchlib import plots, report
from perf.benchlib.clients import ClientConfig, TritonClient, make_client
from perf.benchlib.cliutil import DEFAULT_MODEL_DIR, REPO_ROOT, log, pin_self, write_json
from perf.benchlib.cpuprobe import CpuProbe, group_members
from perf.benchlib.deploy import (
    DeployError,
    VllmConfig,
    VllmServer,
    free_port,
    pool_parameter,
    start_triton,
    stop_group,
    vllm_command_line,
    wait_for_health,
    with_orchestrator_parameters,
    with_pool_parameters,
)
from perf.benchlib.experiment import GoodputResult, RunPlan, pooled_interference, search_goodput, start_rate
from perf.benchlib.gridcache import GridCache, GridEntry, machine_key
from perf.benchlib.llamacpp import LlamaCppConfig, LlamaCppServer, build_record, gguf_of
from perf.benchlib.search import Bracket, SearchConfig
from perf.benchlib.slo import (
    FIXED_SLOS,
    REFERENCE_DEPLOYMENT,
    SLO_FILE,
    TPOT_FACTOR,
    TTFT_FACTOR,
    Calibration,
    FrozenSlo,
    base_workload,
    calibrate,
    freeze,
    judged_by,
    load_frozen,
)
from perf.benchlib.timeplan import (
    GOODPUT_WEIGHT,
    INTERFERENCE_WEIGHT,
    MIN_CONFIG_S,
    TimePlan,
    goodput_part,
    grid_config_weight,
    grid_part,
    interference_part,
    shares,
)
from perf.benchlib.workload import WORKLOADS, PromptFactory

PERF = Path(__file__).resolve().parent
BENCH_OUT = PERF / "results" / "bench"  # `make bench`'s results (--out-dir)
ORCHESTRATION_OUT = PERF / "results" / "orchestration_cost"  # perf.orchestration_cost's own default
SLO_RULE = (
    f"Per workload: TTFT SLO = {TTFT_FACTOR:g} × idle TTFT of `{REFERENCE_DEPLOYMENT}` at the workload's "
    f"median prompt length; TPOT SLO = {TPOT_FACTOR:g} × its idle single-stream TPOT. The same absolute "
    "values judge every deployment, vLLM included. They are derived once per model and workload and "
    "frozen in `perf/slos.json` (so a faster reference does not tighten them); the table shows today's "
    "idle figures beside the frozen SLOs and when they were derived."
)
TRITON_MODELS = {"disagg": "ensemble", "colocated": "ensemble_colocated", "llm": "llm"}
PEERS = ("vllm", "llamacpp", "vllm-pd")
MEASURING_ORDER = ("colocated", "disagg", "llm", "llamacpp", "vllm", "vllm-pd")
"""The SLO reference first, then our deployments, the peers (llama.cpp, quick to start, before vLLM,
which compiles at every start), and vLLM's own P/D last. Every part gets its share of the time left
(benchlib.timeplan), so a run that is short of time widens the last brackets instead of skipping the
last deployments."""
IDLE_REPS = 3
"""Requests served alone, before a deployment's goodput search, to see whether it can meet the SLOs."""
NOTES = {
    "disagg": "Triton ensemble: prefill pool on core 0, decode pool on core 1, BLS orchestrator",
    "colocated": "Triton ensemble_colocated: one continuous-batching pool (SLO reference)",
    "llm": "Triton llm: orchestrator called directly",
}


@dataclass(frozen=True)
class Profile:
    """Sizes of one benchmark mode, chosen to fit its time budget on two cores."""

    name: str
    workloads: tuple[str, ...]
    plan: RunPlan
    max_probes: int
    rel_tol: float
    calibration_reps: int
    interference_count: int
    interference_concurrency: float
    budget_s: float
    growth: float = 2.0
    """The search's bracketing step from the idle start (from an earlier run's goodput: NEAR_GROWTH)."""
    interference_seeds: tuple[int, ...] = (1,)
    """The interference pair is run once per seed and pooled."""


NEAR_GROWTH = 1.15
"""The bracketing step of a search started at an earlier run's goodput (--start-at)."""


PROFILES = {
    # budgets: the grids' tuning searches (ours before the servers start, vLLM's before its full
    # searches) count against them; the orchestration cost and AIPerf's comparison come after
    "quick": Profile("quick", ("codegen",), RunPlan(12, 12, 60, 30), 4, 0.15, 3, 40, 4.0, 1500),
    "full": Profile(
        "full",
        ("codegen", "chat", "summarize", "codegen@article"),
        RunPlan(25, 16, 150, 60),
        10,
        0.03,
        5,
        100,
        4.0,
        5700,
        growth=1.4,
        interference_seeds=(1, 2, 3),
    ),
}


@dataclass
class Deployment:
    name: str
    config: ClientConfig | None
    cores: int
    note: str
    endpoint: str = ""
    pgid: int | None = None
    """Process group of the server, when started here: its processes are watched by the CPU probe."""
    available: bool = False
    reason: str = ""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--quick", action="store_const", dest="mode", const="quick")
    mode.add_argument("--full", action="store_const", dest="mode", const="full")
    mode.add_argument(
        "--render-only", action="store_true", help="re-render report and plots from the last run's JSON"
    )
    parser.add_argument(
        "--deployments",
        default="disagg,colocated,vllm,llamacpp,vllm-pd",
        help="comma-separated names; vllm-pd: vLLM's own prefill/decode disaggregation (NIXL connector, "
        "prefill on core 0, decode on core 1, perf/benchlib/pd_proxy.py in front); llamacpp: llama.cpp's "
        "server (make llamacpp) on the GGUF file the model was converted from",
    )
    parser.add_argument(
        "--llamacpp-grid",
        default="16:2:2,8:2:2,4:2:2,16:1:2",
        help="llama.cpp configurations tried, SLOTS:THREADS:BATCH_THREADS (-np, -t, -tb), comma-separated; "
        "each is tuned on the first workload and the best is measured in full as 'llamacpp'",
    )
    parser.add_argument(
        "--vllm-chunk-grid",
        default="256,512,2048",
        help="vLLM's chunked-prefill budgets (--max-num-batched-tokens) tried on the best of --vllm-grid "
        "(a second stage; empty: none)",
    )
    parser.add_argument(
        "--grid-cache",
        type=Path,
        default=PERF / "results" / "bench" / "grids.json",
        help="every tuned configuration's goodput, with its date and machine (written as they come)",
    )
    parser.add_argument(
        "--reuse-grids",
        action="store_true",
        help="take a configuration's goodput from --grid-cache when it was measured on this machine, model "
        "and workload, instead of tuning it again (the report says which figures are reused)",
    )
    parser.add_argument(
        "--start-at",
        type=Path,
        default=None,
        help="an earlier run's bench.json: each search starts at that run's goodput for its workload and "
        "deployment (a x1.15 bracketing step), else at the idle start",
    )
    parser.add_argument(
        "--keep-earlier",
        action="store_true",
        help="carry the earlier bench.json's figures that this run does not measure (other workloads or "
        "deployments) into the report, each marked with the run it comes from",
    )
    parser.add_argument(
        "--budget-min",
        type=float,
        default=None,
        help="minutes the run's parts share (benchlib.timeplan; default: the profile's, 95 for --full, so "
        "that make bench, with the orchestration cost and AIPerf after it, ends within 120)",
    )
    parser.add_argument(
        "--no-bandwidth",
        action="store_true",
        help="do not measure the machine's read bandwidth for the report (tests)",
    )
    parser.add_argument("--vllm-pd-dtype", default="bfloat16", help="vllm-pd's --dtype")
    parser.add_argument(
        "--tell-slos",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="our deployments (started here) are told each workload's SLOs, as a user sets them "
        "(entry_points.slo: the orchestrators' slo.ttft_s / slo.tpot_s, which admission judges by, and "
        "admission margin 1, the spec's default with a TTFT SLO): "
        "each workload's search, and the interference pair, on a server of its own. --no-tell-slos: one "
        "server for all, with the repository's own SLOs (the default deployment's 1 s TTFT target)",
    )
    parser.add_argument("--workloads", default="", help="override the profile's workloads")
    parser.add_argument(
        "--experiments", default="goodput,interference", help="which to run (calibration always runs)"
    )
    parser.add_argument("--model-dir", type=Path, default=DEFAULT_MODEL_DIR)
    parser.add_argument("--triton-url", default="", help="gRPC host:port of a running Triton")
    parser.add_argument(
        "--start-triton", type=Path, nargs="?", const=REPO_ROOT / "model_repository", default=None,
        metavar="REPOSITORY", help="start Triton with the project's launcher (default: model_repository/)",
    )  # fmt: skip
    parser.add_argument("--vllm-url", default="", help="use a running vLLM (http://host:port) instead")
    parser.add_argument("--vllm-served-name", default="tiny")
    parser.add_argument("--vllm-cpus", default="0,1", help="taskset list for vLLM")
    parser.add_argument(
        "--vllm-grid",
        default="bfloat16:0-1,bfloat16:auto,float32:0-1,float32:auto",
        help="vLLM configurations tried, dtype:VLLM_CPU_OMP_THREADS_BIND; each is tuned on the first "
        "workload, then the best with each --vllm-chunk-grid budget, and the best of all is measured in "
        "full as 'vllm' (default: bf16 and fp32 crossed with both cores and vLLM's own auto, which "
        "reserves one core for its front end)",
    )
    parser.add_argument(
        "--colocated-grid",
        default="0,1@4096;0,1@512+chunked;0@4096",
        help="our colocated baseline's configurations tried (with --start-triton), CORES@TOKENS[+chunked]: "
        "the colocated pool's cores and prompt tokens per step, chunked prefill with +chunked; each is "
        "tuned on the first workload and the best is measured in full as 'colocated' (default: the "
        "repository's own, both cores with chunks of 512 as vLLM does, and one core)",
    )
    parser.add_argument(
        "--disagg-grid",
        default="0,512,0+static",
        help="our disaggregated deployment's configurations tried (with --start-triton): conditional "
        "disaggregation's longest prompt prefilled on the decode pool while the prefill pool is "
        "backlogged, 0 for off, each with +lendMS (the decode pool lends its core within MS ms a token) "
        "or +static (no core loans); else the repository's own loans. Each is tuned on the first "
        "workload and the best is measured in full as 'disagg' (default: off, prompts up to 512 tokens, "
        "and off without loans)",
    )
    parser.add_argument("--vllm-omp-bind", default="", help="one configuration only: this bind")
    parser.add_argument("--vllm-dtype", default="", help="one configuration only: this --dtype")
    parser.add_argument("--cores", type=int, default=2, help="cores each deployment occupies (per core)")
    parser.add_argument("--loadgen-cpus", default=None, help="pin the load generator, e.g. '0'")
    parser.add_argument(
        "--server-cpus",
        default="",
        help="with --start-triton: pin tritonserver's own threads, e.g. '0' (off the decode core)",
    )
    parser.add_argument(
        "--slo-file", type=Path, default=SLO_FILE, help="the frozen SLOs per model and workload"
    )
    parser.add_argument(
        "--derive-slos",
        action="store_true",
        help="measure the SLOs by the rule on colocated, write them into --slo-file for this model, and "
        "stop (an explicit, recorded step; a run without it judges by the frozen SLOs)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--note", action="append", default=[], help="a line for the report (e.g. what else ran meanwhile)"
    )
    parser.add_argument("--out-dir", type=Path, default=BENCH_OUT)
    parser.add_argument("--report", type=Path, default=PERF / "RESULTS.md")
    parser.add_argument("--records", type=Path, default=PERF / "out" / "bench_records.json")
    return parser.parse_args(argv)


@dataclass(frozen=True)
class VllmChoice:
    """One configuration of the vLLM grid: its compute dtype, VLLM_CPU_OMP_THREADS_BIND, and its
    chunked-prefill budget (--max-num-batched-tokens; 0: vLLM's default)."""

    dtype: str
    bind: str
    max_batched_tokens: int = 0

    @property
    def label(self) -> str:
        budget = f", {self.max_batched_tokens} batched tokens" if self.max_batched_tokens else ""
        return f"{self.dtype}, bind {self.bind}{budget}"

    def extra_args(self) -> tuple[str, ...]:
        return ("--max-num-batched-tokens", str(self.max_batched_tokens)) if self.max_batched_tokens else ()


def vllm_chunk_grid(best: VllmChoice, text: str) -> list[VllmChoice]:
    """The second stage of vLLM's grid: `best` as it is, then with each budget of `--vllm-chunk-grid`."""
    try:
        budgets = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        budgets = [0]
    if any(not 16 <= n <= 65536 for n in budgets):
        raise SystemExit(f"--vllm-chunk-grid: {text!r} is not a list of token budgets (e.g. 256,512,2048)")
    return [best, *(dataclasses.replace(best, max_batched_tokens=n) for n in budgets)]


@dataclass(frozen=True)
class LlamaCppChoice:
    """One configuration of llama.cpp's server: parallel slots (-np), generation threads (-t) and
    prompt-processing threads (-tb)."""

    slots: int
    threads: int
    batch_threads: int

    @property
    def label(self) -> str:
        return f"{self.slots} slots, -t {self.threads} -tb {self.batch_threads}"


def llamacpp_grid(text: str) -> list[LlamaCppChoice]:
    """`--llamacpp-grid`: SLOTS:THREADS:BATCH_THREADS, comma-separated."""
    choices = []
    for item in (part.strip() for part in text.split(",") if part.strip()):
        try:
            slots, threads, batch = (int(n) for n in item.split(":"))
        except ValueError:
            slots = threads = batch = 0
        if not (1 <= slots <= 256 and 1 <= threads <= 256 and 1 <= batch <= 256):
            raise SystemExit(f"--llamacpp-grid: {item!r} is not SLOTS:THREADS:BATCH_THREADS (e.g. 16:2:2)")
        choices.append(LlamaCppChoice(slots, threads, batch))
    if not choices:
        raise SystemExit("--llamacpp-grid is empty")
    return choices


def llamacpp_config(args: argparse.Namespace, workdir: Path, choice: LlamaCppChoice) -> LlamaCppConfig:
    return LlamaCppConfig(
        gguf=gguf_of(args.model_dir.resolve()), cpus=args.vllm_cpus, slots=choice.slots,
        threads=choice.threads, batch_threads=choice.batch_threads, log_path=workdir / "llamacpp.log",
        served_name=args.vllm_served_name,
    )  # fmt: skip


def llamacpp_unavailable(model_dir: Path) -> str:
    """Why llama.cpp's server cannot be measured on `model_dir` ("" when it can)."""
    if build_record() is None:
        return "llama-server is not built (make llamacpp)"
    try:
        gguf_of(model_dir.resolve())
    except (DeployError, OSError, ValueError) as exc:
        return str(exc)
    return ""


@contextlib.contextmanager
def llamacpp_running(
    args: argparse.Namespace, workdir: Path, notes: list[str], choice: LlamaCppChoice
) -> Iterator[tuple[ClientConfig, int | None, str]]:
    """llama.cpp's server with `choice`: its client config, process group and command line."""
    config = llamacpp_config(args, workdir, choice)
    log(f"starting llama.cpp's server, {choice.label} (log {config.log_path}) ...")
    with LlamaCppServer(config).start() as server:
        server.wait_healthy(120.0)
        yield ClientConfig("openai", config.url, config.served_name), server.pid, shlex.join(config.command())


def vllm_grid(args: argparse.Namespace) -> list[VllmChoice]:
    """`--vllm-grid` as choices; `--vllm-dtype` / `--vllm-omp-bind`, when given, make a grid of one."""
    if args.vllm_dtype or args.vllm_omp_bind:
        return [VllmChoice(args.vllm_dtype or "bfloat16", args.vllm_omp_bind or "auto")]
    choices = []
    for item in (part.strip() for part in args.vllm_grid.split(",") if part.strip()):
        dtype, sep, bind = item.partition(":")
        if not sep or dtype not in ("bfloat16", "float32", "float16") or not bind:
            raise SystemExit(f"--vllm-grid: {item!r} is not dtype:bind (e.g. bfloat16:0-1, float32:auto)")
        choices.append(VllmChoice(dtype, bind))
    if not choices:
        raise SystemExit("--vllm-grid is empty")
    return choices


def vllm_config(args: argparse.Namespace, workdir: Path, choice: VllmChoice) -> VllmConfig:
    return VllmConfig(
        model_dir=args.model_dir.resolve(),
        cpus=args.vllm_cpus,
        omp_bind=choice.bind,
        dtype=choice.dtype,
        log_path=workdir / "vllm.log",
        served_name=args.vllm_served_name,
        extra_args=choice.extra_args(),
    )


@contextlib.contextmanager
def vllm_running(
    args: argparse.Namespace, workdir: Path, notes: list[str], choice: VllmChoice
) -> Iterator[tuple[ClientConfig, int | None, str]]:
    """The vLLM client config, its process group id when started here, and its command line."""
    if args.vllm_url:
        yield (
            ClientConfig("openai", args.vllm_url, args.vllm_served_name),
            None,
            f"(running at {args.vllm_url})",
        )
        return
    config = vllm_config(args, workdir, choice)
    log(f"starting vLLM CPU on cpus {config.cpus} (log {config.log_path}) ...")
    started = time.monotonic()
    with VllmServer(config).start() as server:
        server.wait_healthy()
        log(f"vLLM healthy after {time.monotonic() - started:.0f} s")
        binding = server.binding()
        if binding:
            notes.append(f"vLLM CPU thread binding, {choice.label} (from its log): {binding}.")
        yield ClientConfig("openai", config.url, config.served_name), server.pid, vllm_command_line(config)


@contextlib.contextmanager
def vllm_pd_running(
    args: argparse.Namespace, workdir: Path, dtype: str
) -> Iterator[tuple[ClientConfig, str]]:
    """vLLM's own prefill/decode disaggregation: a kv_producer on core 0 and a kv_consumer on core 1
    (NIXL with host buffers), each computing on its core, and perf/benchlib/pd_proxy.py in front.
    Yields the proxy's client config and the three command lines."""
    configs = [
        VllmConfig(
            model_dir=args.model_dir.resolve(), cpus=core, omp_bind=core, dtype=dtype,
            log_path=workdir / f"vllm-{role}.log", served_name=args.vllm_served_name, kv_cache_gib=1,
            kv_role=role, side_channel_port=free_port(),
        )
        for core, role in (("0", "producer"), ("1", "consumer"))
    ]  # fmt: skip
    port = free_port()
    proxy = [sys.executable, str(PERF / "benchlib" / "pd_proxy.py"), "--port", str(port)]
    proxy += ["--prefill", configs[0].url, "--decode", configs[1].url]
    command = " ; ".join([*(vllm_command_line(c) for c in configs), shlex.join(proxy)])
    log(f"starting vLLM P/D (logs {configs[0].log_path}, {configs[1].log_path}) ...")
    with contextlib.ExitStack() as stack:
        servers = [stack.enter_context(VllmServer(c).start()) for c in configs]
        for server in servers:
            server.wait_healthy()
        front = subprocess.Popen(proxy, stdin=subprocess.DEVNULL, process_group=0)
        # SIGKILL after 10 s: with connections still open, SIGTERM alone left it running, and the
        # measured run was reported as failed
        stack.callback(stop_group, front, 10.0)
        url = f"http://127.0.0.1:{port}"
        wait_for_health(f"{url}/health", front, "the P/D proxy")
        yield ClientConfig("openai", url, args.vllm_served_name), command


async def tune_grid(
    kind: str,
    grid: list[Any],
    running: Callable[..., Any],
    args: argparse.Namespace,
    workdir: Path,
    profile: Profile,
    factory: PromptFactory,
    results: dict[str, Any],
    deadline: float,
    frozen: dict[str, FrozenSlo] | None,
    search: Callable[..., Awaitable[None]] | None = None,
    cache: GridCache | None = None,
    extend: bool = False,
    run_end: float | None = None,
) -> Any:
    """A deployment at its best: every configuration of `grid` (choices with a `label`) searched for
    goodput on the profile's first workload with the quick plan, each recorded (with its exact command
    line) in results[f"{kind}_grid"]; returns the best, which is then measured in full as `kind`.
    `running(args, workdir, notes, choice)` starts one configuration and yields (client config,
    process group, command line); `search` stands in for measure (tests).
    `cache`: a configuration measured earlier in this run, or (with its reuse on) in an earlier run on
    this machine, is taken from it, not measured again; what is measured goes into it.
    `extend`: a later stage of the same grid; the earlier stages' entries are kept, and the best is the
    best of all (the earlier stages' best must be in `grid` to be returned). `deadline`: the grid's
    share of the run (benchlib.timeplan); `run_end`: the run's end, past which no configuration starts
    (default: `deadline`)."""
    search = search or measure
    workload = profile.workloads[0]
    earlier = results.get(f"{kind}_grid", {}).get("tried", []) if extend else []
    if len(grid) == 1 and not earlier:
        results[f"{kind}_grid"] = {"workload": None, "tried": [], "best": grid[0].label}
        return grid[0]
    tuning = Profile(**{**PROFILES["quick"].__dict__, "workloads": (workload,)})
    model = Path(results["meta"].get("model", "")).name
    where = results["meta"].get("machine_key", "")
    tried = list(earlier)

    def known_of(choice: Any) -> GridEntry | None:
        return cache.lookup(kind, choice.label, workload, model, where) if cache is not None else None

    to_measure = [c for c in grid if not any(e["config"] == c.label for e in tried) and known_of(c) is None]
    for choice in grid:
        if any(e["config"] == choice.label for e in tried):
            continue  # an earlier stage's configuration
        known = known_of(choice)
        if known is not None:
            entry = {"config": choice.label, "command": known.command, "goodput_rps": known.goodput_rps,
                     "bracket": known.bracket, "error": known.error, "measured": known.measured,
                     "reused": not cache.is_fresh(known)}  # fmt: skip
            log(f"{kind} grid, {choice.label}: {known.goodput_rps} req/s, from {known.measured}")
            tried.append(entry)
            continue
        entry = {"config": choice.label, "command": "", "goodput_rps": None, "error": "",
                 "measured": _now(), "reused": False}  # fmt: skip
        # each configuration still to measure gets an equal share of the grid's time left, counted
        # from when its server is up, and at least MIN_CONFIG_S of search: a start alone can take
        # minutes (vLLM: 1.5-2.5 min), and counted in the share it left vLLM's configurations no time
        # to search, each skipped after its start. A configuration is skipped only once the whole
        # run's time is spent, since a peer cut from its grid is a peer below its best.
        now = time.monotonic()
        left = len(to_measure) - to_measure.index(choice)
        if now > (run_end if run_end is not None else deadline):
            entry["error"] = "skipped: the run's time budget was spent"
            log(f"{kind} grid, {choice.label}: {entry['error']}")
            tried.append(entry)
            continue
        scratch = {**results, "goodput": {}, "interference": {}}  # shares the calibrations and notes
        skipped = False
        try:
            with running(args, workdir, results["meta"]["notes"], choice) as (config, pgid, command):
                entry["command"] = command
                dep = Deployment(
                    f"{kind} ({choice.label})", config, args.cores, "", pgid=pgid, available=True
                )
                records: dict[str, Any] = {"goodput": {}, "interference": {}}
                up = time.monotonic()
                own = max(shares(deadline, left, up), up + MIN_CONFIG_S)
                await search(dep, tuning, factory, scratch, records, TimePlan(own), ("goodput",), frozen)
            found = scratch["goodput"].get(workload, {}).get(dep.name)
            skipped = found is None  # the search skipped it: the run's time budget was spent
            if skipped:
                entry["error"] = "skipped: the run's time budget was spent"
            else:
                entry["goodput_rps"] = found["goodput_rps"]
                entry["bracket"] = found.get("bracket")
        except Exception as exc:  # a configuration that cannot run is reported, the others still are
            entry["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        measured = entry["goodput_rps"]
        log(
            f"{kind} grid, {choice.label}: "
            + (f"{measured:.3f} req/s" if measured is not None else entry["error"])
        )
        if cache is not None and not skipped:
            cache.put(
                GridEntry(
                    kind, choice.label, workload, model, where, entry["measured"], measured,
                    entry.get("bracket"), entry["command"], entry["error"],
                )
            )  # fmt: skip
        tried.append(entry)
    measured = [e for e in tried if e["goodput_rps"] is not None]
    if not measured:
        raise RuntimeError(f"no configuration of the {kind} grid could be measured")
    best = max(measured, key=lambda e: e["goodput_rps"])  # the first listed of a tie
    results[f"{kind}_grid"] = {"workload": workload, "plan": "quick", "tried": tried, "best": best["config"]}
    chosen = next((c for c in grid if c.label == best["config"]), None)
    if chosen is None:
        raise RuntimeError(f"the {kind} grid's best ({best['config']}) is not among this stage's choices")
    return chosen


def time_plan(
    names: list[str], args: argparse.Namespace, profile: Profile, cache: GridCache, facts: Any, end: float
) -> TimePlan:
    """Every part the run will take, in measuring order, weighted (benchlib.timeplan): each grid's
    configurations that the cache does not answer, then each workload's goodput search and the
    interference pair of each deployment."""
    plan = TimePlan(end)
    model, where, first = (
        Path(args.model_dir).name,
        machine_key(facts.model, facts.flags),
        profile.workloads[0],
    )

    def to_measure(kind: str, grid: list[Any]) -> int:
        if len(grid) < 2:
            return 0  # taken as it is, never searched
        return sum(cache.lookup(kind, c.label, first, model, where) is None for c in grid)

    tuned = not args.triton_url and args.start_triton is not None and not args.derive_slos
    grids = {
        "colocated": [("", colocated_grid(args.colocated_grid))] if tuned else [],
        "disagg": [("", disagg_grid(args.disagg_grid))] if tuned else [],
        "llamacpp": [("", llamacpp_grid(args.llamacpp_grid))],
        "vllm": [("", vllm_tuning_grid(args))],
    }
    if not args.vllm_url and args.vllm_chunk_grid.strip():
        # the second stage's labels depend on the first's best: every budget is counted as unmeasured
        budgets = [b for b in args.vllm_chunk_grid.split(",") if b.strip()]
        grids["vllm"].append(("chunks", [None, *budgets]))
    for name in sorted(names, key=MEASURING_ORDER.index):
        for stage, grid in grids.get(name, []):
            count = len(grid) - 1 if stage else to_measure(name, grid)
            if count:
                plan.add(grid_part(name, stage), grid_config_weight(name) * count)
        for workload in profile.workloads:
            plan.add(goodput_part(name, workload), GOODPUT_WEIGHT)
        plan.add(interference_part(name), INTERFERENCE_WEIGHT)
    return plan


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def vllm_tuning_grid(args: argparse.Namespace) -> list[VllmChoice]:
    """The vLLM configurations tune_grid tries: `--vllm-grid`, or only its first for a running vLLM
    (--vllm-url), which is taken as it is."""
    grid = vllm_grid(args)
    return grid[:1] if args.vllm_url else grid


@dataclass(frozen=True)
class ColocatedChoice:
    """One configuration of our colocated baseline: the colocated pool's cores and its prompt tokens
    per engine step, whole prompts or cut into chunks (vLLM's chunked prefill)."""

    cores: str
    max_prefill_tokens: int
    chunked: bool

    @property
    def label(self) -> str:
        unit = "chunks" if self.chunked else "whole prompts"
        return f"cores {self.cores}, {unit}, {self.max_prefill_tokens} tokens per step"

    def parameters(self) -> dict[str, str]:
        """The colocated pool's config.pbtxt parameters for this choice."""
        return {
            "cores": self.cores,
            "max_prefill_tokens": str(self.max_prefill_tokens),
            "chunked_prefill": "true" if self.chunked else "false",
        }


def colocated_grid(text: str) -> list[ColocatedChoice]:
    """`--colocated-grid`: configurations separated by ';', each CORES@TOKENS, '+chunked' to chunk."""
    choices = []
    for item in (part.strip() for part in text.split(";") if part.strip()):
        cores, sep, budget = item.partition("@")
        budget, plus, suffix = budget.partition("+")
        try:
            parse_cpus(cores)
            tokens = int(budget)
        except ValueError:
            tokens = 0
        if not sep or not cores or not 16 <= tokens <= 65536 or (plus and suffix != "chunked"):
            raise SystemExit(
                f"--colocated-grid: {item!r} is not CORES@TOKENS[+chunked] (e.g. 0,1@512+chunked)"
            )
        choices.append(ColocatedChoice(cores, tokens, bool(plus)))
    if not choices:
        raise SystemExit("--colocated-grid is empty")
    return choices


@dataclass(frozen=True)
class DisaggChoice:
    """One configuration of our disaggregated deployment: conditional disaggregation off (0), or the
    longest prompt the decode pool prefills itself, in chunks between its decode steps, while the
    prefill pool is backlogged (the spec's `pools.decode.conditional.prefill_tokens`); and whether the
    decode pool lends its cores to the prefill pool (`pools.prefill.borrow`), keeping a step plus the
    time lent after it within `lend_tpot_ms` a token while prompts wait (`--decode-lend-tpot`)."""

    conditional_tokens: int
    chunk_tokens: int = 128
    lend_tpot_ms: int | None = None  # None: the repository's own loans (its spec's), if any
    static: bool = False  # no loans whatever the repository has: the pools keep their own cores

    @property
    def label(self) -> str:
        if not self.conditional_tokens:
            text = "conditional disaggregation off"
        else:
            text = (
                f"conditional disaggregation, prompts up to {self.conditional_tokens} tokens on the decode "
                f"pool in chunks of {self.chunk_tokens}"
            )
        if self.lend_tpot_ms is not None:
            text += f", decode lends its core (step + loan <= {self.lend_tpot_ms} ms a token)"
        if self.static:
            text += ", static pools (no core loans)"
        elif self.lend_tpot_ms is None:
            text += ", core loans as the repository has them"
        return text

    @property
    def key(self) -> str:
        """A folder name for this configuration."""
        lend = "" if self.lend_tpot_ms is None else f"+lend{self.lend_tpot_ms}"
        return f"{self.conditional_tokens}{lend}{'+static' if self.static else ''}"

    @property
    def command(self) -> str:
        text = (
            f"disagg repository --set pools.decode.conditional.prefill_tokens={self.conditional_tokens}"
            f" --set pools.decode.conditional.chunk_tokens={self.chunk_tokens}"
        )
        if self.lend_tpot_ms is not None:
            text += (
                " --set 'pools.prefill.borrow=[DECODE_CORES]'"
                f" --set pools.decode.lend_tpot_s={self.lend_tpot_ms / 1000:g}"
            )
        if self.static:
            text += " --set 'pools.prefill.borrow=[]'"
        return text

    def repository(self, repository: Path, scratch: Path) -> Path:
        """`repository` with this configuration: itself when it is the repository's own, else a copy
        under `scratch` whose pools and disaggregated orchestrators carry the parameters `disagg
        repository` writes."""
        if not self.conditional_tokens and self.lend_tpot_ms is None and not self.static:
            return repository
        if self.static or self.lend_tpot_ms is not None:  # the prefill pool's borrow, the decode pool's lend
            cores = "" if self.static else pool_parameter(repository, "decode", "cores")
            lend = {"lend": cores}
            if not self.static:
                lend["lend_tpot_s"] = f"{self.lend_tpot_ms / 1000:g}"
            repository = with_pool_parameters(repository, scratch / "borrow", "prefill", {"borrow": cores})
            repository = with_pool_parameters(repository, scratch / "lend", "decode", lend)
        if not self.conditional_tokens:
            return repository
        pool = {  # the decode pool's side, in the spec's words
            "conditional.prefill_tokens": str(self.conditional_tokens),
            "conditional.chunk_tokens": str(self.chunk_tokens),
        }
        pools = with_pool_parameters(repository, scratch / "pools", "decode", pool)
        orchestrators = {"conditional.prefill_tokens": str(self.conditional_tokens)}
        return with_orchestrator_parameters(pools, scratch, orchestrators, mode="disaggregated")


def disagg_grid(text: str) -> list[DisaggChoice]:
    """`--disagg-grid`: conditional disaggregation's prompt limits, comma-separated, 0 for off, each
    with `+lendMS` where the decode pool lends its cores within MS milliseconds a token, or `+static`
    where it lends none (else: as the repository says)."""
    choices = []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        static = part.endswith("+static")
        limit, plus, lend = part.removesuffix("+static").partition("+lend")
        try:
            choice = DisaggChoice(int(limit), lend_tpot_ms=int(lend) if plus else None, static=static)
        except ValueError:
            choice = None
        lend_ok = choice is not None and (choice.lend_tpot_ms is None or 1 <= choice.lend_tpot_ms <= 10000)
        lend_ok = lend_ok and not (static and plus)
        if choice is None or not lend_ok or not 0 <= choice.conditional_tokens <= 65536:
            raise SystemExit(
                f"--disagg-grid: {part!r} is not a prompt token limit with an optional +lendMS, e.g. 0+lend30"
            )
        choices.append(choice)
    if not choices:
        raise SystemExit(f"--disagg-grid: {text!r} is not a list of prompt token limits (e.g. 0,512)")
    return choices


def judging_slo(workload: str, frozen: dict[str, FrozenSlo] | None) -> Any:
    """The SLO that judges `workload` before it is calibrated: given from outside, or frozen; None when
    it is derived by this run."""
    fixed = FIXED_SLOS.get(workload)
    if fixed is not None:
        return fixed.slo
    return frozen[workload].slo if frozen is not None and workload in frozen else None


def told_repository(repository: Path, scratch: Path, slo: Any) -> Path:
    """A copy of `repository` whose orchestrators are told `slo`: the parameters `disagg repository`
    writes for the spec's `entry_points.slo.ttft_s` / `.tpot_s`, and the admission margin its default
    gives a deployment told its TTFT SLO, where `repository` has the untold default."""
    params = {"slo.ttft_s": f"{slo.ttft_s:g}", "slo.tpot_s": f"{slo.tpot_s:g}"}
    if pool_parameter(repository, "orchestrator", "admission.margin") == f"{MARGIN_GUESSED:g}":
        params["admission.margin"] = f"{MARGIN_TOLD:g}"
    return with_orchestrator_parameters(repository, scratch, params)


async def measure_told(
    dep: Deployment,
    repository: Path,
    args: argparse.Namespace,
    profile: Profile,
    factory: PromptFactory,
    results: dict[str, Any],
    records: dict[str, Any],
    plan: TimePlan,
    experiments: tuple[str, ...],
    frozen: dict[str, FrozenSlo],
    starts: dict[str, dict[str, float]] | None,
) -> None:
    """`measure` for our Triton deployment `dep` told the SLOs it is judged by: each workload's goodput
    search, then the interference pair (judged by the `decode` workload's SLO), each on a server of its
    own started on `repository` with that workload's SLOs in its orchestrators."""
    parts = [(w, ("goodput",)) for w in profile.workloads if "goodput" in experiments]
    if "interference" in experiments:
        parts.append(("decode", ("interference",)))
    for workload, what in parts:
        slo = judging_slo(workload, frozen)
        if slo is None:
            raise ValueError(f"{workload}: no SLO to tell before it is calibrated (freeze them first)")
        scratch = fresh(PERF / "out" / "told" / f"{dep.name}-{workload}")
        log(f"{dep.name}: starting Triton told {workload}'s SLOs ({slo.ttft_s:g} s / {slo.tpot_s:g} s) ...")
        server = start_triton(
            told_repository(repository, scratch, slo),
            scratch,
            args.model_dir,
            cpus=parse_cpus(args.server_cpus),
        )
        try:
            dep.config = ClientConfig("triton", server.config.grpc_url, TRITON_MODELS[dep.name])
            dep.pgid = server.pid
            own = profile if workload == "decode" else dataclasses.replace(profile, workloads=(workload,))
            await measure(dep, own, factory, results, records, plan, what, frozen, starts)
        finally:
            server.stop()


def fresh(folder: Path) -> Path:
    """`folder`, emptied (a scratch folder of this run under perf/out)."""
    import shutil

    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    return folder


@contextlib.contextmanager
def grid_server(
    args: argparse.Namespace, scratch: Path, repository: Path, kind: str, label: str, command: str
) -> Iterator[tuple[ClientConfig, int | None, str]]:
    """Triton on `repository` for one configuration of our `kind` grid (its own server, so nothing else
    shares the cores while it is measured); yields what `tune_grid`'s `running` yields."""
    log(f"starting Triton for the {kind} grid ({label}) ...")
    server = start_triton(repository, scratch, args.model_dir, cpus=parse_cpus(args.server_cpus))
    try:
        yield ClientConfig("triton", server.config.grpc_url, TRITON_MODELS[kind]), server.pid, command
    finally:
        server.stop()


@contextlib.contextmanager
def colocated_running(
    args: argparse.Namespace, workdir: Path, notes: list[str], choice: ColocatedChoice
) -> Iterator[tuple[ClientConfig, int | None, str]]:
    """Triton on a copy of the repository whose colocated pool takes `choice`."""
    scratch = fresh(workdir / "colocated-grid" / choice.label.replace(" ", "_").replace(",", ""))
    repository = with_pool_parameters(args.start_triton, scratch, "colocated", choice.parameters())
    params = " ".join(f"{k}={v}" for k, v in choice.parameters().items())
    command = f"disagg repository's colocated pool with {params}"
    with grid_server(args, scratch, repository, "colocated", choice.label, command) as running:
        yield running


@contextlib.contextmanager
def disagg_running(
    args: argparse.Namespace, workdir: Path, notes: list[str], choice: DisaggChoice
) -> Iterator[tuple[ClientConfig, int | None, str]]:
    """Triton on the repository with `choice`."""
    scratch = fresh(workdir / "disagg-grid" / choice.key)
    repository = choice.repository(args.start_triton, scratch)
    with grid_server(args, scratch, repository, "disagg", choice.label, choice.command) as running:
        yield running


async def triton_ready(config: ClientConfig) -> bool:
    client = TritonClient(config)
    await client.open()
    try:
        return await client.is_ready()
    finally:
        await client.close()


async def measure(
    dep: Deployment,
    profile: Profile,
    factory: PromptFactory,
    results: dict[str, Any],
    records: dict[str, Any],
    plan: TimePlan,
    experiments: tuple[str, ...] = ("goodput", "interference"),
    frozen: dict[str, FrozenSlo] | None = None,
    starts: dict[str, dict[str, float]] | None = None,
) -> None:
    """Calibrate (if this is the first deployment and none was done), search goodput per workload, run the
    interference pair once per seed of the profile and pool them; fills `results` and `records` in
    place. Each search and the interference pair take their deadline from `plan` (its parts
    `goodput_part` and `interference_part`; a part not planned runs to the plan's end). With `frozen`,
    every workload is judged by its frozen SLO (the calibration's idle figures are still measured and
    reported). `starts[workload][deployment]`: an earlier run's goodput, where the
    search starts (with a smaller bracketing step) instead of the idle start."""
    if dep.config is None:
        raise ValueError(f"{dep.name} has no client configuration")
    client = make_client(dep.config)
    await client.open()
    try:
        cals = results["calibrations"]
        # each workload is calibrated by the first deployment measured on it (a grid's tuning measures
        # only the first workload: the others are calibrated by the first full measurement)
        uncalibrated = [n for n in (*profile.workloads, "decode") if n not in cals]
        if uncalibrated:
            is_reference = dep.name.partition(" (")[0] == REFERENCE_DEPLOYMENT  # or one of its grid's
            reference = dep.name if is_reference else f"{dep.name} (stand-in for {REFERENCE_DEPLOYMENT})"
            for name in uncalibrated:
                fixed = FIXED_SLOS.get(name)
                if fixed is not None and fixed.workload in cals:  # the same prompts: measured already
                    cal = _calibration(cals[fixed.workload])
                else:
                    cal = await calibrate(
                        client, WORKLOADS[base_workload(name)], factory, reference,
                        reps=profile.calibration_reps,
                    )  # fmt: skip
                if fixed is not None:
                    cal = dataclasses.replace(cal, workload=name, slo=fixed.slo)
                elif frozen is not None:
                    cal = judged_by(cal, frozen[name])
                cals[name] = cal.to_dict()
                if fixed is not None:
                    cals[name]["fixed"] = fixed.source
                elif frozen is not None:
                    cals[name]["frozen"] = dataclasses.asdict(frozen[name])
                slo = cal.slo
                source = (
                    "given" if fixed is not None
                    else f"frozen {frozen[name].derived}" if frozen is not None
                    else "derived now"
                )  # fmt: skip
                log(
                    f"SLO {name} ({source}): TTFT {slo.ttft_s * 1000:.0f} ms, "
                    f"TPOT {slo.tpot_s * 1000:.1f} ms (idle today {cal.idle_ttft_s * 1000:.0f} / "
                    f"{cal.idle_tpot_s * 1000:.1f} ms on {reference})"
                )
        for name in profile.workloads if "goodput" in experiments else ():
            deadline = plan.start(goodput_part(dep.name, name))
            if time.monotonic() > deadline:
                results["meta"]["notes"].append(f"{dep.name} {name}: skipped, time budget spent")
                continue
            if _server_lost(dep, name, results):
                continue
            workload, cal = WORKLOADS[base_workload(name)], _calibration(cals[name])
            if await _misses_alone(client, dep, name, workload, factory, cal, results, records):
                continue
            alone_s = results["alone"][name][dep.name].get("ttft_s")
            idle = start_rate(cal.idle_ttft_s, cal.idle_tpot_s, workload.output.median())
            if alone_s:  # no faster than its prompts back to back: a slow peer starts where it can pass
                idle = min(idle, 1.0 / alone_s)
            earlier = (starts or {}).get(name, {}).get(dep.name)
            start, growth = (earlier, NEAR_GROWTH) if earlier else (idle, profile.growth)
            search = SearchConfig(
                start=start, min_rate=min(start, idle) / 16, max_rate=max(start, idle) * 64,
                rel_tol=profile.rel_tol, max_probes=profile.max_probes, growth=growth, alone_s=alone_s,
            )  # fmt: skip
            where = "a goodput known from the grid or an earlier run" if earlier else "the idle start"
            log(f"{dep.name}: goodput search on {name} from {start:.2f} req/s ({where}, x{growth:g})")
            res = await search_goodput(
                client, workload, factory, cal.slo, search, profile.plan, dep.cores, log, deadline
            )
            if _server_lost(dep, name, results):
                continue  # it died during this search: its last probes measured errors
            results["goodput"].setdefault(name, {})[dep.name] = {**res.to_dict(), "measured": _now()}
            best = [r for r in res.runs if r.rate == res.best_rate]
            records["goodput"].setdefault(name, {})[dep.name] = best[0].to_dict() if best else None
            log(f"{dep.name}: {name} goodput {res.best_rate:.3f} req/s ({res.per_core:.3f} per core)")
        if "interference" not in experiments:
            return
        if time.monotonic() > plan.start(interference_part(dep.name)):
            results["meta"]["notes"].append(f"{dep.name} interference: skipped, time budget spent")
            return
        if _server_lost(dep, "interference", results):
            return
        decode = _calibration(cals["decode"])
        rate = profile.interference_concurrency / (decode.idle_ttft_s + 63 * decode.idle_tpot_s)
        log(f"{dep.name}: interference at {rate:.2f} req/s, {profile.interference_count} requests per run")
        pgid = dep.pgid

        def probe() -> CpuProbe:
            return CpuProbe(lambda: [os.getpid(), *(group_members(pgid) if pgid else [])])

        inter = await pooled_interference(
            client, factory, rate, profile.interference_count, decode.slo, profile.interference_seeds,
            probe=probe,
        )  # fmt: skip
        if _server_lost(dep, "interference", results):
            return
        results["interference"][dep.name] = {**inter.to_dict(with_records=False), "measured": _now()}
        records["interference"][dep.name] = inter.to_dict(with_records=True)
        fig = inter.figures()
        per_seed = ", ".join(f"x{r:.2f}" if r else "–" for r in inter.seed_ratios("p99"))
        log(
            f"{dep.name}: short TPOT p99 {fig['decode_only_tpot_p99']} -> {fig['mixed_tpot_p99']} s "
            f"(pooled x{fig['ratio_p99']}; per seed {per_seed})"
        )
    finally:
        await client.close()


async def _misses_alone(
    client: Any,
    dep: Deployment,
    name: str,
    workload: Any,
    factory: PromptFactory,
    cal: Calibration,
    results: dict[str, Any],
    records: dict[str, Any],
) -> bool:
    """Serve IDLE_REPS requests of `workload` alone on `dep` and record their median TTFT / TPOT in
    results["alone"]; True (with goodput 0 recorded, and a note) when that median already misses an SLO
    of `cal`: then no rate can reach the target attainment, and the search is skipped."""
    try:
        alone = await calibrate(client, workload, factory, dep.name, reps=IDLE_REPS)
    except ValueError as exc:  # a failing request: the search below measures and reports the errors
        results.setdefault("alone", {}).setdefault(name, {})[dep.name] = {"error": str(exc)[:300]}
        return False
    figures = {"ttft_s": alone.idle_ttft_s, "tpot_s": alone.idle_tpot_s, "requests": IDLE_REPS}
    results.setdefault("alone", {}).setdefault(name, {})[dep.name] = figures
    if alone.idle_ttft_s <= cal.slo.ttft_s and alone.idle_tpot_s <= cal.slo.tpot_s:
        return False
    res = GoodputResult(workload.name, 0.0, dep.cores, [], Bracket(0.0, 0.0), "misses alone").to_dict()
    results["goodput"].setdefault(name, {})[dep.name] = {**res, "misses_alone": True, "measured": _now()}
    records["goodput"].setdefault(name, {})[dep.name] = None
    note = (
        f"{dep.name} {name}: goodput 0 without a search: alone, its median TTFT "
        f"{alone.idle_ttft_s * 1000:.0f} ms / TPOT {alone.idle_tpot_s * 1000:.1f} ms already miss the SLOs "
        f"({cal.slo.ttft_s * 1000:.0f} / {cal.slo.tpot_s * 1000:.1f} ms)"
    )
    results["meta"]["notes"].append(note)
    log(note)
    return True


def server_alive(pid: int | None) -> bool:
    """False once the benchmarked server process has exited (a zombie counts as exited)."""
    if pid is None:
        return True
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def _server_lost(dep: Deployment, what: str, results: dict[str, Any]) -> bool:
    """Note and report a server that died: what it served from then on are errors, not measurements."""
    if server_alive(dep.pgid):
        return False
    note = f"{dep.name} {what}: not measured, the Triton server had exited (see perf/out/tritonserver.log)"
    if note not in results["meta"]["notes"]:
        results["meta"]["notes"].append(note)
        log(note)
    return True


def _calibration(d: dict[str, Any]) -> Calibration:
    from perf.benchlib.metrics import Slo

    return Calibration(
        d["workload"], d["reference"], d["prompt_tokens"], d["idle_ttft_s"], d["idle_tpot_s"],
        Slo(**d["slo"]), d["samples"],
    )  # fmt: skip


def deployment_rows(deployments: dict[str, Deployment]) -> dict[str, dict[str, Any]]:
    return {
        n: {"endpoint": d.endpoint, "cores": d.cores, "note": d.note,
            "available": d.available, "reason": d.reason}
        for n, d in deployments.items()
    }  # fmt: skip


def earlier_run(args: argparse.Namespace, model_key: str, notes: list[str]) -> tuple[dict, dict] | None:
    """With --keep-earlier: the earlier run's results and records (read before this run writes its own),
    or None (with a note) when they are of another model."""
    earlier_json = args.out_dir / "bench.json"
    if not (args.keep_earlier and earlier_json.is_file()):
        return None
    earlier = json.loads(earlier_json.read_text())
    if Path(earlier["meta"]["model"]).name != model_key:
        notes.append(f"--keep-earlier: {earlier_json} is of another model, not kept")
        return None
    return earlier, json.loads(args.records.read_text()) if args.records.is_file() else {}


def write_partial(
    results: dict[str, Any],
    records: dict[str, Any],
    deployments: dict[str, Deployment],
    args: argparse.Namespace,
    started: float,
    earlier: tuple[dict, dict] | None,
    final: bool = False,
) -> None:
    """The report of what is measured so far (after each deployment, and at the end): a run cut short
    still leaves its figures. With `earlier` (`earlier_run`), its other figures are carried."""
    out = {**results, "deployments": deployment_rows(deployments)}
    out["meta"] = {**results["meta"], "elapsed_s": time.monotonic() - started}
    out["meta"]["finished"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    if not final:
        out["meta"]["notes"] = [*results["meta"]["notes"], "partial: the run was still going on"]
    if earlier is not None:
        out, records = carry_earlier(out, earlier[0]), carry_earlier_records(records, earlier[1])
    write_outputs(out, records, args)


def grid_start(starts: dict[str, dict[str, float]], results: dict[str, Any], kind: str) -> None:
    """Where `kind`'s full search on its tuning workload starts: the goodput its best configuration
    reached in the grid (an earlier run's, from --start-at, takes precedence)."""
    grid = results.get(f"{kind}_grid") or {}
    best = next((e for e in grid.get("tried", []) if e["config"] == grid.get("best")), None)
    if best and best.get("goodput_rps") and grid.get("workload"):
        starts.setdefault(grid["workload"], {}).setdefault(kind, best["goodput_rps"])


def earlier_goodputs(path: Path) -> dict[str, dict[str, float]]:
    """An earlier run's goodputs (bench.json) by workload and deployment, those above 0 only: where
    this run's searches start."""
    earlier = json.loads(Path(path).read_text())
    return {
        workload: {name: res["goodput_rps"] for name, res in per.items() if res.get("goodput_rps")}
        for workload, per in earlier.get("goodput", {}).items()
    }


def carry_earlier(results: dict[str, Any], earlier: dict[str, Any]) -> dict[str, Any]:
    """`results` with the earlier run's figures this run did not measure: goodput cells (workload x
    deployment), interference rows, calibrations, grids and deployment rows, each marked
    `from_run` (the earlier run's start, or the run its figure came from), so the report can say
    which parts are fresh. This run's own figures always win."""
    out = json.loads(json.dumps(results))
    run = earlier["meta"].get("started", "an earlier run")

    def carried(value: dict[str, Any]) -> dict[str, Any]:
        return {**value, "from_run": value.get("from_run") or run}

    for workload, per in earlier.get("goodput", {}).items():
        mine = out["goodput"].setdefault(workload, {})
        for name, res in per.items():
            if name not in mine:
                mine[name] = carried(res)
                alone = earlier.get("alone", {}).get(workload, {}).get(name)
                if alone is not None:
                    out.setdefault("alone", {}).setdefault(workload, {})[name] = alone
    for name, res in earlier.get("interference", {}).items():
        out["interference"].setdefault(name, carried(res))
    for workload, cal in earlier.get("calibrations", {}).items():
        out["calibrations"].setdefault(workload, carried(cal))
    for name, dep in earlier.get("deployments", {}).items():
        out["deployments"].setdefault(name, carried(dep))
    for key, grid in earlier.items():
        if key.endswith("_grid") or key in ("vllm_pd", "llamacpp_build"):
            out.setdefault(key, carried(grid) if isinstance(grid, dict) else grid)
    return out


def carry_earlier_records(records: dict[str, Any], earlier: dict[str, Any]) -> dict[str, Any]:
    """The records (for the plots) of the cells `carry_earlier` keeps, from the earlier records."""
    out = json.loads(json.dumps(records))
    for workload, per in earlier.get("goodput", {}).items():
        mine = out["goodput"].setdefault(workload, {})
        for name, rec in (per or {}).items():
            mine.setdefault(name, rec)
    for name, rec in earlier.get("interference", {}).items():
        out["interference"].setdefault(name, rec)
    return out


def write_outputs(results: dict[str, Any], records: dict[str, Any], args: argparse.Namespace) -> None:
    """bench.json (figures), the records JSON, the PNG plots and the markdown report."""
    args.out_dir.mkdir(parents=True, exist_ok=True)
    write_json(args.out_dir / "bench.json", results)
    write_json(args.records, records)
    written = {
        "attainment": plots.attainment_plots(results, args.out_dir),
        "cdf": plots.cdf_plots(results, records, args.out_dir),
        "interference": plots.interference_plot(results, args.out_dir),
    }
    base = args.report.resolve().parent
    rel = {k: [os.path.relpath(p.resolve(), base) for p in v] for k, v in written.items()}
    orchestration_json = orchestration_dir(args) / "orchestration_cost.json"
    orchestration = json.loads(orchestration_json.read_text()) if orchestration_json.exists() else None
    earlier = args.report.read_text() if args.report.is_file() else ""
    args.report.write_text(report.keeping_sections(report.render(results, rel, orchestration), earlier))
    count = sum(map(len, written.values()))
    minutes = results["meta"]["elapsed_s"] / 60
    log(f"wrote {args.report}, {args.out_dir / 'bench.json'} and {count} plots in {minutes:.1f} min")


async def main_async(args: argparse.Namespace) -> int:
    profile = PROFILES[args.mode]
    if args.workloads:
        unknown = [w for w in args.workloads.split(",") if w not in WORKLOADS and w not in FIXED_SLOS]
        if unknown:
            raise SystemExit(f"unknown workloads: {unknown}; known: {sorted({*WORKLOADS, *FIXED_SLOS})}")
        profile = Profile(**{**profile.__dict__, "workloads": tuple(args.workloads.split(","))})
    experiments = tuple(e.strip() for e in args.experiments.split(",") if e.strip())
    if not experiments or set(experiments) - {"goodput", "interference"}:
        raise SystemExit("--experiments takes goodput and/or interference")
    model_key = args.model_dir.resolve().name
    needed = tuple(dict.fromkeys(w for w in (*profile.workloads, "decode") if w not in FIXED_SLOS))
    frozen: dict[str, FrozenSlo] | None = None
    derived = False
    if args.derive_slos:
        names_given = [n.strip() for n in args.deployments.split(",") if n.strip()]
        if "colocated" not in names_given:
            raise SystemExit(
                "--derive-slos measures the rule's reference: include colocated in --deployments"
            )
        args.deployments = "colocated"
    else:
        frozen = load_frozen(args.slo_file, model_key)
        missing = [w for w in needed if w not in frozen]
        if missing:
            raise SystemExit(
                f"{args.slo_file} has no frozen SLOs for {model_key}: {', '.join(missing)}. Derive them "
                f"once (a recorded step): perf/run_all.py --{profile.name} --derive-slos --start-triton "
                f"--model-dir {args.model_dir}"
            )
    pin_self(args.loadgen_cpus)
    started_wall, started = datetime.datetime.now(datetime.timezone.utc), time.monotonic()
    deadline = started + (profile.budget_s if args.budget_min is None else args.budget_min * 60)
    workdir = PERF / "out"
    workdir.mkdir(parents=True, exist_ok=True)
    factory = PromptFactory.from_model_dir(args.model_dir)
    names = [n.strip() for n in args.deployments.split(",") if n.strip()]
    unknown = [n for n in names if n not in (*TRITON_MODELS, *PEERS)]
    if unknown:
        raise SystemExit(f"unknown deployments: {unknown}")
    facts = machine_facts.measure(bandwidth=not args.no_bandwidth)
    log(f"machine: {facts.describe()}")
    cache = GridCache(args.grid_cache, reuse=args.reuse_grids)
    starts = earlier_goodputs(args.start_at) if args.start_at else {}
    plan = time_plan(names, args, profile, cache, facts, deadline)
    log(f"time plan: {len(plan.parts)} parts in {plan.remaining_s() / 60:.0f} min")

    triton_server = None
    triton_url = args.triton_url
    deployments: dict[str, Deployment] = {}
    results: dict[str, Any] = {
        "meta": {
            "command": f"python -m perf.run_all --{profile.name}",
            "mode": profile.name,
            "started": started_wall.isoformat(timespec="seconds"),
            "machine": facts.describe(),
            "machine_facts": facts.to_dict(),
            "machine_key": machine_key(facts.model, facts.flags),
            "workloads": list(profile.workloads),
            "deployments_measured": list(names),
            "model": str(args.model_dir),
            "loadgen_affinity": sorted(os.sched_getaffinity(0)),
            "server_cpus": None,
            "token_counting": "vLLM: its reported usage.completion_tokens; Triton: the requested "
            "count (min_length = max_tokens forces it; the pipeline's pieces can merge tokens)",
            "profile": {k: str(v) for k, v in profile.__dict__.items()},
            "notes": list(args.note),
        },
        "slo_rule": SLO_RULE,
        "target_attainment": 0.9,
        "calibrations": {},
        "deployments": {},
        "goodput": {},
        "interference": {},
    }
    earlier = earlier_run(args, model_key, results["meta"]["notes"])
    try:
        repository = args.start_triton
        if "colocated" in names and not triton_url and repository is not None and not args.derive_slos:
            # our colocated baseline at its best, each configuration on its own server, before the
            # server every Triton deployment is measured on starts with the best one
            try:
                best = await tune_grid(
                    "colocated", colocated_grid(args.colocated_grid), colocated_running, args, workdir,
                    profile, factory, results, plan.start(grid_part("colocated")), frozen, cache=cache,
                    run_end=plan.end,
                )  # fmt: skip
                scratch = fresh(workdir / "colocated-best")
                repository = with_pool_parameters(repository, scratch, "colocated", best.parameters())
                grid_start(starts, results, "colocated")
            except RuntimeError as exc:
                results["meta"]["notes"].append(f"colocated grid: {exc}; the repository's own is measured")
        if "disagg" in names and not triton_url and repository is not None and not args.derive_slos:
            try:
                best = await tune_grid(
                    "disagg", disagg_grid(args.disagg_grid), disagg_running, args, workdir, profile,
                    factory, results, plan.start(grid_part("disagg")), frozen, cache=cache, run_end=plan.end,
                )  # fmt: skip
                repository = best.repository(repository, fresh(workdir / "disagg-best"))
                grid_start(starts, results, "disagg")
            except RuntimeError as exc:
                results["meta"]["notes"].append(f"disagg grid: {exc}; the repository's own is measured")
        if any(n in TRITON_MODELS for n in names) and not triton_url and repository is not None:
            log(f"starting Triton on {repository} ...")
            try:
                triton_server = start_triton(
                    repository, workdir, args.model_dir, cpus=parse_cpus(args.server_cpus)
                )
                triton_url = triton_server.config.grpc_url
                results["meta"]["server_cpus"] = list(parse_cpus(args.server_cpus))
            except Exception as exc:  # a broken repository must not cost the vLLM measurement
                log(f"Triton did not start: {exc}")
        for name in names:
            if name == "vllm":
                note = f"vLLM CPU 0.32.0, taskset -c {args.vllm_cpus}, the best of its grid (below)"
                endpoint = args.vllm_url or "to be started"
                dep = Deployment(name, None, args.cores, note, available=True)
            elif name == "llamacpp":
                dep = Deployment(name, None, args.cores, "llama.cpp's server")
                dep.reason = llamacpp_unavailable(args.model_dir)
                dep.available = not dep.reason
                results["llamacpp_build"] = build_record()
                endpoint = "to be started"
            elif name == "vllm-pd":
                note = (
                    f"vLLM CPU 0.32.0 P/D: prefill kv_producer on core 0, decode kv_consumer on core 1, "
                    f"NixlConnector with host buffers, {args.vllm_pd_dtype}"
                )
                dep = Deployment(name, None, args.cores, note, available=True)
                endpoint = "to be started"
            else:
                endpoint = f"{triton_url or '?'} model {TRITON_MODELS[name]}"
                dep = Deployment(name, None, args.cores, NOTES[name])
                if results.get(f"{name}_grid"):
                    dep.note += f"; {results[f'{name}_grid']['best']}, the best of its grid"
                if not triton_url:
                    dep.reason = "no Triton server (--triton-url or --start-triton)"
                else:
                    dep.config = ClientConfig("triton", triton_url, TRITON_MODELS[name])
                    dep.pgid = triton_server.pid if triton_server is not None else None
                    dep.available = await triton_ready(dep.config)
                    dep.reason = "" if dep.available else f"model {TRITON_MODELS[name]} not ready"
            dep.endpoint = endpoint
            deployments[name] = dep
        told = args.tell_slos and triton_server is not None and frozen is not None
        if told:  # each of our searches gets a server of its own, told its SLOs: this one was the check
            results["meta"]["notes"].append(
                "Our deployments were told each workload's SLOs, as a user sets them in the spec "
                "(`entry_points.slo`: the orchestrators' `slo.ttft_s` / `slo.tpot_s`, which admission "
                "judges by, and the admission margin the spec then defaults to, 1), each search on a "
                "server of its own; their grids were tuned with the repository's own SLOs. vLLM and "
                "llama.cpp have no such setting."
            )
            for dep in deployments.values():
                if dep.name in TRITON_MODELS and dep.available:
                    dep.endpoint += ", a server per workload, told its SLOs"
            triton_server.stop()
            triton_server = None

        records: dict[str, Any] = {"goodput": {}, "interference": {}}
        # The SLO reference is measured first; without it, the first available deployment stands in
        # (and the report says so).
        order = sorted(names, key=MEASURING_ORDER.index)
        if frozen is not None and "colocated" not in names:
            results["meta"]["notes"].append(
                f"{REFERENCE_DEPLOYMENT} is not measured in this run: every workload is judged by its "
                "frozen SLOs, and the idle figures beside them were measured on the first deployment."
            )
        elif not (deployments.get("colocated") and deployments["colocated"].available):
            results["meta"]["notes"].append(
                f"{REFERENCE_DEPLOYMENT} was not available: the SLOs were calibrated on a stand-in "
                "(named in the SLO table), so they are not the project's rule values."
            )
            order = sorted(names, key=lambda n: n != "vllm")
        for name in order:
            dep = deployments[name]
            if not dep.available:
                log(f"{name}: not measured ({dep.reason})")
                plan.drop(name)  # its time goes to the others
                continue
            try:
                if name == "vllm-pd":
                    notes = results["meta"]["notes"]
                    with vllm_pd_running(args, workdir, args.vllm_pd_dtype) as (config, command):
                        results["vllm_pd"] = {"command": command}
                        dep.config, dep.endpoint = config, f"{config.url} (started here)"
                        await measure(
                            dep, profile, factory, results, records, plan, experiments, frozen, starts
                        )
                elif name == "llamacpp":
                    choice = await tune_grid(
                        "llamacpp", llamacpp_grid(args.llamacpp_grid), llamacpp_running, args, workdir,
                        profile, factory, results, plan.start(grid_part("llamacpp")), frozen,
                        cache=cache, run_end=plan.end,
                    )  # fmt: skip
                    dep.note = f"llama.cpp's server, taskset -c {args.vllm_cpus}, {choice.label}"
                    grid_start(starts, results, "llamacpp")
                    with llamacpp_running(args, workdir, results["meta"]["notes"], choice) as running:
                        config, pgid, command = running
                        results["llamacpp_grid"]["command"] = command
                        dep.config, dep.pgid, dep.endpoint = config, pgid, f"{config.url} (started here)"
                        await measure(
                            dep, profile, factory, results, records, plan, experiments, frozen, starts
                        )
                elif name == "vllm":
                    choice = await tune_grid(
                        "vllm", vllm_tuning_grid(args), vllm_running, args, workdir, profile, factory,
                        results, plan.start(grid_part("vllm")), frozen, cache=cache, run_end=plan.end,
                    )  # fmt: skip
                    if not args.vllm_url and args.vllm_chunk_grid.strip():
                        choice = await tune_grid(
                            "vllm", vllm_chunk_grid(choice, args.vllm_chunk_grid), vllm_running, args,
                            workdir, profile, factory, results, plan.start(grid_part("vllm", "chunks")),
                            frozen, cache=cache, run_end=plan.end, extend=True,
                        )  # fmt: skip
                    dep.note = f"vLLM CPU 0.32.0, taskset -c {args.vllm_cpus}, {choice.label}"
                    grid_start(starts, results, "vllm")
                    notes = results["meta"]["notes"]
                    with vllm_running(args, workdir, notes, choice) as (config, pgid, command):
                        results["vllm_grid"]["command"] = command
                        dep.config, dep.pgid = config, pgid
                        dep.endpoint = config.url if args.vllm_url else f"{config.url} (started here)"
                        if triton_server is not None:
                            results["meta"]["notes"].append(
                                "Triton stayed up, idle, while vLLM was measured (and vLLM was not yet "
                                "started while Triton deployments were)."
                            )
                        await measure(
                            dep, profile, factory, results, records, plan, experiments, frozen, starts
                        )
                elif args.derive_slos:
                    await measure(dep, profile, factory, results, records, plan, ())
                    cals = {
                        n: _calibration(d) for n, d in results["calibrations"].items() if n in needed
                    }  # SLOs given from outside are never frozen
                    if dep.name != "colocated" or len(cals) != len(needed):
                        raise RuntimeError("the SLOs could not be measured on colocated")
                    command = "python -m perf.run_all " + " ".join(sys.argv[1:])
                    freeze(
                        args.slo_file, model_key, cals, started_wall.isoformat(timespec="seconds"), command
                    )
                    log(f"froze the SLOs of {model_key} ({', '.join(cals)}) in {args.slo_file}")
                    derived = True
                elif told:
                    await measure_told(
                        dep, repository, args, profile, factory, results, records, plan, experiments,
                        frozen, starts,
                    )  # fmt: skip
                else:
                    await measure(dep, profile, factory, results, records, plan, experiments, frozen, starts)
            except Exception as exc:  # one broken deployment is reported, the others still run
                dep.available, dep.reason = False, f"failed: {type(exc).__name__}: {str(exc)[:300]}"
                log(f"{name}: {dep.reason}")
                plan.drop(name)
            if not args.derive_slos:  # a run cut short still leaves what it measured
                write_partial(results, records, deployments, args, started, earlier)
    finally:
        if triton_server is not None:
            triton_server.stop()
    if args.derive_slos:  # a derivation writes the SLO file only, never a report
        return 0 if derived else 1

    if profile.name == "full" and triton_url and args.start_triton is not None:
        # the orchestration cost (one stream, its own server) is part of the full report
        log("orchestration cost: perf/orchestration_cost.py --reps 3 ...")
        command = ["-m", "perf.orchestration_cost", "--reps", "3", "--out-dir", str(orchestration_dir(args))]
        cost = subprocess.run([sys.executable, *command], cwd=PERF.parent, check=False)
        if cost.returncode:
            results["meta"]["notes"].append("orchestration cost: the benchmark failed (see its output)")
    write_partial(results, records, deployments, args, started, earlier, final=True)
    return 0 if results["calibrations"] else 1


def orchestration_dir(args: argparse.Namespace) -> Path:
    """Where the full run's orchestration cost goes and its report reads it: the committed folder for
    `make bench`'s own results (`--out-dir` left as it is), else a folder inside `--out-dir`, so that a
    run into scratch folders leaves the committed results alone."""
    if args.out_dir.resolve() == BENCH_OUT.resolve():
        return ORCHESTRATION_OUT
    return args.out_dir / "orchestration_cost"


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    # SIGTERM (a `kill`, a CI timeout) unwinds like Ctrl-C: the servers started here are stopped
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    args = parse_args(argv)
    if args.render_only:
        # Re-render report and plots from the last run's JSON, measuring nothing.
        results = json.loads((args.out_dir / "bench.json").read_text())
        records = json.loads(args.records.read_text())
        results["meta"]["notes"] += [n for n in args.note if n not in results["meta"]["notes"]]
        write_outputs(results, records, args)
        return 0
    return asyncio.run(main_async(args))


if __name__ == "__main__":
    sys.exit(main())
