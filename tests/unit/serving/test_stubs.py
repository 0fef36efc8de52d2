"""``StubWatch`` on real processes, children of the test as pool stubs are children of tritonserver
and named on their command line by instance: one killed and not reaped is a zombie, as a stub that
died is under Triton 2.51; one reaped at once (an unloaded instance) is forgotten, never dead."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from disagg.triton.stubs import StubWatch

MODELS = {"prefill": "prefill", "decode": "decode"}


def _stub(instance: str) -> subprocess.Popen[bytes]:
    """A child named like a stub: ``instance`` (e.g. ``decode_0_0``) among its arguments."""
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "shm-region", instance])


def _started(child: subprocess.Popen[bytes]) -> None:
    """Wait until the child runs Python (its command line is the one given, not the fork's)."""
    while b"shm-region" not in Path(f"/proc/{child.pid}/cmdline").read_bytes():
        os.sched_yield()


def _state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def test_a_stub_killed_and_left_a_zombie_is_dead_once_confirmed() -> None:
    now = [0.0]
    watch = StubWatch(MODELS, parent=os.getpid(), confirm_s=0.2, clock=lambda: now[0])
    decode, other = _stub("decode_0_0"), _stub("decoder_0_0")
    try:
        _started(decode)
        _started(other)
        watch.refresh()
        assert not watch.dead("decode")
        os.kill(decode.pid, signal.SIGKILL)
        os.kill(other.pid, signal.SIGKILL)  # another model's stub: not the decode pool's
        for child in (decode, other):
            os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)  # died, and still not reaped
        assert _state(decode.pid) == "Z"
        assert not watch.dead("decode"), "one look at a zombie is not enough"
        now[0] = 0.1
        assert not watch.dead("decode")
        now[0] = 0.2
        assert watch.dead("decode") and not watch.dead("prefill")
        watch.forget("decode")
        watch.refresh()  # a zombie is never recorded anew
        now[0] = 1.0
        assert not watch.dead("decode"), "a pool found gone is not looked at again"
    finally:
        for child in (decode, other):
            child.kill()
            child.wait()


def test_a_stub_that_exits_and_is_reaped_is_forgotten_not_dead() -> None:
    now = [0.0]
    watch = StubWatch(MODELS, parent=os.getpid(), confirm_s=0.2, clock=lambda: now[0])
    child = _stub("prefill_0_1")
    _started(child)
    watch.refresh()
    child.kill()
    child.wait()  # reaped at once, as Triton reaps the stub of an instance it unloads
    for t in (0.0, 1.0):
        now[0] = t
        assert not watch.dead("prefill")


def test_a_process_id_taken_by_another_process_is_not_the_dead_stub(tmp_path: Path) -> None:
    """The stub's id reused by another process (another start time) that is a zombie says nothing of
    the stub: it is forgotten."""
    now = [0.0]
    proc = tmp_path / "proc"
    (proc / "4242").mkdir(parents=True)

    def write(state: str, started: int) -> None:
        fields = [state, "7", *["0"] * 17, str(started)]
        (proc / "4242" / "stat").write_text(f"4242 (triton_python_b) {' '.join(fields)} 0 0\n")

    (proc / "4242" / "cmdline").write_bytes(
        b"triton_python_backend_stub\0/models/decode/1/model.py\0decode_0_0\0"
    )
    watch = StubWatch(MODELS, parent=7, confirm_s=0.2, proc=proc, clock=lambda: now[0])
    write("S", 100)
    watch.refresh()
    write("Z", 100)
    assert not watch.dead("decode")
    now[0] = 0.3
    assert watch.dead("decode"), "the fake is read as the real one is"
    write("Z", 200)
    for t in (0.3, 1.0):
        now[0] = t
        assert not watch.dead("decode")
    write("Z", 100)  # the stub itself would count now, but it was forgotten
    now[0] = 2.0
    assert not watch.dead("decode")
