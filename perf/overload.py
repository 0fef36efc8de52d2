"""RELIABILITY E1 measured: arrivals far above the goodput, and what admission by capacity does.

One run against a fresh Triton on a copy of the project's repository whose orchestrators refuse a
request when its predicted TTFT exceeds `--admission-margin` x the TTFT SLO (`admission.margin`), the
SLO being the workload's frozen one; or, with `--as-deployed`, on the repository as it is (its own
margin and SLO: the default deployment, as `make serve` starts it). The load, to `--model` for
`--duration` seconds: an open-loop Poisson load of one workload at `--rate` (10x the measured
goodput), or `--clients N` clients sending its requests back to back (each its next one as soon as
the last ended; after a refusal, once the server's retry hint has passed). Reported: how fast refusals
come back (p50/p99 from send to the error), the admitted requests' TTFT and TPOT p99 against the
frozen SLOs (`perf/slos.json`), their goodput, the server's resident memory (its process group) every
second, and whether the pools' gauges and the open pool calls came back to their baseline afterwards.

    .venv/bin/python -m perf.overload --model-dir .models/tiny --rate 37 --duration 60
    .venv/bin/python -m perf.overload --model-dir .models/smollm2-135m-instruct --as-deployed \
        --clients 64 --duration 45

Writes `<out-dir>/overload.json` and `.md`.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import itertools
import json
import re
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from disagg.serving.telemetry import SloConfig
from perf.benchlib.arrivals import count_for
from perf.benchlib.clients import ClientConfig, make_client
from perf.benchlib.cliutil import add_run_args, log, machine, write_json
from perf.benchlib.deploy import pool_parameter, start_triton, with_orchestrator_parameters
from perf.benchlib.gauges import IDLE_GAUGES, scrape, settle
from perf.benchlib.loadgen import LoadConfig, run_clients, run_trace
from perf.benchlib.metrics import RequestRecord, Slo, percentile
from perf.benchlib.modelstats import delta, model_stats, table
from perf.benchlib.sampler import Sampler
from perf.benchlib.slo import SLO_FILE, load_frozen
from perf.benchlib.workload import WORKLOADS, PromptFactory, RequestSpec, build_trace, new_salt

REPO_ROOT = Path(__file__).resolve().parents[1]
RSS_EVERY_S = 1.0


class MemoryWatch(Sampler):
    """Samples the resident memory of the server's process group every second until stopped."""

    def __init__(self, pgid: int) -> None:
        super().__init__(RSS_EVERY_S)
        self.pgid = pgid
        self.samples: list[tuple[float, int]] = []  # (perf_counter, bytes)

    def sample(self) -> None:
        from disagg.server import process_group_members

        total = 0
        for pid in process_group_members(self.pgid):
            try:
                status = Path(f"/proc/{pid}/status").read_text()
            except OSError:
                continue
            for line in status.splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
        self.samples.append((time.perf_counter(), total))


# A process of its own that sleeps 5 ms at a time and writes down every wake-up late by over 20 ms:
# the scheduling stalls during the run, which bound any latency measured on it. Seen on this 2-vCPU
# VM: 100-900 ms with 40 % of the CPU idle, all of it run-queue wait, while the server ran in a
# session (a scheduler autogroup) of its own; none since it runs in the caller's
# (docs/degradation.md, "Measuring on one machine"). Started beside the load, not in the client's
# process (its GIL would stall it).
STALL_PROBE = """
import json, sys, time
late, end = [], time.monotonic() + float(sys.argv[1])
while time.monotonic() < end:
    t = time.monotonic()
    time.sleep(0.005)
    if (d := time.monotonic() - t - 0.005) > 0.02:
        late.append(d)
print(json.dumps(late))
"""


async def stall_probe(duration_s: float) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        sys.executable, "-c", STALL_PROBE, str(duration_s), stdout=asyncio.subprocess.PIPE
    )


def stall_summary(raw: bytes) -> dict[str, Any]:
    late = json.loads(raw or b"[]")
    return {
        "stalls_over_50ms": sum(1 for d in late if d > 0.05),
        "stall_max_ms": max(late) * 1000 if late else 0.0,
    }


OPENING_S = 1.0  # the clients' first requests all go out together: the refusals sent this early
CLIENT_SIDE = ("timeout", "not sent", "client crashed")  # errors of the load generator, not the server's


def refused(record: RequestRecord) -> bool:
    """Turned away by the server before any token (admission, a full queue, a shed rung): an error
    the server sent with no piece before it. Through `ensemble` Triton 2.51 drops the code from the
    message, so the code is not what tells."""
    error = record.error
    return error is not None and record.first_token is None and not error.startswith(CLIENT_SIDE)


