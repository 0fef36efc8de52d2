"""What a scheduler hands the runner (``Plan``), what the runner hands back (results), and what
the scheduler then emits (``Emission``) or gives up (``Removal``)."""

from __future__ import annotations

from dataclasses import dataclass

from disagg.engine.backend import Exported
from disagg.engine.sequence import StepOutput
from disagg.protocol.errors import ServingError
from disagg.protocol.messages import DecodeJob, Event, GenerateJob, Job, PrefillJob


@dataclass(frozen=True)
class Chunk:
    """Prefill the next ``tokens`` prompt tokens of ``job``; ``seq_id`` is None for its first chunk
    (the runner starts the sequence). The chunk that completes the prompt yields the first token (and,
    for a PrefillJob, the export)."""

    job: PrefillJob | GenerateJob
    seq_id: int | None
    tokens: int


@dataclass(frozen=True)
class Plan:
    """One engine-loop iteration's work, run in this order."""

    refused: tuple[tuple[Job, ServingError], ...] = ()
    prefill: tuple[Chunk, ...] = ()
    imports: tuple[DecodeJob, ...] = ()  # pull each one's KV, join the decode batch
    decode: bool = False  # one decode step over the batch
    fused: bool = False  # the prompt chunks and the decode step in one forward pass

    @property
    def empty(self) -> bool:
        return not (self.refused or self.prefill or self.imports or self.decode)

    @property
    def jobs(self) -> tuple[Job, ...]:
        """The jobs the plan names (the decode batch's are the scheduler's): while it runs, the
        scheduler waits for their results, so an engine fault must end them from here."""
        return (*(job for job, _ in self.refused), *(c.job for c in self.prefill), *self.imports)


# ---------------------------------------------------------------- results of running a plan


@dataclass(frozen=True)
class Refused:
    """The job ended before (or instead of) running; whatever the engine held for it is back."""

    job: Job
    error: ServingError


@dataclass(frozen=True)
class Progressed:
    """A chunk of a prompt was prefilled; more of it remains."""

    job: PrefillJob | GenerateJob
    seq_id: int


@dataclass(frozen=True)
class Started:
    """A generate job was prefilled; its sequence is in the decode batch (unless ``output.finished``)."""

    job: GenerateJob
    seq_id: int
    output: StepOutput


@dataclass(frozen=True)
class Handed:
    """A prefill job was prefilled; its KV is offered under a lease (``exported``), or its first token
    already ended it (``exported`` is None, the engine freed it)."""

    job: PrefillJob
    seq_id: int
    output: StepOutput
    exported: Exported | None


@dataclass(frozen=True)
class Joined:
    """A decode job's KV arrived; its sequence is in the decode batch."""

    job: DecodeJob
    seq_id: int
    transfer_s: float


@dataclass(frozen=True)
class Stepped:
    """One decode step: new tokens of the batch's sequences, in order (finished ones already freed),
    and the sequences the engine failed (freed too)."""

    outputs: tuple[StepOutput, ...]
    failed: tuple[int, ...] = ()


Result = Refused | Progressed | Started | Handed | Joined | Stepped


# ---------------------------------------------------------------- what the loop does next


@dataclass(frozen=True)
class Emission:
    """An event for a job; ``final`` ends the job (exactly one final per job)."""

    job: Job
    event: Event
    final: bool


@dataclass(frozen=True)
class Removal:
    """A request taken out of the scheduler (stopped or cancelled): the loop ends ``job`` (if it was
    still running or queued), frees ``seq_id`` in the engine, and aborts ``lease_id``."""

    job: Job | None
    seq_id: int | None = None
    lease_id: str | None = None
