"""Devices, dtypes and CPU pinning for an engine instance (``pin_process`` is in ``disagg.affinity``)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from disagg.engine import kernel

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
AUTO = "auto"


def onednn_bf16() -> bool:
    """Whether this CPU's oneDNN runs bf16 kernels (AVX-512-BF16 or AMX)."""
    return torch.backends.mkldnn.is_available() and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def auto_dtype(device: str) -> str:
    """The compute dtype ``auto`` stands for on ``device``, by a fixed rule (never by a timing, which
    could flip between restarts): ``bfloat16`` on a CUDA device that supports it, and on a CPU whose
    oneDNN has bf16 kernels (AVX-512-BF16 or AMX), where bf16 with prepacked weights measured faster
    than fp32 in both prefill and decode (``perf/engine_bench.py``); otherwise ``float32``."""
    kind = torch.device(device).type
    if kind == "cuda":
        return "bfloat16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "float32"
    return "bfloat16" if onednn_bf16() else "float32"


def resolve_device(name: str) -> torch.device:
    """``cpu``, ``cuda`` or ``cuda:N``; refuses CUDA when none is present."""
    device = torch.device(name)
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"unsupported device {name!r} (cpu, cuda, cuda:N)")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' requested but no CUDA device is available")
    return device


def pin_cpu(cores: tuple[int, ...] | None, num_threads: int | None = None) -> None:
    """Pin this process to ``cores`` and size torch's thread pool to match.

    Pools run on disjoint core sets (the CPU analogue of disjoint GPUs), so an engine must not spill
    its intra-op threads onto a neighbour's cores.
    """
    if cores:
        try:  # the calling thread and the threads it starts later (an engine loop) run there
            os.sched_setaffinity(0, set(cores))
        except (OSError, ValueError):
            raise ValueError(f"cores {sorted(cores)} are not available to this process") from None
    threads = num_threads or (len(cores) if cores else None)
    if threads:
        torch.set_num_threads(threads)


@contextmanager
def kernel_threads() -> Iterator[None]:
    """For the block's length, the engine's native kernels run on torch's threads and torch on one;
    both settings as they were after it.

    The kernels split each call over their own team (``kernels/team.c``), whose caller never waits
    for a helper the OS has not run yet. Torch's OpenMP workers, left with the few small operations
    between kernels, would otherwise spin after each one on the very cores the team's helpers need.
    Measured inside Triton, a colocated pool's decode step on two cores took 15.4-16.1 ms with the
    kernels on torch's OpenMP pool and 9.2-11.6 ms on the team with torch on one thread."""
    before = torch.get_num_threads()
    if before == 1:
        yield
        return
    previous = kernel.use_threads(kernel.team_threads())
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)
        kernel.use_threads(previous)
