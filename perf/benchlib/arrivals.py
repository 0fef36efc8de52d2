"""Open-loop arrival schedules (pure): when each request is *due*, independent of how the server copes."""

from __future__ import annotations

import math

import numpy as np


def poisson_arrivals(rate_rps: float, count: int, rng: np.random.Generator) -> list[float]:
    """`count` arrival offsets (seconds from the start, non-decreasing) of a Poisson process of `rate_rps`.

    The first request is due at 0 so that every run starts loaded at once rather than after a random
    idle gap. Inter-arrival gaps are drawn as unit exponentials and scaled by 1/rate, so one seed gives
    the same sequence at every rate, only stretched: runs at different rates differ in rate alone.
    """
    if not isinstance(rate_rps, (int, float)) or not math.isfinite(rate_rps) or rate_rps <= 0:
        raise ValueError("rate_rps must be a positive finite number")
    if isinstance(count, bool) or not isinstance(count, int) or count < 0:
        raise ValueError("count must be a non-negative integer")
    if count == 0:
        return []
    gaps = rng.exponential(1.0, size=count - 1) / rate_rps
    return [0.0, *np.cumsum(gaps).tolist()]


def count_for(rate_rps: float, duration_s: float, max_requests: int, min_requests: int = 1) -> int:
    """How many requests a run at `rate_rps` sends: rate x duration, within [min_requests, max_requests]."""
    if duration_s <= 0 or max_requests < min_requests or min_requests < 1:
        raise ValueError("need duration_s > 0 and 1 <= min_requests <= max_requests")
    return max(min_requests, min(max_requests, math.ceil(rate_rps * duration_s)))
