"""Experiments built from the pieces: one run at a rate, the goodput search, the interference pair.

Each takes an opened `StreamClient`, so the same code measures Triton deployments and the vLLM peer.
Every run gets a fresh random `salt`, so its prompts differ from every earlier run's (a server's prefix
cache lives across runs); the seed alone fixes arrivals and lengths, so runs stay comparable.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from perf.benchlib.arrivals import count_for
from perf.benchlib.clients import ClientConfig, StreamClient, make_client
from perf.benchlib.cliutil import log
from perf.benchlib.cpuprobe import CpuProbe
from perf.benchlib.loadgen import LoadConfig, run_trace
from perf.benchlib.metrics import RequestRecord, Slo, Summary, percentile, summarize
from perf.benchlib.search import BUDGET, Bracket, RateSearch, SearchConfig
from perf.benchlib.slo import calibrate
from perf.benchlib.workload import WORKLOADS, PromptFactory, Workload, build_trace, new_salt


@dataclass(frozen=True)
class RunPlan:
    """Size of each measured run: `duration_s` of arrivals at the run's rate, clamped to
    [min_requests, max_requests] requests; bounds of `LoadConfig` around it."""

    duration_s: float = 30.0
    min_requests: int = 20
    max_requests: int = 200
    drain_timeout_s: float = 60.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.duration_s <= 0 or self.drain_timeout_s <= 0:
            raise ValueError("duration_s and drain_timeout_s must be positive")
        if not 1 <= self.min_requests <= self.max_requests:
            raise ValueError("need 1 <= min_requests <= max_requests")

    def load_config(self, rate: float) -> LoadConfig:
        count = count_for(rate, self.duration_s, self.max_requests, self.min_requests)
        # Room for the clamped count's arrivals, with slack for the Poisson tail.
        return LoadConfig(max_duration_s=2 * count / rate + 1, drain_timeout_s=self.drain_timeout_s)


@dataclass(frozen=True)
class RateRun:
    rate: float
    summary: Summary
    records: list[RequestRecord]
    cpu: dict[str, dict[str, float]] | None = None
    """CPU seconds per process and core during the run (`benchlib.cpuprobe`), when probed."""

    def to_dict(self, with_records: bool = True) -> dict[str, Any]:
        out: dict[str, Any] = {"rate": self.rate, "summary": self.summary.to_dict()}
        if self.cpu is not None:
            out["cpu"] = self.cpu
        if with_records:
            out["records"] = [r.to_dict() for r in self.records]
        return out


async def run_rate(
    client: StreamClient,
    workload: Workload,
    factory: PromptFactory,
    rate: float,
    slo: Slo,
    plan: RunPlan,
) -> RateRun:
    """One open-loop run of `workload` at `rate` requests/s, judged against `slo`."""
    count = count_for(rate, plan.duration_s, plan.max_requests, plan.min_requests)
    trace = build_trace(workload, factory, rate, count, plan.seed, new_salt())
    records = await run_trace(client, trace, plan.load_config(rate), factory.count_output)
    return RateRun(rate, summarize(records, slo), records)


@dataclass(frozen=True)
class GoodputResult:
    workload: str
    best_rate: float
    cores: int
    runs: list[RateRun]
    bracket: Bracket | None = None
    """[highest rate that met, lowest above it that missed); None for a result without a search."""
    stop_reason: str = ""
    """Why the search stopped (`benchlib.search.STOP_REASONS`)."""

    @property
    def per_core(self) -> float:
        return self.best_rate / self.cores

    def to_dict(self, with_records: bool = False) -> dict[str, Any]:
        return {
            "workload": self.workload,
            "goodput_rps": self.best_rate,
            "cores": self.cores,
            "goodput_rps_per_core": self.per_core,
            **({"bracket": self.bracket.to_dict()} if self.bracket is not None else {}),
            **({"stop_reason": self.stop_reason} if self.stop_reason else {}),
            "probes": [r.to_dict(with_records) for r in self.runs],
        }


async def search_goodput(
    client: StreamClient,
    workload: Workload,
    factory: PromptFactory,
    slo: Slo,
    search: SearchConfig,
    plan: RunPlan,
    cores: int,
    log: Any = None,
    deadline: float | None = None,
) -> GoodputResult:
    """Highest arrival rate with attainment >= `search.target` (see `benchlib.search`). No new probe
    starts after `deadline` (a `time.monotonic()` value): the best rate so far is returned."""
    state = RateSearch(search)
    runs = []
    stopped = ""
    while (rate := state.next_rate()) is not None:
        if deadline is not None and time.monotonic() > deadline:
            if log is not None:
                log(f"  {workload.name}: time budget spent, search stopped after {len(runs)} probes")
            stopped = BUDGET
            break
        run = await run_rate(client, workload, factory, rate, slo, plan)
        state.record(rate, run.summary.attainment)
        runs.append(run)
        if log is not None:
            s = run.summary
            log(
                f"  {workload.name} rate {rate:.3f}/s: attainment {s.attainment:.2f} "
                f"(n={s.n_requests}, errors {s.n_errors}), TTFT p90 {_ms(s.ttft_p90)}, "
                f"TPOT p90 {_ms(s.tpot_p90)}, max send lag {_ms(s.max_send_lag_s)}"
            )
    reason = stopped or state.stop_reason or ""
    if log is not None:
        log(f"  {workload.name}: goodput {state.bracket.text()} req/s, stopped: {reason}")
    return GoodputResult(workload.name, state.best, cores, runs, state.bracket, reason)


async def calibrations(
    url: str, model: str, workloads: list[str], factory: PromptFactory, reps: int = 3
) -> dict[str, Any]:
    """SLOs by the project's rule from idle figures measured now on the Triton entry point `model` at
    `url` (`benchlib.slo.calibrate`, per workload): for a comparison that needs SLOs this machine can
    meet, where the frozen ones came from another machine. Each `Calibration` has the attributes
    `goodput_runs` reads of a frozen SLO."""
    client = make_client(ClientConfig(kind="triton", url=url, model=model))
    await client.open()
    try:
        return {w: await calibrate(client, WORKLOADS[w], factory, model, reps=reps) for w in workloads}
    finally:
        await client.close()


async def goodput_runs(
    url: str,
    model: str,
    workloads: list[str],
    factory: PromptFactory,
    frozen: dict[str, Any],
    args: Any,
    starts: dict[str, float] | None = None,
) -> dict[str, list[dict[str, Any]]]:
    """`args.runs` goodput searches per workload against the Triton entry point `model` at `url` (gRPC),
    each judged by its SLO (a `benchlib.slo.FrozenSlo`, or a `Calibration` made here) and started from
    `starts[workload]` where given (an earlier run's goodput), else from its idle capacity; the
    searches' sizes come from `args` (duration, min_requests, max_requests, rel_tol, max_probes,
    growth). Per workload: each run's goodput and its best probe's p90 TTFT / TPOT, and every probe."""
    client = make_client(ClientConfig(kind="triton", url=url, model=model))
    await client.open()
    plan = RunPlan(args.duration, args.min_requests, args.max_requests, 60.0)
    out: dict[str, list[dict[str, Any]]] = {}
    try:
        for name in workloads:
            workload, fz = WORKLOADS[name], frozen[name]
            idle = start_rate(fz.idle_ttft_s, fz.idle_tpot_s, workload.output.median())
            start = (starts or {}).get(name, idle)
            search = SearchConfig(
                start=start, min_rate=min(start, idle) * args.lowest_rate, max_rate=max(start, idle) * 64,
                rel_tol=args.rel_tol, max_probes=args.max_probes, growth=args.growth,
            )  # fmt: skip
            for run in range(args.runs):
                log(f"{model} {name} run {run + 1}/{args.runs}: goodput search from {start:.2f} req/s")
                res = await search_goodput(client, workload, factory, fz.slo, search, plan, 1, log)
                best = next((r for r in res.runs if r.rate == res.best_rate), None)
                out.setdefault(name, []).append(
                    {
                        "goodput_rps": res.best_rate,
                        "ttft_p90_s": best.summary.ttft_p90 if best else None,
                        "tpot_p90_s": best.summary.tpot_p90 if best else None,
                        "probes": [(r.rate, r.summary.attainment) for r in res.runs],
                    }
                )
    finally:
        await client.close()
    return out


def start_rate(idle_ttft_s: float, idle_tpot_s: float, output_tokens: int) -> float:
    """Where the search starts: what one request stream at a time could sustain when idle."""
    return 1.0 / (idle_ttft_s + idle_tpot_s * max(output_tokens - 1, 0))


def tpot_ratios(decode_only: list[float], mixed: list[float]) -> dict[str, float | None]:
    """The short requests' TPOT p50 / p99 in each run of the interference pair, and mixed / decode-only."""
    fig = {
        "decode_only_tpot_p50": percentile(decode_only, 50),
        "decode_only_tpot_p99": percentile(decode_only, 99),
        "mixed_tpot_p50": percentile(mixed, 50),
        "mixed_tpot_p99": percentile(mixed, 99),
    }
    for q in ("p50", "p99"):
        base, worse = fig[f"decode_only_tpot_{q}"], fig[f"mixed_tpot_{q}"]
        fig[f"ratio_{q}"] = worse / base if base and worse is not None else None
    return fig


