"""A pure-Python EngineBackend for scheduler tests: real block and batch accounting, no model.

Tokens are ``100 + step``; a sequence finishes after ``max_tokens``. The backend raises OutOfBlocks and
BatchFull exactly as the torch engine does, so a scheduler that over-admits fails the test.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from disagg.engine.backend import BlockUsage, EngineLimits, Exported, Imported
from disagg.engine.errors import BatchFull, InvalidRequest, OutOfBlocks
from disagg.engine.params import SamplingParams
from disagg.engine.sequence import FINISH_LENGTH, Request, SequenceState, StepOutput
from disagg.protocol.messages import DecodeJob, Event, GenerateJob, PrefillJob


@dataclass
class _Seq:
    state: SequenceState
    blocks: int
    decoding: bool


class FakeBackend:
    def __init__(
        self, num_blocks: int = 64, block_size: int = 4, max_batch_size: int = 8, fused: bool = False
    ) -> None:
        self._limits = EngineLimits(
            num_blocks, block_size, max_batch_size, max_context=4096, vocab_size=1000, fused_steps=fused
        )
        self.seqs: dict[int, _Seq] = {}
        self.ids = itertools.count(1)
        self.calls: list[str] = []
        self.exports: dict[str, SequenceState] = {}
        self.joins: dict[int, bool] = {}  # started sequences: whether they join the decode batch
        self.done: dict[int, int] = {}  # prompt tokens prefilled so far

    @property
    def limits(self) -> EngineLimits:
        return self._limits

    def describe(self) -> dict[str, str]:
        return {"dtype": "float32", "kv_dtype": "float32", "projections": "fake", "attention": "fake"}

    def usage(self) -> BlockUsage:
        used = sum(s.blocks for s in self.seqs.values())
        return BlockUsage(used, self._limits.num_blocks - used)

    def validate(self, request: Request) -> None:
        if not request.prompt_token_ids:
            raise InvalidRequest("prompt is empty")

    def _take(self, blocks: int, decoding: bool) -> None:
        if blocks > self.usage().free:
            raise OutOfBlocks(blocks, self.usage().free)
        if decoding and self._batch() >= self._limits.max_batch_size:
            raise BatchFull(self._limits.max_batch_size)

    def _batch(self) -> int:
        return sum(s.decoding for s in self.seqs.values()) + sum(self.joins.values())

    def _first(self, seq_id: int) -> StepOutput:
        seq = self.seqs[seq_id]
        return self._append(seq_id, seq)

    def _append(self, seq_id: int, seq: _Seq) -> StepOutput:
        token = 100 + len(seq.state.generated_token_ids)
        seq.state = SequenceState(
            seq.state.prompt_token_ids, (*seq.state.generated_token_ids, token), seq.state.params
        )
        done = len(seq.state.generated_token_ids) >= seq.state.params.max_tokens
        if done:
            del self.seqs[seq_id]
        return StepOutput(seq_id, token, done, FINISH_LENGTH if done else None)

    def prefill(self, requests, *, decode: bool) -> list[StepOutput]:
        self.calls.append("prefill")
        out = []
        for request in requests:
            blocks = self._limits.blocks_needed(request, decode=decode)
            self._take(blocks, decode)
            seq_id = next(self.ids)
            self.seqs[seq_id] = _Seq(
                SequenceState(request.prompt_token_ids, (), request.params), blocks, decode
            )
            out.append(self._first(seq_id))
        return out

    def start(self, request: Request, *, decode: bool) -> int:
        self.validate(request)
        blocks = self._limits.blocks_needed(request, decode=decode)
        self._take(blocks, decode)
        seq_id = next(self.ids)
        self.seqs[seq_id] = _Seq(SequenceState(request.prompt_token_ids, (), request.params), blocks, False)
        self.joins[seq_id] = decode
        self.done[seq_id] = 0
        return seq_id

    def prefill_chunk(self, seq_id: int, max_tokens: int) -> StepOutput | None:
        self.calls.append(f"chunk {max_tokens}")
        return self._chunk(seq_id, max_tokens)

    def _chunk(self, seq_id: int, max_tokens: int) -> StepOutput | None:
        seq = self.seqs[seq_id]
        self.done[seq_id] += max_tokens
        if self.done[seq_id] > len(seq.state.prompt_token_ids):
            raise AssertionError("chunk beyond the prompt")
        if self.done[seq_id] < len(seq.state.prompt_token_ids):
            return None
        seq.decoding = self.joins.pop(seq_id)
        return self._first(seq_id)

    def step(self, chunks, *, decode=True):
        self.calls.append(f"step {[n for _, n in chunks]} decode={decode}")
        batch = [i for i, s in self.seqs.items() if s.decoding] if decode else []
        firsts = [self._chunk(seq_id, n) for seq_id, n in chunks]
        return [self._append(i, self.seqs[i]) for i in batch], firsts

    def decode_step(self) -> list[StepOutput]:
        self.calls.append("decode")
        return [self._append(i, s) for i, s in list(self.seqs.items()) if s.decoding]

    def export_sequence(self, seq_id: int, transport: object) -> Exported:
        lease = f"lease-{seq_id}"
        self.exports[lease] = self.seqs[seq_id].state
        return Exported(lease.encode(), lease, self.seqs[seq_id].state)

    def import_sequence(self, state: SequenceState, descriptor: bytes, transport: object) -> Imported:
        self.calls.append("import")
        blocks = self._limits.blocks_needed(Request(state.prompt_token_ids, state.params))
        self._take(blocks, True)
        seq_id = next(self.ids)
        self.seqs[seq_id] = _Seq(state, blocks, True)
        return Imported(seq_id, 0.001)

    def free(self, seq_id: int) -> bool:
        self.joins.pop(seq_id, None)
        self.done.pop(seq_id, None)
        return self.seqs.pop(seq_id, None) is not None


@dataclass
class Sink:
    events: list[tuple[Event, bool]] = field(default_factory=list)

    def emit(self, event: Event, final: bool) -> None:
        self.events.append((event, final))

    def is_cancelled(self) -> bool:
        return False


def request(prompt_len: int = 4, max_tokens: int = 4) -> Request:
    return Request(tuple(range(1, prompt_len + 1)), SamplingParams(max_tokens=max_tokens))


def prefill_job(handle: str, prompt_len: int = 4, max_tokens: int = 4) -> PrefillJob:
    return PrefillJob(handle, Sink(), request(prompt_len, max_tokens))


def generate_job(handle: str, prompt_len: int = 4, max_tokens: int = 4) -> GenerateJob:
    return GenerateJob(handle, Sink(), request(prompt_len, max_tokens))


def decode_job(handle: str, prompt_len: int = 4, max_tokens: int = 4) -> DecodeJob:
    r = request(prompt_len, max_tokens)
    return DecodeJob(handle, Sink(), SequenceState(r.prompt_token_ids, (100,), r.params), b"descriptor")