def refusal_kind(error: str) -> str:
    """A refusal's message with its figures taken out, so refusals group by their cause."""
    return re.sub(r"\d+(\.\d+)?", "N", error)[:140]


def refusal_kinds(refusals: list[RequestRecord]) -> dict[str, dict[str, Any]]:
    """Each cause of refusal: how many, and how long they waited for it (p50 / p99, ms)."""
    waits: dict[str, list[float]] = {}
    for record in refusals:
        if record.ended is not None and record.sent is not None:
            waits.setdefault(refusal_kind(record.error or ""), []).append(record.ended - record.sent)
    kinds = sorted(waits.items(), key=lambda item: -len(item[1]))[:6]
    return {
        kind: {"count": len(w), "ms_p50": percentile(w, 50) * 1000, "ms_p99": percentile(w, 99) * 1000}
        for kind, w in kinds
    }


def summary(records: list[RequestRecord], slo: Slo, duration_s: float) -> dict[str, Any]:
    admitted = [r for r in records if r.ok]
    refusals = [r for r in records if refused(r)]
    others = [r for r in records if not r.ok and not refused(r)]
    timed = [r for r in refusals if r.ended is not None and r.sent is not None]
    waits = [r.ended - r.sent for r in timed]
    # the opening burst (every client at once) queues in the text steps one request after another;
    # the refusals after it are what a client meets once the load is under way
    later = [r.ended - r.sent for r in timed if r.sent >= OPENING_S]
    ttfts = [r.ttft for r in admitted if r.ttft is not None]
    tpots = [r.tpot for r in admitted if r.tpot is not None]
    good = [r for r in admitted if r.meets(slo)]

    def ms(value: float | None) -> float | None:
        return None if value is None else value * 1000

    return {
        "requests": len(records),
        "admitted": len(admitted),
        "refused": len(refusals),
        "failed_otherwise": len(others),
        "other_errors": dict(Counter((r.error or "")[:120] for r in others).most_common(5)),
        "refusal_ms_p50": ms(percentile(waits, 50)),
        "refusal_ms_p99": ms(percentile(waits, 99)),
        "refused_after_opening": len(later),
        "refusal_after_opening_ms_p50": ms(percentile(later, 50)),
        "refusal_after_opening_ms_p99": ms(percentile(later, 99)),
        "refusal_kinds": refusal_kinds(refusals),
        "admitted_ttft_ms_p50": ms(percentile(ttfts, 50)),
        "admitted_ttft_ms_p90": ms(percentile(ttfts, 90)),
        "admitted_ttft_ms_p99": ms(percentile(ttfts, 99)),
        "admitted_tpot_ms_p99": ms(percentile(tpots, 99)),
        "admitted_attainment": len(good) / len(admitted) if admitted else None,
        "served_rps": len(admitted) / duration_s,
        "goodput_rps": len(good) / duration_s,
    }


def endless(workload: Any, factory: PromptFactory, seed: int) -> Iterator[RequestSpec]:
    """The workload's requests one after another, each prompt unique (a new salt every 256)."""
    for batch in itertools.count():
        yield from build_trace(workload, factory, 1.0, 256, seed + batch, new_salt())


