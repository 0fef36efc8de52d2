"""The engine loop of a pool instance: one thread owns the Engine and serves every job.

Triton's ``execute`` only parses a request and calls ``submit``; this thread prefills, imports and
steps the decode batch, and reports through each job's ``Sink``. Every job gets exactly one final
event (its last token, its prefill result, or a failure), whatever happens: cancellation, a stop
request, an engine fault or shutdown.

Roles:
- ``prefill``: prompts one at a time (FIFO); the KV is exported under a lease and the job ends with
  a ``Prefilled`` event carrying the first token and the signed descriptor. The sequence's blocks are
  freed when the transport reports the lease released (ack from the importer, abort, or expiry).
- ``decode``: jobs carry a descriptor and the sequence state; the KV is imported (one copy) when
  blocks are free, then the sequence joins the continuous batch.
- ``colocated``: both phases in this engine (``ColocatedScheduler``): the baseline and the fallback.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

from disagg.engine.engine import Engine
from disagg.engine.errors import BatchFull, OutOfBlocks
from disagg.engine.scheduler import ColocatedScheduler
from disagg.engine.sequence import Request, SequenceState
from disagg.kv.transport import Transport
from disagg.serving.errors import CANCELLED, INVALID_ARG, UNAVAILABLE, ServingError, classify

log = logging.getLogger(__name__)

T = TypeVar("T")

ROLES = ("prefill", "decode", "colocated")


@dataclass(frozen=True)
class Token:
    token_id: int
    finished: bool
    finish_reason: str | None = None


@dataclass(frozen=True)
class Prefilled:
    token_id: int
    finished: bool
    finish_reason: str | None
    descriptor: bytes | None  # None when the first token already ends the sequence
    lease_id: str | None
    state: SequenceState | None


@dataclass(frozen=True)
class Failed:
    error: ServingError


Event = Token | Prefilled | Failed


class Sink(Protocol):
    """Where a job's events go (a Triton response sender, or a list in tests)."""

    def emit(self, event: Event, final: bool) -> None: ...

    def is_cancelled(self) -> bool: ...


@dataclass
class Job:
    handle: str  # the orchestrator's id for the request, used by stop()
    sink: Sink
    request: Request | None = None  # prefill / colocated
    state: SequenceState | None = None  # decode
    descriptor: bytes | None = None  # decode
    submitted: float = field(default_factory=time.monotonic)
    seq_id: int | None = None
    done: bool = False

    @property
    def prompt_tokens(self) -> int:
        source = self.request.prompt_token_ids if self.request else self.state.prompt_token_ids  # type: ignore[union-attr]
        return len(source)


@dataclass(frozen=True)
class LoopStats:
    """A consistent snapshot for metrics and readiness."""

    role: str
    queued: int
    queued_prompt_tokens: int
    active_sequences: int
    held_leases: int
    blocks_used: int
    blocks_free: int
    healthy: bool
    engine_steps: int  # engine calls so far: prefills (prefill), batch steps (decode, colocated)
    engine_busy_s: float  # seconds spent inside them


