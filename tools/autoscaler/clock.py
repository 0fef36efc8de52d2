"""Time as the autoscaler sees it, injectable so tests drive it without sleeping."""

from __future__ import annotations

import threading
import time
from typing import Protocol


class Clock(Protocol):
    """`monotonic()` for intervals and cooldowns, `time()` for wall-clock stamps, `wait()` to pause
    (returns True when the process was asked to stop)."""

    def monotonic(self) -> float: ...

    def time(self) -> float: ...

    def wait(self, seconds: float) -> bool: ...


class SystemClock:
    """The real clock; `wait` returns early when `stop` is set (SIGTERM / Ctrl-C)."""

    def __init__(self, stop: threading.Event | None = None) -> None:
        self.stop = stop or threading.Event()

    def monotonic(self) -> float:
        return time.monotonic()

    def time(self) -> float:
        return time.time()

    def wait(self, seconds: float) -> bool:
        return self.stop.wait(max(0.0, seconds))
