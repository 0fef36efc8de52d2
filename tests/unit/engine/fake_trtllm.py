"""A fake of the few ``tensorrt_llm`` names ``TrtllmBackend`` uses, backed by the reference engine.

Tests only; ``install(monkeypatch)`` puts it into ``sys.modules`` as ``tensorrt_llm`` and
``tensorrt_llm.llmapi``. It copies the *shape* of TensorRT-LLM's LLM API as documented (keyword-only
parameter classes that refuse unknown fields, ``generate_async`` returning a result that is iterated
for streaming and waited on with ``result(timeout)``, ``abort()``, ``DisaggregatedParams`` on the
output) and what its disaggregated tests show (a generation-only output repeats first_gen_tokens).
It does not copy TensorRT-LLM's behaviour beyond that: it is no evidence the adapter works on it.

Tokens come from the torch reference ``Engine`` on the given checkpoint, so they are meaningful and
equal the reference engine's for the same request. An executor thread per LLM batches on its own,
queueing requests that do not fit (as TensorRT-LLM does). The "cache transceiver" is a process-wide
table: a context-only request leaves its KV there under a random opaque state; a generation-only
request takes it (once) and fails when it is not there.
"""

from __future__ import annotations

import itertools
import queue
import secrets
import sys
import threading
from collections import deque
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, ClassVar

import pytest
import torch

from disagg.engine.engine import Engine, EngineConfig
from disagg.engine.errors import BatchFull, OutOfBlocks
from disagg.engine.params import SamplingParams as ReferenceParams
from disagg.engine.sequence import Request, SequenceState
from disagg.kv.layout import KVLayout


@dataclass(kw_only=True)
class SamplingParams:
    end_id: int | None = None
    max_tokens: int = 32
    stop_token_ids: list[int] | None = None
    n: int = 1
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    temperature: float | None = None
    min_tokens: int | None = None
    detokenize: bool = True

    def reference(self) -> ReferenceParams:
        greedy = self.temperature is None and self.top_p is None and self.top_k in (None, 1)
        return ReferenceParams(
            max_tokens=self.max_tokens,
            temperature=0.0 if greedy or self.temperature is None else self.temperature,
            top_k=self.top_k or 0,
            top_p=1.0 if self.top_p is None else self.top_p,
            seed=self.seed or 0,
            min_length=self.min_tokens or 0,
            end_id=self.end_id,
            stop_token_ids=tuple(self.stop_token_ids or ()),
        )


@dataclass(kw_only=True)
class DisaggregatedParams:
    request_type: str | None = None
    first_gen_tokens: list[int] | None = None
    ctx_request_id: int | None = None
    opaque_state: bytes | None = None
    draft_tokens: list[int] | None = None
    disagg_request_id: int | None = None
    ctx_dp_rank: int | None = None
    ctx_info_endpoint: str | None = None


@dataclass(kw_only=True)
class KvCacheConfig:
    max_tokens: int | None = None
    tokens_per_block: int = 32
    enable_block_reuse: bool = True
    free_gpu_memory_fraction: float | None = 0.9


@dataclass(kw_only=True)
class CacheTransceiverConfig:
    backend: str | None = None
    max_tokens_in_buffer: int | None = None


@dataclass
class CompletionOutput:
    index: int
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    disaggregated_params: DisaggregatedParams | None = None


class RequestError(RuntimeError):
    """What iterating a failed request raises."""


@dataclass
class _Response:
    tokens: list[int]
    final: bool
    finish_reason: str | None = None
    error: str | None = None
    params: DisaggregatedParams | None = None


class GenerationResult:
    def __init__(
        self, request_id: int, prompt: list[int], sampling: SamplingParams, streaming: bool, llm: LLM
    ):
        self.request_id = request_id
        self.prompt_token_ids = prompt
        self.sampling_params = sampling
        self.outputs = [CompletionOutput(0)]
        self.disaggregated_params: DisaggregatedParams | None = None
        self._streaming = streaming
        self._llm = llm
        self._queue: queue.Queue[_Response] = queue.Queue()
        self._buffered: list[int] = []  # not streaming: everything comes in the final response
        self._done = False

    @property
    def finished(self) -> bool:
        return self._done

    def _handle(self, response: _Response) -> None:
        out = self.outputs[0]
        out.token_ids.extend(response.tokens)
        self._done = response.final
        if response.params is not None:
            self.disaggregated_params = out.disaggregated_params = response.params
        if response.final:
            out.finish_reason = response.finish_reason
        if response.error is not None:
            raise RequestError(response.error)

    def result(self, timeout: float | None = None) -> GenerationResult:
        while not self._done:
            self._handle(self._queue.get(timeout=timeout))
        return self

    def __iter__(self) -> GenerationResult:
        return self

    def __next__(self) -> GenerationResult:
        if self._done:
            raise StopIteration
        self._handle(self._queue.get())
        return self

    def abort(self) -> None:
        self._llm._abort(self.request_id)


