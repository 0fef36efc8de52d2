"""The orchestrator's client for pools on other Triton servers (``disagg.triton.remote.RemotePools``),
against a fake of ``tritonclient.grpc.aio`` streaming: each call is one stream carrying one signed
request; its events come back as the pool sends them; a failed server is taken out of rotation; stops
and lease aborts go to the server that holds the job or the lease; a caller that stops reading early
leaves its stream drained (not cancelled), and a pool found lost ends its open calls at once."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from types import SimpleNamespace
from typing import Any, TypeVar

import grpc
import numpy as np
import pytest
from tritonclient.utils import InferenceServerException, deserialize_bytes_tensor

from disagg.engine.params import SamplingParams
from disagg.engine.sequence import Request, SequenceState
from disagg.protocol.errors import CANCELLED, DEADLINE, INVALID_ARG, UNAVAILABLE, Reason, ServingError
from disagg.protocol.messages import (
    Control,
    Event,
    Failed,
    Ping,
    PoolLoad,
    Prefilled,
    Stop,
    Token,
)
from disagg.serving.auth import PARAMETER, TokenSigner
from disagg.triton import remote, wire
from disagg.triton.remote import CONTROL_TIMEOUT_S, RemotePools

T = TypeVar("T")
SECRET = b"k" * 32
MODELS = {"prefill": "prefill-model", "decode": "decode-model", "colocated": "colocated-model"}
CALL_TIMEOUT_S = 30.0
PARAMS = SamplingParams(max_tokens=8, temperature=0.0)
STATE = SequenceState((1, 2, 3), (4,), PARAMS)
_CANCEL = object()  # what cancel() puts in a stream: its pending read raises CancelledError


def _load(**fields: Any) -> PoolLoad:
    zero = {"queued": 0, "queued_prompt_tokens": 0, "active_sequences": 0, "blocks_used": 0}
    return PoolLoad(**{**zero, "blocks_free": 8, **fields})


def _rpc_error(code: grpc.StatusCode) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details="x")


class _Result:
    """A tritonclient InferResult: BYTES outputs, and whether it is the request's final response."""

    def __init__(self, outputs: dict[str, bytes], final: bool) -> None:
        self._outputs = outputs
        self._parameters = {remote.FINAL: SimpleNamespace(bool_param=final)}

    def as_numpy(self, name: str) -> np.ndarray | None:
        value = self._outputs.get(name)
        return None if value is None else np.array([value], dtype=np.object_)

    def get_response(self) -> Any:
        return SimpleNamespace(parameters=self._parameters)


def _inputs(tensors: list[Any]) -> dict[str, np.ndarray]:
    """The values of the client's InferInputs, as the server would read them."""
    values = {}
    for tensor in tensors:
        raw = tensor._get_content()
        if tensor.datatype() == "BYTES":
            array = deserialize_bytes_tensor(raw)
        else:
            assert tensor.datatype() == "INT32"
            array = np.frombuffer(raw, dtype=np.int32)
        values[tensor.name()] = array.reshape(list(tensor.shape()))
    return values


class _Stream:
    """One ``stream_infer`` call: the request the client sent, and the responses the test puts in."""

    def __init__(self, server: _Server, stream_timeout: float | None) -> None:
        self.server = server
        self.stream_timeout = stream_timeout
        self.request: dict[str, Any] = {}
        self.inputs: dict[str, np.ndarray] = {}
        self.request_closed = asyncio.Event()  # the client's request iterator ended
        self.cancelled = False  # cancel() was called (by the client, or by a cancelled read as in grpc.aio)
        self.ended = False  # a final response was sent
        self._queue: asyncio.Queue[Any] = asyncio.Queue()

    # ---- the client's side (tritonclient's _ResponseIterator)

    def __aiter__(self) -> _Stream:
        return self

    async def __anext__(self) -> tuple[Any, Any]:
        try:
            item = await self._queue.get()
        except asyncio.CancelledError:  # as grpc.aio: a read cancelled by its caller cancels the call
            if not self.cancelled:
                self.cancel()
            raise
        if item is _CANCEL:
            raise asyncio.CancelledError
        if isinstance(item, BaseException) or item is StopAsyncIteration:
            raise item
        return item

    def cancel(self) -> bool:
        if self.cancelled:
            return False
        self.cancelled = True
        self._queue.put_nowait(_CANCEL)
        return True

    # ---- the server's side

    def text(self, name: str) -> str | None:
        value = self.inputs.get(name)
        return None if value is None else value.reshape(-1)[0].decode()

    def send(self, event: Event, final: bool = False) -> None:
        outputs = {"event": wire.encode_event(event).encode()}
        if isinstance(event, Prefilled) and event.descriptor is not None:
            outputs["descriptor"] = event.descriptor
        self._respond(_Result(outputs, final), final)

    def send_raw(self, event: bytes, final: bool = True) -> None:
        self._respond(_Result({"event": event}, final), final)

    def finish(self) -> None:
        """The empty final response (``triton_enable_empty_final_response``)."""
        self._respond(_Result({}, True), True)

    def error(self, message: str) -> None:
        self.ended = True
        self._queue.put_nowait((None, InferenceServerException(msg=message)))

    def fail(self, exc: BaseException | type[StopAsyncIteration]) -> None:
        self.ended = True
        self._queue.put_nowait(exc)

    def _respond(self, result: _Result, final: bool) -> None:
        self.ended = self.ended or final
        self._queue.put_nowait((result, None))


