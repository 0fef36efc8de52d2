"""A discrete-event simulation of the pools, driven by fitted profiles (``planner.profile``).

Disaggregated: P prefill instances and D decode instances. A request goes to the prefill instance
with the fewest prompt tokens waiting; an idle instance takes waiting prompts first come first served
up to ``max_prefill_tokens`` per step (at least one) and samples each prompt's first token at the
step's end (its TTFT). Its KV then moves to the decode instance with the fewest sequences, taking
``transfer_fixed_s + prompt tokens x kv_bytes_per_token / transfer_bytes_per_s``; a decode instance
steps all its sequences at once (at most ``max_batch``; the others wait their turn), one token each per step.

Colocated: C instances that do both, stepping as the colocated scheduler plans: each step first
prefills waiting prompts within the budget (whole prompts, however long: the decode batch waits for
them, the interference disaggregation removes; or, with ``chunk_tokens``, at most that many prompt
tokens), then one decode step over the whole batch.

Every decode step costs ``relay_s_per_token`` more per token it produces: what the entry points'
relay of each token takes from the pool's cores, measured apart (``perf/relay_cost.py``). Where the
entry points share the disaggregated prefill instances' core, a prefill step also lasts
``prefill_relay_s_per_token`` longer per token streamed while it ran.

Elastic (``lend_tpot_s`` set; one prefill and one decode instance): the decode instance lends its
core to prefill (``disagg.engine.loan``). While it is idle the core is lent whole; while prompts wait,
each decode step is followed by a loan of what is left of ``lend_tpot_s`` (``disagg.scheduling.pacing``),
so the step lasts ``max(step, lend_tpot_s)``. A prefill step runs at its profile's speed times
``1 + (loan_speedup - 1) x f``, where ``loan_speedup`` is the prompt's speed on a whole lent core
beside its own (the 2-core profile's over the 1-core's) and ``f`` the share of the decode core lent
when the step starts (1 idle, ``lend / (step + lend)`` decoding): an approximation, since the share
moves during the step.

Pure and deterministic: the same jobs give the same results. What it leaves out is said in docs/sizing.md
(the orchestrator's cost apart from the relay, CPU contention between pools sharing a core).
"""

from __future__ import annotations

import heapq
import itertools
import random
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from disagg_tools.planner.lengths import LengthDist
from disagg_tools.planner.profile import Profile


@dataclass(frozen=True)
class Job:
    arrival: float
    prompt: int
    output: int  # tokens generated, the first (prefill's) included


@dataclass
class Outcome:
    job: Job
    first_token: float | None = None
    last_token: float | None = None

    @property
    def ttft(self) -> float:
        """Seconds to the first token (infinite for a job the simulation did not reach)."""
        return float("inf") if self.first_token is None else self.first_token - self.job.arrival

    @property
    def tpot(self) -> float | None:
        if self.job.output < 2 or self.last_token is None or self.first_token is None:
            return None
        return (self.last_token - self.first_token) / (self.job.output - 1)


ROUTINGS = ("least_loaded", "random")


