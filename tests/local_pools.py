"""Pools reached in-process: EngineLoops behind the orchestrator's PoolClient interface, for the
orchestrator's unit tests (the reference behaviour the Triton BLS client, ``disagg.triton.pools``,
must match). Served pools are always reached through Triton."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

from disagg.engine.sequence import Request, SequenceState
from disagg.pool.loop import EngineLoop
from disagg.protocol.errors import UNAVAILABLE, ServingError
from disagg.protocol.messages import (
    DecodeJob,
    Event,
    Failed,
    GenerateJob,
    Job,
    PoolLoad,
    Prefilled,
    PrefillJob,
    Token,
)


class QueueSink:
    """A Sink that hands events from the loop thread to an asyncio queue."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self.queue: asyncio.Queue[tuple[Event, bool]] = asyncio.Queue()
        self.cancelled = False

    def emit(self, event: Event, final: bool) -> None:
        self._loop.call_soon_threadsafe(self.queue.put_nowait, (event, final))

    def is_cancelled(self) -> bool:
        return self.cancelled


class LocalPools:
    def __init__(
        self,
        prefill: EngineLoop | None = None,
        decode: EngineLoop | None = None,
        colocated: EngineLoop | None = None,
        decode_hot: EngineLoop | None = None,
    ) -> None:
        """``decode_hot``: a second decode pool, the hot prompts' (``orchestrator.HOT_POOL``)."""
        self.loops = {"prefill": prefill, "decode": decode, "colocated": colocated, "decode_hot": decode_hot}

    def _loop(self, pool: str) -> EngineLoop:
        loop = self.loops.get(pool)
        if loop is None:
            raise ServingError(UNAVAILABLE, f"no {pool} pool is deployed")
        return loop

    def _submit(self, pool: str, make: Callable[[QueueSink], Job]) -> QueueSink:
        sink = QueueSink(asyncio.get_running_loop())
        job = make(sink)
        loop = self._loop(pool)
        loop.validate(job)
        loop.submit(job)
        return sink

    async def prefill(self, handle: str, request: Request) -> Prefilled:
        sink = self._submit("prefill", lambda sink: PrefillJob(handle, sink, request))
        event, _ = await sink.queue.get()
        if isinstance(event, Failed):
            raise event.error
        if not isinstance(event, Prefilled):
            raise ServingError("INTERNAL", "prefill pool answered out of protocol")
        return event

    async def _stream(self, sink: QueueSink) -> AsyncIterator[Token]:
        while True:
            event, final = await sink.queue.get()
            if isinstance(event, Failed):
                raise event.error
            if isinstance(event, Token):
                yield event
            if final:
                return

    def decode(
        self, handle: str, state: SequenceState, descriptor: bytes, pool: str = "decode"
    ) -> AsyncIterator[Token]:
        return self._stream(self._submit(pool, lambda sink: DecodeJob(handle, sink, state, descriptor)))

    def generate(self, handle: str, request: Request, pool: str = "colocated") -> AsyncIterator[Token]:
        return self._stream(self._submit(pool, lambda sink: GenerateJob(handle, sink, request)))

    async def stop(self, pool: str, handle: str) -> None:
        self._loop(pool).stop(handle)

    async def ping(self, pool: str) -> PoolLoad:
        loop = self._loop(pool)
        if not loop.healthy:
            raise ServingError(UNAVAILABLE, f"the {pool} pool is not serving")
        return loop.stats().load()
