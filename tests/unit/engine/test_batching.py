"""Continuous batching: a sequence's tokens do not depend on who else is in the batch."""

from __future__ import annotations

import random

from disagg.engine.params import SamplingParams
from disagg.engine.sequence import Request
from disagg.pool.offline import OfflineRun, generate


def _requests(n: int, seed: int = 0, sampled: bool = False) -> list[Request]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        prompt = tuple([1] + [rng.randrange(3, 256) for _ in range(rng.randrange(1, 40))])
        params = SamplingParams(
            max_tokens=rng.randrange(8, 30),
            temperature=0.8 if sampled else 0.0,
            top_k=50 if sampled else 0,
            top_p=0.9 if sampled else 1.0,
            seed=1000 + i,
        )
        out.append(Request(prompt, params))
    return out


def _alone(make_engine, requests):
    engine = make_engine()
    return [generate(engine, r)[0] for r in requests]


def _staggered(engine, requests, joins_every: int = 3):
    """Submit one request every ``joins_every`` steps, so sequences join and leave mid-batch."""
    scheduler = OfflineRun(engine)
    tokens: dict[int, list[int]] = {i: [] for i in range(len(requests))}
    pending = list(enumerate(requests))
    step = 0
    max_batch = 0
    while pending or not scheduler.idle:
        if pending and step % joins_every == 0:
            scheduler.submit(*pending.pop(0))
        for event in scheduler.step():
            tokens[event.key].append(event.token_id)
        max_batch = max(max_batch, len(engine.active_sequences()))
        step += 1
    return [tokens[i] for i in range(len(requests))], max_batch


def test_batched_greedy_equals_alone(make_engine):
    requests = _requests(10)
    expected = _alone(make_engine, requests)
    engine = make_engine()
    got, max_batch = _staggered(engine, requests)
    assert max_batch >= 4, "the schedule should really batch"
    assert got == expected
    assert engine.kv.free_blocks == engine.kv.num_blocks


def test_batched_sampling_reproducible_per_seed(make_engine):
    requests = _requests(8, seed=5, sampled=True)
    expected = _alone(make_engine, requests)
    got, _ = _staggered(make_engine(), requests, joins_every=2)
    assert got == expected
    assert len({tuple(t) for t in got}) == len(got)


def test_all_at_once_equals_alone(make_engine):
    requests = _requests(12, seed=9)
    expected = _alone(make_engine, requests)
    engine = make_engine()
    scheduler = OfflineRun(engine)
    for i, r in enumerate(requests):
        scheduler.submit(i, r)
    tokens: dict[int, list[int]] = {i: [] for i in range(len(requests))}
    for event in scheduler.run():
        tokens[event.key].append(event.token_id)
    assert [tokens[i] for i in range(len(requests))] == expected
