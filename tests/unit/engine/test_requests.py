"""Request validation, stop conditions, sampling knobs and block accounting."""

from __future__ import annotations

import math
import random

import pytest

from disagg.engine.errors import InvalidRequest, OutOfBlocks
from disagg.engine.params import SamplingParams
from disagg.engine.sequence import Request
from disagg.pool.offline import OfflineRun, generate

PROMPT = (1, 40, 41, 42, 43)


@pytest.mark.parametrize(
    ("params", "field"),
    [
        (dict(max_tokens=0), "max_tokens"),
        (dict(max_tokens=10_000), "max_tokens"),
        (dict(temperature=-0.1), "temperature"),
        (dict(temperature=math.nan), "temperature"),
        (dict(temperature=math.inf), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_p=math.nan), "top_p"),
        (dict(top_k=-1), "top_k"),
        (dict(seed=-1), "seed"),
        (dict(seed=1 << 64), "seed"),
        (dict(min_length=20, max_tokens=10), "min_length"),
        (dict(end_id=100_000), "end_id"),
        (dict(stop_token_ids=(-3,)), "stop token id"),
        (dict(max_tokens=True), "max_tokens"),
    ],
)
def test_invalid_sampling_parameters_are_named(make_engine, params, field):
    engine = make_engine()
    with pytest.raises(InvalidRequest, match=field):
        engine.prefill([Request(PROMPT, SamplingParams(**params))])
    assert engine.kv.free_blocks == engine.kv.num_blocks


def test_invalid_prompts(make_engine):
    engine = make_engine()
    with pytest.raises(InvalidRequest, match="empty"):
        engine.validate(Request((), SamplingParams()))
    with pytest.raises(InvalidRequest, match="token ids"):
        engine.validate(Request((1, 999_999), SamplingParams()))
    with pytest.raises(InvalidRequest, match="context of 512"):
        engine.validate(Request(tuple([5] * 500), SamplingParams(max_tokens=20)))
    assert engine.kv.free_blocks == engine.kv.num_blocks


def test_out_of_blocks_is_catchable_and_allocates_nothing(make_engine):
    engine = make_engine(num_blocks=8, block_size=4)  # 32 positions
    big = Request(tuple([1] * 20), SamplingParams(max_tokens=20))
    with pytest.raises(OutOfBlocks) as err:
        engine.prefill([big])
    assert err.value.needed == 10 and err.value.free == 8
    assert engine.kv.free_blocks == 8 and not engine.held_sequences()


def test_end_id_stop_tokens_and_min_length(make_engine):
    engine = make_engine()
    free_run, _ = generate(engine, Request(PROMPT, SamplingParams(max_tokens=30)))
    stop = free_run[5]
    first = free_run.index(stop)
    tokens, reason = generate(engine, Request(PROMPT, SamplingParams(max_tokens=30, stop_token_ids=(stop,))))
    assert tokens == free_run[: first + 1] and reason == "stop"
    tokens, reason = generate(engine, Request(PROMPT, SamplingParams(max_tokens=30, end_id=stop)))
    assert tokens == free_run[: first + 1] and reason == "stop"
    # min_length suppresses the stop token until that many tokens exist
    tokens, _ = generate(engine, Request(PROMPT, SamplingParams(max_tokens=30, end_id=stop, min_length=8)))
    assert len(tokens) >= 8 and stop not in tokens[:8]


def test_sampling_knobs(make_engine):
    engine = make_engine()
    greedy, _ = generate(engine, Request(PROMPT, SamplingParams(max_tokens=20)))

    def run(**kw):
        return generate(engine, Request(PROMPT, SamplingParams(max_tokens=20, **kw)))[0]

    assert run(temperature=1.0, top_k=1, seed=3) == greedy
    assert run(temperature=1.0, top_p=1e-6, seed=3) == greedy
    hot = run(temperature=1.5, seed=3)
    assert hot == run(temperature=1.5, seed=3), "same seed, same tokens"
    assert hot != run(temperature=1.5, seed=4) and hot != greedy


def test_top_k_limits_the_choice(make_engine):
    engine = make_engine()
    (out,) = engine.prefill([Request(PROMPT, SamplingParams(max_tokens=2))])
    engine.free(out.seq_id)
    picks = {
        generate(engine, Request(PROMPT, SamplingParams(max_tokens=1, temperature=5.0, top_k=3, seed=s)))[0][
            0
        ]
        for s in range(60)
    }
    assert 2 <= len(picks) <= 3


def test_block_accounting_with_aborts(make_engine):
    engine = make_engine(num_blocks=200, block_size=4, max_batch_size=16)
    scheduler = OfflineRun(engine)
    rng = random.Random(1)
    start = engine.kv.free_blocks
    submitted = 0
    for step in range(300):
        if submitted < 120 and rng.random() < 0.6:
            prompt = tuple([1] + [rng.randrange(3, 256) for _ in range(rng.randrange(1, 60))])
            scheduler.submit(submitted, Request(prompt, SamplingParams(max_tokens=rng.randrange(1, 25))))
            submitted += 1
        if rng.random() < 0.2 and submitted:
            scheduler.cancel(rng.randrange(submitted))
        scheduler.step()
        assert engine.kv.used_blocks <= engine.kv.num_blocks
        if step == 150:
            assert engine.kv.used_blocks > 0
    scheduler.run()
    assert submitted == 120
    assert engine.kv.free_blocks == start and not engine.held_sequences()
    assert engine.kv.allocations == engine.kv.frees > 0


def test_free_is_idempotent(make_engine):
    engine = make_engine()
    (out,) = engine.prefill([Request(PROMPT, SamplingParams(max_tokens=5))])
    assert engine.abort(out.seq_id) is True
    assert engine.abort(out.seq_id) is False
    assert engine.kv.free_blocks == engine.kv.num_blocks
