"""The token sampler: the Gumbel-max trick on counter-based noise, with no random generator.

A token is drawn as ``argmax(scores / temperature + g)`` over the tokens top-k and top-p keep, where
``g`` is Gumbel noise, ``-log(-log(u))``, and ``u`` a uniform number made by hashing (the row's key,
the token id). The key is a hash of the request's seed and the draw's step (``row_key``). Nothing
holds state between draws, so:

- a draw depends only on (seed, step, logits): alone, in a batch of any size, on another engine
  after a KV hand-off, it is the same token;
- a batch of rows is drawn by a handful of tensor operations of fixed shapes, with no host sync and
  no generator, so the draw can run inside a captured CUDA graph (``disagg.engine.replay``) and only
  the sampled ids come back to the host;
- the host's one-row path (``sample``) and the batched one (``draw``) share the filters, the keys and
  the noise, so they pick the same token.

The argmax of the scores plus Gumbel noise is an exact draw from ``softmax(scores)``: the same
distribution ``torch.multinomial`` samples, from another stream of random numbers.

The hash is 32-bit (two rounds of a multiply-xorshift mixer), computed in int64 with every product
below 2**63, so it gives the same bits on every CPU and GPU; ``u`` keeps 23 bits, so ``log(u)`` and
``log(-log(u))`` are finite in float32.
"""

from __future__ import annotations

import math
from typing import TypeVar

import torch

from disagg.engine.params import SamplingParams

MASK32 = 0xFFFFFFFF
_MULTIPLIER = 0x045D9F3B  # below 2**27: a product with a 32-bit value stays below 2**59
_GOLDEN = 0x9E3779B9  # 2**32 / the golden ratio: separates the two hashing rounds of a token
_UNIT = 2.0**-23

Bits = TypeVar("Bits", int, torch.Tensor)


def mix32(x: Bits) -> Bits:
    """The 32-bit mixer, on a Python int or an int64 tensor of values below 2**32: the same bits
    either way (every product stays below 2**59)."""
    x = (((x >> 16) ^ x) * _MULTIPLIER) & MASK32
    x = (((x >> 16) ^ x) * _MULTIPLIER) & MASK32
    return (x >> 16) ^ x


def row_key(seed: int, step: int) -> int:
    """The 32-bit key of draw number ``step`` of a request with ``seed`` (a 64-bit seed)."""
    key = mix32(step & MASK32)
    key = mix32(key ^ (seed >> 32))
    return mix32((key ^ seed) & MASK32)


def noise(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """Gumbel noise [rows, vocab] float32 for int64 ``keys`` [rows] (each below 2**32), on their
    device: element (r, t) depends on keys[r] and t alone."""
    tokens = torch.arange(vocab, dtype=torch.int64, device=keys.device)
    bits = mix32((mix32(keys[:, None] ^ tokens[None, :]) + _GOLDEN) & MASK32)
    uniform = ((bits >> 9).to(torch.float32) + 0.5) * _UNIT  # in (0, 1), 23 bits
    return -torch.log(-torch.log(uniform))


def filtered(scores: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """``scores`` [rows, vocab] (logits over temperature) with -inf where a row's top-k or top-p
    drops a token. ``top_k`` [rows] int64, 0: off (ties with the k-th score stay); ``top_p`` [rows]
    float32, 1: off (a token is dropped when the tokens ranked above it already hold top_p of the
    probability; the first always stays; among tied scores the lower token id ranks first). Fixed
    shapes, no host sync."""
    ordered, order = torch.sort(scores, dim=-1, descending=True, stable=True)  # ties: the lower id first
    vocab = scores.shape[-1]
    kth = ordered.gather(-1, (top_k.clamp(1, vocab) - 1)[:, None])
    kth = torch.where(top_k[:, None] > 0, kth, torch.full_like(kth, -math.inf))
    ordered = ordered.masked_fill(ordered < kth, -math.inf)
    probs = ordered.softmax(-1)
    before = probs.cumsum(-1) - probs
    drop = (before >= top_p[:, None]) & (top_p[:, None] < 1.0)
    drop = drop | (ordered == -math.inf)
    return scores.masked_fill(torch.zeros_like(drop).scatter(-1, order, drop), -math.inf)


def draw(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    keys: torch.Tensor,
) -> torch.Tensor:
    """Token ids [rows] int64 for float32 ``logits`` [rows, vocab]: a greedy row (temperature 0)
    takes its argmax, any other its Gumbel-max draw with ``keys`` (``row_key``). Every input is a
    tensor on the logits' device; fixed shapes, no host sync, so it can be captured in a graph."""
    greedy = temperature <= 0
    scale = torch.where(greedy, torch.ones_like(temperature), temperature)
    scores = filtered(logits / scale[:, None], top_k, top_p)
    drawn = torch.argmax(scores + noise(keys, logits.shape[-1]), dim=-1)
    return torch.where(greedy, torch.argmax(logits, dim=-1), drawn)


def sample(logits: torch.Tensor, params: SamplingParams, step: int) -> int:
    """One token from float32 ``logits`` [vocab] (already masked for min_length): what ``draw`` picks
    for this row, skipping the filters a request leaves off."""
    if params.greedy:
        return int(torch.argmax(logits))
    temperature = torch.tensor([params.temperature], dtype=torch.float32, device=logits.device)
    scores = logits[None, :] / temperature[:, None]  # as ``draw`` divides: a tensor, not a Python float
    if params.top_k or params.top_p < 1.0:
        top_k = torch.tensor([params.top_k], dtype=torch.int64, device=logits.device)
        top_p = torch.tensor([params.top_p], dtype=torch.float32, device=logits.device)
        scores = filtered(scores, top_k, top_p)
    keys = torch.tensor([row_key(params.seed, step)], dtype=torch.int64, device=logits.device)
    return int(torch.argmax(scores[0] + noise(keys, logits.shape[-1])[0]))
