"""Renewals: the KV leases behind imports that wait for decode blocks, and which to renew now.

A prefilled sequence's KV stays in the prefill pool under a lease until the decode pool copies it.
When the decode pool's blocks are all in use, an import waits in its queue, and its lease would
expire meanwhile (RELIABILITY E2). The decode loop asks this table, each iteration, which waiting
imports have less than ``fraction`` of their lease's lifetime left, and renews those through the
transport (``Transport.renew``). Pure bookkeeping: the caller owns the clock and the transport.
"""

from __future__ import annotations

from dataclasses import dataclass

from disagg.kv.descriptor import Descriptor


@dataclass
class _Watched:
    descriptor: Descriptor
    expires_at: float
    lifetime_s: float


class Renewals:
    def __init__(self, fraction: float = 0.5) -> None:
        if not 0 < fraction < 1:
            raise ValueError("Renewals.fraction must be in (0, 1)")
        self.fraction = fraction
        self._watched: dict[str, _Watched] = {}

    def __len__(self) -> int:
        return len(self._watched)

    def watch(self, handle: str, descriptor: Descriptor) -> None:
        """An import is queued with its verified descriptor (its lease's issue and expiry)."""
        lifetime = max(descriptor.expires_at - descriptor.issued_at, 0.0)
        self._watched[handle] = _Watched(descriptor, descriptor.expires_at, lifetime)

    def forget(self, handle: str) -> None:
        """The import left the queue (admitted, refused, stopped, cancelled). Idempotent."""
        self._watched.pop(handle, None)

    def clear(self) -> None:
        self._watched.clear()

    def due(self, now: float) -> list[tuple[str, Descriptor]]:
        """``(handle, descriptor)`` of every watched import whose lease has less than ``fraction`` of
        its lifetime left at ``now``."""
        return [
            (handle, w.descriptor)
            for handle, w in self._watched.items()
            if w.expires_at - now < self.fraction * w.lifetime_s
        ]

    def renewed(self, handle: str, expires_at: float) -> None:
        """The lease now lasts until ``expires_at`` (what ``Transport.renew`` returned)."""
        watched = self._watched.get(handle)
        if watched is not None:
            watched.expires_at = expires_at
