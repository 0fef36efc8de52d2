"""Colocated continuous batching: both phases in one engine, the baseline disaggregation is judged by.

Each ``step()`` first admits waiting requests (prefilling them, which emits their first token) and
then runs one decode step over every active sequence. A long prompt admitted here stalls every
running sequence for the length of its prefill: exactly the interference disaggregation removes.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable
from dataclasses import dataclass

from disagg.engine.engine import Engine
from disagg.engine.errors import OutOfBlocks
from disagg.engine.sequence import Request, StepOutput


@dataclass(frozen=True)
class TokenEvent:
    """A new token for the request known to the caller as ``key``."""

    key: Hashable
    token_id: int
    finished: bool
    finish_reason: str | None


class ColocatedScheduler:
    """FIFO admission plus continuous batching over one Engine. Driven by one thread."""

    def __init__(self, engine: Engine, max_prefill_tokens: int = 4096) -> None:
        self.engine = engine
        self.max_prefill_tokens = max_prefill_tokens  # per step, so decode is not starved forever
        self._waiting: deque[tuple[Hashable, Request]] = deque()
        self._keys: dict[int, Hashable] = {}  # seq_id -> caller's key

    @property
    def idle(self) -> bool:
        return not self._waiting and not self._keys

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def submit(self, key: Hashable, request: Request) -> None:
        """Queue a request; invalid ones are refused here (InvalidRequest), before any work."""
        self.engine.validate(request)
        self._waiting.append((key, request))

    def cancel(self, key: Hashable) -> bool:
        """Drop a request wherever it is; True if it was found."""
        for item in self._waiting:
            if item[0] == key:
                self._waiting.remove(item)
                return True
        for seq_id, k in list(self._keys.items()):
            if k == key:
                del self._keys[seq_id]
                return self.engine.free(seq_id)
        return False

    def step(self) -> list[TokenEvent]:
        events = self._admit()
        for out in self.engine.decode_step():
            events.append(self._event(out))
        return events

    def _admit(self) -> list[TokenEvent]:
        events: list[TokenEvent] = []
        budget = self.max_prefill_tokens
        free_slots = self.engine.config.max_batch_size - len(self.engine.active_sequences())
        while self._waiting and free_slots > 0:
            key, request = self._waiting[0]
            if events and len(request.prompt_token_ids) > budget:
                break  # at least one prompt per step, however long
            try:
                (out,) = self.engine.prefill([request])
            except OutOfBlocks:
                break  # wait for running sequences to finish and free their blocks
            self._waiting.popleft()
            budget -= len(request.prompt_token_ids)
            free_slots -= 1
            self._keys[out.seq_id] = key
            events.append(self._event(out))
        return events

    def _event(self, out: StepOutput) -> TokenEvent:
        key = self._keys[out.seq_id]
        if out.finished:
            del self._keys[out.seq_id]
        return TokenEvent(key, out.token_id, out.finished, out.finish_reason)

    def run(self) -> list[TokenEvent]:
        """Step until every submitted request has finished (tests, CLI, benchmarks)."""
        events: list[TokenEvent] = []
        while not self.idle:
            stepped = self.step()
            if not stepped and self._waiting:
                raise OutOfBlocks(
                    self.engine.blocks_needed(self._waiting[0][1]), self.engine.pool.free_blocks
                )
            events.extend(stepped)
        return events


def generate(engine: Engine, request: Request) -> tuple[list[int], str | None]:
    """Generate one request to completion: (token ids incl. any end token, finish reason)."""
    scheduler = ColocatedScheduler(engine)
    scheduler.submit(0, request)
    events = scheduler.run()
    return [e.token_id for e in events], events[-1].finish_reason
