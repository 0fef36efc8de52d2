"""Paged decode attention: each decode row's query over its own sequence's blocks, read in place
through the block table, with static shapes (no host read of a length), so a CUDA graph can hold it.

Shapes: B rows, nh / nkv query / kv heads (a group of g = nh / nkv query heads per kv head), hd head
dim, bs block size, MB the block table's width. The cache is the block pool's typed view
``[num_blocks, layers, 2, bs, nkv, hd]`` (``disagg.engine.kvcache``).

Two implementations of one contract:

- ``reference``: plain torch, any device. It gathers all MB blocks of every row and masks the
  positions at or past each row's length, so it costs the whole table width whatever the lengths:
  the oracle, and the fallback where Triton-lang is absent.
- ``triton_attention()``: a Triton-lang kernel (one program per row and query head) that walks only
  the row's first ``ceil(len / bs)`` blocks with an online softmax. None where the ``triton``
  package does not import (CPU builds of torch do not ship it). Tested on CPU under Triton's
  interpreter (``TRITON_INTERPRET=1``); NOT verified on a GPU.

Scores and the softmax are float32 whatever the cache dtype; the output has the query's dtype.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from functools import cache

import torch

# (q [B, nh, hd], cache, layer, block_table [B, MB] int64, seq_lens [B] int64) -> [B, nh, hd]
PagedAttention = Callable[[torch.Tensor, torch.Tensor, int, torch.Tensor, torch.Tensor], torch.Tensor]


def reference(
    q: torch.Tensor, cache: torch.Tensor, layer: int, block_table: torch.Tensor, seq_lens: torch.Tensor
) -> torch.Tensor:
    """q [B, nh, hd] over positions 0..seq_len-1 of each row's blocks -> [B, nh, hd]."""
    batch, heads, head_dim = q.shape
    width, bs, kv_heads = block_table.shape[1], cache.shape[3], cache.shape[4]
    span = width * bs
    # [B, MB, bs, nkv, hd] -> [B, nkv, span, hd]
    keys = cache[block_table, layer, 0].reshape(batch, span, kv_heads, head_dim).transpose(1, 2).float()
    values = cache[block_table, layer, 1].reshape(batch, span, kv_heads, head_dim).transpose(1, 2).float()
    grouped = q.reshape(batch, kv_heads, heads // kv_heads, head_dim).float()  # [B, nkv, g, hd]
    scores = torch.matmul(grouped, keys.transpose(-1, -2)) * head_dim**-0.5  # [B, nkv, g, span]
    past = torch.arange(span, device=q.device)[None, :] >= seq_lens[:, None]  # [B, span]
    scores = scores.masked_fill(past[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.matmul(probs, values).reshape(batch, heads, head_dim).to(q.dtype)


def triton_available() -> bool:
    """Whether the ``triton`` package is installed (CUDA builds of torch ship it)."""
    return importlib.util.find_spec("triton") is not None


@cache
def triton_attention() -> PagedAttention | None:
    """The Triton-lang paged decode attention, compiled on first call; None without ``triton``.

    On CPU tensors it runs only under ``TRITON_INTERPRET=1`` (set before ``triton`` is imported)."""
    if not triton_available():
        return None
    import triton
    import triton.language as tl

    @triton.jit
    def _kernel(
        q_ptr,
        kv_ptr,  # the cache at this layer's keys: block b, slot s, kv head h, dim d at
        # b * stride_block + s * stride_slot + h * stride_head + d; values at + stride_kv
        table_ptr,
        lens_ptr,
        out_ptr,
        stride_qb,
        stride_qh,
        stride_block,
        stride_kv,
        stride_slot,
        stride_head,
        stride_tb,
        stride_lens,
        stride_ob,
        stride_oh,
        scale,
        GROUP: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        DIM_P2: tl.constexpr,
        BLOCK: tl.constexpr,
        BLOCK_P2: tl.constexpr,
    ):
        row = tl.program_id(0)
        head = tl.program_id(1)
        kv_head = head // GROUP
        dims = tl.arange(0, DIM_P2)
        in_dim = dims < HEAD_DIM
        q = tl.load(q_ptr + row * stride_qb + head * stride_qh + dims, mask=in_dim, other=0.0).to(tl.float32)
        seq_len = tl.load(lens_ptr + row * stride_lens)
        slots = tl.arange(0, BLOCK_P2)
        best = tl.full([], float("-inf"), tl.float32)  # running max of the scores
        total = tl.full([], 0.0, tl.float32)  # running sum of exp(score - best)
        acc = tl.zeros([DIM_P2], dtype=tl.float32)  # running sum of exp(score - best) * value
        for index in range(0, tl.cdiv(seq_len, BLOCK)):
            block = tl.load(table_ptr + row * stride_tb + index)
            valid = (slots < BLOCK) & (index * BLOCK + slots < seq_len)
            where = kv_ptr + block * stride_block + kv_head * stride_head
            where = where + slots[:, None] * stride_slot + dims[None, :]  # [BLOCK_P2, DIM_P2]
            both = valid[:, None] & in_dim[None, :]
            k = tl.load(where, mask=both, other=0.0).to(tl.float32)
            v = tl.load(where + stride_kv, mask=both, other=0.0).to(tl.float32)
            scores = tl.sum(k * q[None, :], 1) * scale  # [BLOCK_P2]
            scores = tl.where(valid, scores, float("-inf"))
            new_best = tl.maximum(best, tl.max(scores, 0))
            weights = tl.exp(scores - new_best)
            rescale = tl.exp(best - new_best)
            total = total * rescale + tl.sum(weights, 0)
            acc = acc * rescale + tl.sum(weights[:, None] * v, 0)
            best = new_best
        out = acc / total
        out_row = out_ptr + row * stride_ob + head * stride_oh
        tl.store(out_row + dims, out.to(out_ptr.dtype.element_ty), mask=in_dim)

    def attention(
        q: torch.Tensor, cache: torch.Tensor, layer: int, block_table: torch.Tensor, seq_lens: torch.Tensor
    ) -> torch.Tensor:
        """``reference``'s contract; q's last dimension and the cache's last three contiguous."""
        batch, heads, head_dim = q.shape
        bs, kv_heads = cache.shape[3], cache.shape[4]
        if q.stride(2) != 1 or cache.stride(5) != 1:
            raise ValueError("q and cache must be contiguous in the head dimension")
        if block_table.stride(1) != 1:
            raise ValueError("block_table must be contiguous along each row")
        out = torch.empty_like(q)
        keys = cache[:, layer, 0]  # a view: [NB, bs, nkv, hd], values one stride(2) of cache further
        _kernel[(batch, heads)](
            q,
            keys,
            block_table,
            seq_lens,
            out,
            q.stride(0),
            q.stride(1),
            cache.stride(0),
            cache.stride(2),
            cache.stride(3),
            cache.stride(4),
            block_table.stride(0),
            seq_lens.stride(0),
            out.stride(0),
            out.stride(1),
            head_dim**-0.5,
            GROUP=heads // kv_heads,
            HEAD_DIM=head_dim,
            DIM_P2=triton.next_power_of_2(head_dim),
            BLOCK=bs,
            BLOCK_P2=triton.next_power_of_2(bs),
        )
        return out

    return attention
