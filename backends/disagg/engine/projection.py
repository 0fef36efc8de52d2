"""A linear projection whose weight may be prepacked for oneDNN.

``F.linear`` on a bfloat16 CPU tensor reorders the weight into oneDNN's blocked layout on every call.
Reordering once, at load, and calling oneDNN's packed kernel (``torch.ops.mkldnn._linear_pointwise``,
the op inductor emits for frozen bf16 linears) gives the same bits, measured by
``perf/engine_bench.py`` and held by ``tests/unit/engine/test_projection.py``, and is faster: 1.9x
on SmolLM2's decode-step linears at batch 1 on one AVX-512-BF16 core. fp32 keeps ``F.linear``: MKL's
packed fp32 GEMM was slower at batch 8 here, and fp32 is the token-exact reference. A packed weight
replaces the plain one, except where the caller keeps the plain tensor itself (a tied output head
shares its weight with the embedding table).

With ``small_batch`` (and one compute thread; off by default, ``EngineConfig.small_batch_kernel``),
calls of up to ``disagg.engine.kernel.MAX_ROWS`` rows (a decode step at batch 1 or 2) go to the
engine's own AVX-512-BF16 kernel instead, which reads the plain weight at close to the core's
bandwidth: about 2x oneDNN there. That keeps the plain weight beside the packed one, so bf16
projection weights take twice their memory (SmolLM2: 270 MB more). Its sums run in another order
than oneDNN's, so its bits differ from ``F.linear`` in the last place; oneDNN gives a row the same
bits whatever the batch (checked at 1 and 8 rows), the kernel does not, so with it a sequence's
greedy text can change with what it is batched with. fp32 never uses it.
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
        small_batch: bool = False,
    ) -> None:
        self.bias = bias
        self.packed = pack and packing_available(weight.dtype, weight.device)
        use_kernel = small_batch and self.packed and torch.get_num_threads() == 1
        self._small = kernel.gemv() if use_kernel else None
        self.plain = weight.contiguous() if self._small is not None else None
        # batch-size hint 1: decode shapes; measured as fast as other hints at batch 8 to 300
        self.weight = torch.ops.mkldnn._reorder_linear_weight(weight, 1) if self.packed else weight

    @property
    def small_batch(self) -> bool:
        """Whether calls of few rows go to the engine's own kernel."""
        return self._small is not None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self._small is not None and x.shape[0] <= kernel.MAX_ROWS:
            return self._small(x, self.plain, self.bias)
        if self.packed:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)

    @property
    def nbytes(self) -> int:
        """Bytes of weight held (both layouts when the small-batch kernel keeps the plain one)."""
        held = [self.weight] if self.plain is None else [self.weight, self.plain]
        return sum(t.numel() * t.element_size() for t in held)
