"""Conditional disaggregation measured: the same mixed trace with the rule off and on, side by side.

The trace is the interference experiment's mix: short requests (10-token prompts, 64 output tokens,
judged by the frozen `decode` SLOs) and long ones (300-token prompts, judged by the frozen `codegen`
SLOs), half each, open-loop Poisson at `--rate`, sent to `ensemble`. The long prompts keep the prefill
pool backlogged. Each variant runs on a fresh Triton on a repository written by `disagg repository`:
`off` is the default one, `on` adds `--conditional-prefill-tokens N` (prompts of at most N tokens go
whole to the decode pool while the prefill pool's predicted TTFT for them exceeds 0.25 s). Reported
per variant and kind: TTFT / TPOT p50 and p99, the attainment of the kind's SLOs and the goodput, and
the share of requests the rule sent to the decode pool (`disagg_fallbacks_total{to="conditional"}`).

    .venv/bin/python -m perf.conditional --model-dir .models/tiny --rate 6 --duration 60

Writes `<out-dir>/conditional.json` and `.md`.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import urllib.request
from pathlib import Path
from typing import Any

from perf.benchlib.arrivals import count_for
from perf.benchlib.clients import ClientConfig, make_client
from perf.benchlib.cliutil import log, machine, write_json
from perf.benchlib.deploy import start_triton
from perf.benchlib.loadgen import LoadConfig, run_trace
from perf.benchlib.metrics import RequestRecord, Slo, percentile
from perf.benchlib.slo import SLO_FILE, load_frozen
from perf.benchlib.workload import WORKLOADS, PromptFactory, build_trace, new_salt

REPO_ROOT = Path(__file__).resolve().parents[1]
KIND_SLO = {"short": "decode", "long": "codegen"}  # each kind is judged by the SLOs of its own shape
VARIANTS = ("off", "on")


def conditional_routes(metrics_url: str) -> float:
    """Requests the rule sent to the decode pool so far, over every entry point."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(metrics_url, timeout=10) as reply:
        text = reply.read().decode()
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "disagg_fallbacks_total" and sample.labels.get("to") == "conditional"
    )


def kind_summary(records: list[RequestRecord], slo: Slo, duration_s: float) -> dict[str, Any]:
    ok = [r for r in records if r.ok]
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    tpots = [r.tpot for r in ok if r.tpot is not None]

    def ms(value: float | None) -> float | None:
        return None if value is None else value * 1000

    good = sum(1 for r in ok if r.meets(slo))
    return {
        "requests": len(records),
        "failed": len(records) - len(ok),
        "ttft_ms_p50": ms(percentile(ttfts, 50)),
        "ttft_ms_p99": ms(percentile(ttfts, 99)),
        "tpot_ms_p50": ms(percentile(tpots, 50)),
        "tpot_ms_p99": ms(percentile(tpots, 99)),
        "attainment": good / len(records) if records else None,
        "goodput_rps": good / duration_s,
    }


def repository(scratch: Path, variant: str, threshold: int) -> Path:
    from disagg_tools.repository import main as write_repository

    out = scratch / f"repository-{variant}"
    extra = ["--conditional-prefill-tokens", str(threshold)] if variant == "on" else []
    if write_repository(["--out", str(out), *extra]) != 0:
        raise RuntimeError(f"disagg repository failed for the {variant} variant")
    return out


async def measure(args: argparse.Namespace, server: Any, seed: int) -> tuple[list[RequestRecord], float]:
    """One variant's run of the trace of ``seed``: its records, and how many the rule routed."""
    factory = PromptFactory.from_model_dir(args.model_dir)
    count = count_for(args.rate, args.duration, max_requests=100000)
    trace = build_trace(WORKLOADS["decode"], factory, args.rate, count, seed, new_salt(), long_share=0.5)
    trace = [s for s in trace if s.arrival < args.duration]
    client = make_client(ClientConfig(kind="triton", url=server.config.grpc_url, model="ensemble"))
    await client.open()
    try:
        before = conditional_routes(server.config.metrics_url)
        records = await run_trace(
            client, trace, LoadConfig(max_duration_s=args.duration), factory.count_output
        )
        routed = conditional_routes(server.config.metrics_url) - before
    finally:
        await client.close()
    return records, routed


def variant_summary(
    records: list[RequestRecord], routed: float, slos: dict[str, Slo], duration_s: float
) -> dict[str, Any]:
    kinds = {
        kind: kind_summary([r for r in records if r.kind == kind], slos[kind], duration_s)
        for kind in KIND_SLO
    }
    good = sum(k["goodput_rps"] for k in kinds.values())
    share = routed / len(records) if records else 0.0
    return {"requests": len(records), "conditional_share": share, "goodput_rps": good, **kinds}


