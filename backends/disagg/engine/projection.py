"""A linear projection, ``y = x W^T + b``, through the fastest path this CPU and dtype have.

- **bf16 on a CPU with AVX-512-BF16** (``native``, ``EngineConfig.native_kernels``): the engine's own
  kernel (``disagg.engine.kernel.gemm``) on a weight laid out for it at load. It reads the weight
  once per call at any number of rows and beat oneDNN's prepacked kernel at every batch measured
  (``perf/projection_bench.py``, SmolLM2's projections on one core: 1.84x at 1 row, 1.15x at 32,
  1.04x at 300). Its sums run in an order
  fixed by the input index alone, so a row gets the same bits whatever it is batched with. On a CPU
  with AMX, tiles are far faster for prompt rows, which are compute-bound: there the projection keeps
  a second copy of the weight laid out as AMX tiles (twice the weight memory; ``split``) and sends
  the rows the caller marks as prompt rows to the engine's tile kernel (``disagg.engine.amxkernel``,
  on the kernels' thread team: every core of the pool; **not verified on AMX hardware**), or, where
  that kernel is off, to oneDNN's packed weight (on torch's one thread inside a step); decode rows,
  bound by the weight's reading, stay on the kernel.
- **bf16 on block-coded weights** (``native``, AVX-512-BF16, and ``source``: the fp32 values the bf16
  weight was rounded from): where those are exactly Q4_1 codes (``disagg.engine.blockcode``), decode
  rows go to the bf16 block-code kernel (``blockcode.bf16_gemm``), which reads 4.5 bits a weight
  instead of 16 and computes with the codes' exact values; prompt rows (compute-bound) stay on the
  bf16 kernel (or oneDNN on AMX) and the bf16 weight. SmolLM2's projections on one core
  (``perf/projection_bench.py``, its Q8_0 head on the bf16 kernel in both): 6.3 ms against 11.2 ms
  on the bf16 weights at 1 row, 13.4 / 14.7 at 8, 1.05x the time at 32 (the kernel's arithmetic).
- **bf16 elsewhere** (``pack``): the weight reordered once, at load, into oneDNN's blocked layout and
  called through ``torch.ops.mkldnn._linear_pointwise`` (the op inductor emits for frozen bf16
  linears): the same bits as ``F.linear``, which reorders on every call, and faster.
- **fp32 on block-coded weights** (``native``, a CPU with AVX2, FMA and F16C): where the weight is
  exactly a Q4_1 or Q8_0 code (a checkpoint converted from a quantized GGUF file, the default SmolLM2
  among them; ``disagg.engine.blockcode``), decode rows go to the block-code kernel, which reads the
  codes (4.5 or 8.5 bits a weight) instead of the fp32 values, and prompt rows (compute-bound) to
  the fp32 weight kept beside them for the engine's fp32 kernel (below). A projection that only sees
  a few rows (the output head, ``split`` off) keeps the codes alone.
- **fp32 otherwise** (``native``, a CPU with AVX2 and FMA): every row through the engine's fp32
  kernel (``disagg.engine.fp32kernel.gemm``) on a weight tiled for it at load. Every output is one
  sum in input order, so a row's bits do not depend on its batch. On the tiny model's projections on
  one core here (``perf/projection_bench.py``) it was 1.4x MKL's ``F.linear`` at 1 row (it streams
  the weight at the read bandwidth) and 1.25x oneDNN's prepacked fp32 kernel at 300.
- **fp32 and the rest**: ``F.linear``. fp32 with ``native`` off is the token-exact reference.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from disagg.engine import amxkernel, blockcode, fp32kernel, kernel
from disagg.engine.device import onednn_bf16


def packing_available(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether weights of ``dtype`` on ``device`` can be prepacked here (bf16 on a CPU whose oneDNN
    runs bf16: AVX-512-BF16 or AMX)."""
    return device.type == "cpu" and dtype == torch.bfloat16 and onednn_bf16()


