"""Degradation over in-process pools: a pool that fails mid-stream or is gone moves requests down the
fallback ladder (local decode in the prefill pool, then colocated, then shedding), a migrated stream
continues with nothing repeated or lost, and every pool's blocks come back."""

from __future__ import annotations

import asyncio
import os
import secrets
import time
from collections.abc import AsyncIterator, Iterator

import pytest
from local_pools import LocalPools
from recorder import Recorder

from disagg.engine.engine import Engine, EngineConfig
from disagg.engine.params import SamplingParams
from disagg.engine.sequence import Request, SequenceState
from disagg.engine.tokenizer import Tokenizer
from disagg.kv.settings import KVSettings
from disagg.pool.instance import PoolConfig, build_instance
from disagg.pool.offline import generate
from disagg.protocol.errors import INVALID_ARG, PROBE_UNANSWERED, UNAVAILABLE, Reason, ServingError
from disagg.protocol.messages import PoolLoad, Token
from disagg.serving import health
from disagg.serving.health import PoolState
from disagg.serving.ladder import Route
from disagg.serving.orchestrator import Orchestrator, OrchestratorConfig
from disagg.serving.settings import DegradationSettings, HealthSettings
from disagg.serving.text_api import TextRequest
from disagg.serving.watcher import PoolWatcher
from disagg.triton.glue import untagged_error

PROMPT = "The quick brown fox"
DEAD = "the decode pool stopped responding"


class FlakyPools(LocalPools):
    """In-process pools where a named pool can die: its streams fail after ``tokens_before_death``
    tokens, and its later calls and pings fail at once, as a killed stub's do under Triton."""

    def __init__(self, loops, tokens_before_death: int | None = None) -> None:
        super().__init__(**loops)
        self.dead: set[str] = set()
        self.handles: list[tuple[str, str]] = []  # (pool, job handle) of each decode and generate call
        self.dying: str | None = None
        self.tokens_before_death = tokens_before_death

    def _check(self, pool: str) -> None:
        if pool in self.dead:
            raise ServingError(UNAVAILABLE, f"the {pool} pool stopped responding")

    async def _dying(self, pool: str, handle: str, tokens: AsyncIterator[Token]) -> AsyncIterator[Token]:
        count = 0
        async for token in tokens:
            if pool == self.dying and count == self.tokens_before_death:
                await super().stop(pool, handle)  # its sequence dies with it
                self.dead.add(pool)
                raise ServingError(UNAVAILABLE, f"the {pool} pool stopped responding")
            count += 1
            yield token

    async def prefill(self, handle, request):
        self._check("prefill")
        return await super().prefill(handle, request)

    def decode(self, handle, state, descriptor, pool="decode"):
        self.handles.append((pool, handle))
        self._check(pool)
        return self._dying(pool, handle, super().decode(handle, state, descriptor, pool))

    def generate(self, handle, request, pool="colocated"):
        self.handles.append((pool, handle))
        self._check(pool)
        return self._dying(pool, handle, super().generate(handle, request, pool))

    async def stop(self, pool, handle):
        if pool not in self.dead:
            await super().stop(pool, handle)

    async def ping(self, pool):
        self._check(pool)
        return await super().ping(pool)


@pytest.fixture(scope="module")
def loops(tiny_model_dir) -> Iterator[dict]:
    secret = secrets.token_bytes(32)
    prefix = f"g{os.getpid()}"
    built = {}
    for role in ("prefill", "decode", "colocated"):
        engine = EngineConfig(model_dir=tiny_model_dir, num_blocks=96, block_size=16)
        config = PoolConfig(
            role=role,
            engine=engine,
            kv=KVSettings(lease_ttl_s=5.0),
            prefix=prefix,
            local_decode=role == "prefill",
        )
        built[role] = build_instance(config, secret)
    started = {role: loop.start() for role, (loop, _) in built.items()}
    yield started
    for loop in started.values():
        loop.shutdown()
    for _, transport in built.values():
        if transport is not None:
            transport.close()


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir) -> Tokenizer:
    return Tokenizer(tiny_model_dir)


