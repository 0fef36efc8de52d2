"""The AMX tile kernel (``kernels/amx.c``): its emulated build, on any CPU, against the exact sums it
is written to compute (the Intel SDM's order: input pairs in order, products exact in fp32); a row's
bits independent of its batch and of the thread count; what it refuses; the projection's routing of
prompt rows to it; and, on a CPU with AMX only, the real build against the emulation."""

from __future__ import annotations

import pytest
import torch

from disagg.engine import amxkernel, kernel
from disagg.engine.projection import Projection

emulated = amxkernel.gemm(emulated=True)
needs_compiler = pytest.mark.skipif(emulated is None, reason="no C compiler here")
needs_bf16_kernel = pytest.mark.skipif(kernel.gemm() is None, reason="no AVX-512-BF16 or no C compiler here")


def _in_order(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, wide: bool) -> torch.Tensor:
    """Each output as one fp32 sum over the inputs in order (every bf16 x bf16 product is exact in
    fp32), plus the bias, rounded to bf16 to nearest even unless ``wide``."""
    acc = torch.zeros(x.shape[0], weight.shape[0], dtype=torch.float32)
    xs, ws = x.float(), weight.float()
    for k in range(x.shape[1]):
        acc += xs[:, k : k + 1] * ws[:, k]
    if bias is not None:
        acc += bias.float()
    return acc if wide else acc.bfloat16()


def _operands(rows: int, outputs: int, width: int, seed: int) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(outputs, width, generator=generator).bfloat16()
    bias = torch.randn(outputs, generator=generator).bfloat16()
    x = torch.randn(rows, width, generator=generator).bfloat16()
    return x, weight, bias


@needs_compiler
@pytest.mark.parametrize("rows", [1, 15, 16, 17, 32, 33, 70])
@pytest.mark.parametrize(("outputs", "width"), [(16, 32), (50, 64), (96, 96), (33, 128)])
def test_the_emulated_kernel_computes_the_sums_in_the_sdms_order(rows: int, outputs: int, width: int) -> None:
    x, weight, bias = _operands(rows, outputs, width, rows * 1000 + outputs * 10 + width)
    packed = amxkernel.pack(weight)
    assert packed.tiles.shape == ((outputs + 31) // 32 * 2, width // 2, 16, 2)
    assert torch.equal(emulated(x, packed, bias), _in_order(x, weight, bias, wide=False))
    assert torch.equal(emulated(x, packed, None, True), _in_order(x, weight, None, wide=True))


@needs_compiler
def test_a_rows_bits_do_not_depend_on_its_batch_or_the_thread_count() -> None:
    x, weight, bias = _operands(70, 96, 64, 7)
    packed = amxkernel.pack(weight)
    before = kernel.use_threads(1)
    try:
        alone = torch.cat([emulated(x[i : i + 1], packed, bias) for i in range(x.shape[0])])
        one_thread = emulated(x, packed, bias)
        kernel.use_threads(2)
        two_threads = emulated(x, packed, bias)
    finally:
        kernel.use_threads(before)
    assert torch.equal(alone, one_thread) and torch.equal(one_thread, two_threads)


@needs_compiler
def test_the_kernel_refuses_what_it_cannot_compute() -> None:
    with pytest.raises(ValueError, match="multiples of 32"):
        amxkernel.pack(torch.zeros(16, 48).bfloat16())
    with pytest.raises(ValueError, match="bf16"):
        amxkernel.pack(torch.zeros(16, 64))
    packed = amxkernel.pack(torch.zeros(16, 64).bfloat16())
    with pytest.raises(ValueError, match="width 64"):
        emulated(torch.zeros(2, 32).bfloat16(), packed, None)
    with pytest.raises(ValueError, match="bias"):
        emulated(torch.zeros(1, 64).bfloat16(), packed, torch.zeros(3).bfloat16())
    assert emulated(torch.zeros(0, 64).bfloat16(), packed, None).shape == (0, 16)
    assert not amxkernel.covers(16, 48) and amxkernel.covers(576, 1536)


@needs_compiler
@needs_bf16_kernel
def test_with_amx_and_the_tile_kernel_prompt_rows_go_to_the_tiles_and_decode_rows_to_the_kernel(
    monkeypatch,
) -> None:
    """``amx`` and ``amx_kernel`` injected, the CPU is not asked: prompt rows are computed by the tile
    kernel on its own layout, decode rows by the bf16 kernel; no oneDNN weight is kept."""
    monkeypatch.setattr(kernel, "cpu_has_amx", lambda: pytest.fail("the CPU was asked despite amx"))
    x, weight, bias = _operands(9, 128, 64, 3)
    projection = Projection(weight, bias, pack=True, native=True, amx=True, amx_kernel=emulated)
    assert projection.native is not None and projection.amx_tiles is not None
    assert projection.weight is None and not projection.packed
    assert projection.nbytes == 2 * 128 * 64 * 2  # the kernel's layout and the tiles'
    split = projection(x, 4)
    assert torch.equal(split[:4], kernel.gemm()(x[:4], projection.native, bias))
    assert torch.equal(split[4:], _in_order(x[4:], weight, bias, wide=False))
    assert torch.equal(projection(x, 0), _in_order(x, weight, bias, wide=False))
    assert torch.equal(projection(x), kernel.gemm()(x, projection.native, bias))  # all decode rows
    head = Projection(
        weight, None, pack=True, native=True, wide=True, split=False, amx=True, amx_kernel=emulated
    )
    assert head.amx_tiles is None  # an output head sees a row a prompt: the kernel alone
    odd = Projection(torch.randn(32, 48).bfloat16(), None, native=True, amx=True, amx_kernel=emulated)
    assert odd.amx_tiles is None  # inputs not in multiples of 32: prompt rows as without the tiles


@needs_compiler
@needs_bf16_kernel
def test_without_the_tile_kernel_prompt_rows_on_amx_go_to_onednn(monkeypatch) -> None:
    monkeypatch.setattr(amxkernel, "gemm", lambda emulated=False: None)
    x, weight, bias = _operands(5, 64, 64, 4)
    projection = Projection(weight, bias, pack=True, native=True, amx=True)
    assert projection.amx_tiles is None and projection.packed and projection.native is not None
    assert torch.equal(projection(x, 0), torch.nn.functional.linear(x, weight, bias))


def test_the_real_kernel_is_off_unless_switched_on(monkeypatch) -> None:
    monkeypatch.delenv(amxkernel.SWITCH, raising=False)
    amxkernel.library.cache_clear()
    try:
        assert amxkernel.gemm() is None  # unverified on AMX hardware: off by default, AMX or not
    finally:
        amxkernel.library.cache_clear()


@pytest.mark.skipif(
    not (amxkernel.cpu_supports() and amxkernel.switched_on()),
    reason="needs a CPU with AMX (amx_tile, amx_bf16) and DISAGG_AMX_TILES=1",
)
def test_on_amx_the_real_kernel_agrees_with_the_emulation() -> None:
    """Runs only on a CPU with AMX, switched on: the real build loads (the tile state granted) and its
    outputs are the emulation's up to the hardware's summation (one bf16 step); a row's bits do not
    depend on its batch."""
    real = amxkernel.gemm()
    assert real is not None, "AMX present but the tile kernel is off (see the log)"
    x, weight, bias = _operands(70, 576, 1536, 11)
    packed = amxkernel.pack(weight)
    got, expected = real(x, packed, bias), emulated(x, packed, bias)
    scale = expected.float().abs().max().item()
    assert (got.float() - expected.float()).abs().max().item() <= scale * 2**-7
    assert torch.equal(real(x[5:6], packed, bias)[0], got[5])
