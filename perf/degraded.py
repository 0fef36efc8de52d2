"""RELIABILITY D1/D2 measured: a pool's stub killed under a steady load, and what the clients got.

One run against a fresh Triton on the project's repository: an open-loop Poisson load of one workload
(`codegen` by default) at `--rate`, sent to `ensemble`; after `--kill-after` seconds the `--kill` pool's
stub gets `kill -9`, and again every `--kill-every` seconds (`--kills` in all; the watcher of an entry
point restarts the pool through model control in between). One outage holds some 30 requests, too few
for a stable figure on its own: the run pools several. A scrape of `/metrics` every 0.5 s records when
an entry point first sees the pool gone and when every one sees it healthy again. The report splits the
run by arrival into three phases: before the first kill (normal), from each kill to the pool healthy
again (degraded) and the rest (recovered); per phase it gives the served rate, the attainment of the
frozen SLOs (`perf/slos.json`) and the goodput (requests per second meeting both), and per kill its
times and its own ratio. The degraded goodput over the normal one is the article's "keeps more than
60 % of normal traffic".

    .venv/bin/python -m perf.degraded --model-dir .models/tiny --rate 1.6 --kill decode

Writes `<out-dir>/degraded_<pool>.json` and `.md`.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import re
import signal
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

from disagg.procfs import stub_pids
from perf.benchlib.arrivals import count_for
from perf.benchlib.clients import ClientConfig, make_client
from perf.benchlib.cliutil import add_run_args, log, machine, write_json
from perf.benchlib.deploy import start_triton, with_orchestrator_parameters
from perf.benchlib.loadgen import LoadConfig, run_trace
from perf.benchlib.metrics import RequestRecord, Slo, percentile
from perf.benchlib.sampler import Sampler
from perf.benchlib.slo import SLO_FILE, load_frozen
from perf.benchlib.workload import WORKLOADS, PromptFactory, build_trace, new_salt

REPO_ROOT = Path(__file__).resolve().parents[1]
WINDOW_S = 10.0
SCRAPE_S = 0.5


def pool_health(metrics_url: str, pool: str) -> list[float]:
    """Every entry point instance's `disagg_pool_health` of `pool` (0 healthy, 1 saturated, 2 gone);
    `metrics_url` is the full URL of `/metrics`."""
    import urllib.request

    with urllib.request.urlopen(metrics_url, timeout=5) as reply:
        text = reply.read().decode()
    pattern = re.compile(rf'^disagg_pool_health\{{[^}}]*pool="{re.escape(pool)}"[^}}]*\}} (\S+)$', re.M)
    return [float(v) for v in pattern.findall(text)]


class HealthWatch(Sampler):
    """Scrapes the pool's health until stopped. ``outages``: per outage, [when an entry point first saw
    the pool gone, when every view said healthy again (None: not yet)] (seconds on
    `time.perf_counter()`)."""

    def __init__(self, metrics_url: str, pool: str) -> None:
        super().__init__(SCRAPE_S)
        self.url, self.pool = metrics_url, pool
        self.outages: list[list[float | None]] = []

    def sample(self) -> None:
        try:
            views = pool_health(self.url, self.pool)
        except OSError:
            return
        now = time.perf_counter()
        open_ = bool(self.outages) and self.outages[-1][1] is None
        if views and max(views) >= 2 and not open_:
            self.outages.append([now, None])
        elif open_ and views and not any(views):
            self.outages[-1][1] = now


def phase_of(arrival: float, outages: list[tuple[float, float | None]]) -> str:
    """``outages``: (kill, healthy again or None) per kill, in order, on the arrivals' clock."""
    if not outages or arrival < outages[0][0]:
        return "normal"
    for kill_at, back_at in outages:
        if kill_at <= arrival and (back_at is None or arrival < back_at):
            return "degraded"
    return "recovered"


def outage_spans(
    kills: list[float], seen: list[tuple[float, float | None]], duration: float
) -> tuple[list[tuple[float, float | None, float | None]], list[tuple[float, float]]]:
    """Per kill, (kill, gone seen, healthy again): the first outage ``seen`` after it and before the
    next kill; and (kill, end of its outage): healthy again, else the next kill (or ``duration``), so
    outages never overlap and the degraded span counts each second once."""
    outages, spans = [], []
    for n, kill_at in enumerate(kills):
        until = kills[n + 1] if n + 1 < len(kills) else math.inf
        gone_at, back_at = next(((g, b) for g, b in seen if kill_at <= g < until), (None, None))
        outages.append((kill_at, gone_at, back_at))
        spans.append((kill_at, back_at if back_at is not None else min(until, duration)))
    return outages, spans


