"""The orchestrator's BLS client (``TritonPools``) against a pool's response sender (``TritonSink``),
through a fake of the Python backend that behaves like Triton 2.51: a decoupled call's iterator ends
after the response flagged final, and an error response after the first one never reaches it (the
backend loses its stream id). A job's failure must still end the caller's call, and every call must
be counted closed once its final response is read, by the caller or by a drain."""

from __future__ import annotations

import asyncio
import queue
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from disagg.engine.params import SamplingParams
from disagg.engine.sequence import Request, SequenceState
from disagg.protocol.errors import CANCELLED, STUB_DEAD, UNAVAILABLE, Reason, ServingError
from disagg.protocol.messages import Event, Failed, PoolLoad, Token
from disagg.serving.auth import TokenSigner
from disagg.triton import bls, wire
from disagg.triton.bls import TritonPools
from disagg.triton.pool_model import TritonSink

FINAL = 1


class _Tensor:
    def __init__(self, name: str, array: np.ndarray) -> None:
        self.name, self._array = name, array

    def as_numpy(self) -> np.ndarray:
        return self._array


class _Response:
    def __init__(self, output_tensors: list[_Tensor] | None = None, error: Any = None) -> None:
        self.outputs = {t.name: t for t in output_tensors or []}
        self._error = error

    def has_error(self) -> bool:
        return self._error is not None

    def error(self) -> Any:
        return self._error


class _Error:
    UNAVAILABLE, INVALID_ARG, CANCELLED, INTERNAL = range(4)

    def __init__(self, message: str, code: int = 3) -> None:
        self._message = message

    def message(self) -> str:
        return self._message


class _Stream:
    """One decoupled call's responses as the caller's iterator sees them on Triton 2.51."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[_Response | None] = queue.SimpleQueue()
        self._sent = 0
        self.ended = False  # the caller's iterator read the final response

    def send(self, response: _Response | None = None, flags: int = 0) -> None:
        first = self._sent == 0
        self._sent += 1
        if response is not None and response.has_error() and not first:
            response = None  # lost on its way (no stream id); only its final flag would have ended it
            if flags & FINAL:
                return
        if response is not None:
            self._queue.put(response)
        if flags & FINAL:
            self._queue.put(None)

    def __iter__(self) -> Iterator[_Response]:
        # Triton's iterator would wait forever for a lost final; a bounded wait keeps a failing test short
        while (response := self._queue.get(timeout=2)) is not None:
            yield response
        self.ended = True


class _FakePb:
    """The pb_utils calls TritonPools and TritonSink make; requests go to ``pool(inputs, stream)``."""

    TRITONSERVER_RESPONSE_COMPLETE_FINAL = FINAL
    TRITONSERVER_MEMORY_CPU = "cpu-memory"
    TritonError = _Error
    Tensor = _Tensor
    InferenceResponse = _Response

    def __init__(self, pool: Any) -> None:
        self.pool = pool
        self.streams: list[_Stream] = []
        self.gate: asyncio.Event | None = None  # when set up: calls are accepted once it is set
        self.sent = 0  # calls sent so far (accepted or not)
        self.preferred: list[tuple[str, int] | None] = []  # each call's preferred output memory
        fake = self

        class InferenceRequest:
            def __init__(
                self, *, model_name: str, inputs: list[_Tensor], preferred_memory: Any = None, **_: Any
            ) -> None:
                self.inputs = {t.name: t.as_numpy() for t in inputs}
                fake.preferred.append(preferred_memory)

            async def async_exec(self, decoupled: bool) -> Iterator[_Response]:
                fake.sent += 1
                if fake.gate is not None:
                    await fake.gate.wait()
                stream = _Stream()
                fake.streams.append(stream)
                fake.pool(self.inputs, stream)
                return iter(stream)

        self.InferenceRequest = InferenceRequest

    @staticmethod
    def get_output_tensor_by_name(response: _Response, name: str) -> _Tensor | None:
        return response.outputs.get(name)

    @staticmethod
    def PreferredMemory(memory_type: str, device_id: int) -> tuple[str, int]:
        return (memory_type, device_id)


def _pools(events: list[tuple[Event, bool]]) -> tuple[TritonPools, list[str]]:
    """Pools whose every job is accepted and then emits ``events`` through a real TritonSink; controls
    are answered empty and recorded."""
    controls: list[str] = []

    def pool(inputs: dict[str, np.ndarray], stream: _Stream) -> None:
        if "control" in inputs:
            controls.append(inputs["control"].reshape(-1)[0].decode())
            stream.send(flags=FINAL)
            return
        sink = TritonSink(pb, stream, descriptor_output=False)
        sink.accept()  # as the pool model does: an empty response before any event
        for event, final in events:
            sink.emit(event, final)

    pb = _FakePb(pool)
    models = {"prefill": "prefill", "decode": "decode", "colocated": "colocated"}
    return TritonPools(pb, TokenSigner(b"k" * 32), models, max_inflight=4), controls


STATE = SequenceState((1, 2, 3), (4,), SamplingParams(max_tokens=8))


async def _read(tokens: Any, stop_after: int | None = None) -> list[int]:
    got = []
    async for token in tokens:
        got.append(token.token_id)
        if stop_after is not None and len(got) == stop_after:
            await tokens.aclose()
            break
    return got


def _all_closed(pools: TritonPools) -> bool:
    """Once every drain has run (the executor joined): every call read to its final response, and
    none counted open."""
    pools._executor.shutdown(wait=True)
    pools._control_executor.shutdown(wait=True)
    return all(stream.ended for stream in pools._pb.streams) and pools.open_calls == 0


def test_a_failure_after_tokens_ends_the_call_with_its_code_and_closes_it() -> None:
    """A stream stopped or failed by its pool after some tokens: the caller sees the pool's error
    (not a call that never ends), and nothing is left open."""
    pools, _ = _pools(
        [(Token(7, False), False), (Failed(ServingError(CANCELLED, "request was stopped")), True)]
    )
    got: list[int] = []

    async def run() -> None:
        async for token in pools.decode("h", STATE, b"descriptor"):
            got.append(token.token_id)

    with pytest.raises(ServingError) as failed:
        asyncio.run(run())
    assert (failed.value.code, failed.value.message) == (CANCELLED, "request was stopped")
    assert got == [7]
    assert _all_closed(pools)


def test_a_stream_left_early_is_drained_to_its_final_response_and_closed() -> None:
    """The caller stops reading after one token (a stop string, a cancel): the rest, ending in the
    pool's failure event, is drained in the background and the call counted closed."""
    events = [(Token(i, False), False) for i in range(3)]
    pools, controls = _pools([*events, (Failed(ServingError(CANCELLED, "request was stopped")), True)])

    async def run() -> list[int]:
        got = await _read(pools.decode("h", STATE, b"descriptor"), stop_after=1)
        await pools.stop("decode", "h")
        return got

    assert asyncio.run(run()) == [0]
    assert controls and '"stop"' in controls[0]
    assert _all_closed(pools)


