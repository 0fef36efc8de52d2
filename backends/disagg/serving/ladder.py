"""The fallback ladder: which way a request is served, given the pools' health. Pure.

Rungs, in the default order of a disaggregated entry point:

1. ``disaggregated``: prefill pool, KV hand-off, decode pool (needs prefill up, decode healthy);
2. ``local``: the prefill pool decodes what it prefilled, no KV moves, with the output capped at
   ``local_max_tokens`` more tokens (needs the prefill pool healthy and deployed with
   ``local_generate``);
3. ``colocated``: the colocated pool, both phases (needs it deployed and not gone);
4. ``shed``: refused at once, UNAVAILABLE with a retry hint.

A request takes the first rung whose pools allow it. A stream whose pool fails mid-way moves down from
the rung it was on (``Ladder.route(after=...)``): it is resumed there by re-prefilling its prompt and
the tokens it already has. A colocated entry point's ladder starts at ``colocated``.

While the decode pool is *gone* (not merely saturated), ``colocated`` is tried before ``local``
(``colocated_first_when_decode_gone``): the dead pool's cores are free for the colocated pool, while
the local rung decodes on the prefill pool's cores beside the prompts still arriving there. Measured
(``perf/degraded.py``, decode stub killed): 0.42-0.46 of normal goodput through the outage against
0.26-0.31 on the local rung. A saturated decode pool keeps the configured order: its cores are busy.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from disagg.serving.health import PoolHealth, PoolState

DISAGGREGATED, LOCAL, COLOCATED, SHED = "disaggregated", "local", "colocated", "shed"
RUNGS = (DISAGGREGATED, LOCAL, COLOCATED, SHED)
CONDITIONAL = "conditional"
"""Not a rung: the route the disaggregated rung takes for a short prompt while the prefill pool is
backlogged (conditional disaggregation, ``OrchestratorConfig.conditional_prefill_tokens``): the decode
pool serves it whole. Counted in ``disagg_fallbacks_total{from="disaggregated",to="conditional"}``."""
DEFAULT_LADDERS = {
    DISAGGREGATED: (DISAGGREGATED, LOCAL, COLOCATED, SHED),
    COLOCATED: (COLOCATED, DISAGGREGATED, LOCAL, SHED),
}
POOLS = {
    DISAGGREGATED: ("prefill", "decode"),
    LOCAL: ("prefill",),
    COLOCATED: ("colocated",),
    SHED: (),
    CONDITIONAL: ("decode",),
}
"""The pools each rung runs on."""


def ladder_pools(rungs: tuple[str, ...]) -> list[str]:
    """The pools a ladder's rungs run on, sorted, each once."""
    return sorted({pool for rung in rungs for pool in POOLS[rung]})


def parse_ladder(text: str, mode: str) -> tuple[str, ...]:
    """A ladder from its config form (``"disaggregated,local,shed"``; empty: ``mode``'s default). It
    must name known rungs once each and end with ``shed`` (every request gets an answer)."""
    if not text.strip():
        return DEFAULT_LADDERS[mode]
    rungs = tuple(part.strip() for part in text.split(","))
    unknown = [r for r in rungs if r not in RUNGS]
    if unknown:
        raise ValueError(f"degradation.ladder: unknown rung {unknown[0]!r} (rungs: {', '.join(RUNGS)})")
    if len(set(rungs)) != len(rungs):
        raise ValueError("degradation.ladder: names a rung twice")
    if rungs[-1] != SHED or rungs.count(SHED) != 1:
        raise ValueError("degradation.ladder: must end with 'shed'")
    return rungs


@dataclass(frozen=True)
class Route:
    """Where a request goes: its rung, and when that is not the first one tried, the rung it fell
    from and why (``reason``: the pool and its state, e.g. ``decode_gone``)."""

    rung: str
    fell_from: str | None = None
    reason: str = ""

    @property
    def pools(self) -> tuple[str, ...]:
        return POOLS[self.rung]


class Ladder:
    def __init__(
        self,
        rungs: tuple[str, ...],
        health: Mapping[str, PoolHealth],
        local: bool = True,
        colocated_first_when_decode_gone: bool = True,
    ) -> None:
        """``health`` has an entry per deployed pool; ``local``: the prefill pool runs generate jobs;
        ``colocated_first_when_decode_gone``: see the module's text."""
        self.rungs = rungs
        self.health = health
        self.local = local
        self.colocated_first_when_decode_gone = colocated_first_when_decode_gone

    def order(self) -> tuple[str, ...]:
        """The rungs in the order they are tried now."""
        rungs = self.rungs
        decode = self.health.get("decode")
        gone = decode is not None and decode.state is PoolState.GONE
        if not (self.colocated_first_when_decode_gone and gone and LOCAL in rungs and COLOCATED in rungs):
            return rungs
        local, colocated = rungs.index(LOCAL), rungs.index(COLOCATED)
        if colocated < local:
            return rungs
        swapped = list(rungs)
        swapped[local], swapped[colocated] = COLOCATED, LOCAL
        return tuple(swapped)

    def route(self, after: str | None = None, reason: str = "") -> Route:
        """The first rung that can serve now; with ``after``, the first below that rung (a stream whose
        rung failed: ``reason`` says how). Below means below in the configured order or in the order
        of now, so a stream routed before the decode pool was found gone (or while it was) passes over
        no rung it has not tried when the two orders differ."""
        rungs = self.order()
        if after is not None:
            below = {*self.rungs[self.rungs.index(after) + 1 :], *rungs[rungs.index(after) + 1 :]}
            rungs = tuple(rung for rung in rungs if rung in below)
        fell_from = after
        for rung in rungs:
            blocked = self._blocked(rung)
            if blocked is None:
                return Route(rung, fell_from, reason if fell_from else "")
            if fell_from is None:
                fell_from, reason = rung, blocked
        return Route(SHED, fell_from, reason)  # parse_ladder ends every ladder with shed: not reached

    @property
    def mode(self) -> str:
        """The rung a new request takes now: the serving mode."""
        return self.route().rung

    def _blocked(self, rung: str) -> str | None:
        """Why ``rung`` cannot serve now (``<pool>_<state>``), or None when it can."""
        if rung == LOCAL and not self.local:
            return "prefill_no_local_generate"
        for pool in POOLS[rung]:
            health = self.health.get(pool)
            if health is None:
                return f"{pool}_not_deployed"
            state = health.state
            if state is PoolState.GONE:
                return f"{pool}_gone"
            needs_healthy = (rung == DISAGGREGATED and pool == "decode") or rung == LOCAL
            if state is PoolState.SATURATED and needs_healthy:
                return f"{pool}_saturated"
        return None
