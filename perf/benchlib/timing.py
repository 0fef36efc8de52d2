"""Wall-clock timing of a callable in a benchmark: warm-up calls, then the median of repetitions."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def median_time(fn: Callable[[], object], reps: int, warmup: int = 1) -> float:
    """Seconds per call of ``fn``: ``warmup`` untimed calls, then the median of ``reps`` timed ones."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)
