"""Hot prompts: which requests belong to a burst of prompts that share a long prefix.

Two detectors watch every new request, over one sliding window:

- **prefix groups** (the router's): the keys of the prompt's full blocks (``disagg.engine.prefix``,
  the chain the engine's prefix cache uses) are counted in a windowed count-min sketch. A request's
  group is its deepest block of at least ``min_prefix_tokens`` whose key was seen ``threshold`` times
  in the window, *and* whose share of the window's requests is at least ``surge`` times its share
  over the longer ``baseline_s`` (a second sketch): the longest prefix it shares with a burst. A
  prefix every request has (an operator's system prompt) keeps its share, so it is never hot however
  busy the server gets; a burst is a prefix whose share jumped. A group is hot from then until its
  count falls below ``threshold x cool_ratio`` (hysteresis), then it cools down.
- **near-duplicate groups** (reported only): MinHash bands over token shingles
  (``disagg.hot.minhash``), counted the same way, find prompts that are similar without sharing a
  prefix (a varying first line, reordered parts).

Why the router uses prefix groups: requests of one prefix group are exactly those whose KV the
prefill pool's prefix cache shares, so isolating a group isolates the work the cache does not
remove; the rule is exact (a count-min sketch only over-counts, by a bounded amount) and never puts
two prompts in one group unless they share ``min_prefix_tokens`` tokens, while LSH groups unrelated
prompts with a probability that grows with their similarity, and long templated prompts of ordinary
traffic are similar. Throttling an innocent user is worse than missing a hot one. The templated bursts
of the source's scenario (a promotion: one long prompt, small variations at its end) share their
prefix. A burst that only the near-duplicate detector sees shows on ``/metrics`` as near-duplicate
groups with no hot prefix group, which is the operator's cue to look.

``min_prefix_tokens`` keeps what every request shares (a chat template's system prompt) out of the
groups. Pure and single-threaded: the caller passes the time.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from disagg.engine.prefix import block_keys
from disagg.hot.minhash import MinHasher
from disagg.hot.sketch import WindowedCountMin

_ANY = bytes(4)  # the one key of the request counters
SIMILARITY_TOKENS = 512  # prompt tokens the near-duplicate signature covers (its cost is linear)


@dataclass(frozen=True)
class HotConfig:
    threshold: int = 4
    """Requests in the window that share a prefix for their group to be hot (0: detection off)."""
    window_s: float = 10.0
    surge: float = 2.0
    """How many times its share over ``baseline_s`` a prefix's share of the window must be (0: any)."""
    baseline_s: float = 300.0
    min_prefix_tokens: int = 64
    """The shortest shared prefix that makes a group."""
    max_prefix_tokens: int = 1024
    """Prompt tokens looked at, at most (hashing cost)."""
    block_tokens: int = 16
    """The prefix-block size hashed (the pools' ``block_size``, so groups follow cached blocks)."""
    cool_ratio: float = 0.5
    """A hot group cools once its count in the window falls below ``threshold x cool_ratio``."""
    sketch_width: int = 4096

    def __post_init__(self) -> None:
        """Ranges and consistency; the types are ``config.build``'s (through ``HotPromptsConfig``; a
        config built by hand in code is trusted to be typed)."""
        ints = (
            ("threshold", 0, 1 << 20),
            ("min_prefix_tokens", 1, 1 << 20),
            ("max_prefix_tokens", 1, 1 << 20),
            ("block_tokens", 1, 4096),
            ("sketch_width", 16, 1 << 20),
        )
        for name, low, top in ints:
            if not low <= getattr(self, name) <= top:
                raise ValueError(f"{name}: must be in [{low}, {top}]")
        if self.min_prefix_tokens > self.max_prefix_tokens:
            raise ValueError("min_prefix_tokens: must be at most max_prefix_tokens")
        if not 0 < self.window_s <= 3600:
            raise ValueError("window_s: must be a number of seconds in (0, 3600]")
        if not 0 < self.cool_ratio <= 1:
            raise ValueError("cool_ratio: must be in (0, 1]")
        if not 0 <= self.surge <= 1000:
            raise ValueError("surge: must be a number in [0, 1000]")
        if not self.window_s <= self.baseline_s <= 86400:
            raise ValueError("baseline_s: must be a number of seconds in [window_s, 86400]")

    @property
    def enabled(self) -> bool:
        return self.threshold > 0

    @property
    def min_blocks(self) -> int:
        return math.ceil(self.min_prefix_tokens / self.block_tokens)


