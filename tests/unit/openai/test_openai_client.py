"""What the front end sends to ``llm`` and how it reads ``llm``'s responses and errors
(disagg.openai.client, disagg.openai.errors), on protobuf messages built here."""

from __future__ import annotations

import numpy as np
import pytest
from tritonclient.grpc import InferResult, service_pb2
from tritonclient.utils import serialize_byte_tensor

from disagg.openai.client import _piece, llm_inputs
from disagg.openai.errors import from_llm
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
