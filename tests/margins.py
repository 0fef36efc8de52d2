"""Recording how sure a greedy engine was of each token (imported by engine tests; not a conftest)."""

from __future__ import annotations

import torch

TIE = 1e-3
"""Top-two logits closer than this: a choice that float32 rounding (another summation order, a KV
computed by another path) may flip."""


def record_margins(engine) -> list[float]:
    """Record, for every token ``engine`` samples from now on, its top-two logit gap."""
    seen: list[float] = []
    sample = engine._append

    def recording(seq, logits):
        top = torch.topk(logits.float(), 2).values
        seen.append(float(top[0] - top[1]))
        return sample(seq, logits)

    engine._append = recording
    return seen
