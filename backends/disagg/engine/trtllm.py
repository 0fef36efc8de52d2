"""TensorRT-LLM behind ``EngineBackend``: ``TrtllmBackend`` drives one ``tensorrt_llm.LLM``.

NOT VERIFIED — never run against a real TensorRT-LLM. TensorRT-LLM cannot be installed on the
machines this project is tested on; this adapter is written against its documented LLM API
(``LLM.generate_async``, ``SamplingParams``, ``DisaggregatedParams``, ``KvCacheConfig``,
``CacheTransceiverConfig``) and tested only through a fake of that module
(``tests/unit/engine/fake_trtllm.py``).

How the step-shaped protocol maps onto an engine that batches on its own:

- ``prefill(decode=False)``: a ``context_only`` request; its one response carries the first token
  and TensorRT-LLM's ``DisaggregatedParams`` (context request id, opaque transceiver state), which the
  context engine honours by keeping the KV for the generation side to pull.
- ``export_sequence``: those parameters plus the ``SequenceState``, in an HMAC-signed envelope
  (``disagg.kv.envelope``) with a lease id and expiry (``disagg.engine.trtllm_descriptor``). No KV
  bytes move through us: TensorRT-LLM's own cache transceiver (UCX / NIXL / MPI) moves them.
- ``import_sequence``: verifies the envelope and starts a ``generation_only`` streaming request with
  those parameters; it returns once the first response arrived (the KV is then on this engine).
- ``prefill(decode=True)``: a plain streaming request; ``prefill`` returns its first token.
- ``decode_step``: the tokens each stream produced since the last call (a reader thread per
  request turns TensorRT-LLM's blocking iteration into a queue), waiting at most ``step_wait_s``
  when none has arrived yet. A sequence may get several tokens in one call, in order.

Capacity (``limits``, ``usage``) is this adapter's own ledger, sized from the config and kept with
the same rule as the reference engine. TensorRT-LLM's KV cache manager is not introspectable in a
stable way, so the ledger can differ from it: the context side may keep blocks after ``free`` until
its transfer completes or times out.

Settings: ``TrtllmConfig`` (``disagg.engine.trtllm_config``, re-exported here).
"""

from __future__ import annotations

import importlib
import itertools
import json
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from disagg.engine.backend import BlockUsage, EngineLimits, Exported, Imported
from disagg.engine.errors import (
    BatchFull,
    EngineError,
    InvalidRequest,
    OutOfBlocks,
    SequenceFailed,
    UnknownSequence,
)
from disagg.engine.params import SamplingParams
from disagg.engine.sequence import FINISH_LENGTH, FINISH_STOP, Request, SequenceState, StepOutput
from disagg.engine.trtllm_config import TRANSCEIVER_BACKENDS, TrtllmConfig
from disagg.engine.trtllm_descriptor import (
    MAX_DESCRIPTOR_BYTES,
    PURPOSE,
    VERSION,
    DescriptorSeal,
    fingerprint,
    params_to_wire,
)
from disagg.kv.errors import TransferError

__all__ = [
    "MAX_DESCRIPTOR_BYTES",
    "PURPOSE",
    "TRANSCEIVER_BACKENDS",
    "VERSION",
    "TrtllmBackend",
    "TrtllmConfig",
    "TrtllmError",
    "trtllm_sampling",
]

log = logging.getLogger(__name__)

_FINISH = {"stop": FINISH_STOP, "length": FINISH_LENGTH}
Clock = Callable[[], float]


class TrtllmError(EngineError):
    """TensorRT-LLM failed, or did not answer in time, for a request (maps to INTERNAL)."""


@dataclass
class _Event:
    tokens: list[int]
    final: bool
    reason: str | None = None
    error: BaseException | None = None


@dataclass
class _Seq:
    seq_id: int
    prompt: tuple[int, ...]
    params: SamplingParams
    blocks: int
    decoding: bool
    generated: list[int] = field(default_factory=list)
    result: Any = None  # tensorrt_llm GenerationResult
    wire: dict[str, Any] | None = None  # context_only: TensorRT-LLM's DisaggregatedParams, JSON-safe
    inbox: deque[_Event] = field(default_factory=deque)  # filled by the reader thread, under the lock
    ready: deque[int] = field(default_factory=deque)  # tokens not yet handed out
    ended: str | None = None  # the stream ended: its finish reason ("" for none)
    error: BaseException | None = None
    reader: threading.Thread | None = None

    def state(self) -> SequenceState:
        return SequenceState(self.prompt, tuple(self.generated), self.params)