@pytest.fixture(scope="module")
def reference(tiny_model_dir, tokenizer):
    engine = Engine(EngineConfig(model_dir=tiny_model_dir, num_blocks=96, block_size=16))

    def text_of(prompt: str, params: SamplingParams) -> str:
        return tokenizer.decode(generate(engine, Request(tuple(tokenizer.encode(prompt)), params))[0])

    return text_of


def _clean(loops, timeout_s: float = 10.0) -> bool:
    """Every pool's blocks back (polled: a stop reaches a pool's engine thread asynchronously)."""

    def clean() -> bool:
        return all(
            loop.engine.kv.free_blocks == loop.engine.kv.num_blocks and not loop.engine.held_sequences()
            for loop in loops.values()
        )

    deadline = time.monotonic() + timeout_s
    while not clean():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def _serve(orchestrator, tokenizer, text: TextRequest, recorder: Recorder | None = None):
    recorder = recorder or Recorder()
    outcome = asyncio.run(orchestrator.serve(tokenizer.encode(text.prompt), text, recorder))
    return outcome, recorder


def _orchestrator(pools, tokenizer, mode: str = "disaggregated", **degradation) -> Orchestrator:
    """An orchestrator over ``pools`` with ``degradation`` settings; the local rung comes before the
    colocated one even while the decode pool is gone, unless a test asks otherwise (most here are about
    the local rung)."""
    degradation.setdefault("colocated_first_when_decode_gone", False)
    config = OrchestratorConfig(mode=mode, degradation=DegradationSettings(**degradation))
    return Orchestrator(config, pools, tokenizer.decode)


@pytest.mark.parametrize("dying", ["decode", "prefill", "colocated"])
@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_a_stream_whose_pool_dies_continues_on_the_next_rung(loops, tokenizer, reference, dying, sampled):
    """decode dies: local decode in the prefill pool takes over; the prefill pool's local decode dies:
    colocated does; colocated dies (a colocated entry point): the disaggregated pools can't resume a
    stream, local decode does. The client's text is the uninterrupted text (float32, seeded draws)."""
    params = SamplingParams(max_tokens=24, temperature=0.9 if sampled else 0.0, top_k=40, seed=99)
    expected = reference(PROMPT, params)
    pools = FlakyPools(loops, tokens_before_death=6)
    pools.dying = dying
    if dying == "prefill":  # only its local decode streams: the decode pool is gone from the start
        pools.dead.add("decode")
    mode = "colocated" if dying == "colocated" else "disaggregated"
    orchestrator = _orchestrator(pools, tokenizer, mode=mode)
    if dying == "prefill":
        orchestrator.observe(orchestrator.health["decode"].failed("probe_failed"))

    outcome, recorder = _serve(orchestrator, tokenizer, TextRequest(PROMPT, params, stream=True))

    assert recorder.error is None and recorder.finals == 1
    assert recorder.text == expected, "one stream: nothing repeated, nothing lost"
    assert outcome.output_tokens == 24 and sum(recorder.tokens) == 24
    assert outcome.migrations == 1
    assert outcome.rung == {"decode": "local", "prefill": "colocated", "colocated": "local"}[dying]
    assert orchestrator.health[dying].state is PoolState.GONE
    # the resumed job has a handle of its own: a pool still holding the first attempt's cannot refuse it
    handles = [handle for _, handle in pools.handles]
    assert handles[-1] == f"{outcome.handle}~1" and handles[0] == outcome.handle, pools.handles
    assert _clean(loops)


