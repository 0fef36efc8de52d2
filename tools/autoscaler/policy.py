"""Scaling policies: plain classes, no I/O, one proposal per interval from already-measured signals.

A policy answers "would this pool be better with one step more, one step less, or as it is?" and why.
It knows nothing of cooldowns, bounds or confirmation streaks: :class:`~.governor.Governor` applies
those on top, so each rule can be tested on its own.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from disagg_tools.autoscaler.config import ScaledPool

OUT, HOLD, IN = 1, 0, -1

OUT_SIGNALS = (
    "ttft_above_target",
    "queue_wait_above_budget",
    "token_load_high",
    "tpot_above_target",
    "kv_utilisation_high",
)
"""Every reason a policy gives for wanting more instances (a scheduled scale-in waits while one holds)."""

# Weight of the newest busy-interval measurement in the per-instance capacity estimate.
_CAPACITY_EWMA = 0.5


@dataclass(frozen=True)
class Proposal:
    """A policy's wish: `direction` is OUT, HOLD or IN; `reasons` name the signals that fired."""

    direction: int
    reasons: tuple[str, ...]
    detail: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class PrefillSignals:
    """What the prefill policy reads, measured over the window (histograms) or now (gauges).

    `arrival_tokens_per_s` is the prompt-token arrival rate over the last interval;
    `processed_tokens_per_s` the rate the pool worked off (arrivals minus the growth of pending tokens);
    `busy` says the pool had pending work at both ends of that interval, so the processed rate measures
    capacity rather than demand.
    """

    ttft_quantile: float | None
    ttft_samples: float
    pending_tokens: float
    queue_requests: float
    prompt_tokens_quantile: float | None
    arrival_tokens_per_s: float | None
    processed_tokens_per_s: float | None
    busy: bool


@dataclass(frozen=True)
class DecodeSignals:
    """What the decode policy reads: windowed TPOT quantile and the KV block gauges now."""

    tpot_quantile: float | None
    tpot_samples: float
    kv_used: float
    kv_free: float
    active_sequences: float


class PrefillPolicy:
    """TTFT-percentile rule plus a token-aware look-ahead.

    Out when any of:
      - observed TTFT quantile (window) > out_ratio x target (the source article's rule; needs
        min_samples observations in the window);
      - predicted queue wait > queue budget: a request arriving now waits for the pending prompt tokens,
        wait = pending_tokens / (capacity x size), then needs its own prefill, own = prompt-length
        quantile / capacity, so the budget for waiting is target - own (at least target / 2, since more
        instances shorten the wait but never one prompt's own prefill). Pending tokens rise when a burst
        of long prompts is admitted, before any of them has a first token: that is what scales out
        before TTFT breaks;
      - prompt-token arrival rate > max_utilisation x capacity x size (the queue is about to grow).
    In only when every available signal agrees at size - 1: observed quantile < in_ratio x target (or the
    window is empty and nothing is pending), queue wait at size - 1 < in_ratio x budget, utilisation at
    size - 1 < min_utilisation. Otherwise hold.

    Capacity (prompt tokens per second per instance) starts at the configured prior and is re-estimated
    (EWMA) from intervals in which the pool stayed busy; without either, only the TTFT rule applies.
    """

    def __init__(self, pool: ScaledPool) -> None:
        if pool.ttft_target_s is None:
            raise ValueError("a prefill policy needs ttft_target_s")
        self._pool = pool
        self._target = pool.ttft_target_s
        self.capacity: float | None = pool.capacity_tokens_per_s

    def _learn(self, s: PrefillSignals, size: int) -> None:
        if s.busy and s.processed_tokens_per_s is not None and s.processed_tokens_per_s > 0:
            measured = s.processed_tokens_per_s / size
            prev = self.capacity
            self.capacity = measured if prev is None else prev + _CAPACITY_EWMA * (measured - prev)

    def _queue_wait(self, s: PrefillSignals, size: int) -> float | None:
        return None if self.capacity is None else s.pending_tokens / (self.capacity * size)

    def _queue_budget(self, s: PrefillSignals) -> float | None:
        if self.capacity is None:
            return None
        own = (s.prompt_tokens_quantile or 0.0) / self.capacity
        return max(self._target - own, self._target / 2)

    def propose(self, s: PrefillSignals, size: int) -> Proposal:
        """Proposal for a pool of `size` instances (size >= 1)."""
        self._learn(s, size)
        p, target = self._pool, self._target
        trusted = s.ttft_samples >= p.min_samples and s.ttft_quantile is not None
        wait = self._queue_wait(s, size)
        budget = self._queue_budget(s)
        util = None
        if self.capacity is not None and s.arrival_tokens_per_s is not None:
            util = s.arrival_tokens_per_s / (self.capacity * size)
        detail: dict[str, Any] = {
            "ttft_quantile_s": s.ttft_quantile,
            "ttft_samples": s.ttft_samples,
            "pending_tokens": s.pending_tokens,
            "queue_requests": s.queue_requests,
            "prompt_tokens_quantile": s.prompt_tokens_quantile,
            "capacity_tokens_per_s": self.capacity,
            "queue_wait_s": wait,
            "queue_budget_s": budget,
            "utilisation": util,
        }
        out = []
        if trusted and s.ttft_quantile > p.out_ratio * target:  # type: ignore[operator]
            out.append("ttft_above_target")
        if wait is not None and budget is not None and wait > budget:
            out.append("queue_wait_above_budget")
        if util is not None and util > p.max_utilisation:
            out.append("token_load_high")
        if out:
            return Proposal(OUT, tuple(out), detail)
        if size <= 1:
            return Proposal(HOLD, ("in_band",), detail)
        idle = s.ttft_samples == 0 and s.pending_tokens == 0 and s.queue_requests == 0
        ttft_low = (trusted and s.ttft_quantile < p.in_ratio * target) or idle  # type: ignore[operator]
        smaller = size - 1
        wait_smaller = self._queue_wait(s, smaller)
        pred_low = wait_smaller is None or budget is None or wait_smaller < p.in_ratio * budget
        util_low = util is None or util * size / smaller < p.min_utilisation
        if ttft_low and pred_low and util_low:
            return Proposal(IN, ("idle",) if idle else ("ttft_below_target",), detail)
        return Proposal(HOLD, ("in_band",), detail)


