"""Per-interval reasoning: snapshots in, one decision per pool out. No I/O; time is passed in.

Each call compares the new snapshot with the previous one (counter deltas, reset-safe), feeds the
deltas into per-pool sliding windows, reads the gauges, checks freshness, and asks each pool's policy
and governor. Any input that cannot be trusted for a pool -- scrape failed, garbage, a family missing,
series stale, current size unknown, or the very first reading (no delta yet) -- gives a fail-static
hold for that pool, with the reason.

Beside the reactive rules, two optional inputs set floors and targets (applied by
:func:`~.schedule.guard`, after the governor): the schedule's size for the window in force at the wall
time passed in, and the planner's count (:class:`~.recommender.Recommender`, fed the window's request
rate and length histograms here, run every planner interval).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import cast

from disagg_tools.autoscaler.config import AutoscalerConfig, ScaledPool
from disagg_tools.autoscaler.governor import HOLD, Decision, Governor
from disagg_tools.autoscaler.histogram import Histogram, HistogramWindow, histogram_delta
from disagg_tools.autoscaler.policy import DecodePolicy, DecodeSignals, PrefillPolicy, PrefillSignals
from disagg_tools.autoscaler.recommender import Recommendation, Recommender, TrafficWindow
from disagg_tools.autoscaler.schedule import Target, floor, guard, targets
from disagg_tools.autoscaler.snapshot import GarbageMetrics, Snapshot

TTFT = "disagg_time_to_first_token_seconds"
TPOT = "disagg_time_per_output_token_seconds"
PROMPT = "disagg_prompt_tokens"
OUTPUT = "disagg_output_tokens"
PENDING = "disagg_prefill_pending_tokens"
QUEUE = "disagg_prefill_queue_requests"
ACTIVE = "disagg_decode_active_sequences"
KV_USED = "disagg_kv_blocks_used"
KV_FREE = "disagg_kv_blocks_free"

READS = (TTFT, TPOT, PROMPT, OUTPUT, PENDING, QUEUE, ACTIVE, KV_USED, KV_FREE)
"""Contract families the autoscaler reads (checked against the contract by a test)."""

GAUGES_BY_ROLE = {"prefill": (PENDING, QUEUE), "decode": (ACTIVE, KV_USED, KV_FREE)}

REQUEST_PATHS = ("disaggregated",)
"""Default `path` values of the request-level families a prefill or decode pool reads: requests on the
`colocated` path never touch those pools."""


class MissingMetric(LookupError):
    """A family the pool's policy needs is absent from the snapshot."""


def gauge(snapshot: Snapshot, name: str, **match: str) -> float:
    """Sum of a gauge over its matching series (one per Triton instance or pod); MissingMetric if none."""
    values = snapshot.select(name, **match)
    if not values:
        raise MissingMetric(name)
    return sum(values.values())


def kv_match(pool: ScaledPool) -> dict[str, str]:
    """Labels selecting a pool's KV block gauges: `pool=<kv_pool>` when configured, else `model=<name>`
    (the server labels them with both; `pool` carries the role, which two decode pools would share)."""
    return {"pool": pool.kv_pool} if pool.kv_pool else {"model": pool.name}


def inflight(snapshot: Snapshot, pool: ScaledPool) -> float:
    """The pool's in-flight work, as scale-in draining reads it (see contract.py for the meanings)."""
    if pool.role == "prefill":
        return gauge(snapshot, PENDING, model=pool.name) + gauge(snapshot, QUEUE, model=pool.name)
    return gauge(snapshot, ACTIVE, model=pool.name)


class _PoolState:
    def __init__(self, pool: ScaledPool, window_s: float) -> None:
        self.pool = pool
        self.governor = Governor(pool)
        self.latency = HistogramWindow(window_s)
        self.prompts = HistogramWindow(window_s)
        self.policy: PrefillPolicy | DecodePolicy = (
            PrefillPolicy(pool) if pool.role == "prefill" else DecodePolicy(pool)
        )


