"""The boundary between a pool's scheduler and an engine: ``EngineBackend``. Torch-free.

The scheduler decides *what* runs (admission, every capacity limit) from ``EngineLimits`` and its
own block ledger; the backend runs it. Two implementations:

- ``disagg.engine.engine.Engine``: the torch reference engine (KV in blocks this process owns,
  moved by a ``disagg.kv`` transport);
- ``disagg.engine.trtllm.TrtllmBackend``: TensorRT-LLM, whose own cache transceiver moves the KV
  (NOT verified: TensorRT-LLM cannot be installed on the machines this project is tested on).

KV sizing is in blocks of ``block_size`` tokens: a sequence admitted for decoding holds
``blocks_for(prompt + max_tokens)`` blocks for its whole life, a prefill-only one
``blocks_for(prompt)`` until its export lease ends.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from disagg.engine.sequence import Request, SequenceState, StepOutput
from disagg.kv.descriptor import Descriptor


@dataclass(frozen=True)
class EngineLimits:
    """What an engine can hold: the numbers a scheduler admits by."""

    num_blocks: int
    block_size: int
    max_batch_size: int
    max_context: int
    vocab_size: int
    chunked_prefill: bool = True  # prefill_chunk honours its token count
    fused_steps: bool = False  # step() reads the weights once for decode rows and prompt chunks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def blocks_needed(self, request: Request, *, decode: bool = True) -> int:
        prefilled = len(request.prompt_token_ids) + len(request.generated_token_ids)
        tokens = len(request.prompt_token_ids) + request.params.max_tokens if decode else prefilled
        return self.blocks_for(tokens)


@dataclass(frozen=True)
class Exported:
    """A prefilled sequence's KV, offered to an importer: the signed descriptor and its lease."""

    descriptor: bytes
    lease_id: str
    state: SequenceState


@dataclass(frozen=True)
class Imported:
    """A sequence taken over from another engine, and how long its KV took to arrive."""

    seq_id: int
    transfer_s: float


@dataclass(frozen=True)
class BlockUsage:
    """KV blocks now: ``used`` by sequences and ``free`` for new ones, ``used + free`` being the pool.
    With a prefix cache, ``cached`` of the free blocks still keep a prefix, and the cache's counters
    so far (in blocks) come along."""

    used: int
    free: int
    cached: int = 0
    prefix_hits: int = 0
    prefix_misses: int = 0
    prefix_evictions: int = 0


class EngineBackend(Protocol):
    """Driven by one thread (the pool's engine loop). Errors: ``disagg.engine.errors``."""

    @property
    def limits(self) -> EngineLimits: ...

    def validate(self, request: Request) -> None:
        """Raise InvalidRequest naming the first problem; nothing is allocated."""

    def prefill(self, requests: Sequence[Request], *, decode: bool) -> list[StepOutput]:
        """Prefill each prompt and sample its first token. ``decode=False``: hold the sequence for
        ``export_sequence`` instead of adding it to the decode batch. All-or-nothing."""

    def start(self, request: Request, *, decode: bool) -> int:
        """Admit a request for ``prefill_chunk``: validate it and take its blocks (and, with
        ``decode``, its batch slot); nothing runs yet. All-or-nothing."""

    def prefill_chunk(self, seq_id: int, max_tokens: int) -> StepOutput | None:
        """Prefill at most the next ``max_tokens`` prompt tokens of a started sequence; the first
        token's output once its prompt is complete (then it joins the decode batch, or is held for
        ``export_sequence``), None before. An engine without chunked prefill
        (``limits.chunked_prefill`` False) prefills the whole rest of the prompt whatever
        ``max_tokens`` says."""

    def decode_step(self) -> list[StepOutput]:
        """New tokens of the decode batch's sequences, in order, a finished one's last (it is freed).
        The torch engine gives exactly one per sequence; an engine that batches on its own may give
        none or several. Raises SequenceFailed naming sequences it lost (and freed)."""

    def step(
        self, chunks: list[tuple[int, int]], *, decode: bool = True
    ) -> tuple[list[StepOutput], list[StepOutput | None]]:
        """``prefill_chunk`` for each ``(seq_id, max_tokens)`` and a ``decode_step``, as one call: an
        engine with ``limits.fused_steps`` runs them as one forward pass. Returns the decode outputs,
        and per chunk what ``prefill_chunk`` returns."""

    def export_sequence(self, seq_id: int, transport: Any) -> Exported:
        """Offer a held, prefilled sequence's KV under a lease; it stays held until ``free``."""

    def import_sequence(
        self, state: SequenceState, descriptor: bytes | Descriptor, transport: Any
    ) -> Imported:
        """Take over a sequence prefilled elsewhere: pull its KV, add it to the decode batch.
        ``descriptor``: the ``Descriptor`` the pool verified on submission, or the token as it came
        (one its transport does not read, such as an engine's own sealed envelope)."""

    def free(self, seq_id: int) -> bool:
        """Drop a sequence and give back its KV; False when it was already gone (idempotent)."""

    def describe(self) -> Mapping[str, str]:
        """What the engine resolved to run with, for ``disagg_engine_info``'s labels: ``dtype`` (of
        its compute), ``kv_dtype`` (of its KV cache), ``projections`` and ``attention`` (the paths
        they take)."""

    def usage(self) -> BlockUsage:
        """KV blocks in use and free, now."""

    def close(self) -> None:
        """Release the engine's threads and devices (the pool is going away); idempotent."""
