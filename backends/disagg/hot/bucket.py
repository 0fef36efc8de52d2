"""Token buckets: a rate cap per hot group, where no pool of its own isolates it.

A bucket holds at most ``burst`` tokens and refills at ``rate`` per second; each request takes one.
A request that finds the bucket empty is not refused at once: it reserves the next token and waits
for it, so a burst is spread out at ``rate`` instead of landing on the shared pools together. A
reservation that would wait longer than ``max_wait_s`` is refused instead (and takes nothing). The
rate may change (``set_rate``: the adaptive cap of ``disagg.hot.throttle``); the time before a
change refills at the old rate. Pure: the caller passes the time, and sleeps.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BucketConfig:
    rate: float = 0.0
    """Requests per second one hot group may start (0: no cap)."""
    burst: int = 1
    max_wait_s: float = 30.0

    def __post_init__(self) -> None:
        """Ranges; the types are ``config.build``'s (through ``HotPromptsConfig``; a config built by hand
        in code is trusted to be typed)."""
        if not 0 <= self.rate <= 1e6:
            raise ValueError("group_rate: must be a number of requests per second in [0, 1e6]")
        if not 1 <= self.burst <= 1 << 20:
            raise ValueError("group_burst: must be in [1, 1048576]")
        if not 0 <= self.max_wait_s <= 86400:
            raise ValueError("max_wait_s: must be a number of seconds in [0, 86400]")

    @property
    def enabled(self) -> bool:
        return self.rate > 0


class TokenBucket:
    def __init__(self, config: BucketConfig, now: float) -> None:
        if not config.enabled:
            raise ValueError("a token bucket needs a positive rate")
        self.config = config
        self._rate = float(config.rate)
        self._tokens = float(config.burst)
        self._at = now

    @property
    def rate(self) -> float:
        """The refill rate now: the config's, or the last one given (an adaptive cap)."""
        return self._rate

    def set_rate(self, rate: float, now: float) -> None:
        """Refill at ``rate`` from ``now`` on; the time before is refilled at the rate it had."""
        if not isinstance(rate, int | float) or isinstance(rate, bool) or not 0 < rate <= 1e6:
            raise ValueError("a token bucket's rate must be a number of requests per second in (0, 1e6]")
        self._refill(now)
        self._rate = float(rate)

    def _refill(self, now: float) -> None:
        if now > self._at:
            self._tokens = min(float(self.config.burst), self._tokens + (now - self._at) * self._rate)
            self._at = now

    def reserve(self, now: float, rate: float | None = None) -> float | None:
        """Take one token: the seconds to wait for it (0: at once), or None when that would exceed
        ``max_wait_s`` (nothing is taken then). ``rate``: the refill rate from ``now`` on (see
        ``set_rate``; None: unchanged). Tokens already reserved are repaid at that rate: a new
        reservation waits behind them at the rate in force when it is made."""
        if rate is not None:
            self.set_rate(rate, now)
        self._refill(now)
        wait = max(0.0, (1.0 - self._tokens) / self._rate) + max(0.0, self._at - now)
        if wait > self.config.max_wait_s:
            return None
        self._tokens -= 1.0
        return wait

    def full(self, now: float) -> bool:
        """Whether it has refilled to its burst (an idle group's bucket can be dropped)."""
        return self._tokens + max(0.0, now - self._at) * self._rate >= self.config.burst
