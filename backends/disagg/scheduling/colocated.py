"""The colocated role: both phases in one engine, the baseline disaggregation is judged by.

Each step first prefills prompt work within the per-step token budget (``max_prefill_tokens``):
prompts already started, then waiting ones (FIFO, while batch slots and blocks allow); a completed
prompt emits its first token and joins the batch. Then one decode step runs over the whole batch.
Without chunked prefill a step takes whole prompts (at least one, however long), so a long prompt
stalls every running sequence for the length of its prefill: the interference disaggregation removes.
With ``chunked_prefill`` a step runs at most the budget's worth of prompt, bounding that stall, and
(on an engine with ``fused_steps``) the chunks ride in the decode step's forward pass, which reads
the weights once for both.
"""

from __future__ import annotations

from disagg.protocol.messages import GenerateJob
from disagg.role import Role
from disagg.scheduling.plan import Plan
from disagg.scheduling.scheduler import Scheduler


class ColocatedScheduler(Scheduler[GenerateJob]):
    job_type = GenerateJob
    role = Role.COLOCATED

    def schedule(self) -> Plan:
        chunks = self._prefill_chunks(slots=self._free_slots())
        fused = self.config.chunked_prefill and self.limits.fused_steps
        return Plan(prefill=tuple(chunks), decode=bool(chunks or self._running), fused=fused and bool(chunks))
