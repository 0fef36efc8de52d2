"""Sampling parameters of one request, validated; torch-free (the text path imports them)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from disagg.engine.errors import InvalidRequest

MAX_SEED = (1 << 64) - 1


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens for one request. ``temperature == 0`` means greedy."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    min_length: int = 0
    end_id: int | None = None
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)

    def validate(self, vocab_size: int, max_tokens_cap: int) -> None:
        """Raise InvalidRequest naming the first bad parameter."""
        _check_int("max_tokens", self.max_tokens, 1, max_tokens_cap)
        if not isinstance(self.temperature, (int, float)) or isinstance(self.temperature, bool):
            raise InvalidRequest("temperature must be a number")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise InvalidRequest(f"temperature must be finite and >= 0, got {self.temperature}")
        _check_int("top_k", self.top_k, 0, vocab_size)
        if not isinstance(self.top_p, (int, float)) or isinstance(self.top_p, bool):
            raise InvalidRequest("top_p must be a number")
        if not (math.isfinite(self.top_p) and 0 < self.top_p <= 1):
            raise InvalidRequest(f"top_p must be in (0, 1], got {self.top_p}")
        _check_int("seed", self.seed, 0, MAX_SEED)
        _check_int("min_length", self.min_length, 0, self.max_tokens)
        if self.end_id is not None:
            _check_int("end_id", self.end_id, 0, vocab_size - 1)
        for token in self.stop_token_ids:
            _check_int("stop token id", token, 0, vocab_size - 1)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1


def _check_int(name: str, value: object, lo: int, hi: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise InvalidRequest(f"{name} must be an integer")
    if not lo <= value <= hi:
        raise InvalidRequest(f"{name} must be in [{lo}, {hi}], got {value}")
