"""The block ledger: how many KV blocks each admitted request holds, against the pool's total."""

from __future__ import annotations


class BlockLedger:
    """Reservations of KV blocks by request handle. Mirrors the engine's pool exactly: a request
    reserves what the engine allocates for it and releases when the engine gives the blocks back."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError("a block ledger needs at least one block")
        self.num_blocks = num_blocks
        self._held: dict[str, int] = {}
        self._reserved = 0

    @property
    def reserved(self) -> int:
        return self._reserved

    @property
    def free(self) -> int:
        return self.num_blocks - self._reserved

    def fits(self, count: int) -> bool:
        return count <= self.free

    def holds(self, handle: str) -> bool:
        return handle in self._held

    def reserve(self, handle: str, count: int) -> None:
        if handle in self._held:
            raise RuntimeError(f"request {handle!r} already holds blocks")
        if not self.fits(count):
            raise RuntimeError(f"reserving {count} blocks with {self.free} free")
        self._held[handle] = count
        self._reserved += count

    def release(self, handle: str) -> int:
        """Give back what ``handle`` holds (0 if nothing: idempotent)."""
        count = self._held.pop(handle, 0)
        self._reserved -= count
        return count
