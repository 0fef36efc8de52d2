"""Per-request latency records and the figures computed from them (DistServe definitions).

Contract (all times in seconds on one monotonic clock, relative to the run's start):

- `arrival` is the *scheduled* send time of the open-loop schedule, not when the client got round to
  sending: a load generator that falls behind is charged to the system under test, never hidden.
- TTFT = first_token - arrival.
- TPOT = (last_token - first_token) / (n - 1), n the number of output tokens; undefined (None) for n <= 1,
  and such a request meets the TPOT SLO vacuously.
- A request *meets the SLO* when it finished without error and TTFT <= ttft_slo and TPOT <= tpot_slo.
- attainment = meeting requests / all requests of the run (errors and timeouts count as misses).
- The run window is [0, end], end = the latest completion (or the last arrival if that is later);
  throughput = finished requests / window, goodput = meeting requests / window, token throughput =
  output tokens of finished requests / window.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class Slo:
    """Latency objectives in seconds; both must be met."""

    ttft_s: float
    tpot_s: float

    def __post_init__(self) -> None:
        for name in ("ttft_s", "tpot_s"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise ValueError(f"{name} must be a positive finite number")


@dataclass(frozen=True)
class RequestRecord:
    """What happened to one request. `error` is None on success; times are None when never reached."""

    index: int
    arrival: float
    sent: float | None
    first_token: float | None
    last_token: float | None
    n_pieces: int
    n_tokens: int
    prompt_tokens: int
    target_output_tokens: int
    error: str | None = None
    kind: str = ""
    """Free label (e.g. "short" / "long" in the interference run)."""
    ended: float | None = None
    """When its last response or its error came back (None: never, or not recorded)."""

    @property
    def ok(self) -> bool:
        return self.error is None and self.first_token is not None and self.last_token is not None

    @property
    def ttft(self) -> float | None:
        if not self.ok:
            return None
        return self.first_token - self.arrival  # type: ignore[operator]

    @property
    def tpot(self) -> float | None:
        if not self.ok or self.n_tokens <= 1:
            return None
        return (self.last_token - self.first_token) / (self.n_tokens - 1)  # type: ignore[operator]

    @property
    def send_lag(self) -> float | None:
        """How late the client sent this request relative to the schedule (open-loop check)."""
        return None if self.sent is None else self.sent - self.arrival

    def meets(self, slo: Slo) -> bool:
        """Finished, and both TTFT and TPOT within `slo` (TPOT vacuous for single-token outputs)."""
        if not self.ok:
            return False
        tpot = self.tpot
        return self.ttft <= slo.ttft_s and (tpot is None or tpot <= slo.tpot_s)  # type: ignore[operator]

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out.update(ttft=self.ttft, tpot=self.tpot)
        return out


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0..100) with linear interpolation between order statistics; None if empty."""
    if not 0 <= q <= 100:
        raise ValueError("q must be in 0..100")
    data = sorted(values)
    if not data:
        return None
    pos = (len(data) - 1) * q / 100
    low = math.floor(pos)
    high = min(low + 1, len(data) - 1)
    return data[low] + (data[high] - data[low]) * (pos - low)


@dataclass(frozen=True)
class Summary:
    """Figures of one run. Latency percentiles are over finished requests only; None when there are none."""

    n_requests: int
    n_ok: int
    n_errors: int
    n_meeting: int
    attainment: float
    window_s: float
    throughput_rps: float
    goodput_rps: float
    token_throughput: float
    ttft_p50: float | None
    ttft_p90: float | None
    ttft_p99: float | None
    tpot_p50: float | None
    tpot_p90: float | None
    tpot_p99: float | None
    ttft_attainment: float
    tpot_attainment: float
    max_send_lag_s: float | None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def summarize(records: Sequence[RequestRecord], slo: Slo) -> Summary:
    """Figures of a run from its records (see the module contract). An empty run is an error."""
    if not records:
        raise ValueError("no records to summarise")
    ok = [r for r in records if r.ok]
    ends = [r.last_token for r in ok if r.last_token is not None]
    end = max([*ends, max(r.arrival for r in records)])
    window = end if end > 0 else float("nan")
    meeting = sum(r.meets(slo) for r in records)
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    tpots = [r.tpot for r in ok if r.tpot is not None]
    lags = [r.send_lag for r in records if r.send_lag is not None]
    n = len(records)
    return Summary(
        n_requests=n,
        n_ok=len(ok),
        n_errors=n - len(ok),
        n_meeting=meeting,
        attainment=meeting / n,
        window_s=window,
        throughput_rps=len(ok) / window,
        goodput_rps=meeting / window,
        token_throughput=sum(r.n_tokens for r in ok) / window,
        ttft_p50=percentile(ttfts, 50),
        ttft_p90=percentile(ttfts, 90),
        ttft_p99=percentile(ttfts, 99),
        tpot_p50=percentile(tpots, 50),
        tpot_p90=percentile(tpots, 90),
        tpot_p99=percentile(tpots, 99),
        ttft_attainment=sum(1 for r in ok if r.ttft <= slo.ttft_s) / n,  # type: ignore[operator]
        tpot_attainment=sum(1 for r in ok if r.tpot is None or r.tpot <= slo.tpot_s) / n,
        max_send_lag_s=max(lags) if lags else None,
    )
