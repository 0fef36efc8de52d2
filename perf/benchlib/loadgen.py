"""Load generation: open-loop (`run_trace`), and closed-loop clients (`run_clients`) for overload.

Open loop: send each request of a trace when it is due, whatever the server does.

Contract of `run_trace`:
- Request i is sent at `t0 + trace[i].arrival` (t0 = the run's start on `time.perf_counter()`), in its own
  task, without waiting for any earlier request: a slow server never slows the arrivals down (closed-loop
  generators hide overload that way). The actual send time is recorded beside the scheduled one.
- The run is bounded: requests due after `max_duration_s` are not sent (recorded with error "not sent"),
  and requests still streaming `drain_timeout_s` after the last send are cancelled (error "timeout").
- Records carry times relative to t0; `benchlib.metrics` computes every figure from them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import math
import re
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from perf.benchlib.clients import StreamClient, StreamOutcome, output_tokens
from perf.benchlib.metrics import RequestRecord
from perf.benchlib.workload import RequestSpec


@dataclass(frozen=True)
class LoadConfig:
    """Bounds of one run."""

    max_duration_s: float = 600.0
    """No request is sent later than this after the start."""
    drain_timeout_s: float = 120.0
    """How long requests may still stream after the last send before they are cancelled."""
    start_delay_s: float = 0.05
    """Lead time before the first arrival, so that task start-up is not charged to request 0."""

    def __post_init__(self) -> None:
        for name in ("max_duration_s", "drain_timeout_s"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise ValueError(f"{name} must be a positive finite number")
        if not 0 <= self.start_delay_s <= 5:
            raise ValueError("start_delay_s must be in [0, 5]")


def to_record(
    spec: RequestSpec,
    t0: float,
    outcome: StreamOutcome | None,
    error: str | None,
    count_mode: str,
    retokenize: Callable[[str], int],
) -> RequestRecord:
    """A record relative to `t0` from a client outcome (None: the request never ran)."""
    if outcome is None:
        return RequestRecord(
            spec.index, spec.arrival, None, None, None, 0, 0, spec.prompt_tokens, spec.output_tokens,
            error or "not sent", spec.kind,
        )  # fmt: skip

    def rel(stamp: float | None) -> float | None:
        return None if stamp is None else stamp - t0

    failure = error or outcome.error
    if failure is None and outcome.first_piece is None:
        failure = "no output"
    return RequestRecord(
        index=spec.index,
        arrival=spec.arrival,
        sent=rel(outcome.sent),
        first_token=rel(outcome.first_piece),
        last_token=rel(outcome.last_piece),
        ended=rel(outcome.ended),
        n_pieces=outcome.n_pieces,
        n_tokens=output_tokens(outcome, count_mode, retokenize, spec.output_tokens),
        prompt_tokens=spec.prompt_tokens,
        target_output_tokens=spec.output_tokens,
        error=failure,
        kind=spec.kind,
    )


async def run_trace(
    client: StreamClient,
    trace: Sequence[RequestSpec],
    config: LoadConfig,
    retokenize: Callable[[str], int],
) -> list[RequestRecord]:
    """Replay `trace` open-loop against an opened `client`; one record per request, in trace order."""
    count_mode = client.config.count_mode
    loop_start = time.perf_counter()
    t0 = loop_start + config.start_delay_s
    tasks: dict[int, asyncio.Task[StreamOutcome]] = {}
    for spec in trace:
        if spec.arrival > config.max_duration_s:
            break
        delay = t0 + spec.arrival - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks[spec.index] = asyncio.create_task(client.stream(spec))
    if tasks:
        _, pending = await asyncio.wait(tasks.values(), timeout=config.drain_timeout_s)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    records = []
    for spec in trace:
        task = tasks.get(spec.index)
        if task is None:
            records.append(to_record(spec, t0, None, "not sent", count_mode, retokenize))
        elif task.cancelled():
            # Only the send time is known for certain; the partial stream is lost with the task.
            records.append(to_record(spec, t0, None, "timeout", count_mode, retokenize))
        elif task.exception() is not None:
            exc = task.exception()
            records.append(
                to_record(spec, t0, None, f"client crashed: {exc!r}"[:200], count_mode, retokenize)
            )
        else:
            records.append(to_record(spec, t0, task.result(), None, count_mode, retokenize))
    return records


RETRY_HINT = re.compile(r"retry after (\d+(?:\.\d+)?) s")
MAX_RETRY_WAIT_S = 60.0  # the longest Retry-After the OpenAI SDKs honour


def retry_hint(error: str | None) -> float:
    """The seconds a refusal asks its client to wait ("... retry after N s"), at most 60; 0 without one."""
    found = RETRY_HINT.search(error or "")
    return min(float(found.group(1)), MAX_RETRY_WAIT_S) if found else 0.0


async def run_clients(
    client: StreamClient,
    specs: Iterator[RequestSpec],
    clients: int,
    config: LoadConfig,
    retokenize: Callable[[str], int],
    honour_retry: bool = True,
) -> list[RequestRecord]:
    """Closed loop: `clients` clients, each sending its next request (the next of `specs`) as soon as
    its last one ended, until `max_duration_s` after the start; a refused request's client first waits
    the server's retry hint when `honour_retry` (as SDKs honour Retry-After). Each record's `arrival`
    is when it was sent (relative to the start), and the records come in that order. Requests still
    streaming `drain_timeout_s` after the end are cancelled (error "timeout")."""
    if clients < 1:
        raise ValueError("clients must be at least 1")
    count_mode = client.config.count_mode
    t0 = time.perf_counter() + config.start_delay_s
    end = t0 + config.max_duration_s
    records: list[RequestRecord] = []
    numbers = itertools.count()

    async def one_client() -> None:
        await asyncio.sleep(max(0.0, t0 - time.perf_counter()))
        while time.perf_counter() < end:
            spec = next(specs)
            spec = dataclasses.replace(spec, index=next(numbers), arrival=time.perf_counter() - t0)
            try:
                outcome = await client.stream(spec)
            except asyncio.CancelledError:
                records.append(to_record(spec, t0, None, "timeout", count_mode, retokenize))
                raise
            record = to_record(spec, t0, outcome, None, count_mode, retokenize)
            records.append(record)
            if honour_retry and record.first_token is None and record.error is not None:
                await asyncio.sleep(min(retry_hint(record.error), max(0.0, end - time.perf_counter())))

    tasks = [asyncio.create_task(one_client()) for _ in range(clients)]
    _, pending = await asyncio.wait(
        tasks, timeout=config.max_duration_s + config.start_delay_s + config.drain_timeout_s
    )
    for task in pending:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    return sorted(records, key=lambda r: r.arrival)