def test_while_decode_is_gone_the_colocated_rung_comes_before_the_local_one(loops, tokenizer, reference):
    """By default a gone decode pool sends new requests and migrating streams to the colocated pool
    (the dead pool's cores are free for it), with no output cap; a saturated one keeps the order."""
    params = SamplingParams(max_tokens=24)
    pools = FlakyPools(loops, tokens_before_death=6)
    pools.dying = "decode"
    orchestrator = _orchestrator(pools, tokenizer, colocated_first_when_decode_gone=True)
    assert orchestrator.ladder.mode == "disaggregated"

    moved, recorder = _serve(orchestrator, tokenizer, TextRequest(PROMPT, params, stream=True))
    later, _ = _serve(orchestrator, tokenizer, TextRequest(PROMPT, SamplingParams(max_tokens=200)))

    assert recorder.error is None and recorder.text == reference(PROMPT, params)
    assert moved.migrations == 1 and moved.rung == "colocated"
    assert moved.fallbacks == [Route("colocated", "disaggregated", "decode_failed")]
    assert later.rung == "colocated" and not later.capped and later.output_tokens == 200
    assert later.fallbacks == [Route("colocated", "disaggregated", "decode_gone")]
    assert orchestrator.ladder.mode == "colocated"
    orchestrator.observe(orchestrator.health["colocated"].failed("probe_failed"))
    assert orchestrator.ladder.mode == "local", "the local rung stays next"
    assert _clean(loops)


def test_a_saturated_decode_pool_keeps_the_local_rung_first(loops, tokenizer):
    pools = FlakyPools(loops)
    orchestrator = _orchestrator(pools, tokenizer, colocated_first_when_decode_gone=True)
    orchestrator.observe(orchestrator.health["decode"].refused())
    assert orchestrator.health["decode"].state is PoolState.SATURATED
    assert orchestrator.ladder.mode == "local"
    outcome, _ = _serve(orchestrator, tokenizer, TextRequest(PROMPT, SamplingParams(max_tokens=4)))
    assert outcome.rung == "local" and outcome.fallbacks == [
        Route("local", "disaggregated", "decode_saturated")
    ]
    assert _clean(loops)


def test_new_requests_skip_a_gone_pool_and_count_why(loops, tokenizer, reference):
    params = SamplingParams(max_tokens=10)
    pools = FlakyPools(loops)
    pools.dead.add("decode")
    orchestrator = _orchestrator(pools, tokenizer)

    first, _ = _serve(orchestrator, tokenizer, TextRequest(PROMPT, params))  # finds decode dead mid-way
    later, recorder = _serve(orchestrator, tokenizer, TextRequest(PROMPT, params, stream=True))

    assert first.error is None and first.migrations == 1
    assert first.fallbacks == [Route("local", "disaggregated", "decode_failed")]
    assert later.migrations == 0 and later.rung == "local"
    assert later.fallbacks == [Route("local", "disaggregated", "decode_gone")]
    assert orchestrator.ladder.mode == "local"
    assert recorder.text == reference(PROMPT, params)
    assert _clean(loops)


def test_the_local_rung_caps_the_output_and_says_so(loops, tokenizer, reference):
    pools = FlakyPools(loops)
    orchestrator = _orchestrator(pools, tokenizer, local_max_tokens=5)
    orchestrator.observe(orchestrator.health["decode"].failed("probe_failed"))

    outcome, recorder = _serve(orchestrator, tokenizer, TextRequest(PROMPT, SamplingParams(max_tokens=40)))

    assert outcome.capped and outcome.output_tokens == 5 and recorder.finish_reason == "length"
    assert recorder.text == PROMPT + reference(PROMPT, SamplingParams(max_tokens=5))
    assert _clean(loops)


def test_the_local_rung_lowers_a_minimum_length_above_its_cap(loops, tokenizer, reference):
    pools = FlakyPools(loops)
    orchestrator = _orchestrator(pools, tokenizer, local_max_tokens=5)
    orchestrator.observe(orchestrator.health["decode"].failed("probe_failed"))
    params = SamplingParams(max_tokens=40, min_length=30)

    outcome, recorder = _serve(orchestrator, tokenizer, TextRequest(PROMPT, params))

    assert outcome.error is None and outcome.capped and outcome.output_tokens == 5
    assert recorder.finish_reason == "length"
    assert recorder.text == PROMPT + reference(PROMPT, SamplingParams(max_tokens=5, min_length=5))
    assert _clean(loops)


def test_with_no_pool_left_requests_are_shed_at_once_with_a_retry_hint(loops, tokenizer):
    pools = FlakyPools(loops)
    orchestrator = _orchestrator(pools, tokenizer, retry_after_s=7)
    for pool in ("prefill", "decode", "colocated"):
        orchestrator.observe(orchestrator.health[pool].failed("probe_failed"))

    outcome, recorder = _serve(orchestrator, tokenizer, TextRequest(PROMPT, SamplingParams(max_tokens=8)))

    assert recorder.error.code == UNAVAILABLE and "retry after 7 s" in recorder.error.message
    assert outcome.rung == "shed" and outcome.first_token_at is None
    assert _clean(loops)


