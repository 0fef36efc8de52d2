"""Policies and governor as plain objects: each rule on its own, no I/O, no clock."""

from __future__ import annotations

import pytest
from autoscale_factory import config, decode_pool, prefill_pool

from disagg_tools.autoscaler.governor import HOLD, SCALE_IN, SCALE_OUT, Governor
from disagg_tools.autoscaler.policy import HOLD as P_HOLD
from disagg_tools.autoscaler.policy import (
    IN,
    OUT,
    DecodePolicy,
    DecodeSignals,
    PrefillPolicy,
    PrefillSignals,
    Proposal,
)


def prefill_signals(**over: object) -> PrefillSignals:
    base = dict(
        ttft_quantile=0.5,
        ttft_samples=100.0,
        pending_tokens=0.0,
        queue_requests=0.0,
        prompt_tokens_quantile=200.0,
        arrival_tokens_per_s=100.0,
        processed_tokens_per_s=100.0,
        busy=False,
    )
    base.update(over)
    return PrefillSignals(**base)  # type: ignore[arg-type]


def decode_signals(**over: object) -> DecodeSignals:
    base = dict(tpot_quantile=0.04, tpot_samples=100.0, kv_used=300.0, kv_free=700.0, active_sequences=8.0)
    base.update(over)
    return DecodeSignals(**base)  # type: ignore[arg-type]


PREFILL = config([prefill_pool()]).pools[0]
DECODE = config([decode_pool()]).pools[0]


@pytest.mark.parametrize(
    ("p99", "direction"),
    [(1.25, OUT), (1.19, P_HOLD), (0.81, P_HOLD), (0.79, IN)],
)
def test_prefill_ttft_rule_out_above_1_2_in_below_0_8(p99: float, direction: int) -> None:
    policy = PrefillPolicy(PREFILL)
    assert policy.propose(prefill_signals(ttft_quantile=p99), size=2).direction == direction


def test_prefill_too_few_samples_do_not_move_the_pool() -> None:
    policy = PrefillPolicy(PREFILL)
    assert policy.propose(prefill_signals(ttft_quantile=9.0, ttft_samples=5), size=2).direction == P_HOLD


def test_prefill_pending_tokens_scale_out_before_ttft_moves() -> None:
    policy = PrefillPolicy(PREFILL)
    # 2 instances x 2000 tok/s: 8000 pending tokens = 2 s of queue > the 1 s target's budget.
    p = policy.propose(prefill_signals(ttft_quantile=0.3, pending_tokens=8000.0), size=2)
    assert p.direction == OUT and "queue_wait_above_budget" in p.reasons
    assert p.detail["queue_wait_s"] == pytest.approx(2.0)


def test_prefill_long_prompts_shrink_the_queue_budget() -> None:
    policy = PrefillPolicy(PREFILL)
    # 1400 pending tokens = 0.35 s of queue at 2 x 2000 tok/s: fine with short prompts...
    short = policy.propose(prefill_signals(pending_tokens=1400.0, prompt_tokens_quantile=100.0), size=2)
    assert short.direction != OUT
    # ...but a p99 prompt of 1400 tokens needs 0.7 s itself, leaving 0.5 s (the floor) for waiting.
    long = policy.propose(prefill_signals(pending_tokens=2400.0, prompt_tokens_quantile=1400.0), size=2)
    assert long.direction == OUT and long.detail["queue_budget_s"] == pytest.approx(0.5)


def test_prefill_token_arrival_rate_above_capacity_scales_out() -> None:
    policy = PrefillPolicy(PREFILL)
    p = policy.propose(prefill_signals(arrival_tokens_per_s=3600.0), size=2)  # 0.9 of 4000
    assert p.direction == OUT and p.reasons == ("token_load_high",)


def test_prefill_scale_in_needs_every_signal_low_at_the_smaller_size() -> None:
    policy = PrefillPolicy(PREFILL)
    # TTFT is low, but one instance fewer would run at 3000/2000 utilisation.
    p = policy.propose(prefill_signals(ttft_quantile=0.2, arrival_tokens_per_s=3000.0), size=2)
    assert p.direction == P_HOLD
    idle = policy.propose(
        prefill_signals(ttft_quantile=None, ttft_samples=0, arrival_tokens_per_s=0.0), size=2
    )
    assert idle.direction == IN and idle.reasons == ("idle",)


