"""A process's state from ``/proc/<pid>/stat`` (Linux): one reader for the server launcher (its
process group), the KV region sweep (is a region's owner alive?) and the stubs' parent watch; and
which of a server's children are the Python backend stubs of a model."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

PROC = Path("/proc")
EXITED_STATES = frozenset("ZXx")  # zombie (exited, not reaped yet) and dead
STUB_EXECUTABLE = "triton_python_backend_stub"


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


def cmdline(pid: int | str, proc: Path = PROC) -> list[str] | None:
    """The process's argv, or None once it is gone (or unreadable)."""
    try:
        raw = (proc / str(pid) / "cmdline").read_bytes()
    except OSError:
        return None
    return raw.decode(errors="replace").split("\0")[:-1] if raw else []


def instance_name(model: str) -> re.Pattern[str]:
    """A Triton model instance's name, ``<model>_<group>_<index>``: how Triton 2.51 names a Python
    backend stub in its argv (the one tie from a process to its model; checked against 2.51 only)."""
    return re.compile(rf"{re.escape(model)}_\d+_\d+")


def serves(argv: list[str], model: str) -> bool:
    """Whether a Python backend stub's ``argv`` serves an instance of ``model``."""
    name = instance_name(model)
    return any(name.fullmatch(arg) for arg in argv[1:])


def stub_pids(server_pid: int, model: str, proc: Path = PROC) -> list[int]:
    """The live Python backend stubs of ``model`` that this server started: its direct children only,
    since other servers on the machine run stubs with the same instance names."""
    pids = []
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        stat = read_stat(entry.name, proc)
        if stat is None or stat.ppid != server_pid or stat.exited:
            continue  # the argv of every other process on the machine is not read
        argv = cmdline(entry.name, proc)
        if argv and argv[0].endswith(STUB_EXECUTABLE) and serves(argv, model):
            pids.append(int(entry.name))
    return pids
