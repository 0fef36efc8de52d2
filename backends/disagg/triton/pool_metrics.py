"""A pool instance's metrics: a reporter thread that publishes its KV, prefix-cache, queue, loan and
transfer gauges and counters every ``interval_s`` (``PoolReporter``). Families come from
``disagg.triton.metrics``."""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from disagg.procfs import stub_pids
from disagg.serving.auth import REFUSALS
from disagg.serving.telemetry import TIME_BUCKETS
from disagg.triton.metrics import Families, Gauge, SerialMetric

if TYPE_CHECKING:
    # Types only: both import torch, and the text models that use this module must not.
    from disagg.engine.loan import LoanStats
    from disagg.kv.transport import Transport
    from disagg.pool.loop import EngineLoop

log = logging.getLogger(__name__)


class PoolReporter:
    """A thread that publishes one pool instance's gauges and KV counters every ``interval_s``."""

    def __init__(
        self,
        pb_utils: Any,
        model: str,
        instance: str,
        loop: EngineLoop,
        transport: Transport | None,
        version: int = 1,
        interval_s: float = 0.25,
        load_s: float = 0.0,
    ) -> None:
        """``load_s``: how long the instance took to load, published once (``disagg_pool_load_seconds``)."""
        fam = self._fam = Families(pb_utils)  # families must outlive their metrics
        role = loop.role.value
        # one series per instance: instances are processes, and a shared series would be overwritten
        # (two versions of a pool, loaded side by side during a rollout, have instances of one name)
        labels = {"model": model, "pool": role, "instance": instance, "version": str(version)}
        self._loop, self._transport, self._interval = loop, transport, interval_s
        self.used = fam.gauge("disagg_kv_blocks_used", labels)
        self.free = fam.gauge("disagg_kv_blocks_free", labels)
        self.cached = fam.gauge("disagg_prefix_cache_blocks", labels)
        self.hits = fam.metric("disagg_prefix_cache_hits_total", labels)
        self.misses = fam.metric("disagg_prefix_cache_misses_total", labels)
        self.evictions = fam.metric("disagg_prefix_cache_evictions_total", labels)
        self.queue = fam.gauge("disagg_prefill_queue_requests", labels) if role == "prefill" else None
        self.pending = fam.gauge("disagg_prefill_pending_tokens", labels) if role == "prefill" else None
        self.active = fam.gauge("disagg_decode_active_sequences", labels) if role != "prefill" else None
        self._labels = labels
        self.limit = fam.gauge("disagg_decode_batch_limit", labels) if role == "decode" else None
        self.series: dict[str, SerialMetric] = {}  # counters made when first seen, by their key in _seen
        self.bytes = fam.metric("disagg_kv_transfer_bytes_total", labels)
        self.exported = fam.metric("disagg_kv_exported_bytes_total", labels)
        self.failures = fam.metric("disagg_kv_transfer_failures_total", labels)
        self.incompatible = fam.metric("disagg_kv_incompatible_total", labels)
        self.expired = fam.metric("disagg_kv_lease_expired_total", labels)
        self.renewals = fam.metric("disagg_kv_lease_renewals_total", labels)
        self.transfer = fam.histogram("disagg_kv_transfer_seconds", labels, TIME_BUCKETS)
        self.steps = fam.metric("disagg_engine_steps_total", labels)
        self.busy = fam.metric("disagg_engine_busy_seconds_total", labels)
        self.refusals = {
            reason: fam.metric("disagg_pool_auth_refusals_total", {**labels, "reason": reason})
            for reason in REFUSALS
        }
        self.info = fam.gauge("disagg_engine_info", {**labels, **loop.engine.describe()})
        self.load = fam.gauge("disagg_pool_load_seconds", labels)
        self._adopt_orphaned_shares(model)
        self.info.set(1)
        self.load.set(load_s)
        self._seen = {
            "bytes": 0.0,
            "exported": 0.0,
            "failures": 0.0,
            "expired": 0.0,
            "renewals": 0.0,
            "steps": 0.0,
            "busy": 0.0,
            "hits": 0.0,
            "misses": 0.0,
            "evictions": 0.0,
            "incompatible": 0.0,
        }
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"metrics-{role}", daemon=True)

    def _adopt_orphaned_shares(
        self, model: str, live_stubs: Callable[[int, str], list[int]] = stub_pids
    ) -> None:
        """An instance reloaded after its stub was killed registers the same series while the dead
        stub's last published gauges are still in them (it never retired): with no other stub of this
        model alive under this server, whatever the gauges hold is such a share, and this instance
        takes it over so that its first publish corrects it. With another stub alive (a reload
        beside a live instance, or a second instance) nothing is taken: that one retires its own."""
        try:
            if any(pid != os.getpid() for pid in live_stubs(os.getppid(), model)):
                return
            for gauge in self._gauges():
                gauge.adopt()
        except Exception:
            log.warning(
                "could not read the pool's gauges at load; a crashed predecessor's values stay", exc_info=True
            )

    def refused(self, reason: str) -> None:
        """A call refused for its token (a reason of ``disagg.serving.auth.REFUSALS``)."""
        self.refusals[reason].increment(1)

    def start(self) -> PoolReporter:
        self.publish()
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)

    def retire(self) -> None:
        """Stop publishing and zero this instance's gauges: its series stay on /metrics (see
        ``Families``), but an instance removed by a scale-in or an unload no longer adds its last
        queue, sequences or KV blocks to the pool's sums. Counters keep their totals."""
        self.stop()
        try:
            self.publish()  # the counters' last increments
        except Exception:
            log.warning("publishing pool metrics failed", exc_info=True)
        for gauge in self._gauges():
            gauge.set(0)

    def _gauges(self) -> list[Gauge]:
        """This instance's gauges (the ones its role has): what it zeroes when it retires, and takes
        over at load from a predecessor that never retired."""
        gauges = (
            self.used,
            self.free,
            self.cached,
            self.queue,
            self.pending,
            self.active,
            self.limit,
            self.info,
            self.load,
        )
        return [gauge for gauge in gauges if gauge is not None]

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                self.publish()
            except Exception:
                log.warning("publishing pool metrics failed", exc_info=True)

    def publish(self) -> None:
        stats = self._loop.stats()
        self.used.set(stats.blocks_used)
        self.free.set(stats.blocks_free)
        if self.queue is not None:
            self.queue.set(stats.queued)
            self.pending.set(stats.queued_prompt_tokens)
        if self.active is not None:
            self.active.set(stats.active_sequences)
        self._add(self.steps, "steps", stats.engine_steps)
        self._add(self.busy, "busy", stats.owned_busy_s)  # borrowed help counted as own time
        self.cached.set(stats.blocks_cached)
        self._add(self.hits, "hits", stats.prefix_hits)
        self._add(self.misses, "misses", stats.prefix_misses)
        self._add(self.evictions, "evictions", stats.prefix_evictions)
        self._add(self.incompatible, "incompatible", stats.kv_incompatible)
        if self.limit is not None:
            self.limit.set(stats.batch_limit)
        for action, reason, count in stats.batch_decisions:
            labels = {**self._labels, "action": action, "reason": reason}
            name = "disagg_batch_tuner_decisions_total"
            self._add_series(f"decisions/{action}/{reason}", name, labels, count)
        for loan in stats.loans:
            self._publish_loan(loan)
        if self._transport is None:
            return
        snap = self._transport.stats.snapshot()
        self._add(self.bytes, "bytes", snap.bytes_imported)
        self._add(self.exported, "exported", snap.bytes_exported)
        # an import whose checksum did not match is one of its failures already (counted once)
        self._add(self.failures, "failures", snap.failures + snap.refused)
        self._add(self.expired, "expired", snap.lease_expiries)
        self._add(self.renewals, "renewals", snap.lease_renewals)
        while self._loop.transfer_times:
            self.transfer.observe(self._loop.transfer_times.popleft())

    def _publish_loan(self, loan: LoanStats) -> None:
        """A borrower's borrowed core-seconds; a lender's lent seconds and reclaims that waited."""
        if not loan.lender:
            return  # no lender has come yet: nothing was lent
        core = str(loan.core)
        if self._loop.role.value == "prefill":
            labels = {**self._labels, "borrower": self._labels["model"], "lender": loan.lender, "core": core}
            series = {"disagg_borrowed_core_seconds_total": loan.borrowed_s}
        else:
            labels = {**self._labels, "lender": loan.lender, "core": core}
            series = {
                "disagg_lent_core_seconds_total": loan.lent_s,
                "disagg_loan_reclaim_waits_total": float(loan.waits),
                "disagg_loan_reclaim_wait_seconds_total": loan.wait_s,
            }
        for name, total in series.items():
            self._add_series(f"loans/{name}/{loan.lender}/{core}", name, labels, total)

    def _add_series(self, key: str, name: str, labels: dict[str, str], total: float) -> None:
        """``_add`` to a counter of family ``name`` made the first time ``key`` is seen."""
        if key not in self.series:
            self.series[key] = self._fam.metric(name, labels)
            self._seen[key] = 0.0
        self._add(self.series[key], key, total)

    def _add(self, counter: SerialMetric, key: str, total: float) -> None:
        delta = total - self._seen[key]
        if delta > 0:
            counter.increment(delta)
            self._seen[key] = total
