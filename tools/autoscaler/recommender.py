"""The planner in the loop: instance counts that meet the SLOs for the traffic observed.

Every planner interval (``planner`` in the config, :class:`~.config.PlannerConfig`) the controller hands
over what the window saw: the requests that ended in it, hence the arrival rate, and the histograms of
their prompt and output lengths (`disagg_prompt_tokens`, `disagg_output_tokens`). The lengths are not
averaged: the planner's jobs draw them from the histograms' buckets
(:func:`disagg_tools.planner.lengths.from_buckets`), so bimodal or long-tailed traffic is simulated as
it is, not as its mean. :func:`search` then runs the planner's discrete-event simulation
(:mod:`disagg_tools.planner.simulator`) of P prefill and D decode instances, each stepping as its
profile predicts, on Poisson arrivals at `headroom` x the observed rate, and walks from the pools'
minimum sizes upwards: while the share of requests meeting both SLOs is below `target`, it adds an
instance to the pool whose own SLO is met least often (prefill for TTFT, decode for TPOT; the other
pool, when that one is at its maximum, only if its own SLO is missed too). It stops at the first
(P, D) that meets the target, or where no pool may usefully grow (reported as not met: the counts
then say how far the bounds allow, and that more would be needed).

Pure and deterministic apart from :func:`load_recommender` (which reads the profile files): the same
window gives the same recommendation (the jobs come from a fixed seed), and each run costs a few
simulations of `requests` requests.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

from disagg.config import ConfigError
from disagg_tools.autoscaler.config import AutoscalerConfig, PlannerConfig, ScaledPool
from disagg_tools.autoscaler.histogram import Histogram
from disagg_tools.planner.lengths import LengthDist, from_buckets
from disagg_tools.planner.profile import Profile
from disagg_tools.planner.simulator import Deployment, Slo, attainment, percentile, poisson_jobs, simulate

MET = "met"
UNMET = "not_met_at_max"
TOO_LITTLE = "too_little_traffic"


@dataclass(frozen=True)
class Observed:
    """What the window saw: `requests` requests ended over `seconds`, with these length histograms."""

    requests: float
    seconds: float
    prompt: Histogram
    output: Histogram

    @property
    def rate_rps(self) -> float:
        return self.requests / self.seconds if self.seconds > 0 else 0.0


class TrafficWindow:
    """Per-interval deltas of the prompt and output length histograms, kept for `window_s` seconds."""

    def __init__(self, window_s: float) -> None:
        self._window_s = window_s
        self._entries: deque[tuple[float, float, Histogram, Histogram]] = deque()

    def add(self, now: float, dt: float, prompt: Histogram, output: Histogram) -> None:
        """One interval of `dt` seconds ending at `now`."""
        self._entries.append((now, dt, prompt, output))
        while self._entries and self._entries[0][0] <= now - self._window_s:
            self._entries.popleft()

    def observed(self) -> Observed | None:
        """The window merged (None before the first interval). A re-bucketed exporter restarts it."""
        if not self._entries:
            return None
        _, _, latest_prompt, latest_output = self._entries[-1]
        prompt, output, seconds = Histogram.empty(latest_prompt.bounds), None, 0.0
        for _, dt, p, o in self._entries:
            seconds += dt
            if p.bounds == latest_prompt.bounds and o.bounds == latest_output.bounds:
                prompt, output = prompt + p, o if output is None else output + o
        if output is None:  # not reached: the latest entry always matches itself
            return None
        return Observed(prompt.count, seconds, prompt, output)


@dataclass(frozen=True)
class Recommendation:
    """One run's answer: `prefill` and `decode` instance counts (None without enough traffic), whether
    they meet the target (`reason`), and what it was computed from."""

    prefill: int | None
    decode: int | None
    reason: str
    rate_rps: float
    planned_rps: float
    requests: float
    attainment: float | None = None
    ttft_p90_s: float | None = None
    tpot_p90_s: float | None = None
    tried: tuple[tuple[int, int, float], ...] = ()
    """Every (prefill, decode, attainment) simulated, in order."""

    def size(self, role: str) -> int | None:
        return self.prefill if role == "prefill" else self.decode

    def as_record(self) -> dict[str, Any]:
        """JSON-serialisable form (the runner prints it as one line per run)."""

        def rounded(x: float | None, digits: int) -> float | None:
            return None if x is None else round(x, digits)

        return {
            "prefill": self.prefill,
            "decode": self.decode,
            "reason": self.reason,
            "rate_rps": rounded(self.rate_rps, 3),
            "planned_rps": rounded(self.planned_rps, 3),
            "requests": self.requests,
            "attainment": rounded(self.attainment, 3),
            "ttft_p90_s": rounded(self.ttft_p90_s, 4),
            "tpot_p90_s": rounded(self.tpot_p90_s, 5),
            "tried": [[p, d, round(a, 3)] for p, d, a in self.tried],
        }


@dataclass(frozen=True)
class Search:
    """What :func:`search` simulates: the pools' profiles and bounds, the SLOs and the engine limits."""

    prefill_profile: Profile
    decode_profile: Profile
    prefill_bounds: tuple[int, int]
    decode_bounds: tuple[int, int]
    slo: Slo
    target: float = 0.9
    requests: int = 300
    seed: int = 0
    transfer_bytes_per_s: float = 0.0
    max_prefill_tokens: int = 4096
    max_batch: int = 64
    routing: str = "least_loaded"
    """How requests meet a pool's instances (``simulator.Deployment.routing``)."""


