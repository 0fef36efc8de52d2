"""The adaptive hot-group cap (``disagg.hot.throttle``): a baseline step time learnt while no group
is hot, AIMD on the cap while one is, recovery after the burst; idle intervals and restarts decide
nothing."""

from __future__ import annotations

import pytest

from disagg.config import ConfigError, build
from disagg.hot.settings import HotPromptsConfig
from disagg.hot.throttle import DECISIONS, Throttle, ThrottleConfig
from disagg.protocol.messages import PoolLoad

MAX = 2.0


class Pool:
    """A decode pool's counters as its probe answers carry them: ``step`` runs ``n`` engine calls of
    ``step_s`` seconds each; ``load`` is the answer now."""

    def __init__(self) -> None:
        self.steps = 0
        self.busy_s = 0.0

    def step(self, n: int, step_s: float) -> PoolLoad:
        self.steps += n
        self.busy_s += n * step_s
        return self.load()

    def load(self) -> PoolLoad:
        return PoolLoad(0, 0, 4, 10, 90, busy_s=self.busy_s, engine_steps=self.steps)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def tick(self) -> float:
        self.now += 1.0
        return self.now


def _throttle(**kw: float) -> tuple[Throttle, Pool, Clock]:
    throttle, pool, clock = Throttle(ThrottleConfig(max_rate=MAX, **kw)), Pool(), Clock()
    throttle.observe(pool.load(), clock.now, hot=False)  # the first load anchors the first interval
    return throttle, pool, clock


def _cold(throttle: Throttle, pool: Pool, clock: Clock, step_s: float = 0.010, probes: int = 3) -> None:
    for _ in range(probes):
        throttle.observe(pool.step(50, step_s), clock.tick(), hot=False)


def _hot(throttle: Throttle, pool: Pool, clock: Clock, step_s: float, n: int = 50) -> float:
    throttle.observe(pool.step(n, step_s), clock.tick(), hot=True)
    return throttle.rate


def test_the_baseline_is_learnt_while_no_group_is_hot():
    throttle, pool, clock = _throttle()
    assert throttle.baseline is None and throttle.rate == MAX
    throttle.observe(pool.step(50, 0.010), clock.tick(), hot=False)
    assert throttle.baseline == pytest.approx(0.010), "the first interval is the baseline"
    throttle.observe(pool.step(50, 0.020), clock.tick(), hot=False)
    assert throttle.baseline == pytest.approx(0.2 * 0.020 + 0.8 * 0.010), "then an EWMA of weight 0.2"
    assert throttle.step_s == pytest.approx(0.020)
    assert throttle.rate == MAX and throttle.decisions == {}, "nothing to decide while nothing is hot"


def test_a_slow_interval_halves_the_cap_and_fast_ones_grow_it_back_to_the_max_never_above():
    throttle, pool, clock = _throttle()
    _cold(throttle, pool, clock)  # baseline 10 ms
    assert _hot(throttle, pool, clock, 0.0115) == 1.0, "15 % slower than the baseline: halved"
    assert _hot(throttle, pool, clock, 0.0115) == 0.5
    assert _hot(throttle, pool, clock, 0.0105) == 0.75, "within 1.1x: +0.25 req/s"
    rates = [_hot(throttle, pool, clock, 0.010) for _ in range(7)]
    assert rates == [1.0, 1.25, 1.5, 1.75, 2.0, 2.0, 2.0], "back to the max, and no higher"
    assert throttle.baseline == pytest.approx(0.010), "hot intervals do not move the baseline"
    assert throttle.decisions == {
        ("decrease", "step_time"): 2,
        ("increase", "headroom"): 6,
        ("hold", "at_max"): 2,
    }
    assert set(throttle.decisions) <= set(DECISIONS)


def test_the_cap_never_goes_below_its_minimum():
    throttle, pool, clock = _throttle(min_rate=0.3)
    _cold(throttle, pool, clock)
    rates = [_hot(throttle, pool, clock, 0.050) for _ in range(5)]
    assert rates == [1.0, 0.5, 0.3, 0.3, 0.3]
    assert throttle.decisions == {("decrease", "step_time"): 3, ("hold", "at_min"): 2}


def test_the_step_ratio_is_the_threshold():
    throttle, pool, clock = _throttle(step_ratio=1.5)
    _cold(throttle, pool, clock)
    assert _hot(throttle, pool, clock, 0.014) == MAX, "1.4x is within a ratio of 1.5"
    assert _hot(throttle, pool, clock, 0.016) == 1.0


