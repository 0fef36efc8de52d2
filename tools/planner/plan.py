"""Goodput by bisection, and the search over the placements a machine allows.

Goodput is the highest Poisson arrival rate at which at least ``attainment`` of the requests meet both
SLOs, found by bisection on simulated runs of ``count`` requests (the same seed at every rate, so the
lengths are the same and only the arrival times scale). Placements of a CPU machine of N cores, from
the profiles measured per core count:

- disaggregated: P prefill and D decode instances of one core each, P + D = N (the 1-core profile);
- colocated: N / k instances of k cores (the k-core profile), whole prompts or in chunks.

Per-device goodput is the goodput over the cores used. Predictions for hardware that never ran a
profile here are predictions, not measurements.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

from disagg_tools.planner.lengths import LengthDist
from disagg_tools.planner.profile import Profile
from disagg_tools.planner.simulator import Deployment, Slo, attainment, percentile, poisson_jobs, simulate


@dataclass(frozen=True)
class Traffic:
    prompt: LengthDist
    output: LengthDist
    count: int = 300
    seed: int = 0


@dataclass(frozen=True)
class Prediction:
    name: str
    cores: int
    goodput_rps: float
    ttft_p90_s: float | None  # at the goodput rate
    tpot_p90_s: float | None

    @property
    def per_core(self) -> float:
        return self.goodput_rps / self.cores


def run_at(deployment: Deployment, traffic: Traffic, rate: float, slo: Slo) -> tuple[float, list]:
    jobs = poisson_jobs(rate, traffic.count, traffic.prompt, traffic.output, traffic.seed)
    outcomes = simulate(deployment, jobs)
    return attainment(outcomes, slo), outcomes


def goodput(
    deployment: Deployment, traffic: Traffic, slo: Slo, target: float = 0.9, steps: int = 14
) -> tuple[float, list]:
    """(goodput in requests/s, the outcomes at that rate); 0 when even a trickle misses the target."""
    low, high = 0.0, 0.25
    first, outcomes = run_at(deployment, traffic, 1e-3, slo)
    if first < target:
        return 0.0, outcomes
    best = outcomes
    while True:  # an upper bound: a rate the deployment cannot serve
        met, found = run_at(deployment, traffic, high, slo)
        if met < target or high > 1e4:
            break
        low, best, high = high, found, high * 2
    for _ in range(steps):
        mid = (low + high) / 2
        met, found = run_at(deployment, traffic, mid, slo)
        if met >= target:
            low, best = mid, found
        else:
            high = mid
    return low, best


LOAN_PROMPT_TOKENS = 300  # the prompt length a loan's speed-up is read at from the profiles


def loan_speedup(profiles: Mapping[int, Profile]) -> float | None:
    """A prompt's speed on its core and a whole lent one over its speed alone: the 2-core profile's
    over the 1-core's (None without both)."""
    one, two = profiles.get(1), profiles.get(2)
    if one is None or two is None:
        return None
    alone, both = one.prefill_s([LOAN_PROMPT_TOKENS]), two.prefill_s([LOAN_PROMPT_TOKENS])
    return max(1.0, alone / both) if both > 0 else None


def placements(
    cores: int, profiles: Mapping[int, Profile], chunk_tokens: int = 0, lend_tpot_s: float | None = None
) -> list[tuple[str, Deployment, int]]:
    """(name, deployment, cores used) of every placement the profiles allow on ``cores`` cores; with
    ``lend_tpot_s``, on two cores, also the elastic pair (the decode instance lends its core)."""
    out: list[tuple[str, Deployment, int]] = []
    one = profiles.get(1)
    if one is not None:
        for p in range(1, cores):
            d = cores - p
            out.append((f"disaggregated {p}P:{d}D", Deployment(prefill=(one,) * p, decode=(one,) * d), cores))
    speedup = loan_speedup(profiles)
    if one is not None and cores == 2 and lend_tpot_s is not None and speedup is not None:
        elastic = Deployment(prefill=(one,), decode=(one,), lend_tpot_s=lend_tpot_s, loan_speedup=speedup)
        name = f"disaggregated 1P:1D, decode lends its core ({lend_tpot_s * 1000:g} ms a token)"
        out.append((name, elastic, cores))
    for k, profile in sorted(profiles.items()):
        n = cores // k
        if n < 1:
            continue
        name = f"colocated {n}x{k} cores"
        out.append((name, Deployment(colocated=(profile,) * n), n * k))
        if chunk_tokens:
            chunked = Deployment(colocated=(profile,) * n, chunk_tokens=chunk_tokens)
            out.append((f"{name}, chunks of {chunk_tokens}", chunked, n * k))
    return out


def plan(
    cores: int,
    profiles: Mapping[int, Profile],
    traffic: Traffic,
    slo: Slo,
    transfer_bytes_per_s: float = 0.0,
    chunk_tokens: int = 0,
    target: float = 0.9,
    relay_s_per_token: float = 0.0,
    prefill_relay_s_per_token: float = 0.0,
    routing: str = "random",
    lend_tpot_s: float | None = None,
) -> list[Prediction]:
    """Every placement's predicted goodput, best per core first. ``relay_s_per_token``: what serving
    adds to each decode step per token it produces, for every placement; ``prefill_relay_s_per_token``:
    the entry points' CPU per token streamed, taken from the disaggregated prefill instances whose
    cores they share (both measured by ``perf/relay_cost.py``). ``routing``: how requests meet a pool's
    instances (``simulator.Deployment.routing``; random: Triton's own, load-oblivious assignment).
    ``lend_tpot_s``: also the elastic pair, whose decode instance lends its core within it."""
    found = []
    for name, deployment, used in placements(cores, profiles, chunk_tokens, lend_tpot_s):
        if deployment.prefill:
            deployment = replace(
                deployment,
                transfer_bytes_per_s=transfer_bytes_per_s,
                prefill_relay_s_per_token=prefill_relay_s_per_token,
            )
        found.append((name, replace(deployment, relay_s_per_token=relay_s_per_token, routing=routing), used))
    return rank(found, traffic, slo, target)


def rank(
    found: list[tuple[str, Deployment, int]],
    traffic: Traffic,
    slo: Slo,
    target: float = 0.9,
    per_instance: bool = False,
    steps: int = 14,
) -> list[Prediction]:
    """The goodput of each (name, deployment, devices used), best per device first. With
    ``per_instance`` each placement simulates ``traffic.count`` requests per instance it has: at a
    fixed count, a placement of many instances would see so short a trace at its high rates that no
    backlog could build, and would look better than it is."""
    results = []
    for name, deployment, used in found:
        instances = len(deployment.colocated) + len(deployment.prefill) + len(deployment.decode)
        sized = replace(traffic, count=traffic.count * instances) if per_instance else traffic
        rate, outcomes = goodput(deployment, sized, slo, target, steps)
        ttft = [o.ttft for o in outcomes]
        tpot = [t for o in outcomes if (t := o.tpot) is not None]
        results.append(Prediction(name, used, rate, percentile(ttft, 90), percentile(tpot, 90)))
    return sorted(results, key=lambda r: r.per_core, reverse=True)
