"""Block-coded weights: codes recovered only when every fp32 value is one, and the kernel's products
against a float64 reference, the same bits for a row at any batch size, and the projection's routing of
decode rows to it and prompt rows to the fp32 weight."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from disagg.engine import blockcode, fp32kernel
from disagg.engine.projection import Projection

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
