"""Staging blocks for exporters whose pool is plain memory (not allocated by the transport).

Exporting then costs a gather copy into these blocks, so a hand-off is two copies instead
of one; the staging blocks are held by the lease and returned when it is released.
"""

from __future__ import annotations

import threading

from disagg.kv.errors import TransferError
from disagg.kv.region import Region


class Staging:
    def __init__(self, region: Region) -> None:
        self.region = region
        self._lock = threading.Lock()
        self._free = list(range(region.num_blocks - 1, -1, -1))

    def take(self, count: int) -> list[int]:
        with self._lock:
            if count > len(self._free):
                raise TransferError("KV staging area is full")
            taken = [self._free.pop() for _ in range(count)]
        return sorted(taken)

    def give(self, block_ids: list[int] | tuple[int, ...]) -> None:
        with self._lock:
            self._free.extend(block_ids)

    def free_count(self) -> int:
        with self._lock:
            return len(self._free)
