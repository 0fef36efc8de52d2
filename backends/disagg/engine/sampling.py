"""The token sampler.

Randomness is reproducible per request and independent of batching: the generator for step ``n`` of a
request is seeded from (seed, n), so a sequence sampled alone, in a batch, or continued on another
engine after a KV hand-off draws the same random numbers.
"""

from __future__ import annotations

import math

import torch

from disagg.engine.params import MAX_SEED, SamplingParams

_MIX = 0x9E3779B97F4A7C15  # golden-ratio increment (splitmix64) to decorrelate per-step seeds


def step_generator(seed: int, step: int) -> torch.Generator:
    """The generator for draw number ``step`` of a request with ``seed``."""
    mixed = (seed * _MIX + (step + 1) * 0xBF58476D1CE4E5B9) & MAX_SEED
    mixed ^= mixed >> 31
    return torch.Generator().manual_seed(mixed & ((1 << 63) - 1))


def sample(logits: torch.Tensor, params: SamplingParams, step: int) -> int:
    """Pick one token from float32 logits [vocab] (already masked for min_length)."""
    if params.greedy:
        return int(torch.argmax(logits))
    scores = logits / params.temperature
    if params.top_k:
        kth = torch.topk(scores, params.top_k).values[-1]
        scores = scores.masked_fill(scores < kth, -math.inf)
    if params.top_p < 1.0:
        sorted_scores, order = torch.sort(scores, descending=True)
        cumulative = sorted_scores.softmax(-1).cumsum(-1)
        # drop a token when the tokens before it already reach top_p; the first always stays
        drop = (cumulative - sorted_scores.softmax(-1)) >= params.top_p
        scores = scores.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), -math.inf)
    probs = scores.softmax(-1)
    return int(torch.multinomial(probs, 1, generator=step_generator(params.seed, step)))
