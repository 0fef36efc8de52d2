"""Hot-prompt detection and its rate cap, pure: the windowed count-min sketch, MinHash bands, the
prefix-group detector with its hysteresis, and the token bucket."""

from __future__ import annotations

import random

import numpy as np
import pytest

from disagg.engine.prefix import block_keys
from disagg.hot.bucket import BucketConfig, TokenBucket
from disagg.hot.hotness import HotConfig, HotPrompts
from disagg.hot.minhash import MinHasher
from disagg.hot.sketch import WindowedCountMin


def _key(i: int) -> bytes:
    return block_keys([i] * 4, 4)[0]


def test_the_sketch_never_under_counts_and_over_counts_within_its_bound():
    sketch = WindowedCountMin(10.0, width=512, depth=4)
    rng = random.Random(7)
    truth: dict[int, int] = {}
    for _ in range(5000):
        i = int(rng.paretovariate(1.2)) % 2000  # skewed, as prompt prefixes are
        truth[i] = truth.get(i, 0) + 1
        sketch.add(_key(i), now=1.0)
    bound = 2.72 * 5000 / 512  # e * N / width
    errors = [sketch.estimate(_key(i)) - n for i, n in truth.items()]
    assert min(errors) >= 0, "a count-min sketch only over-counts"
    assert sum(e > bound for e in errors) <= 0.05 * len(errors)
    assert sketch.total == 5000


def test_the_sketch_forgets_what_left_the_window():
    sketch = WindowedCountMin(10.0, buckets=10)
    for t in range(10):
        sketch.add(_key(1), now=float(t))  # one per second
    assert sketch.estimate(_key(1), now=9.5) == 10
    assert sketch.estimate(_key(1), now=12.5) == 7, "the slices of 0-2 s left the window"
    assert sketch.estimate(_key(1), now=100.0) == 0
    assert sketch.add(_key(1), now=100.0) == 1


def test_the_sketch_refuses_bad_settings_and_short_keys():
    with pytest.raises(ValueError, match="window_s"):
        WindowedCountMin(0)
    with pytest.raises(ValueError, match="width"):
        WindowedCountMin(1.0, width=0)
    with pytest.raises(ValueError, match="16 bytes"):
        WindowedCountMin(1.0).add(b"short", 0.0)


def test_minhash_bands_group_near_duplicates_and_not_strangers():
    hasher = MinHasher()
    rng = random.Random(3)
    base = [rng.randrange(50000) for _ in range(300)]
    variant = list(base)
    for i in rng.sample(range(300), 6):  # 2 % of the tokens changed, anywhere (the start too)
        variant[i] = rng.randrange(50000)
    stranger = [rng.randrange(50000) for _ in range(300)]
    bands = set(hasher.band_keys(base))
    assert bands & set(hasher.band_keys(variant)), "near-duplicates share a band"
    assert not bands & set(hasher.band_keys(stranger))
    assert hasher.band_keys(base) == MinHasher().band_keys(base), "signatures are deterministic"
    assert len(hasher.band_keys([5])) == hasher.bands, "a prompt shorter than a shingle still has bands"


def _reference_signature(hasher: MinHasher, tokens: list[int]) -> list[int]:
    """The definition, in Python integers: for each hash function (a x + b) mod (2^61 - 1), its
    smallest value over the prompt's shingles."""
    prime = (1 << 61) - 1
    shingles = [int(v) for v in hasher.shingles(tokens)]
    return [
        min((int(a) * v + int(b)) % prime for v in shingles)
        for a, b in zip(hasher._a, hasher._b, strict=True)
    ]


@pytest.mark.parametrize("length", [1, 3, 4, 300, 1500])
def test_minhash_signatures_are_the_definition_in_slices_and_without_a_division(length):
    # 1500 tokens: the 1,024 it looks at make several slices; 1 and 3: padded to one shingle
    hasher = MinHasher()
    rng = random.Random(length)
    tokens = [rng.randrange(50000) for _ in range(length)]
    assert hasher.signature(tokens).tolist() == _reference_signature(hasher, tokens)


