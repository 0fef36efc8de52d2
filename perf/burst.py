"""Refusal bursts: how fast the server turns away a crowd that arrives at once.

The overload run (``perf.overload``) meets one such crowd: its clients' first requests, all sent at
the same instant. Admission admits what the prefill pool can take within its margin and refuses the
rest, and the refusals of that one burst are the slowest of the whole run, so they set its p99 (the
issue's target: under 50 ms). One burst is one sample, and its p99 varies from run to run by more
than most changes to the refusal path. This sends ``--bursts`` such crowds, each of ``--clients``
unique prompts of a workload sent together, and between two bursts waits until the server is idle
again (the pools' gauges back at rest), so each burst meets the same server:

- the first burst meets pools whose prefill speed admission has not measured yet (admission holds
  the backlog to ``cold_backlog_tokens``), as the overload run's opening burst does;
- every later one meets a measured pool.

Reported, per burst and pooled over the measured ones: how many were refused and admitted, and the
refusals' latency from send to the error (p50, p99, the slowest). The server is the repository as it
is (its own admission margin and SLO: the default deployment, as ``make serve`` starts it).

Beside them, in the same run, the **floor**: as many bursts of requests with an empty prompt, which
the first step that reads the prompt refuses (``preprocessing`` for ``ensemble``, the orchestrator's
parser for ``llm``) before any tokenization, admission or prefill. What those take is the client,
Triton and the text path alone, with nothing computing beside them.

    .venv/bin/python -m perf.burst --model-dir .models/smollm2-135m-instruct

Writes ``<out-dir>/<name>.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import sys
import tempfile
from pathlib import Path
from typing import Any

from perf.benchlib.clients import ClientConfig, make_client
from perf.benchlib.cliutil import machine
from perf.benchlib.deploy import pool_parameter, start_triton
from perf.benchlib.gauges import IDLE_GAUGES, settle
from perf.benchlib.loadgen import LoadConfig, run_trace
from perf.benchlib.metrics import RequestRecord, percentile
from perf.benchlib.outputs import write_results
from perf.benchlib.workload import WORKLOADS, PromptFactory, build_trace, new_salt
from perf.overload import refused

REPO_ROOT = Path(__file__).resolve().parents[1]
RESULTS = REPO_ROOT / "perf" / "results" / "burst"
IDLE_TIMEOUT_S = 120.0  # a burst's admitted requests are served within this, or the run stops


def burst_summary(records: list[RequestRecord]) -> dict[str, Any]:
    """One burst: refused / admitted / other, and the refusals' latency (ms) from send to error."""
    refusals = [r for r in records if refused(r)]
    waits = [(r.ended - r.sent) * 1000 for r in refusals if r.ended is not None and r.sent is not None]
    return {
        "refused": len(refusals),
        "admitted": sum(r.ok for r in records),
        "failed_otherwise": sum(not r.ok and not refused(r) for r in records),
        "refusal_ms": waits,
        "refusal_ms_p50": percentile(waits, 50),
        "refusal_ms_p99": percentile(waits, 99),
        "refusal_ms_max": max(waits) if waits else None,
    }