def test_a_finished_stream_closes_its_call() -> None:
    pools, _ = _pools([(Token(1, False), False), (Token(2, True, "length"), True)])
    request = Request(STATE.prompt_token_ids, STATE.params, STATE.generated_token_ids)
    assert asyncio.run(_read(pools.generate("h", request))) == [1, 2]
    # every call asks for its outputs in CPU memory (a pool on a GPU could answer in GPU memory)
    assert pools._pb.preferred == [("cpu-memory", 0)]
    assert _all_closed(pools)


def test_a_refusal_as_the_first_response_still_reaches_the_caller() -> None:
    """A pool refusing a job at once (its first and only response) may answer with an event or a
    Triton error: both end the call with the pool's code."""
    full = ServingError(UNAVAILABLE, "decode pool is full; retry later", Reason.FULL)
    pools, _ = _pools([(Failed(full), True)])

    async def run() -> None:
        await _read(pools.decode("h", STATE, b"descriptor"))

    with pytest.raises(ServingError) as failed:
        asyncio.run(run())
    assert (failed.value.code, failed.value.reason) == (UNAVAILABLE, Reason.FULL)
    assert _all_closed(pools)


async def _until(condition: Any, timeout_s: float = 5.0) -> None:
    """Yield to the loop until ``condition()`` holds (a bounded wait for callbacks, not a delay)."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached"
        await asyncio.sleep(0.001)


@pytest.mark.parametrize("kind", ["decode", "prefill", "ping"])
def test_a_caller_that_leaves_before_its_call_is_accepted_leaves_it_drained(kind: str) -> None:
    """A request cancelled while its call waits to be accepted (queued behind a busy pool), or a ping
    that timed out: once the call is accepted it is read to its end in the background, not left
    open in the stub forever."""
    pools, _ = _pools([(Token(1, False), False), (Token(2, True, "length"), True)])
    pb = pools._pb

    async def run() -> None:
        pb.gate = asyncio.Event()
        if kind == "decode":
            caller = _read(pools.decode("h", STATE, b"descriptor"))
        elif kind == "prefill":
            caller = pools.prefill("h", Request(STATE.prompt_token_ids, STATE.params))
        else:
            caller = pools.ping("decode")
        task = asyncio.ensure_future(caller)
        await _until(lambda: pb.sent == 1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        pb.gate.set()  # accepted only now
        await _until(lambda: pb.streams and pb.streams[0].ended)

    asyncio.run(run())
    assert _all_closed(pools)


def test_a_call_accepted_while_its_overdue_probe_fails_is_drained(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under overload a call can be accepted while the probe of its overdue pool is still out; when
    that probe then fails, the call (given up by its caller) must still be read to its end."""
    monkeypatch.setattr(bls, "PROBE_AFTER_S", 0.0)  # probe at once
    monkeypatch.setattr(bls, "CHECK_S", 0.01)
    pools, _ = _pools([(Token(1, False), False), (Token(2, True, "length"), True)])
    pb = pools._pb

    async def probe_that_fails(pool: str) -> PoolLoad:
        pb.gate.set()  # the call is accepted while this probe waits
        await _until(lambda: pb.streams)
        raise ServingError(UNAVAILABLE, "the decode pool did not answer its probe")

    pools.ping = probe_that_fails  # type: ignore[method-assign]

    async def run() -> None:
        pb.gate = asyncio.Event()
        with pytest.raises(ServingError, match="stopped responding"):
            await _read(pools.decode("h", STATE, b"descriptor"))
        await _until(lambda: pb.streams[0].ended)

    asyncio.run(run())
    assert _all_closed(pools)


