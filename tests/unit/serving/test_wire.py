"""The wire module: every message between orchestrator and pools round-trips, and malformed input is
refused as the client's error (INVALID_ARG), never a crash."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from disagg.engine.params import SamplingParams
from disagg.engine.sequence import Request, SequenceState
from disagg.protocol.errors import INTERNAL, INVALID_ARG, STUB_DEAD, UNAVAILABLE, Reason, ServingError
from disagg.protocol.messages import (
    DecodeJob,
    Failed,
    GenerateJob,
    Ping,
    PoolLoad,
    Prefilled,
    PrefillJob,
    Stop,
    Token,
)
from disagg.role import Role
from disagg.triton import glue, wire

PARAMS = SamplingParams(max_tokens=7, temperature=0.5, top_k=3, seed=11, stop_token_ids=(4, 5))
STATE = SequenceState((1, 2, 3), (9,), PARAMS)


class _Sink:
    def emit(self, event, final):
        pass

    def is_cancelled(self) -> bool:
        return False


def _bytes(value: str | bytes) -> np.ndarray:
    return np.array([value.encode() if isinstance(value, str) else value], dtype=object)


@pytest.mark.parametrize("control", [Stop("h1"), Ping()])
def test_controls_round_trip(control):
    assert wire.decode_control(wire.encode_control(control).encode()) == control


@pytest.mark.parametrize(
    "raw", [b"", b"{", b"[]", b'{"op": "reboot"}', b'{"op": "stop"}', b'{"op": "ping", "x": 1}', b'{"op": 1}']
)
def test_malformed_controls_are_invalid_arg(raw):
    with pytest.raises(ServingError) as refused:
        wire.decode_control(raw)
    assert refused.value.code == INVALID_ARG


def test_events_round_trip():
    token = Token(42, True, "length")
    assert wire.decode_event(wire.encode_event(token).encode(), None) == token
    prefilled = Prefilled(9, False, None, b"descriptor-bytes", "lease-1", STATE)
    assert wire.decode_event(wire.encode_event(prefilled).encode(), b"descriptor-bytes") == prefilled
    failed = wire.decode_event(
        wire.encode_event(Failed(ServingError(UNAVAILABLE, "shutting down"))).encode(), None
    )
    assert isinstance(failed, Failed) and (failed.error.code, failed.error.message) == (
        UNAVAILABLE,
        "shutting down",
    )


@pytest.mark.parametrize("reason", list(Reason))
def test_a_failure_keeps_its_reason_on_the_wire_and_in_the_tag(reason):
    """The orchestrator decides on the reason, never the text: both ways a pool's error reaches it
    (an event, a Triton error's tagged message) carry it."""
    error = ServingError(UNAVAILABLE, "x: y", reason)
    failed = wire.decode_event(wire.encode_event(Failed(error)).encode(), None)
    assert (failed.error.code, failed.error.reason, failed.error.message) == (UNAVAILABLE, reason, "x: y")
    tagged = f"disagg-code:UNAVAILABLE/{reason.value}:x: y"
    back = glue.untagged_error(tagged)
    assert (back.code, back.reason, back.message) == (UNAVAILABLE, reason, "x: y")


def test_an_error_without_a_reason_gets_its_codes_and_triton_s_own_are_classified_once():
    """A peer that sends no reason (or one unknown here) gets its code's; Triton's own messages are
    a pool failure, and a dead stub's is the one text read (``STUB_DEAD``)."""
    for raw in (
        b'{"type": "failed", "code": "UNAVAILABLE", "message": "m"}',
        b'{"type": "failed", "code": "UNAVAILABLE", "reason": "bored", "message": "m"}',
    ):
        assert wire.decode_event(raw, None).error.reason is Reason.LOST
    assert glue.untagged_error("disagg-code:INVALID_ARG:bad").reason is Reason.BAD_REQUEST
    assert glue.untagged_error("disagg-code:UNAVAILABLE/bored:m").reason is Reason.LOST
    dead = glue.untagged_error("Stub process 'decode_0_0' is not healthy.")
    assert STUB_DEAD in dead.message and (dead.code, dead.reason) == (UNAVAILABLE, Reason.DEAD)
    other = glue.untagged_error("Request for unknown model: 'decode' is not found")
    assert (other.code, other.reason) == (UNAVAILABLE, Reason.LOST)
    assert ServingError(INTERNAL, "m").reason is Reason.INTERNAL
    with pytest.raises(ValueError):
        ServingError(UNAVAILABLE, "m", "bored")


def test_a_failure_with_a_code_not_ours_decodes_as_internal():
    raw = b'{"type": "failed", "code": "TEAPOT", "message": "short and stout"}'
    failed = wire.decode_event(raw, None)
    assert isinstance(failed, Failed) and (failed.error.code, failed.error.message) == (
        INTERNAL,
        "short and stout",
    )


def test_state_and_sampling_round_trip():
    assert wire.decode_state(wire.encode_state(STATE).encode()) == STATE
    assert wire.decode_sampling(wire.encode_sampling(PARAMS).encode()) == PARAMS


def test_jobs_by_role_and_inputs():
    prompt = {
        "handle": _bytes("h"),
        "input_ids": np.array([[1, 2, 3]], dtype=np.int32),
        "sampling": _bytes(wire.encode_sampling(PARAMS)),
    }
    prefill = wire.decode_job(Role.PREFILL, prompt, _Sink())
    assert isinstance(prefill, PrefillJob) and prefill.request.prompt_token_ids == (1, 2, 3)
    assert prefill.request.params == PARAMS and prefill.handle == "h"
    assert isinstance(wire.decode_job(Role.COLOCATED, prompt, _Sink()), GenerateJob)
    handoff = {"handle": _bytes("h"), "state": _bytes(wire.encode_state(STATE)), "descriptor": _bytes(b"d")}
    decode = wire.decode_job(Role.DECODE, handoff, _Sink())
    assert isinstance(decode, DecodeJob) and decode.state == STATE and decode.descriptor == b"d"


def test_a_state_alone_asks_for_generation_that_resumes_it():
    """The fallback ladder's request to a colocated pool or a prefill pool's local decode: the state's
    generated tokens are re-prefilled after its prompt."""
    job = wire.decode_job(
        Role.PREFILL, {"handle": _bytes("h"), "state": _bytes(wire.encode_state(STATE))}, _Sink()
    )
    assert isinstance(job, GenerateJob)
    assert job.request == Request(STATE.prompt_token_ids, STATE.params, STATE.generated_token_ids)


def test_a_pool_load_round_trips_and_anything_else_is_out_of_protocol():
    load = PoolLoad(queued=3, queued_prompt_tokens=900, active_sequences=5, blocks_used=30, blocks_free=70)
    assert wire.decode_load(wire.encode_load(load).encode()) == load
    timed = dataclasses.replace(load, prompt_tokens_done=600, busy_s=1.5, prefill_busy_s=0.25)
    assert wire.decode_load(wire.encode_load(timed).encode()) == timed
    assert load.kv_use == 0.3
    for raw in (wire.encode_event(Token(5, False)), "[]", '{"type": "load"}'):
        with pytest.raises(ValueError):
            wire.decode_load(raw.encode())


def test_a_pool_load_of_another_version_fills_in_defaults_and_ignores_unknown_fields():
    """A rolling upgrade: an older pool lacks the newer counters (their defaults), a newer one may
    send fields this version does not know (ignored); a field of the wrong type is still refused."""
    full = PoolLoad(1, 10, 2, 3, 4, prompt_tokens_done=5, busy_s=0.5, engine_steps=6)
    assert wire.decode_load(wire.encode_load(full).encode()) == full
    older = {"type": "load", "queued": 1, "queued_prompt_tokens": 10, "active_sequences": 2}
    older |= {"blocks_used": 3, "blocks_free": 4, "prompt_tokens_done": 5, "busy_s": 0.5}
    assert wire.decode_load(json.dumps(older).encode()) == PoolLoad(1, 10, 2, 3, 4, 5, 0.5, engine_steps=0)
    oldest = {k: v for k, v in older.items() if k not in ("prompt_tokens_done", "busy_s")}
    assert wire.decode_load(json.dumps(oldest).encode()) == PoolLoad(1, 10, 2, 3, 4)
    newer = {**older, "engine_steps": 6, "spare_cores": 2, "mood": "fine"}
    assert wire.decode_load(json.dumps(newer).encode()) == full
    for wrong in ({"engine_steps": "many"}, {"busy_s": None}, {"queued": [1]}):
        with pytest.raises((ValueError, TypeError)):
            wire.decode_load(json.dumps({**newer, **wrong}).encode())
    without_required = {k: v for k, v in older.items() if k != "blocks_free"}
    with pytest.raises(ValueError, match="blocks_free"):
        wire.decode_load(json.dumps(without_required).encode())


@pytest.mark.parametrize(
    "values",
    [
        {"input_ids": np.array([[1]], dtype=np.int32)},  # no handle
        {"handle": _bytes("x" * 200), "input_ids": np.array([[1]], dtype=np.int32), "sampling": _bytes("{}")},
        {"handle": _bytes("h"), "input_ids": np.array([[1]], dtype=np.int32)},  # no sampling
        {"handle": _bytes("h"), "descriptor": _bytes(b"d")},  # no state
        {"handle": _bytes("h"), "state": _bytes(b"{}"), "descriptor": _bytes(b"d")},
        {
            "handle": _bytes("h"),
            "input_ids": np.array([[1]], dtype=np.int32),
            "sampling": _bytes('{"bogus": 1}'),
        },
    ],
)
def test_malformed_jobs_are_invalid_arg(values):
    with pytest.raises(ServingError) as refused:
        wire.decode_job(Role.PREFILL, values, _Sink())
    assert refused.value.code == INVALID_ARG