@dataclass(frozen=True)
class Deployment:
    prefill: tuple[Profile, ...] = ()
    decode: tuple[Profile, ...] = ()
    colocated: tuple[Profile, ...] = ()
    max_prefill_tokens: int = 4096
    max_batch: int = 64
    transfer_bytes_per_s: float = 0.0  # 0: the KV hand-off's bytes take no time
    transfer_fixed_s: float = 0.0  # the hand-off's cost apart from its bytes (export, descriptor, ack)
    chunk_tokens: int = 0  # colocated: prompt tokens per step beside decode (0: whole prompts, alone)
    relay_s_per_token: float = 0.0
    """What serving adds to a decode step (decode and colocated instances) per token it produces: the
    entry points relaying each token on the pool's cores or beside them (``perf/relay_cost.py``
    measures it per deployment); 0: the profile's step alone."""
    prefill_relay_s_per_token: float = 0.0
    """Disaggregated: the entry points' CPU per token streamed, taken from the prefill instances (they
    share its core): a prefill step lasts this much longer per token the decode instances produced
    while it ran. 0: the relay takes nothing from prefill."""
    lend_tpot_s: float | None = None
    """Elastic: the decode instance lends its core to the prefill instance, within this many seconds
    a token while prompts wait (None: static pools)."""
    loan_speedup: float = 1.0
    """Elastic: a prompt's speed with a whole lent core beside its own, over its speed alone."""
    routing: str = "least_loaded"
    """How a request (and, disaggregated, its hand-off) picks among a pool's instances:
    ``least_loaded`` (the fewest prompt tokens waiting, plus sequences where colocated; the decode
    instance with the fewest sequences) or ``random`` (uniform, seeded): Triton's own assignment, which
    hands a model's calls to its instances in turn, the entry points' pings among them, so that
    which instance a request meets is close to random (docs/sizing.md, "Checked against real runs")."""

    def __post_init__(self) -> None:
        for name in ("relay_s_per_token", "prefill_relay_s_per_token"):
            if not 0 <= getattr(self, name) < 1:
                raise ValueError(f"{name} must be seconds in [0, 1)")
        if self.colocated and (self.prefill or self.decode):
            raise ValueError("a deployment is disaggregated (prefill + decode) or colocated, not both")
        if not self.colocated and not (self.prefill and self.decode):
            raise ValueError("a disaggregated deployment needs prefill and decode instances")
        if self.routing not in ROUTINGS:
            raise ValueError(f"routing must be one of {', '.join(ROUTINGS)}")
        if self.lend_tpot_s is not None:
            if self.colocated or len(self.prefill) != 1 or len(self.decode) != 1:
                raise ValueError("lend_tpot_s: loans are between one prefill and one decode instance")
            if not self.lend_tpot_s >= 0 or not self.loan_speedup >= 1:
                raise ValueError("lend_tpot_s must be >= 0 and loan_speedup >= 1")


@dataclass
class _Seq:
    outcome: Outcome
    left: int  # tokens still to generate
    context: int


@dataclass(eq=False)  # instances are told apart by identity: two idle ones are not the same
class _Instance:
    profile: Profile
    queue: deque[tuple[Outcome, int]] = field(default_factory=deque)  # (request, prompt tokens left)
    active: list[_Seq] = field(default_factory=list)
    joining: deque[_Seq] = field(default_factory=deque)
    busy: bool = False
    incoming: int = 0  # sequences on their way (KV in transfer)
    stepping: int = 0  # prompt tokens of the step running now

    def waiting_tokens(self) -> int:
        """Prompt tokens not prefilled yet: the queue's and the running step's."""
        return sum(left for _, left in self.queue) + self.stepping

    def sequences(self) -> int:
        return len(self.active) + len(self.joining) + self.incoming


_Piece = tuple[Outcome, int, bool]  # a step's prompt piece: (request, tokens, whether its last)


