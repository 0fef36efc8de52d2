"""When `disagg serve` restarts a tritonserver that died on its own.

Why it must: on Triton 2.51 a Python backend stub killed while it holds the lock of its shared-memory
message queue (a pool's stub OOM-killed or crashing mid-response) makes tritonserver itself abort
(`terminate called after throwing an instance of 'boost::interprocess::lock_exception'`), taking every
model with it (`disagg_tools.repro.stub_kill_stress` measures how often). The launcher then starts it
again, so the deployment loses the requests in flight instead of serving nothing until someone intervenes.

The policy is pure: the launcher tells it what happened and asks.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field


@dataclass
class RestartPolicy:
    """At most `max_restarts` restarts within any `window_s` seconds, and only of a server that had
    become ready since it was last started: one that fails while starting (a bad repository, a model
    that does not load) would fail again, and is reported instead."""

    max_restarts: int = 5
    window_s: float = 600.0
    _restarts: deque[float] = field(default_factory=deque, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.max_restarts < 0:
            raise ValueError("max_restarts must be >= 0")
        if self.window_s <= 0:
            raise ValueError("window_s must be > 0")

    def should_restart(self, *, now: float, was_ready: bool, stopping: bool) -> bool:
        """Decide about a server that just exited at monotonic time `now`; a yes is counted."""
        if stopping or not was_ready or self.max_restarts == 0:
            return False
        while self._restarts and now - self._restarts[0] >= self.window_s:
            self._restarts.popleft()
        if len(self._restarts) >= self.max_restarts:
            return False
        self._restarts.append(now)
        return True

    @property
    def recent(self) -> int:
        """Restarts counted in the current window (as of the last decision)."""
        return len(self._restarts)
