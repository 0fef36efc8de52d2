"""The planner against reality: predicted goodput and p90 TTFT / TPOT beside measured ones, side by side.

For each deployment and workload, `disagg plan`'s simulator predicts goodput (the highest Poisson rate
at which 90 % of the requests meet both frozen SLOs, perf/slos.json) from profiles taken here by
`disagg profile` (or given), with the KV hand-off cost fitted from perf/results/kv_transfer.json; then
a real Triton serving that deployment is measured with the serving benchmark's goodput search, `--runs`
times, so the spread of the measurement stands beside the prediction's error.

Deployments (two cores):
  disagg       `ensemble`: prefill pool on core 0 (with the entry points), decode pool on core 1
  colocated    `ensemble_colocated`: one colocated pool instance on both cores
  colocated2   `ensemble_colocated`: two colocated instances, one per core

    .venv/bin/python -m perf.planner_validation --model-dir .models/smollm2-135m-instruct

Writes `<out-dir>/planner_validation.json` and `.md`, and its section of `--report` (perf/RESULTS.md).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from disagg_tools.planner.plan import Traffic, goodput, run_at
from disagg_tools.planner.profile import Profile
from disagg_tools.planner.simulator import ROUTINGS, Deployment, Slo
from perf.benchlib.cliutil import add_search_args, log, machine, write_json
from perf.benchlib.deploy import spec_repository, start_triton
from perf.benchlib.experiment import calibrations, goodput_runs
from perf.benchlib.metrics import percentile
from perf.benchlib.report import publish
from perf.benchlib.slo import SLO_FILE, load_frozen
from perf.benchlib.workload import WORKLOADS, PromptFactory

REPO_ROOT = Path(__file__).resolve().parents[1]
SECTION = "planner-validation"
TARGET = 0.9  # attainment, as the serving benchmark's search and the planner both judge goodput
TARGET_ERROR = 0.15
SLO_SOURCES = {
    "here": "by the project's rule (4 x idle TTFT, 2 x idle TPOT) from `colocated`'s idle figures, "
    "measured at the start of this run",
    "frozen": "frozen, perf/slos.json",
}


@dataclass(frozen=True)
class Setup:
    name: str
    model: str  # the Triton entry point measured
    spec: dict[str, Any]  # laid over the default deployment spec
    pool_parameters: dict[str, str]  # laid over the colocated pool's parameters after rendering
    description: str


SETUPS = {
    "disagg": Setup(
        "disagg", "ensemble", {}, {}, "prefill pool core 0 (entry points beside it), decode pool core 1"
    ),
    "colocated": Setup("colocated", "ensemble_colocated", {}, {}, "one colocated instance on cores 0 and 1"),
    "colocated2": Setup(
        "colocated2",
        "ensemble_colocated",
        {"pools": {"colocated": {"instances": 2}}},
        {"cores": "0;1"},
        "two colocated instances, one on core 0 (entry points beside it), one on core 1",
    ),
}


def transfer_cost(path: Path, transport: str = "shm") -> tuple[float, float]:
    """(fixed seconds, bytes per second) of one KV hand-off, least squares over the measured rows of
    `perf/kv_transfer_bench.py` (time = fixed + bytes / rate)."""
    rows = [r for r in json.loads(path.read_text())["results"] if r["transport"] == transport]
    xs = [float(r["bytes"]) for r in rows]
    ys = [x / (r["gbps"] * 1e9) for x, r in zip(xs, rows, strict=True)]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs)
    return max(0.0, my - slope * mx), 1.0 / slope


def profiles(args: argparse.Namespace) -> dict[int, Profile]:
    """The 1- and 2-core profiles: given (`--profile K=FILE`), else measured now by `disagg profile`
    (with --repredict: the earlier run's, in --out-dir)."""
    given = {int(k): Path(v) for k, _, v in (item.partition("=") for item in args.profile)}
    for cores, spec in ((1, "0"), (2, "0,1")):
        if cores in given:
            continue
        if args.repredict:  # the profiles the measured run was predicted from
            given[cores] = args.out_dir / f"profile-{cores}.json"
            continue
        out = args.out_dir / f"profile-{cores}.json"
        log(f"disagg profile on cores {spec} -> {out}")
        subprocess.run(
            [str(REPO_ROOT / ".venv" / "bin" / "disagg"), "profile", "--model", str(args.model_dir),
             "--cores", spec, "--dtype", args.dtype, "--out", str(out)],
            check=True,
        )  # fmt: skip
        given[cores] = out
    return {k: Profile.load(p) for k, p in given.items()}


def simulated(
    name: str,
    found: dict[int, Profile],
    fixed_s: float,
    rate_bps: float,
    relay: Relay | None = None,
    routing: str = "random",
) -> Deployment:
    one, two = found[1], found[2]
    relay_s = relay.step_s_per_token if relay else 0.0
    if name == "disagg":  # the entry points share the prefill pool's core: their CPU delays prompts
        return Deployment(
            prefill=(one,),
            decode=(one,),
            transfer_bytes_per_s=rate_bps,
            transfer_fixed_s=fixed_s,
            relay_s_per_token=relay_s,
            prefill_relay_s_per_token=relay.entry_cpu_s_per_token if relay else 0.0,
            routing=routing,
        )
    if name == "colocated":
        return Deployment(colocated=(two,), relay_s_per_token=relay_s, routing=routing)
    return Deployment(colocated=(one, one), relay_s_per_token=relay_s, routing=routing)


@dataclass(frozen=True)
class Relay:
    """A deployment's relay terms, measured by `perf/relay_cost.py`."""

    step_s_per_token: float  # a decode step's time inside the server over its profile's, per token
    entry_cpu_s_per_token: float  # the entry points' CPU per token streamed


def relay_costs(path: Path | None) -> dict[str, Relay]:
    """Each deployment's relay terms (`perf/relay_cost.py`); none without the file."""
    if path is None or not path.exists():
        return {}
    found = json.loads(path.read_text())["deployments"]
    return {
        name: Relay(float(d["relay_s_per_token"]), float(d.get("entry_cpu_s_per_token", 0.0)))
        for name, d in found.items()
    }


def predictions(
    name: str, found: dict[int, Profile], transfer: tuple[float, float], relay: dict[str, float],
    slos: dict[str, Any], workloads: list[str], requests: int, measured: dict[str, list[dict[str, Any]]],
    routing: str = "random",
) -> dict[str, dict[str, Any]]:  # fmt: skip
    """Per workload: the prediction with the deployment's relay term, the profiles' alone beside it
    (``profile_only``), and the p90s the simulator gives at the measured goodput (``at_measured``)."""
    fixed_s, rate_bps = transfer
    deployment = simulated(name, found, fixed_s, rate_bps, relay.get(name), routing)
    alone = simulated(name, found, fixed_s, rate_bps, routing=routing)
    out = {}
    for w in workloads:
        slo = Slo(slos[w].slo.ttft_s, slos[w].slo.tpot_s)
        out[w] = predict(deployment, w, slo, requests)
        out[w]["relay_s_per_token"] = deployment.relay_s_per_token
        out[w]["prefill_relay_s_per_token"] = deployment.prefill_relay_s_per_token
        out[w]["profile_only"] = predict(alone, w, slo, requests)
        runs = measured.get(w, [])
        if runs:
            rate = statistics.fmean(r["goodput_rps"] for r in runs)
            out[w]["at_measured"] = p90s_at(deployment, w, rate, requests)
    return out


def p90s_at(deployment: Deployment, workload: str, rate: float, requests: int) -> dict[str, Any]:
    """The simulator's p90 TTFT / TPOT at ``rate`` (the measured goodput): comparable with the measured
    p90s, which were taken at that rate."""
    w = WORKLOADS[workload]
    _, outcomes = run_at(deployment, Traffic(w.prompt, w.output, requests), rate, Slo(1e9, 1e9))
    tpots = [t for o in outcomes if (t := o.tpot) is not None]
    return {
        "rate_rps": rate,
        "ttft_p90_s": percentile([o.ttft for o in outcomes], 90),
        "tpot_p90_s": percentile(tpots, 90) if tpots else None,
    }


def bracket(run: dict[str, Any]) -> float | None:
    """The lowest probed rate above a run's goodput that missed the target: the truth lies between."""
    above = [rate for rate, met in run.get("probes", ()) if rate > run["goodput_rps"] and met < TARGET]
    return min(above) if above else None


def predict(deployment: Deployment, workload: str, slo: Slo, requests: int) -> dict[str, Any]:
    w = WORKLOADS[workload]
    rate, outcomes = goodput(deployment, Traffic(w.prompt, w.output, requests), slo, TARGET)
    tpots = [t for o in outcomes if (t := o.tpot) is not None]
    return {
        "goodput_rps": rate,
        "ttft_p90_s": percentile([o.ttft for o in outcomes], 90),
        "tpot_p90_s": percentile(tpots, 90) if tpots else None,
    }


def repository(setup: Setup, model_dir: Path, dtype: str, scratch: Path) -> Path:
    pools = {"colocated": setup.pool_parameters} if setup.pool_parameters else {}
    return spec_repository(setup.spec, model_dir, dtype, scratch, pools)


def _ms(value: float | None) -> str:
    return "–" if value is None else f"{value * 1000:.0f}"


def _err(predicted: float | None, measured: float | None) -> float | None:
    if predicted is None or not measured:
        return None
    return predicted / measured - 1.0


def cells(out: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for setup, by_workload in out["measured"].items():
        for workload, runs in by_workload.items():
            pred = out["predicted"][setup][workload]
            values = [r["goodput_rps"] for r in runs]
            mean = statistics.fmean(values)
            spread = (max(values) - min(values)) / mean if mean and len(values) > 1 else None

            def med(key: str, runs: list[dict[str, Any]] = runs) -> float | None:
                got = [r[key] for r in runs if r[key] is not None]
                return statistics.median(got) if got else None

            at = pred.get("at_measured", pred)  # older runs: the p90s at the predicted goodput
            alone = pred.get("profile_only")
            rows.append(
                {
                    "deployment": setup,
                    "workload": workload,
                    "predicted_rps": pred["goodput_rps"],
                    "profile_only_rps": alone["goodput_rps"] if alone else None,
                    "relay_ms": pred.get("relay_s_per_token", 0.0) * 1e3,
                    "prefill_relay_ms": pred.get("prefill_relay_s_per_token", 0.0) * 1e3,
                    "measured_rps": values,
                    "missed_at": [bracket(r) for r in runs],
                    "measured_mean_rps": mean,
                    "spread": spread,
                    "error": _err(pred["goodput_rps"], mean),
                    "profile_only_error": _err(alone["goodput_rps"], mean) if alone else None,
                    "ttft_p90": (at["ttft_p90_s"], med("ttft_p90_s")),
                    "tpot_p90": (at["tpot_p90_s"], med("tpot_p90_s")),
                }
            )
    return rows


def _relay(row: dict[str, Any]) -> str:
    shown = f"{row['relay_ms']:.2f}"
    return shown + (f"; prefill {row['prefill_relay_ms']:.2f}" if row["prefill_relay_ms"] else "")


def _routing(out: dict[str, Any]) -> str:
    """How the simulator assigned requests to a pool's instances, for runs that record it."""
    routing = out.get("routing")
    if routing is None:
        return ""
    how = "at random, as Triton's own assignment" if routing == "random" else "to the least loaded"
    return f"; requests go to a pool's instances {how}"


def _search(out: dict[str, Any]) -> str:
    """How the searches ran, for runs that record it."""
    search = out.get("search")
    if not search:
        return ""
    return (
        f" (started at {search['started_at']}, steps of x{search['growth']:g} until one missed, then "
        f"bisection to {search['rel_tol']:.0%} or {search['max_probes']} probes)"
    )


def _pct(value: float | None) -> str:
    return "–" if value is None else f"{value:+.0%}"


def markdown(out: dict[str, Any]) -> str:
    rows = cells(out)
    met = [r for r in rows if r["error"] is not None and abs(r["error"]) <= TARGET_ERROR]
    lines = [
        "# Planner vs measured",
        "",
        f"`{out['command']}` on {out['machine']}, {out['model']} {out['dtype']}. "
        "Predictions: `disagg plan`'s simulator on the profiles below "
        f"({out['requests']} simulated requests per rate{_routing(out)}), KV hand-off "
        f"{out['transfer']['fixed_ms']:.2f} ms + {out['transfer']['gbps']:.2f} GB/s (fitted to "
        "perf/results/kv_transfer.json), and each decode step r ms longer per token it produces (the "
        'relay\'s cost, measured apart by `perf/relay_cost.py`; "profile only": without it); where '
        "the entry points share the prefill pool's core (`disagg`), each prefill step also lasts the "
        '"prefill" ms longer per token streamed while it ran (their CPU per token, measured by the same '
        "script). "
        "Measured: the serving benchmark's goodput search on a real Triton, "
        f"{out['runs']} runs per cell, {out['duration']:g} s of arrivals per probe{_search(out)}. "
        f"Goodput: the highest probed rate with {TARGET:.0%} of requests meeting both SLOs; in brackets "
        "the lowest probed rate "
        "above it that missed (the search's resolution: the true goodput lies between). p90s are at the "
        "measured goodput: measured (the median over the runs), and the simulator's at that rate.",
        "",
        "| deployment | workload | r (ms) | predicted (req/s) | profile only | measured (req/s) "
        "| spread of runs | error | error, profile only | TTFT p90 pred / meas (ms) "
        "| TPOT p90 pred / meas (ms) |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        measured = " / ".join(
            f"{v:.2f}" + ("" if m is None else f" (<{m:.2f})")
            for v, m in zip(r["measured_rps"], r["missed_at"], strict=True)
        )
        spread = "–" if r["spread"] is None else f"{r['spread']:.0%}"
        alone = "–" if r["profile_only_rps"] is None else f"{r['profile_only_rps']:.2f}"
        (pt, mt), (pp, mp) = r["ttft_p90"], r["tpot_p90"]
        lines.append(
            f"| {r['deployment']} | {r['workload']} | {_relay(r)} | {r['predicted_rps']:.2f} | "
            f"{alone} | {measured} | {spread} | {_pct(r['error'])} | {_pct(r['profile_only_error'])} | "
            f"{_ms(pt)} / {_ms(mt)} | {_ms(pp)} / {_ms(mp)} |"
        )
    alone_met = [
        r
        for r in rows
        if r["profile_only_error"] is not None and abs(r["profile_only_error"]) <= TARGET_ERROR
    ]
    lines += [
        "",
        f"Target (goodput error ≤ {TARGET_ERROR:.0%} in every cell): met in {len(met)} of {len(rows)} cells "
        f"(profile only: {len(alone_met)} of {len(rows)}).",
        "",
        "Deployments: " + "; ".join(f"`{s}`: {SETUPS[s].description}" for s in out["measured"]) + ".",
        "",
        "Profiles: "
        + "; ".join(
            f"{k} core(s): prefill fit {p['prefill_error']:.1%}, decode fit {p['decode_error']:.1%} "
            "mean error"
            for k, p in out["profiles"].items()
        )
        + ".",
        "",
        f"SLOs ({out['slo_source']}): " + "; ".join(f"`{w}` {s}" for w, s in out["slos"].items()) + ".",
    ]
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model-dir", type=Path, default=REPO_ROOT / ".models" / "smollm2-135m-instruct")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument(
        "--slos",
        choices=sorted(SLO_SOURCES),
        default="here",
        help="here: by the project's rule from the colocated deployment's idle figures, measured first "
        "in this run; frozen: perf/slos.json",
    )
    parser.add_argument("--profile", action="append", default=[], metavar="K=FILE")
    parser.add_argument(
        "--resume",
        type=Path,
        help="an earlier run's planner_validation.json: its deployments and SLOs are kept, and the "
        "deployments given here are measured beside them with the same SLOs",
    )
    parser.add_argument(
        "--repredict",
        action="store_true",
        help="measure nothing: predict again for the deployments measured in --resume (default: "
        "<out-dir>/planner_validation.json), with the relay terms of --relay-cost",
    )
    parser.add_argument(
        "--relay-cost",
        type=Path,
        default=REPO_ROOT / "perf" / "results" / "planner" / "relay_cost.json",
        help="perf/relay_cost.py's results: each deployment's relay term (none when absent)",
    )
    parser.add_argument(
        "--start-at",
        type=Path,
        help="an earlier run's planner_validation.json: each cell's search starts at the goodput that "
        "run measured for it (with a small --growth, fewer probes bracket it), not at the idle capacity",
    )
    parser.add_argument(
        "--routing",
        choices=ROUTINGS,
        default="random",
        help="the simulator's assignment of requests to a pool's instances (random: as Triton's)",
    )
    parser.add_argument("--deployments", default="disagg,colocated,colocated2")
    parser.add_argument("--workloads", default="codegen,chat")
    add_search_args(parser, runs=2, max_requests=150)
    parser.add_argument("--requests", type=int, default=300, help="simulated requests per rate")
    parser.add_argument(
        "--kv-transfer", type=Path, default=REPO_ROOT / "perf" / "results" / "kv_transfer.json"
    )
    parser.add_argument("--out-dir", type=Path, default=REPO_ROOT / "perf" / "results" / "planner")
    parser.add_argument("--report", type=Path, default=REPO_ROOT / "perf" / "RESULTS.md")
    return parser.parse_args(argv)


def slo_line(slo: Any) -> str:
    return f"TTFT {slo.slo.ttft_s * 1000:.0f} ms, TPOT {slo.slo.tpot_s * 1000:.1f} ms"


@dataclass(frozen=True)
class GivenSlo:
    """An SLO carried over from an earlier run's report (`--resume`), with the attributes a frozen or
    calibrated one has."""

    slo: Any
    idle_ttft_s: float
    idle_tpot_s: float


def resumed(path: Path) -> tuple[dict[str, Any], dict[str, GivenSlo]]:
    """An earlier run's results and the SLOs it derived (its `slos` lines: 4 x idle TTFT, 2 x idle
    TPOT, so the idle figures the searches start from come back too)."""
    from perf.benchlib.metrics import Slo as Judged

    earlier = json.loads(path.read_text())
    slos = {}
    for workload, line in earlier["slos"].items():
        ttft_ms, tpot_ms = (float(x) for x in re.findall(r"([0-9.]+) ms", line))
        slo = Judged(ttft_s=ttft_ms / 1000, tpot_s=tpot_ms / 1000)
        slos[workload] = GivenSlo(slo, slo.ttft_s / 4, slo.tpot_s / 2)
    return earlier, slos


def earlier_goodputs(path: Path | None) -> dict[str, dict[str, float]]:
    """Per deployment and workload, the mean goodput an earlier run measured (none without a file)."""
    if path is None:
        return {}
    measured = json.loads(path.read_text())["measured"]
    return {
        setup: {
            w: statistics.fmean(r["goodput_rps"] for r in runs) for w, runs in by_workload.items() if runs
        }
        for setup, by_workload in measured.items()
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    args.model_dir = args.model_dir.resolve()
    workloads = args.workloads.split(",")
    setups = [SETUPS[name] for name in args.deployments.split(",")]
    if args.slos == "here":  # derived on the colocated deployment: it runs first
        setups.sort(key=lambda s: s.name != "colocated")
    found = profiles(args)
    fixed_s, rate_bps = transfer_cost(args.kv_transfer)
    slos: dict[str, Any] = load_frozen(SLO_FILE, args.model_dir.name) if args.slos == "frozen" else {}
    earlier: dict[str, Any] = {}
    if args.repredict and args.resume is None:
        args.resume = args.out_dir / "planner_validation.json"
    if args.resume is not None:  # the deployments measured before, and their SLOs
        earlier, slos = resumed(args.resume)
    out: dict[str, Any] = {
        "command": "python -m perf.planner_validation "
        + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": machine(),
        "model": args.model_dir.name,
        "dtype": args.dtype,
        "runs": args.runs,
        "duration": args.duration,
        "search": {
            "growth": args.growth,
            "rel_tol": args.rel_tol,
            "max_probes": args.max_probes,
            "started_at": str(args.start_at) if args.start_at else "the idle capacity",
        },
        "requests": args.requests,
        "routing": args.routing,
        "transfer": {"fixed_ms": fixed_s * 1000, "gbps": rate_bps / 1e9},
        "profiles": {
            k: {"prefill_error": p.prefill.mean_error, "decode_error": p.decode.mean_error}
            for k, p in sorted(found.items())
        },
        "slo_source": SLO_SOURCES[args.slos],
        "slos": {},
        "predicted": dict(earlier.get("predicted", {})),
        "measured": dict(earlier.get("measured", {})),
    }
    if earlier:
        out["command"] = f"{earlier['command'].split(', then ')[0]}, then {out['command']}"
        if args.repredict:  # the measurement's settings, not this run's defaults
            out.update(
                {k: earlier[k] for k in ("machine", "runs", "duration", "dtype", "search") if k in earlier}
            )
    starts = earlier_goodputs(args.start_at)
    relay = relay_costs(args.relay_cost)
    out["relay_cost"] = str(args.relay_cost) if relay else None
    factory = PromptFactory.from_model_dir(args.model_dir)
    for setup in setups:
        if not args.repredict:
            with tempfile.TemporaryDirectory(prefix="planner-") as name:
                scratch = Path(name)
                repo = repository(setup, args.model_dir, args.dtype, scratch)
                started = time.perf_counter()
                server = start_triton(repo, scratch / "server", args.model_dir, exit_timeout_s=10)
                log(f"{setup.name}: ready in {time.perf_counter() - started:.0f} s")
                try:
                    url = server.config.grpc_url
                    if not slos:
                        slos = asyncio.run(calibrations(url, setup.model, workloads, factory))
                        out["slos"] = {w: slo_line(slos[w]) for w in workloads}
                        log(f"SLOs by the rule, measured on {setup.name}: {out['slos']}")
                    out["measured"][setup.name] = asyncio.run(
                        goodput_runs(url, setup.model, workloads, factory, slos, args, starts.get(setup.name))
                    )
                finally:
                    server.stop(grace_s=5)
        out["slos"] = {w: slo_line(slos[w]) for w in workloads}
        out["predicted"][setup.name] = predictions(
            setup.name, found, (fixed_s, rate_bps), relay, slos, workloads, args.requests,
            out["measured"].get(setup.name, {}), args.routing,
        )  # fmt: skip
        log(f"{setup.name}: predicted {out['predicted'][setup.name]}")
        write_json(args.out_dir / "planner_validation.json", out)  # each deployment as it ends
    publish(markdown(out), args.out_dir / "planner_validation.md", args.report, SECTION)
    return 0


if __name__ == "__main__":
    sys.exit(main())
