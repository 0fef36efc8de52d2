"""Which pool stubs of this server have died, read from ``/proc``.

On Triton 2.51 a Python model instance whose stub process dies (``kill -9``, the OOM killer) stays
READY, and a call to it fails "Stub process '...' is not healthy" only after Triton's own check of the
stub, about a second later (measured: 1.0-1.3 s for a call open at the death and for one sent after
it). Nobody reaps the dead stub either: it stays a zombie child of tritonserver until its model is
unloaded. For streams of a few dozen tokens at a few milliseconds each, that second is the SLO.

So the orchestrator looks itself. Every stub is a child of the same tritonserver, named on its command
line by its instance (``<model>_<group>_<index>``, e.g. ``decode_0_0``): ``refresh`` (every second, on
a thread of its own) records the live stubs of each pool by process id and start time, reading the
server's children from its threads' ``/proc/<pid>/task/<tid>/children`` lists (not every process of
the host). A recorded stub
seen as a zombie on two looks at least ``confirm_s`` apart is dead. A stub that exits because Triton
unloads its instance (a restart, a scale-in) is reaped by Triton at once and never stays a zombie that
long; one that is gone, or whose process id now names another process (another start time), is
forgotten, not dead. A stub already a zombie when first seen is never recorded (it may be one being
reaped), so a death is seen only by an orchestrator that saw the stub alive.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path

from disagg.procfs import PROC, cmdline, read_stat, serves

CONFIRM_S = 0.1
ZOMBIE = "Z"  # exited, not reaped yet
REFRESH_S = 1.0


class StubWatch:
    def __init__(
        self,
        models: Mapping[str, str],
        parent: int | None = None,
        confirm_s: float = CONFIRM_S,
        proc: Path = PROC,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``models``: pool -> Triton model name; ``parent``: the server's process (default: this
        process's parent, as for a stub)."""
        self.parent = os.getppid() if parent is None else parent
        self.confirm_s = confirm_s
        self._models = dict(models)
        self._proc = proc
        self._clock = clock
        self._lock = threading.Lock()
        # pool -> {pid: (start time, when first seen a zombie or None)}
        self._stubs: dict[str, dict[int, tuple[int, float | None]]] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _children(self) -> list[int]:
        """The server's child processes: from its threads' ``children`` lists (a few reads, however
        many processes the host runs), else, on a kernel without them, from every process's parent."""
        try:
            tasks = list((self._proc / str(self.parent) / "task").iterdir())
        except OSError:
            tasks = []
        if not tasks or not (tasks[0] / "children").exists():
            return [int(e.name) for e in self._proc.iterdir() if e.name.isdigit()]
        kids: set[int] = set()
        for task in tasks:
            try:
                kids.update(int(pid) for pid in (task / "children").read_text().split())
            except (OSError, ValueError):
                continue  # a thread that exited meanwhile
        return sorted(kids)

    def refresh(self) -> None:
        """Record the live stubs of every pool (those already recorded keep their state)."""
        found: list[tuple[str, int, int]] = []
        for pid in self._children():
            stat = read_stat(pid, self._proc)
            if stat is None or stat.ppid != self.parent or stat.state == ZOMBIE:
                continue
            argv = cmdline(pid, self._proc)
            if argv is None:
                continue
            for pool, model in self._models.items():
                if serves(argv, model):
                    found.append((pool, pid, stat.start_time))
                    break
        with self._lock:
            for pool, pid, started in found:
                stubs = self._stubs.setdefault(pool, {})
                if stubs.get(pid, (None,))[0] != started:
                    stubs[pid] = (started, None)

    def start(self, interval_s: float = REFRESH_S) -> StubWatch:
        """Refresh every ``interval_s`` on a daemon thread until ``stop``."""

        def run() -> None:
            while not self._stop.is_set():
                with contextlib.suppress(OSError):  # /proc unreadable now: the next round tries again
                    self.refresh()
                self._stop.wait(interval_s)

        self._thread = threading.Thread(target=run, name="stub-watch", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def forget(self, pool: str) -> None:
        """The pool was found gone: its stubs are not looked at again (a restart starts new ones)."""
        with self._lock:
            self._stubs.pop(pool, None)

    def dead(self, pool: str) -> bool:
        """A recorded stub of ``pool`` has died (a zombie for ``confirm_s`` or longer)."""
        now = self._clock()
        with self._lock:
            stubs = self._stubs.get(pool, {})
            for pid, (started, zombie_since) in list(stubs.items()):
                stat = read_stat(pid, self._proc)
                if stat is None or stat.start_time != started:
                    del stubs[pid]  # exited and reaped (unloaded), or the id names another process now
                elif stat.state != ZOMBIE:
                    stubs[pid] = (started, None)
                elif zombie_since is None:
                    stubs[pid] = (started, now)
                elif now - zombie_since >= self.confirm_s:
                    return True
            return False
