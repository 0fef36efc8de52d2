"""The fp32 kernels (the projection, RMSNorm, rotary + cache writes, paged decode attention) against
PyTorch, a row's bits independent of its batch and thread count, and an engine on a block-coded or a
plain checkpoint running them with the tokens of the reference fp32 engine."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from coded import greedy
from margins import TIE, record_margins

from disagg.engine import blockcode, fp32kernel, kernel
from disagg.engine.checkpoint import RopeConfig
from disagg.engine.engine import Engine, EngineConfig
from disagg.engine.rope import RotaryTable

needs_kernels = pytest.mark.skipif(
    fp32kernel.library() is None or blockcode.gemm() is None, reason="no AVX2 / FMA / F16C, or no C compiler"
)
pytestmark = needs_kernels

LAYERS, KV_HEADS, HEAD_DIM, BLOCK = 3, 2, 16, 4


def _cache(blocks: int, seed: int, head_dim: int = HEAD_DIM, block_size: int = BLOCK) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(blocks, LAYERS, 2, block_size, KV_HEADS, head_dim, generator=generator)


@pytest.mark.parametrize(
    ("rows", "out_features", "in_features"), [(1, 16, 8), (7, 37, 100), (50, 130, 64), (97, 48, 1)]
)
@pytest.mark.parametrize("threads", [1, 2])
def test_the_fp32_projection_matches_float64_and_a_row_its_own_bits(
    rows: int, out_features: int, in_features: int, threads: int
) -> None:
    """Row counts across the kernel's groups of 6 and chunks of 48, outputs not a whole tile."""
    generator = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, in_features, generator=generator)
    weight = torch.randn(out_features, in_features, generator=generator)
    bias = torch.randn(out_features, generator=generator)
    tiles, gemm = fp32kernel.pack(weight), fp32kernel.gemm()
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        y, unbiased = gemm(x, tiles, bias), gemm(x, tiles, None)
        alone = [gemm(x[r : r + 1], tiles, bias) for r in range(rows)]
    finally:
        torch.set_num_threads(previous)
    reference = x.double() @ weight.double().T
    assert torch.allclose(y.double(), reference + bias.double(), rtol=1e-5, atol=1e-5)
    assert torch.allclose(unbiased.double(), reference, rtol=1e-5, atol=1e-5)
    for r in range(rows):  # a row alone gets the bits it gets in the batch
        assert torch.equal(alone[r][0], y[r])
    assert gemm(x[:0], tiles, bias).shape == (0, out_features)
    assert tiles.tiles.shape == (-(-out_features // fp32kernel.TILE), in_features, fp32kernel.TILE)


def test_the_fp32_projection_refuses_what_it_cannot_compute() -> None:
    weight = torch.randn(32, 16)
    tiles, gemm = fp32kernel.pack(weight), fp32kernel.gemm()
    with pytest.raises(ValueError, match="fp32 rows of width 16"):
        gemm(torch.randn(2, 15), tiles, None)
    with pytest.raises(ValueError, match="fp32 rows"):
        gemm(torch.randn(2, 16).bfloat16(), tiles, None)
    with pytest.raises(ValueError, match="fp32 bias of 32"):
        gemm(torch.randn(2, 16), tiles, torch.randn(31))
    with pytest.raises(ValueError, match="2-D fp32"):
        fp32kernel.pack(weight.bfloat16())


def test_rms_norm_matches_the_formula_and_a_row_its_own_bits() -> None:
    generator = torch.Generator().manual_seed(0)
    x, weight = torch.randn(5, 100, generator=generator), torch.randn(100, generator=generator)
    norm = fp32kernel.rms_norm()
    y = norm(x, weight, 1e-5)
    x64 = x.double()
    reference = weight.double() * x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-5)
    assert torch.allclose(y.double(), reference, rtol=1e-5, atol=1e-6)
    assert torch.equal(norm(x[3:4], weight, 1e-5), y[3:4])
    with pytest.raises(ValueError, match="fp32 rows"):
        norm(x.bfloat16(), weight, 1e-5)


def test_rope_cache_gives_the_rotary_tables_bits_and_writes_the_slots() -> None:
    heads, rows = 4, 6
    table = RotaryTable(RopeConfig(theta=10000.0), HEAD_DIM, 64, torch.float32)
    generator = torch.Generator().manual_seed(1)
    qkv = torch.randn(rows, (heads + 2 * KV_HEADS) * HEAD_DIM, generator=generator)
    positions = torch.tensor([0, 5, 9, 10, 33, 63])
    slot_block, slot_offset = torch.tensor([3, 1, 1, 0, 2, 4]), torch.tensor([0, 1, 2, 3, 0, 3])
    cache = _cache(5, 2)
    expected = cache.clone()
    q = fp32kernel.rope_cache()(
        qkv, cache, 1, positions, slot_block, slot_offset, table.cos, table.sin, heads, 2
    )
    q_ref, k, v = qkv.split([heads * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], dim=-1)
    assert torch.equal(q, table.apply(q_ref.view(rows, heads, HEAD_DIM), positions))
    expected[slot_block, 1, 0, slot_offset] = table.apply(k.reshape(rows, KV_HEADS, HEAD_DIM), positions)
    expected[slot_block, 1, 1, slot_offset] = v.reshape(rows, KV_HEADS, HEAD_DIM)
    assert torch.equal(cache, expected)  # and nothing else of the cache was touched


def _reference_attention(q: torch.Tensor, cache: torch.Tensor, layer: int, table: list[int], position: int):
    """One row q [heads, hd] over positions 0..position of its blocks, in float64."""
    span, head_dim = position + 1, q.shape[-1]
    rows = cache[torch.tensor(table), layer].double()  # [blocks, 2, bs, kv, hd]
    keys = rows[:, 0].reshape(-1, KV_HEADS, head_dim)[:span].transpose(0, 1)  # [kv, span, hd]
    values = rows[:, 1].reshape(-1, KV_HEADS, head_dim)[:span].transpose(0, 1)
    group = q.shape[0] // KV_HEADS
    keys, values = keys.repeat_interleave(group, 0), values.repeat_interleave(group, 0)
    scores = torch.softmax((q.double()[:, None, :] @ keys.transpose(-1, -2))[:, 0] * head_dim**-0.5, -1)
    return (scores[:, None, :] @ values)[:, 0]


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("head_dim", [16, 64, 136])  # in memory; in registers; 64 in registers, 72 not
@pytest.mark.parametrize("block_size", [4, 16])  # keys one at a time; also eight at a time
def test_decode_attention_reads_each_rows_own_blocks(threads: int, head_dim: int, block_size: int) -> None:
    heads = 6  # three query heads per kv head
    cache = _cache(40, 3, head_dim, block_size)
    tables = [
        [7, 3, 0, 0, 0, 0, 0, 0],
        [1, 2, 4, 5, 6, 8, 9, 10],
        [11, 0, 0, 0, 0, 0, 0, 0],
        [39, 20, 21, 0, 0, 0, 0, 0],
    ]
    positions = torch.tensor([5, 31, 0, 10])  # mixed lengths: one 32-position row among short ones
    block_table = torch.tensor(tables)
    q = torch.randn(4, heads, head_dim, generator=torch.Generator().manual_seed(4))
    attend = fp32kernel.decode_attention()
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = attend(q, cache, 2, block_table, positions, kernel.decode_plan(block_table, positions, 3))
        alone = attend(q[1:2], cache, 2, block_table[1:2], positions[1:2])
    finally:
        torch.set_num_threads(previous)
    for row in range(4):
        reference = _reference_attention(q[row], cache, 2, tables[row], int(positions[row]))
        assert torch.allclose(out[row].double(), reference, rtol=1e-5, atol=1e-6)
    assert torch.equal(alone[0], out[1])
    with pytest.raises(ValueError, match="not this batch"):
        attend(q[:2], cache, 2, block_table, positions, kernel.decode_plan(block_table, positions, 3))


@pytest.mark.parametrize(
    ("model", "projections"), [("coded_model", "blocks-q4_1"), ("plain_model", "fp32-kernel")]
)
def test_an_fp32_engine_runs_the_kernels_with_the_plain_engines_tokens(
    model: str, projections: str, request: pytest.FixtureRequest
) -> None:
    """On a block-coded checkpoint (decode rows on the codes, prompt rows on the fp32 kernel) and on
    a plain one (every row on the fp32 kernel)."""
    model_dir: Path = request.getfixturevalue(model)
    make: Callable[[bool], Engine] = lambda native: Engine(  # noqa: E731
        EngineConfig(
            model_dir=model_dir, dtype="float32", num_blocks=256, block_size=BLOCK, native_kernels=native
        )
    )
    fast = make(True)
    assert fast.describe()["projections"] == projections and fast.describe()["attention"] == "kernel"
    prompts = [tuple([1, *range(7, 7 + n)]) for n in (3, 20, 45)]
    batched, chunked = greedy(fast, prompts, 16), greedy(fast, prompts, 16, chunk=7)
    compared = 0
    for prompt, got, got_chunked in zip(prompts, batched, chunked, strict=True):
        plain = make(False)  # one sequence at a time, so its margins are this sequence's, in order
        assert plain.describe()["projections"] == "torch" and plain.describe()["attention"] == "torch"
        margins = record_margins(plain)
        (expected,) = greedy(plain, [prompt], 16)
        for step, want in enumerate(expected):
            if margins[step] < TIE:
                break
            assert got[step] == want and got_chunked[step] == want, (
                f"token {step} of a {len(prompt)}-token prompt"
            )
            compared += 1
    assert compared >= 24  # most of the stream is compared, not cut short at a tie
    # a sequence's tokens do not depend on its batch: the long prompt alone, then beside the others
    assert greedy(fast, prompts[2:], 16) == greedy(fast, prompts, 16)[2:]


@pytest.mark.parametrize(
    ("model", "projections"), [("coded_model", "blocks-q4_1"), ("plain_model", "fp32-kernel")]
)
def test_a_bf16_kv_cache_keeps_pytorchs_operations_between_projections(
    model: str, projections: str, request: pytest.FixtureRequest
) -> None:
    config = EngineConfig(
        model_dir=request.getfixturevalue(model), dtype="float32", kv_dtype="bfloat16", num_blocks=64
    )
    bf16_kv = Engine(config)
    assert bf16_kv.describe()["projections"] == projections and bf16_kv.describe()["attention"] == "torch"
    assert bf16_kv.model.norm_kernel is None and bf16_kv.model.rope_kernel is None
