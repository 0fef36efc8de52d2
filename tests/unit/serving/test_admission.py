"""Admission by capacity: the predicted TTFT from a pool's backlog and measured throughput, early
refusal above the margin (sheddable requests first), and the backlog this orchestrator adds between
two probes."""

from __future__ import annotations

import re

import pytest

from disagg.protocol.errors import UNAVAILABLE, ServingError
from disagg.protocol.messages import PoolLoad
from disagg.serving.admission import MAX_RETRY_S, Admission, AdmissionConfig


def _load(queued_tokens: int, done: int, busy_s: float) -> PoolLoad:
    return PoolLoad(1, queued_tokens, 0, 0, 100, prompt_tokens_done=done, busy_s=busy_s)


def _measured(config: AdmissionConfig) -> Admission:
    """A prefill pool that prefilled 1,000 tokens in 1 s of engine time, with 1,500 tokens waiting."""
    admission = Admission(config)
    admission.observe("prefill", _load(0, 0, 0.0))
    admission.observe("prefill", _load(1500, 1000, 1.0))
    return admission


def test_the_prediction_is_backlog_over_throughput():
    admission = _measured(AdmissionConfig(margin=2.0, ttft_slo_s=1.0))
    assert admission.predict_ttft("prefill", 300) == pytest.approx(1.8)
    assert admission.predict_ttft("decode", 300) is None, "no estimate for a pool never probed"


def test_a_request_that_would_wait_too_long_is_refused_with_a_retry_hint_and_others_pass():
    admission = _measured(AdmissionConfig(margin=2.0, ttft_slo_s=1.0))  # 1,500 tokens wait, 1,000/s
    admission.admit("prefill", 300)  # waits 1.5 s <= 2 x 1 s
    admission.admit("prefill", 300)  # waits 1.8 s (its TTFT 2.1 s: its own prefill is not held against it)
    with pytest.raises(ServingError) as refused:
        admission.admit("prefill", 300)  # waits 2.1 s: 1,500 + 2 x 300 ahead
    assert refused.value.code == UNAVAILABLE
    assert "would wait 2.1 s" in refused.value.message
    assert "predicted time to first token 2.4 s" in refused.value.message
    assert "retry after 1 s" in refused.value.message
    admission.observe("prefill", _load(0, 3100, 3.1))  # the backlog drained: admitted again
    admission.admit("prefill", 300)


def test_a_long_prompt_is_judged_by_its_wait_against_its_own_prefill_not_its_length():
    """On a pool of 575 tokens/s a 1,150-token prompt takes 2 s, longer than the 1 s SLO: its target is
    its own prefill, so with margin 2 it may wait 4 s. Behind one such prompt another waits 2 s (its
    TTFT will be 4 s) and is admitted, a third waits 4 s and is admitted, a fourth (6 s) is refused; a
    300-token prompt (0.5 s, so its target is the 1 s SLO) is refused already behind two of them."""
    admission = Admission(AdmissionConfig(margin=2.0, ttft_slo_s=1.0))
    admission.observe("prefill", _load(0, 0, 0.0))
    admission.observe("prefill", _load(1150, 575, 1.0))
    admission.admit("prefill", 1150)  # waits 2 s
    with pytest.raises(ServingError, match=r"would wait 4\.0 s for its turn, over 2 x its 1 s target"):
        admission.admit("prefill", 300)  # waits 4 s: over 2 x 1 s
    admission.admit("prefill", 1150)  # waits 4 s: within 2 x its own 2 s
    with pytest.raises(ServingError, match=r"would wait 6\.0 s for its turn, over 2 x its 2 s target"):
        admission.admit("prefill", 1150)


def test_a_prompt_too_long_for_the_target_alone_is_admitted_to_an_empty_pool():
    admission = Admission(AdmissionConfig(margin=1.0, ttft_slo_s=1.0))
    admission.observe("prefill", _load(0, 0, 0.0))
    admission.observe("prefill", _load(0, 1000, 1.0))  # 1,000 tokens/s, nothing waiting
    admission.admit("prefill", 5000)  # 5 s alone: refusing it would leave it no way to be served
    with pytest.raises(ServingError):
        admission.admit("prefill", 10)  # behind it: 5.01 s


