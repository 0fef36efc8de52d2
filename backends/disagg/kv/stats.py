"""Thread-safe counters of one transport, read by the metrics layer."""

from __future__ import annotations

import threading
from dataclasses import asdict, dataclass


@dataclass
class StatsSnapshot:
    exported: int = 0
    imported: int = 0
    bytes_exported: int = 0
    bytes_imported: int = 0
    transfer_seconds: float = 0.0
    failures: int = 0  # imports that failed, checksum mismatches included
    checksum_failures: int = 0  # of those, the checksum mismatches
    refused: int = 0
    acks: int = 0
    stale_acks: int = 0
    aborts: int = 0
    lease_expiries: int = 0
    lease_renewals: int = 0  # exporter: leases extended because their importer was still waiting
    renewals_sent: int = 0  # importer: renewals asked for

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


class TransferStats:
    """Counters behind one lock; ``add`` is the only writer."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values = StatsSnapshot()

    def add(self, **deltas: float) -> None:
        with self._lock:
            for name, delta in deltas.items():
                if not hasattr(self._values, name):
                    raise AttributeError(f"unknown counter {name!r}")
                setattr(self._values, name, getattr(self._values, name) + delta)

    def snapshot(self) -> StatsSnapshot:
        with self._lock:
            return StatsSnapshot(**asdict(self._values))
