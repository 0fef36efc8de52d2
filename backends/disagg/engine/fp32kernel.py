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
import logging
from collections.abc import Callable
from pathlib import Path

import torch

from disagg.engine import kernel

log = logging.getLogger(__name__)

SOURCE = Path(__file__).resolve().parent / "kernels" / "fp32.c"
NEEDS = frozenset({"avx2", "fma"})


def cpu_supports() -> bool:
    return kernel.cpu_flags() >= NEEDS


@functools.cache
def library() -> ctypes.CDLL | None:
    """The built library, or None (logged once) where it cannot run or be built."""
    if not cpu_supports():
        log.info("fp32 CPU kernels off: this CPU has no AVX2 and FMA")
        return None
    try:
        loaded = ctypes.CDLL(str(kernel.build(source_path=SOURCE)))
    except (RuntimeError, OSError) as exc:
        log.warning("fp32 CPU kernels off: %s", exc)
        return None
    pointer, size = ctypes.c_void_p, ctypes.c_int64
    loaded.rms_norm_f32.argtypes = [pointer] * 3 + [size, size, ctypes.c_float]
    loaded.rms_norm_f32.restype = None
    loaded.rope_cache_f32.argtypes = [pointer] * 8 + [size] * 7
    loaded.rope_cache_f32.restype = None
    loaded.decode_attention_f32.argtypes = [pointer] * 6 + [size] * 8 + [ctypes.c_float, size, size]
    loaded.decode_attention_f32.restype = None
    return loaded


def _fp32(*tensors: torch.Tensor) -> bool:
    return all(t.dtype == torch.float32 and t.device.type == "cpu" for t in tensors)


def rms_norm() -> Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor] | None:
    loaded = library()
    if loaded is None:
        return None
    function = loaded.rms_norm_f32

    def call(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        rows, width = x.shape
        if not _fp32(x, weight) or weight.shape != (width,):
            raise ValueError("rms_norm takes fp32 rows and a weight of their width")
        x, weight = x.contiguous(), weight.contiguous()
        out = torch.empty_like(x)
        function(x.data_ptr(), weight.data_ptr(), out.data_ptr(), rows, width, eps)
        return out

    return call


def rope_cache() -> Callable[..., torch.Tensor] | None:
    loaded = library()
    if loaded is None:
        return None
    function = loaded.rope_cache_f32

    def call(
        qkv: torch.Tensor,
        cache: torch.Tensor,
        layer: int,
        positions: torch.Tensor,
        slot_block: torch.Tensor,
        slot_offset: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        heads: int,
        kv_heads: int,
    ) -> torch.Tensor:
        rows, width = qkv.shape
        layers, block_size, head_dim = cache.shape[1], cache.shape[3], cache.shape[5]
        if (
            not _fp32(qkv, cache, cos, sin)
            or not cache.is_contiguous()
            or head_dim % 2
            or width != (heads + 2 * kv_heads) * head_dim
            or cache.shape[4] != kv_heads
            or cos.shape[1] != head_dim
            or not 0 <= layer < layers
        ):
            raise ValueError("rope_cache takes fp32 qkv rows, cache and tables of one head layout")
        for index in (positions, slot_block, slot_offset):
            if index.dtype != torch.int64 or index.shape != (rows,) or not index.is_contiguous():
                raise ValueError("rope_cache takes contiguous int64 positions and slots, one per row")
        qkv, cos, sin = qkv.contiguous(), cos.contiguous(), sin.contiguous()
        q = torch.empty(rows, heads, head_dim)
        function(
            qkv.data_ptr(),
            q.data_ptr(),
            cache.data_ptr(),
            positions.data_ptr(),
            slot_block.data_ptr(),
            slot_offset.data_ptr(),
            cos.data_ptr(),
            sin.data_ptr(),
            rows,
            heads,
            kv_heads,
            head_dim,
            layers,
            layer,
            block_size,
        )
        return q

    return call


def decode_attention() -> Callable[..., torch.Tensor] | None:
    """``attend(q, cache, layer, block_table, positions, plan=None)``, as ``kernel.decode_attention``
    in fp32; ``plan``: the step's ``kernel.decode_plan``, made once for all its layers."""
    loaded = library()
    if loaded is None:
        return None
    function = loaded.decode_attention_f32

    def call(
        q: torch.Tensor,
        cache: torch.Tensor,
        layer: int,
        block_table: torch.Tensor,
        positions: torch.Tensor,
        plan: kernel.DecodePlan | None = None,
    ) -> torch.Tensor:
        batch, heads, head_dim = q.shape
        _, layers, _, block_size, kv_heads, _ = cache.shape
        if not _fp32(q, cache) or not cache.is_contiguous() or head_dim % 8 or heads % kv_heads:
            raise ValueError("decode_attention takes fp32, head_dim a multiple of 8")
        plan = plan or kernel.decode_plan(block_table, positions, heads // kv_heads)
        if plan.table.shape[0] != batch:  # a plan is made from the very tensors of its step
            raise ValueError("the decode plan is not this batch's")
        q = q.contiguous()
        out = torch.empty_like(q)
        function(
            q.data_ptr(),
            cache.data_ptr(),
            plan.table.data_ptr(),
            plan.where.data_ptr(),
            out.data_ptr(),
            plan.scratch.data_ptr(),
            batch,
            plan.table.shape[1],
            layer,
            layers,
            block_size,
            kv_heads,
            heads // kv_heads,
            head_dim,
            head_dim**-0.5,
            plan.threads,
            plan.per_thread,
        )
        return out

    return call
