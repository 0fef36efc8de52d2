"""Block-coded weights: codes recovered only when every fp32 value is one, and the kernel's products
against a float64 reference, the same bits for a row at any batch size, and the projection's routing of
decode rows to it and prompt rows to the fp32 weight."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from disagg.engine import blockcode, fp32kernel
from disagg.engine.params import SamplingParams
from disagg.engine.projection import Projection
from disagg.engine.sequence import Request

needs_kernel = pytest.mark.skipif(blockcode.gemm() is None, reason="no AVX2 / FMA / F16C, or no C compiler")


def coded(rows: int, cols: int, kind: GGMLQuantizationType, seed: int = 0) -> torch.Tensor:
    """What the converter stores for a GGUF weight of ``kind``: the fp32 values its blocks decode to."""
    values = np.random.default_rng(seed).standard_normal((rows, cols), dtype=np.float32) * 0.05
    return torch.from_numpy(dequantize(quantize(values, kind), kind).astype(np.float32))


@pytest.mark.parametrize(("kind", "bits"), [(GGMLQuantizationType.Q4_1, 4), (GGMLQuantizationType.Q8_0, 8)])
def test_codes_are_recovered_from_the_fp32_values_they_decode_to(
    kind: GGMLQuantizationType, bits: int
) -> None:
    weight = coded(40, 96, kind)
    code = blockcode.recover(weight)
    assert code is not None and code.bits == bits
    assert (code.out_features, code.in_features) == (40, 96)
    # tiles of 16 outputs, padded: 3 tiles; 4-bit codes take half a byte a weight
    assert code.codes.shape == (3, 96, 16 * bits // 8)
    assert code.scales.shape == (3, 3, 16) and code.scales.dtype == torch.float16
    assert (code.mins is not None) == (bits == 4)
    per_tile = 96 * 16 * bits // 8 + 3 * 16 * 2 * (2 if bits == 4 else 1)  # codes, scales (and mins)
    assert code.nbytes == 3 * per_tile < weight.numel() * 4 / 3


def test_weights_that_are_no_code_stay_fp32() -> None:
    generator = torch.Generator().manual_seed(0)
    assert blockcode.recover(torch.randn(64, 96, generator=generator)) is None  # a random fp32 model
    assert blockcode.recover(torch.randn(64, 96, generator=generator).bfloat16().float()) is None
    almost = coded(48, 64, GGMLQuantizationType.Q4_1)
    almost[30, 7] = torch.nextafter(almost[30, 7], torch.tensor(1.0))  # one ulp off, past the sample
    assert blockcode.recover(almost) is None
    assert blockcode.recover(coded(8, 64, GGMLQuantizationType.Q4_1)[:, :40]) is None  # not whole runs
    assert blockcode.recover(coded(8, 64, GGMLQuantizationType.Q8_0).bfloat16()) is None  # not fp32


def test_constant_and_zero_runs_are_codes() -> None:
    weight = coded(16, 64, GGMLQuantizationType.Q4_1)
    weight[3, :32] = weight[3, :32].min()  # a run of one value (its min, an fp16): scale 0, codes 0
    weight[5] = 0.0
    code = blockcode.recover(weight)
    assert code is not None and code.bits == 4


@needs_kernel
@pytest.mark.parametrize("kind", [GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0])
@pytest.mark.parametrize("out_features", [16, 40, 200])
def test_the_kernel_computes_the_products_and_a_row_gets_the_same_bits_at_any_batch(
    kind: GGMLQuantizationType, out_features: int
) -> None:
    weight = coded(out_features, 160, kind, seed=out_features)
    code = blockcode.recover(weight)
    assert code is not None
    gemm = blockcode.gemm()
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(13, 160, generator=generator)
    bias = torch.randn(out_features, generator=generator)
    reference = x.double() @ weight.double().T + bias.double()
    y = gemm(x, code, bias)
    assert y.dtype == torch.float32 and y.shape == (13, out_features)
    assert torch.allclose(y.double(), reference, rtol=1e-5, atol=1e-5)
    for rows in (1, 2, 3, 7):  # row groups of 2 and a last single row: the same sums
        assert torch.equal(gemm(x[:rows], code, bias), y[:rows])
    assert torch.equal(gemm(x[5:6], code, None) + 0, gemm(x, code, None)[5:6])
    assert gemm(x[:0], code, None).shape == (0, out_features)
    with pytest.raises(ValueError, match="fp32 rows"):
        gemm(x.bfloat16(), code, None)
    with pytest.raises(ValueError, match="fp32 bias"):
        gemm(x, code, bias[:-1])


@needs_kernel
def test_a_projection_sends_decode_rows_to_the_codes_and_prompt_rows_to_the_fp32_weight() -> None:
    weight = coded(48, 64, GGMLQuantizationType.Q4_1)
    x = torch.randn(6, 64, generator=torch.Generator().manual_seed(2))
    projection = Projection(weight, None, native=True)
    assert projection.blocks is not None and projection.weight is None and projection.tiles is not None
    codes = blockcode.gemm()(x, projection.blocks, None)
    assert torch.equal(projection(x), codes)  # all decode rows
    mixed = projection(x, 2)  # two decode rows, then four prompt rows: the fp32 kernel's
    assert torch.equal(mixed[:2], codes[:2])
    prompt = fp32kernel.gemm()(x, fp32kernel.pack(weight), None)
    assert torch.equal(mixed[2:], prompt[2:])
    torch.testing.assert_close(mixed[2:], F.linear(x[2:], weight), rtol=1e-5, atol=1e-5)
    assert torch.equal(projection(x, 0), prompt)
    head = Projection(weight, None, native=True, wide=True, split=False)  # few rows: the codes alone
    assert head.weight is None and head.nbytes == head.blocks.nbytes
    assert torch.equal(head(x, 2), codes)
    plain = Projection(weight, None, native=False)
    assert plain.blocks is None and torch.equal(plain(x), F.linear(x, weight))


needs_bf16_codes = pytest.mark.skipif(
    blockcode.bf16_gemm() is None, reason="no AVX-512-BF16, or no C compiler"
)


@needs_bf16_codes
@pytest.mark.parametrize(("out_features", "in_features"), [(16, 160), (40, 160), (200, 1024)])
def test_the_bf16_kernel_computes_the_codes_products_and_a_row_gets_the_same_bits_at_any_batch(
    out_features: int, in_features: int
) -> None:
    weight = coded(out_features, in_features, GGMLQuantizationType.Q4_1, seed=out_features)
    code = blockcode.quads(blockcode.recover(weight))
    gemm = blockcode.bf16_gemm()
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(13, in_features, generator=generator).bfloat16()
    bias = torch.randn(out_features, generator=generator).bfloat16()
    reference = x.double() @ weight.double().T + bias.double()  # the codes' exact values, unrounded
    wide = gemm(x, code, bias, wide=True)
    assert wide.dtype == torch.float32 and wide.shape == (13, out_features)
    assert torch.allclose(wide.double(), reference, rtol=1e-5, atol=1e-5)
    y = gemm(x, code, bias)
    assert y.dtype == torch.bfloat16 and torch.equal(y, wide.bfloat16())  # rounded to nearest even
    for rows in (1, 2, 5, 7, 8, 9):  # row groups of 8, and the last rows: the same sums
        assert torch.equal(gemm(x[:rows], code, bias, wide=True), wide[:rows])
    assert torch.equal(gemm(x[9:10], code, bias, wide=True), wide[9:10])
    threads = torch.get_num_threads()
    try:
        for count in (1, 2):  # split by tiles (the largest shape is big enough to split)
            torch.set_num_threads(count)
            assert torch.equal(gemm(x, code, bias, wide=True), wide)
    finally:
        torch.set_num_threads(threads)
    assert gemm(x[:0], code, None).shape == (0, out_features)
    with pytest.raises(ValueError, match="bf16 rows"):
        gemm(x.float(), code, None)
    with pytest.raises(ValueError, match="bf16 bias"):
        gemm(x, code, bias[:-1])
    with pytest.raises(ValueError, match="quads"):
        gemm(x, blockcode.recover(weight), None)  # the fp32 kernel's layout


def test_only_4_bit_codes_are_laid_out_for_the_bf16_kernel() -> None:
    code = blockcode.quads(blockcode.recover(coded(20, 64, GGMLQuantizationType.Q4_1)))
    assert code.layout == "quads" and code.codes.shape == (2, 16, 32)  # 2 tiles, 16 groups of 4 inputs
    assert code.nbytes == blockcode.recover(coded(20, 64, GGMLQuantizationType.Q4_1)).nbytes
    with pytest.raises(ValueError, match="4-bit"):
        blockcode.quads(blockcode.recover(coded(20, 64, GGMLQuantizationType.Q8_0)))
    with pytest.raises(ValueError, match="4-bit"):
        blockcode.quads(code)


@needs_bf16_codes
def test_a_bf16_projection_sends_decode_rows_to_the_codes_and_prompt_rows_to_the_bf16_weight() -> None:
    from disagg.engine import kernel

    source = coded(48, 64, GGMLQuantizationType.Q4_1)
    weight = source.bfloat16()
    x = torch.randn(6, 64, generator=torch.Generator().manual_seed(2)).bfloat16()
    projection = Projection(weight, None, native=True, source=source)
    assert projection.blocks is not None and projection.blocks.layout == "quads"
    codes = blockcode.bf16_gemm()(x, projection.blocks, None)
    assert torch.equal(projection(x), codes)  # all decode rows
    mixed = projection(x, 2)  # two decode rows, then four prompt rows
    assert torch.equal(mixed[:2], codes[:2])
    if not kernel.cpu_has_amx():  # with AMX, prompt rows go to the AMX tiles (or oneDNN)
        assert torch.equal(mixed[2:], kernel.gemm()(x[2:], kernel.pack(weight), None))
    torch.testing.assert_close(
        mixed[2:].float(), F.linear(x[2:].float(), weight.float()), rtol=0.02, atol=0.02
    )
    head = Projection(weight, None, native=True, wide=True, split=False, source=source)  # the codes alone
    assert head.native is None and head.weight is None and head.nbytes == head.blocks.nbytes
    assert torch.equal(head(x, 2), blockcode.bf16_gemm()(x, head.blocks, None, wide=True))
    eight = coded(48, 64, GGMLQuantizationType.Q8_0)
    for unfound in (
        Projection(weight, None, native=True),
        Projection(eight.bfloat16(), None, native=True, source=eight),
    ):
        assert unfound.blocks is None and unfound.native is not None  # no source, or not 4-bit: bf16 weight


@needs_bf16_codes
def test_a_bf16_engine_decodes_on_the_codes_close_to_fp32_and_alone_as_in_a_batch(
    coded_model: Path, tmp_path: Path
) -> None:
    """A bf16 engine on a Q4_1-coded checkpoint: decode rows on the codes. One decode step's logits
    are as close to fp32's as those of the same engine on the bf16-rounded weights (where no code
    can be found); a sequence's greedy tokens do not depend on its batch or on prefill in chunks."""
    from checkpoints import write_checkpoint
    from coded import coded_copy, greedy

    from disagg.engine.engine import Engine, EngineConfig

    rounded = coded_copy(
        write_checkpoint(tmp_path / "plain", "llama-gqa"), tmp_path / "rounded", torch.bfloat16
    )
    logits = {}
    for name, model_dir, dtype in (
        ("codes", coded_model, "bfloat16"),
        ("rounded", rounded, "bfloat16"),
        ("fp32", coded_model, "float32"),
    ):
        engine = Engine(
            EngineConfig(model_dir=model_dir, dtype=dtype, num_blocks=64, native_kernels=dtype == "bfloat16")
        )
        if name == "codes":
            assert engine.describe()["projections"] == "kernel+blocks-q4_1"
        elif name == "rounded":
            assert engine.describe()["projections"] == "kernel"
        engine.prefill([Request(tuple(range(3, 3 + n)), SamplingParams(max_tokens=4)) for n in (5, 21, 40)])
        rows = engine._decode_rows(list(engine._sequences.values()))
        logits[name], _ = engine.model.step(rows, [], engine.kv.cache)
    reference = logits["fp32"]
    codes, rounded_err = ((logits[n] - reference).abs().max().item() for n in ("codes", "rounded"))
    assert codes < 1.5 * rounded_err + 0.01 * reference.abs().max().item()

    engine = Engine(EngineConfig(model_dir=coded_model, dtype="bfloat16", num_blocks=256, block_size=4))
    prompts = [tuple([1, *range(7, 7 + n)]) for n in (3, 20, 45)]
    together = greedy(engine, prompts, 12)
    assert greedy(engine, prompts[2:], 12) == together[2:]
    assert greedy(engine, prompts, 12, chunk=7) == together
