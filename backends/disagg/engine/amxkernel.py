"""Prompt rows' projections on AMX tiles (``kernels/amx.c``), on the kernels' thread team.

**Not verified on AMX hardware.** The real build has been compiled (its object code holds the
``tileloadd`` / ``tdpbf16ps`` instructions) but never run: no machine this project was measured on had
AMX. What runs everywhere is the *emulated* build (``gemm(emulated=True)``, the C source compiled with
``-DAMX_EMULATE``), in which the four tile instructions used are plain C written from the Intel SDM's
pseudocode; the tests check its layout, blocking, tails, bias and rounding against PyTorch, and the
projection's routing of prompt rows to it. Because it is unverified, the real build is **off unless
``DISAGG_AMX_TILES=1``** is set; then, on a CPU with ``amx_tile`` and ``amx_bf16``, it is used once
Linux has granted this process the tile state (``arch_prctl(ARCH_REQ_XCOMP_PERM)``), and
``tests/unit/engine/test_amx_kernel.py`` also compares it with the emulation; ``perf/engine_bench.py``
reports the prompt's projection rate beside a reference GEMM. Off, prompt rows on AMX go to oneDNN as
before.

Why: on AMX, oneDNN's bf16 GEMM is an order of magnitude faster than AVX-512 for compute-bound prompt
rows, but called from an engine step it runs on torch's one thread (``disagg.engine.device``). This
kernel splits the tiles over the team's threads (every core of the pool, and a lent core), like the
engine's other kernels.

``gemm()`` has the signature of ``disagg.engine.kernel.gemm()``'s function, on a weight laid out by
``pack`` (16 outputs a tile, padded to pairs of tiles) and K a multiple of ``INPUTS`` (``covers``).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os

import torch
import torch.nn.functional as F

from disagg.engine import kernel

log = logging.getLogger(__name__)

SOURCE = kernel.SOURCE.parent / "amx.c"
NEEDS = frozenset({"amx_tile", "amx_bf16"})
TILE = 16  # outputs per B tile; kernels/amx.c's TN
INPUTS = 32  # inputs per A tile row; kernels/amx.c's TK
EMULATE = "AMX_EMULATE"
SWITCH = "DISAGG_AMX_TILES"


def cpu_supports() -> bool:
    """AMX tiles with bf16 dot products."""
    return kernel.cpu_flags() >= NEEDS


def covers(out_features: int, in_features: int) -> bool:
    """Whether the kernel takes a weight of this shape: inputs a multiple of 32."""
    return in_features % INPUTS == 0 and in_features > 0 and out_features > 0


def _declare(loaded: ctypes.CDLL) -> str | None:
    pointer, size = ctypes.c_void_p, ctypes.c_int64
    loaded.gemm_amx_bf16.argtypes = [pointer] * 4 + [size] * 5
    loaded.gemm_amx_bf16.restype = size
    for name in ("amx_enable", "amx_emulated", "amx_tile_cols", "amx_tile_inputs"):
        getattr(loaded, name).restype = size
    if loaded.amx_tile_cols() != TILE or loaded.amx_tile_inputs() != INPUTS:
        return f"{SOURCE.name} does not match this module's layout"
    if loaded.amx_enable() != 0:
        return "Linux did not grant this process the AMX tile state (arch_prctl ARCH_REQ_XCOMP_PERM)"
    return None


def switched_on() -> bool:
    """Whether the real build may be used: ``DISAGG_AMX_TILES=1``. Off by default until it has run on
    AMX hardware (the tests then compare it with the emulation, see the module's docstring)."""
    return os.environ.get(SWITCH) == "1"


@functools.cache
def library(emulated: bool = False) -> ctypes.CDLL | None:
    """The real build (None, logged once, unless switched on, on a CPU with AMX, with the tile state
    granted), or the emulated one (any CPU with a C compiler)."""
    if emulated:
        return kernel.load("AMX kernel (emulated)", SOURCE, True, "", _declare, defines=(EMULATE,))
    if not switched_on():
        if cpu_supports():
            log.info("AMX tile kernel off: not verified on AMX hardware yet (%s=1 switches it on)", SWITCH)
        return None
    return kernel.load("AMX kernel", SOURCE, cpu_supports(), "AMX (amx_tile, amx_bf16)", _declare)


def pack(weight: torch.Tensor) -> kernel.PackedWeight:
    """``weight`` [N, K] bf16 as B tiles: [ceil(N / 32) * 2, K / 2, 16, 2], outputs zero-padded to
    pairs of tiles; ValueError for a shape ``covers`` refuses."""
    if weight.dim() != 2 or weight.dtype != torch.bfloat16:
        raise ValueError("amxkernel.pack takes a 2-D bf16 weight")
    n, k = weight.shape
    if not covers(n, k):
        raise ValueError(f"amxkernel.pack takes inputs in multiples of {INPUTS}, not {k}")
    padded = F.pad(weight, (0, 0, 0, -n % (2 * TILE)))
    tiles = padded.view(padded.shape[0] // TILE, TILE, k // 2, 2).transpose(1, 2)
    return kernel.PackedWeight(tiles.contiguous(), n, k)


def gemm(emulated: bool = False) -> kernel.Gemm | None:
    """``gemm(x [M, K] bf16, weight (pack's), bias [N] | None, wide=False) -> y [M, N]``: bf16, or fp32
    with ``wide``; a row's bits do not depend on M. None where the kernel is off (``library``)."""
    loaded = library(emulated)
    if loaded is None:
        return None
    return kernel.packed_gemm("amx gemm", loaded.gemm_amx_bf16)