def _import_llmapi() -> Any:
    try:
        return importlib.import_module("tensorrt_llm.llmapi")
    except ImportError as exc:
        raise ImportError(
            "TrtllmBackend needs the 'tensorrt_llm' package (NVIDIA TensorRT-LLM, GPU only), "
            "which cannot be imported here"
        ) from exc


def _model_facts(model: Path) -> dict[str, Any]:
    """vocab size, context and eos ids from a checkpoint's or engine dir's config.json, if readable."""
    try:
        raw = json.loads((model / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    if isinstance(raw, dict) and isinstance(raw.get("pretrained_config"), dict):
        raw = raw["pretrained_config"]  # a TensorRT-LLM engine dir
    if not isinstance(raw, dict):
        return {}
    eos = raw.get("eos_token_id")
    try:
        gen = json.loads((model / "generation_config.json").read_text())
        eos = gen.get("eos_token_id", eos) if isinstance(gen, dict) else eos
    except (OSError, ValueError):
        pass
    return {
        "vocab_size": raw.get("vocab_size"),
        "max_context": raw.get("max_position_embeddings"),
        "eos": [eos] if isinstance(eos, int) else eos,
    }


def trtllm_sampling(params: SamplingParams, api: Any) -> Any:
    """Our SamplingParams as ``tensorrt_llm.SamplingParams`` (token ids out, no detokenizing).

    Greedy is ``top_k=1``. TensorRT-LLM's sampler seeds differently from the reference engine: a
    sampled request gives other tokens on the two engines, and whether a generation-only request
    continues the seeded stream of its context request exactly is not verified.
    """
    kw: dict[str, Any] = {"max_tokens": params.max_tokens, "n": 1, "detokenize": False, "seed": params.seed}
    if params.greedy:
        kw["top_k"] = 1
    else:
        kw["temperature"] = float(params.temperature)
        if params.top_k:
            kw["top_k"] = params.top_k
        if params.top_p < 1.0:
            kw["top_p"] = float(params.top_p)
    if params.min_length:
        kw["min_tokens"] = params.min_length
    if params.end_id is not None:
        kw["end_id"] = params.end_id
    if params.stop_token_ids:
        kw["stop_token_ids"] = list(params.stop_token_ids)
    return api.SamplingParams(**kw)


class TrtllmBackend:
    """``EngineBackend`` over one ``tensorrt_llm.LLM``. NOT VERIFIED: never run against a real
    TensorRT-LLM, only against the fake in ``tests/unit/engine/fake_trtllm.py``.

    Driven by one thread, like every backend; each live TensorRT-LLM stream has a daemon reader
    thread. ``close()`` aborts every request and shuts the LLM down.
    """

    def __init__(self, config: TrtllmConfig, *, clock: Clock | None = None) -> None:
        self.config = config
        self._api = _import_llmapi()
        facts = _model_facts(config.model)
        vocab = config.vocab_size or facts.get("vocab_size")
        context = config.max_context or facts.get("max_context")
        eos = config.eos_token_ids if config.eos_token_ids is not None else facts.get("eos") or ()
        if not isinstance(vocab, int) or not isinstance(context, int):
            raise ValueError("set vocab_size and max_context: the model's config.json does not give them")
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in eos):
            raise ValueError("eos_token_ids must be integers")
        self._eos = frozenset(eos)
        # TensorRT-LLM chunks prompts itself (its own scheduler); ours gets whole prompts
        self._limits = EngineLimits(
            config.num_blocks,
            config.tokens_per_block,
            config.max_batch_size,
            context,
            vocab,
            chunked_prefill=False,
        )
        self._max_tokens_cap = min(config.max_tokens_cap or context, context)
        self._seal = DescriptorSeal(
            fingerprint(config.model_id or config.model.name, config.tokens_per_block),
            ttl_s=config.ttl_s,
            clock=clock or time.time,
            secret=config.secret,
        )
        self._cond = threading.Condition()
        self._seqs: dict[int, _Seq] = {}
        self._starting: dict[int, bool] = {}  # started, not yet submitted: whether it joins the batch
        self._ids = itertools.count(1)
        self._carry: list[StepOutput] = []
        self._readers: list[threading.Thread] = []
        api = self._api
        # Block reuse off: shared prefix blocks would make TensorRT-LLM's use differ from our ledger.
        kv_cache = api.KvCacheConfig(
            max_tokens=config.num_blocks * config.tokens_per_block,
            tokens_per_block=config.tokens_per_block,
            enable_block_reuse=False,
        )
        self._llm = api.LLM(
            model=str(config.model),
            max_batch_size=config.max_batch_size,
            max_seq_len=context,
            kv_cache_config=kv_cache,
            cache_transceiver_config=api.CacheTransceiverConfig(backend=config.transceiver_backend),
            tensor_parallel_size=config.tensor_parallel_size,
            disable_overlap_scheduler=True,  # the documented setting for disaggregated instances
        )

    # ----------------------------------------------------------------- queries

    @property
    def limits(self) -> EngineLimits:
        return self._limits

    def describe(self) -> dict[str, str]:
        """TensorRT-LLM picks its own dtype (from the checkpoint) and kernels."""
        return {
            "dtype": "checkpoint",
            "kv_dtype": "checkpoint",
            "projections": "tensorrt-llm",
            "attention": "tensorrt-llm",
        }

    def usage(self) -> BlockUsage:
        used = sum(s.blocks for s in self._seqs.values())
        return BlockUsage(used, self._limits.num_blocks - used)

    def active_sequences(self) -> list[int]:
        return [s.seq_id for s in self._seqs.values() if s.decoding]

    def held_sequences(self) -> list[int]:
        return list(self._seqs)

    def validate(self, request: Request) -> None:
        """Raise InvalidRequest naming the first problem; nothing is allocated."""
        request.validate(self._limits.vocab_size, self._max_tokens_cap, self._limits.max_context)
        if request.generated_token_ids:  # TensorRT-LLM's sampler cannot start at draw n
            raise InvalidRequest("the TensorRT-LLM backend cannot resume a stream (generated tokens given)")

    # ----------------------------------------------------------------- phases

    def prefill(self, requests: Sequence[Request], *, decode: bool) -> list[StepOutput]:
        """Submit every prompt (TensorRT-LLM batches them), then wait for each first token.
        All-or-nothing: on any error every request of this call is aborted and freed."""
        requests = list(requests)
        for request in requests:
            self.validate(request)
        if decode and self._batch_size() + len(requests) > self._limits.max_batch_size:
            raise BatchFull(self._limits.max_batch_size)
        needed = [self._limits.blocks_needed(r, decode=decode) for r in requests]
        self._reserve(sum(needed))
        seqs = [
            self._add(r.prompt_token_ids, r.params, n, decode) for r, n in zip(requests, needed, strict=True)
        ]
        try:
            for seq in seqs:
                self._submit(seq, decode)
            return [self._first(seq) if decode else self._context_done(seq) for seq in seqs]
        except BaseException:
            for seq in seqs:
                self.free(seq.seq_id)
            raise

    def start(self, request: Request, *, decode: bool) -> int:
        """Take a request's blocks (and batch slot) for ``prefill_chunk``; nothing is submitted yet."""
        self.validate(request)
        if decode and self._batch_size() >= self._limits.max_batch_size:
            raise BatchFull(self._limits.max_batch_size)
        needed = self._limits.blocks_needed(request, decode=decode)
        self._reserve(needed)
        seq = self._add(request.prompt_token_ids, request.params, needed, False)
        self._starting[seq.seq_id] = decode
        return seq.seq_id

    def prefill_chunk(self, seq_id: int, max_tokens: int) -> StepOutput | None:
        """Submit a started sequence's whole prompt (``limits.chunked_prefill`` is False: TensorRT-LLM
        chunks on its own) and wait for its first token."""
        if seq_id not in self._starting:
            raise InvalidRequest(f"sequence {seq_id} was not started, or is already prefilled")
        decode = self._starting.pop(seq_id)
        seq = self._get(seq_id)
        seq.decoding = decode
        try:
            self._submit(seq, decode)
            return self._first(seq) if decode else self._context_done(seq)
        except BaseException:
            self.free(seq_id)
            raise

    def step(
        self, chunks: list[tuple[int, int]], *, decode: bool = True
    ) -> tuple[list[StepOutput], list[StepOutput | None]]:
        """The chunks' prompts, then a decode step (``limits.fused_steps`` is False: TensorRT-LLM batches
        them on its own)."""
        firsts = [self.prefill_chunk(seq_id, count) for seq_id, count in chunks]
        return (self.decode_step() if decode else []), firsts

    def _batch_size(self) -> int:
        """Sequences decoding, and started ones that will join the batch."""
        return len(self.active_sequences()) + sum(self._starting.values())

    def _submit(self, seq: _Seq, decode: bool) -> None:
        """Hand a sequence's prompt to TensorRT-LLM: a streaming request (``decode``), else a
        context-only one whose KV its cache transceiver keeps for the hand-off."""
        sampling = trtllm_sampling(seq.params, self._api)
        if decode:
            self._stream(seq, sampling, None)
            return
        ctx = self._api.DisaggregatedParams(request_type="context_only")
        seq.result = self._llm.generate_async(
            list(seq.prompt), sampling_params=sampling, streaming=False, disaggregated_params=ctx
        )

    def _context_done(self, seq: _Seq) -> StepOutput:
        try:
            result = seq.result.result(timeout=self.config.request_timeout_s)
        except queue.Empty:
            raise TrtllmError("TensorRT-LLM did not answer the context request in time") from None
        except Exception as exc:
            raise TrtllmError("TensorRT-LLM failed the context request") from exc
        out = result.outputs[0]
        tokens = list(out.token_ids or ())
        if not tokens:
            raise TrtllmError("TensorRT-LLM's context response has no token")
        token = tokens[0]
        seq.generated.append(token)
        reason = self._finish_reason(seq, token) or (FINISH_STOP if out.finish_reason == "stop" else None)
        if reason is None:
            params = getattr(out, "disaggregated_params", None) or getattr(
                result, "disaggregated_params", None
            )
            if params is None:
                raise TrtllmError("TensorRT-LLM's context response carries no disaggregated params")
            wire = params_to_wire(params)
            if not wire.get("first_gen_tokens"):
                raise TrtllmError("TensorRT-LLM's context response has no first generated tokens")
            seq.wire = wire
        else:
            self.free(seq.seq_id)
        return StepOutput(seq.seq_id, token, reason is not None, reason)

    def _first(self, seq: _Seq) -> StepOutput:
        self._await_first(seq)
        outs, failure = self._emit(seq, limit=1)
        if failure is not None:
            raise TrtllmError("TensorRT-LLM failed the request") from failure
        if not outs:
            raise TrtllmError("TensorRT-LLM did not produce a first token in time")
        return outs[0]

    def decode_step(self) -> list[StepOutput]:
        """The tokens every decoding sequence produced since the last call (several per sequence
        when TensorRT-LLM ran ahead), waiting up to ``step_wait_s`` for one if none is there yet.
        Finished sequences are freed. Raises SequenceFailed for streams that failed."""
        if self._carry:
            carried, self._carry = self._carry, []
            return carried
        batch = [s for s in self._seqs.values() if s.decoding]
        if not batch:
            return []
        if not any(s.ready or s.ended is not None or s.error is not None for s in batch):
            self._wait(lambda: any(s.inbox for s in batch), self.config.step_wait_s)
        self._collect(batch)
        outputs: list[StepOutput] = []
        failed: list[int] = []
        for seq in batch:
            outs, failure = self._emit(seq)
            outputs.extend(outs)
            if failure is not None:
                log.warning("TensorRT-LLM stream of sequence %d failed: %s", seq.seq_id, failure)
                failed.append(seq.seq_id)
                self.free(seq.seq_id)
        if failed:
            self._carry = outputs
            raise SequenceFailed(failed)
        return outputs

    # ----------------------------------------------------------------- hand-off

    def export_sequence(self, seq_id: int, transport: Any) -> Exported:
        """Sign TensorRT-LLM's disaggregated params and the sequence state under a new lease.
        TensorRT-LLM's context engine keeps the KV for its transceiver; ``free`` gives it up."""
        seq = self._get(seq_id)
        if seq.decoding or seq.wire is None:
            raise InvalidRequest("sequence was not prefilled for export (prefill with decode=False)")
        return self._seal.seal(seq.state(), seq.wire, transport)

    def import_sequence(self, state: SequenceState, descriptor: bytes, transport: Any) -> Imported:
        """Verify the descriptor, start the generation-only request and wait for its first response
        (TensorRT-LLM pulls the KV before it): ``transfer_s`` is that wait, one decode step included."""
        handoff = self._seal.unseal(descriptor, transport)
        if handoff.state != state:
            raise InvalidRequest("sequence state does not match its descriptor")
        request = Request(tuple(state.prompt_token_ids), state.params)
        self.validate(request)
        if not state.generated_token_ids or len(state.generated_token_ids) >= state.params.max_tokens:
            raise InvalidRequest("sequence state has no token to continue from, or is already complete")
        if list(state.generated_token_ids) != handoff.first_gen_tokens:
            raise InvalidRequest("sequence state does not match TensorRT-LLM's first generated tokens")
        if len(self.active_sequences()) >= self._limits.max_batch_size:
            raise BatchFull(self._limits.max_batch_size)
        params = handoff.disaggregated_params()  # before anything is held: it may refuse the descriptor
        needed = self._limits.blocks_needed(request)
        self._reserve(needed)
        self._seal.claim(handoff)
        seq = self._add(request.prompt_token_ids, state.params, needed, True)
        seq.generated = list(state.generated_token_ids)
        start = time.perf_counter()
        try:
            gen = self._api.DisaggregatedParams(request_type="generation_only", **params)
            # The generation-only output repeats first_gen_tokens (TensorRT-LLM's own disaggregated
            # tests compare it with the whole single-engine output): skip what we already have.
            self._stream(seq, trtllm_sampling(state.params, self._api), gen, skip=len(seq.generated))
            self._await_first(seq)
            if seq.error is not None or not seq.ready:
                raise TransferError("KV hand-off through TensorRT-LLM's cache transceiver failed")
        except BaseException as exc:
            self.free(seq.seq_id)
            self._seal.release(handoff)  # nothing arrived: the caller may retry while the lease lives
            if isinstance(exc, TransferError) or not isinstance(exc, Exception):
                raise
            raise TransferError("KV hand-off through TensorRT-LLM's cache transceiver failed") from exc
        return Imported(seq.seq_id, time.perf_counter() - start)

    # ----------------------------------------------------------------- lifetime

    def free(self, seq_id: int) -> bool:
        """Drop a sequence and abort its TensorRT-LLM request; False when it was already gone.

        Aborting a finished context-only request is meant to let TensorRT-LLM drop the KV it keeps
        for the transceiver; whether it does (or waits for its transfer timeout) is not verified.
        """
        self._starting.pop(seq_id, None)
        seq = self._seqs.pop(seq_id, None)
        if seq is None:
            return False
        if seq.result is not None and (not seq.decoding or not seq.result.finished):
            try:
                seq.result.abort()
            except Exception:
                log.debug("aborting TensorRT-LLM request of sequence %d failed", seq_id, exc_info=True)
        return True

    abort = free

    def close(self, timeout_s: float = 5.0) -> None:
        """Abort every request, shut the LLM down and join the reader threads. Idempotent."""
        for seq_id in list(self._seqs):
            self.free(seq_id)
        try:
            self._llm.shutdown()
        finally:
            deadline = time.monotonic() + timeout_s
            for reader in self._readers:
                reader.join(max(0.0, deadline - time.monotonic()))
            self._readers = [r for r in self._readers if r.is_alive()]

    def __enter__(self) -> TrtllmBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ----------------------------------------------------------------- helpers

    def _get(self, seq_id: int) -> _Seq:
        try:
            return self._seqs[seq_id]
        except KeyError:
            raise UnknownSequence(f"unknown sequence {seq_id}") from None

    def _reserve(self, blocks: int) -> None:
        free = self.usage().free
        if blocks > free:
            raise OutOfBlocks(blocks, free)

    def _add(self, prompt: tuple[int, ...], params: SamplingParams, blocks: int, decoding: bool) -> _Seq:
        seq = _Seq(next(self._ids), tuple(prompt), params, blocks, decoding)
        self._seqs[seq.seq_id] = seq
        return seq

    def _stream(self, seq: _Seq, sampling: Any, disagg: Any, skip: int = 0) -> None:
        kwargs = {} if disagg is None else {"disaggregated_params": disagg}
        seq.result = self._llm.generate_async(
            list(seq.prompt), sampling_params=sampling, streaming=True, **kwargs
        )
        self._readers = [r for r in self._readers if r.is_alive()]
        seq.reader = threading.Thread(
            target=self._read, args=(seq, skip), name=f"trtllm-seq-{seq.seq_id}", daemon=True
        )
        self._readers.append(seq.reader)
        seq.reader.start()

    def _read(self, seq: _Seq, seen: int) -> None:
        """Reader thread: each ``next()`` blocks until TensorRT-LLM's next response of this stream."""
        try:
            for result in seq.result:
                out = result.outputs[0]
                tokens = list(out.token_ids or ())
                event = _Event(tokens[seen:], bool(result.finished), out.finish_reason)
                seen = max(seen, len(tokens))
                self._post(seq, event)
                if event.final:
                    return
            self._post(seq, _Event([], True, None))
        except BaseException as exc:  # a failed request raises from the iteration
            self._post(seq, _Event([], True, None, exc))

    def _post(self, seq: _Seq, event: _Event) -> None:
        with self._cond:
            seq.inbox.append(event)
            self._cond.notify_all()

    def _wait(self, predicate: Callable[[], bool], timeout: float) -> None:
        with self._cond:
            self._cond.wait_for(predicate, timeout)

    def _await_first(self, seq: _Seq) -> None:
        """Wait (up to ``request_timeout_s``) until the stream has a token for us, failed or ended."""
        deadline = time.monotonic() + self.config.request_timeout_s
        while not (seq.ready or seq.error is not None or seq.ended is not None):
            left = deadline - time.monotonic()
            if left <= 0:
                return
            self._wait(lambda: bool(seq.inbox), left)
            self._collect([seq])

    def _collect(self, seqs: list[_Seq]) -> None:
        with self._cond:
            events = [(s, list(s.inbox)) for s in seqs]
            for s in seqs:
                s.inbox.clear()
        for seq, evs in events:
            for ev in evs:
                if seq.ended is not None or seq.error is not None:
                    break
                seq.ready.extend(ev.tokens)
                if ev.error is not None:
                    seq.error = ev.error
                elif ev.final:
                    seq.ended = ev.reason or ""

    def _emit(self, seq: _Seq, limit: int | None = None) -> tuple[list[StepOutput], BaseException | None]:
        """Hand out ready tokens (at most ``limit``); free the sequence when it finishes."""
        outs: list[StepOutput] = []
        while seq.ready and (limit is None or len(outs) < limit):
            token = seq.ready.popleft()
            seq.generated.append(token)
            reason = self._finish_reason(seq, token)
            if reason is None and not seq.ready and seq.error is None and seq.ended is not None:
                reason = _FINISH.get(seq.ended)
                if reason is None:
                    return outs, TrtllmError(f"stream ended as {seq.ended or 'nothing'!r}")
            outs.append(StepOutput(seq.seq_id, token, reason is not None, reason))
            if reason is not None:
                self.free(seq.seq_id)
                return outs, None
        if not seq.ready and seq.error is not None:
            return outs, seq.error
        if not seq.ready and seq.ended is not None:
            return outs, TrtllmError("stream ended without its final token")
        return outs, None

    def _finish_reason(self, seq: _Seq, token: int) -> str | None:
        """The reference engine's rule: a stop token once min_length is reached, else max_tokens."""
        params = seq.params
        stops = {params.end_id} if params.end_id is not None else set(self._eos)
        if token in stops | set(params.stop_token_ids) and len(seq.generated) > params.min_length:
            return FINISH_STOP
        if len(seq.generated) >= params.max_tokens:
            return FINISH_LENGTH
        return None