def pooled(bursts: list[dict[str, Any]], skip_first: bool = True) -> dict[str, Any]:
    """The measured bursts (every one after the first, the cold one, unless ``skip_first`` is False)
    together: their refusals' latency, and the median of the bursts' own p99s (what one overload run's
    opening burst would show, typically)."""
    later = bursts[1:] if skip_first else bursts
    waits = [w for b in later for w in b["refusal_ms"]]
    p99s = sorted(b["refusal_ms_p99"] for b in later if b["refusal_ms_p99"] is not None)
    return {
        "bursts": len(later),
        "refused": len(waits),
        "refusal_ms_p50": percentile(waits, 50),
        "refusal_ms_p99": percentile(waits, 99),
        "burst_p99_ms_median": p99s[len(p99s) // 2] if p99s else None,
        "burst_p99_ms_range": [p99s[0], p99s[-1]] if p99s else None,
    }


async def run(args: argparse.Namespace, server: Any) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    workload = WORKLOADS[args.workload]
    factory = PromptFactory.from_model_dir(args.model_dir)
    client = make_client(ClientConfig(kind="triton", url=server.config.grpc_url, model=args.model))
    await client.open()
    metrics, rest = server.config.metrics_url, dict.fromkeys(IDLE_GAUGES, 0.0)
    bursts: list[dict[str, Any]] = []
    floor: list[dict[str, Any]] = []
    try:
        # one request first, not counted: the client's channel and lazy set-up happen before
        warm = build_trace(workload, factory, 1.0, 1, args.seed, new_salt())
        await run_trace(client, warm, LoadConfig(max_duration_s=60), factory.count_output)
        for index in range(2 * args.bursts):  # the bursts, then as many empty ones (the floor)
            settled, off = settle(metrics, rest, timeout_s=IDLE_TIMEOUT_S)
            if settled is None:
                raise RuntimeError(f"the server was not idle {IDLE_TIMEOUT_S:g} s after a burst: {off}")
            crowd = build_trace(workload, factory, 1.0, args.clients, args.seed + 1 + index, new_salt())
            empty = index >= args.bursts
            # all at once; an empty prompt is refused by the first step that reads it
            crowd = [dataclasses.replace(s, arrival=0.0, prompt="" if empty else s.prompt) for s in crowd]
            records = await run_trace(client, crowd, LoadConfig(max_duration_s=60), factory.count_output)
            (floor if empty else bursts).append(burst_summary(records))
    finally:
        await client.close()
    return bursts, floor


def _ms(value: float | None) -> str:
    return "–" if value is None else f"{value:.1f}"


def markdown(out: dict[str, Any]) -> str:
    total = out["pooled"]
    lines = [
        "# Refusal bursts (RELIABILITY E1: the overload run's opening burst, repeated)",
        "",
        f"Written by `perf/burst.py`: `{out['command']}`. {out['bursts_sent']} bursts of "
        f"{out['clients']} `{out['workload']}` requests sent at once to `{out['entry_point']}`, then "
        "as many of requests with an empty prompt (the floor), the server idle before each burst; "
        f"the repository as deployed (`admission.margin` "
        f"{out['admission_margin']}). {out['machine']}.",
        "",
        "| burst | refused | admitted | failed otherwise | refusal p50 / p99 / slowest, ms |",
        "|---:|---:|---:|---:|---:|",
    ]
    for index, b in enumerate(out["bursts"]):
        label = "1 (cold pool)" if index == 0 else str(index + 1)
        latency = f"{_ms(b['refusal_ms_p50'])} / {_ms(b['refusal_ms_p99'])} / {_ms(b['refusal_ms_max'])}"
        lines.append(f"| {label} | {b['refused']} | {b['admitted']} | {b['failed_otherwise']} | {latency} |")
    floor = out["floor"]
    lines += [
        "",
        "| | bursts | refusals | p50, ms | p99, ms | a burst's own p99, ms: median (range) |",
        "|---|---:|---:|---:|---:|---:|",
        _pooled_row(f"bursts 2-{len(out['bursts'])} (measured pools)", total),
        _pooled_row("the floor: empty prompts, refused before any work", floor),
        "",
        "Target (RELIABILITY E1 under overload): refusal p99 < 50 ms.",
        "",
    ]
    return "\n".join(lines)


def _pooled_row(label: str, total: dict[str, Any]) -> str:
    spread = total["burst_p99_ms_range"]
    between = f" ({_ms(spread[0])}-{_ms(spread[1])})" if spread else ""
    return (
        f"| {label} | {total['bursts']} | {total['refused']} | {_ms(total['refusal_ms_p50'])} | "
        f"{_ms(total['refusal_ms_p99'])} | {_ms(total['burst_p99_ms_median'])}{between} |"
    )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model-dir", type=Path, default=REPO_ROOT / ".models" / "smollm2-135m-instruct")
    parser.add_argument("--repository", type=Path, default=REPO_ROOT / "model_repository")
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="codegen")
    parser.add_argument("--model", default="ensemble", help="the entry point the bursts go to")
    parser.add_argument("--clients", type=int, default=64, help="requests in one burst")
    parser.add_argument("--bursts", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--name", default="burst")
    parser.add_argument("--out-dir", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if args.clients < 1 or args.bursts < 2:
        parser.error("--clients must be at least 1 and --bursts at least 2 (the first meets a cold pool)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="burst-") as scratch:
        server = start_triton(args.repository, Path(scratch), args.model_dir, exit_timeout_s=10)
        try:
            bursts, floor = asyncio.run(run(args, server))
        finally:
            server.stop(grace_s=5)
    out = {
        "workload": args.workload,
        "entry_point": args.model,
        "clients": args.clients,
        "bursts_sent": args.bursts,
        "admission_margin": pool_parameter(args.repository, "orchestrator", "admission.margin") or "0",
        "bursts": bursts,
        "pooled": pooled(bursts),
        "floor_bursts": floor,
        "floor": pooled(floor, skip_first=False),
        "machine": machine(),
        "command": "python -m perf.burst " + " ".join(argv if argv is not None else sys.argv[1:]),
    }
    write_results(args.out_dir, args.name, out, markdown(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
