"""Errors of the KV hand-off layer.

The serving layer maps each class to a Triton code through ``triton_code``. Messages are
fixed phrases: they never carry region names, paths, addresses or the secret, because
they may reach a client (RELIABILITY.md G2).
"""

from __future__ import annotations


class KVError(Exception):
    """Base class of every error raised by ``disagg.kv``."""

    triton_code = "INTERNAL"


class SecretError(KVError):
    """The deployment secret is missing, too short, or stored unsafely."""


class DescriptorError(KVError):
    """A descriptor (or ack) is malformed, forged, of an unknown version, or out of limits."""

    triton_code = "INVALID_ARG"


class LeaseExpired(DescriptorError):
    """The descriptor's lease has expired, so its blocks may already be reused."""

    triton_code = "UNAVAILABLE"


class IncompatibleKV(DescriptorError):
    """The KV was computed by another model version: its fingerprint (checkpoint, layout, KV dtype,
    block size, engine KV format; ``disagg.engine.fingerprint``) is not the importer's. Refused before
    any memory is touched. UNAVAILABLE: the orchestrator may still serve the request on another rung."""

    triton_code = "UNAVAILABLE"


class LeaseGone(DescriptorError):
    """The lease is no longer held: already consumed, released, aborted or expired (replay)."""

    triton_code = "UNAVAILABLE"


class TransferError(KVError):
    """The copy itself failed (peer gone, timeout, injected fault); the destination is partial."""

    triton_code = "UNAVAILABLE"


class ChecksumMismatch(TransferError):
    """The bytes that arrived differ from the bytes that were exported."""


class TransportClosed(KVError):
    """The transport was closed; no further exports or imports."""

    triton_code = "UNAVAILABLE"
