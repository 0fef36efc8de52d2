"""The day/night split: windows by time of day, the guardrail rules on their own, and a compressed
24-hour trace through the whole loop against the triton actuator and a fake model repository."""

from __future__ import annotations

import calendar
from typing import Any

import pytest
from autoscale_factory import (
    ACTIVE,
    ADMIN_KEY,
    KV_FREE,
    KV_USED,
    PENDING,
    PROMPT,
    QUEUE,
    TPOT,
    TTFT,
    FakeClock,
    FakeExporter,
    TextSource,
    config,
    decode_exporter,
    decode_pool,
    http_fake,
    model_config,
    prefill_exporter,
    prefill_pool,
    triton_repository,
)

from disagg_tools.autoscaler.actuator import TritonActuator, instance_count
from disagg_tools.autoscaler.config import ActuatorConfig, ConfigError, build_config
from disagg_tools.autoscaler.governor import HOLD, SCALE_IN, SCALE_OUT, Decision
from disagg_tools.autoscaler.runner import Runner
from disagg_tools.autoscaler.schedule import (
    GUARDRAIL_MAX,
    GUARDRAIL_MIN,
    GUARDRAIL_SCALE_OUT_SIGNAL,
    GUARDRAIL_SLO_BREACH,
    PLANNER,
    SCHEDULED,
    Target,
    active_window,
    bounded,
    floor,
    guard,
    slo_breach,
    targets,
)

MIDNIGHT_UTC = calendar.timegm((2024, 3, 4, 0, 0, 0))  # a Monday, far from any DST change
L = {"model": "prefill", "path": "disaggregated"}
D = {"model": "decode", "path": "disaggregated"}

DAY_NIGHT = {
    "utc_offset": "+02:00",
    "total": 10,
    "windows": [
        {
            "start": "22:00",
            "name": "night",
            "shares": {"prefill": 0.1, "decode": 0.7},
            "release": {"decode": 0.5},
        },
        {"start": "07:00", "name": "day", "shares": {"prefill": 0.3, "decode": 0.7}},
    ],
}


def at(hour: int, minute: int = 0, offset_h: int = 2) -> float:
    """Wall time of a local time of day on the test's date, in a zone `offset_h` hours east of UTC."""
    return MIDNIGHT_UTC + (hour - offset_h) * 3600 + minute * 60


def pools(**over: Any) -> list[dict[str, Any]]:
    prefill = prefill_pool(min_size=2, max_size=4, capacity_tokens_per_s=None, **over)
    return [prefill, decode_pool(min_size=2, max_size=8, **over)]


def schedule_config(schedule: dict[str, Any] | None = None, **top: Any) -> Any:
    return config(pools(), schedule=schedule or DAY_NIGHT, **top)


# ---- windows ---------------------------------------------------------------------------------------


def test_the_window_in_force_wraps_around_midnight_and_follows_the_offset() -> None:
    schedule = schedule_config().schedule
    assert [w.label for w in schedule.windows] == ["day", "night"]  # sorted by start
    assert active_window(schedule, at(6, 59)).label == "night"  # before the first start: last night's
    assert active_window(schedule, at(7, 0)).label == "day"
    assert active_window(schedule, at(21, 59)).label == "day"
    assert active_window(schedule, at(22, 0)).label == "night"
    assert active_window(schedule, at(0, 30)).label == "night"
    # 07:00 at +02:00 is 05:00 UTC: the same instant read in UTC is still night
    utc = schedule_config({**DAY_NIGHT, "utc_offset": ""}).schedule
    assert active_window(utc, at(7, 0)).label == "night"
    assert active_window(utc, at(9, 0)).label == "day"


def test_a_named_time_zone_follows_daylight_saving() -> None:
    paris = schedule_config({**DAY_NIGHT, "utc_offset": "", "timezone": "Europe/Paris"}).schedule
    winter = calendar.timegm((2024, 1, 10, 6, 0, 0))  # 07:00 in Paris (UTC+1)
    summer = calendar.timegm((2024, 7, 10, 5, 0, 0))  # 07:00 in Paris (UTC+2)
    assert active_window(paris, winter).label == "day"
    assert active_window(paris, summer).label == "day"
    assert active_window(paris, summer - 60).label == "night"