def test_the_migration_limit_ends_a_stream_with_its_error(loops, tokenizer):
    pools = FlakyPools(loops, tokens_before_death=3)
    pools.dying = "decode"
    orchestrator = _orchestrator(pools, tokenizer, migration_limit=0)

    outcome, recorder = _serve(orchestrator, tokenizer, TextRequest(PROMPT, SamplingParams(16), stream=True))

    assert recorder.error.code == UNAVAILABLE and DEAD in recorder.error.message
    assert outcome.migrations == 0 and outcome.output_tokens == 4  # the first token, then 3 from decode
    assert _clean(loops)


def test_a_bad_request_is_not_migrated(loops, tokenizer):
    orchestrator = _orchestrator(FlakyPools(loops), tokenizer)
    text = TextRequest(PROMPT, SamplingParams(max_tokens=10**6))
    outcome, recorder = _serve(orchestrator, tokenizer, text)
    assert recorder.error.code == INVALID_ARG and outcome.migrations == 0
    assert all(h.state is PoolState.HEALTHY for h in orchestrator.health.values())


def test_a_prefill_pool_without_local_generate_refuses_whole_requests(tiny_model_dir):
    engine = EngineConfig(model_dir=tiny_model_dir, num_blocks=32, block_size=16)
    loop, transport = build_instance(PoolConfig(role="prefill", engine=engine), secrets.token_bytes(32))
    try:
        pools = LocalPools(prefill=loop.start())
        state = SequenceState((1, 2, 3), (), SamplingParams(max_tokens=4))

        async def attempt():
            async for _ in pools.generate("h", Request.resuming(state), "prefill"):
                pass

        with pytest.raises(ServingError, match="does not run generate jobs"):
            asyncio.run(attempt())
    finally:
        loop.shutdown()
        transport.close()


class _ScriptedPools:
    """Pings answered from a script per pool: a PoolLoad, or an exception to raise."""

    def __init__(self) -> None:
        self.answers: dict[str, object] = {}

    async def ping(self, pool: str) -> PoolLoad:
        answer = self.answers.get(pool, PoolLoad(0, 0, 0, 0, 10))
        if isinstance(answer, BaseException):
            raise answer
        return answer


def test_the_watcher_finds_a_dead_pool_restarts_it_once_per_backoff_and_times_its_recovery():
    now = [100.0]
    pools = _ScriptedPools()
    restarted: list[str] = []

    async def restart(pool: str) -> None:
        restarted.append(pool)

    orchestrator = Orchestrator(
        OrchestratorConfig(health=HealthSettings(recovery_backoff_s=5)),
        pools,
        lambda ids: "",
        deployed=("prefill", "decode"),
    )
    watcher = PoolWatcher(orchestrator, restart, clock=lambda: now[0], restart_delay_s=0)

    async def rounds() -> None:
        async def at(t: float) -> None:
            now[0] = t
            await watcher.probe_all()
            await asyncio.sleep(0)  # let a restart it started run

        pools.answers["decode"] = ServingError(UNAVAILABLE, DEAD)
        await at(99.0)  # one missed probe says nothing yet
        assert orchestrator.health["decode"].state is PoolState.HEALTHY
        await at(100.0)  # two: gone (dead); the restart waits one probe round (1 s)
        assert restarted == []
        await at(101.5)  # still silent: first restart
        await at(104.0)  # within the backoff (5 s): none
        assert restarted == ["decode"]
        await at(107.0)  # backoff passed: second restart (the next waits 10 s)
        pools.answers.pop("decode")
        await at(108.0)  # one answered probe: not yet trusted
        assert orchestrator.health["decode"].state is PoolState.GONE
        await at(109.0)  # two: healthy again

    asyncio.run(rounds())
    assert restarted == ["decode", "decode"]
    assert orchestrator.health["decode"].state is PoolState.HEALTHY
    assert orchestrator.health["prefill"].state is PoolState.HEALTHY
    assert watcher.recovered == [("decode", 9.0)]
    assert orchestrator.ladder.mode == "disaggregated"


