"""Block-coded weights: fp32 projection weights that are exactly llama.cpp's Q4_1 or Q8_0 codes, read
in that code by the engine's kernel (``kernels/blocks.c``) instead of as fp32.

A checkpoint converted from a quantized GGUF file (``tools/converter.py``, the default SmolLM2 model
among them) stores every weight as the fp32 value its block decodes to: per run of 32 inputs of an
output row, ``d * q + m`` (Q4_1: q in 0..15, fp16 scale d and min m) or ``d * q`` (Q8_0: q in
-128..127). ``recover`` finds those codes from the fp32 values alone and keeps them only when every
weight of the tensor decodes back to its fp32 value bit for bit, so nothing is guessed: a weight that
is not such a code (the random tiny model, a bf16 or fp32 checkpoint) stays fp32. The kernel then
reads 4.5 (Q4_1) or 8.5 (Q8_0) bits a weight instead of 32, which is what a decode step, bound by
reading the weights, pays for: ``perf/engine_bench.py`` measures it.

What the kernel computes is the code's own value, exact: per run, ``d * sum(x q) + m * sum(x)`` in
fp32. It differs from the fp32 weights' product by rounding only (the converter rounded ``d q + m`` to
fp32 once per weight; the sums are in another order than MKL's), the same order of difference as
between two fp32 GEMM libraries, and a row's result does not depend on the rows batched with it.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from disagg.engine import kernel

SOURCE = Path(__file__).resolve().parent / "kernels" / "blocks.c"
RUN = 32  # inputs per block (one scale, one min); kernels/blocks.c's RUN
TILE = 16  # outputs per tile of the layout; kernels/blocks.c's COLS
NEEDS = frozenset({"avx2", "fma", "f16c"})
SAMPLE = 16  # rows tried first: a weight that is no code is refused without reading the rest


@dataclass(frozen=True)
class BlockCode:
    """A weight [N, K] in the layout ``gemm`` reads: ``codes`` [ceil(N / TILE), K, TILE * bits / 8]
    (4-bit: outputs 0..7 in the low nibbles, 8..15 in the high), ``scales`` and ``mins`` fp16
    [ceil(N / TILE), K / RUN, TILE] (``mins`` None for Q8_0); outputs zero-padded to whole tiles.
    ``bf16_gemm`` reads 4-bit codes in another order (``quads``)."""

    codes: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None
    bits: int
    out_features: int
    in_features: int
    layout: str = "inputs"  # "quads": the codes re-laid for the bf16 kernel (``quads``)

    @property
    def name(self) -> str:
        return "q4_1" if self.bits == 4 else "q8_0"

    @property
    def nbytes(self) -> int:
        held = [t for t in (self.codes, self.scales, self.mins) if t is not None]
        return sum(t.numel() * t.element_size() for t in held)


def _fp16_exact(values: torch.Tensor) -> bool:
    return bool((values.half().float() == values).all())


def _neighbours(estimate: torch.Tensor) -> list[torch.Tensor]:
    """``estimate`` rounded to fp16, and the fp16 values one and two steps either side (as fp32)."""
    bits = estimate.clamp(min=0).half().view(torch.int16).to(torch.int32)
    out = []
    for step in (0, -1, 1, -2, 2):
        moved = (bits + step).clamp(0, 0x7BFF).to(torch.int16).view(torch.float16)
        out.append(moved.float())
    return out


Decode = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def _pick(
    blocks: torch.Tensor, offsets: torch.Tensor, candidates: list[torch.Tensor], decode: Decode
) -> tuple | None:
    """Codes and, per block, the first candidate scale whose codes decode to every value exactly;
    None if a block has none. ``blocks`` [B, RUN], ``offsets`` [B] (the mins, or zeros), candidates
    [B] each; ``decode(blocks, scale [b, 1], offset [b, 1]) -> (codes, values)``. Each candidate is
    tried on the blocks the ones before it left, so a tensor costs about one decoding pass."""
    codes = torch.empty_like(blocks)
    chosen = torch.empty(blocks.shape[0])
    left = torch.arange(blocks.shape[0])
    for scale in candidates:
        part, offset, tried = blocks[left], offsets[left, None], scale[left]
        got, values = decode(part, tried[:, None], offset)
        exact = (values == part).all(-1)
        done = left[exact]
        codes[done], chosen[done] = got[exact], tried[exact]
        left = left[~exact]
        if not left.numel():
            return codes, chosen
    return None


def _q4_1(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """Codes 0..15, scales and mins of blocks [B, RUN] whose values are fl32(d q + m), or None."""
    low = blocks.amin(-1)  # the min's code is 0, so the block's min is m itself
    if not _fp16_exact(low):
        return None

    def decode(
        part: torch.Tensor, scale: torch.Tensor, mins: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))
        codes = torch.where(scale > 0, torch.round((part - mins) / safe), 0).clamp(0, 15)
        return codes, scale * codes + mins  # the converter's order: the product, then the min

    picked = _pick(blocks, low, _neighbours((blocks.amax(-1) - low) / 15), decode)
    return None if picked is None else (picked[0].to(torch.uint8), picked[1], low)


def _q8_0(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Codes -128..127 and scales of blocks [B, RUN] whose values are fl32(d q), or None."""

    def decode(part: torch.Tensor, scale: torch.Tensor, _: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))
        codes = torch.where(scale > 0, torch.round(part / safe), 0).clamp(-128, 127)
        return codes, scale * codes

    zeros = torch.zeros(blocks.shape[0])
    picked = _pick(blocks, zeros, _neighbours(blocks.abs().amax(-1) / 127), decode)
    return None if picked is None else (picked[0].to(torch.int8), picked[1])


