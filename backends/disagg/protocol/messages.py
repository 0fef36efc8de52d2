"""The typed messages of a pool: jobs in, events out, and the engine loop's inbox. Torch-free.

One job type per operation (``disagg.role.Operation``): ``PrefillJob`` (prefill and export the KV),
``DecodeJob`` (import the KV and decode), ``GenerateJob`` (both, colocated). Every job ends with
exactly one final event: its last ``Token``, its ``Prefilled`` result, or ``Failed``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import ClassVar, Protocol

from disagg.engine.sequence import Request, SequenceState
from disagg.kv.descriptor import Descriptor
from disagg.protocol.errors import ServingError
from disagg.role import Operation

# ---------------------------------------------------------------- identity


@dataclass(frozen=True)
class JobId:
    """One request's identity at the pools: the id its entry point gave it, and which attempt (0, then
    one more per migration, so that a pool still holding the last attempt's job never mistakes the next
    for it). ``str`` is its wire form: the jobs' ``handle``, which a pool token is bound to."""

    request: str
    attempt: int = 0

    def __post_init__(self) -> None:
        if not self.request or "~" in self.request or self.attempt < 0:
            raise ValueError(f"bad job id {self.request!r} attempt {self.attempt}")

    def __str__(self) -> str:
        return self.request if self.attempt == 0 else f"{self.request}~{self.attempt}"


# ---------------------------------------------------------------- events (pool -> orchestrator)


@dataclass(frozen=True)
class Token:
    token_id: int
    finished: bool
    finish_reason: str | None = None


@dataclass(frozen=True)
class Prefilled:
    token_id: int
    finished: bool
    finish_reason: str | None
    descriptor: bytes | None  # None when the first token already ends the sequence
    lease_id: str | None
    state: SequenceState | None


@dataclass(frozen=True)
class Failed:
    error: ServingError


Event = Token | Prefilled | Failed


class Sink(Protocol):
    """Where a job's events go (a Triton response sender, or a queue in tests)."""

    def emit(self, event: Event, final: bool) -> None: ...

    def is_cancelled(self) -> bool: ...


# ---------------------------------------------------------------- jobs (orchestrator -> pool)


@dataclass(frozen=True, eq=False)
class PrefillJob:
    """Prefill ``request`` and export its KV (a prefill pool)."""

    operation: ClassVar[Operation] = Operation.PREFILL
    handle: str  # the orchestrator's id for the request, used by stop()
    sink: Sink
    request: Request
    submitted: float = field(default_factory=time.monotonic)


@dataclass(frozen=True, eq=False)
class DecodeJob:
    """Import a sequence prefilled elsewhere (its state and signed KV descriptor) and decode it.
    ``descriptor``: the signed token as it came; the pool's loop replaces it with the verified
    ``Descriptor`` when it takes the job, so that it is verified once."""

    operation: ClassVar[Operation] = Operation.DECODE
    handle: str
    sink: Sink
    state: SequenceState
    descriptor: bytes | Descriptor
    submitted: float = field(default_factory=time.monotonic)

    @property
    def request(self) -> Request:
        return Request(self.state.prompt_token_ids, self.state.params)


@dataclass(frozen=True, eq=False)
class GenerateJob:
    """Both phases of ``request`` in this pool (colocated)."""

    operation: ClassVar[Operation] = Operation.GENERATE
    handle: str
    sink: Sink
    request: Request
    submitted: float = field(default_factory=time.monotonic)


Job = PrefillJob | DecodeJob | GenerateJob


def prompt_tokens(job: Job) -> int:
    """Tokens a prefill of ``job`` computes (a resumed request's generated tokens included)."""
    return len(job.request.context_token_ids)


# ---------------------------------------------------------------- the engine loop's inbox


@dataclass(frozen=True)
class Submit:
    job: Job


@dataclass(frozen=True)
class Stop:
    """The orchestrator stops a request (its client cancelled, or a stop string ended it)."""

    handle: str


@dataclass(frozen=True)
class Cancelled:
    """The response sender of a request reports it cancelled."""

    handle: str


@dataclass(frozen=True)
class Released:
    """The transport reports an exported lease ended (acked, aborted or expired)."""

    lease_id: str
    reason: str


Message = Submit | Stop | Cancelled | Released


# ---------------------------------------------------------------- control requests to a pool


@dataclass(frozen=True)
class Ping:
    """A liveness probe: a live pool answers at once, with its ``PoolLoad``."""


@dataclass(frozen=True)
class PoolLoad:
    """A pool instance's answer to a ``Ping``: its load, which the orchestrator judges health by.

    Fields are only ever added, with a default: a pool of an older version answers without the newer
    ones (``wire.decode_load`` gives them their default). Counters (``prompt_tokens_done``,
    ``busy_s``, ``engine_steps``) only grow while the instance lives; a pool of several servers
    answers the sum of each field (``disagg.triton.remote``)."""

    queued: int  # jobs waiting for admission
    queued_prompt_tokens: int  # prompt tokens not prefilled yet
    active_sequences: int  # in the decode batch
    blocks_used: int
    blocks_free: int
    prompt_tokens_done: int = 0  # prompt tokens prefilled since the instance started ...
    busy_s: float = 0.0  # ... and the seconds its engine has computed: the throughput, from two loads
    engine_steps: int = 0  # engine calls since it started: busy_s per step is its mean step time
    prefill_busy_s: float = 0.0
    """Of ``busy_s``, the seconds of the calls that prefilled (decode steps alone left out): with
    ``prompt_tokens_done``, the prefill throughput of a pool that decodes too (0: a pool of an older
    version, whose ``busy_s`` stands in)."""

    @property
    def kv_use(self) -> float:
        """Share of the KV blocks in use, 0..1."""
        total = self.blocks_used + self.blocks_free
        return self.blocks_used / total if total else 0.0


Control = Stop | Ping
