"""What turns a policy's wish into a decision: bounds, confirmation streaks, cooldowns, fail-static.

Plain Python, no I/O, time passed in. Guarantees, per pool:

- the desired size is always within [min_size, max_size] and never 0 (min_size >= 1 is validated);
- at most one size change per call, of at most `step` instances, and none sooner than the cooldown
  after the previous change (cooldowns are validated to be >= the polling interval, so at most one
  step per interval even if called more often);
- a scale-out needs the out-signal on `scale_out_after` consecutive calls, a scale-in on
  `scale_in_after`; any hold, opposite signal or data gap resets the streak. With the policies'
  out/in threshold gap this bounds how often a signal oscillating around a threshold can move the pool;
- when data is missing, stale or garbage (a fail-static call) the size is held and the decision says why;
- with a `floor` (a scheduled size, the planner's count: see :mod:`~.schedule`) a scale-in stops there.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from disagg_tools.autoscaler.config import ScaledPool
from disagg_tools.autoscaler.policy import IN, OUT, Proposal

SCALE_OUT = "scale_out"
SCALE_IN = "scale_in"
HOLD = "hold"


@dataclass(frozen=True)
class Decision:
    """One pool's outcome for one interval; `desired` is what the actuator should set."""

    pool: str
    kind: str
    current: int | None
    desired: int | None
    reason: str
    fail_static: bool = False
    signals: tuple[str, ...] = ()
    detail: dict[str, Any] = field(default_factory=dict)

    def as_record(self) -> dict[str, Any]:
        """JSON-serialisable form (the `log` actuator prints it)."""
        return {
            "pool": self.pool,
            "kind": self.kind,
            "current": self.current,
            "desired": self.desired,
            "reason": self.reason,
            "fail_static": self.fail_static,
            "signals": list(self.signals),
            "detail": self.detail,
        }


class Governor:
    """Per-pool state between intervals: the time of the last change and the confirmation streaks."""

    def __init__(self, pool: ScaledPool) -> None:
        self._pool = pool
        self._last_change: float | None = None
        self._out_streak = 0
        self._in_streak = 0

    def _hold(self, current: int, reason: str, proposal: Proposal | None = None) -> Decision:
        return Decision(
            self._pool.name,
            HOLD,
            current,
            current,
            reason,
            signals=proposal.reasons if proposal else (),
            detail=proposal.detail if proposal else {},
        )

    @property
    def last_change(self) -> float | None:
        """When the last size change was decided (monotonic seconds), or None."""
        return self._last_change

    def changed(self, now: float) -> None:
        """A change was decided outside the reactive rules (the schedule, the planner's floor): the
        cooldowns count from it and the streaks restart."""
        self._last_change = now
        self._out_streak = self._in_streak = 0

    def fail_static(self, current: int | None, reason: str) -> Decision:
        """Hold because the inputs cannot be trusted; the streaks restart after the gap."""
        self._out_streak = self._in_streak = 0
        return Decision(self._pool.name, HOLD, current, current, reason, fail_static=True)

    def decide(self, proposal: Proposal, current: int, now: float, floor: int | None = None) -> Decision:
        """Decision for a pool now at `current` instances, given the policy's proposal; a scale-in never
        goes below `floor` (held there as `at_floor`). Raising a pool to its floor is not done here."""
        p = self._pool
        lowest = p.min_size if floor is None else max(p.min_size, min(floor, p.max_size))
        if current < p.min_size or current > p.max_size:
            # Out of bounds (e.g. a restarted server came back with its file's count): repair first,
            # one step at a time, without waiting for a signal.
            self._out_streak = self._in_streak = 0
            if current < p.min_size:
                desired, kind = min(p.min_size, current + p.step), SCALE_OUT
            else:
                desired, kind = max(p.max_size, current - p.step), SCALE_IN
            self._last_change = now
            return Decision(p.name, kind, current, desired, "outside_bounds", detail=proposal.detail)
        if proposal.direction == OUT:
            self._out_streak, self._in_streak = self._out_streak + 1, 0
            streak, needed, cooldown = self._out_streak, p.scale_out_after, p.cooldown_out_s
            blocked, kind = current >= p.max_size, SCALE_OUT
            desired = min(p.max_size, current + p.step)
        elif proposal.direction == IN:
            self._in_streak, self._out_streak = self._in_streak + 1, 0
            streak, needed, cooldown = self._in_streak, p.scale_in_after, p.cooldown_in_s
            blocked, kind = current <= lowest, SCALE_IN
            desired = max(lowest, current - p.step)
        else:
            self._out_streak = self._in_streak = 0
            return self._hold(current, "in_band", proposal)
        if blocked:
            if kind == SCALE_OUT:
                return self._hold(current, "at_max", proposal)
            return self._hold(current, "at_min" if lowest == p.min_size else "at_floor", proposal)
        if streak < needed:
            return self._hold(current, "confirming", proposal)
        if self._last_change is not None and now - self._last_change < cooldown:
            return self._hold(current, "cooldown", proposal)
        # The change counts from the moment it is decided, whether or not the actuator then succeeds:
        # a failing actuator is retried after a cooldown, not hammered every interval.
        self._last_change = now
        self._out_streak = self._in_streak = 0
        return Decision(
            p.name,
            kind,
            current,
            desired,
            ",".join(proposal.reasons),
            signals=proposal.reasons,
            detail=proposal.detail,
        )
