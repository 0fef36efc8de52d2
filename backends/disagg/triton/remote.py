"""The orchestrator's PoolClient for pools served by other Triton servers, over gRPC streaming.

BLS reaches only the models of the orchestrator's own server; a pool on another host is reached here,
through Triton's own client (``tritonclient.grpc.aio``). A pool's servers come from its spec
(``disagg.serving.endpoints``: a static list, or a DNS name such as a Kubernetes headless Service).

- **The same protocol as BLS.** Each call is one bidirectional stream carrying one request to the pool
  model, with the same wire messages (``disagg.triton.wire``) and the same signed internal token, as
  the request parameter ``disagg_auth``. The pool cannot tell the two apart.
- **Stop.** A ``Stop`` goes to the server that ran the request's job (remembered per call): for a
  prefill job after its prefill, the server that holds its KV under a lease, which gives it back. A
  caller that stops reading early does not cancel the stream: it sends the stop, and the stream is
  read to its end in the background (Triton 2.51 can keep a model referenced after a cancelled stream; see
  ``disagg.openai.client``). Only a stream that outlives ``DRAIN_TIMEOUT_S`` after that is cancelled.
- **Deadlines.** A job's stream carries the request timeout as its gRPC deadline; a control request
  (ping, stop) ``CONTROL_TIMEOUT_S``.
- **Liveness.** A server that dies resets its connections: its streams end at once and the call fails
  UNAVAILABLE. A server cut off by a partition sends nothing at all; the channel's keepalive pings
  (every ``KEEPALIVE_TIME_MS``, each answered within ``KEEPALIVE_TIMEOUT_MS``) find that within seconds
  and fail its streams the same way. The server must accept pings that often (``disagg.serverconfig``
  passes ``--grpc-http2-max-ping-strikes=0``). A server that fails a call is taken out of the pool's
  rotation until a ping finds it back; the watcher's pings reach every listed server.
- **Reconnection** is gRPC's own: a channel reconnects on its next call, with backoff.

A remote pool is never restarted from here: its own server (``disagg serve`` restarts a dead
tritonserver) or its Deployment does that.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

import grpc
import numpy as np
import tritonclient.grpc.aio as grpcclient
from tritonclient.utils import InferenceServerException

from disagg.engine.sequence import Request, SequenceState
from disagg.protocol.errors import DEADLINE, INTERNAL, UNAVAILABLE, ServingError
from disagg.protocol.messages import Control, Failed, Ping, PoolLoad, Prefilled, Stop, Token
from disagg.serving.auth import PARAMETER, TokenSigner
from disagg.serving.endpoints import Endpoint, Endpoints, Resolve, resolve_host
from disagg.tls import GrpcTls
from disagg.triton import glue, wire

log = logging.getLogger(__name__)

KEEPALIVE_TIME_MS = 2000
KEEPALIVE_TIMEOUT_MS = 4000
CONTROL_TIMEOUT_S = 10.0
PING_TIMEOUT_S = 4.0  # one server's ping: under the watcher's probe timeout, so one silent server
# does not fail the ping of a pool whose other servers answered
DRAIN_TIMEOUT_S = 30.0  # a call its caller left: how long its job may take to end after the stop
REMEMBERED = 65536  # handles and leases remembered for their stops and aborts (oldest forgotten)
FINAL = "triton_final_response"
MAX_RECONNECT_MS = 2000
CHANNEL_ARGS = [  # tritonclient's own defaults, with keepalive and a short reconnection backoff
    ("grpc.max_send_message_length", grpcclient.MAX_GRPC_MESSAGE_SIZE),
    ("grpc.max_receive_message_length", grpcclient.MAX_GRPC_MESSAGE_SIZE),
    ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
    ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.initial_reconnect_backoff_ms", 500),
    ("grpc.min_reconnect_backoff_ms", 500),
    ("grpc.max_reconnect_backoff_ms", MAX_RECONNECT_MS),
]


def new_client(url: str, tls: GrpcTls | None = None) -> Any:
    """A ``tritonclient.grpc.aio`` client on ``url`` with keepalive pings (see the module docstring)
    and a reconnection backoff capped at ``MAX_RECONNECT_MS``: gRPC's default grows to 120 s, so a
    server listed long before it started would be found that late. With ``tls``, over mutual TLS."""
    options = tls.client_options() if tls is not None else {}
    return grpcclient.InferenceServerClient(url, channel_args=CHANNEL_ARGS, **options)


def _tensor(name: str, value: Any) -> Any:
    if name == "input_ids":
        array = np.asarray(value, dtype=np.int32).reshape(-1)
        kind = "INT32"
    else:
        data = value.encode() if isinstance(value, str) else value
        array, kind = np.array([data], dtype=np.object_), "BYTES"
    tensor = grpcclient.InferInput(name, list(array.shape), kind)
    tensor.set_data_from_numpy(array)
    return tensor


def _output(result: Any, name: str) -> bytes | None:
    return glue.first_bytes(result.as_numpy(name))


def _is_final(result: Any) -> bool:
    params = result.get_response().parameters
    return FINAL in params and params[FINAL].bool_param


class _Call:
    """One open stream: where it runs, and whether its pool was found lost meanwhile."""

    def __init__(self, pool: str, endpoint: Endpoint, responses: Any, done: asyncio.Event) -> None:
        self.pool = pool
        self.endpoint = endpoint
        self.responses = responses
        self.done = done  # set: the request side closes (the server then ends the stream)
        self.lost = False
        self.answered = False  # a response came
        self.pending: asyncio.Future[Any] | None = None  # a read its caller stopped waiting for
        self.unreached = False  # it failed UNAVAILABLE before any response: try another server


class RemotePools:
    """PoolClient for the pools of ``specs`` (pool -> servers spec); ``models``: pool -> model name."""

    def __init__(
        self,
        signer: TokenSigner,
        specs: Mapping[str, str],
        models: Mapping[str, str],
        call_timeout_s: float,
        client_factory: Callable[[str], Any] = new_client,
        resolve: Resolve = resolve_host,
    ) -> None:
        self._signer = signer
        self.endpoints = {pool: Endpoints(pool, spec, resolve) for pool, spec in specs.items()}
        self.models = dict(models)
        self._call_timeout_s = call_timeout_s
        self._client_factory = client_factory
        self._clients: dict[str, Any] = {}
        self._jobs: OrderedDict[tuple[str, str], Endpoint] = OrderedDict()  # (pool, handle) -> server
        self._open: set[_Call] = set()
        self._draining: set[asyncio.Task[None]] = set()

    def __contains__(self, pool: object) -> bool:
        return pool in self.endpoints

    @property
    def open_calls(self) -> int:
        return len(self._open)

    def server_counts(self) -> dict[tuple[str, str], int]:
        """(pool, state) -> how many of its listed servers are in that state: ``up``, ``down`` or
        ``unknown`` (not pinged yet). Read from the metrics thread while the event loop may change a
        list: a read that raced with a change is read again."""
        for _ in range(3):
            counts: dict[tuple[str, str], int] = {}
            try:
                for pool, endpoints in self.endpoints.items():
                    for endpoint in endpoints.listed():
                        state = {True: "up", False: "down", None: "unknown"}[endpoint.up]
                        counts[(pool, state)] = counts.get((pool, state), 0) + 1
            except RuntimeError:  # dictionary changed size during iteration
                continue
            return counts
        return {}

    def pool_lost(self, pool: str) -> None:
        """The watcher found the pool gone: its open calls end UNAVAILABLE now."""
        self.endpoints[pool].all_down()
        for call in [c for c in self._open if c.pool == pool]:
            call.lost = True
            call.responses.cancel()

    async def close(self) -> None:
        for task in list(self._draining):
            task.cancel()
        for client in self._clients.values():
            with contextlib.suppress(Exception):
                await client.close()
        self._clients.clear()

    def _client(self, url: str) -> Any:
        client = self._clients.get(url)
        if client is None:
            client = self._clients[url] = self._client_factory(url)
        return client

    @staticmethod
    def _remember(table: OrderedDict[Any, Endpoint], key: Any, endpoint: Endpoint) -> None:
        table[key] = endpoint
        table.move_to_end(key)
        while len(table) > REMEMBERED:
            table.popitem(last=False)

    def _open_stream(
        self, pool: str, endpoint: Endpoint, values: Mapping[str, Any], timeout_s: float
    ) -> _Call:
        request = {
            "model_name": self.models[pool],
            "inputs": [_tensor(name, value) for name, value in values.items()],
            "parameters": {
                PARAMETER: self._signer.mint(wire.call_subject(values.get("handle"), values.get("control"))),
                "triton_enable_empty_final_response": True,
            },
        }
        done = asyncio.Event()

        async def one_request() -> AsyncIterator[dict[str, Any]]:
            yield request
            await done.wait()  # the request side stays open until the request has ended

        responses = self._client(endpoint.url).stream_infer(one_request(), stream_timeout=timeout_s)
        call = _Call(pool, endpoint, responses, done)
        self._open.add(call)
        endpoint.open += 1
        return call

    def _closed(self, call: _Call) -> None:
        if call in self._open:
            self._open.discard(call)
            call.endpoint.open -= 1
        call.done.set()

    async def _results(self, call: _Call) -> AsyncIterator[Any]:
        """The responses of one call up to its final one (an empty final response is not yielded).

        Raises ServingError: a refusal as the pool sent it; UNAVAILABLE when the server or the link
        failed (the server is then out of rotation) or the watcher found the pool lost."""
        where = f"the {call.pool} server at {call.endpoint.url}"
        finished = False
        try:
            while True:
                # shielded: a caller cancelled while it waits (its client left, its deadline) must not
                # cancel the stream; the read goes on in the drain below
                reading = asyncio.ensure_future(call.responses.__anext__())
                try:
                    result, error = await asyncio.shield(reading)
                except StopAsyncIteration:
                    finished = True
                    raise ServingError(UNAVAILABLE, f"{where} ended a call before its answer") from None
                except (grpc.RpcError, InferenceServerException, asyncio.CancelledError) as exc:
                    if isinstance(exc, asyncio.CancelledError) and not reading.done():
                        call.pending = reading  # this caller was cancelled, not the stream
                        raise
                    finished = True
                    if not call.lost and isinstance(exc, asyncio.CancelledError):
                        raise
                    raise self._failure(call, exc) from None
                if error is not None:  # a refusal is the request's last response
                    call.answered = finished = True
                    raise glue.untagged_error(str(error.message()))
                final = _is_final(result)
                has_event = _output(result, "event") is not None
                if final or has_event:
                    call.answered = True  # a pool's empty acceptance does not count: nothing ran yet
                if final:
                    finished = True
                if has_event:
                    yield result
                if final:
                    return
        finally:
            if finished:
                self._closed(call)
            else:  # the caller left early: it sends a stop; the job's stream ends after it
                task = asyncio.ensure_future(self._drain(call))
                self._draining.add(task)
                task.add_done_callback(self._draining.discard)

    def _failure(self, call: _Call, exc: BaseException) -> ServingError:
        where = f"the {call.pool} server at {call.endpoint.url}"
        if call.lost:
            return ServingError(UNAVAILABLE, f"the {call.pool} pool stopped responding (it was lost)")
        code = exc.code() if isinstance(exc, grpc.RpcError) and callable(getattr(exc, "code", None)) else None
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            return ServingError(DEADLINE, f"{where} did not finish the request in time")
        self.endpoints[call.pool].down(call.endpoint)
        call.unreached = code == grpc.StatusCode.UNAVAILABLE and not call.answered
        status = getattr(code, "name", None)
        if status is None and isinstance(exc, InferenceServerException):
            status = exc.status()
        log.warning("%s failed a call (%s); it is out of rotation until it answers a ping", where, status)
        return ServingError(UNAVAILABLE, f"{where} is not reachable ({status or 'connection lost'})")

    async def _drain(self, call: _Call) -> None:
        async def to_end() -> None:
            pending, call.pending = call.pending, None
            while True:
                result, error = await (pending if pending is not None else call.responses.__anext__())
                pending = None
                if error is not None or _is_final(result):
                    return

        try:
            await asyncio.wait_for(to_end(), DRAIN_TIMEOUT_S)
        except StopAsyncIteration:
            pass
        except (
            TimeoutError,
            asyncio.TimeoutError,
            grpc.RpcError,
            InferenceServerException,
            asyncio.CancelledError,
        ):
            call.responses.cancel()
        finally:
            self._closed(call)

    async def _events(
        self, pool: str, handle: str, values: Mapping[str, Any]
    ) -> AsyncIterator[Token | Prefilled]:
        """A job's events from one server of the pool. A server that could not be reached (nothing
        came back: refused, reset, no route) is out of rotation, and the job goes to the next one."""
        endpoints = self.endpoints[pool]
        for _ in range(len(endpoints.listed())):
            endpoint = endpoints.pick()
            self._remember(self._jobs, (pool, handle), endpoint)
            call = self._open_stream(pool, endpoint, {"handle": handle, **values}, self._call_timeout_s)
            try:
                async with contextlib.aclosing(self._results(call)) as results:
                    async for result in results:
                        raw = _output(result, "event") or b""
                        event = wire.decode_event(raw, _output(result, "descriptor"))
                        if isinstance(event, Failed):
                            raise event.error
                        yield event  # type: ignore[misc]
                return
            except ServingError:
                if not call.unreached or not [e for e in endpoints.listed() if e.up is not False]:
                    raise
                log.warning(
                    "the %s server at %s is not reachable: the job goes to another", pool, endpoint.url
                )
        raise ServingError(UNAVAILABLE, f"no server of the remote {pool} pool could be reached")

    async def prefill(self, handle: str, request: Request) -> Prefilled:
        sampling = wire.encode_sampling(request.params)
        values = {"input_ids": list(request.prompt_token_ids), "sampling": sampling}
        result = None
        async with contextlib.aclosing(self._events("prefill", handle, values)) as events:
            async for event in events:
                result = event
        if not isinstance(result, Prefilled):
            raise ServingError(INTERNAL, "the prefill pool answered out of protocol")
        return result

    async def _tokens(self, pool: str, handle: str, values: Mapping[str, Any]) -> AsyncIterator[Token]:
        async with contextlib.aclosing(self._events(pool, handle, values)) as events:
            async for event in events:
                if isinstance(event, Token):
                    yield event

    def decode(
        self, handle: str, state: SequenceState, descriptor: bytes, pool: str = "decode"
    ) -> AsyncIterator[Token]:
        return self._tokens(pool, handle, {"state": wire.encode_state(state), "descriptor": descriptor})

    def generate(self, handle: str, request: Request, pool: str = "colocated") -> AsyncIterator[Token]:
        state = SequenceState(request.prompt_token_ids, request.generated_token_ids, request.params)
        return self._tokens(pool, handle, {"state": wire.encode_state(state)})

    async def _control(self, pool: str, endpoint: Endpoint, control: Control) -> bytes | None:
        """Send a control request to one server; the event of its answer, if it had one."""
        values = {"control": wire.encode_control(control)}
        call = self._open_stream(pool, endpoint, values, CONTROL_TIMEOUT_S)
        event = None
        async with contextlib.aclosing(self._results(call)) as results:
            async for result in results:
                event = _output(result, "event") or event
        return event

    async def stop(self, pool: str, handle: str) -> None:
        endpoint = self._jobs.pop((pool, handle), None)
        if endpoint is not None:  # else no job of it ever went out
            await self._control(pool, endpoint, Stop(handle))

    async def ping(self, pool: str) -> PoolLoad:
        """Ping every server of the pool (resolving its spec again when due): the sum of the loads of
        those that answered; ServingError(UNAVAILABLE) when none did."""
        endpoints = self.endpoints[pool]
        loop = asyncio.get_running_loop()
        if endpoints.due(loop.time()):  # the DNS lookup off the loop, the list changed on it
            endpoints.apply(await loop.run_in_executor(None, endpoints.resolve), loop.time())
        listed = endpoints.listed()
        answers = await asyncio.gather(*(self._ping_one(pool, e) for e in listed), return_exceptions=True)
        loads = [a for a in answers if isinstance(a, PoolLoad)]
        if not loads:
            message = f"no server of the remote {pool} pool answers ({len(listed)} listed)"
            raise ServingError(UNAVAILABLE, message)
        return PoolLoad(
            **{name: sum(getattr(load, name) for load in loads) for name in PoolLoad.__dataclass_fields__}
        )

    async def _ping_one(self, pool: str, endpoint: Endpoint) -> PoolLoad:
        endpoints = self.endpoints[pool]
        try:
            raw = await asyncio.wait_for(self._control(pool, endpoint, Ping()), PING_TIMEOUT_S)
            load = wire.decode_load(raw or b"")
        except (ServingError, ValueError, KeyError, TypeError, TimeoutError, asyncio.TimeoutError):
            endpoints.down(endpoint)
            raise
        if endpoints.answered(endpoint):
            log.info("the %s server at %s answers: in rotation", pool, endpoint.url)
        return load
