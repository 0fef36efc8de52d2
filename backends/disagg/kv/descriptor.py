"""The KV descriptor: a small signed statement "these blocks of mine hold this KV, until then".

It names the exporter's memory only through the transport's ``location`` and is refused
(DescriptorError and subclasses) before any memory is mapped when it is forged, of an
unknown version, out of limits, inconsistent with its layout, or expired. Replays are caught
by the importer's consumed-lease set and by the exporter's block tags (see ``transport``).
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from disagg.kv.envelope import open_sealed, seal
from disagg.kv.errors import DescriptorError, LeaseExpired
from disagg.kv.layout import KVLayout, LayoutError
from disagg.kv.runs import Run, check_block_ids, from_runs, to_runs

VERSION = 1
PURPOSE = "disagg.kv.descriptor"
ACK_PURPOSE = "disagg.kv.ack"
RENEW_PURPOSE = "disagg.kv.renew"
CHECKSUM_ALGS = ("blake2b-128",)
_LEASE_RE = re.compile(r"^[0-9a-f]{32}$")
_NAME_RE = re.compile(r"^[A-Za-z0-9_.-]{1,128}$")
_FIELDS = {
    "version",
    "transport",
    "origin",
    "location",
    "layout",
    "byte_size",
    "pool_blocks",
    "blocks",
    "lease_id",
    "issued_at",
    "expires_at",
    "checksum",
}


@dataclass(frozen=True)
class DescriptorLimits:
    """Bounds a descriptor must respect; checked before any memory is touched."""

    max_blocks: int = 1 << 16
    max_bytes: int = 1 << 40
    max_token_bytes: int = 1 << 18
    max_ttl_s: float = 3600.0
    clock_skew_s: float = 5.0

    def __post_init__(self) -> None:
        for name in ("max_blocks", "max_bytes", "max_token_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"DescriptorLimits.{name} must be a positive integer")
        for name in ("max_ttl_s", "clock_skew_s"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or isinstance(value, bool) or not 0 <= value < 1e7:
                raise ValueError(f"DescriptorLimits.{name} must be a non-negative number")


def new_lease_id() -> str:
    return secrets.token_hex(16)


def lease_tag(lease_id: str) -> int:
    """A non-zero 62-bit value written into the exporter's block tags while the lease lives."""
    return (int(lease_id[:16], 16) & ((1 << 62) - 1)) | 1


@dataclass(frozen=True)
class Descriptor:
    """One exported sequence of KV blocks. ``layout.num_tokens`` says how many positions are valid."""

    transport: str
    origin: str
    location: dict[str, Any]
    layout: KVLayout
    pool_blocks: int
    block_ids: tuple[int, ...]
    lease_id: str
    issued_at: float
    expires_at: float
    checksum: dict[str, str] | None = None
    version: int = VERSION
    _runs: tuple[Run, ...] = field(default=(), compare=False, repr=False)

    @property
    def byte_size(self) -> int:
        return self.layout.byte_size

    @property
    def tag(self) -> int:
        return lease_tag(self.lease_id)

    def runs(self) -> list[Run]:
        return list(self._runs) if self._runs else to_runs(self.block_ids)

    def to_body(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "transport": self.transport,
            "origin": self.origin,
            "location": self.location,
            "layout": self.layout.to_dict(),
            "byte_size": self.byte_size,
            "pool_blocks": self.pool_blocks,
            "blocks": [list(r) for r in self.runs()],
            "lease_id": self.lease_id,
            "issued_at": self.issued_at,
            "expires_at": self.expires_at,
            "checksum": self.checksum,
        }

    def sign(self, secret: bytes) -> bytes:
        return seal(self.to_body(), secret, PURPOSE)


def _num(value: Any, what: str) -> float:
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise DescriptorError(f"descriptor {what} must be a number")
    return float(value)


