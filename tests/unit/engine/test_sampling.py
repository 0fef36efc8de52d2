"""The token sampler, counter-based (Gumbel-max): a draw depends on (seed, step, logits) alone, the
batched draw picks what the one-row path picks, the filters keep what the sampler before it kept, and
the draws follow softmax(logits / temperature)."""

from __future__ import annotations

import math

import pytest
import torch

from disagg.engine import sampling
from disagg.engine.params import SamplingParams

VOCAB = 257


def params(**kw) -> SamplingParams:
    return SamplingParams(max_tokens=64, **kw)


def batch_inputs(rows: list[tuple[SamplingParams, int]]) -> tuple[torch.Tensor, ...]:
    return (
        torch.tensor([p.temperature for p, _ in rows], dtype=torch.float32),
        torch.tensor([p.top_k for p, _ in rows], dtype=torch.int64),
        torch.tensor([p.top_p for p, _ in rows], dtype=torch.float32),
        torch.tensor([sampling.row_key(p.seed, step) for p, step in rows], dtype=torch.int64),
    )


def test_the_mixer_gives_the_same_bits_on_ints_and_int64_tensors() -> None:
    values = [0, 1, 2, 0xFFFFFFFF, 0x80000000, 0x12345678, *torch.randint(0, 2**32, (200,)).tolist()]
    mixed = sampling.mix32(torch.tensor(values, dtype=torch.int64)).tolist()
    assert mixed == [sampling.mix32(v) for v in values]
    assert all(0 <= m <= sampling.MASK32 for m in mixed)


def test_keys_differ_by_seed_step_and_the_seeds_high_half() -> None:
    keys = {sampling.row_key(seed, step) for seed in (0, 1, 2**32, 2**64 - 1) for step in range(50)}
    assert len(keys) == 200


def test_a_rows_noise_depends_on_its_key_alone_and_is_finite() -> None:
    keys = torch.tensor([sampling.row_key(7, s) for s in range(6)], dtype=torch.int64)
    together = sampling.noise(keys, 49152)
    assert torch.isfinite(together).all()
    for row in range(6):
        assert torch.equal(sampling.noise(keys[row : row + 1], 49152)[0], together[row])
    assert not torch.equal(together[0], together[1])


def test_a_batched_draw_picks_what_each_row_alone_picks() -> None:
    torch.manual_seed(0)
    logits = torch.randn(8, VOCAB) * 3
    rows = [
        (params(), 0),  # greedy
        (params(temperature=1.0, seed=1), 0),
        (params(temperature=0.7, seed=1), 5),
        (params(temperature=1.3, top_k=5, seed=2**63 + 9), 3),
        (params(temperature=1.0, top_p=0.8, seed=42), 11),
        (params(temperature=0.9, top_k=40, top_p=0.5, seed=3), 1),
        (params(temperature=2.0, top_k=1, seed=4), 2),
        (params(temperature=1.0, top_p=0.999, seed=5), 63),
    ]
    drawn = sampling.draw(logits, *batch_inputs(rows)).tolist()
    alone = [sampling.sample(logits[i], p, step) for i, (p, step) in enumerate(rows)]
    assert drawn == alone
    assert drawn[0] == int(torch.argmax(logits[0])) and drawn[6] == int(torch.argmax(logits[6]))
    again = sampling.draw(logits[3:5], *batch_inputs(rows[3:5])).tolist()
    assert again == drawn[3:5]  # the same rows in another batch


def old_filter(scores: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """The filters of the sampler this one replaced (softmax, then ``torch.multinomial`` with a
    generator seeded per step), as a mask of kept tokens; its sort made stable, as top-p among tied
    scores depends on their order."""
    if top_k:
        kth = torch.topk(scores, top_k).values[-1]
        scores = scores.masked_fill(scores < kth, -math.inf)
    if top_p < 1.0:
        ordered, order = torch.sort(scores, descending=True, stable=True)
        cumulative = ordered.softmax(-1).cumsum(-1)
        drop = (cumulative - ordered.softmax(-1)) >= top_p
        scores = scores.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), -math.inf)
    return scores > -math.inf


@pytest.mark.parametrize("top_k,top_p", [(0, 1.0), (1, 1.0), (7, 1.0), (0, 0.3), (0, 0.9), (20, 0.6)])
def test_the_filters_keep_what_the_host_sampler_kept(top_k: int, top_p: float) -> None:
    torch.manual_seed(top_k * 100 + int(top_p * 10))
    scores = torch.randn(4, VOCAB) * 2
    scores[1, :10] = 5.0  # ties at the top
    kept = sampling.filtered(scores, torch.full((4,), top_k), torch.full((4,), top_p)) > -math.inf
    for row in range(4):
        assert torch.equal(kept[row], old_filter(scores[row], top_k, top_p))


def frequencies(logits: torch.Tensor, p: SamplingParams, draws: int) -> torch.Tensor:
    rows = logits.expand(draws, -1).contiguous()
    keys = torch.tensor([sampling.row_key(p.seed, s) for s in range(draws)], dtype=torch.int64)
    temperature = torch.full((draws,), p.temperature)
    ids = sampling.draw(rows, temperature, torch.full((draws,), p.top_k), torch.full((draws,), p.top_p), keys)
    return torch.bincount(ids, minlength=logits.shape[0]).double()


def chi_square(observed: torch.Tensor, expected_p: torch.Tensor) -> float:
    expected = expected_p * observed.sum()
    keep = expected > 0
    assert observed[~keep].sum() == 0  # nothing drawn outside the support
    return float((((observed - expected) ** 2)[keep] / expected[keep]).sum())


# chi-square thresholds at p = 0.001 for 5 and 2 degrees of freedom; the draws are deterministic (fixed
# seeds and steps), so each case passes or fails the same way on every run
def test_draws_follow_the_softmax_of_the_scaled_logits() -> None:
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    observed = frequencies(logits, params(temperature=0.8, seed=11), 20000)
    assert chi_square(observed, (logits / 0.8).double().softmax(-1)) < 20.5


def test_top_k_and_top_p_renormalise_over_what_they_keep() -> None:
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    top_k = frequencies(logits, params(temperature=1.0, top_k=3, seed=12), 20000)
    expected = torch.cat([logits[:3].double().softmax(-1), torch.zeros(3, dtype=torch.float64)])
    assert chi_square(top_k, expected) < 13.8
    # softmax(logits) = .561 .206 .125 .076 .028 .004: top_p 0.8 keeps the first three (.767 < .8 ahead
    # of the third, .892 ahead of the fourth)
    top_p = frequencies(logits, params(temperature=1.0, top_p=0.8, seed=13), 20000)
    assert chi_square(top_p, expected) < 13.8