class EngineLoop:
    def __init__(
        self,
        engine: Engine,
        role: str,
        transport: Transport | None = None,
        *,
        max_queue: int = 256,
        idle_wait_s: float = 0.05,
    ) -> None:
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}")
        if role in ("prefill", "decode") and transport is None:
            raise ValueError(f"the {role} role needs a KV transport")
        self.engine = engine
        self.role = role
        self.transport = transport
        self.max_queue = max_queue
        self.idle_wait_s = idle_wait_s
        self._cond = threading.Condition()
        self._inbox: deque[tuple[str, object]] = deque()
        self._waiting: deque[Job] = deque()  # not yet in the engine
        self._running: dict[int, Job] = {}  # seq_id -> job (decode / colocated)
        self._leases: dict[str, tuple[int, str]] = {}  # lease id -> (held seq id, handle) (prefill)
        self._lease_of: dict[str, str] = {}  # handle -> lease id, while the lease is held
        self._by_handle: dict[str, Job] = {}
        self._scheduler = ColocatedScheduler(engine) if role == "colocated" else None
        self._stopping = False
        self._draining = False
        self._healthy = True
        self._active = 0  # sequences in the engine's batch, as of the last iteration
        # seconds of each KV import (decode), drained by the metrics reporter
        self.transfer_times: deque[float] = deque(maxlen=4096)
        # engine calls and the seconds spent in them (written by the loop thread only)
        self._steps = 0
        self._busy_s = 0.0
        self._thread = threading.Thread(target=self._run, name=f"engine-{role}", daemon=True)
        # Responses and cancellation checks are round trips to the server: a dispatcher thread does
        # them, so the engine thread never waits on one between steps.
        self._outbox: queue.SimpleQueue[tuple[Job, Event, bool, Callable[[], None] | None] | None] = (
            queue.SimpleQueue()
        )
        self._watched: dict[str, Job] = {}  # jobs the dispatcher polls for cancellation (under _cond)
        self._dispatcher = threading.Thread(target=self._dispatch, name=f"responses-{role}", daemon=True)

    # ------------------------------------------------------------- other threads

    def start(self) -> EngineLoop:
        self._thread.start()
        self._dispatcher.start()
        return self

    @property
    def healthy(self) -> bool:
        return self._healthy and self._thread.is_alive()

    def validate(self, job: Job) -> None:
        """Refuse, on the caller's thread, a job this pool could never serve (ServingError)."""
        engine = self.engine
        if job.request is not None:
            engine.validate(job.request)
            needed = engine.blocks_needed(job.request, decode=self.role != "prefill")
        elif job.state is not None and job.descriptor is not None:
            request = Request(job.state.prompt_token_ids, job.state.params)
            engine.validate(request)
            needed = engine.blocks_needed(request)
        else:
            raise ServingError(INVALID_ARG, f"malformed {self.role} job")
        if needed > engine.pool.num_blocks:
            raise ServingError(
                INVALID_ARG,
                f"request needs {needed} KV blocks; the {self.role} pool has {engine.pool.num_blocks}",
            )

    def submit(self, job: Job) -> None:
        """Queue a job; raises ServingError(UNAVAILABLE) when the queue is full or the loop is down."""
        with self._cond:
            if self._stopping or self._draining or not self._healthy:
                raise ServingError(UNAVAILABLE, f"{self.role} pool is not serving")
            queued = len(self._waiting) + sum(1 for kind, _ in self._inbox if kind == "job")
            if queued >= self.max_queue:
                raise ServingError(UNAVAILABLE, f"{self.role} queue is full ({self.max_queue}), retry later")
            self._inbox.append(("job", job))
            self._cond.notify()

    def stop(self, handle: str) -> None:
        """End the job with this handle (client cancel relayed by the orchestrator). Idempotent."""
        self._post("stop", handle)

    def lease_released(self, lease_id: str, reason: str) -> None:
        """Transport callback (any thread): the importer has the KV, or the lease ended."""
        self._post("released", lease_id)

    def abort_lease(self, lease_id: str) -> bool:
        """Give a lease's blocks back now (the request was cancelled between prefill and decode)."""
        return self.transport.abort(lease_id) if self.transport else False

    def _post(self, kind: str, item: object) -> None:
        with self._cond:
            self._inbox.append((kind, item))
            self._cond.notify()

    def stats(self) -> LoopStats:
        with self._cond:
            waiting = list(self._waiting) + [j for k, j in self._inbox if k == "job"]
            running = len(self._running)
            leases = len(self._leases)
        pool = self.engine.pool
        return LoopStats(
            role=self.role,
            queued=len(waiting),
            queued_prompt_tokens=sum(j.prompt_tokens for j in waiting),  # type: ignore[union-attr]
            active_sequences=self._active if self.role != "prefill" else running,
            held_leases=leases,
            blocks_used=pool.used_blocks,
            blocks_free=pool.free_blocks,
            healthy=self.healthy,
            engine_steps=self._steps,
            engine_busy_s=self._busy_s,
        )

    def drain(self, timeout_s: float) -> bool:
        """Stop taking jobs, then wait (bounded) until the ones taken have ended and, on a prefill
        pool, until every exported KV lease has been acked or has expired: an instance removed by a
        scale-in or a shutdown then strands no request and no importer. True when fully drained."""
        with self._cond:
            self._draining = True
            self._cond.notify()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and self.healthy:
            with self._cond:
                busy = self._inbox or self._by_handle or self._leases or self._has_work()
                if not busy:
                    return True
                self._cond.wait(0.05)  # woken by each loop iteration; the deadline bounds the wait
        return False

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stop taking jobs, fail the queued ones, end the running ones, join the thread."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join(timeout_s)
        self._outbox.put(None)  # after the loop's last final responses
        if self._dispatcher.is_alive():
            self._dispatcher.join(timeout_s)

    # ------------------------------------------------------------- the loop thread

    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    if self._stopping:
                        break
                    if not self._inbox and not self._has_work():
                        self._cond.wait(self.idle_wait_s)
                    inbox, self._inbox = list(self._inbox), deque()
                self._take(inbox)
                self._work()
                self._active = len(self.engine.active_sequences())
                if self._draining:
                    with self._cond:
                        self._cond.notify_all()
        except BaseException as exc:  # an engine fault: nobody can be served any more
            log.exception("%s engine loop failed", self.role)
            self._healthy = False
            self._fail_all(ServingError(UNAVAILABLE, f"{self.role} pool failed"))
            if not isinstance(exc, Exception):
                raise
            return
        self._fail_all(ServingError(UNAVAILABLE, f"{self.role} pool is shutting down"))

    def _has_work(self) -> bool:
        if self.role == "colocated":
            return not self._scheduler.idle  # type: ignore[union-attr]
        return bool(self._waiting or self._running)

    def _take(self, inbox: list[tuple[str, object]]) -> None:
        for kind, item in inbox:
            if kind == "job":
                job: Job = item  # type: ignore[assignment]
                self._by_handle[job.handle] = job
                with self._cond:
                    self._watched[job.handle] = job
                if self._scheduler is None:
                    self._waiting.append(job)
                    continue
                try:
                    self._scheduler.submit(job.handle, job.request)  # type: ignore[arg-type]
                except Exception as exc:
                    self._end(job, Failed(classify(exc)))
            elif kind in ("stop", "cancelled"):
                job = self._by_handle.get(item)  # type: ignore[arg-type]
                if job is not None:
                    why = "request was stopped" if kind == "stop" else "request was cancelled"
                    self._end(job, Failed(ServingError(CANCELLED, why)))
                elif item in self._lease_of and self.transport is not None:
                    # stopped after its prefill finished: nobody will import the KV
                    self.transport.abort(self._lease_of[item])  # type: ignore[index]
            elif kind == "released":
                held = self._leases.pop(item, None)  # type: ignore[arg-type]
                if held is not None:
                    self.engine.free(held[0])
                    self._lease_of.pop(held[1], None)

    def _end(self, job: Job, event: Event, on_undelivered: Callable[[], None] | None = None) -> None:
        """Send a job's final event and forget it; frees its sequence unless a lease holds it.

        ``on_undelivered`` runs (on the dispatcher thread) if the event cannot reach the client.
        """
        if job.done:
            return
        job.done = True
        self._by_handle.pop(job.handle, None)
        with self._cond:
            self._watched.pop(job.handle, None)
        if job in self._waiting:
            self._waiting.remove(job)
        if self._scheduler is not None:
            self._scheduler.cancel(job.handle)
        elif job.seq_id is not None:
            self._running.pop(job.seq_id, None)
            self.engine.free(job.seq_id)
        self._send(job, event, final=True, on_undelivered=on_undelivered)

    def _send(
        self, job: Job, event: Event, final: bool, on_undelivered: Callable[[], None] | None = None
    ) -> None:
        self._outbox.put((job, event, final, on_undelivered))

    # ------------------------------------------------------------- the dispatcher thread

    def _dispatch(self) -> None:
        """Deliver events in order; between deliveries, poll live jobs for cancellation (every 20 ms)."""
        last_poll = 0.0
        while True:
            try:
                item = self._outbox.get(timeout=0.02)
            except queue.Empty:
                item = ()
            if item is None:
                return
            if item:
                job, event, final, on_undelivered = item
                try:
                    job.sink.emit(event, final)
                except Exception:  # a client that went away must not stop the others
                    log.warning("could not deliver a response for %s", job.handle, exc_info=True)
                    if on_undelivered is not None:
                        on_undelivered()
            now = time.monotonic()
            if now - last_poll >= 0.02:
                last_poll = now
                self._poll_cancelled()

    def _poll_cancelled(self) -> None:
        with self._cond:
            jobs = list(self._watched.values())
        for job in jobs:
            try:
                cancelled = job.sink.is_cancelled()
            except Exception:
                cancelled = True  # its request is gone
            if cancelled:
                with self._cond:
                    self._watched.pop(job.handle, None)
                self._post("cancelled", job.handle)

    def _fail_all(self, error: ServingError) -> None:
        for job in list(self._by_handle.values()):
            self._end(job, Failed(error))
        for lease_id in list(self._leases):
            if self.transport is not None:
                self.transport.abort(lease_id)

    def _timed(self, call: Callable[..., T], *args: object, **kwargs: object) -> T:
        """One engine call, counted with its duration (``disagg_engine_*`` metrics)."""
        started = time.perf_counter()
        try:
            return call(*args, **kwargs)
        finally:
            self._busy_s += time.perf_counter() - started
            self._steps += 1

    def _work(self) -> None:
        if self.role == "prefill":
            self._prefill_one()
        elif self.role == "decode":
            self._admit_imports()
            self._decode_step()
        else:
            self._colocated_step()

    def _prefill_one(self) -> None:
        if not self._waiting:
            return
        job = self._waiting[0]
        try:
            (out,) = self._timed(self.engine.prefill, [job.request], decode=False)  # type: ignore[list-item]
        except OutOfBlocks:
            if self._leases:
                return  # blocks come back as leases end; try again then
            self._waiting.popleft()
            self._end(job, Failed(ServingError(UNAVAILABLE, "prompt does not fit in the prefill KV cache")))
            return
        except Exception as exc:
            self._waiting.popleft()
            self._end(job, Failed(classify(exc)))
            return
        self._waiting.popleft()
        if out.finished:
            self._end(job, Prefilled(out.token_id, True, out.finish_reason, None, None, None))
            return
        try:
            state, layout, blocks = self.engine.export_kv(out.seq_id)
            token = self.transport.export_blocks(self.engine.pool.memory, blocks, layout)  # type: ignore[union-attr]
            lease_id = self.transport.verify(token).lease_id  # type: ignore[union-attr]
        except Exception as exc:
            self.engine.free(out.seq_id)
            self._end(job, Failed(classify(exc)))
            return
        self._leases[lease_id] = (out.seq_id, job.handle)
        self._lease_of[job.handle] = lease_id
        transport = self.transport
        self._end(
            job,
            Prefilled(out.token_id, False, None, token, lease_id, state),
            on_undelivered=lambda: transport.abort(lease_id),  # type: ignore[union-attr]  # nobody will import it
        )

    def _admit_imports(self) -> None:
        transport = self.transport
        if transport is None:  # the constructor refuses a decode loop without one
            return
        for job in list(self._waiting):
            descriptor, state = job.descriptor, job.state
            if descriptor is None or state is None:  # validate() keeps such jobs out
                continue
            try:
                layout = transport.verify(descriptor).layout

                def fill(memory, dest, token=descriptor):
                    result = transport.import_blocks(token, memory, dest)
                    self.transfer_times.append(result.seconds)

                seq_id = self.engine.import_kv(state, layout, fill)
            except (OutOfBlocks, BatchFull):
                return  # FIFO: wait for running sequences to finish (and give back blocks or a slot)
            except Exception as exc:
                self._waiting.remove(job)
                self._end(job, Failed(classify(exc)))
                continue
            self._waiting.remove(job)
            job.seq_id = seq_id
            self._running[seq_id] = job

    def _decode_step(self) -> None:
        if not self._running:
            return
        for out in self._timed(self.engine.decode_step):
            job = self._running.get(out.seq_id)
            if job is None:
                continue
            event = Token(out.token_id, out.finished, out.finish_reason)
            if out.finished:
                job.seq_id = None  # the engine already freed it
                self._running.pop(out.seq_id, None)
                self._end(job, event)
            else:
                self._send(job, event, final=False)

    def _colocated_step(self) -> None:
        try:
            events = self._timed(self._scheduler.step)  # type: ignore[union-attr]
        except OutOfBlocks:
            return
        for ev in events:
            job = self._by_handle.get(ev.key)  # type: ignore[arg-type]
            if job is None:
                continue
            event = Token(ev.token_id, ev.finished, ev.finish_reason)
            if ev.finished:
                self._end(job, event)
            else:
                self._send(job, event, final=False)
