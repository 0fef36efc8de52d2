"""Hot-prompt isolation in the orchestrator, over in-process pools: a hot group decodes on the hot
pool while it is healthy, or is held to its group's rate by a token bucket; cold requests are never
touched; the text is the same whichever pool decodes it."""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import time
from collections.abc import Iterator

import pytest
from local_pools import LocalPools
from recorder import Recorder

from disagg.config import ConfigError, build
from disagg.engine.engine import EngineConfig
from disagg.engine.params import SamplingParams
from disagg.engine.tokenizer import Tokenizer
from disagg.hot.settings import HotPromptsConfig
from disagg.pool.instance import PoolConfig, build_instance
from disagg.protocol.errors import UNAVAILABLE
from disagg.protocol.messages import PoolLoad
from disagg.serving.health import PoolState
from disagg.serving.orchestrator import HOT_POOL, Orchestrator, OrchestratorConfig
from disagg.serving.text_api import TextRequest
from disagg.serving.watcher import PoolWatcher

SHARED = list(range(300, 364))  # a 64-token prefix: 4 blocks of 16
PARAMS = SamplingParams(max_tokens=6)
HOT = {"threshold": 3, "min_prefix_tokens": 32, "surge": 0}  # no baseline traffic here


def _hot(**kw) -> OrchestratorConfig:
    """An orchestrator's config with these hot-prompt settings (the rest: ``mode``, given apart)."""
    mode = kw.pop("mode", "disaggregated")
    return OrchestratorConfig(mode=mode, hot_prompts=HotPromptsConfig(**kw))


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
    orch = Orchestrator(_hot(decode_model="decode_hot", **HOT), local, tokenizer.decode)
    assert HOT_POOL in orch.health, "the hot pool is watched as any other"
    before = _decoded(local, HOT_POOL)
    cold = [[7, 8, 9, 10 + i] * 10 for i in range(3)]
    served = _serve(orch, _burst(5) + cold)
    routes = [outcome.hot_route for _, outcome in served]
    assert routes == ["cold", "cold", "hot_pool", "hot_pool", "hot_pool", "cold", "cold", "cold"]
    assert all(out.error is None and outcome.output_tokens == 6 for out, outcome in served)
    assert _decoded(local, HOT_POOL) - before >= 3 * 5, "the hot pool decoded the hot requests"

    plain = Orchestrator(_hot(threshold=0), local, tokenizer.decode)
    again = _serve(plain, _burst(5))
    assert [o.hot_route for _, o in again] == ["cold"] * 5, "detection off: nothing is hot"
    assert [out.text for out, _ in again] == [out.text for out, _ in served[:5]], (
        "the same text whichever decode pool ran it"
    )


def test_a_hot_pool_that_is_not_healthy_is_passed_by(pools):
    local, tokenizer = pools
    config = _hot(decode_model="decode_hot", **HOT)
    orch = Orchestrator(config, local, tokenizer.decode)
    orch.observe(orch.health[HOT_POOL].failed("call_failed"))
    assert orch.health[HOT_POOL].state is PoolState.GONE
    served = _serve(orch, _burst(4))
    assert [o.hot_route for _, o in served][2:] == ["hot_shared", "hot_shared"]
    assert [out.error for out, _ in served] == [None] * 4


def _bucketed(local, tokenizer, **kw) -> Orchestrator:
    config = _hot(group_burst=1, **HOT, **kw)
    return Orchestrator(config, local, tokenizer.decode)


def test_without_a_hot_pool_a_token_bucket_refuses_a_group_over_its_rate(pools):
    orch = _bucketed(*pools, group_rate=0.001, max_wait_s=0.5)  # one token per 1000 s
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
    orch = _bucketed(*pools, group_rate=100.0, max_wait_s=10.0)  # one token per 10 ms

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
    orch = _bucketed(*pools, group_rate=0.001, max_wait_s=10000.0)
    _serve(orch, _burst(3))  # the third took the group's one token
    gone = Recorder(cancel_after=0)
    started = time.monotonic()
    outcome = asyncio.run(orch.serve(_burst(4)[3], TextRequest("", PARAMS), gone))
    assert outcome.hot_route == "hot_delayed" and gone.error is not None and gone.error.code == "CANCELLED"
    assert time.monotonic() - started < 5, "noticed at the next poll, not after the 1000 s wait"


class _Decode:
    """A decode pool's probe answers: ``run(n, step_s)`` runs n engine steps of step_s seconds."""

    def __init__(self) -> None:
        self.steps, self.busy_s = 0, 0.0

    def run(self, n: int, step_s: float) -> PoolLoad:
        self.steps, self.busy_s = self.steps + n, self.busy_s + n * step_s
        return self.load()

    def load(self) -> PoolLoad:
        return PoolLoad(0, 0, 4, 10, 90, busy_s=self.busy_s, engine_steps=self.steps)

    async def ping(self, pool: str) -> PoolLoad:  # the watcher's probes: every pool answers this load
        return self.load()


ADAPTIVE = {"group_rate": 2.0, "rate_adaptive": True, "group_burst": 1, "max_wait_s": 100.0}


