"""The decode role: prefilled sequences join the continuous batch as slots and blocks allow (FIFO);
one decode step per iteration over the whole batch.

A head import that waits for KV blocks (a long one, with the cache full of running sequences) lets
imports behind it that fit now go first, at most ``max_overtakes`` times for that head; after that
nothing overtakes it until it is admitted, so it gets the blocks the running sequences give back.

With ``local_prefill_tokens`` the pool also runs generate jobs of short prompts (conditional
disaggregation: the orchestrator keeps them off a backlogged prefill pool). They take their turn in
the same FIFO queue: an import at the head joins the batch, a generate job at the head is prefilled
within the per-step token budget (``max_prefill_tokens``, in chunks when the engine and the config
allow), then decoded with the rest of the batch."""

from __future__ import annotations

from disagg.engine.backend import EngineLimits
from disagg.protocol.errors import INVALID_ARG, ServingError
from disagg.protocol.messages import DecodeJob, GenerateJob, Job, prompt_tokens
from disagg.role import Operation, Role
from disagg.scheduling.plan import Plan
from disagg.scheduling.scheduler import Scheduler, SchedulerConfig


class DecodeScheduler(Scheduler[DecodeJob | GenerateJob]):
    job_type = DecodeJob
    role = Role.DECODE

    def __init__(self, limits: EngineLimits, config: SchedulerConfig | None = None) -> None:
        super().__init__(limits, config)
        self._blocked: tuple[str, int] | None = None  # (handle of the head waiting for blocks, overtakes)
        if self.config.local_prefill_tokens:
            self.operations = self.operations | {Operation.GENERATE}
            self.job_type = (DecodeJob, GenerateJob)  # type: ignore[assignment]

    def check(self, job: Job) -> None:
        super().check(job)
        limit = self.config.local_prefill_tokens
        if isinstance(job, GenerateJob) and prompt_tokens(job) > limit:
            raise ServingError(
                INVALID_ARG, f"a decode pool prefills prompts of at most {limit} tokens itself"
            )

    def _overtaker(self) -> DecodeJob | None:
        """An import behind a head import that waits for blocks, that fits now, while that head has
        been overtaken fewer than ``max_overtakes`` times."""
        head = self._waiting[0] if self._waiting else None
        if not isinstance(head, DecodeJob):  # none waits, or a local prompt (it needs a slot, not blocks)
            return None
        handle, count = (
            self._blocked if self._blocked and self._blocked[0] == head.handle else (head.handle, 0)
        )
        if count >= self.config.max_overtakes:
            return None
        for job in list(self._waiting)[1:]:
            if isinstance(job, DecodeJob) and self.ledger.fits(self.blocks_needed(job)):
                self._blocked = (handle, count + 1)
                return job
        return None

    def schedule(self) -> Plan:
        imports: list[DecodeJob] = []
        slots = self._free_slots()
        while slots > 0 and (job := self._head(DecodeJob) or self._overtaker()) is not None:
            self._admit(job)
            imports.append(job)
            slots -= 1
        chunks = []
        if self.config.local_prefill_tokens:
            chunks = self._prefill_chunks(slots=slots, kind=GenerateJob)
        self.slot_waiting = self._slot_waiting(DecodeJob) if slots <= 0 else 0
        return Plan(
            imports=tuple(imports),
            prefill=tuple(chunks),
            decode=bool(imports or chunks or self._running),
            fused=bool(chunks) and self.config.chunked_prefill and self.limits.fused_steps,
        )
