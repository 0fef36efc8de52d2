"""End a model's stub process when the Triton server that started it is gone.

The Python backend's stub checks its parent with ``kill(pid, 0)``, which succeeds on a zombie: when
tritonserver crashes and whoever started it has not reaped it yet (a supervisor busy elsewhere, a
benchmark driver), the stubs keep running, the pools' engine loops polling and their KV regions left
in /dev/shm. This watch reads the parent's state from /proc instead; when the parent has exited
(zombie, gone, or this process re-parented) it runs the adapter's clean-up (the pools unlink their
KV regions) and exits the process.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path

from disagg.procfs import PROC, read_stat

log = logging.getLogger(__name__)

INTERVAL_S = 1.0
EXIT_STATUS = 3  # distinguishable from a crash in the stub's exit status


def running(pid: int, proc: Path = PROC) -> bool:
    """True while process `pid` exists and has not exited (a zombie has exited)."""
    stat = read_stat(pid, proc)
    return stat is not None and not stat.exited


def parent_alive(pid: int) -> bool:
    """False once `pid` has exited or is no longer this process's parent (we were re-parented)."""
    return os.getppid() == pid and running(pid)


class ParentWatch:
    """A daemon thread: every `interval_s`, is the parent alive? If not: `cleanup()`, then `exit`."""

    def __init__(
        self,
        cleanup: Callable[[], None],
        *,
        parent: int | None = None,
        interval_s: float = INTERVAL_S,
        alive: Callable[[int], bool] = parent_alive,
        exit: Callable[[int], None] = os._exit,
    ) -> None:
        self.parent = os.getppid() if parent is None else parent
        self._cleanup = cleanup
        self._interval_s = interval_s
        self._alive = alive
        self._exit = exit
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="parent-watch", daemon=True)

    def start(self) -> ParentWatch:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            if self._alive(self.parent):
                continue
            log.error("the Triton server (pid %d) is gone: cleaning up and exiting", self.parent)
            try:
                self._cleanup()
            except Exception:
                log.exception("clean-up after the server's exit failed")
            self._exit(EXIT_STATUS)
            return