def test_sheddable_requests_are_refused_first():
    admission = _measured(AdmissionConfig(margin=2.0, sheddable_margin=1.0, ttft_slo_s=1.0))
    with pytest.raises(ServingError):
        admission.admit("prefill", 300, priority=-1)  # waits 1.5 s > 1 x 1 s
    admission.admit("prefill", 300, priority=0)
    admission.admit("prefill", 100, priority=5)


def test_off_without_a_margin():
    off = _measured(AdmissionConfig(margin=0.0))
    for _ in range(100):
        off.admit("prefill", 10_000)


def test_a_pool_of_unknown_speed_gets_a_bounded_backlog():
    """Before any throughput estimate a flood is not admitted whole: the backlog is held to the cold
    budget (a prompt alone always fits an empty pool), and the first probe showing engine time
    gives the estimate from the counters since the instance started."""
    cold = Admission(AdmissionConfig(margin=1.0, cold_backlog_tokens=1000))
    cold.admit("prefill", 5000)  # never probed, nothing waiting: a prompt alone is admitted
    with pytest.raises(ServingError) as refused:
        cold.admit("prefill", 10)
    assert refused.value.code == UNAVAILABLE and "warming up" in refused.value.message
    assert "retry after 1 s" in refused.value.message
    cold.observe("prefill", _load(0, 0, 0.0))  # probed, idle, nothing computed yet: still cold
    for _ in range(3):
        cold.admit("prefill", 300)
    with pytest.raises(ServingError):
        cold.admit("prefill", 300)  # 900 + 300 > 1000
    assert cold.predict_ttft("prefill", 0) is None
    cold.observe("prefill", _load(600, 900, 0.5))  # first computed: 1,800 tokens/s since start
    assert cold.predict_ttft("prefill", 300) == pytest.approx(0.5)


def test_the_throughput_is_prompt_tokens_per_second_of_prefill_not_of_decode():
    """A pool that decodes too (colocated, or a decode pool that prefills short prompts) spends
    engine time on decode steps: its prompts are no slower for it. A pool too old to report its
    prefill time is judged by all its engine time."""
    admission = Admission(AdmissionConfig(margin=1.0))
    admission.observe("colocated", PoolLoad(0, 0, 0, 0, 100))
    busy = PoolLoad(1, 1000, 0, 0, 100, prompt_tokens_done=1000, busy_s=2.0, prefill_busy_s=0.5)
    admission.observe("colocated", busy)  # 1,000 tokens in 0.5 s of its 2 s: 2,000 tokens/s
    assert admission.predict_ttft("colocated", 1000) == pytest.approx(1.0)
    old = Admission(AdmissionConfig(margin=1.0))
    old.observe("colocated", PoolLoad(0, 0, 0, 0, 100))
    old.observe("colocated", PoolLoad(1, 1000, 0, 0, 100, prompt_tokens_done=1000, busy_s=2.0))
    assert old.predict_ttft("colocated", 1000) == pytest.approx(4.0)


def test_throughput_ignores_idle_intervals_and_restarted_counters():
    admission = _measured(AdmissionConfig(margin=1.0))
    admission.observe("prefill", _load(0, 1000, 1.0))  # idle: no engine time between the probes
    admission.observe("prefill", _load(0, 10, 0.1))  # restarted instance: counters went back
    admission.observe("prefill", _load(1000, 510, 0.6))  # 500 tokens in 0.5 s: the same rate
    assert admission.predict_ttft("prefill", 0) == pytest.approx(1.0)


def test_a_request_that_left_the_pool_no_longer_counts_in_its_backlog():
    """A finished request leaves the backlog when released, not at the next probe: until then it
    refused requests to an idle pool (a short request served, then a burst sent before the probe,
    found every burst request behind a backlog that was gone)."""
    admission = Admission(AdmissionConfig(margin=1.0, ttft_slo_s=0.3))
    admission.observe("prefill", _load(0, 0, 0.0))
    admission.observe("prefill", _load(0, 100, 1.0))  # 100 tokens/s: a 300-token prompt takes 3 s
    first = admission.admit("prefill", 300)  # an empty pool: admitted, however long
    with pytest.raises(ServingError):
        admission.admit("prefill", 30)  # it would wait 3 s behind the first, over its 0.3 s
    admission.release(first)
    assert admission.predict_ttft("prefill", 300) == pytest.approx(3.0)
    admission.admit("prefill", 300)  # nothing waits ahead any more: admitted


