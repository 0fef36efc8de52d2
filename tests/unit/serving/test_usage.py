"""The token counts and finish reason the orchestrator reports with its responses (what ``llm``'s
``num_output_tokens`` / ``finish_reason`` outputs carry): their sum is every token the engine generated,
and the reason is why the engine or a stop string ended the output. The engine alone is the oracle."""

from __future__ import annotations

import asyncio

import pytest
from oracle import stop_string
from recorder import Recorder

from disagg.engine.engine import Engine, EngineConfig
from disagg.engine.params import SamplingParams
from disagg.engine.sequence import Request
from disagg.pool.offline import generate
from disagg.serving.text_api import TextRequest

PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def oracle(tiny_model_dir):
    engine = Engine(EngineConfig(model_dir=tiny_model_dir, num_blocks=96, block_size=16))

    def run(tokenizer, prompt: str, params: SamplingParams) -> tuple[list[int], str | None]:
        return generate(engine, Request(tuple(tokenizer.encode(prompt)), params))

    return run


def serve(deployment, mode: str, text: TextRequest) -> tuple[Recorder, object]:
    recorder = Recorder()
    ids = deployment.tokenizer.encode(text.prompt)
    outcome = asyncio.run(deployment.orchestrator(mode).serve(ids, text, recorder))
    return recorder, outcome


@pytest.mark.parametrize("mode", ["disaggregated", "colocated"])
@pytest.mark.parametrize("stream", [True, False])
def test_counts_sum_to_the_engine_tokens_and_max_tokens_is_length(deployment, oracle, mode, stream):
    params = SamplingParams(max_tokens=14, min_length=14)
    tokens, reason = oracle(deployment.tokenizer, PROMPT, params)
    assert (len(tokens), reason) == (14, "length")
    rec, outcome = serve(deployment, mode, TextRequest(PROMPT, params, stream=stream))
    assert rec.error is None and rec.finals == 1
    assert sum(rec.tokens) == outcome.output_tokens == 14
    assert rec.finish_reason == outcome.finish_reason == "length"
    if stream:
        assert len(rec.tokens) > 3 and all(n >= 0 for n in rec.tokens), "counts arrive with the pieces"
        assert rec.tokens[-1] == 14 - sum(rec.tokens[:-1])


@pytest.mark.parametrize("stream", [True, False])
def test_an_end_token_is_counted_and_finishes_with_stop(deployment, oracle, stream):
    """The end id set to a token the engine produces (the first after the first token that did not
    come before): the output ends there, that token included, with reason stop."""
    free = oracle(deployment.tokenizer, PROMPT, SamplingParams(max_tokens=12, min_length=12))[0]
    end = next(i for i in range(1, len(free)) if free[i] not in free[:i])
    params = SamplingParams(max_tokens=12, end_id=free[end])
    assert oracle(deployment.tokenizer, PROMPT, params) == (free[: end + 1], "stop")
    rec, _ = serve(deployment, "disaggregated", TextRequest(PROMPT, params, stream=stream))
    assert sum(rec.tokens) == end + 1 and rec.finish_reason == "stop"


def test_a_stop_string_counts_the_tokens_up_to_it(deployment, oracle):
    params = SamplingParams(max_tokens=30, min_length=30)
    tokens, _ = oracle(deployment.tokenizer, PROMPT, params)
    full = deployment.tokenizer.decode(tokens)
    stop, needed = stop_string(deployment.tokenizer.decode, tokens)
    for stream in (True, False):
        text = TextRequest(PROMPT, params, stream=stream, exclude_input_in_output=True, stop_words=(stop,))
        rec, _ = serve(deployment, "disaggregated", text)
        assert rec.text == full[: full.index(stop)]
        assert sum(rec.tokens) == needed and rec.finish_reason == "stop"
