"""Streaming clients: Triton gRPC (TensorRT-LLM ensemble tensors) and OpenAI `/v1/completions` (vLLM).

Contract of `StreamClient.stream(spec)`: sends one request asking for exactly `spec.output_tokens`
tokens (greedy, end token ignored) and returns a `StreamOutcome` with `time.perf_counter()` stamps taken
as each piece arrives: when the request left (`sent`), the first and last piece carrying a token, the
number of pieces, the concatenated text and, where the server reports it, its own output-token count.
Failures come back as `error` text, never as exceptions, so a bad request never stops a run.

Token counts (the records' `n_tokens`, by `count_tokens`), which TPOT divides by:
- `reported`: the server's own count when it gives one (vLLM's `usage.completion_tokens`), else pieces.
- `requested`: the count asked for. Requests set min = max output tokens (Triton `min_length` =
  `max_tokens`; vLLM `min_tokens` + `ignore_eos`), so a stream that ends normally produced exactly that
  many; the piece count stays in the record beside it as a check.
- `pieces`: one token per streamed piece. Low on the Triton pipeline: its detokenizer holds back
  incomplete UTF-8 characters and sends several tokens in one response (seen: 119 pieces for 153 tokens
  on the random default model).
- `retokenize`: the model tokenizer run on the final text. Decoding then re-encoding does not give back
  the generated ids (BPE merges differently; partial UTF-8 bytes become replacement characters): seen
  1.1-1.5x the true count on the default model.
The Triton client defaults to `requested`, the OpenAI client to `reported`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from perf.benchlib.workload import RequestSpec

COUNT_MODES = ("reported", "requested", "pieces", "retokenize")


@dataclass(frozen=True)
class StreamOutcome:
    """Raw observation of one streamed request (perf_counter seconds)."""

    sent: float
    first_piece: float | None
    last_piece: float | None
    n_pieces: int
    text: str
    reported_tokens: int | None
    error: str | None
    ended: float | None = None
    """When the request's last response (or its error) arrived."""


@dataclass(frozen=True)
class ClientConfig:
    """Where and how a client talks. `kind`: "triton" (url host:port of gRPC, `model` the Triton model)
    or "openai" (url http://host:port, `model` the served model name)."""

    kind: str
    url: str
    model: str
    request_timeout_s: float = 300.0
    count_tokens: str = ""
    """One of COUNT_MODES; empty picks the kind's default (see module docstring)."""

    def __post_init__(self) -> None:
        if self.kind not in ("triton", "openai"):
            raise ValueError("kind must be 'triton' or 'openai'")
        if not self.url or not self.model:
            raise ValueError("url and model must be non-empty")
        host = self.url.split("://", 1)[-1].split(":", 1)[0].strip("[]")
        # Load tests target this machine only.
        if host not in ("localhost", "::1") and not host.startswith("127."):
            raise ValueError("benchmarks only target loopback addresses")
        if self.request_timeout_s <= 0:
            raise ValueError("request_timeout_s must be positive")
        if self.count_tokens and self.count_tokens not in COUNT_MODES:
            raise ValueError(f"count_tokens must be one of {COUNT_MODES}")

    @property
    def count_mode(self) -> str:
        return self.count_tokens or ("requested" if self.kind == "triton" else "reported")


class StreamClient(Protocol):
    config: ClientConfig

    async def open(self) -> None: ...

    async def close(self) -> None: ...

    async def stream(self, spec: RequestSpec) -> StreamOutcome: ...


def output_tokens(outcome: StreamOutcome, mode: str, retokenize: Callable[[str], int], requested: int) -> int:
    """Output-token count of an outcome under a COUNT_MODES mode (see module docstring)."""
    if mode == "reported" and outcome.reported_tokens is not None:
        return outcome.reported_tokens
    if mode == "requested" and outcome.error is None and outcome.n_pieces > 0:
        return requested
    if mode == "retokenize":
        return retokenize(outcome.text)
    return outcome.n_pieces


class _Pieces:
    """Accumulates stamps as pieces arrive."""

    def __init__(self) -> None:
        self.sent = time.perf_counter()
        self.first: float | None = None
        self.last: float | None = None
        self.count = 0
        self.text: list[str] = []
        self.reported: int | None = None

    def piece(self, text: str) -> None:
        now = time.perf_counter()
        if self.first is None:
            self.first = now
        self.last = now
        self.count += 1
        self.text.append(text)

    def outcome(self, error: str | None) -> StreamOutcome:
        return StreamOutcome(
            self.sent, self.first, self.last, self.count, "".join(self.text), self.reported, error,
            time.perf_counter(),
        )  # fmt: skip


