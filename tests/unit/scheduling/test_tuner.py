"""The decode batch tuner's rules, one at a time, on hand-made intervals; the decode scheduler under its
limit; and the loop feeding it (its limit and decisions in the pool's stats)."""

from __future__ import annotations

import pytest
from scheduler_fakes import FakeBackend, decode_job

from disagg.pool.runner import Runner
from disagg.protocol.errors import UNAVAILABLE
from disagg.protocol.messages import Failed
from disagg.scheduling import DecodeScheduler
from disagg.scheduling.tuner import BatchTuner, TunerConfig, batch_knee

SLO = 0.050


class Clocked(BatchTuner):
    """A tuner that remembers the time of its last observation (the tests' clock)."""

    now = 0.0

    def observe(self, now: float, *args, **kw):
        self.now = now
        return super().observe(now, *args, **kw)


def tuner(start: int = 32, max_batch: int = 64, **kw) -> Clocked:
    t = Clocked(TunerConfig(tpot_slo_s=SLO, start=start, interval_s=1.0, **kw), max_batch)
    assert t.observe(0.0, 0, 0.0) is None  # its first interval starts at 0
    return t


def interval(
    t: Clocked,
    batch: int,
    step_s: float,
    busy: float = 1.0,
    bound: bool = False,
    demand: int = 0,
):
    """Decode steps over ``batch`` sequences, ``step_s`` apart from the last observation, the engine
    busy for ``busy`` of each, until the interval ends; returns the decision that closes it."""
    begin = t.now
    for k in range(1, 1000):
        decision = t.observe(begin + k * step_s, batch, busy * step_s, bound, demand)
        if decision is not None:
            return decision
    raise AssertionError("the interval never ended")


def test_the_knee_is_the_smallest_batch_near_the_best_throughput_under_the_slo():
    # step times of a bandwidth-bound decode: 10 ms + 1 ms per sequence
    points = [(b, 0.010 + 0.001 * b) for b in (1, 2, 4, 8, 16, 32, 64)]
    # within 50 ms: batches up to 32 (42 ms); best throughput at 32 (762/s); 90 % of it is 686/s:
    # batch 16 gives 615/s, batch 32 762/s -> the knee is 32
    assert batch_knee(points, 0.050) == 32
    assert batch_knee(points, 0.050, share=0.8) == 16
    with pytest.raises(ValueError, match="TPOT SLO"):
        batch_knee(points, 0.005)


def test_a_tpot_breach_shrinks_by_ten_percent_and_caps_growth_below_it():
    t = tuner(start=40)
    d = interval(t, batch=40, step_s=0.080, bound=True, demand=50)
    assert (d.action, d.reason, d.limit) == ("shrink", "tpot_slo", 36)
    assert d.tpot_s == pytest.approx(0.080)
    # under the SLO again and slot-bound: it grows, but never back to the limit that breached
    d = interval(t, batch=36, step_s=0.030, bound=True, demand=60)
    assert (d.action, d.reason, d.limit) == ("grow", "under_slo", 39)


def test_low_utilisation_shrinks_toward_the_batch_in_use_never_below_it():
    t = tuner(start=8)
    assert interval(t, batch=8, step_s=0.020, bound=True, demand=32).limit == 32
    d = interval(t, batch=20, step_s=0.020, busy=0.5)
    assert (d.action, d.reason, d.limit) == ("shrink", "low_utilisation", 28)
    for _ in range(5):
        d = interval(t, batch=20, step_s=0.020, busy=0.5)
    assert t.limit == 20 and d.action == "hold", "the floor is the largest batch the interval used"


def test_an_idle_pool_comes_back_to_its_start_and_a_burst_grows_it_to_the_demand_at_once():
    t = tuner(start=8)
    assert interval(t, batch=8, step_s=0.015, bound=True, demand=40).limit == 40
    for _ in range(40):
        t.observe(t.now + 0.5, 0, 0.0)
    assert t.limit == 8, "never below the start: the next burst would wait for slots"
    d = interval(t, batch=8, step_s=0.015, bound=True, demand=24)
    assert (d.action, d.reason, d.limit) == ("grow", "under_slo", 24)


def test_growth_is_by_ten_percent_at_least_one_and_stops_at_the_engine_limit():
    t = tuner(start=60)
    d = interval(t, batch=60, step_s=0.020, bound=True, demand=61)
    assert d.limit == 64 and d.action == "grow"
    d = interval(t, batch=64, step_s=0.020, bound=True, demand=70)
    assert d.limit == 64 and d.action == "hold"
    small = tuner(start=3)
    assert interval(small, batch=3, step_s=0.020, bound=True, demand=3).limit == 4


def test_near_the_slo_or_without_a_full_batch_it_holds():
    t = tuner(start=32)
    near = interval(t, batch=32, step_s=0.047, bound=True, demand=40)  # within the 10 % margin
    assert (near.action, near.limit) == ("hold", 32)
    busy_not_bound = interval(t, batch=32, step_s=0.030)
    assert (busy_not_bound.action, busy_not_bound.limit) == ("hold", 32)
    assert t.decisions == {("hold", "steady"): 2}


def test_too_few_tokens_are_not_judged_against_the_slo():
    t = tuner(start=8, min_tokens=32)
    # one sequence, slow steps: 9 tokens in the interval, fewer than min_tokens
    d = interval(t, batch=1, step_s=0.100, bound=True, demand=2)
    assert d.tpot_s is None and d.action == "grow"


def test_the_config_refuses_what_it_cannot_mean():
    for bad in ({"tpot_slo_s": -1}, {"min_batch": 0}, {"shrink": 1.5}, {"interval_s": 0}):
        with pytest.raises(ValueError):
            TunerConfig(**bad)
    assert not TunerConfig().enabled


def test_the_decode_scheduler_keeps_to_the_limit_and_reports_who_waits_for_a_slot():
    backend = FakeBackend(max_batch_size=8)
    scheduler = DecodeScheduler(backend.limits)
    scheduler.batch_limit = 2
    for name in "abcd":
        scheduler.add(decode_job(name, max_tokens=4))
    plan = scheduler.schedule()
    assert [j.handle for j in plan.imports] == ["a", "b"]
    assert scheduler.slot_waiting == 2, "c and d have their blocks free: only the limit holds them"
    scheduler.postprocess(Runner(backend).run(plan))
    scheduler.batch_limit = 1  # lowered below the running batch: nobody is cut, nobody new joins
    plan = scheduler.schedule()
    assert not plan.imports and plan.decode and scheduler.num_running == 2


def test_a_limit_above_what_the_kv_holds_makes_sequences_wait_never_fail():
    """Blocks are reserved for a sequence's whole length when it joins, so a grown limit can never
    exhaust the KV mid-stream: sequences that do not fit wait (and are not slot-bound)."""
    backend = FakeBackend(num_blocks=4, block_size=4, max_batch_size=8)
    scheduler = DecodeScheduler(backend.limits)
    for name in "abcd":
        scheduler.add(decode_job(name))  # 2 blocks each: two fit
    runner, emissions = Runner(backend), []
    while not scheduler.idle:
        plan = scheduler.schedule()
        assert scheduler.slot_waiting == 0
        emissions += scheduler.postprocess(runner.run(plan))
        assert scheduler.ledger.reserved == backend.usage().used <= 4
    assert not [e for e in emissions if isinstance(e.event, Failed) and e.event.error.code == UNAVAILABLE]
    assert sorted(e.job.handle for e in emissions if e.final) == list("abcd")