def figures(records: list[RequestRecord], slo: Slo, span_s: float) -> dict[str, Any]:
    """Served rate, attainment and goodput of the requests that arrived in a span of `span_s`."""
    good = [r for r in records if r.ok and r.ttft is not None and r.meets(slo)]
    served = [r for r in records if r.ok]
    errors = Counter((r.error or "no answer")[:120] for r in records if not r.ok)
    ttfts = [r.ttft for r in served if r.ttft is not None]
    tpots = [r.tpot for r in served if r.tpot is not None]
    return {
        # which target the misses missed: the answer to what limits the degraded goodput
        "ttft_met": sum(t <= slo.ttft_s for t in ttfts) / len(served) if served else None,
        "tpot_met": sum(t <= slo.tpot_s for t in tpots) / len(tpots) if tpots else None,
        "ttft_p50_s": percentile(ttfts, 50),
        "ttft_p90_s": percentile(ttfts, 90),
        "tpot_p50_s": percentile(tpots, 50),
        "tpot_p90_s": percentile(tpots, 90),
        "errors": dict(errors.most_common(5)),
        "requests": len(records),
        "served": len(served),
        "failed": len(records) - len(served),
        "served_rps": len(served) / span_s if span_s > 0 else 0.0,
        "attainment": len(good) / len(records) if records else None,
        "goodput_rps": len(good) / span_s if span_s > 0 else 0.0,
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_run_args(parser, rate_help="requests/s: 80 %% of the normal goodput")
    parser.add_argument("--kill", default="decode", choices=("decode", "prefill"))
    parser.add_argument("--kill-after", type=float, default=40.0, help="seconds of normal load first")
    parser.add_argument(
        "--kills", type=int, default=3, help="kills in one run (a 10 s outage holds ~30 requests: pool a few)"
    )
    parser.add_argument("--kill-every", type=float, default=40.0, help="seconds from one kill to the next")
    parser.add_argument(
        "--duration",
        type=float,
        default=None,
        help="seconds of arrivals in all (default: 40 s after the last kill)",
    )
    parser.add_argument("--model", default="ensemble", help="the entry point the load goes to")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--no-recovery",
        action="store_true",
        help="serve a copy of the repository whose entry points never restart pools (steady degraded mode)",
    )
    parser.add_argument("--out-dir", type=Path, default=REPO_ROOT / "perf" / "results" / "degraded")
    args = parser.parse_args(argv)
    if args.kills < 1:
        parser.error("--kills must be at least 1")
    if args.duration is None:
        args.duration = args.kill_after + (args.kills - 1) * args.kill_every + 40.0
    return args


async def run(args: argparse.Namespace, server: Any, slo: Slo) -> dict[str, Any]:
    workload = WORKLOADS[args.workload]
    factory = PromptFactory.from_model_dir(args.model_dir)
    count = count_for(args.rate, args.duration, max_requests=100000)
    trace = build_trace(workload, factory, args.rate, count, args.seed, new_salt())
    trace = [spec for spec in trace if spec.arrival < args.duration]  # the run's arrivals only
    client = make_client(ClientConfig(kind="triton", url=server.config.grpc_url, model=args.model))
    await client.open()
    watch = HealthWatch(server.config.metrics_url, args.kill).start()
    started = time.perf_counter()
    load = asyncio.create_task(
        run_trace(client, trace, LoadConfig(max_duration_s=args.duration), factory.count_output)
    )
    kills: list[float] = []
    for n in range(args.kills):
        await asyncio.sleep(max(0.0, started + args.kill_after + n * args.kill_every - time.perf_counter()))
        victims = stub_pids(server.pid, args.kill)
        if len(victims) != 1:  # not restarted since the last kill
            log(f"kill {n + 1}: {len(victims)} {args.kill} stubs running; none killed")
            continue
        os.kill(victims[0], signal.SIGKILL)
        kills.append(time.perf_counter() - started)
        log(f"killed the {args.kill} stub (pid {victims[0]}) at {kills[-1]:.1f} s")
    records = await load
    watch.stop()
    await client.close()
    seen = [(gone - started, None if back is None else back - started) for gone, back in watch.outages]
    outages, spans = outage_spans(kills, seen, args.duration)
    phases: dict[str, list[RequestRecord]] = {"normal": [], "degraded": [], "recovered": []}
    for record in records:
        phases[phase_of(record.arrival, spans)].append(record)
    degraded_s = sum(end - kill for kill, end in spans)
    first = spans[0][0] if spans else args.duration
    span_of = {"normal": first, "degraded": degraded_s, "recovered": args.duration - first - degraded_s}
    windows = []
    for start in range(0, int(args.duration), int(WINDOW_S)):
        inside = [r for r in records if start <= r.arrival < start + WINDOW_S]
        middle = start + WINDOW_S / 2  # a window is labelled by the phase of most of it
        windows.append({"start_s": start, "phase": phase_of(middle, spans), **figures(inside, slo, WINDOW_S)})
    result = {
        phase: figures(phases[phase], slo, span_of[phase]) | {"span_s": span_of[phase]} for phase in phases
    }
    normal, degraded = result["normal"]["goodput_rps"], result["degraded"]["goodput_rps"]
    per_kill = []
    for (kill_at, gone_at, back_at), (_, end) in zip(outages, spans, strict=True):
        inside = [r for r in records if kill_at <= r.arrival < end]
        good = figures(inside, slo, end - kill_at)["goodput_rps"]
        per_kill.append(
            {
                "killed_at_s": kill_at,
                "gone_seen_at_s": gone_at,  # the first scrape with an entry point seeing the pool gone
                "healthy_again_at_s": back_at,
                "recovery_s": None if back_at is None else back_at - kill_at,
                "requests": len(inside),
                "degraded_over_normal_goodput": good / normal if normal else None,
            }
        )
    return {
        "kill": args.kill,
        "workload": args.workload,
        "entry_point": args.model,
        "rate_rps": args.rate,
        "slo": {"ttft_s": slo.ttft_s, "tpot_s": slo.tpot_s},
        "kills": per_kill,
        "phases": result,
        "degraded_over_normal_goodput": degraded / normal if normal else None,
        "windows": windows,
        # what each request of the degraded phase got (arrival from the start of the load, seconds)
        "degraded_requests": [
            {
                "arrival_s": r.arrival,
                "output_tokens": r.n_tokens,
                "ttft_s": r.ttft,
                "tpot_s": r.tpot,
                "error": r.error,
            }
            for r in phases["degraded"]
        ],
        "machine": machine(),
    }


