"""Runs a scheduler's plan on an engine: the only code between the schedulers and ``EngineBackend``.

A failure of one job (bad KV descriptor, a transfer that fails) becomes that job's ``Refused`` result,
with whatever the engine held for it given back; a failure of the decode step is the engine's and
propagates (the loop then fails every job).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from typing import Any, TypeVar

from disagg.engine.backend import EngineBackend
from disagg.engine.errors import SequenceFailed
from disagg.engine.params import SamplingParams
from disagg.engine.sequence import Request, StepOutput
from disagg.kv.errors import IncompatibleKV
from disagg.protocol.errors import INTERNAL, ServingError, classify
from disagg.protocol.messages import DecodeJob, PrefillJob
from disagg.scheduling.plan import Chunk, Handed, Joined, Plan, Progressed, Refused, Result, Started, Stepped

T = TypeVar("T")
log = logging.getLogger(__name__)


class Runner:
    def __init__(self, backend: EngineBackend, transport: Any = None) -> None:
        self.backend = backend
        self.transport = transport  # moves the KV of PrefillJobs and DecodeJobs
        self.steps = 0  # engine calls so far (each prefill, each decode step) ...
        self.busy_s = 0.0  # ... and the seconds spent in them (disagg_engine_* metrics)
        self.prompt_tokens = 0  # prompt tokens prefilled so far ...
        self.prefill_busy_s = 0.0  # ... and the seconds of the calls that prefilled: the prefill throughput
        self.transfer_times: deque[float] = deque(maxlen=4096)  # seconds of each KV import
        self.kv_incompatible = 0  # imports refused: KV of another model version (engine.fingerprint)

    def run(self, plan: Plan) -> list[Result]:
        results: list[Result] = [Refused(job, error) for job, error in plan.refused]
        results.extend(self._import(job) for job in plan.imports)
        if plan.fused:
            results.extend(self._fused(plan))
            return results
        results.extend(self._prefill(chunk) for chunk in plan.prefill)
        if plan.decode:
            try:
                results.append(Stepped(tuple(self._timed(self.backend.decode_step))))
            except SequenceFailed as failure:  # those are freed; the rest of the batch carries on
                results.append(Stepped((), tuple(failure.seq_ids)))
        return results

    def _sequence(self, chunk: Chunk) -> int:
        """The chunk's sequence, started with its first chunk."""
        if chunk.seq_id is not None:
            return chunk.seq_id
        return self.backend.start(chunk.job.request, decode=not isinstance(chunk.job, PrefillJob))

    def _prefill(self, chunk: Chunk) -> Result:
        seq_id = None
        try:
            seq_id = self._sequence(chunk)
            output = self._timed(self.backend.prefill_chunk, seq_id, chunk.tokens, prefill=True)
            self.prompt_tokens += chunk.tokens
        except Exception as exc:
            if seq_id is not None:
                self.backend.free(seq_id)
            return Refused(chunk.job, classify(exc))
        return self._prefilled(chunk, seq_id, output)

    def _prefilled(self, chunk: Chunk, seq_id: int, output: StepOutput | None) -> Result:
        """What a chunk's prefill means: more to come, a generate job started, or a prefill job's KV
        exported (unless its first token already ended it)."""
        job = chunk.job
        if output is None:
            return Progressed(job, seq_id)
        if not isinstance(job, PrefillJob):
            return Started(job, seq_id, output)
        if output.finished:
            return Handed(job, seq_id, output, None)
        try:
            exported = self.backend.export_sequence(seq_id, self.transport)
        except Exception as exc:
            self.backend.free(seq_id)
            return Refused(job, classify(exc))
        return Handed(job, seq_id, output, exported)

    def _fused(self, plan: Plan) -> list[Result]:
        """Start the new sequences, then run every chunk and the decode step as one engine call."""
        results: list[Result] = []
        chunks: list[tuple[Chunk, int]] = []
        for chunk in plan.prefill:
            try:
                chunks.append((chunk, self._sequence(chunk)))
            except Exception as exc:
                results.append(Refused(chunk.job, classify(exc)))
        try:
            # a fused step's time counts as prefill whole: its decode rows add little to its chunks'
            outputs, firsts = self._timed(
                self.backend.step,
                [(seq_id, c.tokens) for c, seq_id in chunks],
                decode=plan.decode,
                prefill=bool(chunks),
            )
            self.prompt_tokens += sum(c.tokens for c, _ in chunks)
        except SequenceFailed as failure:  # the chunks' outcome is unknown: they end with the lost ones
            for chunk, seq_id in chunks:
                self.backend.free(seq_id)
                results.append(Refused(chunk.job, ServingError(INTERNAL, "the engine failed this request")))
            return [*results, Stepped((), tuple(failure.seq_ids))]
        results.extend(
            self._prefilled(c, seq_id, first) for (c, seq_id), first in zip(chunks, firsts, strict=True)
        )
        results.append(Stepped(tuple(outputs)))
        return results

    def _import(self, job: DecodeJob) -> Result:
        try:
            imported = self.backend.import_sequence(job.state, job.descriptor, self.transport)
        except Exception as exc:
            if isinstance(exc, IncompatibleKV):
                self.kv_incompatible += 1
                log.warning("refused KV computed by another model version (fingerprint mismatch)")
            return Refused(job, classify(exc))
        self.transfer_times.append(imported.transfer_s)
        return Joined(job, imported.seq_id, imported.transfer_s)

    def warm_up(self, tokens: int) -> None:
        """Prefill one prompt of ``tokens`` and drop it, counted like any call (its time is the
        engine's). Before the loop starts; a prompt this engine cannot take is logged and skipped."""
        request = Request((1,) * tokens, SamplingParams(max_tokens=1))
        try:
            seq_id = self.backend.start(request, decode=False)
        except Exception as exc:
            log.warning("no warm-up: a %d-token prompt does not fit this engine (%s)", tokens, exc)
            return
        try:
            while self._timed(self.backend.prefill_chunk, seq_id, tokens, prefill=True) is None:
                pass  # an engine that prefills in smaller chunks than asked
            self.prompt_tokens += tokens
        finally:
            self.backend.free(seq_id)

    def _timed(self, call: Callable[..., T], *args: object, prefill: bool = False, **kwargs: object) -> T:
        started = time.perf_counter()
        try:
            return call(*args, **kwargs)
        finally:
            elapsed = time.perf_counter() - started
            self.busy_s += elapsed
            self.prefill_busy_s += elapsed if prefill else 0.0
            self.steps += 1
