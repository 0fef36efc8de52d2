"""The projections' arithmetic in a prompt's prefill, and a reference rate for the same GEMMs.

A prefill of T prompt tokens multiplies every row by each layer's projections (q, k, v, o, gate, up
and down: 2 FLOPs a weight a row) and its last row only by the output head (a prompt asks for one
token's logits): ``prompt_flops`` counts 2 T (the layers' weight count) + 2 (the head's). Set against
a measured prefill time (attention, norms and the rest included), that is the prompt's projection
rate; ``reference_seconds`` times the same GEMMs through ``torch.nn.functional.linear`` on one
thread, the rate a plain PyTorch call reaches on these shapes here, to set it beside.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F

from perf.benchlib.timing import median_time


class ModelShape(Protocol):
    """What the counting reads of a model's configuration (``disagg.engine.checkpoint.ModelConfig``);
    ``head_dim`` None: ``hidden_size // num_heads``."""

    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int | None
    num_layers: int
    vocab_size: int


def layer_shapes(cfg: ModelShape) -> list[tuple[int, int]]:
    """(in, out) of one layer's projections: q, k, v, o, gate, up, down."""
    hidden, inter = cfg.hidden_size, cfg.intermediate_size
    head_dim = cfg.head_dim or hidden // cfg.num_heads
    q, kv = cfg.num_heads * head_dim, cfg.num_kv_heads * head_dim
    attention = [(hidden, q), (hidden, kv), (hidden, kv), (q, hidden)]
    return [*attention, (hidden, inter), (hidden, inter), (inter, hidden)]


def prompt_flops(cfg: ModelShape, tokens: int) -> int:
    """FLOPs of a ``tokens``-token prompt's projections: 2 x tokens x the layers' projection weights
    (every layer) + 2 x the output head's weights (its last row only)."""
    layers = cfg.num_layers * sum(width * out for width, out in layer_shapes(cfg))
    return 2 * tokens * layers + 2 * cfg.hidden_size * cfg.vocab_size


def reference_seconds(cfg: ModelShape, tokens: int, dtype: torch.dtype, reps: int) -> float:
    """Seconds for the GEMMs ``prompt_flops`` counts through ``F.linear`` in ``dtype`` on one thread
    (torch's thread count restored after): per repetition, one layer's projections on ``tokens`` rows
    (random weights, one set, called once per layer: ``num_layers`` times) and the head on one row;
    the median of ``reps`` after a warm-up."""
    generator = torch.Generator().manual_seed(0)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator).to(dtype)

    inputs = {width: randn(tokens, width) for width, _ in layer_shapes(cfg)}
    layer = [(inputs[width], randn(out, width)) for width, out in layer_shapes(cfg)]
    head_x, head_w = randn(1, cfg.hidden_size), randn(cfg.vocab_size, cfg.hidden_size)

    def prompt() -> None:
        for _ in range(cfg.num_layers):
            for x, weight in layer:
                F.linear(x, weight)
        F.linear(head_x, head_w)

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.inference_mode():
            return median_time(prompt, reps)
    finally:
        torch.set_num_threads(threads)
