"""The small-batch bf16 kernel against F.linear, its build cache, and the fallback without it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from disagg.engine import kernel
from disagg.engine.projection import Projection

needs_kernel = pytest.mark.skipif(kernel.gemv() is None, reason="no AVX-512-BF16 or no C compiler here")


def _close(got: torch.Tensor, expected: torch.Tensor) -> None:
    # both round an fp32 sum to bf16; the sums run in different orders: one bf16 step apart at most
    scale = expected.float().abs().max().item()
    assert got.dtype == torch.bfloat16 and got.shape == expected.shape
    assert (got.float() - expected.float()).abs().max().item() <= scale * 2**-7


@needs_kernel
@pytest.mark.parametrize("rows", range(1, 9))
@pytest.mark.parametrize("width", [64, 576, 45])  # 45: a tail shorter than one 32-element vector
def test_the_kernel_matches_f_linear(rows: int, width: int) -> None:
    generator = torch.Generator().manual_seed(rows * width)
    weight = torch.randn(37, width, generator=generator).bfloat16()
    bias = torch.randn(37, generator=generator).bfloat16()
    x = torch.randn(rows, width, generator=generator).bfloat16()
    gemv = kernel.gemv()
    _close(gemv(x, weight, None), F.linear(x, weight))
    _close(gemv(x, weight, bias), F.linear(x, weight, bias))


@needs_kernel
def test_the_kernel_refuses_what_it_cannot_compute() -> None:
    gemv = kernel.gemv()
    with pytest.raises(ValueError):
        gemv(torch.zeros(9, 8).bfloat16(), torch.zeros(4, 8).bfloat16(), None)
    with pytest.raises(ValueError):
        gemv(torch.zeros(1, 8), torch.zeros(4, 8), None)


@needs_kernel
def test_a_projection_sends_few_rows_to_the_kernel_and_more_to_onednn(monkeypatch) -> None:
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    weight = torch.randn(16, 64).bfloat16()
    projection = Projection(weight, None, pack=True, small_batch=True)
    assert projection.small_batch and projection.nbytes == 2 * weight.numel() * 2  # both layouts
    calls = []
    real = projection._small
    projection._small = lambda *args: calls.append(args[0].shape[0]) or real(*args)
    for rows in (1, kernel.MAX_ROWS, kernel.MAX_ROWS + 1, 40):
        x = torch.randn(rows, 64).bfloat16()
        _close(projection(x), F.linear(x, weight))
    assert calls == [1, kernel.MAX_ROWS]


def test_several_threads_or_no_kernel_fall_back_to_onednn(monkeypatch) -> None:
    weight = torch.randn(16, 64).bfloat16()
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    assert not Projection(weight, None, pack=True, small_batch=True).small_batch
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    monkeypatch.setattr(kernel, "gemv", lambda: None)
    projection = Projection(weight, None, pack=True, small_batch=True)
    assert not projection.small_batch and projection.plain is None
    x = torch.randn(1, 64).bfloat16()
    _close(projection(x), F.linear(x, weight))


def test_a_build_is_reused_and_a_broken_compiler_is_an_error(tmp_path, monkeypatch) -> None:
    if not kernel.cpu_supports():
        pytest.skip("this CPU has no AVX-512-BF16")
    built = kernel.build(tmp_path)
    assert built.is_file() and built.parent == tmp_path
    stamp = built.stat().st_mtime_ns
    assert kernel.build(tmp_path) == built and built.stat().st_mtime_ns == stamp  # not rebuilt
    monkeypatch.setenv("CC", "false")
    with pytest.raises(RuntimeError, match="failed"):
        kernel.build(tmp_path / "other")


def _sdpa_reference(q, cache, layer, tables, positions):
    """Each sequence alone through PyTorch's SDPA in fp32 over its gathered positions."""
    out = []
    for row, (table, position) in enumerate(zip(tables, positions.tolist(), strict=True)):
        span = position + 1
        keys = cache[table, layer, 0].flatten(0, 1)[:span].float().transpose(0, 1)  # [nkv, span, hd]
        values = cache[table, layer, 1].flatten(0, 1)[:span].float().transpose(0, 1)
        attn = F.scaled_dot_product_attention(q[row].float()[:, None], keys, values, enable_gqa=True)
        out.append(attn[:, 0])
    return torch.stack(out)