class _Server:
    """One pool server: answers pings with ``load`` (none while it is None), records every control,
    ends the job a Stop names, and queues every job stream for the test (answering it with
    ``script`` first, when set)."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.load: PoolLoad | None = _load()
        self.ping_failure: Callable[[_Stream], None] | None = None
        self.script: list[tuple[Event, bool]] = []
        self.jobs: asyncio.Queue[_Stream] = asyncio.Queue()
        self.job_streams: list[_Stream] = []
        self.controls: list[Control] = []
        self.control_streams: list[_Stream] = []
        self.held_pings: list[_Stream] = []

    def arrive(self, stream: _Stream) -> None:
        if "control" not in stream.inputs:
            self.job_streams.append(stream)
            for event, final in self.script:
                stream.send(event, final)
            self.jobs.put_nowait(stream)
            return
        control = wire.decode_control(stream.inputs["control"].reshape(-1)[0])
        self.controls.append(control)
        self.control_streams.append(stream)
        if isinstance(control, Ping):
            if self.ping_failure is not None:
                self.ping_failure(stream)
            elif self.load is None:
                self.held_pings.append(stream)
            else:
                stream.send_raw(wire.encode_load(self.load).encode())
            return
        stream.finish()
        if isinstance(control, Stop):
            for job in self.job_streams:
                if job.text("handle") == control.handle and not job.ended:
                    job.send(Failed(ServingError(CANCELLED, "request was stopped")), final=True)


class _Client:
    """A ``tritonclient.grpc.aio.InferenceServerClient`` on one server."""

    def __init__(self, server: _Server) -> None:
        self.server = server
        self.closed = False
        self._readers: set[asyncio.Task[None]] = set()

    def stream_infer(
        self, inputs_iterator: AsyncIterator[dict[str, Any]], stream_timeout: Any = None
    ) -> _Stream:
        stream = _Stream(self.server, stream_timeout)
        reader = asyncio.ensure_future(self._read(stream, inputs_iterator))
        self._readers.add(reader)
        reader.add_done_callback(self._readers.discard)
        return stream

    async def _read(self, stream: _Stream, requests: AsyncIterator[dict[str, Any]]) -> None:
        async for request in requests:
            assert not stream.request, "one request per stream"
            stream.request = request
            stream.inputs = _inputs(request["inputs"])
            self.server.arrive(stream)
        stream.request_closed.set()

    async def close(self) -> None:
        self.closed = True


class _Fleet:
    """Servers by url, and the client factory RemotePools is given."""

    def __init__(self, *urls: str) -> None:
        self.servers = {url: _Server(url) for url in urls}
        self.clients: dict[str, _Client] = {}
        self.made: list[str] = []

    def __getitem__(self, url: str) -> _Server:
        return self.servers[url]

    def client(self, url: str) -> _Client:
        self.made.append(url)
        client = self.clients[url] = _Client(self.servers[url])
        return client


def _no_dns(name: str) -> list[str]:
    raise AssertionError(f"a static spec is never resolved ({name!r})")


def _pools(fleet: _Fleet, **specs: str) -> RemotePools:
    return RemotePools(TokenSigner(SECRET), specs, MODELS, CALL_TIMEOUT_S, fleet.client, _no_dns)


def _run(test: Callable[[], Awaitable[T]]) -> T:
    return asyncio.run(test())


async def _tokens(tokens: AsyncIterator[Token]) -> list[Token]:
    return [token async for token in tokens]


def _check_request(stream: _Stream, model: str, timeout_s: float) -> None:
    """Every pool request: to the pool's model, with a valid internal token and empty final responses."""
    assert stream.request["model_name"] == model
    parameters = stream.request["parameters"]
    assert set(parameters) == {PARAMETER, "triton_enable_empty_final_response"}
    assert parameters["triton_enable_empty_final_response"] is True
    subject = wire.call_subject(_first(stream.inputs.get("handle")), _first(stream.inputs.get("control")))
    TokenSigner(SECRET).check(parameters[PARAMETER], subject)  # bound to this call's job or control
    assert TokenSigner(SECRET).refusal(parameters[PARAMETER], subject + b"x") == "mismatch"
    assert stream.stream_timeout == timeout_s


def _first(array: np.ndarray | None) -> bytes | None:
    return None if array is None else bytes(array.reshape(-1)[0])


FIRST = Token(1, False)


