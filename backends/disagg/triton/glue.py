"""Small helpers shared by the adapters: parameters, tensors, errors, responses."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

import numpy as np

from disagg.kv.errors import SecretError
from disagg.kv.secret import load_secret
from disagg.protocol.errors import (
    CANCELLED,
    CODES,
    DEADLINE,
    INTERNAL,
    INVALID_ARG,
    STUB_DEAD,
    UNAVAILABLE,
    Reason,
    ServingError,
    reason_named,
)

log = logging.getLogger(__name__)


def model_parameters(args: dict[str, Any]) -> dict[str, str]:
    """The ``parameters`` block of config.pbtxt as name -> string value."""
    config = json.loads(args["model_config"])
    return {k: v.get("string_value", "") for k, v in (config.get("parameters") or {}).items()}


def parse_cores(text: str, instance_name: str) -> tuple[int, ...] | None:
    """``"0"``, ``"0,1"`` or per-instance sets ``"0;1"`` (instance i takes set i mod n); empty: None."""
    text = text.strip()
    if not text:
        return None
    sets = [s for s in text.split(";") if s.strip()]
    index = instance_index(instance_name)
    chosen = sets[index % len(sets)]
    try:
        return tuple(int(c) for c in chosen.split(","))
    except ValueError:
        raise ValueError(f"cores parameter {text!r} is not a list of core numbers") from None


def instance_device(args: dict[str, Any]) -> str | None:
    """``cuda:N`` for a ``KIND_GPU`` instance (Triton passes its kind and device id), else None."""
    if str(args.get("model_instance_kind", "")).upper() != "GPU":
        return None
    return f"cuda:{int(args.get('model_instance_device_id', 0))}"


def instance_index(instance_name: str) -> int:
    """Triton names instances ``<group>_<index>``; the trailing number is this instance's index."""
    tail = instance_name.rsplit("_", 1)[-1]
    return int(tail) if tail.isdigit() else 0


def deployment_secret(path: str = "", wait_s: float = 10.0) -> bytes:
    """The deployment secret. Instances start at once; one creates the file while others wait."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            return load_secret(Path(path) if path else None)
        except SecretError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)  # another instance is between creating and writing the file


def triton_error(pb_utils: Any, error: ServingError, *, tagged: bool = False) -> Any:
    """A Triton error for ``error``. ``tagged`` (pool -> orchestrator) also writes the code and the
    reason into the message: Triton 2.51 hands a BLS caller every error with code INTERNAL, whatever
    was sent (``disagg-code:UNAVAILABLE/full:KV cache is full, retry later``)."""
    codes = {
        INVALID_ARG: pb_utils.TritonError.INVALID_ARG,
        UNAVAILABLE: pb_utils.TritonError.UNAVAILABLE,
        CANCELLED: pb_utils.TritonError.CANCELLED,
        DEADLINE: pb_utils.TritonError.UNAVAILABLE,
        INTERNAL: pb_utils.TritonError.INTERNAL,
    }
    message = f"{_TAG}{error.code}/{error.reason.value}:{error.message}" if tagged else error.message
    return pb_utils.TritonError(message, codes[error.code])


_TAG = "disagg-code:"


def serving_error(pb_utils: Any, error: Any) -> ServingError:
    """The inverse of triton_error(tagged=True), for errors coming back from a BLS call."""
    return untagged_error(error.message())


def untagged_error(message: str) -> ServingError:
    """The ServingError a pool sent as ``message`` (tagged by triton_error), over BLS or gRPC.

    Not one of ours, it is Triton's own, and the pool is not serving: this is the one place that
    reads an error's text to decide, for Triton's message about a dead stub (``STUB_DEAD``)."""
    if message.startswith(_TAG):
        head, _, text = message[len(_TAG) :].partition(":")
        code, _, reason = head.partition("/")
        if code in CODES:
            return ServingError(code, text, reason_named(reason))
    return ServingError(UNAVAILABLE, message, Reason.DEAD if STUB_DEAD in message else Reason.LOST)


def bytes_tensor(pb_utils: Any, name: str, value: bytes | str, shape: tuple[int, ...] = (1,)) -> Any:
    data = value.encode() if isinstance(value, str) else value
    return pb_utils.Tensor(name, np.array([data], dtype=np.object_).reshape(shape))


def input_arrays(pb_utils: Any, request: Any, names: Any) -> dict[str, np.ndarray | None]:
    out = {}
    for name in names:
        tensor = pb_utils.get_input_tensor_by_name(request, name)
        out[name] = None if tensor is None else tensor.as_numpy()
    return out


def first_bytes(array: np.ndarray | None) -> bytes | None:
    if array is None or array.size == 0:
        return None
    item = array.reshape(-1)[0]
    return item if isinstance(item, bytes) else str(item).encode()


def request_parameters(request: Any) -> dict[str, Any]:
    raw = request.parameters()
    return json.loads(raw) if raw else {}


def send_error(pb_utils: Any, sender: Any, error: ServingError, *, tagged: bool = False) -> None:
    response = pb_utils.InferenceResponse(error=triton_error(pb_utils, error, tagged=tagged))
    sender.send(response, flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