def _tiled(per_output: torch.Tensor) -> torch.Tensor:
    """[N, X] -> [ceil(N / TILE), X, TILE], outputs zero-padded to whole tiles."""
    padded = F.pad(per_output, (0, 0, 0, -per_output.shape[0] % TILE))
    return padded.view(-1, TILE, per_output.shape[1]).transpose(1, 2).contiguous()


@torch.inference_mode()
def recover(weight: torch.Tensor) -> BlockCode | None:
    """``weight`` [N, K] fp32 as a Q4_1 or Q8_0 block code, when every value is exactly one; else None."""
    if weight.dim() != 2 or weight.dtype != torch.float32 or weight.device.type != "cpu":
        return None
    n, k = weight.shape
    if k % RUN or not bool(torch.isfinite(weight).all()):
        return None
    if n > SAMPLE and _recovered(weight[:SAMPLE]) is None:  # most weights that are not codes fail here
        return None
    return _recovered(weight)


def _recovered(weight: torch.Tensor) -> BlockCode | None:
    n, k = weight.shape
    blocks = weight.reshape(-1, RUN)
    runs = k // RUN
    q4 = _q4_1(blocks)
    if q4 is not None:
        codes, scales, mins = q4
        tiled = _tiled(codes.reshape(n, k))  # [T, K, 16]
        packed = tiled[..., :8] | (tiled[..., 8:] << 4)
        per_run = (_tiled(t.reshape(n, runs).half()) for t in (scales, mins))
        return BlockCode(packed.contiguous(), *per_run, 4, n, k)
    q8 = _q8_0(blocks)
    if q8 is not None:
        codes, scales = q8
        tiled = _tiled(codes.reshape(n, k).view(torch.uint8))
        return BlockCode(tiled, _tiled(scales.reshape(n, runs).half()), None, 8, n, k)
    return None


