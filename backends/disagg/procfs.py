"""A process's state from ``/proc/<pid>/stat`` (Linux): one reader for the server launcher (its
process group), the KV region sweep (is a region's owner alive?) and the stubs' parent watch."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

PROC = Path("/proc")
EXITED_STATES = frozenset("ZXx")  # zombie (exited, not reaped yet) and dead


@dataclass(frozen=True)
class ProcStat:
    state: str
    ppid: int
    pgrp: int
    start_time: int  # clock ticks since boot
    cpu_ticks: int = 0  # user + system CPU time so far, clock ticks

    @property
    def exited(self) -> bool:
        return self.state in EXITED_STATES


def read_stat(pid: int | str, proc: Path = PROC) -> ProcStat | None:
    """The process's stat fields we use, or None once it is gone (or unreadable)."""
    try:
        line = (proc / str(pid) / "stat").read_text()
    except OSError:
        return None
    # fields after the parenthesised command name (which may itself contain spaces or parentheses)
    fields = line.rsplit(")", 1)[1].split()
    return ProcStat(
        state=fields[0],
        ppid=int(fields[1]),
        pgrp=int(fields[2]),
        start_time=int(fields[19]),
        cpu_ticks=int(fields[11]) + int(fields[12]),
    )
