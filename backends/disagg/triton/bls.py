"""The orchestrator's PoolClient over Triton BLS: pools are other models of this server.

Triton 2.51's BLS response iterator blocks and has no ``cancel()``: responses are pulled off the
event loop on a thread pool (pulling on the loop would serialise every request of the instance), and
a sequence is stopped with a ``control`` request to its pool, keyed by the request handle.

A pool instance whose stub process dies (``kill -9``, OOM) never completes its open requests on
Triton 2.51, and the stub is not restarted: a wait for its next response would block forever. So
while a response is overdue the pool is probed (a ``ping`` control request, answered at once by a
live pool); a probe that fails or does not answer in time ends the request UNAVAILABLE. A ping goes to
the pool's model, not to the instance a request is on: once the watcher has restarted a dead pool,
the new instance answers for it. So each call also remembers the pool's *epoch* (how many times it
was found gone, ``pool_lost``): a call whose pool was lost since it began ends UNAVAILABLE too, at its
next check (every ``CHECK_S``).

Probes are shared, and never queued behind work. A pool that answered any ping (the watcher's, every
second, or another call's) within ``PROBE_AFTER_S`` is known alive, so an overdue call sends none;
otherwise the overdue calls of one pool share one probe in flight. Control calls (pings, stops) read
their answers on threads of their own: under overload every job thread can be blocked waiting for
its pool, and a probe queued behind them would go unanswered and get a live pool declared gone.

A finished iterator is never simply dropped: it goes to the ``Graveyard``, which releases it once the
stub has dropped its own reference (Triton 2.51 would otherwise free its responses without the GIL;
see ``graveyard``).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from disagg.engine.sequence import Request, SequenceState
from disagg.protocol.errors import (
    INTERNAL,
    PROBE_UNANSWERED,
    STUB_DEAD,
    UNAVAILABLE,
    Reason,
    ServingError,
)
from disagg.protocol.messages import Control, Failed, Ping, PoolLoad, Prefilled, Stop, Token
from disagg.serving.auth import PARAMETER, TokenSigner
from disagg.serving.routing import pinned_version
from disagg.triton import glue, wire
from disagg.triton.graveyard import Graveyard
from disagg.triton.stubs import StubWatch

_END = object()


def _drain(responses: Iterator[Any], bury: Callable[[Iterator[Any]], None]) -> None:
    """Consume a BLS call's remaining responses (on an executor thread), then bury the iterator."""
    try:
        for _ in responses:
            pass
    finally:
        bury(responses)


PROBE_AFTER_S = 5.0  # a response overdue this long triggers a liveness probe of the pool
PROBE_TIMEOUT_S = 10.0  # a live pool answers a probe in milliseconds
CHECK_S = 0.1  # how often a waiting call looks whether its pool was lost meanwhile
CONTROL_WORKERS = 32  # threads reading control answers (a ping to a dead pool may hold one for good)