def test_idle_intervals_take_no_decision_and_are_judged_once_they_have_enough_steps():
    throttle, pool, clock = _throttle()
    _cold(throttle, pool, clock)
    assert _hot(throttle, pool, clock, 0.050, n=4) == MAX, "4 steps: too few to judge"
    assert _hot(throttle, pool, clock, 0.050, n=0) == MAX, "no step at all"
    assert throttle.decisions == {}
    # a slow pool fits few steps in a probe interval: they add up to an interval that is judged
    assert _hot(throttle, pool, clock, 0.050, n=1) == 1.0
    assert throttle.step_s == pytest.approx(0.050) and throttle.decisions == {("decrease", "step_time"): 1}


def test_counters_that_went_back_start_a_new_interval_without_a_decision():
    throttle, pool, clock = _throttle()
    _cold(throttle, pool, clock)
    restarted = Pool()  # a new instance: its counters start again from 0
    throttle.observe(restarted.step(50, 0.050), clock.tick(), hot=True)
    assert throttle.rate == MAX and throttle.decisions == {}, "a restart is no step time"
    assert _hot(throttle, restarted, clock, 0.050) == 1.0, "the next interval starts at the restart"
    assert throttle.step_s == pytest.approx(0.050)
    assert throttle.baseline == pytest.approx(0.010), "the baseline is kept across a restart"


def test_without_a_baseline_the_cap_is_held_at_the_max():
    throttle, pool, clock = _throttle()
    rates = [_hot(throttle, pool, clock, step_s) for step_s in (0.010, 0.100, 1.0)]
    assert rates == [MAX] * 3, "a burst from the first probe on: nothing to compare with"
    assert throttle.baseline is None and throttle.decisions == {("hold", "no_baseline"): 3}


def test_after_the_burst_the_cap_recovers_additively_and_the_baseline_waits_to_settle():
    throttle, pool, clock = _throttle(settle_s=3.0)
    _cold(throttle, pool, clock)
    for _ in range(3):
        _hot(throttle, pool, clock, 0.030)
    assert throttle.rate == 0.25
    recovered = []
    for _ in range(8):  # the burst's sequences still decode slowly for a while
        throttle.observe(pool.step(50, 0.030), clock.tick(), hot=False)
        recovered.append(throttle.rate)
    assert recovered == [0.5, 0.75, 1.0, 1.25, 1.5, 1.75, 2.0, 2.0], "+0.25 a probe, up to the max"
    assert throttle.decisions[("recover", "cold")] == 7
    # the first two cold intervals were under settle_s after the burst: not learnt; then six were
    assert throttle.baseline == pytest.approx(0.030 - 0.020 * 0.8**6)


def test_a_cold_probe_recovers_even_without_steps_to_judge():
    throttle, pool, clock = _throttle()
    _cold(throttle, pool, clock)
    _hot(throttle, pool, clock, 0.030)
    throttle.observe(pool.load(), clock.tick(), hot=False)  # an idle pool after the burst
    assert throttle.rate == 1.25


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"max_rate": 0.0}, "group_rate: must"),
        ({"max_rate": 1.0, "min_rate": 2.0}, "rate_min: must"),
        ({"max_rate": 1.0, "min_rate": 0.0}, "rate_min: must"),
        ({"max_rate": 1.0, "step_ratio": 1.0}, "step_ratio: must"),
        ({"max_rate": 1.0, "step_ratio": float("nan")}, "step_ratio: must"),
        ({"max_rate": 1.0, "decrease": 1.0}, "rate_decrease: must"),
        ({"max_rate": 1.0, "increase": 0.0}, "rate_increase: must"),
        ({"max_rate": 1.0, "min_steps": 0}, "min_steps"),
    ],
)
def test_bad_settings_are_refused(kw, message):
    with pytest.raises(ValueError, match=message):
        ThrottleConfig(**kw)


def test_a_rate_that_is_not_a_number_is_refused_by_config_build():
    """The types are config.build's: the cap's maximum comes in as ``hot_prompts.group_rate``."""
    with pytest.raises(ConfigError, match=r"^group_rate: must be a finite number$"):
        build(HotPromptsConfig, {"group_rate": True, "rate_adaptive": True})