def test_a_release_after_a_probe_takes_the_request_out_of_the_probed_queue():
    admission = _measured(AdmissionConfig(margin=2.0, ttft_slo_s=1.0))  # 1,500 waiting at 1,000/s
    before = admission.admit("prefill", 400)
    admission.observe("prefill", _load(1900, 1000, 1.0))  # the probe counts it among the 1,900 waiting
    after = admission.admit("prefill", 100)
    assert admission.predict_ttft("prefill", 0) == pytest.approx(2.0)
    admission.release(before)  # left the pool since the probe
    assert admission.predict_ttft("prefill", 0) == pytest.approx(1.6)
    admission.release(after)  # admitted since the probe: out of what was added since
    assert admission.predict_ttft("prefill", 0) == pytest.approx(1.5)
    late = admission.admit("prefill", 50)
    admission.observe("prefill", _load(0, 2000, 2.0))  # prefilled before the probe, released after it
    admission.release(late)
    assert admission.predict_ttft("prefill", 0) == 0.0, "never below an empty pool"
    admission.admit("prefill", 10)
    assert admission.predict_ttft("prefill", 0) == pytest.approx(0.01)


def _hint(admission: Admission, prompt_tokens: int) -> float:
    """The retry hint of a request ``admission`` refuses, in seconds."""
    with pytest.raises(ServingError) as refused:
        admission.admit("prefill", prompt_tokens)
    return float(re.search(r"retry after (\S+) s", refused.value.message).group(1))


def test_refused_requests_are_given_retry_slots_one_prefill_apart():
    """Requests refused together are not all told "1 s": each gets the next slot, one prompt's
    prefill after the last (here 300 tokens at 1,000 tokens/s), from when the backlog has room."""
    now = [100.0]
    admission = Admission(AdmissionConfig(margin=1.0, ttft_slo_s=1.0), clock=lambda: now[0])
    admission.observe("prefill", _load(0, 0, 0.0))
    admission.observe("prefill", _load(2700, 1000, 1.0))  # 2.7 s waiting at 1,000 tokens/s

    def hint() -> float:
        return _hint(admission, 300)

    assert [hint() for _ in range(3)] == [1.7, 2.0, 2.3]  # room after 2.7 - 1.0 s, then a slot each
    now[0] += 2.0
    admission.observe("prefill", _load(1500, 2700, 2.7))  # drained to 1,500 waiting: room in 0.5 s
    assert hint() == 1.0  # MIN_RETRY_S, which also outlasts the last slot (0.6 s from now)
    assert hint() == 1.3
    now[0] += 60.0  # slots long past: back to the backlog's own wait, at least MIN_RETRY_S
    assert hint() == 1.0
    hints = [hint() for _ in range(200)]
    assert max(hints) <= MAX_RETRY_S, "a slot is never further ahead than MAX_RETRY_S"


def test_refusals_beyond_the_horizon_are_spread_not_heaped_at_it():
    """Once the slots reach MAX_RETRY_S ahead, each further refusal gets a different time in the
    horizon's second half, and the slots themselves stop growing: when time has passed, the next
    refusal is one prefill after the last slot handed out, not after the spread ones."""
    now = [0.0]
    admission = Admission(AdmissionConfig(margin=1.0, ttft_slo_s=1.0), clock=lambda: now[0])
    admission.observe("prefill", _load(0, 0, 0.0))
    admission.observe("prefill", _load(5000, 1000, 1.0))  # 5 s waiting at 1,000 tokens/s

    def hint() -> float:
        return _hint(admission, 1000)  # slots 1 s apart

    slots = [hint() for _ in range(27)]
    assert slots == [float(s) for s in range(4, 31)], "one prefill apart up to the horizon"
    spread = [hint() for _ in range(40)]
    assert all(MAX_RETRY_S / 2 <= s <= MAX_RETRY_S for s in spread), spread
    assert len(set(spread)) >= 35, f"spread, not heaped at the cap: {sorted(spread)}"
    now[0] += 10.0  # the last slot (30 s) ended 31 s after the start: 21 s from now
    assert hint() == 21.0