def quads(code: BlockCode) -> BlockCode:
    """A 4-bit ``code`` in the layout ``bf16_gemm`` reads: per tile and group of four inputs k .. k + 3,
    32 bytes, byte 2 j + p holding output j's code of input k + p (low nibble) and of k + 2 + p (high)
    (``kernels/bf16.c``, gemm_codes_bf16). The scales and mins are shared with ``code``."""
    if code.bits != 4 or code.layout != "inputs":
        raise ValueError("quads takes 4-bit codes in the inputs layout")
    tiles, k = code.codes.shape[0], code.in_features
    per_output = torch.cat([code.codes & 15, code.codes >> 4], -1).view(tiles, k // 4, 4, TILE)
    low, high = (per_output[:, :, part].transpose(2, 3) for part in (slice(0, 2), slice(2, 4)))
    packed = (low | (high << 4)).reshape(tiles, k // 4, 2 * TILE).contiguous()
    return BlockCode(packed, code.scales, code.mins, 4, code.out_features, code.in_features, "quads")


def cpu_supports() -> bool:
    """AVX2 with FMA and F16C: what ``kernels/blocks.c`` needs."""
    return kernel.cpu_flags() >= NEEDS


def _declare(loaded: ctypes.CDLL) -> str | None:
    pointer, size = ctypes.c_void_p, ctypes.c_int64
    loaded.gemm_blocks_f32.argtypes = [pointer] * 6 + [size] * 5
    loaded.gemm_blocks_f32.restype = size
    loaded.blocks_tile_cols.restype = size
    loaded.blocks_run.restype = size
    if (loaded.blocks_tile_cols(), loaded.blocks_run()) != (TILE, RUN):
        return f"{SOURCE.name} does not match this module's layout"
    return None


@functools.cache
def library() -> ctypes.CDLL | None:
    """The built library, or None (logged once) where it cannot run or be built."""
    return kernel.load("block-code kernel", SOURCE, cpu_supports(), "AVX2, FMA and F16C", _declare)


BlockGemm = Callable[[torch.Tensor, BlockCode, "torch.Tensor | None"], torch.Tensor]


def gemm() -> BlockGemm | None:
    """``gemm(x [M, K] fp32, code: BlockCode, bias [N] fp32 | None) -> y [M, N] fp32``, any M; a row's
    bits do not depend on M or on the other rows. None where the kernel is off."""
    loaded = library()
    if loaded is None:
        return None
    function = loaded.gemm_blocks_f32

    def call(x: torch.Tensor, code: BlockCode, bias: torch.Tensor | None) -> torch.Tensor:
        rows, width = x.shape
        if x.dtype != torch.float32 or width != code.in_features:
            raise ValueError(f"block gemm takes fp32 rows of width {code.in_features}")
        if bias is not None and (bias.dtype != torch.float32 or bias.shape != (code.out_features,)):
            raise ValueError(f"block gemm takes an fp32 bias of {code.out_features}")
        x = x.contiguous()
        out = torch.empty(rows, code.out_features, dtype=torch.float32)
        if rows:
            status = function(
                x.data_ptr(),
                code.codes.data_ptr(),
                code.scales.data_ptr(),
                None if code.mins is None else code.mins.data_ptr(),
                None if bias is None else bias.contiguous().data_ptr(),
                out.data_ptr(),
                rows,
                code.out_features,
                width,
                code.bits,
                kernel.team_threads(),
            )
            if status:
                raise MemoryError("block gemm could not allocate its scratch")
        return out

    return call


def bf16_gemm() -> BlockGemm | None:
    """``gemm(x [M, K] bf16, code: BlockCode (4-bit, ``quads``), bias [N] bf16 | None, wide=False) ->
    y [M, N]``, bf16, or fp32 with ``wide``; any M, and a row's bits do not depend on M or on the other
    rows. Where the bf16 kernels run (AVX-512-BF16; ``kernel.library``), else None."""
    loaded = kernel.library()
    if loaded is None:
        return None
    function = loaded.gemm_codes_bf16

    def call(x: torch.Tensor, code: BlockCode, bias: torch.Tensor | None, wide: bool = False) -> torch.Tensor:
        if code.layout != "quads":
            raise ValueError("bf16 block gemm takes 4-bit codes laid out by quads()")
        x, out = kernel.bf16_operands("bf16 block gemm", x, code.in_features, code.out_features, bias, wide)
        rows, width = x.shape
        if rows:
            sums = torch.empty(rows * (width // RUN), dtype=torch.float32)
            function(
                x.data_ptr(),
                code.codes.data_ptr(),
                code.scales.data_ptr(),
                code.mins.data_ptr(),
                None if bias is None else bias.contiguous().data_ptr(),
                out.data_ptr(),
                sums.data_ptr(),
                rows,
                code.out_features,
                width,
                kernel.team_threads(),
                int(wide),
            )
        return out

    return call
