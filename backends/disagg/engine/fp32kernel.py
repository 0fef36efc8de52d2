"""The engine's fp32 CPU kernels for the work between projections (``kernels/fp32.c``, AVX2 + FMA).

Beside the block-code projections (``disagg.engine.blockcode``), where a decode step's projections
read 5x less than fp32 weights and PyTorch's per-operation cost becomes half the step, a layer's
RMSNorm, its rotary embedding with its KV cache writes, and its decode attention over the paged cache
each run as one call instead of dozens of small PyTorch operations:

- ``rms_norm(x [N, H], weight [H], eps)``;
- ``rope_cache(qkv, cache, layer, positions, slot_block, slot_offset, cos, sin, heads, kv_heads)``:
  the queries rotated, the keys rotated and the values written into their cache slots (the same bits
  as ``RotaryTable.apply`` and the indexed writes);
- ``decode_attention(q [B, heads, hd], cache, layer, block_table, positions, plan)``: every decode row
  over positions 0..its own of its own blocks, scores and softmax in fp32.

Each result depends on its own row alone, never on the batch or the thread count. None where the CPU
has no AVX2 and FMA or no C compiler (logged once); the engine then keeps PyTorch's operations.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from disagg.engine import kernel

SOURCE = Path(__file__).resolve().parent / "kernels" / "fp32.c"
NEEDS = frozenset({"avx2", "fma"})
TILE = 16  # outputs per tile of a projection's weight; kernels/fp32.c's GEMM_COLS


def cpu_supports() -> bool:
    return kernel.cpu_flags() >= NEEDS


def _declare(loaded: ctypes.CDLL) -> str | None:
    pointer, size = ctypes.c_void_p, ctypes.c_int64
    loaded.rms_norm_f32.argtypes = [pointer] * 3 + [size, size, ctypes.c_float]
    loaded.rms_norm_f32.restype = None
    loaded.rope_cache_f32.argtypes = [pointer] * 8 + [size] * 7
    loaded.rope_cache_f32.restype = None
    loaded.decode_attention_f32.argtypes = kernel.DECODE_ATTENTION_ARGS
    loaded.decode_attention_f32.restype = None
    loaded.gemm_f32.argtypes = [pointer] * 4 + [size] * 4
    loaded.gemm_f32.restype = None
    loaded.gemm_f32_tile_cols.restype = size
    if loaded.gemm_f32_tile_cols() != TILE:
        return f"{SOURCE.name} does not match this module's layout"
    return None


@functools.cache
def library() -> ctypes.CDLL | None:
    """The built library, or None (logged once) where it cannot run or be built."""
    return kernel.load("fp32 CPU kernels", SOURCE, cpu_supports(), "AVX2 and FMA", _declare)


def _fp32(*tensors: torch.Tensor) -> bool:
    return all(t.dtype == torch.float32 and t.device.type == "cpu" for t in tensors)


def rms_norm() -> kernel.RmsNorm | None:
    """``kernel.rms_norm`` in fp32, any width."""
    loaded = library()
    if loaded is None:
        return None
    return kernel.row_norm(loaded.rms_norm_f32, torch.float32, width_multiple=1, threads=False)


def rope_cache() -> kernel.RopeCache | None:
    """``kernel.rope_cache`` in fp32 (the same bits as ``RotaryTable.apply``), head_dim even."""
    loaded = library()
    if loaded is None:
        return None
    return kernel.rotary_cache_writer(
        loaded.rope_cache_f32, torch.float32, head_dim_multiple=2, threads=False
    )


def _check_attention(q: torch.Tensor, cache: torch.Tensor, heads: int, kv_heads: int, head_dim: int) -> None:
    if not _fp32(q, cache) or not cache.is_contiguous() or head_dim % 8 or heads % kv_heads:
        raise ValueError("decode_attention takes fp32, head_dim a multiple of 8")


def decode_attention() -> kernel.DecodeAttention | None:
    """``attend(q, cache, layer, block_table, positions, plan=None)``, as ``kernel.decode_attention``
    in fp32; ``plan``: the step's ``kernel.decode_plan``, made once for all its layers."""
    loaded = library()
    return (
        None
        if loaded is None
        else kernel.paged_decode_attention(loaded.decode_attention_f32, _check_attention)
    )


@torch.inference_mode()
def pack(weight: torch.Tensor) -> kernel.PackedWeight:
    """``weight`` [N, K] fp32 on CPU in ``gemm``'s layout, [ceil(N / TILE), K, TILE] (per tile of TILE
    outputs, each input's TILE weights), outputs zero-padded (a copy; the caller drops the original)."""
    if weight.dim() != 2 or not _fp32(weight):
        raise ValueError("pack takes a 2-D fp32 CPU weight")
    n, k = weight.shape
    padded = F.pad(weight, (0, 0, 0, -n % TILE))
    return kernel.PackedWeight(padded.view(-1, TILE, k).transpose(1, 2).contiguous(), n, k)


Gemm = Callable[[torch.Tensor, kernel.PackedWeight, "torch.Tensor | None"], torch.Tensor]


def gemm() -> Gemm | None:
    """``gemm(x [M, K] fp32, weight from ``pack``, bias [N] fp32 | None) -> y [M, N] fp32``, any M:
    every output one sum over the inputs in order, so a row's bits do not depend on M or on the other
    rows. None where the kernels are off."""
    loaded = library()
    if loaded is None:
        return None
    function = loaded.gemm_f32

    def call(x: torch.Tensor, weight: kernel.PackedWeight, bias: torch.Tensor | None) -> torch.Tensor:
        rows, width = x.shape
        if not _fp32(x) or width != weight.in_features:
            raise ValueError(f"gemm takes fp32 rows of width {weight.in_features}")
        if bias is not None and (not _fp32(bias) or bias.shape != (weight.out_features,)):
            raise ValueError(f"gemm takes an fp32 bias of {weight.out_features}")
        x = x.contiguous()
        out = torch.empty(rows, weight.out_features, dtype=torch.float32)
        if rows:
            function(
                x.data_ptr(),
                weight.tiles.data_ptr(),
                None if bias is None else bias.contiguous().data_ptr(),
                out.data_ptr(),
                rows,
                weight.out_features,
                width,
                kernel.team_threads(),
            )
        return out

    return call
