"""Projection: a prepacked bf16 weight gives F.linear's bits, fp32 or unsupported CPUs fall back; and the
``auto`` dtype rule that follows from it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from disagg.engine.projection import Projection, packing_available

CPU = torch.device("cpu")
needs_packing = pytest.mark.skipif(
    not packing_available(torch.bfloat16, CPU), reason="this CPU's oneDNN has no bf16 kernels"
)


@needs_packing
@pytest.mark.parametrize("rows", [1, 3, 8, 64, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_a_packed_bf16_projection_gives_f_linear_bits(rows: int, bias: bool) -> None:
    generator = torch.Generator().manual_seed(rows)
    weight = torch.randn(96, 64, generator=generator).bfloat16()
    offset = torch.randn(96, generator=generator).bfloat16() if bias else None
    x = torch.randn(rows, 64, generator=generator).bfloat16()
    projection = Projection(weight.clone(), offset, pack=True)
    assert projection.packed
    assert torch.equal(projection(x), F.linear(x, weight, offset))
    assert projection.nbytes == weight.numel() * 2  # a replacement, not a second copy


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_other_dtypes_keep_the_plain_weight(dtype: torch.dtype) -> None:
    weight = torch.randn(8, 4, dtype=dtype)
    projection = Projection(weight, None, pack=True)
    assert not projection.packed and projection.weight is weight
    x = torch.randn(2, 4, dtype=dtype)
    assert torch.equal(projection(x), F.linear(x, weight))


def test_packing_off_keeps_the_plain_weight() -> None:
    weight = torch.randn(8, 4).bfloat16()
    projection = Projection(weight, None, pack=False)
    assert not projection.packed and projection.weight is weight


def test_auto_dtype_follows_the_cpu_rule_and_is_resolved_in_the_config(tmp_path) -> None:
    from disagg.engine.device import auto_dtype
    from disagg.engine.engine import EngineConfig

    expected = "bfloat16" if packing_available(torch.bfloat16, CPU) else "float32"
    assert auto_dtype("cpu") == expected
    config = EngineConfig(model_dir=tmp_path, dtype="auto")
    assert config.dtype == expected  # resolved once, at construction: every later reader sees it
    assert EngineConfig.from_dict({"model_dir": str(tmp_path), "dtype": "auto"}).dtype == expected
    with pytest.raises(ValueError, match="auto"):
        EngineConfig(model_dir=tmp_path, dtype="int8")