def _held_pools(max_inflight: int) -> tuple[TritonPools, list[_Stream], list[float]]:
    """Pools that hold every job unanswered (the test ends them) and answer each ping at once with a
    load; the times of the pings are recorded."""
    held: list[_Stream] = []
    pings: list[float] = []
    load = wire.encode_load(
        PoolLoad(queued=0, queued_prompt_tokens=0, active_sequences=0, blocks_used=0, blocks_free=8)
    )

    def pool(inputs: dict[str, np.ndarray], stream: _Stream) -> None:
        if "control" in inputs:
            pings.append(time.monotonic())
            stream.send(_Response([_Tensor("event", np.array([load], dtype=np.object_))]), flags=FINAL)
        else:
            held.append(stream)

    pb = _FakePb(pool)
    models = {"prefill": "prefill", "decode": "decode", "colocated": "colocated"}
    return TritonPools(pb, TokenSigner(b"k" * 32), models, max_inflight=max_inflight), held, pings


def _end(pools: TritonPools, held: list[_Stream]) -> None:
    for stream in held:
        TritonSink(pools._pb, stream, descriptor_output=False).emit(Token(1, True, "length"), True)


def test_overdue_calls_of_one_pool_share_their_probe(monkeypatch: pytest.MonkeyPatch) -> None:
    """Twenty calls overdue at once send one ping per round between them, not one each: under
    overload a probe per waiting call flooded the pool (and the threads reading answers)."""
    monkeypatch.setattr(bls, "PROBE_AFTER_S", 0.05)
    monkeypatch.setattr(bls, "CHECK_S", 0.01)
    pools, held, pings = _held_pools(max_inflight=32)

    async def run() -> None:
        readers = [asyncio.ensure_future(_read(pools.decode(f"h{i}", STATE, b"d"))) for i in range(20)]
        await _until(lambda: len(held) == 20)
        await _until(lambda: len(pings) >= 3)  # three probe rounds with every call overdue
        assert len(pings) <= 5, f"{len(pings)} pings for 20 overdue calls in three rounds"
        _end(pools, held)
        assert [await reader for reader in readers] == [[1]] * 20

    asyncio.run(run())
    assert _all_closed(pools)


