"""Requests, sequences and the portable state that travels with a KV hand-off."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from disagg.engine.errors import InvalidRequest
from disagg.engine.params import SamplingParams

FINISH_STOP = "stop"  # an end or stop token was produced
FINISH_LENGTH = "length"  # max_tokens reached


@dataclass(frozen=True)
class Request:
    """A tokenized prompt and how to continue it."""

    prompt_token_ids: tuple[int, ...]
    params: SamplingParams = field(default_factory=SamplingParams)
    generated_token_ids: tuple[int, ...] = ()
    """Tokens already generated for this request elsewhere: a stream resumed after the pool running it
    failed. They are prefilled after the prompt and count as generated here: toward ``max_tokens`` and
    ``min_length``, and in the sampling draws (seeded from (seed, n)), so the continuation is the one
    the first pool would have produced, up to rounding of the re-computed KV."""

    @classmethod
    def resuming(cls, state: SequenceState) -> Request:
        """The request that continues ``state`` by re-prefilling it (no KV moves)."""
        return cls(state.prompt_token_ids, state.params, state.generated_token_ids)

    @property
    def context_token_ids(self) -> tuple[int, ...]:
        """What a prefill of this request computes: the prompt, then the tokens already generated."""
        return self.prompt_token_ids + self.generated_token_ids

    def validate(self, vocab_size: int, max_tokens_cap: int, max_context: int) -> None:
        """Raise InvalidRequest naming the first problem, for a model with these limits."""
        prompt = self.prompt_token_ids
        if len(prompt) == 0:
            raise InvalidRequest("prompt is empty (0 tokens)")
        if any(not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab_size for t in prompt):
            raise InvalidRequest(f"prompt token ids must be integers in [0, {vocab_size})")
        self.params.validate(vocab_size, max_tokens_cap)
        generated = self.generated_token_ids
        if any(not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab_size for t in generated):
            raise InvalidRequest(f"generated token ids must be integers in [0, {vocab_size})")
        if len(generated) >= self.params.max_tokens:
            raise InvalidRequest("a resumed request must have tokens left to generate (below max_tokens)")
        if len(prompt) + self.params.max_tokens > max_context:
            raise InvalidRequest(
                f"prompt ({len(prompt)} tokens) + max_tokens ({self.params.max_tokens}) exceeds the "
                f"model's context of {max_context} tokens"
            )


@dataclass(frozen=True)
class StepOutput:
    """One new token of one sequence."""

    seq_id: int
    token_id: int
    finished: bool
    finish_reason: str | None = None


@dataclass
class Sequence:
    """A request inside an engine: its tokens so far and the blocks holding its KV."""

    seq_id: int
    prompt: tuple[int, ...]
    params: SamplingParams
    blocks: list[int]
    generated: list[int] = field(default_factory=list)
    num_cached: int = 0  # positions whose KV is in the blocks
    decoding: bool = True  # part of decode_step()'s batch
    joins_decode: bool = True  # joins that batch once its prompt is prefilled (False: held for export)
    resumed: int = 0  # generated tokens it started with (Request.generated_token_ids), prefilled too
    # prefix keys of its context's full blocks (``disagg.engine.prefix``; empty: no prefix cache), and
    # how many of its first blocks are published or were taken from the cache
    prefix_keys: list[bytes] = field(default_factory=list)
    published: int = 0

    @property
    def context(self) -> tuple[int, ...]:
        """The tokens its prefill computes: the prompt, then the generated tokens it was resumed with."""
        return self.prompt + tuple(self.generated[: self.resumed]) if self.resumed else self.prompt

    @property
    def last_token(self) -> int:
        return self.generated[-1] if self.generated else self.prompt[-1]

    def state(self) -> SequenceState:
        return SequenceState(self.prompt, tuple(self.generated), self.params)


@dataclass(frozen=True)
class SequenceState:
    """What another engine needs, beside the KV blocks, to continue a sequence exactly."""

    prompt_token_ids: tuple[int, ...]
    generated_token_ids: tuple[int, ...]
    params: SamplingParams

    def to_dict(self) -> dict[str, Any]:
        return {
            "prompt_token_ids": list(self.prompt_token_ids),
            "generated_token_ids": list(self.generated_token_ids),
            "params": {**asdict(self.params), "stop_token_ids": list(self.params.stop_token_ids)},
        }

    @classmethod
    def from_dict(cls, data: Any) -> SequenceState:
        """Parse untrusted data; unknown or missing keys are errors (values are checked on import)."""
        if not isinstance(data, dict) or set(data) != {"prompt_token_ids", "generated_token_ids", "params"}:
            raise InvalidRequest("sequence state must have exactly prompt/generated token ids and params")
        params = data["params"]
        known = set(SamplingParams.__dataclass_fields__)
        if not isinstance(params, dict) or not set(params) <= known:
            raise InvalidRequest("sequence state has unknown sampling parameters")
        for key in ("prompt_token_ids", "generated_token_ids"):
            if not isinstance(data[key], list):
                raise InvalidRequest(f"sequence state {key} must be a list")
        stop = params.get("stop_token_ids", ())
        if not isinstance(stop, (list, tuple)):
            raise InvalidRequest("stop_token_ids must be a list")
        return cls(
            tuple(data["prompt_token_ids"]),
            tuple(data["generated_token_ids"]),
            SamplingParams(**{**params, "stop_token_ids": tuple(stop)}),
        )
