"""The text-level tensor interface of ``ensemble``, ``llm`` and ``ensemble_colocated``.

Tensor names and types follow the TensorRT-LLM ``ensemble`` so that existing clients, perf_analyzer
and genai-perf work unchanged: ``max_batch_size`` > 0 and ``dims: [1]``, so a client sends shape
[1, 1]. Inputs this server does not implement are declared (optional) and refused only when set to a
value other than their neutral default.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from disagg.engine.params import SamplingParams
from disagg.protocol.errors import invalid


@dataclass(frozen=True)
class InputSpec:
    name: str
    triton_type: str  # TYPE_* of config.pbtxt
    dims: tuple[int, ...] = (1,)
    optional: bool = True
    neutral: Any = None  # for unimplemented inputs: the only accepted value


# Implemented inputs, in the order of the TensorRT-LLM ensemble.
IMPLEMENTED = (
    InputSpec("text_input", "TYPE_STRING", optional=False),
    InputSpec("max_tokens", "TYPE_INT32", optional=False),
    InputSpec("stop_words", "TYPE_STRING", (-1,)),
    InputSpec("end_id", "TYPE_INT32"),
    InputSpec("top_k", "TYPE_INT32"),
    InputSpec("top_p", "TYPE_FP32"),
    InputSpec("temperature", "TYPE_FP32"),
    InputSpec("min_length", "TYPE_INT32"),
    InputSpec("random_seed", "TYPE_UINT64"),
    InputSpec("stream", "TYPE_BOOL"),
    InputSpec("exclude_input_in_output", "TYPE_BOOL"),
)
# Declared so that clients of the TensorRT-LLM ensemble can send them; refused unless neutral.
UNIMPLEMENTED = (
    InputSpec("bad_words", "TYPE_STRING", (-1,), neutral=""),
    InputSpec("pad_id", "TYPE_INT32", neutral=None),  # any value: padding does not exist here
    InputSpec("beam_width", "TYPE_INT32", neutral=1),
    InputSpec("num_return_sequences", "TYPE_INT32", neutral=1),
    InputSpec("length_penalty", "TYPE_FP32", neutral=1.0),
    InputSpec("repetition_penalty", "TYPE_FP32", neutral=1.0),
    InputSpec("presence_penalty", "TYPE_FP32", neutral=0.0),
    InputSpec("frequency_penalty", "TYPE_FP32", neutral=0.0),
    InputSpec("return_log_probs", "TYPE_BOOL", neutral=False),
    InputSpec("return_context_logits", "TYPE_BOOL", neutral=False),
    InputSpec("return_generation_logits", "TYPE_BOOL", neutral=False),
    InputSpec("embedding_bias_words", "TYPE_STRING", (-1,), neutral=""),
    InputSpec("embedding_bias_weights", "TYPE_FP32", (-1,), neutral=0.0),
)
ALL_INPUTS = IMPLEMENTED + UNIMPLEMENTED
INPUT_NAMES = frozenset(spec.name for spec in ALL_INPUTS)
OUTPUT_NAME = "text_output"

# Optional outputs of ``llm`` only (not of the ensembles), each sent when its request input is true.
# Names and meaning follow the Triton vLLM backend's "additional outputs", which Triton's own OpenAI
# front end reads: ``num_input_tokens`` the prompt's tokens (on every response), ``num_output_tokens``
# the tokens generated since the previous response of the request (their sum is every token the engine
# generated, end token included), ``finish_reason`` "stop" or "length" on the final response ("" before).
# ``return_error_code`` is this server's own: an error's message then starts with its code and ": "
# (gRPC streaming carries an error's text only, not its code).
EXTRA_OUTPUTS = (
    ("return_num_input_tokens", "num_input_tokens", "TYPE_UINT32"),
    ("return_num_output_tokens", "num_output_tokens", "TYPE_UINT32"),
    ("return_finish_reason", "finish_reason", "TYPE_STRING"),
)
ERROR_CODE_INPUT = "return_error_code"
LLM_ONLY_INPUTS = tuple(
    InputSpec(flag, "TYPE_BOOL") for flag in (*(flag for flag, _, _ in EXTRA_OUTPUTS), ERROR_CODE_INPUT)
)
LLM_INPUT_NAMES = INPUT_NAMES | {spec.name for spec in LLM_ONLY_INPUTS}

NUMPY_KIND = {
    "TYPE_STRING": "O",
    "TYPE_INT32": "i",
    "TYPE_UINT64": "u",
    "TYPE_FP32": "f",
    "TYPE_BOOL": "b",
}

MAX_PROMPT_BYTES = 1 << 20  # 1 MiB of UTF-8: far above any context this server accepts
MAX_STOP_WORDS = 16
MAX_STOP_WORD_BYTES = 256
# Request parameters Triton itself adds, or that our own glue sets; everything else is refused.
PRIORITY_PARAMETER = "disagg_priority"
"""Request parameter: an integer in [-MAX_PRIORITY, MAX_PRIORITY], 0 by default; negative is sheddable
(refused first when the server is over capacity). Not ``priority``: Triton reserves that name for its
own scheduler's priority level (the clients refuse it as a parameter)."""
ALLOWED_PARAMETERS = frozenset({"triton_enable_empty_final_response", "disagg_auth", PRIORITY_PARAMETER})
MAX_PRIORITY = 100


