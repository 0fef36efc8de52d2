"""A pool's settings sections that the deployment spec holds in the same words (torch-free, as
``disagg.kv.settings``: the repository builder and the spec read them)."""

from __future__ import annotations

from dataclasses import dataclass

MAX_TOKENS = 1 << 20


@dataclass(frozen=True)
class ConditionalPrefill:
    """Conditional disaggregation, a decode pool's side: it also serves whole the requests whose prompt
    has at most ``prefill_tokens`` tokens (the entry points send them while the prefill pool is
    backlogged), prefilling ``chunk_tokens`` of them per step between decode steps (0: off).

    config.pbtxt spells it ``conditional.prefill_tokens`` / ``conditional.chunk_tokens``, the spec
    ``pools.decode.conditional.*``; the entry points' side is ``disagg.serving.settings``."""

    prefill_tokens: int = 0
    chunk_tokens: int = 128

    def __post_init__(self) -> None:
        if not 0 <= self.prefill_tokens <= MAX_TOKENS:
            raise ValueError(f"prefill_tokens: must be in [0, {MAX_TOKENS}] (0: off)")
        if not 1 <= self.chunk_tokens <= MAX_TOKENS:
            raise ValueError(f"chunk_tokens: must be in [1, {MAX_TOKENS}]")

    @property
    def enabled(self) -> bool:
        return self.prefill_tokens > 0
