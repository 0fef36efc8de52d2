"""The decode role: prefilled sequences join the continuous batch as slots and blocks allow (FIFO);
one decode step per iteration over the whole batch."""

from __future__ import annotations

from disagg.role import Role
from disagg.scheduling.plan import Plan
from disagg.scheduling.scheduler import Scheduler
from disagg.serving.messages import DecodeJob


class DecodeScheduler(Scheduler[DecodeJob]):
    job_type = DecodeJob
    role = Role.DECODE

    def schedule(self) -> Plan:
        imports: list[DecodeJob] = []
        slots = self._free_slots()
        while slots > 0 and (head := self._head()) is not None:
            self._admit(head)
            imports.append(head)
            slots -= 1
        return Plan(imports=tuple(imports), decode=bool(imports or self._running))
