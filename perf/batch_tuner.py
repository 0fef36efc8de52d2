"""The decode batch tuner against fixed batch sizes: goodput of the disaggregated deployment (`ensemble`)
with the decode pool's batch limit fixed at each of `--fixed` (the engine's `max_batch_size`), at the
default (64), and tuned (`batch_tpot_slo_s` = the workload's frozen TPOT SLO, starting from the knee of
the decode step-time curve that `disagg profile` measures here, unless `--start` says otherwise).

Every configuration is a fresh Triton on the same repository but for the decode pool's parameters, on
the same cores, measured one after another with the serving benchmark's goodput search (`--runs`
searches each), judged by the frozen SLOs (perf/slos.json). The tuned runs also report the tuner's
decisions and its last limit, read from the server's /metrics.

    .venv/bin/python -m perf.batch_tuner --model-dir .models/smollm2-135m-instruct

Writes `<out-dir>/batch_tuner.json` and `.md`, and its section of `--report` (perf/RESULTS.md).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from disagg_tools.planner.cli import knee_line
from disagg_tools.planner.profile import Profile
from perf.benchlib.cliutil import add_search_args, log, machine, write_json
from perf.benchlib.deploy import spec_repository, start_triton
from perf.benchlib.experiment import calibrations, goodput_runs
from perf.benchlib.metrics import Slo
from perf.benchlib.report import publish
from perf.benchlib.slo import SLO_FILE, load_frozen
from perf.benchlib.workload import PromptFactory

REPO_ROOT = Path(__file__).resolve().parents[1]
SECTION = "batch-tuner"
DEFAULT_BATCH = 64  # the engine's max_batch_size


def knee(args: argparse.Namespace, tpot_slo_s: float) -> tuple[int, str]:
    """The tuner's start: `--start`, else the knee of a decode profile measured now on core 1."""
    if args.start:
        return args.start, f"--start {args.start}"
    out = args.out_dir / "decode-profile.json"
    if args.profile is None:
        subprocess.run(
            [str(REPO_ROOT / ".venv" / "bin" / "disagg"), "profile", "--model", str(args.model_dir),
             "--cores", "1", "--dtype", args.dtype, "--out", str(out)],
            check=True,
        )  # fmt: skip
    profile = Profile.load(args.profile or out)
    line = knee_line(profile, tpot_slo_s, args.context, DEFAULT_BATCH)
    log(line)
    try:
        return int(line.split(": ", 1)[1].split(" ", 1)[0]), line
    except ValueError:
        return DEFAULT_BATCH, line


@dataclass(frozen=True)
class GivenSlo:
    """An SLO carried over from an earlier run (`--resume`), with the idle figures the rule derived it
    from (4 x idle TTFT, 2 x idle TPOT), where a search starts."""

    slo: Slo

    @property
    def idle_ttft_s(self) -> float:
        return self.slo.ttft_s / 4

    @property
    def idle_tpot_s(self) -> float:
        return self.slo.tpot_s / 2


def scrape(url: str) -> dict[str, float]:
    """The decode pool's tuner series on /metrics: its limit and each decision's count."""
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith(("disagg_decode_batch_limit{", "disagg_batch_tuner_decisions_total{")):
            name, _, value = line.rpartition(" ")
            if 'pool="decode"' in name:
                out[name] = float(value)
    return out


def configurations(
    args: argparse.Namespace, start: int, tpot_slo_s: float
) -> list[tuple[str, dict[str, str]]]:
    out = [(f"fixed {b}", {"max_batch_size": str(b)}) for b in args.fixed]
    out.append((f"default (fixed {DEFAULT_BATCH})", {}))
    out.append((f"tuned (start {start})", {"batch_tpot_slo_s": f"{tpot_slo_s:g}", "batch_start": str(start)}))
    return out