def markdown(out: dict[str, Any], command: str) -> str:
    slo = out["slo"]
    lines = [
        f"# Degraded mode: the {out['kill']} stub killed under load",
        "",
        f"Written by `perf/degraded.py`: `{command}`. {out['workload']} at {out['rate_rps']:g} req/s "
        f"(Poisson) to `{out['entry_point']}`; SLOs {slo['ttft_s'] * 1000:.0f} ms TTFT / "
        f"{slo['tpot_s'] * 1000:.1f} ms TPOT (frozen, `perf/slos.json`). {out['machine']}.",
        "",
        "| kill | killed at, s | an entry point saw it gone, s | all saw it healthy again, s | recovery, s "
        "| requests while degraded | degraded / normal goodput |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]

    def at(value: float | None, digits: int = 1) -> str:
        return "never" if value is None else f"{value:.{digits}f}"

    for n, kill in enumerate(out["kills"], 1):
        lines.append(
            f"| {n} | {kill['killed_at_s']:.1f} | {at(kill['gone_seen_at_s'])} | "
            f"{at(kill['healthy_again_at_s'])} | {at(kill['recovery_s'])} | {kill['requests']} | "
            f"{at(kill['degraded_over_normal_goodput'], 2)} |"
        )
    lines += [
        "",
        "| phase | span, s | requests | served | failed | served, req/s | attainment | goodput, req/s "
        "| TTFT met | TPOT met | TTFT p50 / p90, ms | TPOT p50 / p90, ms |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]

    def share(value: float | None) -> str:
        return "–" if value is None else f"{value:.2f}"

    def ms(value: float | None, digits: int = 0) -> str:
        return "–" if value is None else f"{value * 1000:.{digits}f}"

    for phase, f in out["phases"].items():
        lines.append(
            f"| {phase} | {f['span_s']:.1f} | {f['requests']} | {f['served']} | {f['failed']} | "
            f"{f['served_rps']:.2f} | {share(f['attainment'])} | {f['goodput_rps']:.2f} | "
            f"{share(f.get('ttft_met'))} | {share(f.get('tpot_met'))} | "
            f"{ms(f.get('ttft_p50_s'))} / {ms(f.get('ttft_p90_s'))} | "
            f"{ms(f.get('tpot_p50_s'), 1)} / {ms(f.get('tpot_p90_s'), 1)} |"
        )
    for phase, f in out["phases"].items():
        for error, count in f["errors"].items():
            lines.append(f"- {phase}: {count} x `{error}`")
    ratio = out["degraded_over_normal_goodput"]
    lines += ["", f"Degraded goodput / normal goodput: **{'–' if ratio is None else f'{ratio:.2f}'}**.", ""]
    lines += [
        "| window (arrivals), s | phase | requests | served | goodput, req/s |",
        "|---|---|---:|---:|---:|",
    ]
    for w in out["windows"]:
        lines.append(
            f"| {w['start_s']}–{w['start_s'] + WINDOW_S:.0f} | {w['phase']} | {w['requests']} | "
            f"{w['served']} | {w['goodput_rps']:.2f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    frozen = load_frozen(SLO_FILE, args.model_dir.name).get(args.workload)
    if frozen is None:
        log(
            f"no frozen SLO for {args.model_dir.name}/{args.workload} in {SLO_FILE}: "
            "run make bench-slos first"
        )
        return 2
    with tempfile.TemporaryDirectory(prefix="degraded-") as scratch:
        repository = (
            with_orchestrator_parameters(args.repository, Path(scratch), {"health.recovery": "false"})
            if args.no_recovery
            else args.repository
        )
        server = start_triton(repository, Path(scratch), args.model_dir, exit_timeout_s=10)
        try:
            out = asyncio.run(run(args, server, frozen.slo))
        finally:
            server.stop(grace_s=5)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    name = f"degraded_{args.kill}" + ("_no_recovery" if args.no_recovery else "")
    write_json(args.out_dir / f"{name}.json", out)
    command = "python -m perf.degraded " + " ".join(argv if argv is not None else sys.argv[1:])
    (args.out_dir / f"{name}.md").write_text(markdown(out, command))
    log(markdown(out, command))
    return 0


if __name__ == "__main__":
    sys.exit(main())