@dataclass
class _Held:
    ctx_request_id: int
    state: SequenceState
    layout: KVLayout
    payload: torch.Tensor


_TRANSCEIVER: dict[bytes, _Held] = {}
_TRANSCEIVER_LOCK = threading.Lock()


def held_kv() -> int:
    """Context KV entries waiting for a generation-only request, in this process (a leak probe)."""
    with _TRANSCEIVER_LOCK:
        return len(_TRANSCEIVER)


class LLM:
    instances: ClassVar[list[LLM]] = []  # every LLM made since install(), so tests can look inside

    def __init__(
        self,
        model: str,
        *,
        max_batch_size: int = 2048,
        max_seq_len: int | None = None,
        kv_cache_config: KvCacheConfig | None = None,
        cache_transceiver_config: CacheTransceiverConfig | None = None,
        tensor_parallel_size: int = 1,
        disable_overlap_scheduler: bool = False,
    ) -> None:
        kv = kv_cache_config or KvCacheConfig()
        self.kv_cache_config = kv
        self.cache_transceiver_config = cache_transceiver_config
        self.max_seq_len = max_seq_len
        self.submitted: list[tuple[str, GenerationResult]] = []  # (request type, result), in order
        self._engine = Engine(
            EngineConfig(
                model_dir=model,
                block_size=kv.tokens_per_block,
                num_blocks=max(1, (kv.max_tokens or 8192) // kv.tokens_per_block),
                max_batch_size=max_batch_size,
            )
        )
        self._ids = itertools.count(1)
        self._cond = threading.Condition()
        self._inbox: deque[tuple[GenerationResult, DisaggregatedParams | None]] = deque()
        self._aborts: set[int] = set()
        self._live: dict[int, GenerationResult] = {}  # engine seq id -> result
        self._seq_of: dict[int, int] = {}  # request id -> engine seq id
        self._repeat: dict[int, list[int]] = {}  # engine seq id -> tokens the next response repeats
        self._ctx_held: dict[int, bytes] = {}  # context request id -> its transceiver key
        self._stop = False
        self._busy = False  # the executor holds requests it took from the inbox
        self._thread = threading.Thread(target=self._run, name="fake-trtllm-executor", daemon=True)
        self._thread.start()
        LLM.instances.append(self)

    def generate_async(
        self,
        inputs: list[int],
        sampling_params: SamplingParams | None = None,
        *,
        streaming: bool = False,
        disaggregated_params: DisaggregatedParams | None = None,
    ) -> GenerationResult:
        if self._stop:
            raise RuntimeError("LLM is shut down")
        sampling = sampling_params or SamplingParams()
        if not isinstance(sampling, SamplingParams):
            raise TypeError("sampling_params must be a SamplingParams")
        kind = disaggregated_params.request_type if disaggregated_params else "context_and_generation"
        result = GenerationResult(next(self._ids), [int(t) for t in inputs], sampling, streaming, self)
        self.submitted.append((str(kind), result))
        with self._cond:
            self._inbox.append((result, disaggregated_params))
            self._cond.notify_all()
        return result

    def shutdown(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self._thread.join(timeout=10)
        with _TRANSCEIVER_LOCK:
            for key in self._ctx_held.values():
                _TRANSCEIVER.pop(key, None)

    def idle(self) -> bool:
        """Nothing queued, aborting or generating: every stream has all its responses."""
        with self._cond:
            return not (self._inbox or self._aborts or self._live or self._busy)

    def cancel(self, request_id: int) -> None:
        """End a request as TensorRT-LLM would on its own (its timeout, an internal error)."""
        self._abort(request_id)

    def _abort(self, request_id: int) -> None:
        with self._cond:
            self._aborts.add(request_id)
            self._cond.notify_all()

    # ---- executor thread ------------------------------------------------------------------

    def _respond(self, result: GenerationResult, tokens: list[int], final: bool, **kw: Any) -> None:
        if not result._streaming and not final and kw.get("error") is None:
            result._buffered.extend(tokens)
            return
        tokens, result._buffered = result._buffered + tokens, []
        result._queue.put(_Response(tokens, final, **kw))

    def _run(self) -> None:
        while True:
            with self._cond:
                while not (self._stop or self._inbox or self._aborts or self._live):
                    self._cond.wait()
                if self._stop:
                    break
                new, aborts = list(self._inbox), set(self._aborts)
                self._inbox.clear()
                self._aborts.clear()
                self._busy = True
            self._apply_aborts(aborts)
            blocked = []
            for result, params in new:
                if result.request_id in aborts:
                    self._respond(result, [], True, finish_reason="cancelled")
                elif blocked:
                    blocked.append((result, params))  # FIFO behind a request that does not fit
                else:
                    try:
                        self._admit(result, params)
                    except (OutOfBlocks, BatchFull):
                        blocked.append((result, params))
                    except Exception as exc:
                        self._respond(result, [], True, error=str(exc))
            if blocked and not self._live:
                for result, _ in blocked:  # nothing will ever finish to make room
                    self._respond(result, [], True, error="request does not fit in the KV cache")
                blocked = []
            with self._cond:
                self._inbox.extendleft(reversed(blocked))
            if self._live:
                for out in self._engine.decode_step():
                    result = self._live[out.seq_id]
                    tokens = [*self._repeat.pop(out.seq_id, []), out.token_id]
                    self._respond(result, tokens, out.finished, finish_reason=out.finish_reason)
                    if out.finished:
                        self._forget(out.seq_id)
            with self._cond:
                self._busy = False
        for seq_id in list(self._live):
            self._respond(self._live[seq_id], [], True, finish_reason="cancelled")
            self._engine.free(seq_id)
            self._forget(seq_id)

    def _forget(self, seq_id: int) -> None:
        result = self._live.pop(seq_id)
        self._seq_of.pop(result.request_id, None)
        self._repeat.pop(seq_id, None)

    def _apply_aborts(self, aborts: set[int]) -> None:
        for request_id in aborts:
            key = self._ctx_held.pop(request_id, None)
            if key is not None:  # a finished context-only request: drop its KV if not yet pulled
                with _TRANSCEIVER_LOCK:
                    _TRANSCEIVER.pop(key, None)
            seq_id = self._seq_of.get(request_id)
            if seq_id is not None:
                self._respond(self._live[seq_id], [], True, finish_reason="cancelled")
                self._engine.free(seq_id)
                self._forget(seq_id)

    def _admit(self, result: GenerationResult, params: DisaggregatedParams | None) -> None:
        kind = params.request_type if params is not None else "context_and_generation"
        request = Request(tuple(result.prompt_token_ids), result.sampling_params.reference())
        if kind == "context_only":
            (out,) = self._engine.prefill([request], decode=False)
            if out.finished:
                self._respond(result, [out.token_id], True, finish_reason=out.finish_reason)
                return
            state, layout, blocks = self._engine.export_kv(out.seq_id)
            payload = self._engine.kv.memory[torch.tensor(blocks, dtype=torch.long)].clone()
            self._engine.free(out.seq_id)
            key = b"fake-ctx:" + secrets.token_bytes(12)
            with _TRANSCEIVER_LOCK:
                _TRANSCEIVER[key] = _Held(result.request_id, state, layout, payload)
            self._ctx_held[result.request_id] = key
            handed = DisaggregatedParams(
                request_type="context_only",
                first_gen_tokens=[out.token_id],
                ctx_request_id=result.request_id,
                opaque_state=key,
            )
            self._respond(result, [out.token_id], True, params=handed)
        elif kind == "generation_only":
            if params is None or not params.first_gen_tokens or params.opaque_state is None:
                raise RequestError("generation-only request without context parameters")
            with _TRANSCEIVER_LOCK:
                held = _TRANSCEIVER.get(params.opaque_state)
            if held is None or held.ctx_request_id != params.ctx_request_id:
                raise RequestError("KV transfer failed: no such context request")
            if held.state.prompt_token_ids != request.prompt_token_ids:
                raise RequestError("KV transfer failed: prompt differs from the context request's")
            state = SequenceState(request.prompt_token_ids, tuple(params.first_gen_tokens), request.params)
            seq_id = self._engine.import_kv(state, held.layout, held.payload)
            with _TRANSCEIVER_LOCK:  # pulled once
                _TRANSCEIVER.pop(params.opaque_state, None)
            self._live[seq_id] = result
            self._seq_of[result.request_id] = seq_id
            self._repeat[seq_id] = list(params.first_gen_tokens)
        elif kind == "context_and_generation":
            (out,) = self._engine.prefill([request], decode=True)
            self._respond(result, [out.token_id], out.finished, finish_reason=out.finish_reason)
            if not out.finished:
                self._live[out.seq_id] = result
                self._seq_of[result.request_id] = out.seq_id
        else:
            raise RequestError(f"unknown request type {kind!r}")


def install(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """Make ``import tensorrt_llm`` / ``tensorrt_llm.llmapi`` give this fake for one test."""
    package = ModuleType("tensorrt_llm")
    package.__path__ = []  # a package, so the submodule import resolves
    llmapi = ModuleType("tensorrt_llm.llmapi")
    names = {
        "LLM": LLM,
        "SamplingParams": SamplingParams,
        "DisaggregatedParams": DisaggregatedParams,
        "KvCacheConfig": KvCacheConfig,
        "CacheTransceiverConfig": CacheTransceiverConfig,
    }
    for name, value in names.items():
        setattr(llmapi, name, value)
        setattr(package, name, value)
    package.llmapi = llmapi  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "tensorrt_llm", package)
    monkeypatch.setitem(sys.modules, "tensorrt_llm.llmapi", llmapi)
    monkeypatch.setattr(LLM, "instances", [])
    return package
