"""The planner in the autoscaler: recommendations from observed length histograms, dry run and floor."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from autoscale_factory import (
    ACTIVE,
    KV_FREE,
    KV_USED,
    PENDING,
    PROMPT,
    QUEUE,
    TIME_BUCKETS,
    TPOT,
    TTFT,
    FakeClock,
    FakeExporter,
    TextSource,
    config,
    decode_exporter,
    decode_pool,
    prefill_pool,
)

from disagg_tools.autoscaler.actuator import LogActuator
from disagg_tools.autoscaler.config import AutoscalerConfig, ConfigError, ScaledPool, build_config
from disagg_tools.autoscaler.controller import OUTPUT
from disagg_tools.autoscaler.governor import HOLD, SCALE_OUT
from disagg_tools.autoscaler.histogram import Histogram
from disagg_tools.autoscaler.recommender import (
    MET,
    TOO_LITTLE,
    UNMET,
    Observed,
    Recommender,
    TrafficWindow,
    load_recommender,
)
from disagg_tools.autoscaler.runner import Runner
from disagg_tools.planner.profile import Fit, Profile

# the server's token buckets (disagg.serving.telemetry.TOKEN_BUCKETS) and +Inf
SERVER_TOKEN_BOUNDS = (*(float(2**i) for i in range(14)), float("inf"))
L = {"model": "prefill", "path": "disaggregated"}
D = {"model": "decode", "path": "disaggregated"}

# One instance of each pool, by hand: a prefill step costs 1 ms per prompt token; a decode step
# 5 ms plus 2 ms per sequence in the batch (so TPOT grows with the number of sequences decoding).
PROFILE = Profile(Fit((0.0, 1e-3, 0.0), 0.0, 0.0), Fit((0.005, 0.002, 0.0), 0.0, 0.0))


def histogram(counts: dict[float, float]) -> Histogram:
    """A windowed histogram with `counts[upper bound]` observations in each bucket."""
    cumulative, total = [], 0.0
    for bound in SERVER_TOKEN_BOUNDS:
        total += counts.get(bound, 0.0)
        cumulative.append(total)
    mass = sum(b * c for b, c in counts.items())
    return Histogram(SERVER_TOKEN_BOUNDS, tuple(cumulative), mass, total)


def planner_config(**planner: Any) -> AutoscalerConfig:
    return config(
        [prefill_pool(max_size=6, capacity_tokens_per_s=None), decode_pool(max_size=6)],
        planner={"enabled": True, "profile": "unused.json", **planner},
    )


def recommender(cfg: AutoscalerConfig) -> Recommender:
    """The planner with the hand-made profile, under the pools' SLOs (TTFT 1 s, TPOT 50 ms)."""
    by_role = {p.role: p for p in cfg.pools}
    return Recommender(cfg.planner, by_role["prefill"], by_role["decode"], PROFILE)


def observed(prompts: dict[float, float], outputs: dict[float, float], seconds: float = 60.0) -> Observed:
    prompt, output = histogram(prompts), histogram(outputs)
    return Observed(prompt.count, seconds, prompt, output)


def test_longer_prompts_ask_for_more_prefill_and_longer_outputs_for_more_decode_at_the_same_rate() -> None:
    rec = recommender(planner_config())
    # 240 requests in a minute (4 req/s) each time; only the length histograms differ
    base = rec.recommend(observed({128.0: 240}, {32.0: 240}), now=0.0)
    longer_prompts = rec.recommend(observed({512.0: 240}, {32.0: 240}), now=1.0)
    longer_outputs = rec.recommend(observed({128.0: 240}, {512.0: 240}), now=2.0)
    assert base.rate_rps == longer_prompts.rate_rps == longer_outputs.rate_rps == 4.0
    assert (base.prefill, base.decode, base.reason) == (1, 1, MET)
    assert longer_prompts.prefill is not None and longer_prompts.prefill > base.prefill
    assert longer_prompts.decode == base.decode
    assert longer_outputs.decode is not None and longer_outputs.decode > base.decode
    assert longer_outputs.prefill == base.prefill
    for r in (base, longer_prompts, longer_outputs):
        assert r.reason == MET and r.attainment is not None and r.attainment >= 0.9
        assert r.tried[0][:2] == (1, 1) and r.tried[-1][:2] == (r.prefill, r.decode)
    # the same window twice: the same answer (a fixed seed)
    assert rec.recommend(observed({512.0: 240}, {32.0: 240}), now=3.0) == longer_prompts


