"""Paged decode attention (disagg.engine.paged): the torch reference against the engine's own decode
attention and a row-by-row oracle; the Triton-lang kernel against the reference under Triton's
interpreter, where the ``triton`` package is installed (CPU builds of torch do not ship it)."""

from __future__ import annotations

import os

import pytest
import torch

from disagg.engine import paged
from disagg.engine.params import SamplingParams
from disagg.engine.sequence import Request

# the kernel runs on CPU tensors only in Triton's interpreter, which is read when triton loads
os.environ.setdefault("TRITON_INTERPRET", "1")

LAYERS, BS, NKV, HD = 2, 4, 2, 16


def _case(
    seq_lens: list[int], *, heads: int = 4, dtype: torch.dtype = torch.float32, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [B, heads, HD], a cache of 64 shuffled blocks, each row's table (scattered blocks, width
    enough for the longest row plus one), lengths."""
    gen = torch.Generator().manual_seed(seed)
    cache = torch.randn(64, LAYERS, 2, BS, NKV, HD, generator=gen).to(dtype)
    width = -(-max(seq_lens) // BS) + 1
    order = torch.randperm(64, generator=gen)
    table = order[: len(seq_lens) * width].view(len(seq_lens), width).contiguous()
    q = torch.randn(len(seq_lens), heads, HD, generator=gen).to(dtype)
    return q, cache, table, torch.tensor(seq_lens)


def _row_by_row(q, cache, layer, table, seq_lens):
    """Each row alone: its first seq_len positions gathered block by block, plain softmax."""
    out = torch.empty_like(q, dtype=torch.float32)
    group = q.shape[1] // cache.shape[4]
    for row, length in enumerate(seq_lens.tolist()):
        k = torch.cat([cache[b, layer, 0] for b in table[row].tolist()])[:length].float()  # [len, nkv, hd]
        v = torch.cat([cache[b, layer, 1] for b in table[row].tolist()])[:length].float()
        for head in range(q.shape[1]):
            scores = k[:, head // group] @ q[row, head].float() * q.shape[-1] ** -0.5  # [len]
            out[row, head] = torch.softmax(scores, 0) @ v[:, head // group]
    return out


@pytest.mark.parametrize("heads", [2, 4])  # one query head per kv head, and groups of two
@pytest.mark.parametrize("layer", [0, 1])
def test_reference_equals_each_row_alone(heads, layer):
    q, cache, table, lens = _case([1, 4, 5, 13, 16], heads=heads)
    got = paged.reference(q, cache, layer, table, lens)
    assert got.shape == q.shape and got.dtype == q.dtype
    torch.testing.assert_close(got, _row_by_row(q, cache, layer, table, lens), atol=1e-5, rtol=1e-5)


def test_reference_ignores_what_lies_past_each_rows_length():
    q, cache, table, lens = _case([3, 9])
    before = paged.reference(q, cache, 0, table, lens)
    scribbled = cache.clone()
    for row, length in enumerate(lens.tolist()):
        for index in range(table.shape[1]):
            block = int(table[row, index])
            for slot in range(BS):
                if index * BS + slot >= length:
                    scribbled[block, 0, :, slot] = 1e4
    torch.testing.assert_close(paged.reference(q, scribbled, 0, table, lens), before)


def test_reference_in_bf16_stays_near_fp32():
    q, cache, table, lens = _case([2, 7, 12], dtype=torch.bfloat16)
    got = paged.reference(q, cache, 1, table, lens)
    assert got.dtype == torch.bfloat16
    want = _row_by_row(q.float(), cache.float(), 1, table, lens)
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)


def test_reference_equals_the_engines_decode_attention(make_engine):
    """Against the engine's existing (length-grouped) decode attention on its own cache layout."""
    engine = make_engine(native_kernels=False)
    model, cfg = engine.model, engine.model_config
    cache = engine.kv.cache
    gen = torch.Generator().manual_seed(3)
    cache.copy_(torch.randn(cache.shape, generator=gen))
    positions = torch.tensor([0, 5, 17, 40])
    bs = cache.shape[3]
    width = 16
    table = torch.randperm(cache.shape[0], generator=gen)[: 4 * width].view(4, width).contiguous()
    q = torch.randn(4, cfg.num_heads, cfg.head_dim, generator=gen)
    for layer in range(cfg.num_layers):
        engine_attn = model._attend_batch(q, cache, layer, model._length_groups(positions, table, bs))
        got = paged.reference(q, cache, layer, table, positions + 1)
        torch.testing.assert_close(got, engine_attn, atol=1e-5, rtol=1e-5)


# ----------------------------------------------------------------- the Triton-lang kernel

needs_triton = pytest.mark.skipif(
    not paged.triton_available(),
    reason="the triton package is not installed (CPU builds of torch do not ship it); "
    "pip install triton to run the kernel under TRITON_INTERPRET=1",
)


@needs_triton
@pytest.mark.parametrize("heads", [2, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_kernel_equals_the_reference(heads, dtype):
    kernel = paged.triton_attention()
    assert kernel is not None
    q, cache, table, lens = _case([1, 4, 5, 13, 16], heads=heads, dtype=dtype, seed=1)
    for layer in range(LAYERS):
        got = kernel(q, cache, layer, table, lens)
        want = paged.reference(q, cache, layer, table, lens)
        tolerance = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(got.float(), want.float(), atol=tolerance, rtol=tolerance)


@needs_triton
def test_triton_kernel_reads_strided_static_buffers():
    """The captured step passes the block table and lengths as columns of one int64 matrix."""
    kernel = paged.triton_attention()
    q, cache, table, lens = _case([6, 11, 1])
    ints = torch.full((3, 4 + table.shape[1]), 63, dtype=torch.long)
    ints[:, 4:] = table
    ints[:, 2] = lens
    got = kernel(q, cache, 0, ints[:, 4:], ints[:, 2])
    torch.testing.assert_close(got, paged.reference(q, cache, 0, table, lens), atol=1e-5, rtol=1e-5)


@needs_triton
def test_triton_kernel_refuses_a_table_that_is_not_row_contiguous():
    kernel = paged.triton_attention()
    q, cache, table, lens = _case([3, 4])
    with pytest.raises(ValueError, match="block_table"):
        kernel(q, cache, 0, table.t().contiguous().t(), lens)


@needs_triton
def test_the_static_decode_step_through_the_kernel_equals_the_eager_step(make_engine):
    """The step a CUDA graph holds (Transformer.decode_static), attention by the kernel, against the
    engine's eager decode step on the same batch."""
    engine = make_engine(native_kernels=False)
    prompts = [(1, *range(3, 3 + n)) for n in (2, 9, 20)]
    outs = engine.prefill([Request(p, SamplingParams(max_tokens=4)) for p in prompts])
    seqs = [engine._get(o.seq_id) for o in outs]
    tokens, positions, table = engine._host_rows(seqs)
    before = engine.kv.cache.clone()
    eager, _ = engine.model.step(engine._decode_rows(seqs), [], engine.kv.cache)
    engine.kv.cache.copy_(before)
    kernel = paged.triton_attention()
    static = engine.model.decode_static(tokens, positions, table, positions + 1, engine.kv.cache, kernel)
    torch.testing.assert_close(static, eager, atol=1e-4, rtol=1e-4)