class TritonPools:
    def __init__(self, pb_utils: Any, signer: TokenSigner, models: dict[str, str], max_inflight: int) -> None:
        self._pb = pb_utils
        self._signer = signer
        self.models = models  # pool -> Triton model name
        self._executor = ThreadPoolExecutor(max_workers=max_inflight, thread_name_prefix="bls")
        self._control_executor = ThreadPoolExecutor(max_workers=CONTROL_WORKERS, thread_name_prefix="bls-ctl")
        self._answered: dict[str, float] = {}  # pool -> loop time of its last answered ping
        self._probes: dict[str, asyncio.Future[PoolLoad]] = {}  # pool -> the overdue calls' probe
        self.graveyard = Graveyard()
        self._epochs: dict[str, int] = {}  # pool -> times it was found gone
        self.stubs = StubWatch(models)  # the pools' stub processes: which died (started by the model)
        self._lock = threading.Lock()
        self._open = 0  # calls made whose final response has not arrived yet
        # whether a pool is known to be overloaded (the orchestrator's health: saturated): an overdue
        # call to it outlives a probe that times out instead of failing UNAVAILABLE
        self.overloaded: Callable[[str], bool] = lambda pool: False

    def pool_lost(self, pool: str) -> None:
        """The pool was found gone: the calls it had open will never be answered."""
        self._epochs[pool] = self._epochs.get(pool, 0) + 1
        self.stubs.forget(pool)

    @property
    def open_calls(self) -> int:
        """Calls to the pools still waiting for their final response (being read or drained); it
        falls back to zero between requests unless a pool left a call without its end."""
        with self._lock:
            return self._open

    def _bury(self, responses: Iterator[Any]) -> None:
        with self._lock:
            self._open -= 1
        self.graveyard.bury(responses)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
        self._control_executor.shutdown(wait=False, cancel_futures=True)
        self.stubs.stop()
        self.graveyard.release_all()

    async def _call(self, pool: str, inputs: list[Any], subject: bytes) -> Iterator[Any]:
        """Send one call to `pool`, with a token bound to `subject` (``wire.call_subject``)."""
        pb = self._pb
        model = self.models[pool]
        request = pb.InferenceRequest(
            model_name=model,
            model_version=pinned_version(model),  # the request's pin (serving.routing), else -1
            inputs=inputs,
            requested_output_names=["event", "descriptor"] if pool == "prefill" else ["event"],
            parameters={PARAMETER: self._signer.mint(subject)},
            # the events are BYTES, read with numpy here: a KIND_GPU pool's answer in CPU memory
            preferred_memory=pb.PreferredMemory(pb.TRITONSERVER_MEMORY_CPU, 0),
        )
        responses = await request.async_exec(decoupled=True)
        with self._lock:
            self._open += 1
        return responses

    async def _responses(
        self, responses: Iterator[Any], pool: str | None = None, epoch: int = 0, control: bool = False
    ) -> AsyncIterator[Any]:
        """Responses of one BLS call; with ``pool``, a pool that stops answering raises UNAVAILABLE.

        A caller that stops early (cancel, stop string, error) leaves the call's remaining responses
        to a background drain: the BLS request must see its final response, or the orchestrator's
        model keeps a request in flight and cannot unload.
        """
        loop = asyncio.get_running_loop()
        executor = self._control_executor if control else self._executor
        pending: asyncio.Future[Any] | None = None
        finished = False
        try:
            while True:
                pending = loop.run_in_executor(executor, next, responses, _END)
                response = await (pending if pool is None else self._while_alive(pool, pending, epoch))
                pending = None
                if response is _END:
                    finished = True
                    self._bury(responses)
                    return
                if response.has_error():
                    raise glue.serving_error(self._pb, response.error())
                yield response
        finally:
            if pending is not None and not pending.done():  # a thread is inside next(): drain after it
                pending.add_done_callback(lambda _: executor.submit(_drain, responses, self._bury))
            elif not finished:
                executor.submit(_drain, responses, self._bury)

    async def _while_alive(self, pool: str, pending: asyncio.Future[Any], epoch: int) -> Any:
        overdue_at = asyncio.get_running_loop().time() + PROBE_AFTER_S
        while True:
            done, _ = await asyncio.wait({pending}, timeout=CHECK_S)
            if done:
                return pending.result()
            if self._epochs.get(pool, 0) != epoch:
                # the thread blocked in next() stays blocked: the iterator has no cancel() here
                raise ServingError(UNAVAILABLE, f"the {pool} pool stopped responding (it was lost)")
            if self.stubs.dead(pool):  # sooner than Triton says so (see stubs)
                raise ServingError(
                    UNAVAILABLE, f"a stub process of the {pool} pool {STUB_DEAD} (it died)", Reason.DEAD
                )
            now = asyncio.get_running_loop().time()
            overdue_at = max(overdue_at, self._answered.get(pool, -PROBE_AFTER_S) + PROBE_AFTER_S)
            if now < overdue_at:
                continue  # the pool answered a ping lately: it is alive, only slow
            try:
                await asyncio.shield(self._probe(pool))
            except TimeoutError:
                if not self.overloaded(pool):
                    message = f"the {pool} pool stopped responding ({PROBE_UNANSWERED})"
                    raise ServingError(UNAVAILABLE, message, Reason.UNANSWERED) from None
                # saturated and slow to answer: keep waiting (a lost pool ends it by its epoch)
            except ServingError:
                message = f"the {pool} pool stopped responding ({PROBE_UNANSWERED})"
                raise ServingError(UNAVAILABLE, message, Reason.UNANSWERED) from None
            overdue_at = asyncio.get_running_loop().time() + PROBE_AFTER_S

    def _probe(self, pool: str) -> asyncio.Future[PoolLoad]:
        """The probe of ``pool`` its overdue calls share: the one in flight, or a new one."""
        probe = self._probes.get(pool)
        if probe is None or probe.done():
            probe = asyncio.ensure_future(asyncio.wait_for(self.ping(pool), PROBE_TIMEOUT_S))
            probe.add_done_callback(lambda done: done.cancelled() or done.exception())  # seen
            self._probes[pool] = probe
        return probe

    def _tensor(self, response: Any, name: str) -> bytes | None:
        tensor = self._pb.get_output_tensor_by_name(response, name)
        return None if tensor is None else glue.first_bytes(tensor.as_numpy())

    def _job_inputs(self, handle: str, **values: Any) -> list[Any]:
        pb = self._pb
        inputs = [glue.bytes_tensor(pb, "handle", handle)]
        for name, value in values.items():
            if name == "input_ids":
                inputs.append(pb.Tensor(name, np.asarray(value, dtype=np.int32)))
            else:
                inputs.append(glue.bytes_tensor(pb, name, value))
        return inputs

    async def _events(self, pool: str, handle: str, inputs: list[Any]) -> AsyncIterator[Token | Prefilled]:
        # aclosing: an early exit closes the inner generator now, not whenever it is collected
        epoch = self._epochs.get(pool, 0)
        call = await self._accepted(pool, inputs, wire.call_subject(handle, None), epoch)
        async with contextlib.aclosing(self._responses(call, pool, epoch)) as responses:
            async for response in responses:
                raw = self._tensor(response, "event")
                if raw is None:
                    continue  # the bare final flag
                descriptor = self._tensor(response, "descriptor") if pool == "prefill" else None
                event = wire.decode_event(raw, descriptor)
                if isinstance(event, Failed):
                    raise event.error
                yield event

    async def prefill(self, handle: str, request: Request) -> Prefilled:
        inputs = self._job_inputs(
            handle, input_ids=list(request.prompt_token_ids), sampling=wire.encode_sampling(request.params)
        )
        result = None
        async with contextlib.aclosing(self._events("prefill", handle, inputs)) as events:
            async for event in events:
                result = event
        if result is None:  # the call ended without its answer: the instance died under it
            raise ServingError(UNAVAILABLE, "the prefill pool ended a request without its answer")
        if not isinstance(result, Prefilled):
            raise ServingError(INTERNAL, "prefill pool answered out of protocol")
        return result

    async def _tokens(self, pool: str, handle: str, inputs: list[Any]) -> AsyncIterator[Token]:
        async with contextlib.aclosing(self._events(pool, handle, inputs)) as events:
            async for event in events:
                if isinstance(event, Token):
                    yield event

    def decode(
        self, handle: str, state: SequenceState, descriptor: bytes, pool: str = "decode"
    ) -> AsyncIterator[Token]:
        """The decode leg on ``pool`` (the decode pool, or the hot prompts' pool)."""
        inputs = self._job_inputs(handle, state=wire.encode_state(state), descriptor=descriptor)
        return self._tokens(pool, handle, inputs)

    def generate(self, handle: str, request: Request, pool: str = "colocated") -> AsyncIterator[Token]:
        """Both phases on ``pool``: the colocated pool, or the prefill pool's local decode. The request
        travels as a sequence state, so a resumed one's generated tokens go with it."""
        state = SequenceState(request.prompt_token_ids, request.generated_token_ids, request.params)
        return self._tokens(pool, handle, self._job_inputs(handle, state=wire.encode_state(state)))

    def _drain_accepted(self, sending: asyncio.Future[Iterator[Any]], control: bool) -> None:
        """A call its caller stopped waiting for before it was accepted: once it is, read it to its
        final response in the background (else the call, and the stub's reference to it, stay)."""
        if not sending.cancelled() and sending.exception() is None:
            executor = self._control_executor if control else self._executor
            executor.submit(_drain, sending.result(), self._bury)

    async def _accepted(
        self, pool: str, inputs: list[Any], subject: bytes, epoch: int | None = None
    ) -> Iterator[Any]:
        """Make a call and wait until it is accepted; with ``epoch`` (a job's call) the wait is watched
        like the call's responses, since one sent to an instance as it dies may never be accepted.

        A caller that gives up first (a cancel while queued, a ping's timeout, the pool lost) leaves
        the call, once it is accepted, to be read to its end in the background; a job's call from a
        pool lost meanwhile that is not accepted yet is given up."""
        sending = asyncio.ensure_future(self._call(pool, inputs, subject))
        try:
            if epoch is None:
                return await asyncio.shield(sending)
            return await self._while_alive(pool, sending, epoch)
        except BaseException:
            sending.add_done_callback(functools.partial(self._drain_accepted, control=epoch is None))
            if epoch is not None and not sending.done() and self._epochs.get(pool, 0) != epoch:
                sending.cancel()
            raise

    async def _control(self, pool: str, control: Control) -> bytes | None:
        """Send a control request; the event of its answer, if it had one."""
        encoded = wire.encode_control(control)
        inputs = [glue.bytes_tensor(self._pb, "control", encoded)]
        event = None
        call = await self._accepted(pool, inputs, wire.call_subject(None, encoded))
        async with contextlib.aclosing(self._responses(call, control=True)) as responses:
            async for response in responses:
                event = self._tensor(response, "event") or event
        return event

    async def stop(self, pool: str, handle: str) -> None:
        await self._control(pool, Stop(handle))

    async def ping(self, pool: str) -> PoolLoad:
        """The pool's load; raises ServingError when it does not answer as live."""
        raw = await self._control(pool, Ping())
        try:
            load = wire.decode_load(raw or b"")
        except (ValueError, KeyError, TypeError):
            raise ServingError(INTERNAL, f"the {pool} pool answered a ping out of protocol") from None
        self._answered[pool] = asyncio.get_running_loop().time()
        return load
