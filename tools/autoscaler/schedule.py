"""The day/night split: what the schedule asks of each pool now, and the guardrails that decide how
much of it to do. Plain Python, no I/O; wall-clock time is passed in.

:func:`targets` reads the schedule (``schedule`` in the config, :class:`~.config.ScheduleConfig`): the
window in force at a wall time, and per pool the size it asks for and the instances it releases.
:func:`guard` then turns the reactive decision of one pool (the policy's, through the governor,
already held at the floor) into the final one. The rules, each decision naming the one that decided:

- **bounds** (`guardrail-min`, `guardrail-max`): a scheduled size is kept in [min_size, max_size];
- **up** (`scheduled`): a pool below its scheduled size goes to it at once, whatever the metrics say
  (more capacity is always safe), unless the reactive rules already go higher;
- **reactive above** (the policy's own reason): on a breach the reactive rules may scale out above the
  scheduled size, and scale back in down to it, never below it (the governor's floor);
- **down** (`scheduled`): a pool above its scheduled size goes down to it at once, but only when it is
  safe: never while the pool's windowed TTFT / TPOT quantile is above target (`guardrail-slo-breach`),
  never while its policy asks for more for another reason, e.g. KV blocks nearly full
  (`guardrail-scale-out-signal`), never on untrusted metrics (the fail-static hold stands), and not
  sooner than the pool's `cooldown_in_s` after its last change (`cooldown`): a breach that scaled the
  pool out is not undone the moment it ends.

The planner's count in floor mode (:mod:`~.recommender`) is a floor of the same kind, without the
scale-in: a pool below it goes up to it (`planner`); a scheduled scale-in stops at it.

A guarded decision keeps the policy's detail and adds `detail["schedule"]`: `window` (its label),
`size` (what it asks before any release), `scheduled_size` (after the release, within the bounds),
`bound` (`scheduled`, `guardrail-min` or `guardrail-max`), `released` (instances of `size` not in
the pool now, at most the window's release), `planned_size` (the planner's floor, when there is one)
and `rule`, the rule that decided (the decision's `reason` too).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from datetime import datetime
from typing import Any

from disagg_tools.autoscaler.config import ScaledPool, ScheduleConfig, ScheduleWindow
from disagg_tools.autoscaler.governor import HOLD, SCALE_IN, SCALE_OUT, Decision
from disagg_tools.autoscaler.policy import OUT_SIGNALS

SCHEDULED = "scheduled"
GUARDRAIL_MIN = "guardrail-min"
GUARDRAIL_MAX = "guardrail-max"
GUARDRAIL_SLO_BREACH = "guardrail-slo-breach"
GUARDRAIL_SCALE_OUT_SIGNAL = "guardrail-scale-out-signal"
PLANNER = "planner"


@dataclass(frozen=True)
class Target:
    """What the window in force asks of one pool: `size` instances, of which `released` are handed to
    other work, so `scheduled` = size - released (before the pool's bounds)."""

    window: str
    size: int
    released: int = 0

    @property
    def scheduled(self) -> int:
        return self.size - self.released


def active_window(schedule: ScheduleConfig, wall: float) -> ScheduleWindow:
    """The window in force at wall time `wall` (Unix seconds): the last one started by the local time
    of day, or before the first start of the day the last window of the day before."""
    local = datetime.fromtimestamp(wall, schedule.tz)
    minute = local.hour * 60 + local.minute
    current = schedule.windows[-1]  # windows are sorted by start
    for window in schedule.windows:
        if window.minute <= minute:
            current = window
    return current


def targets(schedule: ScheduleConfig, wall: float) -> dict[str, Target]:
    """Per pool named by the window in force, what it asks for. A share is of the schedule's total,
    rounded to the nearest instance; a release is rounded down (the pool keeps the larger part)."""
    window = active_window(schedule, wall)
    sizes = dict(window.sizes)
    for name, share in window.shares:
        sizes[name] = math.floor(share * (schedule.total or 0) + 0.5)
    release = dict(window.release)
    return {
        name: Target(window.label, size, math.floor(size * release.get(name, 0.0)))
        for name, size in sizes.items()
    }


def bounded(pool: ScaledPool, size: int) -> tuple[int, str]:
    """`size` within the pool's bounds, and the rule that set it."""
    if size < pool.min_size:
        return pool.min_size, GUARDRAIL_MIN
    if size > pool.max_size:
        return pool.max_size, GUARDRAIL_MAX
    return size, SCHEDULED


def slo_breach(pool: ScaledPool, decision: Decision) -> bool | None:
    """Whether the pool's windowed latency quantile is above its target, as its policy measured it
    for this decision (TTFT for prefill, TPOT for decode); a window with fewer than `min_samples`
    observations is no breach (the policy does not trust it either). None when the inputs were not
    trusted at all (a fail-static decision): unknown."""
    if decision.fail_static:
        return None
    if pool.role == "prefill":
        quantile, samples, target = (
            decision.detail.get("ttft_quantile_s"),
            decision.detail.get("ttft_samples", 0.0),
            pool.ttft_target_s,
        )
    else:
        quantile, samples, target = (
            decision.detail.get("tpot_quantile_s"),
            decision.detail.get("tpot_samples", 0.0),
            pool.tpot_target_s,
        )
    if quantile is None or target is None or samples < pool.min_samples:
        return False
    return bool(quantile > target)


def floor(pool: ScaledPool, target: Target | None, planned: int | None) -> int | None:
    """The lowest size the reactive rules may scale the pool in to: the bounded scheduled size and the
    planner's count, whichever is higher; None when neither applies."""
    found = [bounded(pool, target.scheduled)[0]] if target is not None else []
    if planned is not None:
        found.append(min(max(planned, pool.min_size), pool.max_size))
    return max(found) if found else None


def guard(
    pool: ScaledPool,
    reactive: Decision,
    target: Target | None,
    planned: int | None = None,
    since_change: float | None = None,
) -> Decision:
    """The final decision for a pool, from the reactive one (made with :func:`floor` as the governor's
    floor), the schedule's `target`, the planner's floor count `planned` and the seconds since the
    pool's last change (None: never changed); see the module docstring for the rules."""
    current = reactive.current
    if current is None or (target is None and planned is None):
        return reactive
    info: dict[str, Any] = {}
    scheduled = reason = None
    if target is not None:
        scheduled, reason = bounded(pool, target.scheduled)
        info.update(window=target.window, size=target.size, scheduled_size=scheduled, bound=reason)
    planned_size = None if planned is None else min(max(planned, pool.min_size), pool.max_size)
    if planned_size is not None:
        info["planned_size"] = planned_size
    lowest = floor(pool, target, planned)
    if lowest is None:  # not reached: target or planned is set
        return reactive
    by = reason if scheduled is not None and scheduled >= (planned_size or 0) else PLANNER

    def final(kind: str, desired: int, why: str) -> Decision:
        released = 0
        if target is not None and target.released:
            released = min(target.released, max(0, target.size - desired))
        if target is not None:
            info["released"] = released
        detail = {**reactive.detail, "schedule": {**info, "rule": why}}
        if kind == reactive.kind and desired == reactive.desired and why == reactive.reason:
            return replace(reactive, detail=detail)
        return replace(reactive, kind=kind, desired=desired, reason=why, detail=detail, fail_static=False)

    if reactive.reason == "outside_bounds":
        return final(reactive.kind, reactive.desired or current, reactive.reason)
    wanted = reactive.desired if reactive.desired is not None else current
    if wanted < lowest:  # up to the floor
        return final(SCALE_OUT, lowest, by)
    if reactive.kind == SCALE_OUT or scheduled is None or current <= max(scheduled, planned_size or 0):
        return final(reactive.kind, wanted, reactive.reason)
    # above the scheduled size: down to it, if that is safe
    if reactive.fail_static:
        return final(HOLD, current, reactive.reason)
    if slo_breach(pool, reactive):
        return final(HOLD, current, GUARDRAIL_SLO_BREACH)
    if any(s in OUT_SIGNALS for s in reactive.signals):
        return final(HOLD, current, GUARDRAIL_SCALE_OUT_SIGNAL)
    if since_change is not None and since_change < pool.cooldown_in_s:
        return final(HOLD, current, "cooldown")
    return final(SCALE_IN, lowest, by)
