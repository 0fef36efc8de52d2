"""The colocated role: both phases in one engine, the baseline disaggregation is judged by.

Each step first admits waiting prompts (FIFO, while batch slots and blocks allow, within the prefill
token budget but at least one prompt) and prefills them, which emits their first token, then runs one
decode step over every sequence of the batch. A long prompt admitted here stalls every running
sequence for the length of its prefill: exactly the interference disaggregation removes.
"""

from __future__ import annotations

from disagg.role import Role
from disagg.scheduling.plan import Plan
from disagg.scheduling.scheduler import Scheduler
from disagg.serving.messages import GenerateJob, prompt_tokens


class ColocatedScheduler(Scheduler[GenerateJob]):
    job_type = GenerateJob
    role = Role.COLOCATED

    def schedule(self) -> Plan:
        admitted: list[GenerateJob] = []
        budget = self.config.max_prefill_tokens
        slots = self._free_slots()
        while slots > 0 and (head := self._head()) is not None:
            if admitted and prompt_tokens(head) > budget:
                break
            self._admit(head)
            admitted.append(head)
            budget -= prompt_tokens(head)
            slots -= 1
        return Plan(prefill=tuple(admitted), decode=bool(admitted or self._running))
