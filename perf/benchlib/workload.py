"""Named synthetic workloads and unique, token-exact prompts.

Contract:

- A `Workload` draws (prompt length, output length) pairs from its two `LengthDist`s; every length is an
  exact token count. Prompt lengths count the tokens *the server sees*, i.e. the model tokenizer's
  encoding with its special tokens (the default model's tokenizer prepends `<s>`).
- `PromptFactory.make(length, nonce)` returns a prompt whose encoding is exactly `length` tokens. The text
  starts with the nonce, so two requests with different nonces differ from their first tokens on: no
  prefix cache (vLLM's automatic prefix caching, or ours later) can answer any part of them from memory.
  The rest is a random sequence of words that are single tokens of the vocabulary, so the length is
  controlled one token at a time.
- `build_trace(...)` is reproducible: same workload, seed, salt, rate and count -> identical requests.
  Arrival gaps, lengths and words come from independent seeded streams, so a different rate changes
  only the arrival times; a different `salt` (one per run) changes every prompt, never the lengths.
"""

from __future__ import annotations

import itertools
import secrets
import string
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from disagg_tools.planner.lengths import CONTEXT_LEN, LengthDist  # the planner draws lengths the same way
from perf.benchlib.arrivals import poisson_arrivals

_STREAM_ARRIVALS, _STREAM_LENGTHS, _STREAM_WORDS = 1, 2, 3


@dataclass(frozen=True)
class Workload:
    """A named mix of prompt and output lengths. Pairs over the context are trimmed on the prompt side."""

    name: str
    prompt: LengthDist
    output: LengthDist
    description: str

    def sample_lengths(self, rng: np.random.Generator, count: int) -> list[tuple[int, int]]:
        prompts = self.prompt.sample(rng, count)
        outputs = self.output.sample(rng, count)
        return [(min(p, CONTEXT_LEN - o), o) for p, o in zip(prompts, outputs, strict=True)]


WORKLOADS: dict[str, Workload] = {
    w.name: w
    for w in (
        Workload(
            "codegen",
            LengthDist("uniform", 270, 330, lo=16),
            LengthDist("uniform", 16, 64),
            "code completion as in the source article: ~300-token prompts, 16-64 output tokens",
        ),
        Workload(
            "chat",
            LengthDist("lognormal", 200, 0.9, lo=16, hi=1536),
            LengthDist("lognormal", 120, 0.7, lo=8, hi=512),
            "ShareGPT-like conversation mix: lognormal prompts (median 200) and outputs (median 120)",
        ),
        Workload(
            "summarize",
            LengthDist("uniform", 800, 1500, lo=16),
            LengthDist("uniform", 16, 64),
            "document summarisation: 800-1500-token prompts, 16-64 output tokens",
        ),
        Workload(
            "decode",
            LengthDist("fixed", 10, lo=2),
            LengthDist("fixed", 64),
            "decode-only load of the interference experiment: 10-token prompts, 64 output tokens",
        ),
    )
}