async def _decoding(
    pools: RemotePools, server: _Server, handle: str = "h1", first: Token = FIRST
) -> tuple[AsyncIterator[Token], _Stream]:
    """A decode of ``handle`` whose job reached ``server`` and whose first token the caller has read."""
    tokens = pools.decode(handle, STATE, b"d")
    reader = asyncio.ensure_future(anext(tokens))
    stream = await server.jobs.get()
    stream.send(first)
    assert await reader == first
    return tokens, stream


def _endpoint(pools: RemotePools, pool: str, url: str) -> Any:
    endpoint = pools.endpoints[pool].get(url)
    assert endpoint is not None
    return endpoint


# ---------------------------------------------------------------- calls that end well


def test_prefill_returns_its_prefilled_event_with_the_descriptor() -> None:
    fleet = _Fleet("p:1")
    fleet["p:1"].script = [(Prefilled(9, False, None, b"signed-descriptor", "lease-1", STATE), True)]
    pools = _pools(fleet, prefill="p:1")

    async def test() -> None:
        result = await pools.prefill("h1", Request((1, 2, 3), PARAMS))
        assert result == Prefilled(9, False, None, b"signed-descriptor", "lease-1", STATE)
        (stream,) = fleet["p:1"].job_streams
        _check_request(stream, "prefill-model", CALL_TIMEOUT_S)
        assert set(stream.inputs) == {"handle", "input_ids", "sampling"}
        assert stream.text("handle") == "h1"
        ids = stream.inputs["input_ids"]
        assert ids.dtype == np.int32 and ids.tolist() == [1, 2, 3]
        assert wire.decode_sampling(stream.inputs["sampling"].reshape(-1)[0]) == PARAMS
        await asyncio.wait_for(stream.request_closed.wait(), 5)  # the request side closed after the final
        assert pools.open_calls == 0 and not stream.cancelled

    _run(test)


def test_a_prefill_that_answers_no_prefilled_event_is_out_of_protocol() -> None:
    fleet = _Fleet("p:1")
    fleet["p:1"].script = [(Token(3, True, "length"), True)]
    pools = _pools(fleet, prefill="p:1")
    with pytest.raises(ServingError, match="out of protocol"):
        _run(lambda: pools.prefill("h1", Request((1, 2, 3), PARAMS)))
    assert pools.open_calls == 0


def test_decode_yields_tokens_until_the_final_response() -> None:
    """Tokens as they come; the empty final response ends the call without a token of its own."""
    fleet = _Fleet("d:1")
    fleet["d:1"].script = [
        (Token(5, False), False),
        (Token(6, False), False),
        (Token(7, True, "stop"), False),
    ]
    pools = _pools(fleet, decode="d:1")

    async def test() -> list[Token]:
        tokens = pools.decode("h1", STATE, b"descriptor")
        first = await anext(tokens)
        stream = fleet["d:1"].job_streams[0]
        assert pools.open_calls == 1 and _endpoint(pools, "decode", "d:1").open == 1
        reader = asyncio.ensure_future(_tokens(tokens))
        stream.finish()
        rest = await reader
        _check_request(stream, "decode-model", CALL_TIMEOUT_S)
        assert set(stream.inputs) == {"handle", "state", "descriptor"}
        assert stream.text("handle") == "h1" and stream.text("descriptor") == "descriptor"
        assert wire.decode_state(stream.inputs["state"].reshape(-1)[0]) == STATE
        await asyncio.wait_for(stream.request_closed.wait(), 5)
        assert pools.open_calls == 0 and _endpoint(pools, "decode", "d:1").open == 0
        return [first, *rest]

    assert _run(test) == [Token(5, False), Token(6, False), Token(7, True, "stop")]


def test_generate_yields_tokens_until_the_final_one() -> None:
    fleet = _Fleet("c:1")
    fleet["c:1"].script = [(Token(1, False), False), (Token(2, True, "length"), True)]
    pools = _pools(fleet, colocated="c:1")
    request = Request((1, 2, 3), PARAMS, (4,))

    async def test() -> list[Token]:
        tokens = await _tokens(pools.generate("h9", request))
        (stream,) = fleet["c:1"].job_streams
        _check_request(stream, "colocated-model", CALL_TIMEOUT_S)
        assert set(stream.inputs) == {"handle", "state"}
        assert wire.decode_state(stream.inputs["state"].reshape(-1)[0]) == STATE  # generated ids kept
        assert pools.open_calls == 0
        return tokens

    assert _run(test) == [Token(1, False), Token(2, True, "length")]


def test_a_generate_on_another_pool_goes_to_that_pools_model() -> None:
    fleet = _Fleet("p:1")
    fleet["p:1"].script = [(Token(1, True, "length"), True)]
    pools = _pools(fleet, prefill="p:1")

    async def test() -> None:
        tokens = await _tokens(pools.generate("h", Request((1,), PARAMS), pool="prefill"))
        assert tokens == [Token(1, True, "length")]
        assert fleet["p:1"].job_streams[0].request["model_name"] == "prefill-model"

    _run(test)


