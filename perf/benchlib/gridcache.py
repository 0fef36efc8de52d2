"""The configurations a benchmark tried for each deployment, kept in a file between runs.

A deployment is measured at its best: every configuration of its grid is tuned on one workload first,
and that costs minutes per configuration (vLLM compiles at every start). The cache keeps each tuned
configuration's goodput with the date, the machine and the model it was measured on, so that a later
run (`perf/run_all.py --reuse-grids`) takes an earlier measurement instead of tuning again, and the
report says which figures are from this run and which are reused.

An entry is reused only for the same deployment kind, configuration label, tuning workload, model
and machine (`machine_key`: the CPU model and the flags that change speed), and only when the caller
asks for reuse; within a run, a configuration measured once is never measured again (a staged grid
that starts from the previous stage's best).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class GridEntry:
    """One configuration's tuning result."""

    kind: str
    config: str
    workload: str
    model: str
    machine: str
    measured: str
    """When it was measured (ISO 8601, UTC)."""
    goodput_rps: float | None
    bracket: dict[str, Any] | None = None
    command: str = ""
    error: str = ""

    def key(self) -> tuple[str, str, str, str, str]:
        return (self.kind, self.config, self.workload, self.model, self.machine)


class GridCache:
    """Entries by key, loaded from and saved to `path`; `fresh` names the keys measured in this run."""

    def __init__(self, path: Path | None, reuse: bool = False) -> None:
        self.path = path
        self.reuse = reuse
        self._entries: dict[tuple[str, ...], GridEntry] = {}
        self.fresh: set[tuple[str, ...]] = set()
        if path is not None and Path(path).is_file():
            for item in json.loads(Path(path).read_text()).get("entries", []):
                entry = GridEntry(**item)
                self._entries[entry.key()] = entry

    def lookup(self, kind: str, config: str, workload: str, model: str, machine: str) -> GridEntry | None:
        """This run's measurement of the configuration, else (with reuse) an earlier run's, else None.
        A failed earlier measurement is never reused: it is tried again."""
        key = (kind, config, workload, model, machine)
        entry = self._entries.get(key)
        if entry is None:
            return None
        if key in self.fresh:
            return entry
        if self.reuse and entry.goodput_rps is not None:
            return entry
        return None

    def put(self, entry: GridEntry) -> None:
        """Record a measurement of this run (and write the file at once: a run cut short keeps it)."""
        self._entries[entry.key()] = entry
        self.fresh.add(entry.key())
        self.save()

    def is_fresh(self, entry: GridEntry) -> bool:
        return entry.key() in self.fresh

    def save(self) -> None:
        if self.path is None:
            return
        Path(self.path).parent.mkdir(parents=True, exist_ok=True)
        entries = sorted(self._entries.values(), key=GridEntry.key)
        Path(self.path).write_text(json.dumps({"entries": [asdict(e) for e in entries]}, indent=1) + "\n")


def machine_key(model: str, flags: tuple[str, ...]) -> str:
    """The machine as a cache key: its CPU model and the flags that change speed (not its core count
    alone: machines of one class differ in their ISA)."""
    return f"{model} [{' '.join(flags) or 'no listed flags'}]"
