"""Pool health as the orchestrator sees it: healthy, saturated or gone, with hysteresis. Pure.

Each pool's state is judged from what the orchestrator observes of it:

- probes (a ``Ping`` answered with the pool's ``PoolLoad``, or not answered in time);
- the calls it makes (a pool that stops responding mid-request, or refuses one UNAVAILABLE);
- the load a probe reports: queue depth, prompt tokens waiting, KV use.

Observations may come from two threads (requests, and the watcher's own loop): each one takes the
pool's lock. Going *gone* is fast: one hard failure (a probe or call that found the pool dead). Coming back is
slow: ``recover_after`` probes in a row that answered. Saturation enters at the thresholds and
leaves only below ``clear_fraction`` of them, so a pool near a threshold does not flap.
"""

from __future__ import annotations

import functools
import math
import threading
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import TypeVar

from disagg.protocol.messages import PoolLoad

DEAD = "dead"
"""The reason of a pool found dead: its stub is gone (a call was told so), or Triton reports it ready
and it does not answer. Its open calls will never be answered, and it is restarted."""
NOT_READY = "not_ready"  # the reason of a pool that does not answer and is not ready (unloading)
CALL_FAILED = "call_failed"
"""The reason of a pool a request's call found unanswering: it says less than a probe, or a stub
reported dead, so it never replaces another reason of a pool already gone."""


class PoolState(str, Enum):
    HEALTHY = "healthy"
    SATURATED = "saturated"
    GONE = "gone"


@dataclass(frozen=True)
class HealthConfig:
    """Thresholds of one orchestrator's health judgement (its config.pbtxt ``health_*`` parameters)."""

    recover_after: int = 2  # answered probes in a row that bring a gone pool back
    saturated_queue: int = 64  # jobs waiting in a pool's queue
    saturated_prompt_tokens: int = 32768  # prompt tokens waiting to be prefilled
    saturated_kv_use: float = 0.95  # share of KV blocks in use
    saturated_probe_s: float = 1.0  # a probe's round trip (a pool that cannot answer quickly)
    clear_fraction: float = 0.5  # leave saturation below this share of every threshold

    def __post_init__(self) -> None:
        """Ranges; the types are trusted (the orchestrator builds it in code)."""
        for name in ("recover_after", "saturated_queue", "saturated_prompt_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"health {name} must be positive")
        for name in ("saturated_kv_use", "clear_fraction"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"health {name} must be in (0, 1]")
        if not 0 < self.saturated_probe_s < math.inf:
            raise ValueError("health saturated_probe_s must be a positive number of seconds")

    def over(self, load: PoolLoad, probe_s: float, scale: float = 1.0) -> str | None:
        """The first threshold (times ``scale``) the load is at or over, by name; None when none is."""
        if load.queued >= self.saturated_queue * scale:
            return "queue"
        if load.queued_prompt_tokens >= self.saturated_prompt_tokens * scale:
            return "prompt_tokens"
        if load.kv_use >= self.saturated_kv_use * scale:
            return "kv"
        if probe_s >= self.saturated_probe_s * scale:
            return "probe_time"
        return None


@dataclass(frozen=True)
class Change:
    """A pool changed state, and why (``reason``: a threshold's name, or what failed)."""

    pool: str
    old: PoolState
    new: PoolState
    reason: str


F = TypeVar("F", bound=Callable[..., "Change | None"])


def _locked(method: F) -> F:
    @functools.wraps(method)
    def run(self: PoolHealth, *args: object) -> Change | None:
        with self._lock:
            return method(self, *args)

    return run  # type: ignore[return-value]


class PoolHealth:
    """The state of one pool; every observation may change it and returns the Change if it did."""

    def __init__(self, pool: str, config: HealthConfig | None = None) -> None:
        self.pool = pool
        self.config = config or HealthConfig()
        self.state = PoolState.HEALTHY
        self.load: PoolLoad | None = None  # the last load a probe reported
        self.reason = ""  # why it is in its state (a threshold's name, or what failed)
        self._answered = 0  # probes answered in a row while gone
        self._lock = threading.Lock()

    @property
    def answered(self) -> int:
        """Probes answered in a row since the pool went gone (0 while it stays silent)."""
        return self._answered

    @_locked
    def probed(self, load: PoolLoad, probe_s: float) -> Change | None:
        """A probe answered with ``load`` after ``probe_s`` seconds."""
        self.load = load
        if self.state is PoolState.GONE:
            self._answered += 1
            if self._answered < self.config.recover_after:
                return None
            return self._to(PoolState.HEALTHY, "recovered")
        over = self.config.over(load, probe_s)
        if self.state is PoolState.HEALTHY and over is not None:
            return self._to(PoolState.SATURATED, over)
        cleared = over is None and self.config.over(load, probe_s, self.config.clear_fraction) is None
        if self.state is PoolState.SATURATED and cleared:
            return self._to(PoolState.HEALTHY, "cleared")
        return None

    @_locked
    def failed(self, reason: str) -> Change | None:
        """A probe or call found the pool dead (no answer, or its stub gone): it is gone at once."""
        self._answered = 0
        if self.state is PoolState.GONE:
            if reason in (self.reason, CALL_FAILED):
                return None
            self.reason = reason  # still gone, known better now (a probe after a call's failure)
            return Change(self.pool, PoolState.GONE, PoolState.GONE, reason)
        return self._to(PoolState.GONE, reason)

    @_locked
    def refused(self) -> Change | None:
        """The pool refused a request as full (UNAVAILABLE): it is saturated until a probe clears it."""
        if self.state is PoolState.HEALTHY:
            return self._to(PoolState.SATURATED, "refused")
        return None

    def _to(self, state: PoolState, reason: str) -> Change | None:
        if state is self.state:
            return None
        change = Change(self.pool, self.state, state, reason)
        self.state, self.reason = state, reason
        if state is not PoolState.GONE:
            self._answered = 0
        return change