def test_one_client_per_server_reused_and_closed() -> None:
    fleet = _Fleet("a:1", "b:1")
    pools = _pools(fleet, decode="a:1,b:1")
    assert "decode" in pools and "prefill" not in pools

    async def test() -> None:
        for _ in range(3):
            await pools.ping("decode")
        assert sorted(fleet.made) == ["a:1", "b:1"]
        await pools.close()
        assert all(client.closed for client in fleet.clients.values())

    _run(test)


# ---------------------------------------------------------------- calls that fail


def test_a_failed_event_raises_its_error_with_its_code() -> None:
    fleet = _Fleet("d:1")
    fleet["d:1"].script = [
        (Token(5, False), False),
        (Failed(ServingError(CANCELLED, "request was stopped")), True),
    ]
    pools = _pools(fleet, decode="d:1")
    got: list[int] = []

    async def test() -> None:
        async for token in pools.decode("h1", STATE, b"descriptor"):
            got.append(token.token_id)

    with pytest.raises(ServingError) as failed:
        _run(test)
    assert (failed.value.code, failed.value.message) == (CANCELLED, "request was stopped")
    assert got == [5] and pools.open_calls == 0
    assert _endpoint(pools, "decode", "d:1").up is None  # the pool refused: the server is not at fault


@pytest.mark.parametrize(
    ("message", "code", "text"),
    [
        ("disagg-code:INVALID_ARG:bad", INVALID_ARG, "bad"),
        ("disagg-code:DEADLINE_EXCEEDED:too slow", DEADLINE, "too slow"),
        ("Stub process is not healthy.", UNAVAILABLE, "Stub process is not healthy."),
    ],
)
def test_an_error_response_raises_the_error_it_tags(message: str, code: str, text: str) -> None:
    fleet = _Fleet("d:1")
    pools = _pools(fleet, decode="d:1")

    async def test() -> None:
        reader = asyncio.ensure_future(_tokens(pools.decode("h1", STATE, b"descriptor")))
        stream = await fleet["d:1"].jobs.get()
        stream.error(message)
        await reader

    with pytest.raises(ServingError) as failed:
        _run(test)
    assert (failed.value.code, failed.value.message) == (code, text)
    assert pools.open_calls == 0


def test_a_connection_error_after_a_response_fails_the_call_and_takes_the_server_out_of_rotation() -> None:
    fleet = _Fleet("a:1", "b:1")
    fleet["b:1"].script = [(Token(1, True, "length"), True)]
    pools = _pools(fleet, decode="a:1,b:1")

    async def test() -> None:
        await pools.ping("decode")  # both up
        tokens, stream = await _decoding(pools, fleet["a:1"], first=Token(7, False))  # the first pick
        stream.fail(_rpc_error(grpc.StatusCode.UNAVAILABLE))
        with pytest.raises(ServingError) as failed:
            await anext(tokens)
        assert failed.value.code == UNAVAILABLE
        assert "a:1" in failed.value.message and "UNAVAILABLE" in failed.value.message
        assert _endpoint(pools, "decode", "a:1").up is False and pools.open_calls == 0
        assert len(fleet["b:1"].job_streams) == 0  # tokens went out: not run again elsewhere
        for handle in ("h2", "h3", "h4"):  # every next call avoids it
            assert await _tokens(pools.decode(handle, STATE, b"d")) == [Token(1, True, "length")]
        assert len(fleet["a:1"].job_streams) == 1 and len(fleet["b:1"].job_streams) == 3

    _run(test)


def test_a_server_not_reached_passes_the_job_to_another() -> None:
    """UNAVAILABLE before any response (refused, reset, no route): that server is out of rotation and
    the job goes to the next one, which its stop then reaches."""
    fleet = _Fleet("a:1", "b:1")
    fleet["b:1"].script = [(Token(1, True, "length"), True)]
    pools = _pools(fleet, decode="a:1,b:1")

    async def test() -> None:
        await pools.ping("decode")
        reader = asyncio.ensure_future(_tokens(pools.decode("h1", STATE, b"d")))
        (await fleet["a:1"].jobs.get()).fail(_rpc_error(grpc.StatusCode.UNAVAILABLE))
        assert await reader == [Token(1, True, "length")]
        assert _endpoint(pools, "decode", "a:1").up is False and pools.open_calls == 0
        (retried,) = fleet["b:1"].job_streams
        assert retried.text("handle") == "h1"
        _check_request(retried, "decode-model", CALL_TIMEOUT_S)
        await pools.stop("decode", "h1")
        assert fleet["b:1"].controls[-1] == Stop("h1") and fleet["a:1"].controls == [Ping()]

    _run(test)


