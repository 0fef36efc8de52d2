"""The decode batch tuner: how many sequences a decode pool lets into its batch, adjusted from what
the pool measures, every ``interval_s``.

The source article's recipe for a decode batch is to start large (2x the GPU's SM count), shrink by
10 % while utilisation stays under 70 %, and page on out-of-memory. Here every rule reads a
measurement of this pool, made by its engine loop:

- **utilisation**: the share of the interval the engine spent inside its calls (the busy counter
  behind ``disagg_engine_busy_seconds_total``);
- **TPOT**: every decode step gives each sequence of its batch one token, so the time from one
  step's end to the next one's is a gap between two tokens of every sequence in both. A request's
  TPOT is the mean of its gaps, so the interval's token-weighted mean gap is what a sequence running
  through it gets. (A high quantile of the gaps would judge the batch by one KV import's or one
  prompt's hiccup, which no batch limit removes: measured, it held the limit at 1);
- **slot-bound**: a sequence waited for a batch slot while the KV blocks it needs were free, so the
  limit, not the memory, held it back; ``demand`` is how many sequences would have run.

Each interval gives one decision, in this order:

1. ``shrink/tpot_slo``: the TPOT is over the SLO: the limit drops by ``shrink`` (10 %, at
   least one), and growth stays below the limit that breached until the traffic eases (utilisation
   under ``low_utilisation`` again);
2. ``shrink/low_utilisation``: the engine was busy less than ``low_utilisation`` (70 %) of the
   interval and the limit is above both the largest batch the interval used and the start: it drops
   by ``shrink``, never below either (the article's rule, kept from making a running request wait,
   and from leaving an idle pool too small for the next burst: sequences waiting for a slot count
   the wait in their time per output token);
3. ``grow/under_slo``: the interval was slot-bound and its TPOT was under the SLO (with
   ``margin``), or too few tokens to judge: the limit rises to the demand, or by ``grow`` (at least
   one) if that is more, below the ceiling a breach left;
4. ``hold``: otherwise.

The first limit is ``start``: the knee of the pool's measured step-time curve under the TPOT SLO
(``disagg profile --tpot-slo`` prints it), else the engine's ``max_batch_size``.

KV exhaustion never fails a request here, whatever the limit: a decode pool's block ledger reserves a
sequence's blocks for its whole length when it joins (``disagg.scheduling.ledger``), so a sequence
that does not fit waits in the queue instead of being preempted or failed mid-stream.

Pure and torch-free: time is passed in, and the decision is returned for the loop to apply.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

GROW, SHRINK, HOLD = "grow", "shrink", "hold"
REASONS = ("tpot_slo", "low_utilisation", "under_slo", "steady")


@dataclass(frozen=True)
class TunerConfig:
    """One decode pool's tuner. ``tpot_slo_s`` = 0 turns it off (the limit stays ``max_batch_size``)."""

    tpot_slo_s: float = 0.0
    start: int = 0  # the first limit (0: the engine's max_batch_size)
    min_batch: int = 1
    interval_s: float = 1.0
    shrink: float = 0.10
    grow: float = 0.10
    low_utilisation: float = 0.70
    margin: float = 0.10  # grow only while the TPOT is this share under the SLO
    min_tokens: int = 32  # fewer tokens in an interval: its TPOT is not judged

    def __post_init__(self) -> None:
        """Ranges; the types are ``config.build``'s (through ``PoolConfig``; a config built by hand in
        code is trusted to be typed)."""
        if not 0 <= self.tpot_slo_s <= 60:
            raise ValueError("batch_tpot_slo_s must be in [0, 60] seconds")
        for name in ("start", "min_batch", "min_tokens"):
            if getattr(self, name) < 0:
                raise ValueError(f"batch_{name} must be >= 0")
        if self.min_batch < 1:
            raise ValueError("batch_min_batch must be at least 1")
        if not 0.05 <= self.interval_s <= 600:
            raise ValueError("batch_interval_s must be in [0.05, 600]")
        for name in ("shrink", "grow", "low_utilisation", "margin"):
            if not 0 <= getattr(self, name) < 1:
                raise ValueError(f"batch_{name} must be in [0, 1)")

    @property
    def enabled(self) -> bool:
        return self.tpot_slo_s > 0