class DecodePolicy:
    """TPOT percentile and KV block utilisation.

    Out when the windowed TPOT quantile > out_ratio x target (>= min_samples) or KV utilisation
    used / (used + free) > kv_high. In only when TPOT is below in_ratio x target (or the pool is idle:
    no samples, no active sequences) AND the KV utilisation the remaining instances would carry,
    util x size / (size - 1), stays below kv_low. Otherwise hold.
    """

    def __init__(self, pool: ScaledPool) -> None:
        if pool.tpot_target_s is None:
            raise ValueError("a decode policy needs tpot_target_s")
        self._pool = pool
        self._target = pool.tpot_target_s

    def propose(self, s: DecodeSignals, size: int) -> Proposal:
        """Proposal for a pool of `size` instances (size >= 1)."""
        p, target = self._pool, self._target
        blocks = s.kv_used + s.kv_free
        util = s.kv_used / blocks if blocks > 0 else None
        trusted = s.tpot_samples >= p.min_samples and s.tpot_quantile is not None
        detail: dict[str, Any] = {
            "tpot_quantile_s": s.tpot_quantile,
            "tpot_samples": s.tpot_samples,
            "kv_utilisation": util,
            "active_sequences": s.active_sequences,
        }
        out = []
        if trusted and s.tpot_quantile > p.out_ratio * target:  # type: ignore[operator]
            out.append("tpot_above_target")
        if util is not None and util > p.kv_high:
            out.append("kv_utilisation_high")
        if out:
            return Proposal(OUT, tuple(out), detail)
        if size <= 1:
            return Proposal(HOLD, ("in_band",), detail)
        idle = s.tpot_samples == 0 and s.active_sequences == 0
        tpot_low = (trusted and s.tpot_quantile < p.in_ratio * target) or idle  # type: ignore[operator]
        kv_low = util is None or util * size / (size - 1) < p.kv_low
        if tpot_low and kv_low:
            return Proposal(IN, ("idle",) if idle else ("tpot_below_target",), detail)
        return Proposal(HOLD, ("in_band",), detail)
