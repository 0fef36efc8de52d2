"""The internal wire format between the orchestrator and the pools (BYTES tensors holding JSON).

Pool inputs (all optional; which ones are present decides the kind of request):
  ``input_ids`` INT32 [-1]   prompt (prefill, colocated)
  ``sampling``  BYTES [1]    SamplingParams as JSON (prefill, colocated)
  ``state``     BYTES [1]    SequenceState as JSON (decode)
  ``descriptor``BYTES [1]    signed KV descriptor (decode)
  ``handle``    BYTES [1]    the orchestrator's request id (every job)
  ``control``   BYTES [1]    {"op": "stop", "handle": ...} | {"op": "abort_lease", "lease_id": ...}
Pool output: ``event`` BYTES [1], one JSON object per response (see ``encode_event``).
Every pool request carries the request parameter ``disagg_auth`` (``disagg.serving.auth``).
"""

from __future__ import annotations

import json
from dataclasses import asdict
from typing import Any

from disagg.engine.params import SamplingParams
from disagg.engine.sequence import SequenceState
from disagg.serving.errors import invalid
from disagg.serving.messages import Event, Prefilled, Token

POOL_INPUTS = ("input_ids", "sampling", "state", "descriptor", "handle", "control")
MAX_HANDLE = 128


def encode_sampling(params: SamplingParams) -> str:
    return json.dumps(_sampling_dict(params))


def _sampling_dict(params: SamplingParams) -> dict[str, Any]:
    return {**asdict(params), "stop_token_ids": list(params.stop_token_ids)}


def decode_sampling(raw: bytes) -> SamplingParams:
    try:
        return _sampling_from(json.loads(raw))
    except ValueError:
        raise invalid("malformed sampling parameters") from None


def _sampling_from(data: Any) -> SamplingParams:
    """SamplingParams from parsed JSON; unknown keys are errors (values are validated by the engine)."""
    try:
        known = set(SamplingParams.__dataclass_fields__)
        if not isinstance(data, dict) or not set(data) <= known:
            raise ValueError
        return SamplingParams(**{**data, "stop_token_ids": tuple(data.get("stop_token_ids", ()))})
    except (ValueError, TypeError):
        raise invalid("malformed sampling parameters") from None


def decode_state(raw: bytes) -> SequenceState:
    try:
        return SequenceState.from_dict(json.loads(raw))
    except ValueError:
        raise invalid("malformed sequence state") from None


def decode_handle(raw: bytes | None) -> str:
    if raw is None or not 0 < len(raw) <= MAX_HANDLE:
        raise invalid("missing or oversized request handle")
    return raw.decode("utf-8", "replace")


def decode_control(raw: bytes) -> dict[str, Any]:
    try:
        data = json.loads(raw)
    except ValueError:
        data = None
    if not isinstance(data, dict) or data.get("op") not in ("stop", "abort_lease"):
        raise invalid("malformed control request")
    return data


def encode_event(event: Event) -> str:
    if isinstance(event, Token):
        return json.dumps({"type": "token", "token_id": event.token_id, "finished": event.finished,
                           "finish_reason": event.finish_reason})  # fmt: skip
    if isinstance(event, Prefilled):
        return json.dumps(
            {
                "type": "prefilled",
                "token_id": event.token_id,
                "finished": event.finished,
                "finish_reason": event.finish_reason,
                "lease_id": event.lease_id,
                "state": event.state.to_dict() if event.state else None,
            }
        )
    raise ValueError("failures travel as Triton errors")


def decode_event(raw: bytes, descriptor: bytes | None) -> Token | Prefilled:
    data = json.loads(raw)
    if data["type"] == "token":
        return Token(int(data["token_id"]), bool(data["finished"]), data["finish_reason"])
    state = SequenceState.from_dict(data["state"]) if data["state"] else None
    return Prefilled(
        int(data["token_id"]),
        bool(data["finished"]),
        data["finish_reason"],
        descriptor,
        data["lease_id"],
        state,
    )


def encode_text_request(text: Any) -> str:
    """A validated TextRequest, from preprocessing to the orchestrator."""
    return json.dumps(
        {
            "prompt": text.prompt,
            "sampling": _sampling_dict(text.params),
            "stream": text.stream,
            "exclude_input_in_output": text.exclude_input_in_output,
            "stop_words": list(text.stop_words),
        }
    )


def decode_text_request(raw: bytes) -> Any:
    from disagg.serving.interface import TextRequest

    try:
        data = json.loads(raw)
        return TextRequest(
            prompt=str(data["prompt"]),
            params=_sampling_from(data["sampling"]),
            stream=bool(data["stream"]),
            exclude_input_in_output=bool(data["exclude_input_in_output"]),
            stop_words=tuple(str(w) for w in data["stop_words"]),
        )
    except (ValueError, KeyError, TypeError):
        raise invalid("malformed request from preprocessing") from None
