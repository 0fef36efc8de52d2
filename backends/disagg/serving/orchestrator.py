"""The orchestrator: one request's path through the pools, in plain asyncio.

disaggregated: prefill pool (first token + KV descriptor) -> first piece sent at once -> decode pool
(imports the KV, streams the rest). colocated: one pool does both. The orchestrator detokenizes
incrementally, applies stop strings, a deadline and cancellation (a stop request to the pool that
runs the sequence, which between the two legs is the prefill pool holding its KV), and maps every
failure to a ServingError. Exactly one final response per request, in every case.

Which way a request goes is the fallback ladder's choice (``disagg.serving.ladder``), from the pools'
health (``disagg.serving.health``, fed by the calls made here and by ``disagg.serving.watcher``'s
probes). A stream whose pool fails mid-way *migrates*: it continues on the next rung, which re-prefills
the prompt and the tokens already sent, so the client sees one stream with nothing repeated or lost.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import ClassVar, Literal, Protocol, TypeVar

from disagg.engine.sequence import FINISH_LENGTH, Request, SequenceState
from disagg.hot.bucket import TokenBucket
from disagg.hot.hotness import GroupRate, Heat, HotPrompts
from disagg.hot.settings import HOT_PROMPTS_FIELDS, HotPromptsConfig
from disagg.hot.throttle import Throttle
from disagg.protocol.errors import (
    CANCELLED,
    DEADLINE,
    UNAVAILABLE,
    Reason,
    ServingError,
    classify,
)
from disagg.protocol.messages import JobId, PoolLoad, Prefilled, Token
from disagg.serving.admission import Admission, AdmissionConfig, Ticket
from disagg.serving.health import CALL_FAILED, DEAD, Change, HealthConfig, PoolHealth, PoolState
from disagg.serving.ladder import (
    COLOCATED,
    CONDITIONAL,
    DISAGGREGATED,
    LOCAL,
    SHED,
    Ladder,
    Route,
    ladder_pools,
    parse_ladder,
)
from disagg.serving.reply import Reply
from disagg.serving.router import (
    HOT_BUCKET,
    HOT_POOL_ROUTE,
    Action,
    Disaggregate,
    Finish,
    Generate,
    GiveUp,
    Migrate,
    PoolsView,
    RequestState,
    Router,
    RouterConfig,
    Shed,
    SkipLocal,
    hot_refusal,
)
from disagg.serving.settings import (
    ADMISSION_FIELDS,
    AdmissionSettings,
    CancelSettings,
    ConditionalSettings,
    DegradationSettings,
    HealthSettings,
    RemoteSettings,
)
from disagg.serving.telemetry import SloConfig, time_per_output_token
from disagg.serving.text_api import TextRequest

log = logging.getLogger(__name__)

T = TypeVar("T")

MODES = ("disaggregated", "colocated")


class PoolClient(Protocol):
    """How the orchestrator reaches the pools (BLS inside Triton; in-process in tests)."""

    async def prefill(self, handle: str, request: Request) -> Prefilled: ...

    def decode(
        self, handle: str, state: SequenceState, descriptor: bytes, pool: str = "decode"
    ) -> AsyncIterator[Token]: ...

    def generate(self, handle: str, request: Request, pool: str = "colocated") -> AsyncIterator[Token]: ...

    async def stop(self, pool: str, handle: str) -> None:
        """Stop job ``handle`` on ``pool``: out of its queue, its sequence freed, or (the prefill pool,
        after its prefill) the KV it holds under a lease for the decode pool given back."""

    async def ping(self, pool: str) -> PoolLoad: ...


class Responder(Protocol):
    """The client side of one request.

    ``send`` carries, beside the text, ``tokens``: how many tokens the engine generated since the
    previous ``send`` of this request (their sum is every token generated, an end token included), and
    on the final one ``finish_reason``: ``"stop"`` (an end token or a stop string) or ``"length"``
    (``max_tokens`` reached).
    """

    def send(self, text: str, final: bool, tokens: int = 0, finish_reason: str | None = None) -> None: ...

    def fail(self, error: ServingError) -> None: ...

    def is_cancelled(self) -> bool: ...


MAX_INFLIGHT_LIMIT = 65536
HOT_POOL = "decode_hot"
HOT_ROUTES = ("cold", "hot_shared", "hot_pool", "hot_delayed", "hot_refused")
"""How a new request was routed by hotness (``disagg_hot_routes_total``): not in a hot group; hot and
served as any other (no isolation configured, or its bucket had a token); hot and decoded on the hot
pool; hot and held back by its group's token bucket; hot and refused (the bucket's wait too long)."""


@dataclass(frozen=True)
class OrchestratorConfig:
    """One orchestrator instance: the ``orchestrator`` / ``llm`` models' config.pbtxt parameters, parsed
    once by ``disagg.config.build(OrchestratorConfig, params, strings=True)``; unknown keys are errors.

    ``role``, ``cores``, ``model_dir`` and ``secret_file`` are read by the adapter (which entry point, its
    CPU pinning, the tokenizer's folder, the deployment secret); the rest is the orchestrator's.
    """

    RENAMED: ClassVar[dict[str, str]] = {
        **{f"hot_{name}": f"hot_prompts.{name}" for name in HOT_PROMPTS_FIELDS},
        **{f"slo_{name}": f"slo.{name}" for name in ("ttft_s", "tpot_s", "window_s")},
        **{f"admission_{name}": f"admission.{name}" for name in ADMISSION_FIELDS},
        **{f"conditional_{name}": f"conditional.{name}" for name in ("prefill_tokens", "backlog_s")},
        **{name: f"health.{name}" for name in ("probe_interval_s", "probe_timeout_s", "recovery_backoff_s")},
        "pool_recovery": "health.recovery",
        **{f"cancel_{name}": f"cancel.{name}" for name in ("poll_s", "checks_per_s")},
        **{f"remote_{name}": f"remote.{name}" for name in ("pools", "tls")},
        "fallback_ladder": "degradation.ladder",
        **{name: f"degradation.{name}" for name in ("local_max_tokens", "migration_limit", "retry_after_s")},
        "shed_sheddable_when_degraded": "degradation.shed_sheddable",
        "colocated_first_when_decode_gone": "degradation.colocated_first_when_decode_gone",
    }  # old config.pbtxt parameter -> its name in its section (config.build)

    mode: str = "disaggregated"
    request_timeout_s: float = 600.0
    max_inflight: int = 256
    """Requests in flight on one instance at most; more are refused UNAVAILABLE."""
    prefill_model: str = "prefill"
    """Names of the pool models (the targets of BLS calls)."""
    decode_model: str = "decode"
    colocated_model: str = "colocated"
    role: Literal["orchestrator", "llm"] | None = None
    cores: str = ""
    """Core sets as ``glue.parse_cores`` reads them (``"0"``, ``"0,1"``, per instance ``"0;1"``)."""
    model_dir: Path | None = None
    """The tokenizer's checkpoint folder (default: ``disagg.paths.resolve_model_dir()``)."""
    secret_file: Path | None = None
    slo: SloConfig = field(default_factory=SloConfig)
    """The SLOs requests are judged by (``disagg_slo_*``) and admission predicts against
    (config.pbtxt: ``slo.ttft_s``, ``slo.tpot_s``, ``slo.window_s``)."""
    admission: AdmissionSettings = field(default_factory=AdmissionSettings)
    """Admission by capacity (``admission.margin``, ...; ``disagg.serving.settings``)."""
    conditional: ConditionalSettings = field(default_factory=ConditionalSettings)
    """Conditional disaggregation (``conditional.prefill_tokens``, ``conditional.backlog_s``)."""
    degradation: DegradationSettings = field(default_factory=DegradationSettings)
    """The fallback ladder, the degraded output cap, migrations and shedding (``degradation.*``)."""
    health: HealthSettings = field(default_factory=HealthSettings)
    """Pool probes and restarts (``health.*``)."""
    cancel: CancelSettings = field(default_factory=CancelSettings)
    """How waiting requests notice their client left (``cancel.poll_s``, ``cancel.checks_per_s``)."""
    hot_prompts: HotPromptsConfig = field(default_factory=HotPromptsConfig)
    """Hot prompts: detection, and isolation on a pool of their own or by rate (``disagg.hot.settings``);
    config.pbtxt spells its fields ``hot_prompts.<field>``."""
    remote: RemoteSettings = field(default_factory=RemoteSettings)
    """Pools on other servers (``remote.pools``, ``remote.tls``)."""

    def __post_init__(self) -> None:
        """Ranges and consistency across sections (each section checks its own); the types are
        ``config.build``'s (a config built by hand in code is trusted to be typed)."""
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}")
        parse_ladder(self.degradation.ladder, self.mode)
        if not 1 <= self.max_inflight <= MAX_INFLIGHT_LIMIT:
            raise ValueError(f"max_inflight must be in [1, {MAX_INFLIGHT_LIMIT}]")
        if not 0 < self.request_timeout_s <= 86400:
            raise ValueError("request_timeout_s must be a number of seconds in (0, 86400]")
        unknown = set(self.remote.servers) - set(self.pool_models)
        if unknown:
            raise ValueError(f"remote: pools names pools this entry point has not: {sorted(unknown)}")

    @property
    def pool_models(self) -> dict[str, str]:
        """Pool role -> the model name its requests go to."""
        models = {
            "prefill": self.prefill_model,
            "decode": self.decode_model,
            "colocated": self.colocated_model,
        }
        if self.hot_prompts.decode_model and self.mode == "disaggregated":
            models[HOT_POOL] = self.hot_prompts.decode_model
        return models

    @property
    def router(self) -> RouterConfig:
        d, c = self.degradation, self.conditional
        return RouterConfig(
            d.local_max_tokens, d.migration_limit, d.shed_sheddable, c.prefill_tokens, c.backlog_s
        )

    @property
    def shared_decode_pool(self) -> str:
        """The pool a hot request decodes on when no hot pool takes it (the adaptive cap watches it)."""
        return "decode" if self.mode == "disaggregated" else COLOCATED

    @property
    def ladder(self) -> tuple[str, ...]:
        return parse_ladder(self.degradation.ladder, self.mode)

    @property
    def admission_policy(self) -> AdmissionConfig:
        """Admission's config, judged against ``slo.ttft_s``."""
        return self.admission.policy(self.slo.ttft_s)