def test_a_target_out_of_reach_stops_at_the_bound_of_the_pool_that_misses() -> None:
    # prompts of 1025..2048 tokens take 1..2 s to prefill alone: a 1 s TTFT is out of reach however
    # many prefill instances; decode meets its TPOT from the start and is not grown for nothing
    rec = recommender(planner_config()).recommend(observed({2048.0: 240}, {32.0: 240}), 0.0)
    assert (rec.prefill, rec.decode, rec.reason) == (6, 1, UNMET)
    assert [t[:2] for t in rec.tried] == [(p, 1) for p in range(1, 7)]


def test_headroom_plans_for_more_than_the_observed_rate_and_a_quiet_window_recommends_nothing() -> None:
    plain = recommender(planner_config()).recommend(observed({512.0: 120}, {32.0: 120}), 0.0)
    ahead = recommender(planner_config(headroom=3.0)).recommend(observed({512.0: 120}, {32.0: 120}), 0.0)
    assert (plain.rate_rps, plain.planned_rps, ahead.planned_rps) == (2.0, 2.0, 6.0)
    assert ahead.prefill is not None and plain.prefill is not None and ahead.prefill > plain.prefill
    quiet = recommender(planner_config()).recommend(observed({512.0: 5}, {32.0: 5}), 0.0)
    assert (quiet.prefill, quiet.decode, quiet.reason) == (None, None, TOO_LITTLE)
    assert recommender(planner_config()).recommend(None, 0.0).reason == TOO_LITTLE


def test_the_traffic_window_rates_the_requests_over_the_seconds_it_covers() -> None:
    window = TrafficWindow(window_s=30.0)
    assert window.observed() is None
    for now in (10.0, 20.0, 30.0, 40.0):
        window.add(now, 10.0, histogram({64.0: 20}), histogram({16.0: 20}))
    seen = window.observed()
    assert seen is not None and (seen.requests, seen.seconds, seen.rate_rps) == (60.0, 30.0, 2.0)


class CountingActuator(LogActuator):
    """The log actuator, counting every change it is asked for."""

    def __init__(self) -> None:
        super().__init__()
        self.applied: list[tuple[str, int, int]] = []

    def apply(self, pool: ScaledPool, current: int, desired: int) -> None:
        self.applied.append((pool.name, current, desired))
        super().apply(pool, current, desired)


def exporter() -> FakeExporter:
    """Both pools' families, the length histograms with the server's own token buckets."""
    ex = decode_exporter()
    ex.declare(TTFT, TIME_BUCKETS, **L)
    ex.declare(PROMPT, SERVER_TOKEN_BOUNDS[:-1], **L)
    ex.declare(OUTPUT, SERVER_TOKEN_BOUNDS[:-1], **L)
    return ex


def in_band_interval(ex: FakeExporter) -> None:
    """Ten seconds of 4 req/s with long prompts: latencies in band, so the reactive rules hold."""
    ex.observe(TTFT, 0.9, n=40, **L)
    ex.observe(PROMPT, 400.0, n=40, **L)
    ex.observe(OUTPUT, 24.0, n=40, **L)
    ex.set(PENDING, 0, model="prefill")
    ex.set(QUEUE, 0, model="prefill")
    ex.observe(TPOT, 0.045, n=100, **D)
    ex.set(ACTIVE, 3, model="decode")
    ex.set(KV_USED, 100, model="decode", pool="decode")
    ex.set(KV_FREE, 900, model="decode", pool="decode")


def run(cfg: AutoscalerConfig, steps: int = 3) -> tuple[CountingActuator, list[dict[str, Any]]]:
    clock = FakeClock()
    ex = exporter()
    actuator = CountingActuator()
    records: list[dict[str, Any]] = []
    runner = Runner(
        cfg, TextSource(ex, clock), actuator, clock, emit=records.append, recommender=recommender(cfg)
    )
    for _ in range(steps):
        in_band_interval(ex)
        clock.advance(cfg.interval_s)
        runner.run_once()
    return actuator, records


def test_a_dry_run_prints_each_recommendation_and_never_calls_the_actuator() -> None:
    actuator, records = run(planner_config(mode="dry_run"))
    plans = [r for r in records if "planner" in r]
    decisions = [r for r in records if "planner" not in r]
    assert len(plans) == 3, "one record per interval (no planner interval set)"
    assert plans[0]["reason"] == TOO_LITTLE  # the first reading: nothing observed yet
    last = plans[-1]
    assert last["planner"] == "dry_run" and last["reason"] == MET and last["rate_rps"] == 4.0
    assert last["prefill"] > 1 and last["decode"] == 1
    assert last["current"] == {"prefill": 1, "decode": 1}
    assert last["would"] == {"prefill": "scale_out", "decode": HOLD}
    assert all(d["kind"] == HOLD for d in decisions)
    assert actuator.applied == []