class Simulation:
    def __init__(self, deployment: Deployment, seed: int = 0) -> None:
        self.d = deployment
        self._events: list[tuple[float, int, Callable[[], None]]] = []
        self._order = itertools.count()
        self.now = 0.0
        self.prefill = [_Instance(p) for p in deployment.prefill]
        self.decode = [_Instance(p) for p in deployment.decode]
        self.colocated = [_Instance(p) for p in deployment.colocated]
        self.emitted = 0  # output tokens the decode steps produced so far (what the relay streams)
        self._rng = random.Random(seed)  # routing="random": the same seed, the same instances

    def _at(self, when: float, action: Callable[[], None]) -> None:
        heapq.heappush(self._events, (when, next(self._order), action))

    def run(self, jobs: Sequence[Job]) -> list[Outcome]:
        outcomes = [Outcome(job) for job in sorted(jobs, key=lambda j: j.arrival)]
        for outcome in outcomes:
            self._at(outcome.job.arrival, lambda o=outcome: self._arrive(o))
        while self._events:
            self.now, _, action = heapq.heappop(self._events)
            action()
        return outcomes

    # ---- arrivals -----------------------------------------------------------------------------------

    def _arrive(self, outcome: Outcome) -> None:
        pools = self.colocated or self.prefill
        target = self._route(pools, lambda i: i.waiting_tokens() + (i.sequences() if self.colocated else 0))
        target.queue.append((outcome, outcome.job.prompt))
        self._kick(target)

    def _route(self, instances: list[_Instance], load: Callable[[_Instance], int]) -> _Instance:
        """The instance a request (or a hand-off) meets: the least loaded, or one drawn at random."""
        return self._rng.choice(instances) if self.d.routing == "random" else min(instances, key=load)

    def _kick(self, instance: _Instance) -> None:
        if instance.busy:
            return
        if instance in self.colocated:
            self._colocated_step(instance)
        elif instance in self.prefill:
            self._prefill_step(instance)
        else:
            self._decode_step(instance)

    # ---- prefill ------------------------------------------------------------------------------------

    def _take_prompts(self, instance: _Instance, budget: int, whole: bool) -> list[_Piece]:
        """Prompt pieces for one step: (request, tokens, its last piece)."""
        taken: list[_Piece] = []
        while instance.queue and budget > 0:
            outcome, left = instance.queue[0]
            if whole and taken and left > budget:
                break
            piece = left if whole else min(left, budget)
            budget -= piece
            if piece == left:
                instance.queue.popleft()
                taken.append((outcome, piece, True))
            else:
                instance.queue[0] = (outcome, left - piece)
                taken.append((outcome, piece, False))
        return taken

    def _prefill_step(self, instance: _Instance) -> None:
        if not instance.queue:
            return
        taken = self._take_prompts(instance, self.d.max_prefill_tokens, whole=True)
        instance.busy = True
        instance.stepping = sum(tokens for _, tokens, _ in taken)
        seconds = instance.profile.prefill_s([tokens for _, tokens, _ in taken]) / self._loan_factor()
        mark = self.emitted
        self._at(self.now + seconds, lambda: self._prefill_relayed(instance, taken, mark))

    def _prefill_relayed(self, instance: _Instance, taken: list[_Piece], mark: int) -> None:
        """The step's compute is done; the relay of the tokens streamed meanwhile took its share of the
        core, so the step ends that much later (and the tokens streamed in that time, later still)."""
        extra = self.d.prefill_relay_s_per_token * (self.emitted - mark)
        if extra > 1e-9:
            mark = self.emitted
            self._at(self.now + extra, lambda: self._prefill_relayed(instance, taken, mark))
            return
        self._prefilled(instance, taken)

    def _prefilled(self, instance: _Instance, taken: list[_Piece]) -> None:
        instance.busy = False
        instance.stepping = 0
        for outcome, _, _ in taken:
            outcome.first_token = self.now
            if outcome.job.output <= 1:
                outcome.last_token = self.now
                continue
            target = self._route(self.decode, _Instance.sequences)
            target.incoming += 1
            bytes_ = outcome.job.prompt * instance.profile.kv_bytes_per_token
            delay = self.d.transfer_fixed_s
            delay += bytes_ / self.d.transfer_bytes_per_s if self.d.transfer_bytes_per_s else 0.0
            self._at(self.now + delay, lambda o=outcome, t=target: self._joined(t, o))
        self._prefill_step(instance)

    def _lent_share(self) -> float:
        """Elastic: the share of the decode core lent now (1 while it has no sequence)."""
        decode = self.decode[0]
        if not decode.active and not decode.joining:
            return 1.0
        step = decode.profile.decode_s(max(len(decode.active), 1), sum(s.context for s in decode.active))
        lend = max(0.0, (self.d.lend_tpot_s or 0.0) - step)
        return lend / (step + lend) if lend > 0 else 0.0

    def _loan_factor(self) -> float:
        if self.d.lend_tpot_s is None:
            return 1.0
        return 1.0 + (self.d.loan_speedup - 1.0) * self._lent_share()

    def _prompts_wait(self) -> bool:
        return any(p.busy or p.queue for p in self.prefill)

    def _joined(self, instance: _Instance, outcome: Outcome) -> None:
        instance.incoming -= 1
        instance.joining.append(_Seq(outcome, outcome.job.output - 1, outcome.job.prompt + 1))
        self._kick(instance)

    # ---- decode -------------------------------------------------------------------------------------

    def _admit(self, instance: _Instance) -> None:
        while instance.joining and len(instance.active) < self.d.max_batch:
            instance.active.append(instance.joining.popleft())

    def _decode_step(self, instance: _Instance) -> None:
        self._admit(instance)
        if not instance.active:
            return
        instance.busy = True
        seconds = self._decode_s(instance)
        if self.d.lend_tpot_s is not None and self._prompts_wait():  # the loan after the step
            seconds = max(seconds, self.d.lend_tpot_s)
        self._at(self.now + seconds, lambda: self._stepped(instance))

    def _decode_s(self, instance: _Instance) -> float:
        """One decode step over the instance's batch: the profile's, plus the relay of its tokens."""
        batch = len(instance.active)
        context = sum(s.context for s in instance.active)
        return instance.profile.decode_s(batch, context) + self.d.relay_s_per_token * batch

    def _advance(self, instance: _Instance) -> None:
        self.emitted += len(instance.active)
        for seq in instance.active:
            seq.left -= 1
            seq.context += 1
            if seq.left == 0:
                seq.outcome.last_token = self.now
        instance.active = [s for s in instance.active if s.left > 0]

    def _stepped(self, instance: _Instance) -> None:
        instance.busy = False
        self._advance(instance)
        self._decode_step(instance)

    # ---- colocated ----------------------------------------------------------------------------------

    def _colocated_step(self, instance: _Instance) -> None:
        """As the colocated scheduler plans a step: prompt work within the budget first (whole prompts,
        or chunks), then one decode step over the whole batch, the prompts just completed included."""
        self._admit(instance)
        if not instance.queue and not instance.active:
            return
        chunked = self.d.chunk_tokens > 0
        budget = self.d.chunk_tokens if chunked else self.d.max_prefill_tokens
        taken = self._take_prompts(instance, budget, whole=not chunked) if instance.queue else []
        instance.stepping = sum(t for _, t, _ in taken)
        seconds = instance.profile.prefill_s([t for _, t, _ in taken]) if taken else 0.0
        instance.busy = True
        self._at(self.now + seconds, lambda: self._colocated_prefilled(instance, taken))

    def _colocated_prefilled(self, instance: _Instance, taken: list[_Piece]) -> None:
        instance.stepping = 0
        for outcome, _, last in taken:
            if not last:
                continue
            outcome.first_token = self.now
            if outcome.job.output <= 1:
                outcome.last_token = self.now
            else:
                instance.joining.append(_Seq(outcome, outcome.job.output - 1, outcome.job.prompt + 1))
        self._admit(instance)
        if not instance.active:
            instance.busy = False
            self._colocated_step(instance)
            return
        self._at(self.now + self._decode_s(instance), lambda: self._colocated_decoded(instance))

    def _colocated_decoded(self, instance: _Instance) -> None:
        instance.busy = False
        self._advance(instance)
        self._colocated_step(instance)


