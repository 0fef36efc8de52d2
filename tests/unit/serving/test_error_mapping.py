"""The error mapping: codes, client-safe messages, and values that hold no frames."""

from __future__ import annotations

import gc
import weakref

import pytest

from disagg.engine.errors import InvalidRequest, OutOfBlocks
from disagg.kv.errors import DescriptorError, LeaseExpired, LeaseGone
from disagg.protocol.errors import INTERNAL, INVALID_ARG, UNAVAILABLE, ServingError, classify, invalid


@pytest.mark.parametrize(
    ("exc", "code", "message"),
    [
        (invalid("bad top_p"), INVALID_ARG, "bad top_p"),
        (InvalidRequest("max_tokens must be positive"), INVALID_ARG, "max_tokens must be positive"),
        (OutOfBlocks(needed=9, free=2), UNAVAILABLE, "KV cache is full, retry later"),
        (RuntimeError("/dev/shm/secret-path exploded"), INTERNAL, "internal error"),
        (LeaseExpired("descriptor lease has expired"), UNAVAILABLE, "KV lease is gone"),
        (LeaseGone("KV lease is no longer held by the exporter"), UNAVAILABLE, "KV lease is gone"),
        (
            DescriptorError("descriptor signature is invalid"),
            INVALID_ARG,
            "KV descriptor refused: descriptor signature is invalid",
        ),
    ],
)
def test_classify_maps_codes_without_leaking_internals(exc: Exception, code: str, message: str) -> None:
    error = classify(exc)
    assert (error.code, error.message) == (code, message)


class _Payload:
    """Stands for a request's input tensor."""


def _refuse(payload: _Payload) -> ServingError:
    try:
        raise invalid("refused")
    except Exception as exc:
        error = classify(exc)
    return error  # a caught exception kept past its except block would reference this frame


def test_classified_error_holds_no_frame_so_the_request_is_freed_at_once() -> None:
    payload = _Payload()
    alive = weakref.ref(payload)
    gc.disable()  # only reference counting: a cycle would keep the payload
    try:
        error = _refuse(payload)
        del payload
        assert alive() is None, "the request outlived its refusal (a traceback cycle)"
    finally:
        gc.enable()
    assert error.__traceback__ is None and error.code == INVALID_ARG
