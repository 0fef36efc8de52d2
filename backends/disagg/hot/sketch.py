"""A count-min sketch over a sliding time window: how often each key was seen lately, in fixed memory.

``depth`` rows of ``width`` counters; a key adds one to one counter per row and its estimate is the
smallest of those counters, so it never under-counts and over-counts by at most ``e * N / width``
with probability ``1 - exp(-depth)`` (N: keys added in the window). The window is ``buckets`` slices of
``window_s / buckets`` seconds each; the sketch keeps one counter table per slice and their running
sum, and a slice that falls out of the window is subtracted from the sum and cleared. So a count
covers between ``window_s - window_s / buckets`` and ``window_s`` seconds.

Keys are digests (``bytes`` of at least ``4 * depth`` bytes, e.g. ``disagg.engine.prefix`` keys):
row ``r`` indexes by the digest's ``r``-th 32-bit word, so no hashing happens here. Pure: the caller
passes the time.
"""

from __future__ import annotations

import math

import numpy as np

MAX_CELLS = 1 << 24  # width x depth x buckets at most (64 MiB of int32)


class WindowedCountMin:
    def __init__(self, window_s: float, width: int = 4096, depth: int = 4, buckets: int = 10) -> None:
        if not isinstance(window_s, int | float) or not 0 < window_s <= 86400:
            raise ValueError("window_s must be a number of seconds in (0, 86400]")
        for name, value, top in (("width", width, 1 << 20), ("depth", depth, 8), ("buckets", buckets, 1000)):
            if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= top:
                raise ValueError(f"{name} must be an integer in [1, {top}]")
        if width * depth * buckets > MAX_CELLS:
            raise ValueError(f"width x depth x buckets must be at most {MAX_CELLS}")
        self.window_s = float(window_s)
        self.width, self.depth, self.buckets = width, depth, buckets
        self._slice_s = self.window_s / buckets
        self._slices = np.zeros((buckets, depth, width), dtype=np.int32)
        self._total = np.zeros((depth, width), dtype=np.int64)
        self._offsets = np.arange(depth, dtype=np.intp) * width  # row r's counters start at r x width
        self._current: int | None = None  # index of the newest slice (time // slice_s)

    def _cells(self, keys: list[bytes]) -> np.ndarray:
        """Each key's counter per row, as indices into a flattened (depth, width) table: shape
        (len(keys), depth)."""
        size = 4 * self.depth
        if min(map(len, keys)) < size:
            raise ValueError(f"a key needs at least {size} bytes (one 32-bit word per row)")
        words = np.frombuffer(b"".join(key[:size] for key in keys), dtype="<u4")
        return (words.reshape(len(keys), self.depth) % self.width).astype(np.intp) + self._offsets

    def advance(self, now: float) -> int:
        """Drop the slices that ended more than a window before ``now``; returns the newest slice."""
        current = math.floor(now / self._slice_s)
        if self._current is None:
            self._current = current
        elif current > self._current:  # time never runs back: a late caller counts in the newest
            for index in range(self._current + 1, min(current, self._current + self.buckets) + 1):
                stale = self._slices[index % self.buckets]
                self._total -= stale
                stale.fill(0)
            self._current = current
        return self._current

    def add(self, key: bytes, now: float, count: int = 1) -> int:
        """Count ``key`` at ``now``; returns its estimate in the window, this one included."""
        return int(self.add_many([key], now, count)[0])

    def add_many(self, keys: list[bytes], now: float, count: int = 1) -> np.ndarray:
        """Count each of ``keys`` at ``now``; their estimates, these included (one vectorised pass)."""
        if not keys:
            return np.zeros(0, dtype=np.int64)
        current = self.advance(now)
        cells = self._cells(keys)
        flat = cells.reshape(-1)  # one-dimensional ``add.at``: numpy's fast path (keys may repeat)
        np.add.at(self._slices[current % self.buckets].reshape(-1), flat, count)
        total = self._total.reshape(-1)
        np.add.at(total, flat, count)
        return total[cells].min(axis=1)

    def estimate(self, key: bytes, now: float | None = None) -> int:
        """How often ``key`` was counted in the window (never fewer than it was)."""
        return int(self.estimate_many([key], now)[0])

    def estimate_many(self, keys: list[bytes], now: float | None = None) -> np.ndarray:
        if now is not None:
            self.advance(now)
        if not keys:
            return np.zeros(0, dtype=np.int64)
        return self._total.reshape(-1)[self._cells(keys)].min(axis=1)

    @property
    def total(self) -> int:
        """Keys counted in the window."""
        return int(self._total[0].sum())
