"""SLO bookkeeping in plain Python: per-request timings and a rolling attainment / goodput window.

DistServe's definitions: TTFT = first token - arrival; TPOT = (last token - first token) / (n - 1);
a request attains the SLO when it meets both targets; attainment is the share of finished requests in
the window that attain it, goodput the rate (per second over the window) of those that do.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass

# Seconds, 1 ms .. 10 min; tokens, 1 .. 8192 (Prometheus histogram upper bounds).
TIME_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
    300.0,
    600.0,
)
TOKEN_BUCKETS = tuple(float(2**i) for i in range(14))


@dataclass(frozen=True)
class SloConfig:
    ttft_s: float = 1.0
    tpot_s: float = 0.1
    window_s: float = 60.0

    def __post_init__(self) -> None:
        """Ranges; the types are ``config.build``'s (``OrchestratorConfig.slo``; a config built by hand
        in code is trusted to be typed)."""
        for name in ("ttft_s", "tpot_s", "window_s"):
            if not 0 < getattr(self, name) < 1e6:
                raise ValueError(f"{name}: must be a positive number of seconds (below 1e6)")


def time_per_output_token(first: float, last: float, tokens: int) -> float | None:
    """(last - first) / (n - 1); None for fewer than two tokens (undefined)."""
    return None if tokens < 2 else (last - first) / (tokens - 1)


def attains(config: SloConfig, ttft: float | None, tpot: float | None) -> bool:
    """Both targets met. A request without a first token fails; one token has no TPOT to miss."""
    return ttft is not None and ttft <= config.ttft_s and (tpot is None or tpot <= config.tpot_s)


class SloWindow:
    """Finished requests of the last ``window_s`` seconds. Thread-safe."""

    def __init__(self, config: SloConfig, clock=time.monotonic) -> None:
        self.config = config
        self._clock = clock
        self._started = clock()
        self._lock = threading.Lock()
        self._items: deque[tuple[float, bool]] = deque()

    def add(self, ok: bool, at: float | None = None) -> None:
        with self._lock:
            self._items.append((self._clock() if at is None else at, ok))

    def _prune(self, now: float) -> None:
        while self._items and self._items[0][0] < now - self.config.window_s:
            self._items.popleft()

    def attainment(self) -> float | None:
        """Share meeting both SLOs, or None when the window is empty."""
        with self._lock:
            self._prune(self._clock())
            if not self._items:
                return None
            return sum(ok for _, ok in self._items) / len(self._items)

    def goodput(self) -> float:
        """Requests per second meeting both SLOs, over the window (or the time since start if shorter)."""
        with self._lock:
            now = self._clock()
            self._prune(now)
            span = min(self.config.window_s, max(now - self._started, 1e-9))
            return sum(ok for _, ok in self._items) / span
