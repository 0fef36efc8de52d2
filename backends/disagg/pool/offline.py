"""Serving without threads: the colocated scheduler and the runner driven step by step on the
caller's thread (the CLI's ``generate``, tests, benchmarks). Same scheduling as a colocated pool."""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

from disagg.engine.backend import EngineBackend
from disagg.engine.errors import OutOfBlocks
from disagg.engine.sequence import Request
from disagg.pool.runner import Runner
from disagg.protocol.messages import Event, Failed, GenerateJob, Token
from disagg.scheduling import ColocatedScheduler, SchedulerConfig


@dataclass(frozen=True)
class TokenEvent:
    """A new token for the request known to the caller as ``key``."""

    key: Hashable
    token_id: int
    finished: bool
    finish_reason: str | None


class _Discard:
    """The sink of an offline job: events are returned by ``step`` instead."""

    def emit(self, event: Event, final: bool) -> None:
        pass

    def is_cancelled(self) -> bool:
        return False


class OfflineRun:
    def __init__(self, engine: EngineBackend, config: SchedulerConfig | None = None) -> None:
        self.engine = engine
        self.scheduler = ColocatedScheduler(engine.limits, config or SchedulerConfig(max_queue=1 << 30))
        self.runner = Runner(engine)
        self._keys: dict[str, Hashable] = {}
        self._ids = 0

    @property
    def idle(self) -> bool:
        return self.scheduler.idle

    def submit(self, key: Hashable, request: Request) -> None:
        """Queue a request; invalid ones are refused here (InvalidRequest / ServingError)."""
        self._ids += 1
        job = GenerateJob(f"offline-{self._ids}", _Discard(), request)
        self.engine.validate(request)
        self.scheduler.check(job)
        self.scheduler.add(job)
        self._keys[job.handle] = key

    def cancel(self, key: Hashable) -> bool:
        """Drop a request wherever it is; True if it was still queued or running."""
        for handle, k in list(self._keys.items()):
            if k == key:
                del self._keys[handle]
                removal = self.scheduler.remove(handle)
                if removal is not None and removal.seq_id is not None:
                    self.engine.free(removal.seq_id)
                return removal is not None
        return False

    def step(self) -> list[TokenEvent]:
        plan = self.scheduler.schedule()
        if plan.empty:
            return []
        events = []
        for emission in self.scheduler.postprocess(self.runner.run(plan)):
            event = emission.event
            if isinstance(event, Failed):
                raise event.error
            if isinstance(event, Token):
                key = self._keys[emission.job.handle]
                if emission.final:
                    del self._keys[emission.job.handle]
                events.append(TokenEvent(key, event.token_id, event.finished, event.finish_reason))
        return events

    def run(self) -> list[TokenEvent]:
        """Step until every submitted request has finished."""
        events: list[TokenEvent] = []
        while not self.idle:
            stepped = self.step()
            scheduler = self.scheduler
            if (
                not stepped
                and scheduler.num_waiting
                and not (scheduler.num_running or scheduler.num_prefilling)
            ):
                raise OutOfBlocks(0, self.engine.usage().free)  # nothing runs, nothing can start
            events.extend(stepped)
        return events


def generate(engine: EngineBackend, request: Request) -> tuple[list[int], str | None]:
    """Generate one request to completion: (token ids incl. any end token, finish reason)."""
    run = OfflineRun(engine)
    run.submit(0, request)
    events = run.run()
    return [e.token_id for e in events], events[-1].finish_reason
