"""The router: every decision on one request's way through the pools, pure.

The orchestrator (``disagg.serving.orchestrator``) runs a request's legs on the pools and asks the
router, at each turn, what comes next. The router reads the request's typed state
(``RequestState``), the pools as the orchestrator sees them (the ladder over their health, the
prefill pool's predicted time to first token) and, after a failed leg, its typed ``Reason``; it
answers with an action. It does no I/O and keeps no state, so it is tested as a table of
(state, view, outcome) -> action.

- ``start``: the route of a new request, the ladder's first rung that can serve now. A sheddable
  request (negative priority) goes no lower than the first rung: lower-priority traffic is shed
  first while the server is degraded.
- ``resume``: a stream that migrates off the disaggregated rung is re-prefilled in one pool.
- ``hot``: where a request of a hot prompt group decodes (the hot pool, the shared pool, or after its
  group's token bucket).
- ``action``: what runs on a route: ``Shed``, ``Disaggregate`` (prefill, then decode on a decode
  pool), ``Generate`` (one pool does both: colocated, local with its output cap, or the decode pool
  for a short prompt under conditional disaggregation) or ``Finish`` (the cap leaves nothing to
  generate). A new request is admitted by capacity on the route's first pool (``admit_on``).
- ``on_failure``: after a leg failed, ``GiveUp``, ``SkipLocal`` (the prefill pool runs no generate
  jobs) or ``Migrate`` to the next rung; ``blame`` names the pool whose health hears of it.
"""

from __future__ import annotations

from dataclasses import dataclass

from disagg.protocol.errors import UNAVAILABLE, Reason, ServingError
from disagg.serving.ladder import COLOCATED, DISAGGREGATED, LOCAL, SHED, Ladder, Route


@dataclass(frozen=True)
class RouterConfig:
    """The orchestrator's settings the router decides by (``OrchestratorConfig.router``)."""

    local_max_tokens: int = 128  # the local rung's output cap, in tokens beyond those streamed
    migration_limit: int = 2  # times one stream may move to another rung after its pool failed
    shed_sheddable_when_degraded: bool = True
    conditional_prefill_tokens: int = 0  # conditional disaggregation's prompt bound (0: off)
    conditional_backlog_s: float = 0.25  # ... and the prefill pool's predicted TTFT above which it acts


@dataclass(frozen=True)
class RequestState:
    """What the router reads of a request in flight."""

    prompt_tokens: int
    max_tokens: int
    min_length: int = 0
    priority: int = 0
    generated: int = 0  # output tokens streamed so far: a resumed stream when above 0
    admitted: bool = False  # admitted by capacity (or kept off admission by conditional routing)
    migrations: int = 0
    finished: bool = False

    @property
    def new(self) -> bool:
        """Nothing streamed and not admitted yet: a request's first dispatch."""
        return not self.generated and not self.admitted


@dataclass(frozen=True)
class PoolsView:
    """The pools as the orchestrator sees them for one decision."""

    ladder: Ladder  # the rungs over the pools' health now
    decode_healthy: bool = True  # the (shared) decode pool is healthy
    prefill_ttft_s: float | None = None  # this prompt's predicted TTFT on the prefill pool (None: unknown)


@dataclass(frozen=True)
class Shed:
    why: str  # the route's reason, for the client's message

    def error(self, retry_after_s: float) -> ServingError:
        return ServingError(
            UNAVAILABLE, f"server is degraded ({self.why}); retry after {retry_after_s:g} s", Reason.SHED
        )


def hot_refusal(rate: float, retry_after_s: float) -> ServingError:
    """A request of a hot prompt group whose token is too far off (its group's cap ``rate``)."""
    return ServingError(
        UNAVAILABLE,
        f"too many similar requests (a hot prompt group over {rate:.3g} requests/s); "
        f"retry after {retry_after_s:g} s",
        Reason.SHED,
    )


@dataclass(frozen=True)
class Disaggregate:
    """Prefill on the prefill pool, then decode on ``decode_pool`` with the KV handed over."""

    decode_pool: str
    admit_on: str | None = None


@dataclass(frozen=True)
class Generate:
    """One pool prefills and decodes: up to ``max_tokens`` in all (``min_length`` lowered with a cap)."""

    pool: str
    max_tokens: int
    min_length: int
    capped: bool = False  # the local rung's cap lowered max_tokens
    conditional: bool = False  # a short prompt served whole by the decode pool
    admit_on: str | None = None


