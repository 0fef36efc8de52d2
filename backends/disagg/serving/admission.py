"""Admission by capacity: refuse at once a request whose time to first token cannot meet the target.

Mooncake's prediction-based early rejection, on what the orchestrator sees of a pool:

- its backlog: the prompt tokens waiting in it (``PoolLoad.queued_prompt_tokens``, from the last probe),
  less those of this orchestrator's requests that left it since (prefilled, failed or cancelled), plus
  those this orchestrator admitted to it since that probe and that still wait;
- its throughput: prompt tokens prefilled per second of prefill time, from the difference of two
  probes' ``prompt_tokens_done`` / ``prefill_busy_s``, smoothed. Decode steps are left out: a
  colocated pool's decode time made its prompts look slower than they are, and requests were
  refused at a third of its capacity.

A request's predicted TTFT is (backlog + its prompt) / throughput: the wait for its turn, backlog /
throughput, then its own prefill. It is refused, UNAVAILABLE with a retry hint, when the **wait** exceeds
``margin`` x its target: the TTFT SLO, or its own prefill where that is longer (no prompt is served
faster than it is prefilled); a request of negative ``priority`` (sheddable) already at
``sheddable_margin`` x it, so it goes first. So a long prompt is never refused for its length, and
waits in proportion to it (a short one behind it is refused sooner). Judged by the whole predicted TTFT
against the SLO, the default deployment (its 1 s target, margin 2) refused about a fifth of
``summarize``'s 1,150-token prompts at any rate on two cores; judged by the wait against the SLO
alone, still one in eight at a third of its capacity, whenever two such prompts were ahead (each takes
1.1-1.8 s; vLLM and llama.cpp refuse none).

Retry hints are slots, not one figure for all: the refused requests of a pool are told to come back
one prompt's prefill apart, in the order they were refused, from the time the backlog has room again.
With one hint for all ("retry after 1 s"), 64 clients refused together came back together, were
refused together again, and the refusals alone (about 50 a second through the tokenizer and the
orchestrator) took the cores from the prompts (0.93 req/s served, refusals 334 ms p99). Slots are
capped at ``MAX_RETRY_S`` ahead; the refusals beyond that horizon are spread over its second half
(a golden-ratio sequence, so no two land together). Held at the cap, they all came back at once: ten
clients in 0.1 s, 30 s into a 64-client run, their refusals up to 210 ms behind each other.

Before a pool's throughput is known (a pool never probed, or one that has computed nothing yet) its
backlog is held to ``cold_backlog_tokens``: a flood arriving at a cold pool is
refused beyond that, instead of being admitted whole and collapsing everyone's TTFT before the first
estimate (seen: 256 requests admitted in the first two seconds at 10x the capacity). A pool's first
probe that shows engine time gives the estimate from its counters since start. Pure: the caller
passes loads.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from disagg.protocol.errors import UNAVAILABLE, Reason, ServingError
from disagg.protocol.messages import PoolLoad

SMOOTHING = 0.3  # weight of the newest throughput sample
MIN_BUSY_S = 0.05  # engine seconds between two probes below which a sample is too noisy to use
MIN_RETRY_S = 1.0  # the soonest a refused request is told to come back
MAX_RETRY_S = 30.0  # the latest (the OpenAI SDK honours a Retry-After of up to 60 s)
SPREAD = (math.sqrt(5) - 1) / 2  # the golden ratio's step: the spread slots beyond the horizon


@dataclass(frozen=True)
class AdmissionConfig:
    margin: float = 0.0  # refuse above margin x the TTFT SLO; 0: admission by capacity is off
    sheddable_margin: float = 0.5  # the same, for requests of negative priority (while margin > 0)
    ttft_slo_s: float = 1.0
    cold_backlog_tokens: int = 2048  # the most prompt tokens let wait on a pool of unknown throughput

    def __post_init__(self) -> None:
        """Ranges; the types are ``config.build``'s (``OrchestratorConfig.admission``; a config built by
        hand in code is trusted to be typed)."""
        for name in ("margin", "sheddable_margin", "ttft_slo_s", "cold_backlog_tokens"):
            if not 0 <= getattr(self, name) < 1e6:
                raise ValueError(f"{name}: must be a number >= 0 (below 1e6)")
        if self.ttft_slo_s <= 0:
            raise ValueError("ttft_slo_s must be positive")


@dataclass(frozen=True)
class Ticket:
    """A request's place in a pool's backlog, handed back with ``Admission.release`` when its
    prompt no longer waits there."""

    pool: str
    tokens: int
    epoch: int  # the pool's probe count when admitted


@dataclass
class _Pool:
    load: PoolLoad | None = None
    throughput: float | None = None  # prompt tokens per engine second
    admitted: int = 0  # prompt tokens admitted here since the last probe, still waiting
    left: int = 0  # prompt tokens admitted before the last probe that left the pool since
    epoch: int = 0  # probes seen
    retry_at: float = 0.0  # clock time the last slot handed to a refused request ends
    beyond: int = 0  # refusals handed a spread slot since the slots last reached past the horizon


class Admission:
    def __init__(self, config: AdmissionConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self._clock = clock  # seconds, for the retry slots
        self._pools: dict[str, _Pool] = {}
        self._lock = threading.Lock()  # observed from the watcher's thread, admitted from requests'

    def observe(self, pool: str, load: PoolLoad) -> None:
        """A probe's answer: the new backlog, and a throughput sample from the previous answer."""
        with self._lock:
            self._observe(pool, load)

    def _observe(self, pool: str, load: PoolLoad) -> None:
        state = self._pools.setdefault(pool, _Pool())
        previous, state.load, state.admitted, state.left = state.load, load, 0, 0
        state.epoch += 1
        if previous is None:  # the first probe: the counters since the instance started
            previous = PoolLoad(0, 0, 0, 0, 0)
        elif load.busy_s < previous.busy_s:
            return  # restarted (its counters went back): no sample; the same engine keeps its estimate
        done = load.prompt_tokens_done - previous.prompt_tokens_done
        if load.prefill_busy_s > 0:
            busy = load.prefill_busy_s - previous.prefill_busy_s
        else:  # a pool too old to tell its prefill time: all its engine time
            busy = load.busy_s - previous.busy_s
        if busy < MIN_BUSY_S or done <= 0:
            return  # idle: no sample
        sample = done / busy
        state.throughput = sample if state.throughput is None else (
            SMOOTHING * sample + (1 - SMOOTHING) * state.throughput
        )  # fmt: skip

    def predict_ttft(self, pool: str, prompt_tokens: int) -> float | None:
        """Seconds until a new request's prompt would be prefilled on ``pool``; None: no estimate yet."""
        throughput = self._throughput(pool)
        if throughput is None:
            return None
        return (self.backlog(pool) + prompt_tokens) / throughput

    def _throughput(self, pool: str) -> float | None:
        """``pool``'s measured prompt tokens per second; None until it is probed and measured."""
        state = self._pools.get(pool)
        if state is None or state.load is None or not state.throughput:
            return None
        return state.throughput

    def admit(self, pool: str, prompt_tokens: int, priority: int = 0) -> Ticket:
        """Count the request into ``pool``'s backlog, or raise UNAVAILABLE when it would miss its TTFT.
        The caller releases the ticket once the prompt no longer waits (its first token, or its end)."""
        with self._lock:
            if self.config.margin > 0:  # off: never refused, but the backlog is kept for predict_ttft
                self._admit(pool, prompt_tokens, priority)
            state = self._pools.setdefault(pool, _Pool())
            state.admitted += prompt_tokens
            return Ticket(pool, prompt_tokens, state.epoch)

    def release(self, ticket: Ticket) -> None:
        """The ticket's prompt left its pool: out of the backlog now, not at the next probe (until
        then a finished request would still count as waiting, and refuse a request to an idle pool)."""
        with self._lock:
            state = self._pools[ticket.pool]
            if ticket.epoch == state.epoch:  # admitted since the last probe: counted in ``admitted``
                state.admitted = max(0, state.admitted - ticket.tokens)
            else:  # counted in the probe's queue, if it had reached the pool by then
                state.left += ticket.tokens

    def _admit(self, pool: str, prompt_tokens: int, priority: int) -> None:
        config = self.config
        throughput = self._throughput(pool)
        if throughput is None:
            self._admit_cold(pool, prompt_tokens)
            return
        margin = config.sheddable_margin if priority < 0 else config.margin
        backlog = self.backlog(pool)
        wait, own = backlog / throughput, prompt_tokens / throughput
        # the wait for its turn, against the TTFT it can have: the SLO, or its own prefill for a prompt
        # too long for the SLO (refusing it for its length would leave it no way to be served at all)
        target = max(config.ttft_slo_s, own)
        budget = margin * target
        if backlog and wait > budget:
            retry = self._retry_slot(pool, prompt_tokens, wait - budget)
            raise ServingError(
                UNAVAILABLE,
                f"server is over capacity: its prompt would wait {wait:.1f} s for its turn, over "
                f"{margin:g} x its {target:.3g} s target (predicted time to first token "
                f"{wait + own:.1f} s); retry after {retry:g} s",
                Reason.SHED,
            )

    def _retry_slot(self, pool: str, prompt_tokens: int, wait: float) -> float:
        """Seconds until a refused request's slot: ``wait`` (until the backlog has room for it) or,
        if later, the end of the last slot handed out, which this one then extends by its prefill.
        A slot past the horizon (``MAX_RETRY_S``) is spread over the horizon's second half instead.
        Rounded up to 0.1 s, within [MIN_RETRY_S, MAX_RETRY_S]."""
        state, now = self._pools[pool], self._clock()
        start = max(now + max(MIN_RETRY_S, wait), state.retry_at)
        if start <= now + MAX_RETRY_S:
            state.retry_at, state.beyond = start + prompt_tokens / (state.throughput or 1.0), 0
        else:  # the slots are taken as far as clients wait: spread, and leave the slots as they are
            state.beyond += 1
            start = now + MAX_RETRY_S * (1 + (state.beyond * SPREAD) % 1) / 2
        return math.ceil(round((start - now) * 10, 6)) / 10

    def backlog(self, pool: str) -> int:
        """Prompt tokens waiting on ``pool``: at its last probe less those of this orchestrator's
        that left since, plus those admitted since that still wait."""
        state = self._pools.setdefault(pool, _Pool())
        probed = state.load.queued_prompt_tokens if state.load else 0
        return max(0, probed - state.left) + state.admitted

    def _admit_cold(self, pool: str, prompt_tokens: int) -> None:
        """No throughput known for ``pool``: admit while its backlog stays within the cold budget
        (a prompt alone always fits an empty pool)."""
        backlog = self.backlog(pool)
        if backlog and backlog + prompt_tokens > self.config.cold_backlog_tokens:
            raise ServingError(
                UNAVAILABLE,
                f"server is warming up: {backlog} prompt tokens already wait on a pool whose speed is "
                f"not measured yet; retry after {MIN_RETRY_S:g} s",
                Reason.SHED,
            )