@dataclass(frozen=True)
class InterferenceResult:
    rate: float
    count: int
    long_share: float
    long_prompt_tokens: int
    decode_only: RateRun
    mixed: RateRun

    def short_tpots(self, run: RateRun) -> list[float]:
        return [r.tpot for r in run.records if r.kind != "long" and r.tpot is not None]

    def figures(self) -> dict[str, float | None]:
        return tpot_ratios(self.short_tpots(self.decode_only), self.short_tpots(self.mixed))

    def to_dict(self, with_records: bool = True) -> dict[str, Any]:
        return {
            "rate": self.rate,
            "count": self.count,
            "long_share": self.long_share,
            "long_prompt_tokens": self.long_prompt_tokens,
            **self.figures(),
            "decode_only": self.decode_only.to_dict(with_records),
            "mixed": self.mixed.to_dict(with_records),
        }


async def interference(
    client: StreamClient,
    factory: PromptFactory,
    rate: float,
    count: int,
    slo: Slo,
    seed: int = 0,
    long_share: float = 0.2,
    long_prompt_tokens: int = 300,
    drain_timeout_s: float = 60.0,
    probe: Callable[[], CpuProbe] | None = None,
) -> InterferenceResult:
    """The source article's experiment: `count` decode-only requests (10-token prompts) at `rate`, then
    the same arrivals with `long_share` of them carrying unique `long_prompt_tokens`-token prompts.
    `probe` (optional) makes a fresh `CpuProbe` per run, recording where CPU time went."""
    workload = WORKLOADS["decode"]
    load = LoadConfig(max_duration_s=2 * count / rate + 1, drain_timeout_s=drain_timeout_s)
    runs = []
    for share in (0.0, long_share):
        trace = build_trace(workload, factory, rate, count, seed, new_salt(), share, long_prompt_tokens)
        watch = probe().start() if probe is not None else None
        try:
            records = await run_trace(client, trace, load, factory.count_output)
        finally:
            cpu = watch.stop() if watch is not None else None
        runs.append(RateRun(rate, summarize(records, slo), records, cpu))
    return InterferenceResult(rate, count, long_share, long_prompt_tokens, runs[0], runs[1])


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.0f} ms"


