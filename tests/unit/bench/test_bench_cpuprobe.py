"""CPU placement probe: charges CPU time to the right process and to real cores."""

from __future__ import annotations

import os
import threading
import time

from perf.benchlib.cpuprobe import CpuProbe, group_members, label, thread_times


def busy_s(per_cpu: dict[str, float]) -> float:
    """Seconds summed over CPUs, to clock-tick precision (0.09 + 0.01 is 0.0999... in floats)."""
    return round(sum(per_cpu.values()), 6)


def test_probe_charges_this_process_busy_time():
    stop = threading.Event()

    def burn() -> None:
        while not stop.is_set():
            sum(range(1000))

    probe = CpuProbe(lambda: [os.getpid()], interval_s=0.02).start()
    worker = threading.Thread(target=burn)
    worker.start()
    deadline = time.monotonic() + 5
    try:
        # Poll until the probe has seen some busy time (never a fixed sleep).
        while time.monotonic() < deadline:
            probe.sample()
            if busy_s(probe._usage.get("load generator", {})) >= 0.1:
                break
    finally:
        stop.set()
        worker.join()
    usage = probe.stop()
    assert busy_s(usage["load generator"]) >= 0.1
    assert all(key.startswith("cpu") and int(key[3:]) < os.cpu_count() for key in usage["load generator"])


def test_helpers_read_proc():
    me = os.getpid()
    assert me in group_members(os.getpgid(0))
    assert me in thread_times(me)  # the main thread's tid is the pid
    assert label(me) == "load generator"
    assert thread_times(2**22 + 12345) == {}
