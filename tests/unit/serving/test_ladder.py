"""The ladder's order while the decode pool is gone, and where a stream that fell from a rung goes."""

from __future__ import annotations

from disagg.serving.health import HealthConfig, PoolHealth
from disagg.serving.ladder import COLOCATED, DEFAULT_LADDERS, DISAGGREGATED, LOCAL, SHED, Ladder, Route


def _ladder(**options: bool) -> Ladder:
    health = {pool: PoolHealth(pool, HealthConfig()) for pool in ("prefill", "decode", "colocated")}
    return Ladder(DEFAULT_LADDERS[DISAGGREGATED], health, **options)


def test_a_gone_decode_pool_puts_colocated_before_local_and_a_saturated_one_does_not() -> None:
    ladder = _ladder()
    assert ladder.order() == (DISAGGREGATED, LOCAL, COLOCATED, SHED)
    ladder.health["decode"].refused()
    assert ladder.order() == (DISAGGREGATED, LOCAL, COLOCATED, SHED)
    assert ladder.route() == Route(LOCAL, DISAGGREGATED, "decode_saturated")
    ladder.health["decode"].failed("dead")
    assert ladder.order() == (DISAGGREGATED, COLOCATED, LOCAL, SHED)
    assert ladder.route() == Route(COLOCATED, DISAGGREGATED, "decode_gone")
    assert _ladder(colocated_first_when_decode_gone=False).order() == DEFAULT_LADDERS[DISAGGREGATED]


def test_a_stream_falls_to_every_rung_it_has_not_tried_whichever_order_it_was_routed_in() -> None:
    """On `local` while decode was saturated, then decode dies and the prefill pool fails: colocated
    still takes it. On `colocated` while decode is gone and the colocated pool fails: local does."""
    ladder = _ladder()
    ladder.health["decode"].failed("dead")
    assert ladder.route(after=LOCAL, reason="prefill_failed") == Route(COLOCATED, LOCAL, "prefill_failed")
    assert ladder.route(after=COLOCATED, reason="colocated_failed") == Route(
        LOCAL, COLOCATED, "colocated_failed"
    )
    assert ladder.route(after=DISAGGREGATED, reason="decode_failed") == Route(
        COLOCATED, DISAGGREGATED, "decode_failed"
    )
    ladder.health["colocated"].failed("dead")
    assert ladder.route(after=LOCAL, reason="prefill_failed") == Route(SHED, LOCAL, "prefill_failed")