@pytest.mark.parametrize("second", ["unreached", "no-other-up"])
def test_a_job_no_server_can_be_reached_for_fails_unavailable(second: str) -> None:
    fleet = _Fleet("a:1", "b:1")
    pools = _pools(fleet, decode="a:1,b:1")

    async def test() -> None:
        await pools.ping("decode")
        if second == "no-other-up":
            pools.endpoints["decode"].down(_endpoint(pools, "decode", "b:1"))
        reader = asyncio.ensure_future(_tokens(pools.decode("h1", STATE, b"d")))
        (await fleet["a:1"].jobs.get()).fail(_rpc_error(grpc.StatusCode.UNAVAILABLE))
        if second == "unreached":
            (await fleet["b:1"].jobs.get()).fail(_rpc_error(grpc.StatusCode.UNAVAILABLE))
        await reader

    with pytest.raises(ServingError) as failed:
        _run(test)
    assert failed.value.code == UNAVAILABLE and "not reachable" in failed.value.message
    assert pools.open_calls == 0
    assert len(fleet["b:1"].job_streams) == (1 if second == "unreached" else 0)
    assert [e.up for e in pools.endpoints["decode"].listed()] == [False, False]


@pytest.mark.parametrize(
    "failure",
    [
        lambda stream: stream.fail(_rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED)),
        lambda stream: stream.error("disagg-code:UNAVAILABLE/full:decode pool is full; retry later"),
        lambda stream: stream.send(
            Failed(ServingError(UNAVAILABLE, "KV cache is full, retry later", Reason.FULL)), True
        ),
    ],
    ids=["deadline", "refusal", "failed-event"],
)
def test_a_job_a_reached_server_refused_is_not_sent_to_another(failure: Callable[[_Stream], None]) -> None:
    fleet = _Fleet("a:1", "b:1")
    pools = _pools(fleet, decode="a:1,b:1")

    async def test() -> None:
        await pools.ping("decode")
        reader = asyncio.ensure_future(_tokens(pools.decode("h1", STATE, b"d")))
        failure(await fleet["a:1"].jobs.get())
        await reader

    with pytest.raises(ServingError):
        _run(test)
    assert fleet["b:1"].job_streams == [] and pools.open_calls == 0


def test_a_server_exception_fails_the_call_with_its_status() -> None:
    fleet = _Fleet("a:1")
    pools = _pools(fleet, decode="a:1")

    async def test() -> None:
        reader = asyncio.ensure_future(_tokens(pools.decode("h1", STATE, b"d")))
        (await fleet["a:1"].jobs.get()).fail(
            InferenceServerException("reset", status="StatusCode.UNAVAILABLE")
        )
        await reader

    with pytest.raises(ServingError) as failed:
        _run(test)
    assert failed.value.code == UNAVAILABLE and "StatusCode.UNAVAILABLE" in failed.value.message
    assert _endpoint(pools, "decode", "a:1").up is False


def test_a_deadline_fails_the_call_without_blaming_the_server() -> None:
    fleet = _Fleet("a:1")
    pools = _pools(fleet, decode="a:1")

    async def test() -> None:
        reader = asyncio.ensure_future(_tokens(pools.decode("h1", STATE, b"d")))
        (await fleet["a:1"].jobs.get()).fail(_rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED))
        await reader

    with pytest.raises(ServingError) as failed:
        _run(test)
    assert failed.value.code == DEADLINE and "in time" in failed.value.message
    assert _endpoint(pools, "decode", "a:1").up is None and pools.open_calls == 0


def test_a_stream_that_ends_before_its_final_response_fails_unavailable() -> None:
    fleet = _Fleet("a:1")
    pools = _pools(fleet, decode="a:1")
    got: list[Token] = []

    async def test() -> None:
        tokens = pools.decode("h1", STATE, b"d")
        reader = asyncio.ensure_future(anext(tokens))
        stream = await fleet["a:1"].jobs.get()
        stream.send(Token(1, False))
        got.append(await reader)
        stream.fail(StopAsyncIteration)
        await anext(tokens)

    with pytest.raises(ServingError, match="ended a call before its answer") as failed:
        _run(test)
    assert failed.value.code == UNAVAILABLE and got == [Token(1, False)] and pools.open_calls == 0


def test_no_server_up_is_unavailable_before_any_stream() -> None:
    fleet = _Fleet("a:1")
    pools = _pools(fleet, decode="a:1")
    pools.endpoints["decode"].all_down()
    with pytest.raises(ServingError) as failed:
        _run(lambda: _tokens(pools.decode("h1", STATE, b"d")))
    assert failed.value.code == UNAVAILABLE and fleet.made == []


# ---------------------------------------------------------------- stops and lease aborts


