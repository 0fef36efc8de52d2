"""The prefill role: prompts one at a time, FIFO; each sequence's blocks stay held under its export
lease until the importer acks, the lease is aborted, or it expires.

With ``local_generate`` the pool also runs generate jobs, the orchestrator's fallback while the decode
pool is gone or saturated: such a job is prefilled in its turn like any prompt (it needs a batch slot
too), then decoded here, one decode step over those sequences per iteration, between prompts."""

from __future__ import annotations

from disagg.engine.backend import EngineLimits
from disagg.protocol.errors import UNAVAILABLE, ServingError
from disagg.protocol.messages import GenerateJob, Prefilled, PrefillJob
from disagg.role import Operation, Role
from disagg.scheduling.plan import Emission, Handed, Plan, Removal
from disagg.scheduling.scheduler import Scheduler, SchedulerConfig


class PrefillScheduler(Scheduler[PrefillJob | GenerateJob]):
    job_type = PrefillJob
    role = Role.PREFILL

    def __init__(self, limits: EngineLimits, config: SchedulerConfig | None = None) -> None:
        super().__init__(limits, config)
        if self.config.local_generate:
            self.operations = self.operations | {Operation.GENERATE}
            self.job_type = (PrefillJob, GenerateJob)  # type: ignore[assignment]
        self._leases: dict[str, tuple[int, str]] = {}  # lease id -> (held seq id, handle)
        self._lease_of: dict[str, str] = {}  # handle -> lease id, while held

    @property
    def held_leases(self) -> int:
        return len(self._leases)

    def schedule(self) -> Plan:
        head = self._waiting[0] if self._waiting else None
        slots = self._free_slots() if isinstance(head, GenerateJob) else None  # it joins the batch
        chunks = self._prefill_chunks(max_jobs=1, slots=slots)  # one prompt at a time, FIFO
        if chunks or self._running:
            return Plan(prefill=tuple(chunks), decode=bool(self._running))
        if self._waiting and not self._leases and not self._prefilling:
            # nothing will come back: the head cannot fit (only a pool too small for check() allows it)
            job = self._waiting.popleft()
            error = ServingError(UNAVAILABLE, "prompt does not fit in the prefill KV cache")
            return Plan(refused=((job, error),))
        return Plan()  # blocks come back as leases end

    def _handed(self, result: Handed) -> Emission:
        job, output, exported = result.job, result.output, result.exported
        self._prefilled(job)
        if exported is None:  # the first token ended it; the engine freed it
            self._end(job)
            return Emission(
                job, Prefilled(output.token_id, True, output.finish_reason, None, None, None), True
            )
        self._known.discard(job.handle)  # the job ends here; its blocks stay reserved under the lease
        self._leases[exported.lease_id] = (result.seq_id, job.handle)
        self._lease_of[job.handle] = exported.lease_id
        event = Prefilled(
            output.token_id, False, None, exported.descriptor, exported.lease_id, exported.state
        )
        return Emission(job, event, True)

    def remove(self, handle: str) -> Removal | None:
        lease_id = self._lease_of.get(handle)
        if lease_id is not None:  # stopped after its prefill: nobody will import the KV
            return Removal(None, lease_id=lease_id)
        return super().remove(handle)

    def lease_released(self, lease_id: str) -> int | None:
        held = self._leases.pop(lease_id, None)
        if held is None:
            return None
        seq_id, handle = held
        self._lease_of.pop(handle, None)
        self.ledger.release(handle)
        return seq_id

    def lease_ids(self) -> list[str]:
        """Lease ids still held (at shutdown the loop aborts each)."""
        return list(self._leases)
