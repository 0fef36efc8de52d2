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
- **fp32 and the rest**: ``F.linear``. fp32 is the token-exact reference; MKL's packed fp32 GEMM was
  slower at batch 8 here.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from disagg.engine import kernel
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
        # oneDNN's weight: the only path without the kernel; beside it for prompt rows on AMX
        onednn = gemm is None or (split and kernel.cpu_has_amx())
        self.packed = onednn and pack and packing_available(weight.dtype, weight.device)
        if not onednn:
            self.weight = None
        elif self.packed:  # batch-size hint 1: measured as fast as other hints at batch 8 to 300
            self.weight = torch.ops.mkldnn._reorder_linear_weight(weight, 1)
        else:
            self.weight = weight

    def __call__(self, x: torch.Tensor, native_rows: int | None = None) -> torch.Tensor:
        """``native_rows``: how many leading rows are decode rows, the rest being prompt rows
        (None: all decode rows). Only a projection holding both paths (AMX) tells them apart."""
        if self.native is None:
            return self._onednn(x)
        if self.weight is None or native_rows is None or native_rows >= x.shape[0]:
            return self._gemm(x, self.native, self.bias, self.wide)
        if native_rows == 0:
            return self._onednn(x)
        decode = self._gemm(x[:native_rows], self.native, self.bias, self.wide)
        return torch.cat([decode, self._onednn(x[native_rows:]).to(decode.dtype)])

    def _onednn(self, x: torch.Tensor) -> torch.Tensor:
        """In the weight's dtype: oneDNN rounds its outputs whatever ``wide`` says."""
        if self.packed:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)

    @property
    def nbytes(self) -> int:
        """Bytes of weight held (both layouts where prompt rows go to oneDNN)."""
        held = [t for t in (self.weight, None if self.native is None else self.native.tiles) if t is not None]
        return sum(t.numel() * t.element_size() for t in held)