@dataclass
class Outcome:
    """What happened to one request (for metrics and tests). Times are ``time.monotonic()``."""

    handle: str
    path: str
    arrival: float
    prompt_tokens: int = 0
    output_tokens: int = 0
    first_token_at: float | None = None
    last_token_at: float | None = None
    error: ServingError | None = None
    finish_reason: str | None = None
    rung: str = ""  # the ladder rung that finished it (or failed it)
    fallbacks: list[Route] = field(default_factory=list)  # every route that fell below its first rung
    migrations: int = 0  # times the stream moved to another rung after its pool failed
    capped: bool = False  # served on the local rung under its lowered output cap
    heat: Heat = field(default_factory=Heat)  # its hot group, if any
    hot_route: str = ""  # one of HOT_ROUTES once routed

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_at is None else self.first_token_at - self.arrival

    @property
    def tpot(self) -> float | None:
        if self.first_token_at is None or self.last_token_at is None:
            return None
        return time_per_output_token(self.first_token_at, self.last_token_at, self.output_tokens)


class Orchestrator:
    def __init__(
        self,
        config: OrchestratorConfig,
        pools: PoolClient,
        decode_text: Callable[[Sequence[int]], str],
        deployed: Sequence[str] | None = None,
        local_generate: bool = True,
        on_change: Callable[[Change], None] | None = None,
    ) -> None:
        """``deployed``: the pools this server has (default: those the ladder names);
        ``local_generate``: the prefill pool runs generate jobs (the ``local`` rung); ``on_change`` is
        told of every pool state change (metrics, log)."""
        self.config = config
        self.pools = pools
        self._decode_text = decode_text
        rungs = config.ladder
        if deployed is None:
            deployed = [*ladder_pools(rungs), *([HOT_POOL] if HOT_POOL in config.pool_models else [])]
        self.health = {pool: PoolHealth(pool, HealthConfig()) for pool in deployed}
        self.ladder = Ladder(
            rungs,
            self.health,
            local=local_generate,
            colocated_first_when_decode_gone=config.degradation.colocated_first_when_decode_gone,
        )
        self.admission = Admission(config.admission_policy)
        self.router = Router(config.router)
        self._listeners: list[Callable[[Change], None]] = [] if on_change is None else [on_change]
        # hot prompts: counted on the event loop, read by the metrics thread too
        self.hotness = HotPrompts(config.hot_prompts.detection)
        self.bucket = config.hot_prompts.bucket  # the hot groups' rate cap, built once
        throttle = config.hot_prompts.throttle
        self.throttle = None if throttle is None else Throttle(throttle)  # an adaptive cap, if any
        self._buckets: dict[str, TokenBucket] = {}
        self._hot_lock = threading.Lock()
        self.waiting = 0  # requests waiting for a pool's first answer or a token (event loop only)

    def view(self, prompt: Sequence[int]) -> PoolsView:
        """The pools as a decision about ``prompt`` sees them now (the router applies the rules)."""
        decode = self.health.get("decode")
        healthy = decode is not None and decode.state is PoolState.HEALTHY
        return PoolsView(self.ladder, healthy, self.admission.predict_ttft("prefill", len(prompt)))

    def cancel_poll_s(self) -> float:
        """How long a waiting request waits between two checks of its client now."""
        cancel = self.config.cancel
        return max(cancel.poll_s, self.waiting / cancel.checks_per_s)

    def heat(self, prompt: Sequence[int], now: float) -> Heat:
        """Count a new request's prompt; its hot group, if any."""
        with self._hot_lock:
            return self.hotness.observe(prompt, now)

    def hot_groups(self, now: float) -> tuple[list[GroupRate], int]:
        """The hot prefix groups now (hottest first) and the near-duplicate groups' count."""
        with self._hot_lock:
            return self.hotness.groups(now), self.hotness.similar_groups(now)

    def hot_rate(self) -> tuple[float, dict[tuple[str, str], int]]:
        """The cap on each hot group now, requests/s (0: none), and the adaptive cap's decisions so
        far by (action, reason) (empty: a fixed cap)."""
        with self._hot_lock:
            if self.throttle is None:
                return self.bucket.rate, {}
            return self.throttle.rate, dict(self.throttle.decisions)

    def observe_load(self, pool: str, load: PoolLoad, now: float) -> None:
        """A probe's answer of ``pool`` at ``now``: the shared decode pool's feeds the adaptive cap,
        with whether a group is hot now."""
        if self.throttle is None or pool != self.config.shared_decode_pool:
            return
        with self._hot_lock:
            self.throttle.observe(load, now, hot=bool(self.hotness.groups(now)))

    def hot_wait(self, group: str, now: float) -> float | None:
        """Seconds a request of hot ``group`` waits for its bucket's token; None: refused. Buckets of
        groups that cooled down and refilled are dropped. An adaptive cap sets the rate at each
        reservation."""
        with self._hot_lock:
            bucket = self._buckets.get(group)
            if bucket is None:
                for old in [
                    g for g, b in self._buckets.items() if b.full(now) and not self.hotness.is_hot(g)
                ]:
                    del self._buckets[old]
                bucket = self._buckets[group] = TokenBucket(self.bucket, now)
            return bucket.reserve(now, None if self.throttle is None else self.throttle.rate)

    def observe(self, change: Change | None) -> None:
        """Pass on a pool's state change (from a call here or a probe)."""
        if change is None:
            return
        log.warning("pool %s: %s -> %s (%s)", change.pool, change.old.value, change.new.value, change.reason)
        for listener in self._listeners:
            listener(change)

    def listen(self, listener: Callable[[Change], None]) -> None:
        """Tell ``listener`` too of every pool state change, after those told before it."""
        self._listeners.append(listener)

    def pool_failed(self, pool: str, error: ServingError) -> None:
        """A call to ``pool`` failed UNAVAILABLE: a pool that refused as full is saturated, a failed KV
        transfer says nothing of the pool, one whose stub the server reports gone is dead (``DEAD``:
        its other calls are given up and it is restarted, as when the watcher finds it silent), and any
        other failure (no answer) is gone; except an overdue call's unanswered probe to a pool the
        watcher already finds saturated (it answers its own probes, slowly): that pool is overloaded,
        not gone, and stays saturated."""
        health = self.health.get(pool)
        if health is None or error.reason in (Reason.TRANSFER_FAILED, Reason.LEASE_LOST):
            return
        if error.reason is Reason.DEAD:
            self.observe(health.failed(DEAD))
            return
        full = error.reason is Reason.FULL
        slow = error.reason is Reason.UNANSWERED and health.state is PoolState.SATURATED
        self.observe(health.refused() if full or slow else health.failed(CALL_FAILED))

    async def serve(
        self, prompt_ids: Sequence[int], text: TextRequest, out: Responder, arrival: float | None = None
    ) -> Outcome:
        """Run one request to its end; sends exactly one final response through ``out``.

        ``arrival`` (``time.monotonic()``) is when the request reached the server, for TTFT.
        """
        arrival = time.monotonic() if arrival is None else arrival
        run = _Run(self, str(uuid.uuid4()), list(prompt_ids), text, out, arrival)
        try:
            async with asyncio.timeout(self.config.request_timeout_s):
                await run.go()
        except TimeoutError:
            await run.cleanup()
            run.fail(
                ServingError(DEADLINE, f"request exceeded its {self.config.request_timeout_s:g} s deadline")
            )
        except asyncio.CancelledError:
            await run.cleanup()
            run.fail(ServingError(CANCELLED, "request was cancelled"))
            raise
        except Exception as exc:
            await run.cleanup()
            run.fail(classify(exc))
        finally:
            run.leave_backlog()  # whatever the ending, the request no longer waits in a backlog
        return run.outcome


