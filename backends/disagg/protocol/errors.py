"""Per-request errors with the Triton code each maps to, and the mapping of everything else."""

from __future__ import annotations

import logging
from enum import StrEnum

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


class Reason(StrEnum):
    """Why a call or a request failed: what the orchestrator decides on (the code is the client's,
    the message is for people). It travels with the code wherever an error crosses a process."""

    FULL = "full"  # a pool at one of its limits (queue, KV blocks, batch): saturated, not gone
    UNANSWERED = "unanswered"  # an overdue call's pool did not answer a probe either
    DEAD = "dead"  # a stub process of the pool died
    LOST = "lost"  # the pool stopped serving or could not be reached: any other pool failure
    LEASE_LOST = "lease_lost"  # the prefill pool no longer holds the KV: prefill again, no pool's fault
    TRANSFER_FAILED = "transfer_failed"  # the KV copy failed: the pools on both ends may be fine
    INCOMPATIBLE_KV = "incompatible_kv"  # KV of another model version (a deployment fault)
    UNSUPPORTED = "unsupported"  # a pool that does not run this kind of job
    SHED = "shed"  # refused by this server's own policy (admission, degradation, limits): retry later
    DRAINING = "draining"  # the server is shutting down
    BAD_REQUEST = "bad_request"
    CANCELLED = "cancelled"
    TIMEOUT = "timeout"
    INTERNAL = "internal"


def reason_named(name: object) -> Reason | None:
    """The reason called ``name`` on the wire; None for anything else (a peer that sent none)."""
    try:
        return Reason(name)
    except ValueError:
        return None


_DEFAULT_REASONS = {
    INVALID_ARG: Reason.BAD_REQUEST,
    UNAVAILABLE: Reason.LOST,
    CANCELLED: Reason.CANCELLED,
    DEADLINE: Reason.TIMEOUT,
    INTERNAL: Reason.INTERNAL,
}


class ServingError(Exception):
    """An error for one request, with its code and a message safe to show the client, and the
    reason decisions read (by default the code's: a pool failure for UNAVAILABLE)."""

    def __init__(self, code: str, message: str, reason: Reason | None = None) -> None:
        if code not in CODES:
            raise ValueError(f"unknown error code {code!r}")
        super().__init__(message)
        self.code = code
        self.message = message
        self.reason = _DEFAULT_REASONS[code] if reason is None else Reason(reason)


def invalid(message: str) -> ServingError:
    return ServingError(INVALID_ARG, message)


def classify(exc: BaseException) -> ServingError:
    """Map any exception to a client-safe ServingError; unexpected ones are logged, not echoed.

    The result is always a fresh value without a traceback: a caught exception kept in a local
    variable references its own frame through ``__traceback__``, a cycle that holds the frame's
    request (a 10 MB input, a Triton response sender) until the cyclic collector happens to run.
    """
    if isinstance(exc, ServingError):
        return ServingError(exc.code, exc.message, exc.reason)
    if isinstance(exc, InvalidRequest):
        return ServingError(INVALID_ARG, str(exc))
    if isinstance(exc, OutOfBlocks):
        return ServingError(UNAVAILABLE, "KV cache is full, retry later", Reason.FULL)
    if isinstance(exc, BatchFull):
        return ServingError(UNAVAILABLE, "decode batch is full, retry later", Reason.FULL)
    if isinstance(exc, IncompatibleKV):
        return ServingError(UNAVAILABLE, KV_INCOMPATIBLE, Reason.INCOMPATIBLE_KV)
    if isinstance(exc, LeaseExpired | LeaseGone):
        return ServingError(UNAVAILABLE, LEASE_LOST, Reason.LEASE_LOST)
    if isinstance(exc, DescriptorError):
        return ServingError(INVALID_ARG, f"KV descriptor refused: {exc}")
    if isinstance(exc, KVError):
        return ServingError(UNAVAILABLE, TRANSFER_FAILED, Reason.TRANSFER_FAILED)
    if isinstance(exc, CheckpointError):
        return ServingError(INTERNAL, "model is not loaded")
    log.error("internal error", exc_info=exc)
    return ServingError(INTERNAL, "internal error")
