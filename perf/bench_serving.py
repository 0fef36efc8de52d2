"""Open-loop serving benchmark against one deployment (Triton gRPC streaming or an OpenAI server).

    # idle calibration: the SLOs the rule derives from this deployment
    python -m perf.bench_serving --kind triton --url 127.0.0.1:8001 --model ensemble_colocated \
        --workload codegen calibrate
    # one run at a fixed Poisson rate, judged against given SLOs (seconds)
    python -m perf.bench_serving --kind openai --url http://127.0.0.1:8000 --model tiny \
        --workload chat rate --rate 2 --ttft-slo 0.7 --tpot-slo 0.03
    # goodput: highest rate with >= 90 % attainment (SLOs given, or calibrated on this deployment)
    python -m perf.bench_serving --kind triton --url 127.0.0.1:8001 --model ensemble \
        --workload codegen search --ttft-slo 0.7 --tpot-slo 0.03

Prints a summary and writes every figure (and per-request records) as JSON to --out. For the whole
comparison (all deployments, report, plots) use perf/run_all.py.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path
from typing import Any

from perf.benchlib.clients import make_client
from perf.benchlib.cliutil import add_target_args, client_config, log, pin_self, write_json
from perf.benchlib.experiment import RunPlan, run_rate, search_goodput, start_rate
from perf.benchlib.metrics import Slo
from perf.benchlib.search import SearchConfig
from perf.benchlib.slo import calibrate
from perf.benchlib.workload import WORKLOADS, PromptFactory


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_target_args(parser)
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="codegen")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--duration", type=float, default=30.0, help="seconds of arrivals per run")
    parser.add_argument("--min-requests", type=int, default=20)
    parser.add_argument("--max-requests", type=int, default=200)
    parser.add_argument("--cores", type=int, default=2, help="cores the deployment occupies (per core)")
    parser.add_argument("--loadgen-cpus", default=None, help="pin this load generator, e.g. '0'")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "out" / "bench.json")
    sub = parser.add_subparsers(dest="command", required=True)
    cal = sub.add_parser("calibrate", help="idle single requests; prints the SLOs the rule gives")
    cal.add_argument("--reps", type=int, default=5)
    rate = sub.add_parser("rate", help="one open-loop run at --rate")
    rate.add_argument("--rate", type=float, required=True, help="requests/s (Poisson)")
    search = sub.add_parser("search", help="goodput bisection")
    search.add_argument("--max-probes", type=int, default=6)
    search.add_argument("--start-rate", type=float, default=0.0, help="default: idle capacity")
    for p in (rate, search):
        p.add_argument("--ttft-slo", type=float, default=0.0, help="seconds (0: calibrate here)")
        p.add_argument("--tpot-slo", type=float, default=0.0, help="seconds (0: calibrate here)")
    return parser.parse_args(argv)


async def main_async(args: argparse.Namespace) -> int:
    pin_self(args.loadgen_cpus)
    factory = PromptFactory.from_model_dir(args.model_dir)
    workload = WORKLOADS[args.workload]
    plan = RunPlan(args.duration, args.min_requests, args.max_requests, seed=args.seed)
    client = make_client(client_config(args))
    await client.open()
    out: dict[str, Any] = {"target": client.config.__dict__, "workload": workload.name}
    try:
        cal = None
        given = getattr(args, "ttft_slo", 0.0), getattr(args, "tpot_slo", 0.0)
        if args.command == "calibrate" or not all(given):
            cal = await calibrate(client, workload, factory, args.model, reps=getattr(args, "reps", 5))
            out["calibration"] = cal.to_dict()
            log(
                f"idle TTFT {cal.idle_ttft_s * 1000:.1f} ms, TPOT {cal.idle_tpot_s * 1000:.2f} ms at "
                f"{cal.prompt_tokens} prompt tokens -> SLO TTFT {cal.slo.ttft_s * 1000:.0f} ms, "
                f"TPOT {cal.slo.tpot_s * 1000:.1f} ms"
            )
        slo = Slo(*given) if all(given) else cal.slo  # type: ignore[union-attr]
        out["slo"] = slo.__dict__
        if args.command == "rate":
            run = await run_rate(client, workload, factory, args.rate, slo, plan)
            out["run"] = run.to_dict()
            s = run.summary
            log(
                f"rate {args.rate}/s: attainment {s.attainment:.3f}, goodput {s.goodput_rps:.3f} req/s, "
                f"throughput {s.throughput_rps:.3f} req/s, TTFT p50/p99 {s.ttft_p50}/{s.ttft_p99} s, "
                f"TPOT p50/p99 {s.tpot_p50}/{s.tpot_p99} s, errors {s.n_errors}"
            )
        elif args.command == "search":
            if args.start_rate:
                start = args.start_rate
            elif cal is not None:
                start = start_rate(cal.idle_ttft_s, cal.idle_tpot_s, workload.output.median())
            else:
                start = 1.0
            search = SearchConfig(start, min_rate=start / 16, max_rate=start * 64, max_probes=args.max_probes)
            res = await search_goodput(client, workload, factory, slo, search, plan, args.cores, log)
            out["goodput"] = res.to_dict(with_records=True)
            log(f"goodput {res.best_rate:.3f} req/s ({res.per_core:.3f} per core)")
    finally:
        await client.close()
    write_json(args.out, out)
    log(f"wrote {args.out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    return asyncio.run(main_async(parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