def search(
    s: Search, prompt: LengthDist, output: LengthDist, rate: float
) -> tuple[int, int, bool, tuple[tuple[int, int, float], ...], list[Any]]:
    """The smallest (prefill, decode) found meeting `s.target` at `rate` requests/s; returns
    (prefill, decode, met, every try, the outcomes of the last try). See the module docstring."""
    jobs = poisson_jobs(rate, s.requests, prompt, output, s.seed)
    p, d = s.prefill_bounds[0], s.decode_bounds[0]
    tried: list[tuple[int, int, float]] = []
    while True:
        deployment = Deployment(
            prefill=(s.prefill_profile,) * p,
            decode=(s.decode_profile,) * d,
            max_prefill_tokens=s.max_prefill_tokens,
            max_batch=s.max_batch,
            transfer_bytes_per_s=s.transfer_bytes_per_s,
            routing=s.routing,
        )
        outcomes = simulate(deployment, jobs)
        met = attainment(outcomes, s.slo)
        tried.append((p, d, met))
        if met >= s.target:
            return p, d, True, tuple(tried), outcomes
        # grow the pool whose own SLO is met least often; the other one only while its own SLO is
        # missed too (a pool at its maximum that still misses is the answer, not a reason to grow
        # the pool that already meets its SLO)
        ttft_met = sum(o.ttft <= s.slo.ttft_s for o in outcomes) / len(outcomes)
        tpot_met = sum(o.tpot is None or o.tpot <= s.slo.tpot_s for o in outcomes) / len(outcomes)
        grow = [("prefill", ttft_met, p < s.prefill_bounds[1]), ("decode", tpot_met, d < s.decode_bounds[1])]
        grow.sort(key=lambda g: g[1])
        pick = next((g[0] for i, g in enumerate(grow) if g[2] and (i == 0 or g[1] < s.target)), None)
        if pick == "prefill":
            p += 1
        elif pick == "decode":
            d += 1
        else:
            return p, d, False, tuple(tried), outcomes