ROUTING_DRAWS = 5  # routing="random": one trace is simulated this many times, one seed each


def simulate(deployment: Deployment, jobs: Sequence[Job]) -> list[Outcome]:
    """The jobs' outcomes. With random routing, which instance a job meets is drawn, and one draw's
    luck moves a short trace's attainment far (seen: a predicted goodput from 1.1 to 1.5 req/s over five
    seeds, 300 requests): the trace is run ``ROUTING_DRAWS`` times, and the outcomes of all the runs
    are returned together (so attainment and percentiles are their expected values)."""
    if deployment.routing != "random":
        return Simulation(deployment).run(jobs)
    return [o for seed in range(ROUTING_DRAWS) for o in Simulation(deployment, seed).run(jobs)]


def poisson_jobs(rate: float, count: int, prompt: LengthDist, output: LengthDist, seed: int = 0) -> list[Job]:
    """``count`` jobs arriving as a Poisson process of ``rate`` per second, lengths drawn per job."""
    rng = np.random.default_rng(seed)
    gaps = rng.exponential(1.0 / rate, size=count)
    times = np.cumsum(gaps) - gaps[0]
    prompts = prompt.sample(np.random.default_rng(seed + 1), count)
    outputs = output.sample(np.random.default_rng(seed + 2), count)
    return [Job(float(t), p, o) for t, p, o in zip(times, prompts, outputs, strict=True)]


@dataclass(frozen=True)
class Slo:
    ttft_s: float
    tpot_s: float


def attainment(outcomes: Sequence[Outcome], slo: Slo) -> float:
    """Share of the jobs meeting both SLOs (TPOT vacuous for one-token outputs)."""
    good = sum(o.ttft <= slo.ttft_s and (o.tpot is None or o.tpot <= slo.tpot_s) for o in outcomes)
    return good / len(outcomes) if outcomes else 0.0


def percentile(values: Sequence[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None