def test_a_probe_is_answered_while_every_job_thread_waits(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every thread that reads job answers is blocked on a pool that is slow to answer: a ping still
    gets its answer read at once, on threads of its own, instead of queueing behind them and timing
    out (which had a live, busy pool declared gone)."""
    pools, held, pings = _held_pools(max_inflight=4)

    async def run() -> None:
        readers = [asyncio.ensure_future(_read(pools.decode(f"h{i}", STATE, b"d"))) for i in range(4)]
        await _until(lambda: len(held) == 4)
        load = await asyncio.wait_for(pools.ping("decode"), 1.0)
        assert load.blocks_free == 8 and len(pings) == 1
        _end(pools, held)
        assert [await reader for reader in readers] == [[1]] * 4

    asyncio.run(run())
    assert _all_closed(pools)


def _unanswering_pools() -> tuple[TritonPools, list[_Stream], list[_Stream]]:
    """Pools that hold every job and answer no ping until the test does (a front end too busy to read
    answers, or a pool too busy to give them): the held jobs and the held pings."""
    held: list[_Stream] = []
    pings: list[_Stream] = []

    def pool(inputs: dict[str, np.ndarray], stream: _Stream) -> None:
        (pings if "control" in inputs else held).append(stream)

    models = {"prefill": "prefill", "decode": "decode", "colocated": "colocated"}
    return TritonPools(_FakePb(pool), TokenSigner(b"k" * 32), models, max_inflight=8), held, pings


def test_a_call_to_an_overloaded_pool_outlives_its_unanswered_probes(monkeypatch: pytest.MonkeyPatch) -> None:
    """A pool the orchestrator already finds saturated whose probes time out is slow, not gone: its
    calls keep waiting for their answers (abandoning them re-ran their work on another rung, as
    overloaded as this one, and a burst cascaded into shedding everything). A pool found lost still
    ends them, and a pool not known to be overloaded still fails them."""
    monkeypatch.setattr(bls, "PROBE_AFTER_S", 0.0)
    monkeypatch.setattr(bls, "PROBE_TIMEOUT_S", 0.02)
    monkeypatch.setattr(bls, "CHECK_S", 0.01)
    pools, held, pings = _unanswering_pools()
    overloaded = {"decode"}
    pools.overloaded = lambda pool: pool in overloaded

    async def run() -> None:
        slow = asyncio.ensure_future(_read(pools.decode("slow", STATE, b"d")))
        lost = asyncio.ensure_future(_read(pools.decode("lost", STATE, b"d")))
        await _until(lambda: len(held) == 2)
        await _until(lambda: len(pings) >= 10)  # ten probes sent and left unanswered
        assert not slow.done() and not lost.done()
        TritonSink(pools._pb, held[0], descriptor_output=False).emit(Token(1, True, "length"), True)
        assert await slow == [1], "answered at last, and the answer reached its caller"
        pools.pool_lost("decode")
        with pytest.raises(ServingError, match="it was lost"):
            await lost
        overloaded.clear()
        with pytest.raises(ServingError, match="stopped responding"):
            await _read(pools.decode("healthy-but-silent", STATE, b"d"))
        _end(pools, held[1:])
        await _until(lambda: all(stream.ended for stream in held))

    asyncio.run(run())
    assert pools.open_calls == 0 and len(pings) >= 5, "every job call closed; the probes kept coming"


def test_a_call_to_a_pool_whose_stub_died_ends_at_its_next_check(monkeypatch: pytest.MonkeyPatch) -> None:
    """Triton 2.51 answers a call to a dead stub "not healthy" only after a second or so; a stub known
    dead (``StubWatch``) ends the pool's waiting calls at their next check, with that message."""
    monkeypatch.setattr(bls, "CHECK_S", 0.01)
    pools, held, _ = _unanswering_pools()
    dead: set[str] = set()
    checks: list[str] = []

    def is_dead(pool: str) -> bool:
        checks.append(pool)
        return pool in dead

    monkeypatch.setattr(pools.stubs, "dead", is_dead)

    async def run() -> None:
        waiting = asyncio.ensure_future(_read(pools.decode("h", STATE, b"d")))
        await _until(lambda: len(held) == 1)
        seen = len(checks)
        await _until(lambda: len(checks) >= seen + 3)  # several checks: alive, so it waits
        assert not waiting.done()
        dead.add("decode")
        with pytest.raises(ServingError, match=STUB_DEAD) as failed:
            await waiting
        assert failed.value.code == UNAVAILABLE
        _end(pools, held)
        await _until(lambda: held[0].ended)

    asyncio.run(run())
    assert pools.open_calls == 0