class Recommender:
    """Runs :func:`search` on the observed traffic every planner interval; keeps the last answer."""

    def __init__(
        self,
        config: PlannerConfig,
        prefill: ScaledPool,
        decode: ScaledPool,
        prefill_profile: Profile,
        decode_profile: Profile | None = None,
        routing: str = "least_loaded",
    ) -> None:
        if prefill.ttft_target_s is None or decode.tpot_target_s is None:
            raise ValueError(
                "the planner needs the prefill pool's ttft_target_s and the decode pool's tpot_target_s"
            )
        self.config = config
        self.prefill = prefill
        self.decode = decode
        self._search = Search(
            prefill_profile=prefill_profile,
            decode_profile=decode_profile or prefill_profile,
            prefill_bounds=(prefill.min_size, prefill.max_size),
            decode_bounds=(decode.min_size, decode.max_size),
            slo=Slo(prefill.ttft_target_s, decode.tpot_target_s),
            target=config.target,
            requests=config.requests,
            seed=config.seed,
            transfer_bytes_per_s=config.transfer_gbps * 1e9,
            max_prefill_tokens=config.max_prefill_tokens,
            max_batch=config.max_batch,
            routing=routing,
        )
        self._last_run: float | None = None
        self.last: Recommendation | None = None

    @property
    def floor_mode(self) -> bool:
        return self.config.mode == "floor"

    def due(self, now: float) -> bool:
        """Whether a run is due at monotonic time `now` (every interval when no planner interval is set)."""
        every = self.config.interval_s
        return self._last_run is None or every is None or now - self._last_run >= every - 1e-9

    def recommend(self, observed: Observed | None, now: float) -> Recommendation:
        """Run now on `observed` (None: nothing observed yet); the answer is kept as `last`."""
        self._last_run = now
        rate = observed.rate_rps if observed is not None else 0.0
        planned = rate * self.config.headroom
        requests = observed.requests if observed is not None else 0.0
        if observed is None or requests < self.config.min_requests or planned <= 0:
            self.last = Recommendation(None, None, TOO_LITTLE, rate, planned, requests)
            return self.last
        try:
            prompt = from_buckets(observed.prompt.bounds, observed.prompt.cumulative)
            output = from_buckets(observed.output.bounds, observed.output.cumulative)
        except ValueError:  # an output histogram with nothing in it while prompts were counted
            self.last = Recommendation(None, None, TOO_LITTLE, rate, planned, requests)
            return self.last
        p, d, met, tried, outcomes = search(self._search, prompt, output, planned)
        ttft = [o.ttft for o in outcomes]
        tpot = [t for o in outcomes if (t := o.tpot) is not None]
        self.last = Recommendation(
            p,
            d,
            MET if met else UNMET,
            rate,
            planned,
            requests,
            attainment=tried[-1][2],
            ttft_p90_s=percentile(ttft, 90),
            tpot_p90_s=percentile(tpot, 90),
            tried=tried,
        )
        return self.last

    def floor_for(self, pool: ScaledPool) -> int | None:
        """In floor mode, the last recommendation's count for `pool` (None: no floor)."""
        if not self.floor_mode or self.last is None:
            return None
        if pool.name == self.prefill.name:
            return self.last.prefill
        if pool.name == self.decode.name:
            return self.last.decode
        return None


def load_recommender(config: AutoscalerConfig) -> Recommender | None:
    """The recommender for an enabled planner, its profiles read from their files; ConfigError naming
    the key when one cannot be read (the message carries no path)."""
    planner = config.planner
    if not planner.enabled or planner.profile is None:
        return None
    profiles: dict[str, Profile] = {}
    for key in ("profile", "decode_profile"):
        path = getattr(planner, key)
        if path is None:
            continue
        try:
            profiles[key] = Profile.load(path)
        except OSError as exc:
            raise ConfigError(f"planner.{key}: cannot read the profile ({exc.strerror})") from None
        except ValueError as exc:
            raise ConfigError(f"planner.{key}: not a profile ({exc})") from None
    prefill = next(p for p in config.pools if p.role == "prefill")
    decode = next(p for p in config.pools if p.role == "decode")
    # the triton actuator sizes the instance groups of one server, whose calls Triton hands to the
    # instances without looking at their load (random routing, as `disagg plan` models it); the
    # kubernetes one sizes servers, which the frontend picks by their fewest open calls
    routing = "random" if config.actuator.kind == "triton" else "least_loaded"
    return Recommender(planner, prefill, decode, profiles["profile"], profiles.get("decode_profile"), routing)