@dataclass(frozen=True)
class Finish:
    """The route's cap leaves nothing more to generate: the request ends at its length."""


Action = Shed | Disaggregate | Generate | Finish


@dataclass(frozen=True)
class GiveUp:
    blame: str | None = None  # the pool whose health hears of the failure first


@dataclass(frozen=True)
class SkipLocal:
    """The prefill pool was deployed without ``local_generate``: the ladder forgets the local rung."""


@dataclass(frozen=True)
class Migrate:
    blame: str
    reason: str  # why the stream falls below its rung (``Route.reason``)


Failover = GiveUp | SkipLocal | Migrate

HOT_COLD, HOT_POOL_ROUTE, HOT_SHARED, HOT_BUCKET = "cold", "hot_pool", "hot_shared", "bucket"


class Router:
    def __init__(self, config: RouterConfig) -> None:
        self.config = config

    def start(self, ladder: Ladder, request: RequestState) -> Route:
        route = ladder.route()
        if route.fell_from is None or route.rung == SHED or request.priority >= 0:
            return route
        if not self.config.shed_sheddable_when_degraded:
            return route
        return Route(SHED, route.fell_from, "sheddable_while_degraded")

    @staticmethod
    def resume(ladder: Ladder, route: Route, request: RequestState) -> Route:
        if route.rung == DISAGGREGATED and request.generated:
            return ladder.route(after=DISAGGREGATED, reason=route.reason or "resumed")
        return route

    @staticmethod
    def hot(route: Route, hot: bool, hot_pool_healthy: bool, bucket: bool) -> str:
        """How a new request is isolated by hotness: ``cold`` (not hot), ``hot_pool`` (it decodes
        there), ``hot_shared`` (served as any other) or ``bucket`` (after its group's token)."""
        if not hot:
            return HOT_COLD
        if route.rung == DISAGGREGATED and hot_pool_healthy:
            return HOT_POOL_ROUTE
        return HOT_BUCKET if bucket else HOT_SHARED

    def action(self, route: Route, request: RequestState, pools: PoolsView, decode_pool: str) -> Action:
        if route.rung == SHED:
            return Shed(route.reason.replace("_", " ") if route.reason else "no pool can serve")
        if route.rung == DISAGGREGATED and request.new and self._conditional(request, pools):
            return Generate("decode", request.max_tokens, request.min_length, conditional=True)
        admit_on = route.pools[0] if request.new else None
        if route.rung == DISAGGREGATED:
            return Disaggregate(decode_pool, admit_on)
        max_tokens, min_length, capped = request.max_tokens, request.min_length, False
        if route.rung == LOCAL:
            cap = request.generated + self.config.local_max_tokens
            if cap < max_tokens:  # a minimum length above the degraded cap is lowered with it
                max_tokens, min_length, capped = cap, min(min_length, cap), True
        if request.generated >= max_tokens:
            return Finish()
        pool = "prefill" if route.rung == LOCAL else COLOCATED
        return Generate(pool, max_tokens, min_length, capped, admit_on=admit_on)

    def _conditional(self, request: RequestState, pools: PoolsView) -> bool:
        """A short prompt, a healthy decode pool that prefills short prompts, and a prefill pool whose
        backlog would delay this one past the threshold."""
        config = self.config
        if not config.conditional_prefill_tokens or request.prompt_tokens > config.conditional_prefill_tokens:
            return False
        if not pools.decode_healthy:
            return False
        return pools.prefill_ttft_s is not None and pools.prefill_ttft_s > config.conditional_backlog_s

    def on_failure(
        self, route: Route, request: RequestState, error: ServingError, pool: str | None
    ) -> Failover:
        """After a leg on ``pool`` (None: no pool was running it) failed with ``error``."""
        if route.rung == LOCAL and error.reason is Reason.UNSUPPORTED and not request.finished:
            return SkipLocal()
        if error.code != UNAVAILABLE or pool is None or request.finished:
            return GiveUp()
        if request.migrations >= self.config.migration_limit:
            return GiveUp(blame=pool)
        # a lost lease leaves the decode pool fine: the KV must be made again
        return Migrate(pool, "kv_lease_lost" if error.reason is Reason.LEASE_LOST else f"{pool}_failed")
