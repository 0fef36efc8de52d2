"""The captured decode step's pointwise work, in three functions a compiler can fuse.

Between its matrix products and its attention, a decode layer does pointwise work: RMSNorm (five
kernels run as plain torch), rotary on q and k and the KV write into the paged cache (a dozen), the
residual adds, and SiLU x up (three). Replayed from a CUDA graph, each kernel still costs a few
microseconds of launch and a round trip through memory; at SmolLM2's 30 layers that is over a
thousand kernels a step, several milliseconds where the weights take a tenth of one.

``Pointwise`` holds that work as three functions, each one fused region:

- ``norm``: the residual add and the next RMSNorm (statistics in float32);
- ``rotary_write``: q and k rotated, k and v written at each row's slot of the cache, q returned;
- ``silu_mul``: SiLU of the gate times up.

``PLAIN`` runs them as plain torch (what ``Transformer.decode_static`` always computed);
``Pointwise.compiled()`` hands each to ``torch.compile``, which fuses each into one generated kernel
(Triton on a GPU, C++ on a CPU) with the batch dimension dynamic, so one compilation serves every
graph bucket. The compiled functions are checked against the plain ones on CPU; on a GPU they are
NOT verified (``perf/gpu_check.sh``, step ``graph_bench``, is the run that would).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from disagg.engine.rope import rotate


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of ``x`` times ``weight``, the statistics in float32 whatever the compute dtype, the
    result in x's dtype (as the reference implementation does)."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def norm(
    x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``x + delta`` (``x`` where ``delta`` is None) and its ``rms_norm``: (the new residual, the
    normed rows)."""
    residual = x if delta is None else x + delta
    return residual, rms_norm(residual, weight, eps)


def rotary_write(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    cache: torch.Tensor,
    layer: int,
    slot_block: torch.Tensor,
    slot_offset: torch.Tensor,
    heads: tuple[int, int, int],
) -> torch.Tensor:
    """From one projection's output ``qkv`` [B, (nh + 2 nkv) hd]: q and k rotated by ``cos`` / ``sin``
    [B, hd] (each row's position), k and v written into ``cache`` [blocks, layers, 2, block, nkv, hd]
    at (``slot_block``, ``layer``, ``slot_offset``) per row; returns q [B, nh, hd]. ``heads``: (nh,
    nkv, hd)."""
    nh, nkv, hd = heads
    q, k, v = qkv.split([nh * hd, nkv * hd, nkv * hd], dim=-1)
    cos, sin = cos[:, None, :], sin[:, None, :]
    q = rotate(q.view(-1, nh, hd), cos, sin)
    k = rotate(k.view(-1, nkv, hd), cos, sin)
    cache[slot_block, layer, 0, slot_offset] = k.to(cache.dtype)
    cache[slot_block, layer, 1, slot_offset] = v.view(-1, nkv, hd).to(cache.dtype)
    return q.contiguous()


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SiLU of the first half of ``gate_up`` [B, 2I] times its second half -> [B, I]."""
    gate, up = gate_up.chunk(2, -1)
    return F.silu(gate) * up


@dataclass(frozen=True)
class Pointwise:
    """The decode step's pointwise functions: plain torch, or compiled (``compiled``)."""

    norm: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    rotary_write: Callable[..., torch.Tensor]
    silu_mul: Callable[[torch.Tensor], torch.Tensor]
    fused: bool = False

    @classmethod
    def compiled(cls) -> Pointwise:
        """Each function through ``torch.compile`` (one graph each, the batch dimension dynamic);
        compiled on its first call, which the engine makes while it captures its graphs."""

        def fuse(fn: Callable) -> Callable:
            return torch.compile(fn, fullgraph=True, dynamic=True)

        return cls(fuse(norm), fuse(rotary_write), fuse(silu_mul), fused=True)


PLAIN = Pointwise(norm, rotary_write, silu_mul)
