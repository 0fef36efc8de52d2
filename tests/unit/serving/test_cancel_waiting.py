"""A request whose pool has not answered yet (queued behind others, being prefilled, waiting for decode
blocks) still hears its client's cancel: the orchestrator polls for it while it waits, stops the
job on its pool and ends the request CANCELLED, long before any answer or deadline (RELIABILITY C1,
C2). Pools here never answer unless told to, so nothing but the poll can end these requests."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from disagg.engine.params import SamplingParams
from disagg.engine.sequence import Request, SequenceState
from disagg.protocol.errors import CANCELLED
from disagg.protocol.messages import PoolLoad, Prefilled, Token
from disagg.serving.orchestrator import Orchestrator, OrchestratorConfig
from disagg.serving.settings import CancelSettings
from disagg.serving.text_api import TextRequest

PARAMS = SamplingParams(max_tokens=16)


@dataclass
class _StuckPools:
    """A PoolClient whose calls wait forever, except the prefill when ``prefill_answers``."""

    prefill_answers: bool = False
    calls: list[str] = field(default_factory=list)
    stops: list[str] = field(default_factory=list)
    waits_ended: int = 0  # stuck waits that were given up (their call closed)

    async def _forever(self) -> None:
        try:
            await asyncio.Event().wait()
        finally:
            self.waits_ended += 1

    async def prefill(self, handle: str, request: Request) -> Prefilled:
        self.calls.append("prefill")
        if not self.prefill_answers:
            await self._forever()
        state = SequenceState(request.prompt_token_ids, (5,), request.params)
        return Prefilled(5, False, None, b"descriptor", "lease-1", state)

    async def _stuck(self, pool: str):
        self.calls.append(pool)
        await self._forever()
        yield Token(0, True)  # never reached

    def decode(self, handle: str, state: SequenceState, descriptor: bytes, pool: str = "decode"):
        return self._stuck(pool)

    def generate(self, handle: str, request: Request, pool: str = "colocated"):
        return self._stuck(pool)

    async def stop(self, pool: str, handle: str) -> None:
        self.stops.append(pool)

    async def ping(self, pool: str) -> PoolLoad:
        return PoolLoad(0, 0, 0, 0, 10)


@dataclass
class _Client:
    """A Responder whose client leaves after its ``leaves_after``-th cancel check."""

    leaves_after: int
    checks: int = 0
    errors: list = field(default_factory=list)
    finals: int = 0

    def send(self, text: str, final: bool, tokens: int = 0, finish_reason: str | None = None) -> None:
        self.finals += final

    def fail(self, error) -> None:
        self.errors.append(error)
        self.finals += 1

    def is_cancelled(self) -> bool:
        self.checks += 1
        return self.checks > self.leaves_after


def _serve(pools: _StuckPools, client: _Client, mode: str = "disaggregated", orchestrator=None):
    config = OrchestratorConfig(mode=mode, cancel=CancelSettings(poll_s=0.01), request_timeout_s=600)
    orchestrator = orchestrator or Orchestrator(config, pools, lambda ids: "x" * len(ids))
    text = TextRequest("hello", PARAMS, stream=True)
    # the bound only turns a hang into a failure: the cancel ends these requests in tens of ms
    return asyncio.run(asyncio.wait_for(orchestrator.serve([1, 2, 3], text, client), 10))


def _cancelled(outcome, client: _Client) -> bool:
    return (
        outcome.error is not None
        and outcome.error.code == CANCELLED
        and [e.code for e in client.errors] == [CANCELLED]
        and client.finals == 1
    )


def test_a_client_gone_before_dispatch_is_never_dispatched():
    pools, client = _StuckPools(), _Client(leaves_after=0)
    assert _cancelled(_serve(pools, client), client)
    assert pools.calls == [] and pools.stops == []


def test_a_cancel_while_queued_for_prefill_stops_the_prefill_job():
    pools, client = _StuckPools(), _Client(leaves_after=3)
    assert _cancelled(_serve(pools, client), client)
    assert pools.calls == ["prefill"] and pools.stops == ["prefill"]
    assert pools.waits_ended == 1  # the wait for the prefill's answer was given up


def test_a_cancel_while_queued_takes_the_prompt_out_of_the_backlog_at_once():
    pools, client = _StuckPools(), _Client(leaves_after=3)
    config = OrchestratorConfig(cancel=CancelSettings(poll_s=0.01), request_timeout_s=600)
    orchestrator = Orchestrator(config, pools, lambda ids: "x" * len(ids))
    assert _cancelled(_serve(pools, client, orchestrator=orchestrator), client)
    assert orchestrator.admission.backlog("prefill") == 0, "admitted, then gone: not counted as waiting"


def test_a_cancel_while_decode_has_not_started_stops_it_and_the_prefill_job_holding_the_lease():
    """Prefilled, then waiting for decode's first token (its queue, or KV blocks to import into):
    the decode job is stopped and the lease given back at once, not left to its TTL (C3)."""
    pools, client = _StuckPools(prefill_answers=True), _Client(leaves_after=3)
    assert _cancelled(_serve(pools, client), client)
    assert pools.calls == ["prefill", "decode"]
    assert pools.stops == ["decode", "prefill"], "the prefill pool gives back the KV it holds for decode"
    assert pools.waits_ended == 1


def test_a_cancel_while_waiting_for_the_first_token_of_one_pool_stops_it():
    pools, client = _StuckPools(), _Client(leaves_after=3)
    assert _cancelled(_serve(pools, client, "colocated"), client)
    assert pools.calls == ["colocated"] and pools.stops == ["colocated"]
    assert pools.waits_ended == 1


def test_a_backlog_checks_its_clients_at_a_bounded_rate():
    """Forty requests stuck waiting on one instance: together they check at most
    ``cancel.checks_per_s`` times a second (each every 40 / 200 = 0.2 s, not every 0.01 s), and a
    client that leaves is still heard."""
    pools = _StuckPools()
    config = OrchestratorConfig(cancel=CancelSettings(poll_s=0.01, checks_per_s=200), request_timeout_s=600)
    orchestrator = Orchestrator(config, pools, lambda ids: "x" * len(ids))
    assert orchestrator.cancel_poll_s() == 0.01
    stuck = [_Client(leaves_after=10**9) for _ in range(39)]
    leaving = _Client(leaves_after=3)

    async def backlog():
        text = TextRequest("hello", PARAMS, stream=True)
        tasks = [asyncio.ensure_future(orchestrator.serve([1, 2], text, c)) for c in stuck]
        while orchestrator.waiting < len(stuck):
            await asyncio.sleep(0)
        assert orchestrator.cancel_poll_s() == len(stuck) / 200
        outcome = await asyncio.wait_for(orchestrator.serve([1, 2], text, leaving), 10)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        return outcome

    outcome = asyncio.run(backlog())
    assert _cancelled(outcome, leaving)
    assert orchestrator.waiting == 0, "every wait counted out, cancelled ones too"
    assert max(c.checks for c in stuck) <= 8, "each stuck one checked a few times at 0.2 s, not ~60"