def test_a_stop_goes_to_the_server_running_the_job() -> None:
    fleet = _Fleet("a:1", "b:1")
    pools = _pools(fleet, decode="a:1,b:1")

    async def test() -> None:
        await pools.ping("decode")
        first = asyncio.ensure_future(_tokens(pools.decode("h1", STATE, b"d")))
        await fleet["a:1"].jobs.get()
        second = asyncio.ensure_future(_tokens(pools.decode("h2", STATE, b"d")))
        await fleet["b:1"].jobs.get()  # the least busy: b

        await pools.stop("decode", "h2")
        assert fleet["b:1"].controls[-1] == Stop("h2") and fleet["a:1"].controls == [Ping()]
        stop = fleet["b:1"].control_streams[-1]
        _check_request(stop, "decode-model", CONTROL_TIMEOUT_S)
        assert set(stop.inputs) == {"control"}
        with pytest.raises(ServingError, match="request was stopped"):
            await second  # the server ended the stopped job

        await pools.stop("decode", "h1")
        assert fleet["a:1"].controls[-1] == Stop("h1")
        with pytest.raises(ServingError, match="request was stopped"):
            await first

        await pools.stop("decode", "h1")  # already stopped: nothing more sent
        await pools.stop("decode", "never-sent")
        assert len(fleet["a:1"].controls) == 2 and len(fleet["b:1"].controls) == 2
        assert pools.open_calls == 0

    _run(test)


def test_a_stop_after_prefill_goes_to_the_prefill_server_that_holds_the_lease() -> None:
    fleet = _Fleet("a:1", "b:1")
    for url in ("a:1", "b:1"):
        fleet[url].script = [(Prefilled(1, False, None, b"d", f"lease-{url}", STATE), True)]
    pools = _pools(fleet, prefill="a:1,b:1")

    async def test() -> None:
        leases = [(await pools.prefill(f"h{i}", Request((1,), PARAMS))).lease_id for i in range(2)]
        assert leases == ["lease-a:1", "lease-b:1"]  # idle servers in turn
        await pools.stop("prefill", "h1")
        assert fleet["b:1"].controls == [Stop("h1")] and fleet["a:1"].controls == []
        _check_request(fleet["b:1"].control_streams[0], "prefill-model", CONTROL_TIMEOUT_S)
        await pools.stop("prefill", "h0")
        assert fleet["a:1"].controls == [Stop("h0")]
        await pools.stop("prefill", "h0")  # once only
        await pools.stop("prefill", "unknown")
        assert len(fleet["a:1"].controls) == len(fleet["b:1"].controls) == 1
        assert pools.open_calls == 0

    _run(test)


def test_the_oldest_jobs_are_forgotten_past_the_remembered_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(remote, "REMEMBERED", 2)
    fleet = _Fleet("a:1")
    fleet["a:1"].script = [(Token(1, True, "length"), True)]
    pools = _pools(fleet, decode="a:1")

    async def test() -> None:
        for handle in ("h1", "h2", "h3"):
            await _tokens(pools.decode(handle, STATE, b"d"))
        for handle in ("h1", "h2", "h3"):
            await pools.stop("decode", handle)
        assert fleet["a:1"].controls == [Stop("h2"), Stop("h3")]

    _run(test)


# ---------------------------------------------------------------- pings


def test_a_ping_sums_the_loads_of_the_servers_that_answered() -> None:
    fleet = _Fleet("a:1", "b:1", "c:1")
    fleet["a:1"].load = PoolLoad(1, 10, 2, 3, 5, prompt_tokens_done=100, busy_s=1.5, engine_steps=70)
    fleet["b:1"].load = PoolLoad(2, 20, 4, 6, 10, prompt_tokens_done=50, busy_s=0.25, engine_steps=30)
    fleet["c:1"].ping_failure = lambda stream: stream.fail(_rpc_error(grpc.StatusCode.UNAVAILABLE))
    pools = _pools(fleet, decode="a:1,b:1,c:1")

    async def test() -> PoolLoad:
        load = await pools.ping("decode")
        for url in ("a:1", "b:1"):
            _check_request(fleet[url].control_streams[0], "decode-model", CONTROL_TIMEOUT_S)
        return load

    # counters sum too: busy_s / engine_steps of the sum is the servers' mean step time, by steps
    assert _run(test) == PoolLoad(3, 30, 6, 9, 15, 150, 1.75, 100)
    assert [_endpoint(pools, "decode", u).up for u in ("a:1", "b:1", "c:1")] == [True, True, False]
    assert pools.open_calls == 0