class Projection:
    """``y = x W^T + b`` for 2-D ``x`` [N, in] -> [N, out]."""

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        pack: bool = False,
        native: bool = False,
        wide: bool = False,
        split: bool = True,
        source: torch.Tensor | None = None,
        amx: bool | None = None,
        amx_kernel: kernel.Gemm | None = None,
    ) -> None:
        """``wide``: the kernel's outputs in fp32, unrounded (an output head's logits). ``split``: keep
        a second path for prompt rows where one is faster for them (off for a projection that only
        ever sees a few rows, such as the output head: one row per prompt). ``source``: the fp32
        values a bf16 ``weight`` was rounded from (the checkpoint's), where block codes may be found.
        ``amx``: whether to route prompt rows as on a CPU with AMX (None: whether this CPU has it,
        ``kernel.cpu_has_amx``); ``amx_kernel``: the tile kernel they go to there (None:
        ``amxkernel.gemm()``, where this CPU runs it; oneDNN where it does not)."""
        self.bias = bias
        self.wide = wide
        on_cpu = weight.device.type == "cpu"
        on_cpu_bf16 = on_cpu and weight.dtype == torch.bfloat16
        on_cpu_fp32 = on_cpu and weight.dtype == torch.float32
        gemm = kernel.gemm() if native and on_cpu_bf16 and weight.shape[1] % 2 == 0 else None
        # block codes: decode rows read them (fp32 kernel on AVX2; bf16 kernel on AVX-512-BF16, 4-bit)
        self.blocks: blockcode.BlockCode | None = None
        if native and on_cpu_fp32 and blockcode.gemm() is not None:
            self.blocks = blockcode.recover(weight)
        elif gemm is not None and source is not None and blockcode.bf16_gemm() is not None:
            found = blockcode.recover(source)
            self.blocks = blockcode.quads(found) if found is not None and found.bits == 4 else None
        amx_prompts = split and (kernel.cpu_has_amx() if amx is None else amx)
        tile_gemm = None
        if amx_prompts and gemm is not None and amxkernel.covers(*weight.shape):
            tile_gemm = amx_kernel if amx_kernel is not None else amxkernel.gemm()
        self.amx_tiles = amxkernel.pack(weight) if tile_gemm is not None else None
        # the bf16 kernel's layout: every row, or the prompt rows beside codes (without AMX)
        keep_native = gemm is not None and (self.blocks is None or (split and not amx_prompts))
        self.native = kernel.pack(weight) if keep_native else None
        # fp32 rows through the engine's fp32 kernel: every row without codes, prompt rows beside them
        fp32_gemm = fp32kernel.gemm() if native and on_cpu_fp32 and (self.blocks is None or split) else None
        self.tiles = fp32kernel.pack(weight) if fp32_gemm is not None else None
        # oneDNN's weight: the only path without a kernel; beside it for prompt rows on AMX without
        # the tile kernel
        codes_only = self.blocks is not None and not split
        onednn_prompts = amx_prompts and tile_gemm is None
        onednn = (gemm is None or onednn_prompts) and self.tiles is None and not codes_only
        self.packed = onednn and pack and packing_available(weight.dtype, weight.device)
        if not onednn:
            self.weight = None
        elif self.packed:  # batch-size hint 1: as fast as others at 8 to 300 rows, measured
            self.weight = torch.ops.mkldnn._reorder_linear_weight(weight, 1)
        else:
            self.weight = weight
        # decode rows, and prompt rows where they take another path (None: the decode rows' path)
        plain = self._plain(gemm, fp32_gemm)
        tiled = None
        if tile_gemm is not None:
            tiles = self.amx_tiles

            def tiled(x: torch.Tensor) -> torch.Tensor:
                return tile_gemm(x, tiles, self.bias, self.wide)

        self._prompt: Rows | None = None
        if self.blocks is not None:  # the codes; prompt rows on AMX tiles or the weight, if kept
            self._decode, self._prompt = self._coded(), tiled or plain
        elif tiled is not None:  # AMX: prompt rows on the tile kernel
            self._decode, self._prompt = plain, tiled
        elif self.native is not None and self.weight is not None:  # AMX: prompt rows to oneDNN
            self._decode, self._prompt = plain, self._onednn
        else:
            self._decode = plain

    def _plain(self, gemm: kernel.Gemm | None, fp32_gemm: fp32kernel.Gemm | None) -> Rows | None:
        """Rows on the weight itself: the bf16 kernel, the fp32 kernel, oneDNN or ``F.linear``."""
        if self.native is not None:
            return lambda x: gemm(x, self.native, self.bias, self.wide)
        if self.tiles is not None:
            return lambda x: fp32_gemm(x, self.tiles, self.bias)
        if self.weight is not None:
            return self._onednn
        return None

    def _coded(self) -> Rows:
        blocks = self.blocks
        if blocks.layout == "quads":
            code_gemm = blockcode.bf16_gemm()
            return lambda x: code_gemm(x, blocks, self.bias, self.wide)
        block_gemm = blockcode.gemm()
        return lambda x: block_gemm(x, blocks, self.bias)

    def _onednn(self, x: torch.Tensor) -> torch.Tensor:
        """oneDNN's prepacked kernel (which rounds its outputs whatever ``wide`` says), or ``F.linear``."""
        if self.packed:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)

    def __call__(self, x: torch.Tensor, native_rows: int | None = None) -> torch.Tensor:
        """``native_rows``: how many leading rows are decode rows, the rest being prompt rows
        (None: all decode rows). Only a projection holding two paths (AMX, block codes) tells them
        apart."""
        if self._prompt is None or native_rows is None or native_rows >= x.shape[0]:
            return self._decode(x)
        if native_rows == 0:
            return self._prompt(x)
        decode = self._decode(x[:native_rows])
        return torch.cat([decode, self._prompt(x[native_rows:]).to(decode.dtype)])

    @property
    def nbytes(self) -> int:
        """Bytes of weight held (every layout kept)."""
        held = [t for t in (self.weight, None if self.native is None else self.native.tiles) if t is not None]
        codes = 0 if self.blocks is None else self.blocks.nbytes
        tiles = sum(0 if t is None else t.nbytes for t in (self.tiles, self.amx_tiles))
        return codes + tiles + sum(t.numel() * t.element_size() for t in held)


Rows = Callable[[torch.Tensor], torch.Tensor]