def test_shares_of_the_total_and_the_released_decode_capacity() -> None:
    schedule = schedule_config().schedule
    day, night = targets(schedule, at(12)), targets(schedule, at(23))
    assert day == {"prefill": Target("day", 3), "decode": Target("day", 7)}
    # 70 % of 10 = 7 decode instances; half of them handed to other work at night: 3 released
    # (rounded down: the pool keeps the larger part), 4 scheduled
    assert night["decode"] == Target("night", 7, released=3) and night["decode"].scheduled == 4
    assert night["prefill"] == Target("night", 1)
    sized = schedule_config({"windows": [{"start": "00:00", "sizes": {"decode": 5}}]}).schedule
    assert targets(sized, at(3)) == {"decode": Target("00:00", 5)}  # prefill: not scheduled


@pytest.mark.parametrize(
    ("schedule", "message"),
    [
        ({"windows": []}, "schedule.windows: at least one window"),
        ({"windows": [{"start": "7:00", "sizes": {"decode": 2}}]}, "schedule.windows[0].start: must be"),
        ({"windows": [{"start": "24:00", "sizes": {"decode": 2}}]}, "schedule.windows[0].start"),
        ({"windows": [{"start": "07:00"}]}, "schedule.windows[0].sizes: a window needs sizes or shares"),
        (
            {"windows": [{"start": "07:00", "sizes": {"decode": -1}}]},
            "windows[0].sizes.decode: must be an integer",
        ),
        (
            {"windows": [{"start": "07:00", "sizes": {"decode": 1.5}}]},
            "windows[0].sizes.decode: must be an integer",
        ),
        ({"windows": [{"start": "07:00", "sizes": {"gpu": 1}}]}, "schedule.windows[0]: no pool named 'gpu'"),
        ({"windows": [{"start": "07:00", "shares": {"decode": 0.5}}]}, "shares need the schedule's total"),
        (
            {"total": 4, "windows": [{"start": "07:00", "shares": {"decode": 0.7, "prefill": 0.6}}]},
            "windows[0].shares: must add up to at most 1",
        ),
        (
            {"windows": [{"start": "07:00", "sizes": {"decode": 2}, "release": {"prefill": 0.5}}]},
            "windows[0].release.prefill: release only from a pool the window sizes",
        ),
        (
            {"windows": [{"start": "07:00", "sizes": {"decode": 2}, "release": {"decode": 1.0}}]},
            "windows[0].release.decode: must be a number in [0, 0.99]",
        ),
        (
            {
                "windows": [
                    {"start": "07:00", "sizes": {"decode": 2}},
                    {"start": "07:00", "sizes": {"decode": 3}},
                ]
            },
            "schedule.windows: two windows start at the same time",
        ),
        (
            {"timezone": "Mars/Olympus", "windows": [{"start": "07:00", "sizes": {"decode": 2}}]},
            "schedule.timezone",
        ),
        (
            {"utc_offset": "+2", "windows": [{"start": "07:00", "sizes": {"decode": 2}}]},
            "schedule.utc_offset",
        ),
        (
            {
                "timezone": "UTC",
                "utc_offset": "+02:00",
                "windows": [{"start": "07:00", "sizes": {"decode": 2}}],
            },
            "schedule.utc_offset: give timezone or utc_offset, not both",
        ),
        ({"windows": [{"start": "07:00", "sizes": {"decode": 2}, "colour": "red"}]}, "unknown key(s) colour"),
    ],
)
def test_schedule_config_refuses_bad_input(schedule: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        build_config({"pools": pools(), "interval_s": 10.0, "schedule": schedule})
    assert message in str(info.value)


# ---- the guardrail rules alone -----------------------------------------------------------------------

DECODE = config([decode_pool(min_size=2, max_size=8, cooldown_in_s=60.0)]).pools[0]
PREFILL = config([prefill_pool(min_size=2, max_size=4)]).pools[0]


def decision(
    kind: str = HOLD,
    current: int = 4,
    desired: int | None = None,
    reason: str = "in_band",
    tpot: float | None = 0.02,
    samples: float = 100.0,
    signals: tuple[str, ...] = ("in_band",),
    fail_static: bool = False,
    pool: str = "decode",
) -> Decision:
    detail = {} if fail_static else {"tpot_quantile_s": tpot, "tpot_samples": samples, "kv_utilisation": 0.1}
    return Decision(
        pool,
        kind,
        current,
        current if desired is None else desired,
        reason,
        fail_static=fail_static,
        signals=() if fail_static else signals,
        detail=detail,
    )


def test_bounds_keep_a_scheduled_size_within_min_and_max() -> None:
    assert bounded(DECODE, 1) == (2, GUARDRAIL_MIN)
    assert bounded(DECODE, 0) == (2, GUARDRAIL_MIN)
    assert bounded(DECODE, 12) == (8, GUARDRAIL_MAX)
    assert bounded(DECODE, 5) == (5, SCHEDULED)
    assert floor(DECODE, Target("night", 7, released=6), None) == 2
    assert floor(DECODE, Target("day", 3), planned=5) == 5
    assert floor(DECODE, None, planned=20) == 8
    assert floor(DECODE, None, None) is None


def test_a_breach_is_the_windowed_quantile_above_target_with_enough_samples() -> None:
    assert slo_breach(DECODE, decision(tpot=0.055)) is True  # above target, below the out threshold
    assert slo_breach(DECODE, decision(tpot=0.05)) is False
    assert slo_breach(DECODE, decision(tpot=0.2, samples=3)) is False  # too few to trust
    assert slo_breach(DECODE, decision(tpot=None)) is False
    assert slo_breach(DECODE, decision(fail_static=True, reason="stale")) is None
    ttft = Decision("prefill", HOLD, 2, 2, "in_band", detail={"ttft_quantile_s": 1.5, "ttft_samples": 50.0})
    assert slo_breach(PREFILL, ttft) is True


def test_scheduled_scale_in_goes_to_the_scheduled_size_at_once_and_reports_the_release() -> None:
    out = guard(DECODE, decision(current=7), Target("night", 7, released=3), since_change=3600.0)
    assert (out.kind, out.current, out.desired, out.reason) == (SCALE_IN, 7, 4, SCHEDULED)
    assert out.detail["schedule"] == {
        "window": "night",
        "size": 7,
        "scheduled_size": 4,
        "bound": SCHEDULED,
        "released": 3,
        "rule": SCHEDULED,
    }
    assert out.detail["tpot_quantile_s"] == 0.02, "the policy's detail is kept"


def test_the_minimum_holds_against_the_schedule() -> None:
    out = guard(DECODE, decision(current=4), Target("night", 1), since_change=None)
    assert (out.kind, out.desired, out.reason) == (SCALE_IN, 2, GUARDRAIL_MIN)
    at_min = guard(DECODE, decision(current=2), Target("night", 1))
    assert (at_min.kind, at_min.desired) == (HOLD, 2)
    assert at_min.detail["schedule"]["bound"] == GUARDRAIL_MIN
    # a pool below its minimum is brought up to it (and below its scheduled size, up to that)
    up = guard(DECODE, decision(current=1), Target("night", 1))
    assert (up.kind, up.desired, up.reason) == (SCALE_OUT, 2, GUARDRAIL_MIN)


def test_a_live_slo_breach_blocks_a_scheduled_scale_in() -> None:
    out = guard(DECODE, decision(current=7, tpot=0.055), Target("night", 7, released=3), since_change=3600.0)
    assert (out.kind, out.desired, out.reason) == (HOLD, 7, GUARDRAIL_SLO_BREACH)
    assert out.detail["schedule"]["released"] == 0, "nothing released while held"
    # another reason to want more (KV nearly full) blocks it too, and says so
    kv = decision(current=7, reason="cooldown", signals=("kv_utilisation_high",))
    held = guard(DECODE, kv, Target("night", 4), since_change=3600.0)
    assert (held.kind, held.reason) == (HOLD, GUARDRAIL_SCALE_OUT_SIGNAL)
    # untrusted metrics: the fail-static hold stands (a breach cannot be ruled out)
    blind = guard(DECODE, decision(current=7, fail_static=True, reason="stale"), Target("night", 4))
    assert (blind.kind, blind.reason, blind.fail_static) == (HOLD, "stale", True)
    # a recent change (a breach just scaled it out): not undone before the pool's cooldown_in_s
    recent = guard(DECODE, decision(current=7), Target("night", 4), since_change=30.0)
    assert (recent.kind, recent.reason) == (HOLD, "cooldown")


def test_the_reactive_rules_may_scale_out_above_the_schedule_and_scale_up_is_unconditional() -> None:
    out = guard(
        DECODE,
        decision(SCALE_OUT, current=7, desired=8, reason="tpot_above_target", tpot=0.09),
        Target("day", 7),
    )
    assert (out.kind, out.desired, out.reason) == (SCALE_OUT, 8, "tpot_above_target")
    # a scheduled scale-out: at once, past the reactive step, even on a breach or untrusted input
    for reactive in (decision(current=4, tpot=0.09), decision(current=4, fail_static=True, reason="warmup")):
        up = guard(DECODE, reactive, Target("day", 7))
        assert (up.kind, up.desired, up.reason, up.fail_static) == (SCALE_OUT, 7, SCHEDULED, False)
    # a reactive step out that stops below the scheduled size is taken all the way
    step = guard(
        DECODE, decision(SCALE_OUT, current=4, desired=5, reason="tpot_above_target"), Target("day", 7)
    )
    assert (step.desired, step.reason) == (7, SCHEDULED)


def test_the_planner_floor_raises_and_bounds_a_scheduled_scale_in() -> None:
    raised = guard(DECODE, decision(current=3), None, planned=5)
    assert (raised.kind, raised.desired, raised.reason) == (SCALE_OUT, 5, PLANNER)
    held = guard(DECODE, decision(current=5), None, planned=5)
    assert (held.kind, held.desired) == (HOLD, 5)
    down = guard(DECODE, decision(current=7), Target("night", 4), planned=5, since_change=3600.0)
    assert (down.kind, down.desired, down.reason) == (SCALE_IN, 5, PLANNER)
    assert guard(DECODE, decision(current=7), None, None) == decision(current=7), "nothing to apply"


def test_the_governor_stops_a_reactive_scale_in_at_the_floor() -> None:
    from disagg_tools.autoscaler.governor import Governor
    from disagg_tools.autoscaler.policy import IN, Proposal

    governor = Governor(DECODE)
    wish = Proposal(IN, ("tpot_below_target",), {"tpot_quantile_s": 0.01, "tpot_samples": 100.0})
    for now in (0.0, 100.0, 200.0):
        held = governor.decide(wish, 4, now, floor=4)
    assert (held.kind, held.reason) == (HOLD, "at_floor")
    moved = governor.decide(wish, 6, 300.0, floor=4)
    assert (moved.kind, moved.desired) == (SCALE_IN, 5)
    assert governor.decide(wish, 2, 400.0).reason == "at_min"


# ---- a compressed day against the triton actuator ------------------------------------------------------


@pytest.fixture(autouse=True)
def own_state_folder(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The model-control lock and journal go to this test's own folder, not the user's state."""
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))


def serving(ex: FakeExporter, tpot: float) -> None:
    """One interval of steady traffic: TTFT well under target; decode at `tpot` seconds per token."""
    ex.observe(TTFT, 0.2, n=30, **L)
    ex.observe(PROMPT, 200.0, n=30, **L)
    ex.set(PENDING, 0, model="prefill")
    ex.set(QUEUE, 0, model="prefill")
    ex.observe(TPOT, tpot, n=100, **D)
    ex.set(ACTIVE, 12, model="decode")
    ex.set(KV_USED, 100, model="decode", pool="decode")
    ex.set(KV_FREE, 900, model="decode", pool="decode")


def test_a_compressed_day_follows_the_windows_keeps_the_minimum_and_waits_out_a_breach() -> None:
    interval = 600.0  # ten minutes a step: 144 steps are a day
    cfg = config(
        pools(cooldown_out_s=600.0, cooldown_in_s=1200.0),
        schedule=DAY_NIGHT,
        interval_s=interval,
        window_s=interval,
    )
    ex = prefill_exporter()
    dec = decode_exporter()
    ex.hists.update(dec.hists)
    ex.gauges.update(dec.gauges)
    # 00:00 local: the night before left prefill at 3 (above its scheduled size) and decode at 4
    models = {"prefill": model_config("prefill", 3), "decode": model_config("decode", 4)}
    clock = FakeClock(start=10_000.0, wall=at(0, 0))
    records: list[dict[str, Any]] = []
    timeline: dict[str, tuple[int, int]] = {}  # local "HH:MM" -> (prefill, decode) after the step
    with http_fake(triton_repository(models)) as (url, calls):
        actuator = TritonActuator(
            ActuatorConfig(kind="triton", url=url),
            clock,
            lambda pool: 0.0,
            environ={"DISAGG_ADMIN_KEY": ADMIN_KEY},
        )
        runner = Runner(cfg, TextSource(ex, clock), actuator, clock, emit=records.append)
        for step in range(1, 145):
            clock.advance(interval)
            minute = step * 10
            hhmm = f"{minute // 60 % 24:02d}:{minute % 60:02d}"
            # a decode breach (TPOT above its 50 ms target, below the 60 ms scale-out threshold)
            # from 21:50 to 22:40: it straddles the switch to the night window
            breach = 21 * 60 + 50 <= minute <= 22 * 60 + 40
            serving(ex, tpot=0.055 if breach else 0.02)
            runner.run_once()
            timeline[hhmm] = (instance_count(models["prefill"]), instance_count(models["decode"]))
    by_time = {}
    for r in records:
        local = (r["at"] - at(0, 0)) / 60
        by_time[(f"{int(local) // 60 % 24:02d}:{int(local) % 60:02d}", r["pool"])] = r

    # the first step is warm-up: the scheduled scale-in (prefill 3 -> its night size) waits for metrics
    assert by_time[("00:10", "prefill")]["reason"] == "warmup"
    # then night: prefill's 10 % share is 1 instance, below its minimum of 2; decode 7 - 3 released = 4
    rec = by_time[("00:20", "prefill")]
    assert (rec["kind"], rec["desired"], rec["reason"]) == (SCALE_IN, 2, GUARDRAIL_MIN)
    assert timeline["00:20"] == (2, 4) and timeline["06:50"] == (2, 4)
    # the reactive rules (TTFT and TPOT far under target) would scale in: held at the schedule's floor
    assert by_time[("03:00", "decode")]["reason"] == "at_floor"
    assert by_time[("03:00", "prefill")]["reason"] == "at_min"
    # 07:00: day, both pools to their shares at once (3 and 7)
    day = by_time[("07:00", "decode")]
    assert (day["kind"], day["current"], day["desired"], day["reason"]) == (SCALE_OUT, 4, 7, SCHEDULED)
    assert timeline["07:00"] == (3, 7) and timeline["21:50"] == (3, 7)
    # 22:00: night; prefill goes to its minimum, decode would release 3 but its TPOT is above target
    assert timeline["22:00"] == (2, 7)
    held = [by_time[(t, "decode")] for t in ("22:00", "22:10", "22:20", "22:30", "22:40")]
    assert all((r["kind"], r["reason"]) == (HOLD, GUARDRAIL_SLO_BREACH) for r in held)
    assert all(r["detail"]["schedule"]["released"] == 0 for r in held)
    # the breach ends: the scale-in goes ahead, 3 instances released
    after = by_time[("22:50", "decode")]
    assert (after["kind"], after["desired"], after["reason"]) == (SCALE_IN, 4, SCHEDULED)
    assert after["detail"]["schedule"]["released"] == 3
    assert timeline["22:50"] == (2, 4) and timeline["00:00"] == (2, 4)
    # never below a minimum, and one load per change, each to the decided count
    assert all(p >= 2 and d >= 2 for p, d in timeline.values())
    changes = [r for r in records if r["kind"] != HOLD]
    assert [(r["pool"], r["desired"]) for r in changes] == [
        ("prefill", 2),
        ("prefill", 3),
        ("decode", 7),
        ("prefill", 2),
        ("decode", 4),
    ]
    assert all(r["applied"] for r in changes)
    loads = [c for c in calls if c.method == "POST"]
    assert len(loads) == len(changes)
    # the autoscaler's own /metrics: scheduled and released sizes
    text = runner.telemetry.registry.get_sample_value
    assert text("disagg_autoscaler_scheduled_size", {"pool": "decode"}) == 4.0
    assert text("disagg_autoscaler_released_size", {"pool": "decode"}) == 3.0
    assert text("disagg_autoscaler_scheduled_size", {"pool": "prefill"}) == 2.0