def test_one_silent_server_does_not_hold_the_pools_ping_past_its_own_timeout(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A partitioned server never answers: the pool's ping still answers with the others' load within
    one server's ping timeout (well under the watcher's probe timeout), and the silent one is down."""
    monkeypatch.setattr(remote, "PING_TIMEOUT_S", 0.05)
    fleet = _Fleet("a:1", "b:1")
    fleet["b:1"].load = None  # b holds its pings unanswered
    pools = _pools(fleet, decode="a:1,b:1")

    assert _run(lambda: pools.ping("decode")) == _load()
    assert [_endpoint(pools, "decode", u).up for u in ("a:1", "b:1")] == [True, False]


@pytest.mark.parametrize("answer", ["rpc-error", "error-response", "not-a-load", "no-event"])
def test_a_ping_that_no_server_answers_is_unavailable(answer: str) -> None:
    fleet = _Fleet("a:1", "b:1")

    def fail(stream: _Stream) -> None:
        if answer == "rpc-error":
            stream.fail(_rpc_error(grpc.StatusCode.UNAVAILABLE))
        elif answer == "error-response":
            stream.error("Stub process is not healthy.")
        elif answer == "not-a-load":
            stream.send(Token(1, True), final=True)
        else:
            stream.finish()

    for server in fleet.servers.values():
        server.ping_failure = fail
    pools = _pools(fleet, decode="a:1,b:1")
    with pytest.raises(ServingError) as failed:
        _run(lambda: pools.ping("decode"))
    assert failed.value.code == UNAVAILABLE
    assert failed.value.message == "no server of the remote decode pool answers (2 listed)"
    assert [e.up for e in pools.endpoints["decode"].listed()] == [False, False]
    assert pools.open_calls == 0


def test_a_server_that_answers_a_ping_again_is_back_in_rotation() -> None:
    fleet = _Fleet("a:1", "b:1")
    for server in fleet.servers.values():
        server.script = [(Token(1, True, "length"), True)]
    fleet["a:1"].ping_failure = lambda stream: stream.fail(_rpc_error(grpc.StatusCode.UNAVAILABLE))
    pools = _pools(fleet, decode="a:1,b:1")

    async def test() -> None:
        await pools.ping("decode")
        for i in range(2):
            await _tokens(pools.decode(f"h{i}", STATE, b"d"))
        assert (len(fleet["a:1"].job_streams), len(fleet["b:1"].job_streams)) == (0, 2)

        fleet["a:1"].ping_failure = None
        await pools.ping("decode")
        assert _endpoint(pools, "decode", "a:1").up is True
        for i in range(2, 6):
            await _tokens(pools.decode(f"h{i}", STATE, b"d"))
        assert (len(fleet["a:1"].job_streams), len(fleet["b:1"].job_streams)) == (2, 4)

    _run(test)


def test_a_pool_with_no_server_up_comes_back_when_one_answers() -> None:
    fleet = _Fleet("a:1")
    fleet["a:1"].ping_failure = lambda stream: stream.fail(_rpc_error(grpc.StatusCode.UNAVAILABLE))
    fleet["a:1"].script = [(Token(1, True, "length"), True)]
    pools = _pools(fleet, decode="a:1")

    async def test() -> None:
        with pytest.raises(ServingError):
            await pools.ping("decode")
        with pytest.raises(ServingError, match="not available"):
            await _tokens(pools.decode("h1", STATE, b"d"))
        fleet["a:1"].ping_failure = None
        assert await pools.ping("decode") == _load()
        assert await _tokens(pools.decode("h2", STATE, b"d")) == [Token(1, True, "length")]

    _run(test)


def test_a_ping_resolves_a_dns_spec_again_and_pings_new_servers(monkeypatch: pytest.MonkeyPatch) -> None:
    from disagg.serving import endpoints

    monkeypatch.setattr(endpoints, "REFRESH_S", 0.0)  # due at every ping
    fleet = _Fleet("10.0.0.1:8001", "10.0.0.2:8001", "[fd00::3]:8001")
    answers: dict[str, list[str]] = {"svc": ["10.0.0.1"]}
    specs = {"decode": "dns:svc:8001"}
    pools = RemotePools(TokenSigner(SECRET), specs, MODELS, CALL_TIMEOUT_S, fleet.client, answers.__getitem__)

    async def test() -> None:
        assert await pools.ping("decode") == _load()
        answers["svc"] = ["10.0.0.2", "fd00::3"]
        assert await pools.ping("decode") == _load(blocks_free=16)
        assert len(fleet["10.0.0.1:8001"].controls) == 1  # left the pool: no longer pinged
        assert len(fleet["10.0.0.2:8001"].controls) == len(fleet["[fd00::3]:8001"].controls) == 1
        answers["svc"] = []
        with pytest.raises(ServingError, match=r"\(0 listed\)"):
            await pools.ping("decode")

    _run(test)


# ---------------------------------------------------------------- lost pools and callers that leave


def test_a_lost_pool_ends_its_open_calls_unavailable() -> None:
    fleet = _Fleet("a:1", "b:1", "c:1")
    pools = _pools(fleet, decode="a:1,b:1", colocated="c:1")

    async def test() -> None:
        waiting = []
        for handle in ("h1", "h2"):
            tokens, stream = await _decoding(pools, fleet["a:1"] if handle == "h1" else fleet["b:1"], handle)
            waiting.append((tokens, stream, asyncio.ensure_future(anext(tokens))))  # waits for its next token
        other = asyncio.ensure_future(_tokens(pools.generate("h3", Request((1,), PARAMS))))
        other_stream = await fleet["c:1"].jobs.get()
        assert pools.open_calls == 3

        pools.pool_lost("decode")
        for _, stream, next_token in waiting:
            with pytest.raises(ServingError) as failed:
                await next_token
            assert failed.value.code == UNAVAILABLE and "it was lost" in failed.value.message
            assert stream.cancelled
        assert pools.open_calls == 1 and not other.done() and not other_stream.cancelled
        assert [e.up for e in pools.endpoints["decode"].listed()] == [False, False]
        with pytest.raises(ServingError, match="not available"):
            await _tokens(pools.decode("h4", STATE, b"d"))

        other_stream.send(Token(2, True, "length"), final=True)  # another pool's call is untouched
        assert await other == [Token(2, True, "length")]
        assert pools.open_calls == 0

    _run(test)


def test_a_caller_that_stops_reading_early_leaves_its_stream_drained_not_cancelled() -> None:
    fleet = _Fleet("a:1")
    pools = _pools(fleet, decode="a:1")

    async def test() -> None:
        tokens, stream = await _decoding(pools, fleet["a:1"])
        await tokens.aclose()  # e.g. a stop string: the caller leaves before the final token
        assert pools.open_calls == 1 and not stream.request_closed.is_set()

        stream.send(Token(2, False))  # still being read, in the background
        stream.send(Token(3, True, "length"))
        stream.finish()
        await asyncio.wait_for(stream.request_closed.wait(), 5)
        assert pools.open_calls == 0 and _endpoint(pools, "decode", "a:1").open == 0
        assert not stream.cancelled

    _run(test)


def test_a_caller_that_leaves_and_stops_its_job_has_the_stream_drained_to_the_pools_failure() -> None:
    """The orchestrator's clean-up: leave the stream, send the stop; the pool ends the job with a
    Failed event, which the drain reads as the stream's final response."""
    fleet = _Fleet("a:1", "b:1")
    pools = _pools(fleet, decode="a:1,b:1")

    async def test() -> None:
        await pools.ping("decode")
        tokens, stream = await _decoding(pools, fleet["a:1"])
        await tokens.aclose()
        await pools.stop("decode", "h1")
        assert fleet["a:1"].controls[-1] == Stop("h1")
        await asyncio.wait_for(stream.request_closed.wait(), 5)
        assert pools.open_calls == 0 and not stream.cancelled
        assert _endpoint(pools, "decode", "a:1").up is True  # a stopped job is not the server's fault

    _run(test)


