"""One generation on the ``llm`` entry point over Triton gRPC streaming (``tritonclient.grpc.aio``).

Every request is its own bidirectional stream, always streamed from ``llm`` (the front end gathers a
unary answer itself), asking for ``llm``'s optional outputs: ``num_input_tokens``, ``num_output_tokens``
(tokens generated since the previous response), ``finish_reason``, and error messages that start with
their code. Leaving ``generate``'s iteration early, or cancelling the task running it, cancels the gRPC
stream: Triton marks the request cancelled and the orchestrator stops both pools' work for it. A
request that has ended (its final response or an error) is not cancelled: its stream is read to its end.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import grpc
import numpy as np
import tritonclient.grpc.aio as grpcclient
from tritonclient.utils import InferenceServerException

from disagg.openai.errors import ApiError, from_llm, unavailable
from disagg.openai.protocol import Generation

log = logging.getLogger(__name__)

MODEL = "llm"
READY_TIMEOUT_S = 2.0
DRAIN_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class Piece:
    """One response of ``llm``: text, tokens generated since the previous piece, the prompt's token
    count, and on the final piece why the output ended (``"stop"`` or ``"length"``)."""

    text: str
    tokens: int
    prompt_tokens: int
    finish_reason: str | None
    final: bool


def llm_inputs(gen: Generation, prompt: str, seed: int) -> list[Any]:
    """The ``llm`` tensors of one request (batch 1: shape [1, 1], stop words [1, n])."""
    values: dict[str, np.ndarray] = {
        "text_input": np.array([[prompt.encode("utf-8")]], dtype=np.object_),
        "max_tokens": np.array([[gen.max_tokens]], dtype=np.int32),
        "min_length": np.array([[gen.min_tokens]], dtype=np.int32),
        "temperature": np.array([[gen.temperature]], dtype=np.float32),
        "top_p": np.array([[gen.top_p]], dtype=np.float32),
        "random_seed": np.array([[seed]], dtype=np.uint64),
        "stream": np.array([[True]], dtype=bool),
    }
    if gen.stop:
        values["stop_words"] = np.array([[w.encode("utf-8") for w in gen.stop]], dtype=np.object_)
    for flag in ("return_num_input_tokens", "return_num_output_tokens", "return_finish_reason"):
        values[flag] = np.array([[True]], dtype=bool)
    values["return_error_code"] = np.array([[True]], dtype=bool)
    kinds = {"O": "BYTES", "i": "INT32", "f": "FP32", "u": "UINT64", "b": "BOOL"}
    inputs = []
    for name, array in values.items():
        tensor = grpcclient.InferInput(name, list(array.shape), kinds[array.dtype.kind])
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    return inputs


class LlmClient:
    """The front end's one gRPC channel to Triton."""

    def __init__(self, url: str, client: Any | None = None) -> None:
        """``client``: the ``tritonclient.grpc.aio`` client to use (default: one on ``url``; tests
        pass a stand-in)."""
        self.url = url
        self._client = client if client is not None else grpcclient.InferenceServerClient(url)

    async def ready(self) -> bool:
        """True when Triton answers and ``llm`` is ready."""
        try:
            return bool(await self._client.is_model_ready(MODEL, client_timeout=READY_TIMEOUT_S))
        except (InferenceServerException, grpc.RpcError, OSError):
            return False

    async def generate(self, gen: Generation, prompt: str) -> AsyncIterator[Piece]:
        """The pieces of one generation, up to and including the final one. Raises ApiError."""
        seed = gen.seed if gen.seed is not None else secrets.randbits(64)
        request = {
            "model_name": MODEL,
            "inputs": llm_inputs(gen, prompt, seed),
            "parameters": {"triton_enable_empty_final_response": True, "disagg_priority": gen.priority},
        }

        # The request side stays open until the request has ended (then the server ends the stream),
        # as tritonclient's own streams do.
        request_done = asyncio.Event()

        async def one_request() -> AsyncIterator[dict[str, Any]]:
            yield request
            await request_done.wait()

        responses = self._client.stream_infer(one_request())
        ended = False  # the RPC is over: nothing left to cancel
        try:
            while True:
                try:
                    result, error = await responses.__anext__()
                except StopAsyncIteration:
                    ended = True
                    raise unavailable("Triton closed the stream before the request ended") from None
                except grpc.RpcError as exc:
                    ended = True
                    raise unavailable(f"Triton is not available ({_rpc_status(exc)})") from None
                if error is not None:  # an error is the request's last response
                    request_done.set()
                    ended = await _drain(responses)
                    raise await self._api_error(str(error.message()))
                piece = _piece(result)
                if piece.final:
                    request_done.set()
                    ended = await _drain(responses)
                    if piece.finish_reason is None:
                        raise ApiError(500, "llm ended the request without a finish reason", "server_error")
                    yield piece
                    return
                yield piece
        finally:
            if not ended:
                responses.cancel()  # Triton marks the request cancelled; the orchestrator stops it
            request_done.set()

    async def _api_error(self, message: str) -> ApiError:
        coded = from_llm(message)
        if coded is not None:
            return coded
        if not await self.ready():
            return unavailable(f"model '{MODEL}' is not ready")
        log.warning("Triton refused a request: %s", message)  # its own text, kept out of the reply
        return ApiError(500, "internal error", "server_error", None, "internal_error")

    async def close(self) -> None:
        await self._client.close()


async def _drain(responses: Any) -> bool:
    """Wait for the server to end a stream whose request has sent its last response; True once it has.

    The stream is left to end by itself rather than cancelled: Triton 2.51 sometimes keeps a
    reference to ``llm`` after a stream is cancelled (it then cannot unload it at shutdown and exits
    after its exit timeout); cancelling every finished stream made that frequent, so only requests
    still running are cancelled.
    """

    async def to_end() -> None:
        async for _ in responses:
            log.warning("llm sent a response after its final one")

    try:
        await asyncio.wait_for(to_end(), DRAIN_TIMEOUT_S)
    except (TimeoutError, asyncio.TimeoutError, grpc.RpcError):
        return False
    return True


def _rpc_status(exc: grpc.RpcError) -> str:
    code = exc.code() if callable(getattr(exc, "code", None)) else None
    return getattr(code, "name", "error")


def _piece(result: Any) -> Piece:
    params = result.get_response().parameters
    final = "triton_final_response" in params and params["triton_final_response"].bool_param

    def first(name: str) -> Any:
        array = result.as_numpy(name)
        return None if array is None or array.size == 0 else array.reshape(-1)[0]

    text = first("text_output")
    reason = first("finish_reason")
    return Piece(
        text=text.decode("utf-8") if isinstance(text, bytes) else "",
        tokens=int(first("num_output_tokens") or 0),
        prompt_tokens=int(first("num_input_tokens") or 0),
        finish_reason=reason.decode() if isinstance(reason, bytes) and reason else None,
        final=final,
    )