@dataclass(frozen=True)
class TextRequest:
    """One validated text request."""

    prompt: str
    params: SamplingParams
    stream: bool = False
    exclude_input_in_output: bool = False
    stop_words: tuple[str, ...] = ()
    extra_outputs: frozenset[str] = frozenset()
    """Names of the ``EXTRA_OUTPUTS`` the client asked for (``llm`` only)."""
    priority: int = 0


def _scalar(name: str, value: np.ndarray) -> Any:
    if value.size != 1:
        raise invalid(
            f"input '{name}' must hold exactly one value (batch size 1, dims [1]); got {value.size}"
        )
    return value.reshape(-1)[0]


def _text(name: str, raw: Any) -> str:
    if isinstance(raw, str):
        data = raw.encode("utf-8", "surrogatepass")
    elif isinstance(raw, (bytes, bytearray, np.bytes_)):
        data = bytes(raw)
    else:
        raise invalid(f"input '{name}' must be BYTES")
    if len(data) > MAX_PROMPT_BYTES:
        raise invalid(f"input '{name}' is larger than {MAX_PROMPT_BYTES} bytes")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise invalid(f"input '{name}' is not valid UTF-8") from None
    if "\x00" in text:
        raise invalid(f"input '{name}' contains a NUL character")
    return text


def _check_kind(spec: InputSpec, value: np.ndarray) -> None:
    if value.dtype.kind != NUMPY_KIND[spec.triton_type] and not (
        spec.triton_type == "TYPE_STRING" and value.dtype.kind in "OSU"
    ):
        raise invalid(f"input '{spec.name}' has type {value.dtype}, expected {spec.triton_type[5:]}")


