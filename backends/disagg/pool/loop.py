"""The engine loop of a pool instance: one thread owns the engine and serves every job.

Triton's ``execute`` only parses a request and calls ``submit``. This thread takes the inbox's typed
messages (``disagg.protocol.messages``), then runs one iteration::

    plan = scheduler.schedule(); results = runner.run(plan); emissions = scheduler.postprocess(results)

and hands the emissions to the dispatcher thread (``disagg.pool.dispatcher``), which delivers
them and watches for cancellation. Every job gets exactly one final event (its last token, its
prefill result, or a failure), whatever happens: cancellation, a stop request, an engine fault or
shutdown. The schedulers (``disagg.scheduling``) own admission and every capacity limit.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from disagg.engine.backend import EngineBackend
from disagg.engine.loan import Loans, LoanStats
from disagg.kv.descriptor import Descriptor
from disagg.kv.errors import KVError
from disagg.pool.dispatcher import Dispatcher
from disagg.pool.renewal import Renewals
from disagg.pool.runner import Runner
from disagg.protocol.errors import CANCELLED, UNAVAILABLE, ServingError
from disagg.protocol.messages import (
    Cancelled,
    DecodeJob,
    Failed,
    Job,
    Message,
    PoolLoad,
    Prefilled,
    Released,
    Stop,
    Submit,
    prompt_tokens,
)
from disagg.scheduling import Scheduler
from disagg.scheduling.plan import Emission, Plan
from disagg.scheduling.tuner import BatchTuner

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoopStats:
    """A consistent snapshot for metrics and readiness (taken by the loop thread each iteration)."""

    role: str
    queued: int
    queued_prompt_tokens: int
    active_sequences: int
    held_leases: int
    blocks_used: int
    blocks_free: int
    healthy: bool
    engine_steps: int  # engine calls so far: each prefill, each decode step
    engine_busy_s: float  # seconds spent inside them
    prompt_tokens_done: int = 0  # prompt tokens prefilled so far
    prefill_busy_s: float = 0.0  # of engine_busy_s, the calls that prefilled
    blocks_cached: int = 0  # of the free blocks, those keeping a prefix (the prefix cache)
    prefix_hits: int = 0  # prefix cache counters so far, in blocks
    prefix_misses: int = 0
    prefix_evictions: int = 0
    kv_incompatible: int = 0  # KV imports refused as another model version's (engine.fingerprint)
    batch_limit: int = 0  # sequences the decode batch may hold now (the batch tuner's limit)
    batch_decisions: tuple[tuple[str, str, int], ...] = ()  # the tuner's (action, reason, count)
    loans: tuple[LoanStats, ...] = ()  # cores lent or borrowed (disagg.engine.loan)

    @property
    def owned_busy_s(self) -> float:
        """Engine seconds as this pool's own cores would have spent them: the time borrowed helpers
        computed on another pool's cores is added back, so that a pool's measured speed (which
        admission by capacity and the autoscaler read) never counts borrowed throughput as its own."""
        return self.engine_busy_s + self._borrowed_s

    @property
    def owned_prefill_busy_s(self) -> float:
        """``prefill_busy_s`` the same way (a prefill pool borrows cores for its prompts)."""
        return self.prefill_busy_s + self._borrowed_s

    @property
    def _borrowed_s(self) -> float:
        return sum(loan.borrowed_s for loan in self.loans) if self.role == "prefill" else 0.0

    def load(self) -> PoolLoad:
        """What a ping answers (``disagg.protocol.messages.PoolLoad``)."""
        return PoolLoad(
            self.queued,
            self.queued_prompt_tokens,
            self.active_sequences,
            self.blocks_used,
            self.blocks_free,
            self.prompt_tokens_done,
            self.owned_busy_s,
            self.engine_steps,
            self.owned_prefill_busy_s,
        )


class EngineLoop:
    def __init__(
        self,
        backend: EngineBackend,
        scheduler: Scheduler,
        transport: Any = None,
        *,
        idle_wait_s: float = 0.05,
        clock: Callable[[], float] = time.time,
        tuner: BatchTuner | None = None,
        loans: Loans | None = None,
    ) -> None:
        self.role = scheduler.role
        if self.role.needs_transport and transport is None:
            raise ValueError(f"the {self.role.value} role needs a KV transport")
        self.engine = backend
        self.scheduler = scheduler
        self.transport = transport
        self.runner = Runner(backend, transport)
        self.transfer_times = self.runner.transfer_times  # drained by the metrics reporter
        self.idle_wait_s = idle_wait_s
        self._clock = clock  # wall clock, as KV descriptors' expiry times are
        self.tuner = tuner  # sets the scheduler's batch limit from what each interval measured
        if tuner is not None:
            scheduler.batch_limit = tuner.limit
        self.loans = loans or Loans()  # cores this pool lends or borrows (disagg.engine.loan)
        self._renewals = Renewals()  # imports waiting for decode blocks, and their leases
        self.iterations = 0  # loop iterations so far (tests: an idle or stalled loop waits)
        self._cond = threading.Condition()
        self._inbox: deque[Message] = deque()
        self._stopping = False
        self._draining = False
        self._healthy = True
        self._snapshot = self._measure()
        self._thread = threading.Thread(target=self._run, name=f"engine-{self.role.value}", daemon=True)
        self.dispatcher = Dispatcher(f"responses-{self.role.value}", self.cancelled)

    # ------------------------------------------------------------- other threads

    def warm_up(self, prompt_tokens: int) -> None:
        """Before ``start``: one prompt prefilled and dropped (``Runner.warm_up``), in the stats."""
        self.runner.warm_up(prompt_tokens)
        self._snapshot = self._measure()

    def start(self) -> EngineLoop:
        self._thread.start()
        self.dispatcher.start()
        return self

    @property
    def healthy(self) -> bool:
        return self._healthy and self._thread.is_alive()

    def validate(self, job: Job) -> None:
        """Refuse, on the caller's thread, a job this pool could never serve (InvalidRequest or
        ServingError INVALID_ARG): a bad request, an operation this role does not run, a job larger
        than the whole KV pool."""
        self.engine.validate(job.request)
        self.scheduler.check(job)

    def submit(self, job: Job) -> None:
        """Queue a validated job; ServingError(UNAVAILABLE) when the loop does not serve. A full
        queue refuses the job with a final UNAVAILABLE event."""
        with self._cond:
            if self._stopping or self._draining or not self._healthy:
                raise ServingError(UNAVAILABLE, f"{self.role.value} pool is not serving")
            self._inbox.append(Submit(job))
            self._cond.notify()

    def stop(self, handle: str) -> None:
        """End the job with this handle (client cancel relayed by the orchestrator). Idempotent."""
        self._post(Stop(handle))

    def cancelled(self, handle: str) -> None:
        """The dispatcher found the job's sink cancelled."""
        self._post(Cancelled(handle))

    def lease_released(self, lease_id: str, reason: str) -> None:
        """Transport callback (any thread): the importer has the KV, or the lease ended."""
        self._post(Released(lease_id, reason))

    def abort_lease(self, lease_id: str) -> bool:
        """Give a lease's blocks back now (the request was cancelled between prefill and decode)."""
        return self.transport.abort(lease_id) if self.transport else False

    def _post(self, message: Message) -> None:
        with self._cond:
            self._inbox.append(message)
            self._cond.notify()

    def stats(self) -> LoopStats:
        snapshot = self._snapshot
        with self._cond:
            incoming = [m.job for m in self._inbox if isinstance(m, Submit)]
        return replace(
            snapshot,
            queued=snapshot.queued + len(incoming),
            queued_prompt_tokens=snapshot.queued_prompt_tokens + sum(prompt_tokens(job) for job in incoming),
            healthy=self.healthy,
        )

    def drain(self, timeout_s: float, leases: bool = True) -> bool:
        """Stop taking jobs, then wait (bounded) until the ones taken have ended and, on a prefill
        pool with ``leases``, until every exported KV lease has been acked or has expired: an
        instance removed by a scale-in then strands no request and no importer. Without ``leases``
        (nothing can import any more: the server is exiting) held leases do not hold the drain.
        True when fully drained."""
        with self._cond:
            self._draining = True
            self._cond.notify()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and self.healthy:
            with self._cond:
                s = self._snapshot
                held = s.held_leases if leases else 0
                if not self._inbox and not (s.queued or s.active_sequences or held):
                    return True
                self._cond.wait(0.05)  # woken by each loop iteration; the deadline bounds the wait
        return False

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stop taking jobs, fail the queued ones, end the running ones, join the threads."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join(timeout_s)
        self.dispatcher.close(timeout_s)  # after the loop's last final responses
        if not self._thread.is_alive():  # the loop thread alone uses the loans and the engine
            self.loans.close()
            self.engine.close()

    # ------------------------------------------------------------- the loop thread

    def _run(self) -> None:
        stalled = False  # the last plan was empty although jobs wait (e.g. for blocks held by leases)
        running = Plan()  # the plan the engine is running (its jobs wait for its results)
        try:
            while True:
                with self._cond:
                    if self._stopping:
                        stranded = self._take_inbox()
                        break
                    # nothing to do until a message comes (a job, a release, a stop) or idle_wait_s
                    # passes (renewals are due by the clock): never spin on an empty plan
                    if not self._inbox and (stalled or self.scheduler.idle):
                        self.loans.idle()
                        self._cond.wait(self.idle_wait_s)
                    inbox = self._take_inbox()
                for message in inbox:
                    self._take(message)
                plan = self.scheduler.schedule()
                stalled = plan.empty
                self.iterations += 1
                for job in (*plan.imports, *(job for job, _ in plan.refused)):
                    self._renewals.forget(job.handle)
                self._renew_waiting()
                batch = self.scheduler.num_running + len(plan.imports) if plan.decode else 0
                busy = self.runner.busy_s
                emissions = []
                if not plan.empty:
                    self.loans.step()
                    running = plan
                    emissions = self.scheduler.postprocess(self.runner.run(plan))
                    running = Plan()
                self._tune(batch, self.runner.busy_s - busy)
                self._snapshot = self._measure()
                for emission in emissions:
                    self._send(emission)
                if not plan.empty:
                    self.loans.stepped()  # after the tokens went out: a lender may pause here
                if self._draining:
                    with self._cond:
                        self._cond.notify_all()
        except BaseException as exc:  # an engine fault: nobody can be served any more
            log.exception("%s engine loop failed", self.role.value)
            with self._cond:  # submit() refuses from here on; what it queued before ends here
                self._healthy = False
                stranded = self._take_inbox()
            self._fail_all(ServingError(UNAVAILABLE, f"{self.role.value} pool failed"), stranded, running)
            if not isinstance(exc, Exception):
                raise
            return
        self._fail_all(
            ServingError(UNAVAILABLE, f"{self.role.value} pool is shutting down"), stranded, Plan()
        )
        self.loans.idle()

    def _take_inbox(self) -> list[Message]:
        """The messages posted since the last call, in order (the caller holds ``_cond``)."""
        inbox, self._inbox = list(self._inbox), deque()
        return inbox

    def _take(self, message: Message) -> None:
        if isinstance(message, Submit):
            job = self._verified(message.job)
            refusal = self.scheduler.add(job)
            if refusal is not None:
                self._send(refusal)
            else:
                self.dispatcher.watch(job)
                if isinstance(job, DecodeJob) and isinstance(job.descriptor, Descriptor):
                    self._renewals.watch(job.handle, job.descriptor)
        elif isinstance(message, (Stop, Cancelled)):
            self._renewals.forget(message.handle)
            removal = self.scheduler.remove(message.handle)
            if removal is None:
                return
            if removal.seq_id is not None:
                self.engine.free(removal.seq_id)
            if removal.lease_id is not None:
                self.abort_lease(removal.lease_id)
            if removal.job is not None:
                why = "request was stopped" if isinstance(message, Stop) else "request was cancelled"
                self._send(Emission(removal.job, Failed(ServingError(CANCELLED, why)), True))
        elif isinstance(message, Released):
            seq_id = self.scheduler.lease_released(message.lease_id)
            if seq_id is not None:
                self.engine.free(seq_id)

    def _tune(self, batch: int, busy_s: float) -> None:
        if self.tuner is None:
            return
        waiting = self.scheduler.slot_waiting
        decision = self.tuner.observe(
            time.monotonic(), batch, busy_s, slot_bound=waiting > 0, demand=batch + waiting
        )
        if decision is None or decision.limit == self.scheduler.batch_limit:
            return
        log.info(
            "%s batch limit %d -> %d (%s: utilisation %.2f, TPOT %s, peak batch %d, demand %d)",
            self.role.value, self.scheduler.batch_limit, decision.limit, decision.reason,
            decision.utilisation,
            "-" if decision.tpot_s is None else f"{decision.tpot_s * 1000:.1f} ms",
            decision.peak_batch, decision.demand,
        )  # fmt: skip
        self.scheduler.batch_limit = decision.limit

    def _verified(self, job: Job) -> Job:
        """A decode job with its descriptor verified, here and once: the import and the renewals
        take the ``Descriptor``. One the transport refuses is left as it came, to be refused at its
        import with the transport's own error (as are the envelopes of engines that seal their own)."""
        if not isinstance(job, DecodeJob) or self.transport is None or isinstance(job.descriptor, Descriptor):
            return job
        try:
            return replace(job, descriptor=self.transport.verify(job.descriptor))
        except KVError:
            return job

    def _renew_waiting(self) -> None:
        """Keep the KV of imports still waiting for blocks: a lease never ends because of the wait."""
        if not self._renewals:
            return
        for handle, descriptor in self._renewals.due(self._clock()):
            try:
                self._renewals.renewed(handle, self.transport.renew(descriptor))
            except KVError as exc:  # gone already: its import fails cleanly at its turn
                log.warning("renewing the KV lease of a waiting import failed: %s", exc)
                self._renewals.forget(handle)

    def _send(self, emission: Emission) -> None:
        event = emission.event
        undelivered = None
        if isinstance(event, Prefilled) and event.lease_id is not None:
            lease_id = event.lease_id
            undelivered = lambda: self.abort_lease(lease_id)  # noqa: E731 - nobody will import it
        self.dispatcher.send(emission.job, event, emission.final, undelivered)

    def _fail_all(self, error: ServingError, inbox: list[Message], plan: Plan) -> None:
        """End every job: those the scheduler holds, those of the ``plan`` an engine fault broke off
        (the scheduler holds them for the plan's results), and those still in ``inbox`` (submitted since
        the loop last took its messages). A job left out would keep its caller waiting forever."""
        self._renewals.clear()
        queued = [message.job for message in inbox if isinstance(message, Submit)]
        jobs = {id(job): job for job in [*self.scheduler.drop_all(), *plan.jobs, *queued]}
        for job in jobs.values():
            self.dispatcher.send(job, Failed(error), True)
        for lease_id in self.scheduler.lease_ids():
            self.abort_lease(lease_id)
        self._snapshot = self._measure()

    def _measure(self) -> LoopStats:
        s, usage = self.scheduler, self.engine.usage()
        return LoopStats(
            role=self.role.value,
            queued=s.num_waiting,
            queued_prompt_tokens=s.queued_prompt_tokens,
            active_sequences=s.num_running,
            held_leases=s.held_leases,
            blocks_used=usage.used,
            blocks_free=usage.free,
            healthy=self._healthy,
            engine_steps=self.runner.steps,
            engine_busy_s=self.runner.busy_s,
            prompt_tokens_done=self.runner.prompt_tokens,
            prefill_busy_s=self.runner.prefill_busy_s,
            blocks_cached=usage.cached,
            prefix_hits=usage.prefix_hits,
            prefix_misses=usage.prefix_misses,
            prefix_evictions=usage.prefix_evictions,
            kv_incompatible=self.runner.kv_incompatible,
            batch_limit=s.batch_limit,
            batch_decisions=tuple(
                (action, reason, n) for (action, reason), n in sorted(self.tuner.decisions.items())
            )
            if self.tuner is not None
            else (),
            loans=self.loans.stats(),
        )