@dataclass(frozen=True)
class Decision:
    """One interval's outcome: the limit from now on, and what it was judged from."""

    limit: int
    action: str  # grow, shrink or hold
    reason: str
    utilisation: float
    tpot_s: float | None  # the interval's mean gap between tokens (None: too few tokens)
    peak_batch: int
    demand: int


def batch_knee(points: list[tuple[int, float]], tpot_slo_s: float, share: float = 0.9) -> int:
    """The knee of a measured step-time curve: the smallest batch whose throughput (batch / step
    seconds) reaches ``share`` of the best throughput among the batches whose step meets the TPOT SLO.
    ``points`` are (batch, step seconds); ValueError when none meets the SLO."""
    meeting = [(b, s) for b, s in points if b >= 1 and 0 < s <= tpot_slo_s]
    if not meeting:
        raise ValueError(f"no measured batch steps within the TPOT SLO of {tpot_slo_s * 1000:.1f} ms")
    best = max(b / s for b, s in meeting)
    return min(b for b, s in meeting if b / s >= share * best)


class BatchTuner:
    """Holds the limit; ``observe`` once per engine-loop iteration, ``decide`` at each interval's end
    (``observe`` calls it)."""

    def __init__(self, config: TunerConfig, max_batch: int) -> None:
        self.config = config
        self.max_batch = max_batch
        self.limit = min(max_batch, max(config.min_batch, config.start or max_batch))
        self.start = self.limit  # where a pool whose traffic eased comes back to
        self.decisions: dict[tuple[str, str], int] = {}
        self.last: Decision | None = None
        self._ceiling = max_batch
        self._started: float | None = None
        self._last_step: float | None = None
        self._busy = 0.0
        self._gaps: list[tuple[float, int]] = []
        self._peak = 0
        self._demand = 0
        self._bound = False

    def observe(
        self, now: float, batch: int, busy_s: float, slot_bound: bool = False, demand: int = 0
    ) -> Decision | None:
        """One loop iteration ended at ``now`` (monotonic seconds): it ran a decode step over ``batch``
        sequences (0: none), spent ``busy_s`` in the engine, and ``slot_bound`` says a sequence waited
        for a slot with its blocks free (``demand``: the batch it would have made). Returns the
        interval's decision when this iteration closed one."""
        if self._started is None:
            self._started = now
        if batch > 0:
            if self._last_step is not None:
                self._gaps.append((now - self._last_step, batch))
            self._last_step = now
        else:
            self._last_step = None  # an idle gap is nobody's time per token
        self._busy += busy_s
        self._peak = max(self._peak, batch)
        self._bound = self._bound or slot_bound
        self._demand = max(self._demand, demand)
        if now - self._started < self.config.interval_s:
            return None
        return self.decide(now)

    def decide(self, now: float) -> Decision:
        c = self.config
        span = max(now - (self._started if self._started is not None else now), 1e-9)
        utilisation = min(1.0, self._busy / span)
        tokens = sum(weight for _, weight in self._gaps)
        tpot = sum(gap * n for gap, n in self._gaps) / tokens if tokens >= c.min_tokens else None
        limit, action, reason = self.limit, HOLD, "steady"
        if tpot is not None and tpot > c.tpot_slo_s and self.limit > c.min_batch:
            self._ceiling = self.limit - 1
            limit, action, reason = self._shrunk(c.min_batch), SHRINK, "tpot_slo"
        elif utilisation < c.low_utilisation and self.limit > (floor := max(self.start, self._peak)):
            self._ceiling = self.max_batch  # the traffic eased: a breach's ceiling no longer holds
            limit, action, reason = self._shrunk(floor), SHRINK, "low_utilisation"
        elif self._bound and (tpot is None or tpot <= (1 - c.margin) * c.tpot_slo_s):
            grown = max(self._demand, self.limit + max(1, math.ceil(c.grow * self.limit)))
            limit = min(grown, self._ceiling, self.max_batch)
            if limit > self.limit:
                action, reason = GROW, "under_slo"
            else:
                limit = self.limit
        decision = Decision(limit, action, reason, utilisation, tpot, self._peak, self._demand)
        self.limit, self.last = limit, decision
        self.decisions[(action, reason)] = self.decisions.get((action, reason), 0) + 1
        self._started, self._busy, self._gaps = now, 0.0, []
        self._peak = self._demand = 0
        self._bound = False
        return decision

    def _shrunk(self, floor: int) -> int:
        return max(floor, self.limit - max(1, math.ceil(self.config.shrink * self.limit)))
