"""The router as a table: (request state, pools, outcome) -> action, for every rung and every reason.
No asyncio, no pools: the router is pure."""

from __future__ import annotations

import pytest

from disagg.protocol.errors import (
    CANCELLED,
    DEADLINE,
    INTERNAL,
    INVALID_ARG,
    UNAVAILABLE,
    Reason,
    ServingError,
)
from disagg.serving.health import PoolHealth
from disagg.serving.ladder import COLOCATED, DEFAULT_LADDERS, DISAGGREGATED, LOCAL, RUNGS, SHED, Ladder, Route
from disagg.serving.router import (
    HOT_BUCKET,
    HOT_COLD,
    HOT_POOL_ROUTE,
    HOT_SHARED,
    Disaggregate,
    Finish,
    Generate,
    GiveUp,
    Migrate,
    PoolsView,
    RequestState,
    Router,
    RouterConfig,
    Shed,
    SkipLocal,
)

NEW = RequestState(prompt_tokens=300, max_tokens=200, min_length=150)
RESUMED = RequestState(prompt_tokens=300, max_tokens=200, min_length=150, generated=40, admitted=True)
ROUTER = Router(RouterConfig(local_max_tokens=100, migration_limit=2, conditional_prefill_tokens=64))


def _ladder(**states: str) -> Ladder:
    """Every pool deployed and healthy, except those named: "gone" or "saturated"."""
    health = {pool: PoolHealth(pool) for pool in ("prefill", "decode", "colocated")}
    for pool, state in states.items():
        health[pool].failed("call_failed") if state == "gone" else health[pool].refused()
    return Ladder(DEFAULT_LADDERS[DISAGGREGATED], health)


def _view(prefill_ttft_s: float | None = None, decode_healthy: bool = True, **states: str) -> PoolsView:
    return PoolsView(_ladder(**states), decode_healthy, prefill_ttft_s)


@pytest.mark.parametrize(
    ("states", "priority", "rung", "reason"),
    [
        ({}, 0, DISAGGREGATED, ""),
        ({"decode": "saturated"}, 0, LOCAL, "decode_saturated"),
        ({"decode": "saturated"}, -1, SHED, "sheddable_while_degraded"),
        ({"decode": "gone"}, 0, COLOCATED, "decode_gone"),  # colocated before local while decode is gone
        ({"prefill": "gone", "colocated": "gone"}, 0, SHED, "prefill_gone"),
    ],
)
def test_a_new_request_starts_on_the_first_rung_that_can_serve(states, priority, rung, reason):
    route = ROUTER.start(_ladder(**states), RequestState(300, 200, priority=priority))
    assert (route.rung, route.reason) == (rung, reason)


def test_a_sheddable_request_may_fall_when_shedding_is_off():
    router = Router(RouterConfig(shed_sheddable_when_degraded=False))
    assert router.start(_ladder(decode="saturated"), RequestState(300, 200, priority=-1)).rung == LOCAL


def test_a_resumed_stream_leaves_the_disaggregated_rung_and_a_new_one_stays():
    ladder = _ladder()
    route = Route(DISAGGREGATED)
    assert ROUTER.resume(ladder, route, NEW) == route
    assert ROUTER.resume(ladder, route, RESUMED) == Route(LOCAL, DISAGGREGATED, "resumed")
    assert ROUTER.resume(ladder, Route(COLOCATED), RESUMED) == Route(COLOCATED)


@pytest.mark.parametrize(
    ("route", "request_", "view", "action"),
    [
        (Route(SHED, DISAGGREGATED, "decode_gone"), NEW, _view(), Shed("decode gone")),
        (Route(SHED), NEW, _view(), Shed("no pool can serve")),
        (Route(DISAGGREGATED), NEW, _view(), Disaggregate("decode", admit_on="prefill")),
        (Route(DISAGGREGATED), RESUMED, _view(), Disaggregate("decode")),
        # conditional disaggregation: a short prompt, the prefill pool backlogged, decode healthy
        (
            Route(DISAGGREGATED),
            RequestState(64, 20, 5),
            _view(0.3),
            Generate("decode", 20, 5, conditional=True),
        ),
        (Route(DISAGGREGATED), RequestState(65, 20), _view(0.3), Disaggregate("decode", admit_on="prefill")),
        (Route(DISAGGREGATED), RequestState(64, 20), _view(0.2), Disaggregate("decode", admit_on="prefill")),
        (Route(DISAGGREGATED), RequestState(64, 20), _view(None), Disaggregate("decode", admit_on="prefill")),
        (
            Route(DISAGGREGATED),
            RequestState(64, 20),
            _view(0.3, decode_healthy=False),
            Disaggregate("decode", admit_on="prefill"),
        ),
        # the local rung caps the output at what was streamed + local_max_tokens, min_length with it
        (Route(LOCAL), NEW, _view(), Generate("prefill", 100, 100, capped=True, admit_on="prefill")),
        (Route(LOCAL), RESUMED, _view(), Generate("prefill", 140, 140, capped=True)),
        (Route(LOCAL), RequestState(300, 50, 10), _view(), Generate("prefill", 50, 10, admit_on="prefill")),
        (Route(LOCAL), RequestState(300, 200, generated=200, admitted=True), _view(), Finish()),
        (Route(COLOCATED), NEW, _view(), Generate(COLOCATED, 200, 150, admit_on=COLOCATED)),
        (Route(COLOCATED), RESUMED, _view(), Generate(COLOCATED, 200, 150)),
    ],
)
def test_what_runs_on_a_route(route, request_, view, action):
    assert ROUTER.action(route, request_, view, "decode") == action


