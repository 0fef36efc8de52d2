"""Exporter-side leases: exported blocks stay held until acked, aborted, or expired.

A lease is released exactly once, whatever arrives first (ack, abort, expiry, close);
later or duplicate releases return False and do nothing, so stale acks are harmless
(RELIABILITY.md B4). Expiry is driven by ``expire(now)``: the caller owns the clock, so
tests drive it instead of sleeping, and a reaper thread can call it in production.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)

ReleaseCallback = Callable[[str, str], None]
REASONS = ("ack", "abort", "expired", "closed", "failed")


@dataclass(frozen=True)
class LeaseConfig:
    """``ttl_s``: how long an unacked export stays held; ``max_leases``: live leases at most."""

    ttl_s: float = 30.0
    max_leases: int = 4096

    def __post_init__(self) -> None:
        """Ranges; the types are ``config.build``'s (through ``TransportConfig``; a config built by hand
        in code is trusted to be typed)."""
        if not 0 < self.ttl_s <= 3600:
            raise ValueError("LeaseConfig.ttl_s must be in (0, 3600]")
        if self.max_leases < 1:
            raise ValueError("LeaseConfig.max_leases must be positive")


@dataclass
class Lease:
    lease_id: str
    region: Hashable
    block_ids: tuple[int, ...]
    expires_at: float
    nbytes: int
    context: Any = field(default=None, repr=False)
    granted_at: float = 0.0


class LeaseTable:
    """Thread-safe table of live leases.

    ``on_release(lease, reason)`` runs first (the transport's own cleanup: clear block tags,
    free staging blocks); then ``on_release_user(lease_id, reason)`` (the engine frees its
    blocks). Both run outside the lock, once per lease.
    """

    def __init__(
        self,
        config: LeaseConfig,
        on_release: Callable[[Lease, str], None] | None = None,
        on_release_user: ReleaseCallback | None = None,
    ) -> None:
        self.config = config
        self._on_release = on_release
        self._on_release_user = on_release_user
        self._lock = threading.Lock()
        self._leases: dict[str, Lease] = {}
        self._held_blocks: dict[tuple[Hashable, int], str] = {}

    def grant(
        self,
        lease_id: str,
        region: Hashable,
        block_ids: tuple[int, ...],
        now: float,
        nbytes: int,
        context: Any = None,
    ) -> Lease:
        """Hold ``block_ids`` of ``region`` under a new lease. A block is in one live lease at most."""
        lease = Lease(lease_id, region, block_ids, now + self.config.ttl_s, nbytes, context, now)
        with self._lock:
            if len(self._leases) >= self.config.max_leases:
                raise RuntimeError("too many live KV leases")
            if lease_id in self._leases:
                raise RuntimeError("lease id collision")
            if any((region, b) in self._held_blocks for b in block_ids):
                raise ValueError("a block is already exported under a live lease")
            self._leases[lease_id] = lease
            for b in block_ids:
                self._held_blocks[(region, b)] = lease_id
        return lease

    def get(self, lease_id: str) -> Lease | None:
        with self._lock:
            return self._leases.get(lease_id)

    def held(self) -> int:
        with self._lock:
            return len(self._leases)

    def live_ids(self) -> list[str]:
        with self._lock:
            return list(self._leases)

    def release(self, lease_id: str, reason: str) -> bool:
        """Release once; True if this call released it, False if it was already gone (idempotent)."""
        if reason not in REASONS:
            raise ValueError(f"unknown release reason {reason!r}")
        with self._lock:
            lease = self._leases.pop(lease_id, None)
            if lease is None:
                return False
            for b in lease.block_ids:
                self._held_blocks.pop((lease.region, b), None)
        self._notify(lease, reason)
        return True

    def extend(self, lease_id: str, until: float, max_life_s: float) -> bool:
        """Keep a live lease until ``until`` at least (its importer still waits for blocks to copy
        into), never past ``max_life_s`` after its grant. True when its expiry moved."""
        with self._lock:
            lease = self._leases.get(lease_id)
            if lease is None:
                return False
            target = min(until, lease.granted_at + max_life_s)
            if target <= lease.expires_at:
                return False
            lease.expires_at = target
            return True

    def expire(self, now: float) -> list[str]:
        """Release every lease whose expiry is at or before ``now``; return their ids."""
        with self._lock:
            due = [lid for lid, lease in self._leases.items() if lease.expires_at <= now]
        return [lid for lid in due if self.release(lid, "expired")]

    def release_all(self, reason: str = "closed") -> int:
        return sum(self.release(lid, reason) for lid in self.live_ids())

    def _notify(self, lease: Lease, reason: str) -> None:
        # A failing callback must not leave other leases unreleased or kill the reaper.
        for cb, args in (
            (self._on_release, (lease, reason)),
            (self._on_release_user, (lease.lease_id, reason)),
        ):
            if cb is None:
                continue
            try:
                cb(*args)
            except Exception:
                log.exception("KV lease release callback failed")
