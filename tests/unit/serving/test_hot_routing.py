"""Hot-prompt isolation in the orchestrator, over in-process pools: a hot group decodes on the hot
pool while it is healthy, or is held to its group's rate by a token bucket; cold requests are never
touched; the text is the same whichever pool decodes it."""

from __future__ import annotations

import asyncio
import os
import secrets
import time
from collections.abc import Iterator

import pytest
from recorder import Recorder

from disagg.engine.engine import EngineConfig
from disagg.engine.params import SamplingParams
from disagg.engine.tokenizer import Tokenizer
from disagg.serving.errors import UNAVAILABLE
from disagg.serving.health import PoolState
from disagg.serving.instance import PoolConfig, build_instance
from disagg.serving.local import LocalPools
from disagg.serving.orchestrator import HOT_POOL, Orchestrator, OrchestratorConfig
from disagg.serving.text_api import TextRequest

SHARED = list(range(300, 364))  # a 64-token prefix: 4 blocks of 16
PARAMS = SamplingParams(max_tokens=6)
HOT = {"hot_threshold": 3, "hot_min_prefix_tokens": 32, "hot_surge": 0}  # no baseline traffic here


@pytest.fixture(scope="module")
def pools(tiny_model_dir) -> Iterator[tuple[LocalPools, Tokenizer]]:
    secret = secrets.token_bytes(32)
    prefix = f"h{os.getpid()}"
    built = {}
    for name, role in (("prefill", "prefill"), ("decode", "decode"), (HOT_POOL, "decode")):
        engine = EngineConfig(model_dir=tiny_model_dir, num_blocks=64, block_size=16)
        built[name] = build_instance(PoolConfig(role=role, engine=engine, prefix=prefix), secret)
    loops = {name: loop.start() for name, (loop, _) in built.items()}
    yield LocalPools(**loops), Tokenizer(tiny_model_dir)
    for loop in loops.values():
        loop.shutdown()
    for _, transport in built.values():
        if transport is not None:
            transport.close()


def _serve(orch: Orchestrator, prompts: list[list[int]]) -> list[tuple[Recorder, object]]:
    async def one(prompt: list[int]):
        out = Recorder()
        return out, await orch.serve(prompt, TextRequest("", PARAMS, exclude_input_in_output=True), out)

    async def every():
        return [await one(p) for p in prompts]  # in order: the group heats up request by request

    return asyncio.run(every())


def _burst(n: int) -> list[list[int]]:
    return [[*SHARED, 900 + i, 950 + i] for i in range(n)]  # the tiny model's vocabulary: 1024


def _decoded(pools: LocalPools, pool: str) -> int:
    return pools.loops[pool].stats().engine_steps


def test_a_hot_group_decodes_on_the_hot_pool_and_cold_requests_do_not(pools):
    local, tokenizer = pools
    orch = Orchestrator(OrchestratorConfig(hot_decode_model="decode_hot", **HOT), local, tokenizer.decode)
    assert HOT_POOL in orch.health, "the hot pool is watched as any other"
    before = _decoded(local, HOT_POOL)
    cold = [[7, 8, 9, 10 + i] * 10 for i in range(3)]
    served = _serve(orch, _burst(5) + cold)
    routes = [outcome.hot_route for _, outcome in served]
    assert routes == ["cold", "cold", "hot_pool", "hot_pool", "hot_pool", "cold", "cold", "cold"]
    assert all(out.error is None and outcome.output_tokens == 6 for out, outcome in served)
    assert _decoded(local, HOT_POOL) - before >= 3 * 5, "the hot pool decoded the hot requests"

    plain = Orchestrator(OrchestratorConfig(hot_threshold=0), local, tokenizer.decode)
    again = _serve(plain, _burst(5))
    assert [o.hot_route for _, o in again] == ["cold"] * 5, "detection off: nothing is hot"
    assert [out.text for out, _ in again] == [out.text for out, _ in served[:5]], (
        "the same text whichever decode pool ran it"
    )


def test_a_hot_pool_that_is_not_healthy_is_passed_by(pools):
    local, tokenizer = pools
    config = OrchestratorConfig(hot_decode_model="decode_hot", **HOT)
    orch = Orchestrator(config, local, tokenizer.decode)
    orch.observe(orch.health[HOT_POOL].failed("call_failed"))
    assert orch.health[HOT_POOL].state is PoolState.GONE
    served = _serve(orch, _burst(4))
    assert [o.hot_route for _, o in served][2:] == ["hot_shared", "hot_shared"]
    assert [out.error for out, _ in served] == [None] * 4


def _bucketed(local, tokenizer, **kw) -> Orchestrator:
    config = OrchestratorConfig(hot_group_burst=1, **HOT, **kw)
    return Orchestrator(config, local, tokenizer.decode)


def test_without_a_hot_pool_a_token_bucket_refuses_a_group_over_its_rate(pools):
    orch = _bucketed(*pools, hot_group_rate=0.001, hot_max_wait_s=0.5)  # one token per 1000 s
    served = _serve(orch, _burst(6))
    routes = [o.hot_route for _, o in served]
    assert routes == ["cold", "cold", "hot_shared"] + ["hot_refused"] * 3, "the burst's one token, then none"
    errors = [out.error for out, _ in served]
    assert errors[:3] == [None] * 3
    assert all(
        e.code == UNAVAILABLE and "hot prompt group" in e.message and "retry after" in e.message
        for e in errors[3:]
    )
    cold = _serve(orch, [[5, 6, 7, 8] * 10])
    assert cold[0][1].hot_route == "cold" and cold[0][0].error is None, "other requests pass"


def test_a_token_bucket_delays_a_burst_and_serves_it(pools):
    orch = _bucketed(*pools, hot_group_rate=100.0, hot_max_wait_s=10.0)  # one token per 10 ms

    async def burst():
        for prompt in _burst(3):  # the group heats up
            await orch.serve(prompt, TextRequest("", PARAMS), Recorder())
        outs = [Recorder() for _ in range(4)]
        runs = [orch.serve(p, TextRequest("", PARAMS), o) for p, o in zip(_burst(4), outs, strict=True)]
        return outs, await asyncio.gather(*runs)

    outs, outcomes = asyncio.run(burst())
    assert all(out.error is None and out.finals == 1 for out in outs)
    routes = [o.hot_route for o in outcomes]
    assert set(routes) <= {"hot_shared", "hot_delayed"} and "hot_delayed" in routes, routes


def test_a_request_waiting_for_its_token_hears_its_client_leave(pools):
    orch = _bucketed(*pools, hot_group_rate=0.001, hot_max_wait_s=10000.0)
    _serve(orch, _burst(3))  # the third took the group's one token
    gone = Recorder(cancel_after=0)
    started = time.monotonic()
    outcome = asyncio.run(orch.serve(_burst(4)[3], TextRequest("", PARAMS), gone))
    assert outcome.hot_route == "hot_delayed" and gone.error is not None and gone.error.code == "CANCELLED"
    assert time.monotonic() - started < 5, "noticed at the next poll, not after the 1000 s wait"


def test_hot_settings_are_checked():
    with pytest.raises(ValueError, match="hot_group_rate"):
        OrchestratorConfig(hot_group_rate=-1)
    with pytest.raises(ValueError, match="hot_min_prefix_tokens"):
        OrchestratorConfig(hot_min_prefix_tokens=0)
    assert HOT_POOL not in OrchestratorConfig(mode="colocated", hot_decode_model="x").pool_models
