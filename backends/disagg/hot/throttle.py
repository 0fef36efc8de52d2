"""The throttle: an adaptive rate cap for hot prompt groups, from the shared decode pool's step time.

Where no pool of their own takes them, a hot group's requests decode in the shared decode pool beside
every other user's, and each one there makes every decode step longer (a bigger batch, more work on
the same cores): the other users' time per output token is that step time. A fixed cap per group
(``hot_prompts.group_rate``) cannot know how much the pool has to spare; this one is adjusted by what the
pool's engine measures, AIMD-style, once per probe answer of the pool (``observe``):

- the **step time** of an interval is ``Δbusy_s / Δengine_steps`` between two of the pool's loads
  (its mean engine call). An interval of fewer than ``min_steps`` calls says too little (an idle pool,
  or one so slow that few steps fit in a probe interval): it is extended to the next load instead;
  counters that went back (the pool restarted, or a server of a remote pool left the sum) start a new
  interval at that load. Neither takes a decision;
- while **no group is hot**, the step time feeds the **baseline** (an EWMA of weight ``smoothing``),
  except for ``settle_s`` after a burst (the burst's last sequences are still decoding then);
- while **a group is hot**: a step time over ``step_ratio`` x the baseline halves the cap
  (``decrease``), down to ``min_rate`` at the least; otherwise the cap grows by ``increase`` up to
  ``max_rate`` (the configured ``hot_prompts.group_rate``). With no baseline yet (a burst from the pool's
  first probes on) there is nothing to compare with: the cap is held at ``max_rate``, the fixed cap's
  behaviour;
- once **no group is hot any more**, every probe answer raises the cap by ``increase`` back towards
  ``max_rate`` (judged interval or not): the cap learnt in a burst still holds for a group that
  flickers cold for a probe and hot again, and is forgotten over a few seconds after the burst.

Pure: the caller passes the loads and the time, and serialises the calls.
"""

from __future__ import annotations

from dataclasses import dataclass

from disagg.protocol.messages import PoolLoad

DECREASE, INCREASE, HOLD, RECOVER = "decrease", "increase", "hold", "recover"
DECISIONS = (
    (DECREASE, "step_time"),  # hot, and the step time is over step_ratio x the baseline
    (HOLD, "at_min"),  # ... but the cap is at min_rate already
    (INCREASE, "headroom"),  # hot, and the step time is within step_ratio x the baseline
    (HOLD, "at_max"),  # ... but the cap is at max_rate already
    (HOLD, "no_baseline"),  # hot before any baseline was learnt: held at max_rate
    (RECOVER, "cold"),  # no group hot any more: the cap grows back towards max_rate
)
"""Every (action, reason) the throttle counts (``disagg_hot_rate_decisions_total``)."""


@dataclass(frozen=True)
class ThrottleConfig:
    """The adaptive cap's settings; ``max_rate`` is ``hot_prompts.group_rate`` (requests/s per hot group)."""

    max_rate: float
    min_rate: float = 0.1
    step_ratio: float = 1.1
    decrease: float = 0.5
    increase: float = 0.25
    """Requests/s added per probe interval (a judged one while hot, every one while cold)."""
    smoothing: float = 0.2
    """The weight of a new step time in the baseline."""
    min_steps: int = 5
    settle_s: float = 5.0

    def __post_init__(self) -> None:
        """Ranges and consistency; the types are ``config.build``'s (through ``HotPromptsConfig``; a
        config built by hand in code is trusted to be typed)."""
        if not 0 < self.max_rate <= 1e6:
            raise ValueError("group_rate: must be a number of requests per second in (0, 1e6]")
        if not 0 < self.min_rate <= self.max_rate:
            raise ValueError("rate_min: must be a number of requests/s in (0, group_rate]")
        if not 1 < self.step_ratio <= 100:
            raise ValueError("step_ratio: must be a number in (1, 100]")
        if not 0 < self.decrease < 1:
            raise ValueError("rate_decrease: must be a number in (0, 1)")
        if not 0 < self.increase <= 1e6:
            raise ValueError("rate_increase: must be a number of requests per second in (0, 1e6]")
        if not 0 < self.smoothing <= 1:
            raise ValueError("smoothing must be a number in (0, 1]")
        if self.min_steps < 1:
            raise ValueError("min_steps must be positive")
        if not 0 <= self.settle_s <= 3600:
            raise ValueError("settle_s must be a number of seconds in [0, 3600]")


class Throttle:
    """The cap (``rate``) and what it learnt; ``observe`` every probe answer of the shared decode pool."""

    def __init__(self, config: ThrottleConfig) -> None:
        self.config = config
        self._rate = float(config.max_rate)
        self.baseline: float | None = None
        """The step time while no group is hot, seconds (None: not learnt yet)."""
        self.step_s: float | None = None
        """The last judged interval's step time, seconds."""
        self.decisions: dict[tuple[str, str], int] = {}
        self._anchor: PoolLoad | None = None  # where the current interval started
        self._hot_at: float | None = None  # the last probe that found a group hot

    @property
    def rate(self) -> float:
        """The cap now: requests per second each hot group may start."""
        return self._rate

    def observe(self, load: PoolLoad, now: float, hot: bool) -> None:
        """One probe answer of the pool at ``now`` (seconds, the caller's monotonic clock); ``hot``:
        whether a prompt group is hot now."""
        step_s = self._interval(load)
        if not hot:
            settled = self._hot_at is None or now - self._hot_at >= self.config.settle_s
            if step_s is not None and settled:
                self._learn(step_s)
            if self._rate < self.config.max_rate:
                self._set(min(self.config.max_rate, self._rate + self.config.increase), RECOVER, "cold")
            return
        self._hot_at = now
        if step_s is not None:
            self._judge(step_s)

    def _interval(self, load: PoolLoad) -> float | None:
        """The step time from the interval's start to ``load``; None when it is not judged."""
        anchor = self._anchor
        if anchor is None or load.engine_steps < anchor.engine_steps or load.busy_s < anchor.busy_s:
            self._anchor = load  # the first load, or the counters went back: a new interval
            return None
        steps = load.engine_steps - anchor.engine_steps
        if steps < self.config.min_steps:
            return None  # too few steps to judge: the interval goes on
        self._anchor = load
        self.step_s = (load.busy_s - anchor.busy_s) / steps
        return self.step_s

    def _learn(self, step_s: float) -> None:
        weight = self.config.smoothing
        self.baseline = step_s if self.baseline is None else weight * step_s + (1 - weight) * self.baseline

    def _judge(self, step_s: float) -> None:
        c = self.config
        if self.baseline is None:
            self._set(c.max_rate, HOLD, "no_baseline")
        elif step_s > c.step_ratio * self.baseline:
            if self._rate > c.min_rate:
                self._set(max(c.min_rate, self._rate * c.decrease), DECREASE, "step_time")
            else:
                self._set(self._rate, HOLD, "at_min")
        elif self._rate < c.max_rate:
            self._set(min(c.max_rate, self._rate + c.increase), INCREASE, "headroom")
        else:
            self._set(self._rate, HOLD, "at_max")

    def _set(self, rate: float, action: str, reason: str) -> None:
        self._rate = float(rate)
        self.decisions[(action, reason)] = self.decisions.get((action, reason), 0) + 1