def test_a_pool_that_answers_again_before_its_restart_is_not_restarted():
    now = [0.0]
    pools = _ScriptedPools()
    restarted: list[str] = []

    async def restart(pool: str) -> None:
        restarted.append(pool)

    orchestrator = Orchestrator(OrchestratorConfig(), pools, lambda ids: "", deployed=("prefill", "decode"))
    watcher = PoolWatcher(orchestrator, restart, clock=lambda: now[0], restart_delay_s=0)

    async def rounds() -> None:
        pools.answers["decode"] = TimeoutError()  # one slow answer
        await watcher.probe_all()
        pools.answers.pop("decode")
        for t in (1.0, 2.0):
            now[0] = t
            await watcher.probe_all()
            await asyncio.sleep(0)

    asyncio.run(rounds())
    assert restarted == [] and orchestrator.health["decode"].state is PoolState.HEALTHY


def test_a_probe_that_does_not_answer_in_time_finds_the_pool_gone():
    class Hanging(_ScriptedPools):
        async def ping(self, pool: str) -> PoolLoad:
            if pool == "decode":
                await asyncio.Event().wait()
            return await super().ping(pool)

    orchestrator = Orchestrator(
        OrchestratorConfig(health=HealthSettings(probe_timeout_s=0.05)),
        Hanging(),
        lambda ids: "",
        deployed=("prefill", "decode"),
    )
    watcher = PoolWatcher(orchestrator)

    async def rounds() -> None:
        for _ in range(2):
            await watcher.probe_all()

    asyncio.run(rounds())
    assert orchestrator.health["decode"].state is PoolState.GONE
    assert orchestrator.ladder.mode == "local"


def test_a_pool_being_unloaded_is_gone_but_never_restarted_and_a_dead_one_is():
    """Not ready (a shutdown, an operator's unload): routed around, left alone. Ready but silent (a
    dead stub, which Triton 2.51 still reports ready), also after a call found it first: restarted."""
    now = [0.0]
    pools = _ScriptedPools()
    ready = {"prefill": False, "decode": True}
    restarted: list[str] = []

    async def is_ready(pool: str) -> bool:
        return ready[pool]

    async def restart(pool: str) -> None:
        restarted.append(pool)

    orchestrator = Orchestrator(OrchestratorConfig(), pools, lambda ids: "", deployed=("prefill", "decode"))
    watcher = PoolWatcher(orchestrator, restart, clock=lambda: now[0], is_ready=is_ready, restart_delay_s=0)
    orchestrator.pool_failed("decode", untagged_error("Stub process 'decode_0_0' is not healthy."))

    async def rounds() -> None:
        for pool in ("prefill", "decode"):
            pools.answers[pool] = ServingError(UNAVAILABLE, "no answer")
        for t in (0.0, 2.0, 4.0):
            now[0] = t
            await watcher.probe_all()
            await asyncio.sleep(0)

    asyncio.run(rounds())
    assert {p: h.state for p, h in orchestrator.health.items()} == {
        "prefill": PoolState.GONE,
        "decode": PoolState.GONE,
    }
    assert (
        orchestrator.health["prefill"].reason == "not_ready"
        and orchestrator.health["decode"].reason == "dead"
    )
    assert restarted == ["decode"]


