"""Where CPU time goes during a run: per process (labelled) and per core, sampled from /proc.

On two cores, every non-engine process (Triton itself, the orchestrator and text steps, vLLM's front
end, this load generator) competes with an engine. `CpuProbe` samples every thread of the watched
processes every `interval_s` and charges the CPU time a thread used since the previous sample to the core
it was last seen on (`/proc/<pid>/task/<tid>/stat`, field 39). Threads migrate between samples, so the
split per core is an approximation at the sampling interval; the totals per process are exact.
"""

from __future__ import annotations

import os
import threading
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")


def thread_times(pid: int) -> dict[int, tuple[float, int]]:
    """{tid: (user + system CPU seconds, last CPU)} of a process's threads; empty if it is gone."""
    out = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        # After the command name: fields[0] is field 3 (state); utime/stime are fields 14/15, CPU is 39.
        out[int(tid)] = ((int(fields[11]) + int(fields[12])) * _TICK_S, int(fields[36]))
    return out


def label(pid: int) -> str:
    """A readable name: the Triton model of a Python backend stub, else the command name."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        comm = Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return f"pid {pid}"
    if comm.startswith("triton_python") and len(argv) > 1:
        parts = Path(argv[1].decode(errors="replace")).parts
        if len(parts) >= 3:
            return f"stub:{parts[-3]}"  # .../<model>/<version>/model.py
    if pid == os.getpid():
        return "load generator"
    return comm


class CpuProbe:
    """Samples the processes `pids()` returns (re-read each sample: children come and go)."""

    def __init__(self, pids: Callable[[], list[int]], interval_s: float = 0.1) -> None:
        if not 0.01 <= interval_s <= 5:
            raise ValueError("interval_s must be in [0.01, 5]")
        self.pids = pids
        self.interval_s = interval_s
        self._last: dict[tuple[int, int], float] = {}
        self._labels: dict[int, str] = {}
        self._usage: dict[str, dict[int, float]] = defaultdict(lambda: defaultdict(float))
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def sample(self) -> None:
        for pid in self.pids():
            name = self._labels.setdefault(pid, label(pid))
            for tid, (seconds, cpu) in thread_times(pid).items():
                previous = self._last.get((pid, tid))
                self._last[(pid, tid)] = seconds
                if previous is not None and seconds > previous:
                    self._usage[name][cpu] += seconds - previous

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()

    def start(self) -> CpuProbe:
        self.sample()  # baseline: only time used from now on is charged
        self._thread = threading.Thread(target=self._loop, name="cpu-probe", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> dict[str, dict[str, float]]:
        """Stop sampling; {label: {"cpu<N>": seconds, ...}} of CPU time used while running."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.sample()
        return {
            name: {f"cpu{cpu}": round(sec, 3) for cpu, sec in sorted(per_cpu.items())}
            for name, per_cpu in sorted(self._usage.items(), key=lambda kv: -sum(kv[1].values()))
        }


def group_members(pgid: int) -> list[int]:
    """Live processes of process group `pgid` (a server started in its own session, with its children)."""
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            members.append(int(entry.name))
    return members