def test_every_rung_has_an_action():
    for rung in RUNGS:
        assert ROUTER.action(Route(rung), NEW, _view(), "decode") is not None


def test_a_hot_request_decodes_on_the_hot_pool_and_else_waits_for_its_bucket():
    assert ROUTER.hot(Route(DISAGGREGATED), False, True, True) == HOT_COLD
    assert ROUTER.hot(Route(DISAGGREGATED), True, True, True) == HOT_POOL_ROUTE
    assert ROUTER.hot(Route(LOCAL), True, True, True) == HOT_BUCKET  # only disaggregated decodes there
    assert ROUTER.hot(Route(DISAGGREGATED), True, False, True) == HOT_BUCKET
    assert ROUTER.hot(Route(DISAGGREGATED), True, False, False) == HOT_SHARED
    assert ROUTER.action(Route(DISAGGREGATED), RESUMED, _view(), "decode_hot") == Disaggregate("decode_hot")


def _expected_failover(reason: Reason, pool: str) -> object:
    if reason is Reason.LEASE_LOST:
        return Migrate(pool, "kv_lease_lost")
    return Migrate(pool, f"{pool}_failed")


@pytest.mark.parametrize("reason", list(Reason))
@pytest.mark.parametrize("rung", [DISAGGREGATED, LOCAL, COLOCATED])
def test_after_an_unavailable_pool_the_stream_migrates_whatever_the_reason(rung, reason):
    """Every reason of an UNAVAILABLE failure on a running pool moves the stream down (the pool's
    health hears of it: full, dead, lost ... ``Orchestrator.pool_failed``), a lost lease as
    ``kv_lease_lost`` (the decode pool is fine); only an unsupported job on the local rung skips it."""
    pool = Route(rung).pools[0]
    error = ServingError(UNAVAILABLE, "m", reason)
    failover = ROUTER.on_failure(Route(rung), NEW, error, pool)
    if rung == LOCAL and reason is Reason.UNSUPPORTED:
        assert failover == SkipLocal()
    else:
        assert failover == _expected_failover(reason, pool)


@pytest.mark.parametrize("code", [INVALID_ARG, CANCELLED, DEADLINE, INTERNAL])
def test_a_failure_that_is_no_pool_s_ends_the_request(code):
    for rung in (DISAGGREGATED, COLOCATED):
        assert ROUTER.on_failure(Route(rung), NEW, ServingError(code, "m"), Route(rung).pools[0]) == GiveUp()


def test_an_unsupported_job_on_the_local_rung_skips_it_unless_the_request_ended():
    unsupported = ServingError(INVALID_ARG, "a prefill pool does not run generate jobs", Reason.UNSUPPORTED)
    assert ROUTER.on_failure(Route(LOCAL), NEW, unsupported, "prefill") == SkipLocal()
    ended = RequestState(300, 200, finished=True)
    assert ROUTER.on_failure(Route(LOCAL), ended, unsupported, "prefill") == GiveUp()


def test_no_migration_without_a_running_pool_after_the_end_or_past_the_limit():
    lost = ServingError(UNAVAILABLE, "m", Reason.LOST)
    assert ROUTER.on_failure(Route(DISAGGREGATED), NEW, lost, None) == GiveUp()  # refused before any pool
    assert (
        ROUTER.on_failure(Route(DISAGGREGATED), RequestState(300, 200, finished=True), lost, "decode")
        == GiveUp()
    )
    worn = RequestState(300, 200, migrations=2)
    assert ROUTER.on_failure(Route(DISAGGREGATED), worn, lost, "decode") == GiveUp(blame="decode")
    once = RequestState(300, 200, migrations=1)
    assert ROUTER.on_failure(Route(DISAGGREGATED), once, lost, "decode") == Migrate("decode", "decode_failed")