@dataclass(frozen=True)
class PooledInterference:
    """The interference pair run once per seed (fresh arrivals and prompts each), pooled: the short
    requests' TPOTs of every seed's decode-only runs against those of every seed's mixed runs. About
    100 requests a run leave one seed's p99 ratio inside its noise; each seed's ratio is kept beside the
    pooled one."""

    seeds: tuple[int, ...]
    runs: tuple[InterferenceResult, ...]

    @property
    def rate(self) -> float:
        return self.runs[0].rate

    def _pooled(self, which: str) -> list[float]:
        return [t for r in self.runs for t in r.short_tpots(getattr(r, which))]

    def figures(self) -> dict[str, float | None]:
        return tpot_ratios(self._pooled("decode_only"), self._pooled("mixed"))

    def seed_ratios(self, q: str) -> list[float | None]:
        return [r.figures()[f"ratio_{q}"] for r in self.runs]

    def _merged(self, which: str, with_records: bool) -> dict[str, Any]:
        """Every seed's run of one kind together: each run's summary, CPU seconds summed over the runs
        (when every run was probed), and the records pooled."""
        runs = [getattr(r, which) for r in self.runs]
        out: dict[str, Any] = {"rate": runs[0].rate, "summaries": [run.summary.to_dict() for run in runs]}
        if all(run.cpu is not None for run in runs):
            cpu: dict[str, dict[str, float]] = {}
            for run in runs:
                for process, per in (run.cpu or {}).items():
                    mine = cpu.setdefault(process, {})
                    for core, seconds in per.items():
                        mine[core] = mine.get(core, 0.0) + seconds
            out["cpu"] = cpu
        if with_records:
            out["records"] = [rec.to_dict() for run in runs for rec in run.records]
        return out

    def to_dict(self, with_records: bool = True) -> dict[str, Any]:
        first = self.runs[0]
        per_seed = []
        for seed, run in zip(self.seeds, self.runs, strict=True):
            f = run.figures()
            per_seed.append({"seed": seed, **{k: f[k] for k in ("decode_only_tpot_p99", "mixed_tpot_p99",
                                                                  "ratio_p50", "ratio_p99")}})  # fmt: skip
        return {
            "rate": first.rate,
            "count": first.count,
            "seeds": list(self.seeds),
            "long_share": first.long_share,
            "long_prompt_tokens": first.long_prompt_tokens,
            **self.figures(),
            "per_seed": per_seed,
            "decode_only": self._merged("decode_only", with_records),
            "mixed": self._merged("mixed", with_records),
        }


async def pooled_interference(
    client: StreamClient,
    factory: PromptFactory,
    rate: float,
    count: int,
    slo: Slo,
    seeds: tuple[int, ...],
    probe: Callable[[], CpuProbe] | None = None,
) -> PooledInterference:
    """`interference` once per seed, in order, pooled (see `PooledInterference`)."""
    if not seeds:
        raise ValueError("at least one seed")
    runs = [await interference(client, factory, rate, count, slo, seed=s, probe=probe) for s in seeds]
    return PooledInterference(tuple(seeds), tuple(runs))