def test_an_adaptive_cap_follows_the_decode_pools_step_time_while_a_group_is_hot():
    decode = _Decode()
    orch = Orchestrator(_hot(**ADAPTIVE, **HOT), decode, lambda ids: "")  # type: ignore[arg-type]
    assert orch.hot_rate() == (2.0, {})
    for t in range(4):  # no group hot: the baseline, 10 ms a step
        orch.observe_load("decode", decode.run(50, 0.010), 100.0 + t)
    heats = [orch.heat(prompt, 104.0) for prompt in _burst(3)]
    assert heats[-1].group is not None, "the third of the burst makes its group hot"
    group = heats[-1].group
    for pool in ("prefill", HOT_POOL):
        orch.observe_load(pool, decode.run(50, 0.050), 105.0)  # not the shared decode pool's
    assert orch.hot_rate() == (2.0, {}), "only the shared decode pool drives the cap"
    orch.observe_load("decode", decode.run(50, 0.050), 106.0)  # (the others' steps are one interval)
    assert orch.hot_rate() == (1.0, {("decrease", "step_time"): 1})
    # the group's bucket refills at the cap: its burst's one token, then one a second
    assert orch.hot_wait(group, 106.0) == 0.0
    assert orch.hot_wait(group, 106.0) == pytest.approx(1.0)
    orch.observe_load("decode", decode.run(50, 0.050), 107.0)
    assert orch.hot_rate()[0] == 0.5
    # the second one's token came at 107 (refilled at 1/s until then): the next one's at 0.5/s
    assert orch.hot_wait(group, 107.0) == pytest.approx(2.0)

    fixed = Orchestrator(_hot(group_rate=2.0, **HOT), decode, lambda ids: "")  # type: ignore[arg-type]
    fixed.observe_load("decode", decode.run(50, 0.050), 108.0)
    assert fixed.throttle is None and fixed.hot_rate() == (2.0, {}), "a fixed cap ignores the loads"
    assert Orchestrator(OrchestratorConfig(), decode, lambda ids: "").hot_rate() == (0.0, {})  # type: ignore[arg-type]


def test_the_watcher_feeds_the_adaptive_cap_the_decode_pools_probe_answers():
    decode = _Decode()
    config = _hot(**ADAPTIVE, **HOT)
    orch = Orchestrator(config, decode, lambda ids: "", deployed=("prefill", "decode"))  # type: ignore[arg-type]
    now = [100.0]
    watcher = PoolWatcher(orch, clock=lambda: now[0])

    async def rounds() -> None:
        for step_s in (0.010, 0.010, 0.020):
            decode.run(50, step_s)
            now[0] += 1.0
            await watcher.probe_all()

    asyncio.run(rounds())
    throttle = orch.throttle
    assert throttle is not None and throttle.step_s == pytest.approx(0.020)
    assert throttle.baseline == pytest.approx(0.2 * 0.020 + 0.8 * 0.010), "the first answer anchors"


def test_a_colocated_entry_point_adapts_to_the_colocated_pool():
    decode = _Decode()
    orch = Orchestrator(_hot(mode="colocated", **ADAPTIVE), decode, lambda ids: "")  # type: ignore[arg-type]
    for t in range(2):
        orch.observe_load("colocated", decode.run(50, 0.010), 100.0 + t)
    assert orch.throttle is not None and orch.throttle.baseline == pytest.approx(0.010)


def test_hot_settings_are_checked_and_named_by_their_section():
    def refused(params: dict[str, str], message: str) -> None:
        with pytest.raises(ConfigError, match=message):
            build(OrchestratorConfig, params, strings=True)

    refused({"hot_prompts.group_rate": "-1"}, r"hot_prompts\.group_rate: must be")
    refused({"hot_prompts.rate_adaptive": "true"}, r"hot_prompts\.rate_adaptive: needs group_rate")
    # under the default minimum
    refused({"hot_prompts.group_rate": "0.05", "hot_prompts.rate_adaptive": "1"}, r"hot_prompts\.rate_min")
    refused({"hot_prompts.step_ratio": "0.9"}, r"hot_prompts\.step_ratio")  # checked with the cap fixed too
    refused({"hot_prompts.rate_decrease": "1.5"}, r"hot_prompts\.rate_decrease")
    refused({"hot_prompts.rate_adaptive": "maybe"}, r"hot_prompts\.rate_adaptive: must be one of")
    refused({"hot_prompts.min_prefix_tokens": "0"}, r"hot_prompts\.min_prefix_tokens")
    refused({"hot_prompts.nope": "1"}, r"hot_prompts: unknown key\(s\) nope")
    refused({"hot_prompts.group_rate": "1", "hot_prompts": "x"}, "given whole and by its keys")
    parsed = build(
        OrchestratorConfig,
        {
            "hot_prompts.group_rate": "3",
            "hot_prompts.rate_adaptive": "true",
            "hot_prompts.step_ratio": "1.25",
            "hot_prompts.rate_min": "0.5",
        },
        strings=True,
    )
    throttle = parsed.hot_prompts.throttle
    assert throttle is not None
    assert (throttle.max_rate, throttle.step_ratio, throttle.min_rate) == (3.0, 1.25, 0.5)
    assert _hot(mode="colocated", decode_model="x").pool_models.keys() == {"prefill", "decode", "colocated"}


def test_the_old_flat_hot_parameters_load_with_a_warning_naming_the_new_key(caplog):
    with caplog.at_level(logging.WARNING, logger="disagg.config"):
        old = build(OrchestratorConfig, {"hot_group_rate": "3", "hot_threshold": "2"}, strings=True)
    assert old.hot_prompts == HotPromptsConfig(group_rate=3.0, threshold=2)
    assert "hot_group_rate is deprecated" in caplog.text and "hot_prompts.group_rate" in caplog.text
    with pytest.raises(ConfigError, match=r"give hot_prompts\.group_rate only"):
        build(OrchestratorConfig, {"hot_group_rate": "3", "hot_prompts.group_rate": "2"}, strings=True)
