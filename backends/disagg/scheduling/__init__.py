"""Pure, torch-free schedulers, one per pool role: admission and every capacity limit in one place.

A scheduler never calls the engine. Each engine-loop iteration is::

    plan = scheduler.schedule()                  # what to run: prefills, KV imports, a decode step
    results = runner.run(plan)                   # the engine runs it (disagg.pool.runner)
    emissions = scheduler.postprocess(results)   # the events each job gets

Capacity limits a scheduler enforces: decode batch slots (``max_batch_size``), KV blocks (a ledger of
what every admitted sequence holds, so the engine never runs out), the per-step prefill token budget
(colocated), and the queue bound. A job that does not fit *waits*; only the queue bound refuses
(UNAVAILABLE), and a job that could never fit is refused at ``check`` (INVALID_ARG).
"""

from __future__ import annotations

from disagg.engine.backend import EngineLimits
from disagg.role import Role
from disagg.scheduling.colocated import ColocatedScheduler
from disagg.scheduling.decode import DecodeScheduler
from disagg.scheduling.prefill import PrefillScheduler
from disagg.scheduling.scheduler import Scheduler, SchedulerConfig

SCHEDULERS: dict[Role, type[Scheduler]] = {
    Role.PREFILL: PrefillScheduler,
    Role.DECODE: DecodeScheduler,
    Role.COLOCATED: ColocatedScheduler,
}


def create_scheduler(
    role: Role | str, limits: EngineLimits, config: SchedulerConfig | None = None
) -> Scheduler:
    return SCHEDULERS[Role.parse(role)](limits, config)


__all__ = [
    "ColocatedScheduler",
    "DecodeScheduler",
    "PrefillScheduler",
    "Scheduler",
    "SchedulerConfig",
    "create_scheduler",
]
