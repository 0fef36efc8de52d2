"""The machine a benchmark ran on, for its report: CPU model, usable cores, the SIMD/AMX flags that
decide how fast CPU inference can be, and the read-only memory bandwidth one core and all cores reach.

Run `.venv/bin/python -m perf.benchlib.machine` (from the repository root) to print a one-line description.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from disagg_tools.runrecord import cpuinfo_field as _field

FLAGS_THAT_MATTER = ("amx_bf16", "amx_int8", "amx_tile", "avx512_bf16", "avx512f", "avx2")

_BARRIER_TIMEOUT_S = 120.0  # a worker that never arrives breaks the barrier instead of hanging the rest
_RESULT_TIMEOUT_S = 600.0


def cpu_model(cpuinfo: str) -> str:
    """The first "model name" of /proc/cpuinfo text, or "unknown"."""
    return _field(cpuinfo, "model name") or "unknown"


def cpu_flags(cpuinfo: str) -> frozenset[str]:
    """The words of the first "flags" line of /proc/cpuinfo text (empty if there is none)."""
    return frozenset((_field(cpuinfo, "flags") or "").split())


def _bandwidth_worker(
    index: int,
    core: int,
    mib: int,
    reps: int,
    barrier: Any,
    results: Any,
) -> None:
    """Pin to `core`, sum a `mib` MiB float32 array once to warm up, then `reps` timed sums, each
    started together with the other workers; put (index, [seconds per rep]) or (index, error)."""
    try:
        import numpy as np

        os.sched_setaffinity(0, {core})
        data = np.ones(mib * 1024 * 1024 // 4, dtype=np.float32)  # written, so every page is real
        data.sum()
        times = []
        for _ in range(reps):
            barrier.wait(_BARRIER_TIMEOUT_S)
            start = time.perf_counter()
            data.sum()
            times.append(time.perf_counter() - start)
        results.put((index, times))
    except BaseException as exc:  # report anything, so the parent never waits for a result in vain
        barrier.abort()
        results.put((index, f"{type(exc).__name__}: {exc}"))


def read_bandwidth(cores: tuple[int, ...], mib: int = 256, reps: int = 5) -> float:
    """Read-only memory bandwidth in GB/s (1e9 bytes/s) of one worker process per core in `cores`.

    Each worker is pinned to its core and sums its own float32 array of `mib` MiB `reps` times after
    one warm-up, all workers starting each rep together. The figure is the sum over workers of
    (bytes of its array / its median rep time).
    """
    if not cores:
        raise ValueError("cores must name at least one CPU")
    if mib < 1 or reps < 1:
        raise ValueError("mib and reps must be >= 1")
    ctx = mp.get_context("spawn")  # a fresh interpreter: no threads or locks inherited from the caller
    barrier = ctx.Barrier(len(cores))
    results = ctx.Queue()
    workers = [
        ctx.Process(
            target=_bandwidth_worker,
            args=(i, core, mib, reps, barrier, results),
            name=f"read-bandwidth-cpu{core}",
            daemon=True,
        )
        for i, core in enumerate(cores)
    ]
    times: dict[int, list[float]] = {}
    try:
        for worker in workers:
            worker.start()
        deadline = time.monotonic() + _RESULT_TIMEOUT_S
        while len(times) < len(workers):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"read_bandwidth: {len(times)} of {len(workers)} workers reported")
            try:
                index, outcome = results.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                if any(w.exitcode not in (None, 0) for w in workers):
                    codes = [w.exitcode for w in workers]
                    raise RuntimeError(f"read_bandwidth: a worker died (exit codes {codes})") from None
                continue
            if isinstance(outcome, str):
                raise RuntimeError(f"read_bandwidth: worker on cpu{cores[index]} failed: {outcome}")
            times[index] = outcome
    finally:
        for worker in workers:
            worker.join(timeout=5)
        for worker in workers:
            if worker.is_alive():
                worker.terminate()
                worker.join(timeout=5)
            if worker.is_alive():
                worker.kill()
                worker.join()
        results.close()
        results.join_thread()
    nbytes = mib * 1024 * 1024
    return sum(nbytes / statistics.median(t) for t in times.values()) / 1e9


def _bandwidth_text(gb_s: float | None) -> str:
    return "not measured" if gb_s is None else f"{gb_s:.1f} GB/s"


@dataclass(frozen=True)
class Machine:
    """What a report says about the machine: model, usable cores, flags and read bandwidth."""

    model: str
    cores: int
    flags: tuple[str, ...]  # those of FLAGS_THAT_MATTER present, in that order
    read_gb_s_one_core: float | None
    read_gb_s_all_cores: float | None

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (flags as a list)."""
        d = asdict(self)
        d["flags"] = list(self.flags)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Machine:
        """The inverse of `to_dict`."""
        return cls(
            model=str(d["model"]),
            cores=int(d["cores"]),
            flags=tuple(d["flags"]),
            read_gb_s_one_core=d.get("read_gb_s_one_core"),
            read_gb_s_all_cores=d.get("read_gb_s_all_cores"),
        )

    def describe(self) -> str:
        """One line, e.g. "2 cores (AMD EPYC), flags avx2 (no AMX, no avx512_bf16), read bandwidth
        21.3 GB/s on one core, 30.1 GB/s on all 2"; names missing AMX and avx512_bf16 explicitly."""
        missing = []
        if not any(flag.startswith("amx_") for flag in self.flags):
            missing.append("no AMX")
        if "avx512_bf16" not in self.flags:
            missing.append("no avx512_bf16")
        flags = " ".join(self.flags) if self.flags else "none"
        if missing:
            flags += f" ({', '.join(missing)})"
        cores = f"{self.cores} core" + ("" if self.cores == 1 else "s")
        return (
            f"{cores} ({self.model}), flags {flags}, read bandwidth "
            f"{_bandwidth_text(self.read_gb_s_one_core)} on one core, "
            f"{_bandwidth_text(self.read_gb_s_all_cores)} on all {self.cores}"
        )


def measure(cpuinfo: str | None = None, bandwidth: bool = True) -> Machine:
    """Describe this machine: /proc/cpuinfo (or the `cpuinfo` text given), the CPUs this process may
    run on, and, unless `bandwidth` is False, read bandwidth on the first of them and on all of them."""
    if cpuinfo is None:
        cpuinfo = Path("/proc/cpuinfo").read_text()
    present = cpu_flags(cpuinfo)
    cores = tuple(sorted(os.sched_getaffinity(0)))
    one = all_ = None
    if bandwidth:
        one = read_bandwidth(cores[:1])
        all_ = read_bandwidth(cores)
    return Machine(
        model=cpu_model(cpuinfo),
        cores=len(cores),
        flags=tuple(flag for flag in FLAGS_THAT_MATTER if flag in present),
        read_gb_s_one_core=one,
        read_gb_s_all_cores=all_,
    )


if __name__ == "__main__":
    print(measure().describe())