def parse_text_request(values: Mapping[str, np.ndarray | None], parameters: Mapping[str, Any]) -> TextRequest:
    """Validate one request's tensors (name -> array, None when absent) and request parameters.

    Raises ServingError(INVALID_ARG) naming the first bad input. Nothing is allocated.
    """
    unknown = sorted(set(parameters) - ALLOWED_PARAMETERS)
    if unknown:
        raise invalid(f"unknown parameter(s) {unknown}: this model accepts the inputs {sorted(INPUT_NAMES)}")
    present = {k: v for k, v in values.items() if v is not None}
    for spec in ALL_INPUTS + LLM_ONLY_INPUTS:
        if spec.name in present:
            _check_kind(spec, present[spec.name])
        elif not spec.optional:
            raise invalid(f"input '{spec.name}' is required")
    for spec in UNIMPLEMENTED:
        if spec.name in present and spec.neutral is not None:
            _refuse_unless_neutral(spec, present[spec.name])

    prompt = _text("text_input", _scalar("text_input", present["text_input"]))
    if not prompt:
        raise invalid("input 'text_input' is empty")

    def get(name: str, default: Any) -> Any:
        return _scalar(name, present[name]) if name in present else default

    temperature = float(get("temperature", 0.0))
    top_p = float(get("top_p", 1.0))
    for name, value in (("temperature", temperature), ("top_p", top_p)):
        if not math.isfinite(value):
            raise invalid(f"input '{name}' must be finite, got {value}")
    end_id = get("end_id", None)
    params = SamplingParams(
        max_tokens=int(get("max_tokens", 0)),
        temperature=temperature,
        top_k=int(get("top_k", 0)),
        top_p=top_p,
        seed=int(get("random_seed", 0)),
        min_length=int(get("min_length", 0)),
        end_id=None if end_id is None else int(end_id),
    )
    return TextRequest(
        prompt=prompt,
        params=params,
        stream=bool(get("stream", False)),
        exclude_input_in_output=bool(get("exclude_input_in_output", False)),
        stop_words=_stop_words(present.get("stop_words")),
        extra_outputs=frozenset(
            output for flag, output, _ in EXTRA_OUTPUTS if flag in present and bool(get(flag, False))
        ),
        priority=_priority(parameters.get(PRIORITY_PARAMETER, 0)),
    )


def _priority(value: Any) -> int:
    if isinstance(value, str) and value.lstrip("-").isdigit():
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool) or not -MAX_PRIORITY <= value <= MAX_PRIORITY:
        raise invalid(
            f"parameter '{PRIORITY_PARAMETER}' must be an integer in [-{MAX_PRIORITY}, {MAX_PRIORITY}]"
        )
    return value


def wants_error_code(values: Mapping[str, np.ndarray | None]) -> bool:
    """True when the request's ``return_error_code`` input is a single true value."""
    value = values.get(ERROR_CODE_INPUT)
    return value is not None and value.dtype.kind == "b" and value.size == 1 and bool(value.reshape(-1)[0])


def _raw_size(raw: Any) -> int:
    """Bytes of one element of a BYTES tensor, without decoding it."""
    if isinstance(raw, (bytes, bytearray, np.bytes_)):
        return len(raw)
    if isinstance(raw, str):
        return len(raw)  # characters: a lower bound of its UTF-8 bytes, checked again once encoded
    return 0  # not BYTES: _text refuses it


def _bounded_list(name: str, value: np.ndarray, max_items: int, max_item_bytes: int) -> np.ndarray:
    """The elements of a list input, once its count (from the tensor's shape) and each element's size
    are within bounds: checked before anything is decoded, so that a request carrying megabytes of
    words costs a refusal, not their decoding."""
    if value.size > max_items:
        raise invalid(f"input '{name}' holds more than {max_items} words ({value.size})")
    flat = value.reshape(-1)
    if any(_raw_size(raw) > max_item_bytes for raw in flat):
        raise invalid(f"input '{name}' has a word longer than {max_item_bytes} bytes")
    return flat


def _stop_words(value: np.ndarray | None) -> tuple[str, ...]:
    if value is None:
        return ()
    flat = _bounded_list("stop_words", value, MAX_STOP_WORDS, MAX_STOP_WORD_BYTES)
    words = [_text("stop_words", raw) for raw in flat]
    words = [w for w in words if w]
    if any(len(w.encode()) > MAX_STOP_WORD_BYTES for w in words):
        raise invalid(f"input 'stop_words' has a word longer than {MAX_STOP_WORD_BYTES} bytes")
    return tuple(words)


def _refuse_unless_neutral(spec: InputSpec, value: np.ndarray) -> None:
    textual = spec.triton_type == "TYPE_STRING"
    for raw in _bounded_list(spec.name, value, MAX_STOP_WORDS, MAX_STOP_WORD_BYTES):
        item = _text(spec.name, raw) if textual else raw
        if item != spec.neutral and not (textual and not item):
            raise invalid(f"input '{spec.name}' is not supported by this server (only {spec.neutral!r})")
