"""A model that computes nothing: the engine's stand-in for ``Transformer`` when ``null_compute`` is set.

It measures what serving costs beside the model: with it, a pool's step is the engine's own
bookkeeping (blocks, sampling, the hand-off) and no forward pass, so a stream's time per output token
through an entry point is the relay's floor (Triton's frontend, the orchestrator, the text steps, the
pool loop), which ``perf.relay_floor`` and the GPU served check measure. Each row's next token is the
token it was given (a decode row's last token, a prompt chunk's last), so a stream repeats the last
token of its prompt: text the detokenizer and the stop checks treat as any other. Nothing is written
into the KV cache; a hand-off still moves the blocks. For benchmarks only: its answers are not the
model's.
"""

from __future__ import annotations

import torch

from disagg.engine.transformer import DecodeRows, PromptChunk


class NullModel:
    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = device

    def step(
        self, decode: DecodeRows | None, chunks: list[PromptChunk], cache: torch.Tensor
    ) -> tuple[torch.Tensor | None, list[torch.Tensor | None]]:
        """``Transformer.step``'s contract: the decode rows' logits [B, V] (None without a batch) and,
        per chunk, its last token's logits [V] (None unless asked), each one-hot on the row's own token."""
        logits = None if decode is None else self._one_hot(decode.tokens)
        last = [self._one_hot(c.tokens[-1:])[0] if c.logits else None for c in chunks]
        return logits, last

    def _one_hot(self, tokens: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(tokens.shape[0], self.vocab_size, dtype=torch.float32, device=self.device)
        return out.scatter_(1, tokens.to(self.device, torch.long)[:, None], 1.0)