def _int(value: Any, what: str, lo: int, hi: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
        raise DescriptorError(f"descriptor {what} is not an integer in range")
    return value


def check_live(
    lease_id: str, expires_at: float, now: float, renewed: Mapping[str, float] | None = None
) -> None:
    """Raise LeaseExpired when the lease has ended at ``now`` (wall clock), counting the later
    expiry its importer asked for (``renewed``: lease id -> until)."""
    if now >= max(expires_at, (renewed or {}).get(lease_id, expires_at)):
        raise LeaseExpired("descriptor lease has expired")


def parse_descriptor(
    token: bytes | str,
    secret: bytes,
    limits: DescriptorLimits,
    now: float,
    transport: str | None = None,
    renewed: Mapping[str, float] | None = None,
) -> Descriptor:
    """Verify and decode a signed descriptor. Pure: maps no memory, opens no file or socket.

    Order: size, signature, version, field set, types and limits, layout consistency,
    transport, expiry. ``now`` is wall-clock seconds (descriptors cross hosts). ``renewed`` maps
    a lease id to the later expiry its importer asked the exporter for (``Transport.renew``).
    """
    body = open_sealed(token, secret, PURPOSE, limits.max_token_bytes)
    if body.get("version") != VERSION:
        raise DescriptorError("descriptor version is not supported")
    if set(body) != _FIELDS:
        raise DescriptorError("descriptor has unknown or missing fields")
    if not isinstance(body["transport"], str) or not _NAME_RE.match(body["transport"]):
        raise DescriptorError("descriptor transport is invalid")
    if transport is not None and body["transport"] != transport:
        raise DescriptorError("descriptor is for another transport")
    if not isinstance(body["origin"], str) or not _NAME_RE.match(body["origin"]):
        raise DescriptorError("descriptor origin is invalid")
    if not isinstance(body["location"], dict):
        raise DescriptorError("descriptor location must be an object")
    if not isinstance(body["lease_id"], str) or not _LEASE_RE.match(body["lease_id"]):
        raise DescriptorError("descriptor lease id is invalid")
    try:
        layout = KVLayout.from_dict(body["layout"])
    except (LayoutError, TypeError):
        raise DescriptorError("descriptor layout is invalid") from None
    pool_blocks = _int(body["pool_blocks"], "pool size", 1, 1 << 40)
    runs_raw = body["blocks"]
    if not isinstance(runs_raw, list) or not 0 < len(runs_raw) <= limits.max_blocks:
        raise DescriptorError("descriptor block list is empty or too long")
    runs: list[Run] = []
    total = 0
    for run in runs_raw:
        if not isinstance(run, list) or len(run) != 2:
            raise DescriptorError("descriptor block run is malformed")
        start = _int(run[0], "block id", 0, pool_blocks - 1)
        count = _int(run[1], "block count", 1, limits.max_blocks)
        total += count
        if total > limits.max_blocks or start + count > pool_blocks:
            raise DescriptorError("descriptor names too many blocks or blocks outside the pool")
        runs.append((start, count))
    if total != layout.num_blocks or layout.num_tokens == 0:
        raise DescriptorError("descriptor block count does not match its layout")
    byte_size = _int(body["byte_size"], "byte size", 1, limits.max_bytes)
    if byte_size != layout.byte_size:
        raise DescriptorError("descriptor byte size does not match its layout")
    try:
        block_ids = check_block_ids(from_runs(runs), pool_blocks)
    except ValueError:
        raise DescriptorError("descriptor names a block twice") from None
    checksum = body["checksum"]
    if checksum is not None and (
        not isinstance(checksum, dict)
        or set(checksum) != {"alg", "hex"}
        or checksum["alg"] not in CHECKSUM_ALGS
        or not isinstance(checksum["hex"], str)
        or not re.fullmatch(r"[0-9a-f]{32}", checksum["hex"])
    ):
        raise DescriptorError("descriptor checksum is malformed")
    issued = _num(body["issued_at"], "issue time")
    expires = _num(body["expires_at"], "expiry")
    if expires <= issued or expires - issued > limits.max_ttl_s or issued > now + limits.clock_skew_s:
        raise DescriptorError("descriptor lifetime is out of range")
    check_live(body["lease_id"], expires, now, renewed)
    return Descriptor(
        transport=body["transport"],
        origin=body["origin"],
        location=body["location"],
        layout=layout,
        pool_blocks=pool_blocks,
        block_ids=tuple(block_ids),
        lease_id=body["lease_id"],
        issued_at=issued,
        expires_at=expires,
        checksum=checksum,
        _runs=tuple(runs),
    )


def sign_ack(lease_id: str, origin: str, secret: bytes) -> bytes:
    """The importer's "done reading" message for the exporter ``origin``."""
    return seal({"version": VERSION, "lease_id": lease_id, "origin": origin}, secret, ACK_PURPOSE)


def parse_ack(token: bytes | str, secret: bytes) -> tuple[str, str]:
    """Return ``(lease_id, origin)`` of a signed ack; DescriptorError when it is not one."""
    body = open_sealed(token, secret, ACK_PURPOSE, 4096)
    if body.get("version") != VERSION or set(body) != {"version", "lease_id", "origin"}:
        raise DescriptorError("ack has an unknown version or fields")
    lease_id, origin = body["lease_id"], body["origin"]
    if not isinstance(lease_id, str) or not _LEASE_RE.match(lease_id):
        raise DescriptorError("ack lease id is invalid")
    if not isinstance(origin, str) or not _NAME_RE.match(origin):
        raise DescriptorError("ack origin is invalid")
    return lease_id, origin


def sign_renewal(lease_id: str, origin: str, seq: int, secret: bytes) -> bytes:
    """The importer's "still waiting for my blocks, keep yours" message, the ``seq``-th for this lease."""
    return seal(
        {"version": VERSION, "lease_id": lease_id, "origin": origin, "seq": seq}, secret, RENEW_PURPOSE
    )


def parse_signal(token: bytes | str, secret: bytes) -> tuple[str, str, str]:
    """Return ``(purpose, lease_id, origin)`` of a signed ack or renewal (the messages an importer
    sends its exporter); DescriptorError when it is neither."""
    try:
        return (ACK_PURPOSE, *parse_ack(token, secret))
    except DescriptorError:
        pass
    body = open_sealed(token, secret, RENEW_PURPOSE, 4096)
    if body.get("version") != VERSION or set(body) != {"version", "lease_id", "origin", "seq"}:
        raise DescriptorError("renewal has an unknown version or fields")
    lease_id, origin, seq = body["lease_id"], body["origin"], body["seq"]
    if not isinstance(lease_id, str) or not _LEASE_RE.match(lease_id):
        raise DescriptorError("renewal lease id is invalid")
    if not isinstance(origin, str) or not _NAME_RE.match(origin):
        raise DescriptorError("renewal origin is invalid")
    if not isinstance(seq, int) or isinstance(seq, bool) or seq < 1:
        raise DescriptorError("renewal sequence number is invalid")
    return RENEW_PURPOSE, lease_id, origin
