"""Conditional disaggregation over in-process pools: while the prefill pool is backlogged a short prompt
is served whole by the decode pool (no KV moves), counted as the route disaggregated -> conditional;
a long prompt, or an idle prefill pool, keeps the normal path; the text is the engine's either way."""

from __future__ import annotations

import asyncio
import os
import secrets
from collections.abc import Iterator

import pytest
from local_pools import LocalPools
from recorder import Recorder

from disagg.engine.engine import Engine, EngineConfig
from disagg.engine.params import SamplingParams
from disagg.engine.sequence import Request
from disagg.engine.tokenizer import Tokenizer
from disagg.pool.instance import PoolConfig, build_instance
from disagg.pool.offline import generate
from disagg.pool.settings import ConditionalPrefill
from disagg.protocol.messages import PoolLoad
from disagg.serving.ladder import Route
from disagg.serving.orchestrator import Orchestrator, OrchestratorConfig
from disagg.serving.settings import ConditionalSettings
from disagg.serving.text_api import TextRequest

SHORT, LONG = "The quick brown fox", "The quick brown fox jumps over the lazy dog " * 6
LIMIT = 32  # prompt tokens the decode pool prefills itself; SHORT is under it, LONG over it


@pytest.fixture(scope="module")
def loops(tiny_model_dir) -> Iterator[dict]:
    secret, prefix = secrets.token_bytes(32), f"c{os.getpid()}"
    built = {}
    for role in ("prefill", "decode"):
        engine = EngineConfig(model_dir=tiny_model_dir, num_blocks=96, block_size=16)
        local = {"conditional": ConditionalPrefill(prefill_tokens=LIMIT)} if role == "decode" else {}
        built[role] = build_instance(PoolConfig(role=role, engine=engine, prefix=prefix, **local), secret)
    started = {role: loop.start() for role, (loop, _) in built.items()}
    yield started
    for loop in started.values():
        loop.shutdown()
    for _, transport in built.values():
        transport.close()


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir) -> Tokenizer:
    return Tokenizer(tiny_model_dir)


def _backlogged(orchestrator: Orchestrator, queued_tokens: int) -> None:
    """The prefill pool as two probes saw it: 1,000 prompt tokens per engine second, ``queued_tokens``
    waiting."""
    orchestrator.admission.observe("prefill", PoolLoad(0, 0, 0, 0, 96, 0, 0.0))
    orchestrator.admission.observe("prefill", PoolLoad(1, queued_tokens, 0, 0, 96, 1000, 1.0))


def _serve(orchestrator: Orchestrator, tokenizer: Tokenizer, prompt: str, params: SamplingParams):
    recorder = Recorder()
    text = TextRequest(prompt, params)
    outcome = asyncio.run(orchestrator.serve(tokenizer.encode(prompt), text, recorder))
    return outcome, recorder


@pytest.mark.parametrize(
    ("prompt", "queued_tokens", "conditional"),
    [(SHORT, 2000, True), (LONG, 2000, False), (SHORT, 0, False)],
    ids=["short-backlogged", "long-backlogged", "short-idle"],
)
def test_short_prompts_skip_a_backlogged_prefill_pool(
    loops, tokenizer, tiny_model_dir, prompt, queued_tokens, conditional
):
    assert (len(tokenizer.encode(SHORT)) <= LIMIT) and (len(tokenizer.encode(LONG)) > LIMIT)
    config = OrchestratorConfig(conditional=ConditionalSettings(prefill_tokens=LIMIT, backlog_s=0.5))
    orchestrator = Orchestrator(config, LocalPools(**loops), tokenizer.decode, deployed=("prefill", "decode"))
    _backlogged(orchestrator, queued_tokens)  # 2,000 queued: 2 s predicted; none queued: 0.005 s
    prefill_steps = loops["prefill"].stats().engine_steps
    params = SamplingParams(max_tokens=8)

    outcome, recorder = _serve(orchestrator, tokenizer, prompt, params)

    assert outcome.error is None and outcome.rung == "disaggregated"
    expected = [Route("conditional", "disaggregated", "prefill_backlog")] if conditional else []
    assert outcome.fallbacks == expected
    ran_on_prefill = loops["prefill"].stats().engine_steps - prefill_steps
    assert ran_on_prefill == (0 if conditional else 1), "the prompt's prefill ran where the rule says"
    engine = Engine(EngineConfig(model_dir=tiny_model_dir, num_blocks=96, block_size=16))
    reference = generate(engine, Request(tuple(tokenizer.encode(prompt)), params))[0]
    assert recorder.text == prompt + tokenizer.decode(reference)  # the prompt echoed, then the output
    assert orchestrator.admission.backlog("prefill") == queued_tokens, "served: out of the backlog"
    for loop in loops.values():
        assert loop.engine.kv.free_blocks == loop.engine.kv.num_blocks


def test_the_rule_is_off_by_default_and_needs_a_healthy_decode_pool(loops, tokenizer):
    off = Orchestrator(
        OrchestratorConfig(), LocalPools(**loops), tokenizer.decode, deployed=("prefill", "decode")
    )
    _backlogged(off, 2000)
    assert _serve(off, tokenizer, SHORT, SamplingParams(max_tokens=4))[0].fallbacks == []
    config = OrchestratorConfig(conditional=ConditionalSettings(prefill_tokens=LIMIT))
    busy = Orchestrator(config, LocalPools(**loops), tokenizer.decode, deployed=("prefill", "decode"))
    _backlogged(busy, 2000)
    busy.observe(busy.health["decode"].refused())  # saturated: it takes no extra prefill work
    routes = [
        route.rung for route in _serve(busy, tokenizer, SHORT, SamplingParams(max_tokens=4))[0].fallbacks
    ]
    assert "conditional" not in routes and routes, "the ladder's own fallback, not the decode pool"
