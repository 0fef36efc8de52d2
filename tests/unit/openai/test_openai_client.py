"""What the front end sends to ``llm`` and how it reads ``llm``'s responses and errors
(disagg.openai.client, disagg.openai.errors), on protobuf messages built here and a stand-in for the
``tritonclient.grpc.aio`` client: a generation left early cancels its stream, one that ended reads its
stream to the end."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import grpc
import numpy as np
import pytest
from tritonclient.grpc import InferResult, service_pb2
from tritonclient.utils import InferenceServerException, serialize_byte_tensor

from disagg.openai.client import LlmClient, Piece, _piece, llm_inputs
from disagg.openai.errors import ApiError, from_llm
from disagg.openai.protocol import Generation
from disagg.serving.text_api import EXTRA_OUTPUTS, LLM_INPUT_NAMES


def test_inputs_name_llm_tensors_with_batch_shapes() -> None:
    gen = Generation(
        kind="completion", model="m", max_tokens=9, min_tokens=3, temperature=0.5, top_p=0.9, stop=("a", "bc")
    )
    inputs = {tensor.name(): tensor for tensor in llm_inputs(gen, "héllo", seed=7)}
    assert set(inputs) <= LLM_INPUT_NAMES, "only inputs llm declares"
    assert {flag for flag, _, _ in EXTRA_OUTPUTS} | {"return_error_code"} <= set(inputs)
    expected = {
        "text_input": ("BYTES", [1, 1]),
        "max_tokens": ("INT32", [1, 1]),
        "min_length": ("INT32", [1, 1]),
        "temperature": ("FP32", [1, 1]),
        "top_p": ("FP32", [1, 1]),
        "random_seed": ("UINT64", [1, 1]),
        "stream": ("BOOL", [1, 1]),
        "stop_words": ("BYTES", [1, 2]),
    }
    for name, (dtype, shape) in expected.items():
        assert (inputs[name].datatype(), inputs[name].shape()) == (dtype, shape), name
    no_stop = {t.name() for t in llm_inputs(Generation(kind="completion", model="m", max_tokens=1), "x", 0)}
    assert "stop_words" not in no_stop


def response(final: bool, **outputs: np.ndarray) -> InferResult:
    message = service_pb2.ModelInferResponse(model_name="llm")
    for name, array in outputs.items():
        tensor = message.outputs.add(name=name, shape=list(array.shape))
        if array.dtype == np.object_:
            tensor.datatype = "BYTES"
            message.raw_output_contents.append(serialize_byte_tensor(array).item())
        else:
            tensor.datatype = "UINT32"
            message.raw_output_contents.append(array.tobytes())
    if final:
        message.parameters["triton_final_response"].bool_param = True
    return InferResult(message)


def test_pieces_read_text_counts_and_the_final_reason() -> None:
    middle = response(
        False,
        text_output=np.array([["é".encode()]], dtype=np.object_),
        num_input_tokens=np.array([[12]], dtype=np.uint32),
        num_output_tokens=np.array([[3]], dtype=np.uint32),
        finish_reason=np.array([[b""]], dtype=np.object_),
    )
    piece = _piece(middle)
    assert (piece.text, piece.tokens, piece.prompt_tokens, piece.finish_reason, piece.final) == (
        "é",
        3,
        12,
        None,
        False,
    )
    last = _piece(
        response(
            True,
            text_output=np.array([[b""]], dtype=np.object_),
            num_output_tokens=np.array([[1]], dtype=np.uint32),
            finish_reason=np.array([[b"length"]], dtype=np.object_),
        )
    )
    assert (last.text, last.tokens, last.finish_reason, last.final) == ("", 1, "length", True)


@pytest.mark.parametrize(
    ("message", "status", "text"),
    [
        (
            "INVALID_ARG: prompt (3000 tokens) exceeds the context",
            400,
            "prompt (3000 tokens) exceeds the context",
        ),
        (
            "UNAVAILABLE: server is at its limit of 256 requests",
            503,
            "server is at its limit of 256 requests",
        ),
        (
            "DEADLINE_EXCEEDED: request exceeded its 600 s deadline",
            504,
            "request exceeded its 600 s deadline",
        ),
        ("INTERNAL: internal error", 500, "internal error"),
    ],
)
def test_coded_llm_errors_map_to_http_statuses(message: str, status: int, text: str) -> None:
    error = from_llm(message)
    assert error is not None and (error.status, error.message) == (status, text)


def test_uncoded_errors_are_left_to_the_caller() -> None:
    assert from_llm("Request for unknown model: 'llm' is not found") is None
    assert from_llm("invalid_arg: lower case is not a code") is None


class FakeStream:
    """What `stream_infer` returns: (result, error) pairs, then the end; records a cancel."""

    def __init__(self, items: list[Any]) -> None:
        self.items = list(items)
        self.cancelled = False

    def __aiter__(self) -> FakeStream:
        return self

    async def __anext__(self) -> Any:
        if not self.items:
            raise StopAsyncIteration
        item = self.items.pop(0)
        if isinstance(item, BaseException):
            raise item
        return item

    def cancel(self) -> bool:
        self.cancelled = True
        return True


class FakeTriton:
    def __init__(self, items: list[Any], ready: bool = True) -> None:
        self.stream = FakeStream(items)
        self.ready = ready
        self.requests: list[dict[str, Any]] = []

    def stream_infer(self, requests: Any) -> FakeStream:
        async def first() -> None:
            self.requests.append(await anext(requests))

        self._first = asyncio.ensure_future(first())
        return self.stream

    async def is_model_ready(self, name: str, client_timeout: float) -> bool:
        return self.ready


def pieces_of(triton: FakeTriton, stop_after: int | None = None) -> list[Piece]:
    async def main() -> list[Piece]:
        client = LlmClient("127.0.0.1:1", client=triton)
        got: list[Piece] = []
        async with contextlib.aclosing(client.generate(GEN, "prompt")) as pieces:
            async for piece in pieces:
                got.append(piece)
                if stop_after is not None and len(got) == stop_after:
                    break
        await triton._first
        return got

    return asyncio.run(main())


GEN = Generation(kind="completion", model="m", max_tokens=4)
TEXT = {"text_output": np.array([[b"hi"]], dtype=np.object_)}
COUNT = {"num_output_tokens": np.array([[2]], dtype=np.uint32)}


def test_generate_reads_to_the_final_piece_and_asks_for_the_counts() -> None:
    done = {**TEXT, **COUNT, "finish_reason": np.array([[b"stop"]], dtype=np.object_)}
    triton = FakeTriton([(response(False, **TEXT, **COUNT), None), (response(True, **done), None)])
    got = pieces_of(triton)
    assert not triton.stream.cancelled, "a request that ended is not cancelled: its stream is read to the end"
    assert [(p.text, p.tokens, p.finish_reason, p.final) for p in got] == [
        ("hi", 2, None, False),
        ("hi", 2, "stop", True),
    ]
    request = triton.requests[0]
    assert request["model_name"] == "llm"
    assert request["parameters"] == {"triton_enable_empty_final_response": True, "disagg_priority": 0}


def test_leaving_early_cancels_the_stream() -> None:
    triton = FakeTriton([(response(False, **TEXT, **COUNT), None)] * 3)
    assert len(pieces_of(triton, stop_after=1)) == 1
    assert triton.stream.cancelled


@pytest.mark.parametrize(
    ("item", "ready", "status"),
    [
        ((None, InferenceServerException("INVALID_ARG: too long")), True, 400),
        ((None, InferenceServerException("Request for unknown model: 'llm'")), False, 503),
        ((None, InferenceServerException("something Triton says")), True, 500),
        (grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, None, None), True, 503),
        ((response(True, **TEXT, **COUNT), None), True, 500),  # a final piece without its reason
    ],
)
def test_failures_become_api_errors(item: Any, ready: bool, status: int) -> None:
    triton = FakeTriton([item], ready=ready)
    with pytest.raises(ApiError) as info:
        pieces_of(triton)
    assert info.value.status == status
    assert not triton.stream.cancelled, "an error ends the request: nothing to cancel"


def test_a_stream_ending_before_the_final_piece_is_unavailable() -> None:
    triton = FakeTriton([(response(False, **TEXT, **COUNT), None)])
    with pytest.raises(ApiError) as info:
        pieces_of(triton)
    assert info.value.status == 503 and "closed the stream" in info.value.message