def test_floor_mode_raises_a_reactive_hold_to_the_planners_count() -> None:
    actuator, records = run(planner_config(mode="floor"))
    plans = [r for r in records if "planner" in r]
    prefill = [r for r in records if r.get("pool") == "prefill"]
    wanted = plans[1]["prefill"]
    assert wanted > 1
    raised = prefill[1]
    assert (raised["kind"], raised["current"], raised["desired"], raised["reason"]) == (
        SCALE_OUT,
        1,
        wanted,
        "planner",
    )
    assert raised["signals"] == ["in_band"], "the reactive rules alone would have held"
    assert raised["detail"]["schedule"]["planned_size"] == wanted
    assert actuator.applied == [("prefill", 1, wanted)]
    assert (prefill[2]["kind"], prefill[2]["current"]) == (HOLD, wanted)
    assert [r for r in records if r.get("pool") == "decode" and r["kind"] != HOLD] == []


def test_a_planner_interval_runs_it_every_few_intervals() -> None:
    _, records = run(planner_config(interval_s=30.0), steps=7)
    assert len([r for r in records if "planner" in r]) == 3  # at 10 s, 40 s and 70 s


@pytest.mark.parametrize(
    ("planner", "message"),
    [
        ({"enabled": True}, "planner.profile: required"),
        ({"target": 1.5}, "planner.target"),
        ({"headroom": 0.5}, "planner.headroom: must be >= 1"),
        ({"interval_s": 5.0}, "planner.interval_s: must be >= interval_s"),
        ({"mode": "act"}, "planner.mode: must be one of dry_run, floor"),
        ({"requests": 0}, "planner.requests"),
        ({"profiles": ["a"]}, "planner: unknown key(s) profiles"),
    ],
)
def test_planner_config_refuses_bad_input(planner: dict[str, Any], message: str) -> None:
    data = {"pools": [prefill_pool(), decode_pool()], "interval_s": 10.0, "planner": planner}
    with pytest.raises(ConfigError) as info:
        build_config(data)
    assert message in str(info.value)
    with pytest.raises(ConfigError, match="exactly one prefill and one decode pool"):
        build_config({"pools": [prefill_pool()], "planner": {"enabled": True, "profile": "p.json"}})


def test_profiles_are_read_with_the_planners_loader(tmp_path: Path) -> None:
    path = tmp_path / "profile.json"
    path.write_text(PROFILE.to_json())
    cfg = planner_config(profile=str(path))
    loaded = load_recommender(cfg)
    assert loaded is not None and loaded.floor_mode is False
    assert load_recommender(config([prefill_pool(), decode_pool()])) is None, "not enabled"
    with pytest.raises(ConfigError, match=r"^planner\.profile: cannot read the profile"):
        load_recommender(planner_config(profile=str(tmp_path / "missing.json")))
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ConfigError, match=r"^planner\.decode_profile: not a profile"):
        load_recommender(planner_config(profile=str(path), decode_profile=str(tmp_path / "bad.json")))


def test_the_triton_actuator_plans_for_tritons_load_oblivious_routing(tmp_path: Path) -> None:
    """Instances of one Triton server meet calls without regard to their load (random routing, as
    `disagg plan` models it), so the same window asks for more prefill instances than when the pools
    are servers the frontend picks by their fewest open calls (kubernetes, or no actuator)."""
    path = tmp_path / "profile.json"
    path.write_text(PROFILE.to_json())
    pools = [prefill_pool(max_size=6, capacity_tokens_per_s=None), decode_pool(max_size=6)]
    planner = {"enabled": True, "profile": str(path)}
    window = observed({512.0: 240}, {32.0: 240})
    on_triton = load_recommender(config(pools, planner=planner, actuator={"kind": "triton"}))
    elsewhere = load_recommender(config(pools, planner=planner))
    assert on_triton is not None and elsewhere is not None
    oblivious, aware = on_triton.recommend(window, 0.0), elsewhere.recommend(window, 0.0)
    assert (aware.prefill, aware.decode, aware.reason) == (2, 1, MET)
    assert (oblivious.prefill, oblivious.decode, oblivious.reason) == (4, 1, MET)