def markdown(out: dict[str, Any]) -> str:
    lines = [
        "# Decode batch tuner",
        "",
        f"`{out['command']}` on {out['machine']}, {out['model']} {out['dtype']}, "
        "`ensemble` (prefill core 0, "
        f"decode core 1). Workloads {', '.join(out['workloads'])}; "
        f"SLOs ({out['slo_source']}): {out['slos']}. "
        "Goodput: the highest "
        "Poisson rate at which 90 % of requests meet both SLOs, by the serving benchmark's search, "
        f"{out['runs']} search(es) per cell, {out['duration']:g} s of arrivals per probe. Tuner start: "
        f"{out['start_line']}.",
        "",
        "| decode batch | " + " | ".join(f"{w} goodput (req/s)" for w in out["workloads"]) + " |",
        "|---|" + "---:|" * len(out["workloads"]),
    ]
    for name, result in out["results"].items():
        row = []
        for w in out["workloads"]:
            values = [r["goodput_rps"] for r in result["runs"].get(w, [])]
            row.append(" / ".join(f"{v:.2f}" for v in values) or "–")
        lines.append(f"| {name} | " + " | ".join(row) + " |")
    tuned = [r for n, r in out["results"].items() if n.startswith("tuned")]
    if tuned and tuned[0].get("metrics"):
        lines += ["", "The tuned pool's series at the end of its runs:", ""]
        lines += [f"- `{k}` {v:g}" for k, v in sorted(tuned[0]["metrics"].items())]
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model-dir", type=Path, default=REPO_ROOT / ".models" / "smollm2-135m-instruct")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument(
        "--slos",
        choices=("here", "frozen"),
        default="here",
        help="here: by the project's rule from `ensemble_colocated`'s idle figures, measured on the first "
        "server of this run; frozen: perf/slos.json",
    )
    parser.add_argument("--workloads", default="decode,chat")
    parser.add_argument("--fixed", type=lambda t: [int(x) for x in t.split(",")], default=[8, 16, 32])
    parser.add_argument("--start", type=int, default=0, help="the tuner's first limit (0: the knee)")
    parser.add_argument("--profile", type=Path, help="a 1-core decode profile (default: measured now)")
    parser.add_argument("--context", type=int, default=128, help="context per sequence for the knee")
    parser.add_argument(
        "--resume",
        type=Path,
        help="an earlier run's batch_tuner.json: its fixed configurations and SLOs are kept, and only "
        "the tuned one is measured again (after a change to the tuner)",
    )
    add_search_args(parser, runs=1, max_requests=200)
    parser.add_argument("--out-dir", type=Path, default=REPO_ROOT / "perf" / "results" / "batch_tuner")
    parser.add_argument("--report", type=Path, default=REPO_ROOT / "perf" / "RESULTS.md")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    args.model_dir = args.model_dir.resolve()
    workloads = args.workloads.split(",")
    factory = PromptFactory.from_model_dir(args.model_dir)
    slos: dict[str, Any] = load_frozen(SLO_FILE, args.model_dir.name) if args.slos == "frozen" else {}
    out: dict[str, Any] = {
        "command": "python -m perf.batch_tuner " + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": machine(),
        "model": args.model_dir.name,
        "dtype": args.dtype,
        "workloads": workloads,
        "runs": args.runs,
        "duration": args.duration,
        "results": {},
    }
    earlier: dict[str, Any] = json.loads(args.resume.read_text()) if args.resume else {}
    if earlier:
        slos = {w: GivenSlo(Slo(*earlier["slo_values"][w])) for w in workloads}
        out["results"] = {n: r for n, r in earlier["results"].items() if not n.startswith("tuned")}
        out["command"] = f"{earlier['command']}, then {out['command']}"
    with tempfile.TemporaryDirectory(prefix="tuner-slos-") as scratch_name:
        if not slos:  # the rule's reference is the colocated entry point of the default repository
            scratch = Path(scratch_name)
            repo = spec_repository({}, args.model_dir, args.dtype, scratch)
            server = start_triton(repo, scratch / "server", args.model_dir, exit_timeout_s=10)
            try:
                url = server.config.grpc_url
                slos = asyncio.run(calibrations(url, "ensemble_colocated", workloads, factory))
            finally:
                server.stop(grace_s=5)
    out["slos"] = "; ".join(
        f"`{w}` TTFT {slos[w].slo.ttft_s * 1000:.0f} ms, TPOT {slos[w].slo.tpot_s * 1000:.1f} ms"
        for w in workloads
    )
    out["slo_source"] = "frozen, perf/slos.json" if args.slos == "frozen" else (
        "by the project's rule (4 x idle TTFT, 2 x idle TPOT of `ensemble_colocated`), measured at the start "
        "of this run"
    )  # fmt: skip
    out["slo_values"] = {w: (slos[w].slo.ttft_s, slos[w].slo.tpot_s) for w in workloads}
    tpot_slo_s = min(slos[w].slo.tpot_s for w in workloads)  # the tighter: it holds for both
    out["tuner_tpot_slo_s"] = tpot_slo_s
    start, out["start_line"] = knee(args, tpot_slo_s)
    for name, params in configurations(args, start, tpot_slo_s):
        if name in out["results"]:
            continue  # measured by the earlier run
        with tempfile.TemporaryDirectory(prefix="tuner-") as scratch_name:
            scratch = Path(scratch_name)
            pools = {"decode": params} if params else {}
            repo = spec_repository({}, args.model_dir, args.dtype, scratch, pools)
            began = time.perf_counter()
            server = start_triton(repo, scratch / "server", args.model_dir, exit_timeout_s=10)
            log(f"{name}: ready in {time.perf_counter() - began:.0f} s")
            try:
                runs = asyncio.run(
                    goodput_runs(server.config.grpc_url, "ensemble", workloads, factory, slos, args)
                )
                metrics = scrape(server.config.metrics_url) if "batch_tpot_slo_s" in params else {}
            finally:
                server.stop(grace_s=5)
        out["results"][name] = {"parameters": params, "runs": runs, "metrics": metrics}
        means = {w: statistics.fmean(r["goodput_rps"] for r in v) for w, v in runs.items()}
        log(f"{name}: goodput {means}")
        write_json(args.out_dir / "batch_tuner.json", out)
    publish(markdown(out), args.out_dir / "batch_tuner.md", args.report, SECTION)
    return 0


if __name__ == "__main__":
    sys.exit(main())
