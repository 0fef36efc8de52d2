"""CPU affinity of a whole process, without torch: the orchestrator's and pools' stubs pin all their
threads with it (a text-path process never loads torch)."""

from __future__ import annotations

import os


def pin_process(cores: tuple[int, ...], skip: tuple[int, ...] = ()) -> int:
    """Pin every thread of this process, those already running included, to ``cores``; the threads
    of ``skip`` keep theirs (a prefill pool's borrowed helpers, on the decode pool's cores).

    ``sched_setaffinity(0, ...)`` moves only the calling thread (and threads it starts later): a
    Triton stub has threads of its own by the time a model initializes, and those would keep
    running on any core, a neighbour pool's included. Returns how many threads were moved.
    """
    moved = 0
    for tid in os.listdir("/proc/self/task"):
        if int(tid) in skip:
            continue
        try:
            os.sched_setaffinity(int(tid), set(cores))
        except ProcessLookupError:
            continue  # the thread ended meanwhile
        except (OSError, ValueError):
            raise ValueError(f"cores {sorted(cores)} are not available to this process") from None
        moved += 1
    return moved