def test_a_call_told_the_stub_is_dead_gets_the_pool_restarted_without_waiting_for_probes():
    """Triton answers a call to an instance whose stub died "Stub process '...' is not healthy": the
    pool is dead at once (its open calls are given up by the listener) and the watcher restarts it
    after one probe round, although its own probes never missed. A later call that merely went
    unanswered does not make it less dead (a ``call_failed`` pool would not be restarted)."""
    now = [0.0]
    pools = _ScriptedPools()
    restarted: list[str] = []
    told: list[tuple[str, str]] = []

    async def restart(pool: str) -> None:
        restarted.append(pool)

    orchestrator = Orchestrator(
        OrchestratorConfig(),
        pools,
        lambda ids: "",
        deployed=("prefill", "decode"),
        on_change=lambda change: told.append((change.pool, change.reason)),
    )
    watcher = PoolWatcher(orchestrator, restart, clock=lambda: now[0], restart_delay_s=0)

    async def rounds() -> None:
        pools.answers["decode"] = TimeoutError()  # pings to a dead stub hang on Triton 2.51
        # Triton's own message, classified where it enters (glue.untagged_error)
        orchestrator.pool_failed("decode", untagged_error("Stub process 'decode_0_0' is not healthy."))
        orchestrator.pool_failed("decode", ServingError(UNAVAILABLE, "the decode pool stopped responding"))
        assert (orchestrator.health["decode"].state, orchestrator.health["decode"].reason) == (
            PoolState.GONE,
            health.DEAD,
        )
        assert watcher.gone_for("decode") == 0.0
        for t in (0.5, 1.0):
            now[0] = t
            await watcher.probe_all()
            await asyncio.sleep(0)

    asyncio.run(rounds())
    assert told == [("decode", health.DEAD)]
    assert restarted == ["decode"]


def test_a_pool_whose_stub_is_known_dead_is_dead_without_a_probe_and_restarted():
    """The orchestrator's model knows its pools' stub processes (``triton.stubs``): one that died makes
    its pool dead at the next round, with no ping sent and none missed, and the pool is restarted."""
    now = [0.0]
    pinged: list[str] = []

    class Counted(_ScriptedPools):
        async def ping(self, pool: str) -> PoolLoad:
            pinged.append(pool)
            return await super().ping(pool)

    pools = Counted()
    pools.answers["decode"] = TimeoutError()  # a ping to a dead stub hangs
    restarted: list[str] = []
    dead = {"decode"}

    async def restart(pool: str) -> None:
        restarted.append(pool)

    orchestrator = Orchestrator(OrchestratorConfig(), pools, lambda ids: "", deployed=("prefill", "decode"))
    watcher = PoolWatcher(
        orchestrator, restart, clock=lambda: now[0], restart_delay_s=0, stub_dead=lambda pool: pool in dead
    )

    async def rounds() -> None:
        await watcher.probe_all()
        assert (orchestrator.health["decode"].state, orchestrator.health["decode"].reason) == (
            PoolState.GONE,
            health.DEAD,
        )
        assert orchestrator.health["prefill"].state is PoolState.HEALTHY and pinged == ["prefill"]
        dead.clear()  # forgotten once found gone (``StubWatch.forget``)
        now[0] = 1.0
        await watcher.probe_all()
        await asyncio.sleep(0)

    asyncio.run(rounds())
    assert restarted == ["decode"]


def test_an_overloaded_pool_whose_call_goes_unanswered_stays_saturated_not_gone():
    """Under overload a call's probe can time out on a pool the watcher hears (slowly): that pool is
    saturated, not gone (gone sheds everything routed to it). The same failure on a pool the
    watcher finds healthy still makes it gone: the watcher has not heard of trouble yet."""
    orchestrator = Orchestrator(
        OrchestratorConfig(), _ScriptedPools(), lambda ids: "", deployed=("prefill", "decode")
    )
    unanswered = ServingError(
        UNAVAILABLE, f"the prefill pool stopped responding ({PROBE_UNANSWERED})", Reason.UNANSWERED
    )
    orchestrator.observe(orchestrator.health["prefill"].refused())  # saturated, as the watcher found
    assert orchestrator.health["prefill"].state is PoolState.SATURATED
    orchestrator.pool_failed("prefill", unanswered)
    assert orchestrator.health["prefill"].state is PoolState.SATURATED
    orchestrator.pool_failed(
        "decode",
        ServingError(UNAVAILABLE, unanswered.message.replace("prefill", "decode"), Reason.UNANSWERED),
    )
    assert orchestrator.health["decode"].state is PoolState.GONE