class PromptFactory:
    """Makes unique prompts of exact token lengths with the model's own tokenizer (tokenizer.json)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.special = len(tokenizer.encode("", add_special_tokens=True).ids)
        # Words that are one vocabulary token when preceded by a space: the byte-level pre-tokenizer
        # splits " word" units apart, so a run of them encodes to exactly one token per word.
        words = []
        for token in tokenizer.get_vocab():
            text = tokenizer.decode([tokenizer.token_to_id(token)])
            body = text[1:]
            single = len(tokenizer.encode(text, add_special_tokens=False).ids) == 1
            if text.startswith(" ") and body.isascii() and body.isalpha() and single:
                words.append(text)
        if len(words) < 16:
            raise ValueError("tokenizer has too few single-token words to build prompts")
        self.words = sorted(words)

    @classmethod
    def from_model_dir(cls, model_dir: Path) -> PromptFactory:
        return cls(Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json")))

    def count(self, text: str) -> int:
        """Tokens of `text` as the server sees it (with the tokenizer's special tokens)."""
        return len(self.tokenizer.encode(text, add_special_tokens=True).ids)

    def count_output(self, text: str) -> int:
        """Tokens of generated text re-tokenized (no special tokens): an estimate of the tokens generated
        (see `benchlib.clients` on how far off it can be)."""
        return len(self.tokenizer.encode(text, add_special_tokens=False).ids) if text else 0

    def make(self, length: int, nonce: str, rng: np.random.Generator) -> str:
        """A prompt starting with `nonce:` encoding to exactly `length` tokens (ValueError if the nonce
        alone is longer)."""
        head = f"{nonce}:"
        base = self.count(head)
        if length < base:
            raise ValueError(f"prompt length {length} is shorter than its nonce ({base} tokens)")
        picks = rng.integers(0, len(self.words), size=length - base)
        text = head + "".join(self.words[i] for i in picks)
        # Exact by construction; checked because a tokenizer other than the default one may merge
        # across the nonce boundary.
        got = self.count(text)
        if got != length:
            raise ValueError(f"prompt encodes to {got} tokens, wanted {length}")
        return text


@dataclass(frozen=True)
class RequestSpec:
    """One request of a trace: when it is due, what it sends, how many tokens it must produce."""

    index: int
    arrival: float
    prompt: str
    prompt_tokens: int
    output_tokens: int
    kind: str = ""


_SALT_PREFIX = "".join(secrets.choice(string.ascii_lowercase) for _ in range(2))
_SALT_COUNTER = itertools.count()


def new_salt() -> str:
    """A salt no other run of this process has used: two random letters (so that separate processes
    talking to one server differ too) and a counter, all letters, so that `salt + index` nonces are
    unambiguous and short (at most 8 tokens with the default tokenizer, leaving room in a 10-token
    prompt)."""
    n, letters = next(_SALT_COUNTER), ""
    while True:
        n, r = divmod(n, 26)
        letters = string.ascii_lowercase[r] + letters
        if n == 0:
            return _SALT_PREFIX + letters


def _rng(seed: int, stream: int, salt: str = "") -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence([seed, stream, zlib.crc32(salt.encode())]))


def build_trace(
    workload: Workload,
    factory: PromptFactory,
    rate_rps: float,
    count: int,
    seed: int,
    salt: str,
    long_share: float = 0.0,
    long_prompt_tokens: int = 300,
) -> list[RequestSpec]:
    """A reproducible open-loop trace (see the module contract).

    `long_share` > 0 turns that share of requests (chosen by a seeded draw) into `kind="long"` requests
    with `long_prompt_tokens`-token prompts and the same output length: the interference experiment's
    mixed run. The other requests are `kind="short"` then, else `kind=workload.name`.
    """
    if not 0.0 <= long_share <= 1.0:
        raise ValueError("long_share must be in [0, 1]")
    if not salt or not (salt.isascii() and salt.isalpha()):
        raise ValueError("salt must be a non-empty string of ASCII letters (one per run, see new_salt)")
    arrivals = poisson_arrivals(rate_rps, count, _rng(seed, _STREAM_ARRIVALS))
    length_rng = _rng(seed, _STREAM_LENGTHS)
    lengths = workload.sample_lengths(length_rng, count)
    long_mask = length_rng.random(count) < long_share if long_share > 0 else np.zeros(count, dtype=bool)
    words = _rng(seed, _STREAM_WORDS, salt)
    trace = []
    for i, (arrival, (prompt_len, output_len)) in enumerate(zip(arrivals, lengths, strict=True)):
        kind = workload.name
        if long_share > 0:
            kind = "long" if long_mask[i] else "short"
            if long_mask[i]:
                prompt_len = min(long_prompt_tokens, CONTEXT_LEN - output_len)
        prompt = factory.make(prompt_len, f"{salt}{i}", words)
        trace.append(RequestSpec(i, arrival, prompt, prompt_len, output_len, kind))
    return trace
