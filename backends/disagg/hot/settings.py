"""The entry points' hot-prompt settings: one frozen section of ``OrchestratorConfig``.

The spec's section ``hot_prompts`` and config.pbtxt's parameters ``hot_prompts.<field>`` use these
names; the detector (``disagg.hot.hotness``), the token buckets (``disagg.hot.bucket``) and the adaptive
cap (``disagg.hot.throttle``) each get their part of it.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from disagg.hot.bucket import BucketConfig
from disagg.hot.hotness import HotConfig
from disagg.hot.throttle import ThrottleConfig


@dataclass(frozen=True)
class HotPromptsConfig:
    """Each default is the one of the component that takes the setting (one place for each)."""

    threshold: int = HotConfig.threshold
    """Detection (``disagg.hot.hotness``): requests in ``window_s`` that share a prefix of at least
    ``min_prefix_tokens`` for their group to be hot (0: detection off), if that prefix's share of the
    window's requests is ``surge`` times its share over ``baseline_s``."""
    window_s: float = HotConfig.window_s
    surge: float = HotConfig.surge
    baseline_s: float = HotConfig.baseline_s
    min_prefix_tokens: int = HotConfig.min_prefix_tokens
    max_prefix_tokens: int = HotConfig.max_prefix_tokens
    block_tokens: int = HotConfig.block_tokens
    cool_ratio: float = HotConfig.cool_ratio
    decode_model: str = ""
    """Isolation on a pool of its own: hot requests decode on this model (a decode pool with its own
    cores or CPU share, the spec's ``hot_prompts.pool``) while it is healthy; "": none."""
    group_rate: float = BucketConfig.rate
    """Isolation by rate, where no hot pool takes a request: each hot group starts at most this many
    requests per second (a token bucket of ``group_burst``); a request that would wait for its token
    longer than ``max_wait_s`` is refused UNAVAILABLE with the retry hint (0: no cap)."""
    group_burst: int = BucketConfig.burst
    max_wait_s: float = BucketConfig.max_wait_s
    rate_adaptive: bool = False
    """The group rate adapts (``disagg.hot.throttle``): ``group_rate`` is its maximum; while a group is
    hot, the cap halves (``rate_decrease``, down to ``rate_min``) after each probe interval whose mean
    decode step time exceeds ``step_ratio`` x the step time learnt while no group was hot, and grows by
    ``rate_increase`` after each interval within it. The shared decode pool's engine measures it
    (``colocated`` in colocated mode). Needs ``group_rate`` > 0."""
    step_ratio: float = ThrottleConfig.step_ratio
    rate_min: float = ThrottleConfig.min_rate
    rate_decrease: float = ThrottleConfig.decrease
    rate_increase: float = ThrottleConfig.increase

    def __post_init__(self) -> None:
        _ = self.detection, self.bucket  # their own range checks
        if self.rate_adaptive and not self.bucket.enabled:
            raise ValueError("rate_adaptive: needs group_rate > 0 (the adaptive cap's maximum)")
        self._throttle(self.group_rate if self.rate_adaptive else 1e6)  # checked when unused too

    @property
    def detection(self) -> HotConfig:
        return HotConfig(
            threshold=self.threshold,
            window_s=self.window_s,
            surge=self.surge,
            baseline_s=self.baseline_s,
            min_prefix_tokens=self.min_prefix_tokens,
            max_prefix_tokens=self.max_prefix_tokens,
            block_tokens=self.block_tokens,
            cool_ratio=self.cool_ratio,
        )

    @property
    def bucket(self) -> BucketConfig:
        return BucketConfig(self.group_rate, self.group_burst, self.max_wait_s)

    @property
    def throttle(self) -> ThrottleConfig | None:
        """The adaptive cap's settings; None unless ``rate_adaptive``."""
        return self._throttle(self.group_rate) if self.rate_adaptive else None

    def _throttle(self, max_rate: float) -> ThrottleConfig:
        return ThrottleConfig(
            max_rate=max_rate,
            min_rate=self.rate_min,
            step_ratio=self.step_ratio,
            decrease=self.rate_decrease,
            increase=self.rate_increase,
        )


HOT_PROMPTS_FIELDS = tuple(f.name for f in fields(HotPromptsConfig))
"""Each was a flat ``hot_<field>`` parameter of the entry points before this section."""
