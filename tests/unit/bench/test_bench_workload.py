"""Workload generator: seeded reproducibility, unique prompts, exact token lengths, arrivals."""

from __future__ import annotations

import numpy as np
import pytest

from perf.benchlib.arrivals import count_for, poisson_arrivals
from perf.benchlib.workload import CONTEXT_LEN, WORKLOADS, LengthDist, PromptFactory, build_trace, new_salt


@pytest.fixture(scope="module")
def factory(tiny_model_dir) -> PromptFactory:
    return PromptFactory.from_model_dir(tiny_model_dir)


def test_same_seed_and_salt_reproduce_the_trace(factory):
    a = build_trace(WORKLOADS["chat"], factory, 2.0, 30, seed=7, salt="sa")
    b = build_trace(WORKLOADS["chat"], factory, 2.0, 30, seed=7, salt="sa")
    assert a == b
    c = build_trace(WORKLOADS["chat"], factory, 2.0, 30, seed=8, salt="sa")
    assert [r.arrival for r in a] != [r.arrival for r in c]


def test_salt_changes_prompts_only_and_rate_changes_arrivals_only(factory):
    base = build_trace(WORKLOADS["codegen"], factory, 2.0, 20, seed=3, salt="sa")
    salted = build_trace(WORKLOADS["codegen"], factory, 2.0, 20, seed=3, salt="sb")
    faster = build_trace(WORKLOADS["codegen"], factory, 4.0, 20, seed=3, salt="sa")
    lengths = [(r.prompt_tokens, r.output_tokens) for r in base]
    assert [(r.prompt_tokens, r.output_tokens) for r in salted] == lengths
    assert not {r.prompt for r in base} & {r.prompt for r in salted}
    assert [r.prompt for r in faster] == [r.prompt for r in base]
    assert [r.arrival * 2 for r in faster] == pytest.approx([r.arrival for r in base])


@pytest.mark.parametrize("name", ["codegen", "chat", "summarize", "decode"])
def test_prompts_unique_and_token_exact(factory, name):
    trace = build_trace(WORKLOADS[name], factory, 1.0, 40, seed=1, salt="ua")
    assert len({r.prompt for r in trace}) == len(trace)
    # The nonce leads every prompt, so they differ within their first 8 tokens: no cache block (16 tokens
    # or more) of one prompt can ever serve another.
    firsts = {tuple(factory.tokenizer.encode(r.prompt).ids[:8]) for r in trace}
    assert len(firsts) == len(trace)
    for r in trace:
        assert factory.count(r.prompt) == r.prompt_tokens
        assert r.prompt_tokens + r.output_tokens <= CONTEXT_LEN


def test_length_targets(factory):
    trace = build_trace(WORKLOADS["codegen"], factory, 1.0, 200, seed=2, salt="ta")
    assert all(270 <= r.prompt_tokens <= 330 and 16 <= r.output_tokens <= 64 for r in trace)
    assert abs(np.median([r.prompt_tokens for r in trace]) - 300) <= 10
    summarize = build_trace(WORKLOADS["summarize"], factory, 1.0, 50, seed=2, salt="tb")
    assert all(800 <= r.prompt_tokens <= 1500 for r in summarize)
    chat = WORKLOADS["chat"].sample_lengths(np.random.default_rng(0), 2000)
    prompts = [p for p, _ in chat]
    assert 160 <= np.median(prompts) <= 240  # lognormal, median 200
    assert min(prompts) >= 16 and max(prompts) <= 1536


def test_interference_mix(factory):
    trace = build_trace(WORKLOADS["decode"], factory, 4.0, 200, seed=1, salt="ma", long_share=0.2)
    longs = [r for r in trace if r.kind == "long"]
    assert 25 <= len(longs) <= 55
    assert all(r.prompt_tokens == 300 for r in longs)
    assert all(r.prompt_tokens == 10 and r.kind == "short" for r in trace if r.kind != "long")
    plain = build_trace(WORKLOADS["decode"], factory, 4.0, 200, seed=1, salt="mb")
    assert [r.arrival for r in plain] == [r.arrival for r in trace]


def test_poisson_arrivals_rate_and_order():
    times = poisson_arrivals(5.0, 5001, np.random.default_rng(0))
    assert times[0] == 0.0 and times == sorted(times)
    assert 5000 / times[-1] == pytest.approx(5.0, rel=0.05)
    assert count_for(2.0, 10.0, 100) == 20
    assert count_for(0.1, 10.0, 100, min_requests=5) == 5
    with pytest.raises(ValueError):
        poisson_arrivals(0.0, 3, np.random.default_rng(0))


def test_salts_are_fresh_letters_and_fit_short_prompts(factory):
    salts = [new_salt() for _ in range(800)]
    assert len(set(salts)) == len(salts)
    assert all(s.isascii() and s.isalpha() for s in salts)
    for salt in salts[::50] + salts[-3:]:
        trace = build_trace(WORKLOADS["decode"], factory, 1.0, 1000, seed=0, salt=salt)
        assert all(r.prompt_tokens == 10 for r in trace[::97])


def test_validation(factory):
    with pytest.raises(ValueError):
        LengthDist("uniform", 10, 5)
    with pytest.raises(ValueError):
        factory.make(2, "longnonce", np.random.default_rng(0))
    with pytest.raises(ValueError):
        build_trace(WORKLOADS["decode"], factory, 1.0, 3, seed=0, salt="bad salt")