def markdown(out: dict[str, Any], command: str) -> str:
    def f(value: float | None, spec: str = ".0f") -> str:
        return "–" if value is None else format(value, spec)

    slos = out["slo"]

    def ms(seconds: float, spec: str = ".0f") -> str:
        return f"{seconds * 1000:{spec}} ms"

    lines = [
        "# Conditional disaggregation, off and on, one mixed trace",
        "",
        f"Written by `perf/conditional.py`: `{command}`. Half short requests (10-token prompts, "
        f"64 tokens out; SLOs {ms(slos['short']['ttft_s'])} / {ms(slos['short']['tpot_s'], '.1f')}), "
        f"half long (300-token prompts; SLOs {ms(slos['long']['ttft_s'])} / "
        f"{ms(slos['long']['tpot_s'], '.1f')}), Poisson at {out['rate_rps']:g} req/s to `ensemble`, "
        f"{out['duration_s']:g} s per run, {out['rounds']} runs of each variant interleaved (the same "
        f"traces for both); `on`: prompts of at most {out['threshold']} tokens go to the decode pool "
        f"while prefill is backlogged. {out['machine']}.",
        "",
        "| variant | kind | requests | failed | TTFT p50 / p99, ms | TPOT p50 / p99, ms | attainment "
        "| goodput, req/s |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for variant in VARIANTS:
        v = out[variant]
        for kind in KIND_SLO:
            k = v[kind]
            lines.append(
                f"| {variant} | {kind} | {k['requests']} | {k['failed']} | "
                f"{f(k['ttft_ms_p50'])} / {f(k['ttft_ms_p99'])} | "
                f"{f(k['tpot_ms_p50'], '.1f')} / {f(k['tpot_ms_p99'], '.1f')} | "
                f"{f(k['attainment'], '.2f')} | {f(k['goodput_rps'], '.2f')} |"
            )
    lines += [""]
    for variant in VARIANTS:
        v = out[variant]
        lines.append(
            f"- `{variant}`: goodput {v['goodput_rps']:.2f} req/s; "
            f"{v['conditional_share']:.0%} of requests prefilled on the decode pool"
        )
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model-dir", type=Path, default=REPO_ROOT / ".models" / "tiny")
    parser.add_argument("--rate", type=float, required=True, help="requests/s, both kinds together")
    parser.add_argument("--duration", type=float, default=60.0)
    parser.add_argument("--threshold", type=int, default=64, help="--conditional-prefill-tokens of `on`")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=2, help="runs of each variant, interleaved")
    parser.add_argument("--out-dir", type=Path, default=REPO_ROOT / "perf" / "results" / "conditional")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    frozen = load_frozen(SLO_FILE, args.model_dir.name)
    missing = [w for w in KIND_SLO.values() if w not in frozen]
    if missing:
        log(f"no frozen SLO for {args.model_dir.name}/{', '.join(missing)} in {SLO_FILE}: make bench-slos")
        return 2
    slos = {kind: frozen[workload].slo for kind, workload in KIND_SLO.items()}
    out: dict[str, Any] = {
        "rate_rps": args.rate,
        "duration_s": args.duration,
        "threshold": args.threshold,
        "rounds": args.rounds,
        "slo": {kind: {"ttft_s": s.ttft_s, "tpot_s": s.tpot_s} for kind, s in slos.items()},
        "machine": machine(),
    }
    runs: dict[str, tuple[list[RequestRecord], float]] = {v: ([], 0.0) for v in VARIANTS}
    with tempfile.TemporaryDirectory(prefix="conditional-") as scratch:
        repos = {variant: repository(Path(scratch), variant, args.threshold) for variant in VARIANTS}
        for round_ in range(args.rounds):  # interleaved, so the machine's drift hits both alike
            for variant in VARIANTS if round_ % 2 == 0 else VARIANTS[::-1]:
                workdir = Path(scratch) / f"{variant}-{round_}"
                server = start_triton(repos[variant], workdir, args.model_dir, exit_timeout_s=10)
                try:
                    records, routed = asyncio.run(measure(args, server, args.seed + round_))
                finally:
                    server.stop(grace_s=5)
                kept, total = runs[variant]
                runs[variant] = (kept + records, total + routed)
                log(f"round {round_ + 1}, {variant}: {len(records)} requests, {routed:g} routed")
    for variant, (records, routed) in runs.items():
        out[variant] = variant_summary(records, routed, slos, args.duration * args.rounds)
    write_json(args.out_dir / "conditional.json", out)
    command = "python -m perf.conditional " + " ".join(argv if argv is not None else sys.argv[1:])
    report = markdown(out, command)
    (args.out_dir / "conditional.md").write_text(report)
    log(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