def test_minhash_reduces_values_at_and_just_past_the_prime():
    # one shingle v, and hash functions that land it on p, p + 3 and past 2^63 (a high part of 4)
    hasher, prime = MinHasher(), (1 << 61) - 1
    (v,) = hasher.shingles([1, 2, 3, 4]).tolist()
    hasher._a = np.array([1, 1, (1 << 63) // v + 1], dtype=np.uint64)
    hasher._b = np.array([prime - v, prime - v + 3, 0], dtype=np.uint64)
    expected = [(int(a) * v + int(b)) % prime for a, b in zip(hasher._a, hasher._b, strict=True)]
    assert expected[:2] == [0, 3]
    assert hasher.signature([1, 2, 3, 4]).tolist() == expected


def test_minhash_shingles_mix_each_window_of_tokens():
    hasher = MinHasher(shingle=3)
    tokens = [7, 11, 13, 17]
    mix = [int(m) for m in hasher._mix]
    expected = set()
    for start in range(len(tokens) - 2):
        mixed = sum(t * m for t, m in zip(tokens[start : start + 3], mix, strict=True)) % (1 << 64)
        expected.add((mixed ^ (mixed >> 29)) & 0xFFFFFFFF)
    assert sorted(hasher.shingles(tokens).tolist()) == sorted(expected)


def test_the_sketch_counts_a_key_repeated_in_one_call_each_time():
    sketch = WindowedCountMin(10.0, width=4096, depth=4)
    assert sketch.add_many([_key(1), _key(2), _key(1)], now=1.0).tolist() == [2, 1, 2]
    assert sketch.add_many([_key(5)] * 3, now=1.0).tolist() == [3, 3, 3]
    assert (sketch.estimate(_key(1)), sketch.estimate(_key(5)), sketch.total) == (2, 3, 6)
    assert sketch.estimate(_key(1), now=20.0) == 0, "both tables: the slice and the window's sum"


def _detector(**kw) -> HotPrompts:
    settings = {"threshold": 5, "window_s": 10.0, "min_prefix_tokens": 32, "block_tokens": 16}
    settings |= {"surge": 0, **kw}  # no baseline traffic here: a share that jumped is tested below
    return HotPrompts(HotConfig(**settings))


def _burst(shared: list[int], i: int) -> list[int]:
    return [*shared, 1000 + i, 2000 + i, 3000 + i]


def test_a_burst_sharing_a_prefix_becomes_one_hot_group_and_cools_down():
    hot = _detector()
    shared = list(range(100, 164))  # 64 tokens: 4 full blocks
    heats = [hot.observe(_burst(shared, i), now=1.0 + 0.01 * i) for i in range(8)]
    assert [h.hot for h in heats] == [False] * 4 + [True] * 4, "hot from the threshold's request on"
    assert len({h.group for h in heats[4:]}) == 1
    assert heats[4].prefix_tokens == 64, "the group is the deepest shared block"
    assert hot.groups(1.1)[0].rate == pytest.approx(8 / 10.0)
    assert hot.became_hot == 1
    hot.observe(_burst(shared, 8), now=5.0)
    hot.observe(_burst(shared, 9), now=5.0)
    # at 11.5 s the first 8 left the window: 3 in it (with this one), under the threshold (5) but not
    # under half of it, so the group stays hot (hysteresis); a cold prefix needs the whole threshold
    assert hot.observe(_burst(shared, 10), now=11.5).group == heats[4].group
    cold = _detector()
    assert not any(cold.observe(_burst(shared, i), now=11.5).hot for i in range(3))
    assert hot.groups(16.0) == [], "cooled once the burst left the window"
    assert hot.cooled == 1


def test_hot_groups_are_looked_at_for_cooling_once_per_slice_not_per_request(
    monkeypatch: pytest.MonkeyPatch,
):
    hot = _detector()
    shared = list(range(100, 164))
    for i in range(6):
        hot.observe(_burst(shared, i), now=1.0 + 0.01 * i)
    assert hot.groups(1.2)
    walks: list[int] = []
    estimate = WindowedCountMin.estimate_many

    def counted(sketch: WindowedCountMin, keys: list[bytes], now: float | None = None):
        walks.append(len(keys))
        return estimate(sketch, keys, now)

    monkeypatch.setattr(WindowedCountMin, "estimate_many", counted)
    for i in range(50):  # the same 1 s slice: the group's count can only grow
        hot.observe(_burst(shared, 100 + i), now=1.3 + 0.01 * i)
    assert walks == [], "no walk of the tables within the slice they were last cooled in"
    hot.observe(_burst(shared, 200), now=2.5)  # a new slice: each table walked once
    assert len(walks) == 2 and walks[0] == 1
    assert hot.groups(14.0) == [] and hot.cooled == 1, "and still cooled once the burst left the window"


def test_ordinary_traffic_sharing_a_short_system_prompt_is_never_hot():
    hot = _detector(min_prefix_tokens=48)
    system = list(range(500, 532))  # 32 tokens every request starts with: under min_prefix_tokens
    rng = random.Random(1)
    heats = [hot.observe(system + [rng.randrange(40000) for _ in range(40)], now=1.0) for _ in range(50)]
    assert not any(h.hot for h in heats)
    assert hot.groups(1.0) == [] and hot.similar_groups(1.0) == 0


def test_a_long_prefix_every_request_shares_is_never_hot_but_a_burst_amid_it_is():
    """An operator's 64-token system prompt on every request, at a steady rate and then at four times
    it: its share of the window never moves, so it is never hot (throttling it would throttle
    everyone). A burst sharing a longer prefix amid that traffic is: its share jumped."""
    hot = _detector(surge=2.0, baseline_s=300.0)
    system = list(range(500, 564))
    rng = random.Random(2)

    def chat(now: float):
        return hot.observe([*system, *(rng.randrange(40000) for _ in range(30))], now)

    steady = [chat(t * 0.5) for t in range(400)]  # 2 req/s for 200 s
    spike = [chat(200 + t * 0.125) for t in range(80)]  # 8 req/s for 10 s
    assert not any(h.hot for h in steady + spike), "a prefix with a steady share is never hot"
    promo = list(range(700, 800))
    burst = [hot.observe([*promo, 900 + i], now=215 + 0.1 * i) for i in range(10)]
    assert not burst[3].hot and burst[4].hot, "the burst is hot from its threshold's request"
    assert burst[4].prefix_tokens == 96, "its group is its own shared prefix, not the system prompt"


def test_near_duplicates_without_a_shared_prefix_are_reported_not_grouped():
    hot = _detector()
    rng = random.Random(5)
    body = [rng.randrange(40000) for _ in range(200)]
    heats = [hot.observe([rng.randrange(40000), *body], now=1.0) for _ in range(8)]  # first token varies
    assert not any(h.hot for h in heats), "no shared prefix: the router sees no group"
    assert heats[-1].similar >= 5
    assert hot.similar_groups(1.0) == 1


def test_detection_off_and_bad_settings():
    assert not _detector(threshold=0).observe(list(range(200)), 0.0).hot
    with pytest.raises(ValueError, match="min_prefix_tokens: must"):
        HotConfig(min_prefix_tokens=4096, max_prefix_tokens=2048)
    with pytest.raises(ValueError, match="cool_ratio: must"):
        HotConfig(cool_ratio=0)
    with pytest.raises(ValueError, match="baseline_s: must"):
        HotConfig(window_s=10.0, baseline_s=5.0)


def test_the_token_bucket_spreads_a_burst_and_refuses_past_its_wait():
    bucket = TokenBucket(BucketConfig(rate=2.0, burst=2, max_wait_s=1.0), now=0.0)
    waits = [bucket.reserve(0.0) for _ in range(5)]
    assert waits[:4] == [0.0, 0.0, 0.5, 1.0], "the burst at once, then one every 1/rate s"
    assert waits[4] is None, "a wait over max_wait_s is refused"
    assert bucket.reserve(0.0) is None, "a refusal takes no token"
    assert bucket.reserve(1.0) == pytest.approx(0.5)
    assert not bucket.full(1.0) and bucket.full(10.0)
    with pytest.raises(ValueError, match="positive rate"):
        TokenBucket(BucketConfig(), now=0.0)
    with pytest.raises(ValueError, match="group_burst: must"):
        BucketConfig(rate=1.0, burst=0)


def test_a_token_bucket_whose_rate_changes_refills_the_time_before_at_the_old_rate():
    bucket = TokenBucket(BucketConfig(rate=2.0, burst=4, max_wait_s=100.0), now=0.0)
    assert [bucket.reserve(0.0) for _ in range(4)] == [0.0] * 4
    assert bucket.rate == 2.0
    # 1 s at 2 tokens/s refilled two tokens before the rate drops to 0.5/s
    assert bucket.reserve(1.0, rate=0.5) == 0.0 and bucket.rate == 0.5
    assert bucket.reserve(1.0) == 0.0
    assert bucket.reserve(1.0) == pytest.approx(2.0), "the next token at the new rate: 1 / 0.5 s"
    assert bucket.reserve(1.0, rate=4.0) == pytest.approx(0.5), "a waiting reservation, then 2 / 4 s"
    assert bucket.reserve(3.0) == 0.0, "2 s at 4/s repaid the two reserved tokens and refilled the burst"
    assert bucket.full(3.25) and not bucket.full(3.2), "3 of 4 tokens left: the fourth in 1 / 4 s"
    bucket.set_rate(1.0, now=10.0)
    assert bucket.reserve(10.0) == 0.0
    with pytest.raises(ValueError, match="rate"):
        bucket.set_rate(0.0, now=11.0)