needs_attention = pytest.mark.skipif(
    kernel.decode_attention() is None, reason="no AVX-512-BF16 or no C compiler here"
)


@needs_attention
@pytest.mark.parametrize(("kv_heads", "group", "head_dim"), [(3, 3, 64), (4, 2, 64), (1, 8, 32), (2, 1, 128)])
def test_paged_attention_matches_sdpa_at_mixed_lengths(kv_heads: int, group: int, head_dim: int) -> None:
    generator = torch.Generator().manual_seed(kv_heads * group)
    blocks, layers, block_size = 64, 2, 4
    cache = torch.randn(blocks, layers, 2, block_size, kv_heads, head_dim, generator=generator).bfloat16()
    lengths = [0, 3, 4, 17, 40]  # positions: one token, a block edge, spans of several blocks
    order = torch.randperm(blocks, generator=generator)
    tables, used = [], 0
    for position in lengths:
        count = position // block_size + 1
        tables.append(order[used : used + count])
        used += count
    width = max(len(t) for t in tables)
    table = torch.stack([F.pad(t, (0, width - len(t)), value=blocks - 1) for t in tables])
    positions = torch.tensor(lengths)
    q = (2 * torch.randn(len(lengths), kv_heads * group, head_dim, generator=generator)).bfloat16()
    got = kernel.decode_attention()(q, cache, 1, table, positions)
    expected = _sdpa_reference(q, cache, 1, tables, positions)
    assert got.dtype == torch.bfloat16 and got.shape == q.shape
    assert (got.float() - expected).abs().max().item() < 2e-2  # bf16 output rounding


@needs_attention
def test_paged_attention_refuses_shapes_it_does_not_cover() -> None:
    attend = kernel.decode_attention()
    cache = torch.zeros(4, 1, 2, 4, 1, 48).bfloat16()  # head_dim 48: not a multiple of 32
    with pytest.raises(ValueError):
        attend(
            torch.zeros(1, 1, 48).bfloat16(), cache, 0, torch.zeros(1, 1, dtype=torch.long), torch.zeros(1)
        )


@needs_attention
def test_an_engine_decodes_the_same_with_and_without_its_kernels(monkeypatch) -> None:
    """One bf16 decode step of three sequences: the kernels' logits are PyTorch's within bf16 noise."""
    from disagg import paths
    from disagg.engine.engine import Engine, EngineConfig
    from disagg.engine.params import SamplingParams
    from disagg.engine.sequence import Request

    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)  # the projection kernel too
    logits = []
    for native in (True, False):
        config = EngineConfig(
            model_dir=paths.tiny_model_dir(),
            dtype="bfloat16",
            num_blocks=64,
            native_kernels=native,
            small_batch_kernel=native,
        )
        engine = Engine(config)
        assert engine.model.paged_attention is native and engine.model.lm_head.small_batch is native
        requests = [Request(tuple(range(3, 3 + n)), SamplingParams(max_tokens=4)) for n in (5, 21, 40)]
        engine.prefill(requests)
        rows = engine._decode_rows(list(engine._sequences.values()))
        for count in (1, 3):  # one row (projection kernel) and three (oneDNN projections)
            batch = type(rows)(rows.tokens[:count], rows.positions[:count], rows.block_table[:count])
            step, _ = engine.model.step(batch, [], engine.kv.cache)
            logits.append(step)
    for with_kernels, without in ((logits[0], logits[2]), (logits[1], logits[3])):
        scale = without.abs().max().item()
        # bf16 noise is about 1 % of the scale; a wrong block, position or head is of the order of it
        assert (with_kernels - without).abs().max().item() < 0.05 * scale
