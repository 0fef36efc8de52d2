"""The scheduler every role shares: the queue, the running set, the block ledger, removal, and the
mapping of results to events. Each role's subclass says only what ``schedule()`` admits."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import ClassVar, Generic, TypeVar

from disagg.engine.backend import EngineLimits
from disagg.engine.sequence import StepOutput
from disagg.protocol.errors import INTERNAL, INVALID_ARG, UNAVAILABLE, Reason, ServingError
from disagg.protocol.messages import Failed, Job, PrefillJob, Token, prompt_tokens
from disagg.role import Role
from disagg.scheduling.ledger import BlockLedger
from disagg.scheduling.plan import (
    Chunk,
    Emission,
    Handed,
    Joined,
    Plan,
    Progressed,
    Refused,
    Removal,
    Result,
    Started,
    Stepped,
)


@dataclass(frozen=True)
class SchedulerConfig:
    """Queue bound and prefill budget of one pool instance."""

    max_queue: int = 256  # jobs waiting for admission; one more is refused UNAVAILABLE
    # prompt tokens prefilled per step, so the sequences already decoding keep getting tokens
    max_prefill_tokens: int = 4096
    # True: prompts are prefilled in chunks that fill the budget exactly (a step never runs more than
    # max_prefill_tokens of prompt); False: whole prompts, at least one per step however long
    chunked_prefill: bool = False
    # True: a prefill pool also runs generate jobs (both phases here, no KV hand-off): the fallback
    # that keeps requests served while the decode pool is gone or saturated ("local decode")
    local_generate: bool = False
    # > 0: a decode pool also runs generate jobs whose prompt has at most this many tokens, prefilled
    # here within ``max_prefill_tokens`` per step between decode steps: conditional disaggregation,
    # short prompts kept off a backlogged prefill pool (0: off)
    local_prefill_tokens: int = 0
    # a decode pool whose head job waits for KV blocks lets smaller imports behind it that fit go
    # first, at most this many times per head; then it is strict FIFO until the head is admitted, so
    # small requests keep flowing past a big one and the big one still gets its blocks (0: FIFO)
    max_overtakes: int = 16

    def __post_init__(self) -> None:
        """Ranges; the types are ``config.build``'s (through ``PoolConfig``; a config built by hand in
        code is trusted to be typed)."""
        for name in ("max_queue", "max_prefill_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive")
        for name in ("local_prefill_tokens", "max_overtakes"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")


@dataclass
class _Partial:
    """A job whose prompt is being prefilled: its sequence (None until the first chunk ran) and the
    prompt tokens not scheduled yet."""

    job: Job
    seq_id: int | None
    left: int


J = TypeVar("J", bound=Job)


class Scheduler(ABC, Generic[J]):
    """Driven by one thread (the engine loop); pure: it never calls the engine. ``J`` is the job type
    of the role's operation."""

    role: ClassVar[Role]
    job_type: ClassVar[type]

    def __init__(self, limits: EngineLimits, config: SchedulerConfig | None = None) -> None:
        self.limits = limits
        config = config or SchedulerConfig()
        if config.chunked_prefill and not limits.chunked_prefill:  # the engine prefills whole prompts
            config = replace(config, chunked_prefill=False)
        self.config = config
        self.operations = self.role.operations
        self.ledger = BlockLedger(limits.num_blocks)
        self._waiting: deque[J] = deque()
        self._running: dict[int, Job] = {}  # seq id -> job, in the decode batch
        self._prefilling: dict[str, _Partial] = {}  # handle -> partial prefill, in admission order
        self._seq_of: dict[str, int] = {}  # handle -> seq id, while in the decode batch
        self._known: set[str] = set()  # handles of every job not yet ended
        # sequences the batch may hold (the decode batch tuner lowers it; never above the engine's)
        self.batch_limit = limits.max_batch_size
        # after schedule(): jobs left waiting for a batch slot although their KV blocks were free
        self.slot_waiting = 0

    # ------------------------------------------------------------- queries

    @property
    def idle(self) -> bool:
        """Nothing to schedule: no job waits, prefills or decodes. Exported KV still held under a
        lease (``held_leases``) is not work: its release arrives as a message that wakes the loop,
        and an engine loop that kept iterating for it would spin its core until the importer acks."""
        return not self._waiting and not self._running and not self._prefilling

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_prefilling(self) -> int:
        return len(self._prefilling)

    @property
    def queued_prompt_tokens(self) -> int:
        """Prompt tokens not prefilled yet: the queue's, and what remains of prompts being prefilled."""
        return sum(prompt_tokens(job) for job in self._waiting) + sum(
            p.left for p in self._prefilling.values()
        )

    @property
    def held_leases(self) -> int:
        return 0

    def blocks_needed(self, job: Job) -> int:
        """Blocks the engine allocates for ``job`` (a prefill-only sequence holds just its prompt)."""
        return self.limits.blocks_needed(job.request, decode=not isinstance(job, PrefillJob))

    # ------------------------------------------------------------- admission

    def check(self, job: Job) -> None:
        """Refuse a job this pool can never run (ServingError INVALID_ARG). Pure; any thread."""
        if job.operation not in self.operations or not isinstance(job, self.job_type):
            raise ServingError(
                INVALID_ARG,
                f"a {self.role.value} pool does not run {job.operation.value} jobs",
                Reason.UNSUPPORTED,
            )
        needed = self.blocks_needed(job)
        if needed > self.limits.num_blocks:
            raise ServingError(
                INVALID_ARG,
                f"request needs {needed} KV blocks; the {self.role.value} pool has {self.limits.num_blocks}",
            )

    def add(self, job: Job) -> Emission | None:
        """Queue a checked job; an Emission refusing it when the queue is full or its handle is taken."""
        if job.handle in self._known or self.ledger.holds(job.handle):
            return Emission(job, Failed(ServingError(INVALID_ARG, "request handle is already in use")), True)
        if len(self._waiting) >= self.config.max_queue:
            error = ServingError(
                UNAVAILABLE,
                f"{self.role.value} queue is full ({self.config.max_queue}), retry later",
                Reason.FULL,
            )
            return Emission(job, Failed(error), True)
        if not isinstance(job, self.job_type):  # check() refuses it first
            return Emission(job, Failed(ServingError(INVALID_ARG, f"not a {self.role.value} job")), True)
        self._known.add(job.handle)
        self._waiting.append(job)
        return None

    @abstractmethod
    def schedule(self) -> Plan:
        """Take what runs next off the queue, reserving its blocks and slots."""

    def _head(self, kind: type | tuple[type, ...] | None = None) -> J | None:
        """The head of the queue when its blocks fit now (FIFO: nothing overtakes a waiting job), and
        with ``kind``, when it is a job of that kind."""
        if not self._waiting:
            return None
        head = self._waiting[0]
        if kind is not None and not isinstance(head, kind):
            return None
        return head if self.ledger.fits(self.blocks_needed(head)) else None

    def _admit(self, job: J) -> None:
        self._waiting.remove(job)
        self.ledger.reserve(job.handle, self.blocks_needed(job))

    def _free_slots(self) -> int:
        limit = min(self.batch_limit, self.limits.max_batch_size)
        return max(0, limit - len(self._running) - len(self._prefilling))

    def _slot_waiting(self, kind: type) -> int:
        """Jobs of ``kind`` at the queue's head whose blocks fit together now: what a batch slot
        more would have admitted."""
        free, count = self.ledger.free, 0
        for job in self._waiting:
            if not isinstance(job, kind) or (need := self.blocks_needed(job)) > free:
                break
            free -= need
            count += 1
        return count

    def _prefill_chunks(
        self, max_jobs: int | None = None, slots: int | None = None, kind: type | None = None
    ) -> list[Chunk]:
        """Prompt work for one step within the token budget: prompts already started first (oldest
        first), then new ones off the queue (FIFO, while ``slots`` and blocks allow, and with
        ``kind`` while the head is of that kind), at most ``max_jobs`` prompts."""
        budget = self.config.max_prefill_tokens
        chunks: list[Chunk] = []

        def now(left: int) -> int:  # tokens of a prompt with ``left`` to go that run this step
            if self.config.chunked_prefill:
                return min(left, budget)
            return left if not chunks or left <= budget else 0

        def room() -> bool:
            return budget > 0 and (max_jobs is None or len(chunks) < max_jobs)

        for part in self._prefilling.values():
            if not room() or not (count := now(part.left)):
                break
            chunks.append(Chunk(part.job, part.seq_id, count))  # type: ignore[arg-type]
            part.left -= count
            budget -= count
        while room() and (slots is None or slots > 0) and (head := self._head(kind)) is not None:
            if not (count := now(prompt_tokens(head))):
                break
            self._admit(head)
            self._prefilling[head.handle] = _Partial(head, None, prompt_tokens(head) - count)
            chunks.append(Chunk(head, None, count))  # type: ignore[arg-type]
            budget -= count
            slots = None if slots is None else slots - 1
        return chunks

    def _prefilled(self, job: Job) -> None:
        """A job's prompt is complete: it is no longer prefilling (its blocks stay reserved)."""
        self._prefilling.pop(job.handle, None)

    # ------------------------------------------------------------- results

    def postprocess(self, results: Iterable[Result]) -> list[Emission]:
        out: list[Emission] = []
        for result in results:
            if isinstance(result, Refused):
                self._end(result.job)
                out.append(Emission(result.job, Failed(result.error), True))
            elif isinstance(result, Progressed):
                self._prefilling[result.job.handle].seq_id = result.seq_id
            elif isinstance(result, Started):
                self._prefilled(result.job)
                out.append(self._token(result.job, result.seq_id, result.output, joining=True))
            elif isinstance(result, Handed):
                out.append(self._handed(result))
            elif isinstance(result, Joined):
                self._join(result.job, result.seq_id)
            elif isinstance(result, Stepped):
                for output in result.outputs:
                    job = self._running.get(output.seq_id)
                    if job is not None:
                        out.append(self._token(job, output.seq_id, output))
                for seq_id in result.failed:
                    job = self._running.get(seq_id)
                    if job is not None:
                        self._end(job)
                        out.append(
                            Emission(
                                job, Failed(ServingError(INTERNAL, "the engine failed this request")), True
                            )
                        )
        return out

    def _handed(self, result: Handed) -> Emission:
        raise RuntimeError(f"a {self.role.value} scheduler does not export KV")

    def _join(self, job: Job, seq_id: int) -> None:
        self._running[seq_id] = job
        self._seq_of[job.handle] = seq_id

    def _token(self, job: Job, seq_id: int, output: StepOutput, joining: bool = False) -> Emission:
        if output.finished:  # the engine freed the sequence
            self._end(job)
        elif joining:
            self._join(job, seq_id)
        return Emission(job, Token(output.token_id, output.finished, output.finish_reason), output.finished)

    def _end(self, job: Job) -> None:
        """Forget a job whose final event is being sent; its blocks are back in the engine."""
        seq_id = self._seq_of.pop(job.handle, None)
        if seq_id is not None:
            self._running.pop(seq_id, None)
        self._prefilling.pop(job.handle, None)
        self.ledger.release(job.handle)
        self._known.discard(job.handle)

    # ------------------------------------------------------------- removal

    def remove(self, handle: str) -> Removal | None:
        """Take a stopped or cancelled request out, wherever it is; None when nothing is known of it."""
        for job in self._waiting:
            if job.handle == handle:
                self._waiting.remove(job)
                self._known.discard(handle)
                return Removal(job)
        part = self._prefilling.get(handle)
        if part is not None:
            self._end(part.job)
            return Removal(part.job, seq_id=part.seq_id)
        seq_id = self._seq_of.get(handle)
        if seq_id is not None:
            job = self._running[seq_id]
            self._end(job)
            return Removal(job, seq_id=seq_id)
        return None

    def lease_released(self, lease_id: str) -> int | None:
        """An exported lease ended: the seq id whose blocks the engine frees now (None if unknown)."""
        return None

    def lease_ids(self) -> list[str]:
        """Ids of the export leases still held."""
        return []

    def drop_all(self) -> list[Job]:
        """Every job not yet ended (shutdown, engine fault); the scheduler is empty afterwards."""
        jobs = list(self._waiting) + [p.job for p in self._prefilling.values()] + list(self._running.values())
        for job in jobs:
            self._end(job)
        self._waiting.clear()
        return jobs

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(waiting={len(self._waiting)}, running={len(self._running)}, "
            f"blocks={self.ledger.reserved}/{self.limits.num_blocks})"
        )
