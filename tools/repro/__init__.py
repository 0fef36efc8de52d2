"""Reproductions of the Triton 2.51 defects the project works around (docs/triton-2.51.md), each run as
``python -m disagg_tools.repro.NAME`` (``make repro-*``) and writing its figures under perf/results/:

- ``metric_race``: several threads on one custom metric crash the server; ``SerialMetric`` prevents it;
- ``stub_kill_stress``: how often ``kill -9`` of a pool's stub takes tritonserver down with it;
- ``bls_release_stress``: freeing a decoupled BLS call's responses races the stub's own thread; the
  orchestrator's graveyard avoids it (a shorter run is in the test suite).
"""

from __future__ import annotations

import json
import os
import platform
import sys
from pathlib import Path
from typing import Any

from disagg.paths import REPO_ROOT

RESULTS = REPO_ROOT / "perf" / "results"


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def machine() -> str:
    """The machine in a few words: its cores, CPU model and Python."""
    cpu = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.partition(":")[2].strip()
                break
    except OSError:
        pass
    cpu = cpu or platform.processor() or platform.machine()
    return f"{os.cpu_count()} cores ({cpu}), Python {platform.python_version()}"


def write_json(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1, default=str) + "\n")
