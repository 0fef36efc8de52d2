"""What a benchmark or a reproduction records of its run: progress lines, its figures as JSON, and the
machine it ran on in a few words (perf/ and ``disagg_tools.repro`` both write them)."""

from __future__ import annotations

import json
import os
import platform
import sys
from pathlib import Path
from typing import Any


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def write_json(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1, default=str) + "\n")


def cpuinfo_field(cpuinfo: str, key: str) -> str | None:
    """The value of the first `key : value` line of /proc/cpuinfo text, or None if there is none."""
    for line in cpuinfo.splitlines():
        name, sep, value = line.partition(":")
        if sep and name.strip() == key:
            return value.strip()
    return None


def machine() -> str:
    """The machine in a few words: its cores, CPU model and Python."""
    try:
        cpu = cpuinfo_field(Path("/proc/cpuinfo").read_text(), "model name")
    except OSError:
        cpu = None
    cpu = cpu or platform.processor() or platform.machine()
    return f"{os.cpu_count()} cores ({cpu}), Python {platform.python_version()}"