class Controller:
    """Holds the previous snapshot and the per-pool windows, governors and policies (and the planner's
    recommender with its traffic window, when one is given)."""

    def __init__(self, config: AutoscalerConfig, recommender: Recommender | None = None) -> None:
        self._config = config
        self._pools = {p.name: _PoolState(p, config.window_s) for p in config.pools}
        self._prev: Snapshot | None = None
        self._prev_now: float | None = None
        self._recommender = recommender
        self._traffic = TrafficWindow(config.window_s)
        self.recommendation: Recommendation | None = None
        """The planner's answer if it ran in the last step, else None."""

    @staticmethod
    def _delta(prev: Snapshot, cur: Snapshot, family: str, pool: ScaledPool) -> Histogram:
        """A request-level family over the pool's paths, summed over the entry points (`model` label:
        the model that served the request, not the pool) or over `request_models` when given."""
        found = None
        models: tuple[str | None, ...] = pool.request_models or (None,)
        for path in pool.paths or REQUEST_PATHS:
            for model in models:
                match = {"path": path} if model is None else {"path": path, "model": model}
                part = histogram_delta(prev, cur, family, **match)
                if part is not None:
                    found = part if found is None else found + part
        if found is None:
            raise MissingMetric(family)
        return found

    def _prefill(
        self,
        st: _PoolState,
        prev: Snapshot,
        cur: Snapshot,
        size: int,
        now: float,
        dt: float,
        lowest: int | None,
    ) -> Decision:
        p, policy = st.pool, cast(PrefillPolicy, st.policy)
        pending = gauge(cur, PENDING, model=p.name)
        queue = gauge(cur, QUEUE, model=p.name)
        ttft = self._delta(prev, cur, TTFT, p)
        prompts = self._delta(prev, cur, PROMPT, p)
        try:
            prev_pending: float | None = gauge(prev, PENDING, model=p.name)
        except MissingMetric:
            prev_pending = None
        st.latency.add(now, ttft)
        st.prompts.add(now, prompts)
        window = st.latency.merged(now)
        prompt_window = st.prompts.merged(now)
        arrival = prompts.total / dt
        processed = None if prev_pending is None else max(0.0, arrival - (pending - prev_pending) / dt)
        signals = PrefillSignals(
            ttft_quantile=window.quantile(p.quantile) if window else None,
            ttft_samples=window.count if window else 0.0,
            pending_tokens=pending,
            queue_requests=queue,
            prompt_tokens_quantile=prompt_window.quantile(p.quantile) if prompt_window else None,
            arrival_tokens_per_s=arrival,
            processed_tokens_per_s=processed,
            busy=bool(prev_pending and pending > 0),
        )
        return st.governor.decide(policy.propose(signals, size), size, now, lowest)

    def _decode(
        self, st: _PoolState, prev: Snapshot, cur: Snapshot, size: int, now: float, lowest: int | None
    ) -> Decision:
        p, policy = st.pool, cast(DecodePolicy, st.policy)
        kv = kv_match(p)
        used = gauge(cur, KV_USED, **kv)
        free = gauge(cur, KV_FREE, **kv)
        active = gauge(cur, ACTIVE, model=p.name)
        st.latency.add(now, self._delta(prev, cur, TPOT, p))
        window = st.latency.merged(now)
        signals = DecodeSignals(
            tpot_quantile=window.quantile(p.quantile) if window else None,
            tpot_samples=window.count if window else 0.0,
            kv_used=used,
            kv_free=free,
            active_sequences=active,
        )
        return st.governor.decide(policy.propose(signals, size), size, now, lowest)

    def _stale(self, cur: Snapshot, pool: ScaledPool) -> bool:
        if not cur.sample_times:
            return False  # a direct scrape is fresh when it succeeds
        match = kv_match(pool) if pool.role == "decode" else {"model": pool.name}
        names = (KV_USED,) if pool.role == "decode" else (PENDING,)
        oldest = cur.oldest_sample_time(names, **match)
        # No timestamp for a series we read means Prometheus had no recent sample of it at all.
        return oldest is None or cur.taken_at - oldest > self._config.source.stale_after_s

    def _plan(self, prev: Snapshot | None, cur: Snapshot | None, now: float, dt: float | None) -> None:
        """Feed the traffic window (the planner's prefill pool's request families) and run the planner
        when due; a failed read or a missing family adds nothing (the window ages)."""
        self.recommendation = None
        rec = self._recommender
        if rec is None:
            return
        if prev is not None and cur is not None and dt is not None and dt > 0:
            try:
                prompts = self._delta(prev, cur, PROMPT, rec.prefill)
                outputs = self._delta(prev, cur, OUTPUT, rec.prefill)
            except (MissingMetric, GarbageMetrics):
                pass
            else:
                self._traffic.add(now, dt, prompts, outputs)
        if rec.due(now):
            self.recommendation = rec.recommend(self._traffic.observed(), now)

    def _reactive(
        self,
        st: _PoolState,
        snapshot: Snapshot | None,
        size: int | None,
        now: float,
        dt: float | None,
        failure: str,
        lowest: int | None,
    ) -> Decision:
        prev = self._prev
        if size is None:
            return st.governor.fail_static(None, "size_unknown")
        if snapshot is None:
            return st.governor.fail_static(size, failure)
        if prev is None or dt is None or dt <= 0:
            return st.governor.fail_static(size, "warmup")
        if self._stale(snapshot, st.pool):
            return st.governor.fail_static(size, "stale")
        try:
            if st.pool.role == "prefill":
                return self._prefill(st, prev, snapshot, size, now, dt, lowest)
            return self._decode(st, prev, snapshot, size, now, lowest)
        except MissingMetric as exc:
            return st.governor.fail_static(size, f"missing:{exc.args[0]}")
        except GarbageMetrics:
            return st.governor.fail_static(size, "garbage")

    def step(
        self,
        snapshot: Snapshot | None,
        sizes: Mapping[str, int | None],
        now: float,
        failure: str = "scrape_failed",
        wall: float | None = None,
    ) -> list[Decision]:
        """One interval. `snapshot` None means the read failed (`failure` says how); `sizes` are the
        pools' current sizes as the actuator reports them (None: unknown); `now` is monotonic seconds,
        `wall` Unix seconds (needed with a schedule: the time of day picks its window)."""
        schedule = self._config.schedule
        if schedule is not None and wall is None:
            raise ValueError("a controller with a schedule needs the wall time")
        dt = None if self._prev_now is None else now - self._prev_now
        self._plan(self._prev, snapshot, now, dt)
        wanted: dict[str, Target] = {} if schedule is None or wall is None else targets(schedule, wall)
        decisions = []
        for st in self._pools.values():
            target = wanted.get(st.pool.name)
            planned = self._recommender.floor_for(st.pool) if self._recommender is not None else None
            last = st.governor.last_change
            since = None if last is None else now - last
            lowest = floor(st.pool, target, planned)
            size = sizes.get(st.pool.name)
            reactive = self._reactive(st, snapshot, size, now, dt, failure, lowest)
            decision = guard(st.pool, reactive, target, planned, since)
            if decision.kind != HOLD:
                st.governor.changed(now)
            decisions.append(decision)
        if snapshot is not None:
            self._prev, self._prev_now = snapshot, now
        return decisions