class LeaseLosingPools(LocalPools):
    """In-process pools where the prefill pool has let go of a sequence's KV (its lease expired)
    before the decode pool imports it."""

    def __init__(self, loops) -> None:
        super().__init__(**loops)
        self.prefill_loop = loops["prefill"]

    def decode(self, handle, state, descriptor, pool="decode"):
        lease_id = self.prefill_loop.transport.verify(descriptor).lease_id
        assert self.prefill_loop.abort_lease(lease_id)
        return super().decode(handle, state, descriptor, pool)


def test_a_lost_kv_lease_is_re_prefilled_and_counted_without_blaming_the_decode_pool(
    loops, tokenizer, reference
):
    params = SamplingParams(max_tokens=12)
    orchestrator = _orchestrator(LeaseLosingPools(loops), tokenizer)

    outcome, recorder = _serve(orchestrator, tokenizer, TextRequest(PROMPT, params, stream=True))

    assert recorder.error is None and recorder.finals == 1
    assert recorder.text == reference(PROMPT, params), "one stream: nothing repeated, nothing lost"
    assert outcome.migrations == 1 and outcome.rung == "local"
    assert outcome.fallbacks == [Route("local", "disaggregated", "kv_lease_lost")]
    assert orchestrator.health["decode"].state is PoolState.HEALTHY, "the decode pool did nothing wrong"
    assert orchestrator.ladder.mode == "disaggregated"
    assert _clean(loops)


@pytest.mark.parametrize("enabled", [True, False])
def test_while_degraded_sheddable_requests_are_shed_first(loops, tokenizer, reference, enabled):
    """Decode is gone, so new requests take the capped local rung: a request of negative priority is
    refused at once with the retry hint instead (unless the setting is off), a normal one is served."""
    pools = FlakyPools(loops)
    pools.dead.add("decode")
    orchestrator = _orchestrator(pools, tokenizer, retry_after_s=3, shed_sheddable=enabled)
    orchestrator.observe(orchestrator.health["decode"].failed("probe_failed"))
    params = SamplingParams(max_tokens=8)

    shed, refused = _serve(orchestrator, tokenizer, TextRequest(PROMPT, params, priority=-1))
    served, recorder = _serve(orchestrator, tokenizer, TextRequest(PROMPT, params, stream=True, priority=0))

    assert recorder.error is None and served.rung == "local" and recorder.text == reference(PROMPT, params)
    if enabled:
        assert refused.error.code == UNAVAILABLE and "retry after 3 s" in refused.error.message
        assert shed.rung == "shed" and shed.first_token_at is None
        assert shed.fallbacks == [Route("shed", "disaggregated", "sheddable_while_degraded")]
    else:
        assert refused.error is None and shed.rung == "local"
    assert _clean(loops)


def test_a_healthy_server_serves_sheddable_requests_on_the_first_rung(loops, tokenizer):
    orchestrator = _orchestrator(FlakyPools(loops), tokenizer)
    outcome, recorder = _serve(orchestrator, tokenizer, TextRequest(PROMPT, SamplingParams(4), priority=-5))
    assert recorder.error is None and outcome.rung == "disaggregated" and outcome.fallbacks == []
    assert _clean(loops)


def test_a_restart_left_to_another_entry_point_is_not_counted_and_the_death_is_dated():
    """`restart` answers False when another entry point's watcher restarted the pool since this one
    found it dead (`disagg.control`): no restart is counted here. `gone_for` dates the death."""
    now = [100.0]
    pools = _ScriptedPools()
    counted: list[str] = []
    seen: list[float | None] = []

    async def restart(pool: str) -> bool:
        seen.append(watcher.gone_for(pool))
        return False

    orchestrator = Orchestrator(OrchestratorConfig(), pools, lambda ids: "", deployed=("prefill", "decode"))
    watcher = PoolWatcher(
        orchestrator, restart, clock=lambda: now[0], on_restart=counted.append, restart_delay_s=0
    )

    async def rounds() -> None:
        pools.answers["decode"] = ServingError(UNAVAILABLE, DEAD)
        for t in (99.0, 100.0, 101.5):
            now[0] = t
            await watcher.probe_all()
            await asyncio.sleep(0)

    asyncio.run(rounds())
    assert seen == [1.5], "found dead at 100.0, restarted at 101.5"
    assert counted == [] and watcher.restarts == 1
    assert watcher.gone_for("prefill") is None
