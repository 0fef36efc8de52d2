"""Shared-memory KV regions whose owner process is gone: finding and removing them.

Torch-free (as is the ``disagg.kv`` package itself), so that the server launcher can sweep after a
server whose pool processes died (``disagg.server``) without importing the engine. Region files
and their header are described in ``disagg.kv.shm``.
"""

from __future__ import annotations

import os
import re
import struct

from disagg.procfs import read_stat

MAGIC = b"DKVSHM01"
HEADER = struct.Struct("<8sQQQQQQQ")  # magic, pid, start time, blocks, block bytes, tags, acks, pool offsets
DEFAULT_DIRECTORY = "/dev/shm"
DEFAULT_PREFIX = "disagg"  # the pools' default ``prefix``


def owner_start_time(pid: int) -> int | None:
    """Process start time in clock ticks since boot, or None if unreadable; -1 for a zombie."""
    stat = read_stat(pid)
    if stat is None:
        return None
    return -1 if stat.exited else stat.start_time


def owner_alive(pid: int, start: int | None = None) -> bool:
    """Whether process ``pid`` (started at ``start`` ticks, if known) still runs."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    now_start = owner_start_time(pid)
    if now_start == -1:
        return False
    return now_start is None or start is None or now_start == start


def name_pattern(prefix: str) -> re.Pattern[str]:
    return re.compile(rf"^{re.escape(prefix)}-(\d{{1,10}})-[0-9a-f]{{16}}$")


def list_regions(directory: str, prefix: str) -> list[str]:
    """Names of this deployment's regions in ``directory`` (a leak probe for tests)."""
    pattern = name_pattern(prefix)
    try:
        return sorted(e.name for e in os.scandir(directory) if pattern.match(e.name))
    except FileNotFoundError:
        return []


def clean_stale_regions(directory: str, prefix: str) -> int:
    """Unlink regions of ``prefix`` whose owner process is gone; returns how many."""
    removed = 0
    pattern = name_pattern(prefix)
    for name in list_regions(directory, prefix):
        match = pattern.match(name)
        if match is None:
            continue
        path = os.path.join(directory, name)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            if os.fstat(fd).st_uid != os.geteuid():
                continue
            raw = os.pread(fd, HEADER.size, 0)
        finally:
            os.close(fd)
        valid = len(raw) == HEADER.size and raw[:8] == MAGIC
        # Without a header (owner died between create and header write) only the pid is known.
        if owner_alive(int(match.group(1)), HEADER.unpack(raw)[2] if valid else None):
            continue
        try:
            os.unlink(path)
            removed += 1
        except FileNotFoundError:
            pass
    return removed