class _Run:
    """State of one request in flight."""

    def __init__(
        self,
        owner: Orchestrator,
        handle: str,
        prompt: list[int],
        text: TextRequest,
        out: Responder,
        arrival: float,
    ) -> None:
        self.owner = owner
        self.pools = owner.pools
        self.prompt = prompt
        self.text = text
        self.out = out
        self.outcome = Outcome(handle, owner.config.mode, arrival, prompt_tokens=len(prompt))
        self.reply = Reply(out, text, owner._decode_text, self.outcome)
        self.holds_lease = False  # the prefill pool holds its KV for the decode pool (its job's lease)
        self.running_on: str | None = None  # pool to send a stop to
        self.tokens: list[int] = []  # every output token so far (what a migration resumes from)
        self.admitted = False  # passed admission by capacity
        self.ticket: Ticket | None = None  # its place in a pool's backlog while its prompt waits there
        self.decode_pool = "decode"  # the disaggregated rung's decode pool: "decode" or the hot pool

    @property
    def handle(self) -> str:
        """The current attempt's jobs' handle at the pools (one more attempt per migration)."""
        return str(JobId(self.outcome.handle, self.outcome.migrations))

    async def go(self) -> None:
        """Serve on the route the router gives; when a leg's pool fails, carry out the router's
        failover (a migration resumes the stream on the next rung)."""
        owner = self.owner
        route = owner.router.start(owner.ladder, self.state())
        if route.rung != SHED:
            await self._isolate(route)
        while True:
            route = owner.router.resume(owner.ladder, route, self.state())
            if route.fell_from is not None:
                self.outcome.fallbacks.append(route)
            self.outcome.rung = route.rung
            try:
                await self._run(
                    owner.router.action(route, self.state(), owner.view(self.prompt), self.decode_pool)
                )
                return
            except ServingError as error:
                self.leave_backlog()  # it waits no more where it failed; a retry is not admitted again
                pool = self.running_on
                failover = owner.router.on_failure(route, self.state(), error, pool)
                if isinstance(failover, SkipLocal):
                    owner.ladder.local = False  # the prefill pool was deployed without it
                    route = owner.ladder.route(after=LOCAL, reason="prefill_no_local_generate")
                    continue
                if failover.blame is not None:
                    owner.pool_failed(failover.blame, error)
                if isinstance(failover, GiveUp):
                    raise
                route = await self._migrate(route, failover, error)

    def state(self) -> RequestState:
        params = self.text.params
        return RequestState(
            len(self.prompt),
            params.max_tokens,
            params.min_length,
            self.text.priority,
            len(self.tokens),
            self.admitted,
            self.outcome.migrations,
            self.finished,
        )

    async def _migrate(self, route: Route, failover: Migrate, error: ServingError) -> Route:
        """Leave the failed pool (its leases with it, for the prefill pool), and take the next rung;
        the next attempt's jobs get a handle of their own: a pool may still hold the last attempt's
        (a prefill lease whose importer died before its ack keeps it until expiry)."""
        self.running_on = None  # no stop to the failed pool: it may never answer
        if failover.blame == "prefill":
            self.holds_lease = False  # its leases went with it
        await self.cleanup()
        self._check_cancelled()
        self.outcome.migrations += 1  # the next attempt: a handle of its own
        log.info("request %s migrates off %s (%s)", self.outcome.handle, route.rung, error.message)
        return self.owner.ladder.route(after=route.rung, reason=failover.reason)

    async def _isolate(self, route: Route) -> None:
        """A new request of a hot group decodes on the hot pool (disaggregated, the pool healthy), or
        waits for its group's token bucket (refused when the wait is too long); others go as usual."""
        owner, outcome = self.owner, self.outcome
        outcome.heat = heat = owner.heat(self.prompt, time.monotonic())
        hot_pool = owner.health.get(HOT_POOL)
        healthy = hot_pool is not None and hot_pool.state is PoolState.HEALTHY
        outcome.hot_route = owner.router.hot(route, heat.group is not None, healthy, owner.bucket.enabled)
        if outcome.hot_route == HOT_POOL_ROUTE:
            self.decode_pool = HOT_POOL
        if outcome.hot_route != HOT_BUCKET or heat.group is None:
            return
        wait = owner.hot_wait(heat.group, time.monotonic())
        if wait is None:
            outcome.hot_route = "hot_refused"
            config = owner.config
            retry = max(config.degradation.retry_after_s, config.hot_prompts.max_wait_s)
            raise hot_refusal(owner.hot_rate()[0], retry)
        outcome.hot_route = "hot_delayed" if wait > 0 else "hot_shared"
        if wait > 0:
            await self._unless_cancelled(asyncio.sleep(wait))

    async def _run(self, action: Action) -> None:
        """Carry out the router's action on the pools."""
        if isinstance(action, Shed):
            self.running_on = None
            raise action.error(self.owner.config.degradation.retry_after_s)
        if isinstance(action, Finish):
            self.outcome.finish_reason = FINISH_LENGTH
            self._finish()
            return
        if action.admit_on is not None:  # a new request: is there capacity for its TTFT?
            # refused before the cancellation check: that check is a round trip through the stub's
            # queue, behind every token relayed, and a burst's refusals waited on it one by one
            self.ticket = self.owner.admission.admit(action.admit_on, len(self.prompt), self.text.priority)
        if action.admit_on is not None or (isinstance(action, Generate) and action.conditional):
            self._check_cancelled()  # a client already gone is never dispatched (C1)
        self.admitted = True  # a conditional one is kept off the prefill pool's admission (no wait there)
        if isinstance(action, Disaggregate):
            await self._disaggregated(action.decode_pool)
            return
        if action.conditional:  # counted as the route ``disaggregated -> conditional``
            self.outcome.fallbacks.append(Route(CONDITIONAL, DISAGGREGATED, "prefill_backlog"))
        self.outcome.capped = self.outcome.capped or action.capped
        params = replace(self.text.params, max_tokens=action.max_tokens, min_length=action.min_length)
        request = Request(tuple(self.prompt), params, tuple(self.tokens))
        self.running_on = action.pool
        await self._relay(self.pools.generate(self.handle, request, action.pool))

    async def _disaggregated(self, decode_pool: str) -> None:
        request = Request(tuple(self.prompt), self.text.params)
        self.running_on = "prefill"
        first = await self._unless_cancelled(self.pools.prefill(self.handle, request))
        self.running_on = None
        self.holds_lease = first.descriptor is not None
        self.outcome.finish_reason = first.finish_reason
        if self._token(first.token_id) or first.finished:
            await self._release_lease()
            self._finish()
            return
        self._check_cancelled()
        if first.state is None or first.descriptor is None:
            raise ServingError("INTERNAL", "prefill pool returned no KV descriptor")
        self.running_on = decode_pool
        await self._relay(self.pools.decode(self.handle, first.state, first.descriptor, decode_pool))

    async def _unless_cancelled(self, answer: Awaitable[T]) -> T:
        """Await a pool's answer, checking every ``cancel.poll_s`` whether the client left meanwhile:
        a request waiting in a pool's queue or being prefilled hears of a cancel no other way. A
        cancel stops the wait (its call is drained in the background) and raises CANCELLED; the
        caller's clean-up then sends the pool a stop, which takes the job out of its queue, or frees
        its KV once the step prefilling it ends (C1, C2)."""
        waiting = asyncio.ensure_future(answer)
        self.owner.waiting += 1
        try:
            while True:
                done, _ = await asyncio.wait({waiting}, timeout=self.owner.cancel_poll_s())
                if done:
                    return waiting.result()
                self._check_cancelled()
        finally:
            self.owner.waiting -= 1
            if not waiting.done():
                waiting.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await waiting

    async def _relay(self, tokens: AsyncIterator[Token]) -> None:
        ended = False
        try:
            # the first token waits behind the pool's queue (and, on one pool, the prefill): watched;
            # every later one is followed by a check of its own
            token = await self._unless_cancelled(anext(tokens, None))
            while token is not None:
                self.holds_lease = False  # decode produced a token: it has imported the KV
                self.outcome.finish_reason = token.finish_reason
                stop = self._token(token.token_id)
                if token.finished:
                    self.running_on, ended = None, True
                    break
                if stop:
                    await self.cleanup()
                    ended = True
                    break
                self._check_cancelled()
                token = await anext(tokens, None)
        finally:
            with contextlib.suppress(Exception):
                await tokens.aclose()  # type: ignore[attr-defined]
        if not ended:  # the pool's stream stopped short of its last token: its instance died
            raise ServingError(UNAVAILABLE, f"the {self.running_on} pool ended a stream before its end")
        self._finish()

    def _token(self, token_id: int) -> bool:
        """Account one token and stream its text; True when a stop string ended the output."""
        self.tokens.append(token_id)
        now = time.monotonic()
        if self.outcome.first_token_at is None:
            self.outcome.first_token_at = now
            self.leave_backlog()
        self.outcome.last_token_at = now
        self.outcome.output_tokens += 1
        return self.reply.add(token_id)

    def leave_backlog(self) -> None:
        """The prompt no longer waits on the pool it was admitted to: out of that pool's backlog."""
        ticket, self.ticket = self.ticket, None
        if ticket is not None:
            self.owner.admission.release(ticket)

    def _check_cancelled(self) -> None:
        if self.out.is_cancelled():
            raise ServingError(CANCELLED, "request was cancelled by the client")

    async def cleanup(self) -> None:
        """Stop whatever still runs for this request: its sequence on a pool, and the KV the prefill
        pool holds for it under a lease (that pool owns the lease: the request names its job only)."""
        pool, self.running_on = self.running_on, None
        await self._stop(pool)
        await self._release_lease()

    async def _release_lease(self) -> None:
        held, self.holds_lease = self.holds_lease, False
        await self._stop("prefill" if held else None)

    async def _stop(self, pool: str | None) -> None:
        if pool is not None:
            try:
                await self.pools.stop(pool, self.handle)
            except Exception:  # a lease not given back expires on its own
                log.warning("stop request to %s failed", pool, exc_info=True)

    @property
    def finished(self) -> bool:
        return self.reply.finished

    def _finish(self) -> None:
        self.reply.finish()

    def fail(self, error: ServingError) -> None:
        self.reply.fail(error)
