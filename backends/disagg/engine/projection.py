"""A linear projection, ``y = x W^T + b``, through the fastest path this CPU and dtype have.

- **bf16 on a CPU with AVX-512-BF16** (``native``, ``EngineConfig.native_kernels``): the engine's own
  kernel (``disagg.engine.kernel.gemm``) on a weight laid out for it at load. It reads the weight
  once per call at any number of rows and beat oneDNN's prepacked kernel at every batch measured
  (``perf/projection_bench.py``, SmolLM2's projections on one core: 1.84x at 1 row, 1.15x at 32,
  1.04x at 300). Its sums run in an order
  fixed by the input index alone, so a row gets the same bits whatever it is batched with. On a CPU
  with AMX, oneDNN's AMX kernels are far faster for prompt rows, which are compute-bound: there the
  projection keeps oneDNN's packed weight as well (twice the weight memory; ``split``) and sends the
  rows the caller marks as prompt rows to it; decode rows, bound by the weight's reading, stay on
  the kernel.
- **bf16 elsewhere** (``pack``): the weight reordered once, at load, into oneDNN's blocked layout and
  called through ``torch.ops.mkldnn._linear_pointwise`` (the op inductor emits for frozen bf16
  linears): the same bits as ``F.linear``, which reorders on every call, and faster.
- **fp32 on block-coded weights** (``native``, a CPU with AVX2, FMA and F16C): where the weight is
  exactly a Q4_1 or Q8_0 code (a checkpoint converted from a quantized GGUF file, the default SmolLM2
  among them; ``disagg.engine.blockcode``), decode rows go to the block-code kernel, which reads the
  codes (4.5 or 8.5 bits a weight) instead of the fp32 values, and prompt rows (compute-bound) to
  the fp32 weight kept beside them, prepacked for oneDNN (``pack``; 1.15-1.4x MKL's ``F.linear`` on
  SmolLM2's prompt projections at 300 rows on one core here; a row's bits did not depend on its
  batch in the shapes checked). A projection that only sees a few rows (the
  output head, ``split`` off) keeps the codes alone.
- **fp32 and the rest**: ``F.linear``. fp32 is the token-exact reference; MKL's packed fp32 GEMM was
  slower at batch 8 here.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from disagg.engine import blockcode, kernel
from disagg.engine.device import onednn_bf16

FP32_PACK_HINT = 256  # oneDNN's batch-size hint for fp32 prompt rows: 64 to 512 measured alike, 1 slower


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
    ) -> None:
        """``wide``: the kernel's outputs in fp32, unrounded (an output head's logits). ``split``: on
        AMX, keep oneDNN's layout for prompt rows (off for a projection that only ever sees a few
        rows, such as the output head: one row per prompt)."""
        self.bias = bias
        self.wide = wide
        on_cpu_bf16 = weight.device.type == "cpu" and weight.dtype == torch.bfloat16
        gemm = kernel.gemm() if native and on_cpu_bf16 and weight.shape[1] % 2 == 0 else None
        self._gemm = gemm
        self.native = kernel.pack(weight) if gemm is not None else None
        on_cpu_fp32 = weight.device.type == "cpu" and weight.dtype == torch.float32
        block_gemm = blockcode.gemm() if native and on_cpu_fp32 else None
        self.blocks = blockcode.recover(weight) if block_gemm is not None else None
        self._block_gemm = block_gemm if self.blocks is not None else None
        # oneDNN's weight: the only path without a kernel; beside it for prompt rows on AMX, and for
        # prompt rows beside the block codes
        onednn = (gemm is None or (split and kernel.cpu_has_amx())) and (self.blocks is None or split)
        # prompt rows beside block codes: oneDNN's prepacked fp32 kernel, which outran MKL's F.linear on
        # SmolLM2's prompt projections (the plain fp32 path stays on F.linear, the token-exact reference)
        coded_prompts = self.blocks is not None and torch.backends.mkldnn.is_available()
        self.packed = onednn and pack and (coded_prompts or packing_available(weight.dtype, weight.device))
        if not onednn:
            self.weight = None
        elif self.packed:  # batch-size hints measured: bf16 1 (as fast as others at 8 to 300), fp32 256
            hint = FP32_PACK_HINT if weight.dtype == torch.float32 else 1
            self.weight = torch.ops.mkldnn._reorder_linear_weight(weight, hint)
        else:
            self.weight = weight

    def __call__(self, x: torch.Tensor, native_rows: int | None = None) -> torch.Tensor:
        """``native_rows``: how many leading rows are decode rows, the rest being prompt rows
        (None: all decode rows). Only a projection holding both paths (AMX) tells them apart."""
        if self.native is None and self.blocks is None:
            return self._onednn(x)
        if self.weight is None or native_rows is None or native_rows >= x.shape[0]:
            return self._kernel(x)
        if native_rows == 0:
            return self._onednn(x)
        decode = self._kernel(x[:native_rows])
        return torch.cat([decode, self._onednn(x[native_rows:]).to(decode.dtype)])

    def _kernel(self, x: torch.Tensor) -> torch.Tensor:
        if self.blocks is not None:
            return self._block_gemm(x, self.blocks, self.bias)
        return self._gemm(x, self.native, self.bias, self.wide)

    def _onednn(self, x: torch.Tensor) -> torch.Tensor:
        """In the weight's dtype: oneDNN rounds its outputs whatever ``wide`` says."""
        if self.packed:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)

    @property
    def nbytes(self) -> int:
        """Bytes of weight held (both layouts where prompt rows go to oneDNN)."""
        held = [t for t in (self.weight, None if self.native is None else self.native.tiles) if t is not None]
        codes = 0 if self.blocks is None else self.blocks.nbytes
        return codes + sum(t.numel() * t.element_size() for t in held)