class OpenAIClient:
    """`/v1/completions` with `stream: true` over one aiohttp session with no connection cap, so that
    open-loop arrivals are never queued client-side waiting for a free connection."""

    def __init__(self, config: ClientConfig) -> None:
        if config.kind != "openai":
            raise ValueError("OpenAIClient needs an openai config")
        self.config = config
        self._session: Any = None

    async def open(self) -> None:
        import aiohttp

        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, force_close=False),
            timeout=aiohttp.ClientTimeout(total=self.config.request_timeout_s),
        )

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def body(self, spec: RequestSpec) -> dict[str, Any]:
        n = spec.output_tokens
        return {
            "model": self.config.model,
            "prompt": spec.prompt,
            "max_tokens": n,
            "min_tokens": n,
            "ignore_eos": True,
            "temperature": 0.0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }

    async def stream(self, spec: RequestSpec) -> StreamOutcome:
        if self._session is None:
            raise RuntimeError("client not opened")
        pieces = _Pieces()
        url = f"{self.config.url.rstrip('/')}/v1/completions"
        try:
            async with self._session.post(url, json=self.body(spec)) as response:
                if response.status != 200:
                    detail = (await response.text())[:200]
                    return pieces.outcome(f"HTTP {response.status}: {detail}")
                async for raw in response.content:
                    line = raw.decode("utf-8", "replace").strip()
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    event = json.loads(data)
                    if event.get("error"):
                        return pieces.outcome(f"stream error: {str(event['error'])[:200]}")
                    # A chunk with a choice is one engine step's output; its text may be empty while
                    # the detokenizer holds back an incomplete UTF-8 character.
                    for choice in event.get("choices") or []:
                        pieces.piece(choice.get("text") or "")
                    usage = event.get("usage")
                    if usage and usage.get("completion_tokens") is not None:
                        pieces.reported = int(usage["completion_tokens"])
        except (TimeoutError, asyncio.TimeoutError):
            return pieces.outcome("timeout")
        except Exception as exc:  # any transport failure is a failed request, never a crashed run
            return pieces.outcome(f"{type(exc).__name__}: {str(exc)[:200]}")
        return pieces.outcome(None)


def triton_inputs(spec: RequestSpec) -> list[Any]:
    """The TensorRT-LLM ensemble tensors for `spec`, each of shape [1, 1]: greedy, exact length."""
    import tritonclient.grpc.aio as grpcaio
    from tritonclient.utils import np_to_triton_dtype

    n = spec.output_tokens
    values = {
        "text_input": np.array([[spec.prompt.encode()]], dtype=object),
        "max_tokens": np.array([[n]], dtype=np.int32),
        "min_length": np.array([[n]], dtype=np.int32),
        "stream": np.array([[True]], dtype=bool),
        "temperature": np.array([[0.0]], dtype=np.float32),
        "top_k": np.array([[1]], dtype=np.int32),
        "top_p": np.array([[1.0]], dtype=np.float32),
        "random_seed": np.array([[0]], dtype=np.uint64),
        "exclude_input_in_output": np.array([[True]], dtype=bool),
    }
    tensors = []
    for name, array in values.items():
        tensor = grpcaio.InferInput(name, list(array.shape), np_to_triton_dtype(array.dtype))
        tensor.set_data_from_numpy(array)
        tensors.append(tensor)
    return tensors


class TritonClient:
    """Triton gRPC streaming: one bidirectional stream per request on one shared channel, so an error
    response is always attributable to its request. The request side of the stream stays open until the
    final response (`triton_final_response`), which is asked for even when it carries no text."""

    def __init__(self, config: ClientConfig) -> None:
        if config.kind != "triton":
            raise ValueError("TritonClient needs a triton config")
        self.config = config
        self._client: Any = None

    async def open(self) -> None:
        import tritonclient.grpc.aio as grpcaio

        self._client = grpcaio.InferenceServerClient(self.config.url)

    async def close(self) -> None:
        if self._client is not None:
            await self._client.close()
            self._client = None

    async def is_ready(self) -> bool:
        """Whether the server has the model loaded and ready."""
        try:
            return bool(await self._client.is_model_ready(self.config.model))
        except Exception:  # unreachable server or unknown model: not ready
            return False

    async def stream(self, spec: RequestSpec) -> StreamOutcome:
        if self._client is None:
            raise RuntimeError("client not opened")
        done = asyncio.Event()
        request = {
            "model_name": self.config.model,
            "inputs": triton_inputs(spec),
            "request_id": str(spec.index),
            "parameters": {"triton_enable_empty_final_response": True},
        }

        async def requests() -> AsyncIterator[dict[str, Any]]:
            yield request
            await done.wait()

        pieces = _Pieces()
        responses = self._client.stream_infer(requests(), stream_timeout=self.config.request_timeout_s)
        try:
            async for result, error in responses:
                if error is not None:
                    return pieces.outcome(f"triton: {str(error)[:200]}")
                response = result.get_response()
                final = response.parameters["triton_final_response"].bool_param
                texts = result.as_numpy("text_output") if response.outputs else None
                text = b"".join(texts.reshape(-1)).decode("utf-8", "replace") if texts is not None else ""
                if text or not final:
                    pieces.piece(text)
                if final:
                    break
            else:
                return pieces.outcome("stream ended without a final response")
        except Exception as exc:  # transport failure or timeout: a failed request, not a crashed run
            return pieces.outcome(f"{type(exc).__name__}: {str(exc)[:200]}")
        finally:
            done.set()  # half-closes the request side; the server then ends the stream
        with contextlib.suppress(Exception):
            # read to the server's end of the stream rather than cancel it: on Triton 2.51, streams
            # cancelled after their final response leave the model live at volume (docs/serving.md)
            async for _ in responses:
                pass
        return pieces.outcome(None)


def make_client(config: ClientConfig) -> StreamClient:
    """The client for `config.kind`."""
    return TritonClient(config) if config.kind == "triton" else OpenAIClient(config)