def test_a_drain_that_outlives_its_timeout_is_cancelled(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(remote, "DRAIN_TIMEOUT_S", 0.0)  # expires at the drain's first wait
    fleet = _Fleet("a:1")
    pools = _pools(fleet, decode="a:1")

    async def test() -> None:
        tokens, stream = await _decoding(pools, fleet["a:1"])
        await tokens.aclose()
        await asyncio.wait_for(stream.request_closed.wait(), 5)
        assert stream.cancelled and pools.open_calls == 0

    _run(test)


def test_a_lost_pool_also_ends_the_drains_of_its_calls() -> None:
    fleet = _Fleet("a:1")
    pools = _pools(fleet, decode="a:1")

    async def test() -> None:
        tokens, stream = await _decoding(pools, fleet["a:1"])
        await tokens.aclose()
        assert pools.open_calls == 1
        pools.pool_lost("decode")
        await asyncio.wait_for(stream.request_closed.wait(), 5)
        assert pools.open_calls == 0 and stream.cancelled

    _run(test)


def test_a_caller_cancelled_while_waiting_leaves_its_stream_drained_not_cancelled() -> None:
    fleet = _Fleet("a:1")
    pools = _pools(fleet, decode="a:1")

    async def test() -> None:
        waiting = asyncio.ensure_future(anext(pools.decode("h1", STATE, b"d")))
        stream = await fleet["a:1"].jobs.get()  # queued in the pool: nothing sent yet
        waiting.cancel()  # the client left (Orchestrator._unless_cancelled), or the request deadline
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert not stream.cancelled, "the stream was cancelled"
        assert pools.open_calls == 1, "the call was given up, not drained"
        stream.send(Token(1, True, "length"), final=True)
        await asyncio.wait_for(stream.request_closed.wait(), 5)
        assert pools.open_calls == 0

    _run(test)


def test_server_counts_say_how_many_servers_of_each_pool_are_up_down_or_unknown() -> None:
    fleet = _Fleet("a:1", "b:1", "c:1")
    fleet["b:1"].ping_failure = lambda stream: stream.fail(_rpc_error(grpc.StatusCode.UNAVAILABLE))
    pools = _pools(fleet, decode="a:1,b:1", prefill="c:1")
    assert pools.server_counts() == {("decode", "unknown"): 2, ("prefill", "unknown"): 1}
    _run(lambda: pools.ping("decode"))
    assert pools.server_counts() == {("decode", "up"): 1, ("decode", "down"): 1, ("prefill", "unknown"): 1}
