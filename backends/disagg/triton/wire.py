"""The internal wire format between the orchestrator and the pools (BYTES tensors holding JSON).

Pool inputs (all optional; which ones are present decides the kind of request):
  ``input_ids`` INT32 [-1]   prompt (prefill, colocated)
  ``sampling``  BYTES [1]    SamplingParams as JSON (prefill, colocated)
  ``state``     BYTES [1]    SequenceState as JSON: with ``descriptor``, decode that KV here; alone,
                             generate here (prefill the prompt and any generated tokens, then
                             decode): colocated, or a prefill pool with ``local_generate``
  ``descriptor``BYTES [1]    signed KV descriptor (decode)
  ``handle``    BYTES [1]    the orchestrator's request id (every job)
  ``control``   BYTES [1]    {"op": "stop", "handle": ...} | {"op": "ping"}
Pool output: ``event`` BYTES [1], one JSON object per response (see ``encode_event``); a ping's one
response carries the pool's load (``encode_load``). A job's first response is an empty acceptance
(no outputs, not final), sent before the job is queued (``pool_model.TritonSink.accept``). A job's
failure is an event too, never a Triton error response: on Triton 2.51 an error response after the
first one of a decoupled BLS stream reaches the caller without the stream's id (the Python backend
saves a response's id only when it has no error), so the caller's iterator never sees its final
response and waits forever.
Every pool request carries the request parameter ``disagg_auth`` (``disagg.serving.auth``).
"""

from __future__ import annotations

import json
from dataclasses import MISSING, asdict
from typing import Any

import numpy as np

from disagg.engine.params import SamplingParams
from disagg.engine.sequence import Request, SequenceState
from disagg.protocol.errors import CODES, INTERNAL, ServingError, invalid, reason_named
from disagg.protocol.messages import (
    Control,
    DecodeJob,
    Event,
    Failed,
    GenerateJob,
    Job,
    Ping,
    PoolLoad,
    Prefilled,
    PrefillJob,
    Sink,
    Stop,
    Token,
)
from disagg.role import Operation, Role
from disagg.triton.glue import first_bytes

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


def encode_state(state: SequenceState) -> str:
    return json.dumps(state.to_dict())


def decode_state(raw: bytes) -> SequenceState:
    try:
        return SequenceState.from_dict(json.loads(raw))
    except ValueError:
        raise invalid("malformed sequence state") from None


def call_subject(handle: str | bytes | None, control: str | bytes | None) -> bytes:
    """What a pool call is about, as its token is bound to it (``disagg.serving.auth``): the control
    message itself, else the job's handle; both sides compute it from the call's own inputs."""
    if control is not None:
        return b"control|" + (control.encode() if isinstance(control, str) else control)
    if handle is not None:
        return b"job|" + (handle.encode() if isinstance(handle, str) else handle)
    return b"none|"


def decode_handle(raw: bytes | None) -> str:
    if raw is None or not 0 < len(raw) <= MAX_HANDLE:
        raise invalid("missing or oversized request handle")
    return raw.decode("utf-8", "replace")


def encode_control(control: Control) -> str:
    if isinstance(control, Stop):
        return json.dumps({"op": "stop", "handle": control.handle})
    return json.dumps({"op": "ping"})


def decode_control(raw: bytes) -> Control:
    try:
        data = json.loads(raw)
    except ValueError:
        data = None
    op = data.get("op") if isinstance(data, dict) else None
    if op == "stop" and isinstance(data.get("handle"), str):
        return Stop(data["handle"])
    if op == "ping" and set(data) == {"op"}:
        return Ping()
    raise invalid("malformed control request")


def decode_job(role: Role, values: dict[str, Any], sink: Sink) -> Job:
    """The job a pool request asks for: a sequence state and KV descriptor make a DecodeJob; a state
    alone a GenerateJob that re-prefills it (whether this pool runs it is the scheduler's check); a
    prompt and sampling parameters a PrefillJob (prefill role) or a GenerateJob (colocated)."""
    handle = decode_handle(first_bytes(values.get("handle")))
    state, descriptor = first_bytes(values.get("state")), first_bytes(values.get("descriptor"))
    if descriptor is not None:
        if state is None:
            raise invalid("decode requests need a KV descriptor and a sequence state")
        return DecodeJob(handle, sink, decode_state(state), descriptor)
    if state is not None:
        return GenerateJob(handle, sink, Request.resuming(decode_state(state)))
    ids, sampling = values.get("input_ids"), first_bytes(values.get("sampling"))
    if ids is None or sampling is None:
        raise invalid(f"{role.value} requests need input_ids and sampling")
    request = Request(tuple(int(t) for t in np.asarray(ids).reshape(-1)), decode_sampling(sampling))
    if Operation.PREFILL in role.operations:
        return PrefillJob(handle, sink, request)
    return GenerateJob(handle, sink, request)


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
    if isinstance(event, Failed):
        error = event.error
        return json.dumps(
            {"type": "failed", "code": error.code, "reason": error.reason.value, "message": error.message}
        )
    raise ValueError(f"not a pool event: {event!r}")


def encode_load(load: PoolLoad) -> str:
    return json.dumps({"type": "load", **asdict(load)})


def decode_load(raw: bytes) -> PoolLoad:
    """A ping's answer; a pool that answers something else is out of protocol (ValueError, or
    TypeError for a field of the wrong type).

    Across versions (a rolling upgrade): a field the answer lacks takes its default, if it has one (a
    pool of an older version knows fewer fields; one without a default is out of protocol), and a
    field this version does not know is ignored (a newer pool's)."""
    data = json.loads(raw)
    if not isinstance(data, dict) or data.pop("type", None) != "load":
        raise ValueError("not a pool load")
    missing = sorted(name for name in _LOAD_REQUIRED if name not in data)
    if missing:
        raise ValueError(f"a pool load without {', '.join(missing)}")
    return PoolLoad(**{name: kind(data[name]) for name, kind in _LOAD_TYPES.items() if name in data})


_LOAD_TYPES = {name: float if name.endswith("busy_s") else int for name in PoolLoad.__dataclass_fields__}
_LOAD_REQUIRED = tuple(
    name
    for name, f in PoolLoad.__dataclass_fields__.items()
    if f.default is MISSING and f.default_factory is MISSING
)


def decode_event(raw: bytes, descriptor: bytes | None) -> Event:
    data = json.loads(raw)
    if data["type"] == "token":
        return Token(int(data["token_id"]), bool(data["finished"]), data["finish_reason"])
    if data["type"] == "failed":
        code = data["code"] if data["code"] in CODES else INTERNAL
        reason = reason_named(data.get("reason")) if code == data["code"] else None
        return Failed(ServingError(code, str(data["message"]), reason))
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
            "priority": text.priority,
        }
    )


def decode_text_request(raw: bytes) -> Any:
    from disagg.serving.text_api import TextRequest

    try:
        data = json.loads(raw)
        return TextRequest(
            prompt=str(data["prompt"]),
            params=_sampling_from(data["sampling"]),
            stream=bool(data["stream"]),
            exclude_input_in_output=bool(data["exclude_input_in_output"]),
            stop_words=tuple(str(w) for w in data["stop_words"]),
            priority=int(data.get("priority", 0)),
        )
    except (ValueError, KeyError, TypeError):
        raise invalid("malformed request from preprocessing") from None