@dataclass(frozen=True)
class Heat:
    """What the detectors say of one request."""

    group: str | None = None
    """The hot prefix group it belongs to (hex of the block key), None when cold."""
    prefix_tokens: int = 0
    """Tokens of the prefix that names the group."""
    rate: float = 0.0
    """Requests per second of that group over the window."""
    similar: int = 0
    """Requests in the window near-duplicate of this one (this one included)."""

    @property
    def hot(self) -> bool:
        return self.group is not None


@dataclass(frozen=True)
class GroupRate:
    group: str
    prefix_tokens: int
    rate: float


class HotPrompts:
    def __init__(self, config: HotConfig) -> None:
        self.config = config
        self._prefixes = WindowedCountMin(config.window_s, width=config.sketch_width)
        self._baseline = WindowedCountMin(config.baseline_s, width=config.sketch_width, buckets=30)
        # requests counted over each window: one counter (a sketch of width 1)
        self._recent = WindowedCountMin(config.window_s, width=1, depth=1)
        self._overall = WindowedCountMin(config.baseline_s, width=1, depth=1, buckets=30)
        self._bands = WindowedCountMin(config.window_s, width=config.sketch_width)
        self._minhash = MinHasher(max_tokens=min(config.max_prefix_tokens, SIMILARITY_TOKENS))
        self._hot: dict[bytes, int] = {}  # hot group key -> its prefix length in tokens
        self._similar: dict[bytes, None] = {}  # near-duplicate band keys at or over the threshold
        self._cooled_in: list[int | None] = [None, None]  # the slice each table was last cooled in
        self.became_hot = 0
        self.cooled = 0

    def observe(self, tokens: Sequence[int], now: float) -> Heat:
        """Count one new request's prompt and say which hot group it is in."""
        config = self.config
        if not config.enabled:
            return Heat()
        limit = config.max_prefix_tokens // config.block_tokens
        keys = block_keys(tokens, config.block_tokens, limit=limit)
        counts = self._prefixes.add_many(keys, now)
        baseline = self._baseline.add_many(keys, now)
        recent, overall = self._recent.add(_ANY, now), self._overall.add(_ANY, now)
        bands = self._minhash.band_keys(tokens)
        band_counts = self._bands.add_many(bands, now)
        similar = int(band_counts.max())
        self._note_similar(bands, band_counts)
        self._cool(now)
        counts, baseline = counts.tolist(), baseline.tolist()
        for depth in range(len(keys) - 1, config.min_blocks - 2, -1):
            key, count = keys[depth], counts[depth]
            if key in self._hot:
                if count >= self._cool_below:
                    return Heat(key.hex(), self._hot[key], count / config.window_s, similar)
                continue
            # its share of the window (count / recent) against its share of the baseline
            surged = count * overall >= config.surge * baseline[depth] * recent
            if count >= config.threshold and surged:
                self._hot[key] = (depth + 1) * config.block_tokens
                self.became_hot += 1
                return Heat(key.hex(), self._hot[key], count / config.window_s, similar)
        return Heat(similar=similar)

    @property
    def _cool_below(self) -> float:
        return self.config.threshold * self.config.cool_ratio

    def _note_similar(self, bands: list[bytes], counts: np.ndarray) -> None:
        if counts.max() < self.config.threshold:
            return
        # the band that counted most names the near-duplicate group (one per group, not per band)
        if not any(band in self._similar for band in bands):
            self._similar[bands[int(counts.argmax())]] = None

    def _cool(self, now: float) -> None:
        """Drop the groups whose count fell below ``threshold x cool_ratio``. A count only falls when
        a slice leaves its sketch's window, and a group enters its table at ``threshold`` or more, so
        each table is looked at once per slice of its sketch, not at every request (at a few hundred
        requests a second the tables fill, and a walk of them per request cost more than the rest)."""
        for index, (table, sketch) in enumerate(((self._hot, self._prefixes), (self._similar, self._bands))):
            current = sketch.advance(now)
            if self._cooled_in[index] == current:
                continue
            self._cooled_in[index] = current
            keys = list(table)
            for key, count in zip(keys, sketch.estimate_many(keys), strict=True):
                if count < self._cool_below:
                    del table[key]
                    self.cooled += table is self._hot

    def is_hot(self, group: str) -> bool:
        return bytes.fromhex(group) in self._hot

    def groups(self, now: float) -> list[GroupRate]:
        """The hot groups now, hottest first (cooled ones dropped)."""
        self._cool(now)
        window = self.config.window_s
        rates = [
            GroupRate(key.hex(), tokens, self._prefixes.estimate(key) / window)
            for key, tokens in self._hot.items()
        ]
        return sorted(rates, key=lambda g: g.rate, reverse=True)

    def similar_groups(self, now: float) -> int:
        """Near-duplicate groups at or over the threshold in the window."""
        self._cool(now)
        return len(self._similar)
