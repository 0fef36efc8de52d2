"""ParentWatch: a stub notices its server has exited, even while the server is an unreaped zombie."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

from disagg.triton.watchdog import EXIT_STATUS, ParentWatch, parent_alive, running


def test_running_is_false_for_a_zombie_and_for_a_gone_process() -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)  # wait for its exit, do not reap it
        assert not running(child.pid)
        stat = Path(f"/proc/{child.pid}/stat").read_text()
        state = stat.rsplit(")", 1)[1].split()[0]
        assert state == "Z"
    finally:
        child.wait()
    assert not running(child.pid)


def test_running_is_true_for_a_live_process() -> None:
    assert running(os.getpid())


def test_parent_alive_only_for_this_process_s_parent() -> None:
    assert parent_alive(os.getppid())
    assert not parent_alive(os.getpid())


class Recorder:
    def __init__(self) -> None:
        self.events: list[str] = []
        self.exited = threading.Event()

    def cleanup(self) -> None:
        self.events.append("cleanup")

    def exit(self, status: int) -> None:
        self.events.append(f"exit {status}")
        self.exited.set()


def test_watch_cleans_up_then_exits_once_the_parent_is_gone() -> None:
    recorder = Recorder()
    checks: list[int] = []

    def alive(pid: int) -> bool:
        checks.append(pid)
        return len(checks) < 3  # alive twice, then gone

    watch = ParentWatch(
        recorder.cleanup, parent=1234, interval_s=0.01, alive=alive, exit=recorder.exit
    ).start()
    assert recorder.exited.wait(10)
    watch.stop()
    assert recorder.events == ["cleanup", f"exit {EXIT_STATUS}"]
    assert checks == [1234, 1234, 1234]


def test_watch_exits_even_when_the_cleanup_fails() -> None:
    recorder = Recorder()

    def broken() -> None:
        raise OSError("unlink failed")

    ParentWatch(broken, parent=1, interval_s=0.01, alive=lambda _: False, exit=recorder.exit).start()
    assert recorder.exited.wait(10)
    assert recorder.events == [f"exit {EXIT_STATUS}"]


def test_stopped_watch_does_nothing() -> None:
    recorder = Recorder()
    watch = ParentWatch(recorder.cleanup, parent=1, interval_s=0.05, alive=lambda _: True, exit=recorder.exit)
    watch.start()
    watch.stop()
    assert recorder.events == []
