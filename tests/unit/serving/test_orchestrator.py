"""The orchestrator over in-process pools: same text as the engine alone, streaming, stops, cancels."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
from recorder import Recorder

from disagg.engine.engine import Engine, EngineConfig
from disagg.engine.params import SamplingParams
from disagg.engine.sequence import Request
from disagg.pool.offline import generate
from disagg.protocol.errors import CANCELLED, DEADLINE, INVALID_ARG
from disagg.serving.text_api import TextRequest

PROMPTS = ["The quick brown fox", "naïve café — 日本語 🙂 and more", "x"]


def _run(orchestrator, tokenizer, text: TextRequest, recorder: Recorder):
    ids = tokenizer.encode(text.prompt)
    return asyncio.run(orchestrator.serve(ids, text, recorder))


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    engine = Engine(EngineConfig(model_dir=tiny_model_dir, num_blocks=96, block_size=16))

    def text_of(tokenizer, prompt: str, params: SamplingParams) -> str:
        tokens, _ = generate(engine, Request(tuple(tokenizer.encode(prompt)), params))
        return tokenizer.decode(tokens)

    return text_of


@pytest.mark.parametrize("mode", ["disaggregated", "colocated"])
@pytest.mark.parametrize("prompt", PROMPTS)
def test_unary_and_stream_equal_the_engine(deployment, reference, mode, prompt):
    params = SamplingParams(max_tokens=20)
    expected = reference(deployment.tokenizer, prompt, params)
    orch = deployment.orchestrator(mode)

    unary = Recorder()
    outcome = _run(orch, deployment.tokenizer, TextRequest(prompt, params), unary)
    assert unary.error is None and unary.finals == 1 and len(unary.pieces) == 1
    assert unary.text == prompt + expected, "unary output begins with the prompt, as in TensorRT-LLM"
    assert outcome.output_tokens == 20

    streamed = Recorder()
    _run(orch, deployment.tokenizer, TextRequest(prompt, params, stream=True), streamed)
    assert streamed.finals == 1 and streamed.pieces[-1] == ""
    assert streamed.text == expected
    assert len(streamed.pieces) > 5, "text arrives piece by piece"

    excluded = Recorder()
    _run(orch, deployment.tokenizer, TextRequest(prompt, params, exclude_input_in_output=True), excluded)
    assert excluded.text == expected
    assert deployment.clean()


def test_sampled_request_is_reproducible_across_modes(deployment):
    params = SamplingParams(max_tokens=16, temperature=0.9, top_k=50, top_p=0.9, seed=1234)
    texts = []
    for mode in ("disaggregated", "colocated"):
        rec = Recorder()
        _run(
            deployment.orchestrator(mode),
            deployment.tokenizer,
            TextRequest("Hello", params, stream=True),
            rec,
        )
        texts.append(rec.text)
    assert texts[0] == texts[1]


def test_concurrent_requests_all_complete(deployment, reference):
    params = SamplingParams(max_tokens=12)
    prompts = [f"request number {i} says" for i in range(8)]
    orch = deployment.orchestrator()

    async def main():
        recs = [Recorder() for _ in prompts]
        await asyncio.gather(
            *(
                orch.serve(deployment.tokenizer.encode(p), TextRequest(p, params, stream=True), r)
                for p, r in zip(prompts, recs, strict=True)
            )
        )
        return recs

    recs = asyncio.run(main())
    for prompt, rec in zip(prompts, recs, strict=True):
        assert rec.error is None and rec.text == reference(deployment.tokenizer, prompt, params)
    assert deployment.clean()


def test_stop_string_ends_output_and_frees_everything(deployment, reference):
    params = SamplingParams(max_tokens=30)
    full = reference(deployment.tokenizer, "Once upon", params)
    stop = full[10:13]
    cut = full[: full.index(stop)]
    for stream in (True, False):
        rec = Recorder()
        text = TextRequest(
            "Once upon", params, stream=stream, exclude_input_in_output=True, stop_words=(stop,)
        )
        _run(deployment.orchestrator(), deployment.tokenizer, text, rec)
        assert rec.error is None and rec.text == cut and rec.finals == 1
    assert _wait_clean(deployment)


def _wait_clean(deployment, timeout_s: float = 5.0) -> bool:
    """Stops and lease releases are asynchronous: poll until the pools are clean (with a deadline)."""
    import time

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if deployment.clean():
            return True
        time.sleep(0.01)
    return deployment.clean()


@pytest.mark.parametrize("mode", ["disaggregated", "colocated"])
def test_cancel_mid_stream(deployment, mode):
    rec = Recorder(cancel_after=4)
    params = SamplingParams(max_tokens=200)
    outcome = _run(
        deployment.orchestrator(mode), deployment.tokenizer, TextRequest("Tell me", params, stream=True), rec
    )
    assert rec.error is not None and rec.error.code == CANCELLED and rec.finals == 1
    assert outcome.output_tokens < 20, "the sequence stopped within a step or two"
    assert _wait_clean(deployment)


def test_cancel_between_prefill_and_decode_aborts_the_lease(deployment):
    """The orchestrator stops the job on the prefill pool, which owns the lease and aborts it."""
    exporter = deployment.transports[0]  # the prefill pool's
    aborts = exporter.stats.snapshot().aborts
    rec = Recorder(cancel_after=1)  # cancelled as soon as the first piece is out
    params = SamplingParams(max_tokens=50)
    _run(deployment.orchestrator(), deployment.tokenizer, TextRequest("Hi there", params, stream=True), rec)
    assert rec.error.code == CANCELLED
    assert _wait_clean(deployment, timeout_s=2.0), "released by the abort, long before the 5 s TTL"
    assert exporter.stats.snapshot().aborts == aborts + 1


def test_deadline(deployment):
    rec = Recorder()
    orch = deployment.orchestrator(request_timeout_s=0.05)
    params = SamplingParams(max_tokens=500)
    _run(orch, deployment.tokenizer, TextRequest("slow", params, stream=True), rec)
    assert rec.error.code == DEADLINE and rec.finals == 1
    assert _wait_clean(deployment)


@pytest.mark.parametrize(
    "params",
    [SamplingParams(max_tokens=0), SamplingParams(max_tokens=5000), SamplingParams(temperature=-1.0)],
)
def test_invalid_requests_allocate_nothing(deployment, params):
    rec = Recorder()
    _run(deployment.orchestrator(), deployment.tokenizer, TextRequest("abc", params), rec)
    assert rec.error.code == INVALID_ARG
    assert deployment.clean()


def test_too_long_prompt_names_the_limit(deployment):
    rec = Recorder()
    prompt = "word " * 3000
    _run(
        deployment.orchestrator(),
        deployment.tokenizer,
        TextRequest(prompt, SamplingParams(max_tokens=4)),
        rec,
    )
    assert rec.error.code == INVALID_ARG and "context of 2048" in rec.error.message


def test_request_is_frozen():
    text = TextRequest("a", SamplingParams())
    with pytest.raises(dataclasses.FrozenInstanceError):
        text.prompt = "b"  # type: ignore[misc]


@pytest.fixture(scope="module")
def chunked_colocated(tiny_model_dir):
    """A colocated pool that prefills at most 5 prompt tokens per step, in chunks."""
    from local_pools import LocalPools

    from disagg.pool.instance import PoolConfig, build_instance

    engine = EngineConfig(model_dir=tiny_model_dir, num_blocks=96, block_size=16)
    config = PoolConfig(role="colocated", engine=engine, max_prefill_tokens=5, chunked_prefill=True)
    loop, _ = build_instance(config, b"s" * 32)
    yield loop.start(), LocalPools(colocated=loop)
    loop.shutdown()


def test_chunked_colocated_pool_gives_the_engine_text_under_concurrency(
    deployment, reference, chunked_colocated
):
    """Prompts cut into 5-token chunks, interleaved with the decode steps of the others: each request
    still gets the text the engine gives it alone (float32)."""
    from disagg.serving.orchestrator import Orchestrator, OrchestratorConfig

    loop, pools = chunked_colocated
    tokenizer = deployment.tokenizer
    orch = Orchestrator(OrchestratorConfig(mode="colocated"), pools, tokenizer.decode)
    params = SamplingParams(max_tokens=12, min_length=12)
    recorders = [Recorder() for _ in PROMPTS]

    async def all_at_once():
        await asyncio.gather(
            *(
                orch.serve(tokenizer.encode(p), TextRequest(p, params, stream=True), r)
                for p, r in zip(PROMPTS, recorders, strict=True)
            )
        )

    asyncio.run(all_at_once())
    for prompt, rec in zip(PROMPTS, recorders, strict=True):
        assert rec.error is None and rec.text == reference(tokenizer, prompt, params), prompt
    assert len(tokenizer.encode(PROMPTS[1])) > 10, "one prompt really spans several chunks"
    assert loop.engine.kv.free_blocks == loop.engine.kv.num_blocks
