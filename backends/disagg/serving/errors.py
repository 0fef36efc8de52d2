"""Per-request errors with the Triton code each maps to, and the mapping of everything else."""

from __future__ import annotations

import logging

from disagg.engine.errors import BatchFull, CheckpointError, InvalidRequest, OutOfBlocks
from disagg.kv.errors import DescriptorError, IncompatibleKV, KVError, LeaseExpired, LeaseGone

log = logging.getLogger(__name__)

INVALID_ARG = "INVALID_ARG"
UNAVAILABLE = "UNAVAILABLE"
CANCELLED = "CANCELLED"
DEADLINE = "DEADLINE_EXCEEDED"
INTERNAL = "INTERNAL"
CODES = (INVALID_ARG, UNAVAILABLE, CANCELLED, DEADLINE, INTERNAL)
TRANSFER_FAILED = "KV transfer failed"  # the message of a KVError (the pools on both ends may be fine)
LEASE_LOST = "KV lease is gone"  # its prefill pool no longer holds the KV: re-prefill, not the pool's fault
# a decode pool refused KV of another model version (fingerprint): a deployment fault, not the request's
KV_INCOMPATIBLE = "KV refused: it was computed by another model version (fingerprint mismatch)"
PROBE_UNANSWERED = "did not answer a probe"  # a call's pool, probed while the call was overdue
STUB_DEAD = "is not healthy"
"""In Triton 2.51's error for a call to a Python model instance whose stub process died ("Stub process
'decode_0_0' is not healthy."): the pool is dead, not slow."""


class ServingError(Exception):
    """An error for one request, with its code and a message safe to show the client."""

    def __init__(self, code: str, message: str) -> None:
        if code not in CODES:
            raise ValueError(f"unknown error code {code!r}")
        super().__init__(message)
        self.code = code
        self.message = message


def invalid(message: str) -> ServingError:
    return ServingError(INVALID_ARG, message)


def classify(exc: BaseException) -> ServingError:
    """Map any exception to a client-safe ServingError; unexpected ones are logged, not echoed.

    The result is always a fresh value without a traceback: a caught exception kept in a local
    variable references its own frame through ``__traceback__``, a cycle that holds the frame's
    request (a 10 MB input, a Triton response sender) until the cyclic collector happens to run.
    """
    if isinstance(exc, ServingError):
        return ServingError(exc.code, exc.message)
    if isinstance(exc, InvalidRequest):
        return ServingError(INVALID_ARG, str(exc))
    if isinstance(exc, OutOfBlocks):
        return ServingError(UNAVAILABLE, "KV cache is full, retry later")
    if isinstance(exc, BatchFull):
        return ServingError(UNAVAILABLE, "decode batch is full, retry later")
    if isinstance(exc, IncompatibleKV):
        return ServingError(UNAVAILABLE, KV_INCOMPATIBLE)
    if isinstance(exc, LeaseExpired | LeaseGone):
        return ServingError(UNAVAILABLE, LEASE_LOST)
    if isinstance(exc, DescriptorError):
        return ServingError(INVALID_ARG, f"KV descriptor refused: {exc}")
    if isinstance(exc, KVError):
        return ServingError(UNAVAILABLE, TRANSFER_FAILED)
    if isinstance(exc, CheckpointError):
        return ServingError(INTERNAL, "model is not loaded")
    log.error("internal error", exc_info=exc)
    return ServingError(INTERNAL, "internal error")