async def run(args: argparse.Namespace, server: Any, slo: Slo) -> dict[str, Any]:
    workload = WORKLOADS[args.workload]
    factory = PromptFactory.from_model_dir(args.model_dir)
    trace: list[RequestSpec] = []
    if args.clients is None:
        count = count_for(args.rate, args.duration, max_requests=100000)
        trace = [
            s
            for s in build_trace(workload, factory, args.rate, count, args.seed, new_salt())
            if s.arrival < args.duration
        ]
    client = make_client(ClientConfig(kind="triton", url=server.config.grpc_url, model=args.model))
    await client.open()
    # one request first, not counted: the client's channel and lazy set-up (seen: its loop stalled
    # 0.6 s on the first responses, which showed as 120 ms refusals) happen before the clock starts
    warm = build_trace(workload, factory, 1.0, 1, args.seed + 1, new_salt())
    await run_trace(client, warm, LoadConfig(max_duration_s=60), factory.count_output)
    settle(server.config.metrics_url, dict.fromkeys(IDLE_GAUGES, 0.0), timeout_s=30)  # idle again
    baseline = scrape(server.config.metrics_url)
    stats_before = model_stats(server.config.http_url)
    memory = MemoryWatch(server.pid).start()  # the server leads its own process group
    stalls = await stall_probe(args.duration)
    started = time.perf_counter()
    try:
        bounds = LoadConfig(max_duration_s=args.duration)
        if args.clients is None:
            records = await run_trace(client, trace, bounds, factory.count_output)
        else:
            specs = endless(workload, factory, args.seed)
            records = await run_clients(client, specs, args.clients, bounds, factory.count_output)
    finally:
        memory.stop()
        probed, _ = await stalls.communicate()
        await client.close()
    # where the time went inside Triton (every request of the run, refused and served together)
    models = delta(stats_before, model_stats(server.config.http_url))
    if args.records is not None:  # every request, one JSON object a line, for a closer look
        with args.records.open("w") as f:
            for record in records:
                f.write(json.dumps(dataclasses.asdict(record)) + "\n")
    settle_s, leftover = settle(server.config.metrics_url, baseline, timeout_s=60)
    rss = [(t - started, b) for t, b in memory.samples]
    under_load = [b for t, b in rss if t <= args.duration]
    third = max(1, len(under_load) // 3)
    return {
        "workload": args.workload,
        "entry_point": args.model,
        "rate_rps": args.rate,
        "clients": args.clients,
        "as_deployed": args.as_deployed,
        "duration_s": args.duration,
        "admission_margin": args.admission_margin,
        "slo": {"ttft_s": slo.ttft_s, "tpot_s": slo.tpot_s},
        **summary(records, slo, args.duration),
        # memory flat: the last third of the run against the first third (after start-up)
        "rss_mb_first_third": sum(under_load[:third]) / third / 2**20 if under_load else None,
        "rss_mb_last_third": sum(under_load[-third:]) / third / 2**20 if under_load else None,
        "rss_mb_max": max(under_load) / 2**20 if under_load else None,
        **stall_summary(probed),
        "settle_s": settle_s,
        "leftover": leftover,
        "models": models,
        "machine": machine(),
    }


def markdown(out: dict[str, Any], command: str) -> str:
    slo = out["slo"]

    def f(value: float | None, spec: str = ".0f") -> str:
        return "–" if value is None else format(value, spec)

    ttft_bound = 2 * slo["ttft_s"] * 1000
    refusal = f"{f(out['refusal_ms_p50'], '.1f')} / {f(out['refusal_ms_p99'], '.1f')}"
    later = (
        f"{f(out.get('refusal_after_opening_ms_p50'), '.1f')} / "
        f"{f(out.get('refusal_after_opening_ms_p99'), '.1f')} ({out.get('refused_after_opening', '–')})"
    )
    ttft = " / ".join(f(out[f"admitted_ttft_ms_p{q}"]) for q in (50, 90, 99))
    rss = " / ".join(f(out[k]) for k in ("rss_mb_first_third", "rss_mb_last_third", "rss_mb_max"))
    settled = "never" if out["settle_s"] is None else f"{out['settle_s']:.1f}"
    rows = [
        ("requests sent", out["requests"]),
        ("admitted (served)", out["admitted"]),
        ("refused (UNAVAILABLE, no token)", out["refused"]),
        ("failed otherwise", out["failed_otherwise"]),
        ("refusal latency p50 / p99, ms (target p99 < 50)", refusal),
        (f"the same, of the refusals sent after the first {OPENING_S:g} s (how many)", later),
        (f"admitted TTFT p50 / p90 / p99, ms (target p99 <= {ttft_bound:.0f})", ttft),
        ("admitted TPOT p99, ms", f(out["admitted_tpot_ms_p99"], ".1f")),
        ("admitted attainment of both SLOs", f(out["admitted_attainment"], ".2f")),
        ("served, req/s", f(out["served_rps"], ".2f")),
        ("goodput (both frozen SLOs met), req/s", f(out["goodput_rps"], ".2f")),
        ("server RSS, first / last third of the run / max, MB", rss),
        ("seconds until the pools' gauges were back", settled),
        (
            "machine stalls: wake-ups of an idle probe process late by > 50 ms / the latest, ms",
            f"{out.get('stalls_over_50ms', '–')} / {f(out.get('stall_max_ms'))}",
        ),
        ("left behind", ", ".join(f"{k}={v:g}" for k, v in out["leftover"].items()) or "nothing"),
    ]
    if out.get("clients"):
        load = (
            f"{out['workload']} from {out['clients']} clients back to back (after a refusal, its retry "
            f"hint first) for {out['duration_s']:g} s"
        )
    else:
        load = f"{out['workload']} at {out['rate_rps']:g} req/s (Poisson) for {out['duration_s']:g} s"
    slos = f"{slo['ttft_s'] * 1000:.0f} ms TTFT / {slo['tpot_s'] * 1000:.1f} ms TPOT (frozen)"
    deployed = "as deployed, " if out.get("as_deployed") else ""
    lines = [
        "# Overload and admission by capacity (RELIABILITY E1)",
        "",
        f"Written by `perf/overload.py`: `{command}`. {load} to `{out['entry_point']}`, {deployed}"
        f"`admission.margin` {out['admission_margin']:g} (x the entry point's TTFT SLO, "
        f"{out['admission_slo_ttft_s']:g} s); goodput judged by the frozen SLOs {slos}. {out['machine']}.",
        "",
        "| | |",
        "|---|---:|",
        *(f"| {name} | {value} |" for name, value in rows),
        "",
    ]
    if out.get("refusal_kinds"):
        lines += ["Refusals by cause (figures replaced by N):", ""]
        lines += ["| cause | count | wait p50 / p99, ms |", "|---|---:|---:|"]
        for kind, k in out["refusal_kinds"].items():
            lines.append(f"| `{kind}` | {k['count']} | {k['ms_p50']:.1f} / {k['ms_p99']:.1f} |")
        lines.append("")
    if out.get("models"):
        lines += ["Inside Triton, per model over the run (Triton's model statistics):", ""]
        lines += [*table(out["models"]), ""]
    for error, count in out["other_errors"].items():
        lines.append(f"- {count} x `{error}`")
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_run_args(parser, rate_help="requests/s: 10x the measured goodput", rate_required=False)
    parser.add_argument(
        "--clients", type=int, default=None, help="closed loop: this many clients back to back (no --rate)"
    )
    parser.add_argument(
        "--as-deployed",
        action="store_true",
        help="serve --repository as it is (its admission margin and SLO), not with --admission-margin",
    )
    parser.add_argument("--name", default="", help="the results' file name (default: from the mode)")
    parser.add_argument("--duration", type=float, default=60.0)
    parser.add_argument("--model", default="ensemble", help="the entry point the load goes to")
    parser.add_argument("--admission-margin", type=float, default=1.0, help="x the TTFT SLO; 0 turns it off")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--records", type=Path, help="write every request's record here (JSON lines)")
    parser.add_argument("--keep-log", type=Path, help="copy the server's log here after the run")
    parser.add_argument("--out-dir", type=Path, default=REPO_ROOT / "perf" / "results" / "overload")
    args = parser.parse_args(argv)
    if (args.rate is None) == (args.clients is None):
        parser.error("give --rate (open loop) or --clients (closed loop)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    frozen = load_frozen(SLO_FILE, args.model_dir.name).get(args.workload)
    if frozen is None:
        log(f"no frozen SLO for {args.model_dir.name}/{args.workload} in {SLO_FILE}: make bench-slos first")
        return 2
    slo = frozen.slo
    if args.as_deployed:  # what the entry points of the repository were deployed with
        args.admission_margin = float(
            pool_parameter(args.repository, "orchestrator", "admission.margin") or 0
        )
        deployed_slo = pool_parameter(args.repository, "orchestrator", "slo.ttft_s")
        admission_slo = float(deployed_slo) if deployed_slo else SloConfig.ttft_s
    else:
        admission_slo = slo.ttft_s
    with tempfile.TemporaryDirectory(prefix="overload-") as scratch:
        repository = args.repository
        if not args.as_deployed:
            params = {"admission.margin": f"{args.admission_margin:g}", "slo.ttft_s": f"{slo.ttft_s:g}"}
            repository = with_orchestrator_parameters(args.repository, Path(scratch), params)
        server = start_triton(repository, Path(scratch), args.model_dir, exit_timeout_s=10)
        try:
            out = {**asyncio.run(run(args, server, slo)), "admission_slo_ttft_s": admission_slo}
        finally:
            server.stop(grace_s=5)
            if args.keep_log is not None:  # the server's log, for what the pools' states did
                args.keep_log.write_bytes((Path(scratch) / "tritonserver.log").read_bytes())
    name = args.name or ("overload" if args.admission_margin else "overload_no_admission")
    write_json(args.out_dir / f"{name}.json", out)
    command = "python -m perf.overload " + " ".join(argv if argv is not None else sys.argv[1:])
    report = markdown(out, command)
    (args.out_dir / f"{name}.md").write_text(report)
    log(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