def test_prefill_capacity_is_learned_only_from_busy_intervals() -> None:
    pool = config([prefill_pool(capacity_tokens_per_s=None)]).pools[0]
    policy = PrefillPolicy(pool)
    policy.propose(prefill_signals(processed_tokens_per_s=500.0, busy=False), size=1)
    assert policy.capacity is None  # an idle pool's throughput is demand, not capacity
    policy.propose(prefill_signals(processed_tokens_per_s=3000.0, busy=True), size=2)
    assert policy.capacity == pytest.approx(1500.0)


@pytest.mark.parametrize(
    ("over", "direction"),
    [
        ({"tpot_quantile": 0.061}, OUT),
        ({"kv_used": 900.0, "kv_free": 100.0}, OUT),
        ({"tpot_quantile": 0.03, "kv_used": 200.0, "kv_free": 800.0}, IN),
        # low TPOT, but 45 % KV on 2 instances is 90 % on one: hold
        ({"tpot_quantile": 0.03, "kv_used": 450.0, "kv_free": 550.0}, P_HOLD),
        ({"tpot_quantile": 0.045}, P_HOLD),
    ],
)
def test_decode_tpot_and_kv_rules(over: dict[str, float], direction: int) -> None:
    assert DecodePolicy(DECODE).propose(decode_signals(**over), size=2).direction == direction


def test_governor_confirms_cools_down_and_bounds() -> None:
    pool = config([prefill_pool(scale_out_after=2, scale_in_after=3, max_size=3)]).pools[0]
    g = Governor(pool)
    out, inn, hold = Proposal(OUT, ("x",)), Proposal(IN, ("y",)), Proposal(P_HOLD, ())
    assert g.decide(out, 1, 0.0).reason == "confirming"
    d = g.decide(out, 1, 10.0)
    assert (d.kind, d.desired) == (SCALE_OUT, 2)
    g.decide(out, 2, 20.0)
    assert g.decide(out, 2, 30.0).reason == "cooldown"  # 20 s since the change < 30 s
    assert g.decide(out, 2, 40.0).kind == SCALE_OUT
    g.decide(out, 3, 80.0)
    assert g.decide(out, 3, 90.0).reason == "at_max"
    for t in (100.0, 110.0):
        assert g.decide(inn, 3, t).reason == "confirming"
    assert g.decide(hold, 3, 115.0).kind == HOLD  # a hold resets the streak
    for t in (120.0, 130.0):
        assert g.decide(inn, 3, t).kind == HOLD
    d = g.decide(inn, 3, 140.0)
    assert (d.kind, d.desired) == (SCALE_IN, 2)


def test_governor_never_goes_below_min_and_repairs_out_of_bounds_sizes() -> None:
    pool = config([prefill_pool(min_size=2, max_size=3, scale_in_after=1)]).pools[0]
    g = Governor(pool)
    assert g.decide(Proposal(IN, ()), 2, 0.0).reason == "at_min"
    d = g.decide(Proposal(P_HOLD, ()), 1, 10.0)  # e.g. a restarted server came back with 1
    assert (d.kind, d.desired) == (SCALE_OUT, 2)
    d = g.decide(Proposal(P_HOLD, ()), 5, 20.0)
    assert (d.kind, d.desired) == (SCALE_IN, 4)


def test_governor_fail_static_holds_and_restarts_the_streak() -> None:
    pool = config([prefill_pool(scale_out_after=2)]).pools[0]
    g = Governor(pool)
    out = Proposal(OUT, ("x",))
    g.decide(out, 1, 0.0)
    d = g.fail_static(1, "stale")
    assert (d.kind, d.desired, d.fail_static, d.reason) == (HOLD, 1, True, "stale")
    assert g.decide(out, 1, 20.0).reason == "confirming"  # the gap broke the streak
