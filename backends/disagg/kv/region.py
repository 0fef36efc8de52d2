"""A block pool owned by a transport: the pool itself plus its per-block tag words.

Memory per region (uint8 pool, int64 words):

    pool  [num_blocks, block_bytes]  the KV blocks; the engine views it as its typed block shape
    tags  [num_blocks]               lease tag of the live lease holding the block, 0 when free
    acks  [num_blocks]               the importer writes a lease's tag at its first block when done

Tags make a late read safe (RELIABILITY.md B2): an importer copies only while every source
block carries its lease's tag, and re-checks after the copy, so a block freed and reused
meanwhile is detected instead of returning another sequence's KV.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class Region:
    key: str
    pool: torch.Tensor  # [num_blocks, block_bytes] uint8
    tags: torch.Tensor  # [num_blocks] int64
    acks: torch.Tensor | None  # [num_blocks] int64, for transports whose importer acks through memory
    extra: dict[str, Any] = field(default_factory=dict)
    closer: Callable[[], None] | None = None

    @property
    def num_blocks(self) -> int:
        return int(self.pool.shape[0])

    @property
    def block_bytes(self) -> int:
        return int(self.pool.shape[1])

    def close(self) -> None:
        if self.closer is not None:
            closer, self.closer = self.closer, None
            closer()


def as_block_bytes(pool: torch.Tensor) -> torch.Tensor:
    """View a contiguous pool of any dtype and block shape as ``[num_blocks, block_bytes]`` uint8."""
    if not isinstance(pool, torch.Tensor) or pool.dim() < 1:
        raise ValueError("pool must be a tensor with a leading block dimension")
    if not pool.is_contiguous():
        raise ValueError("pool must be contiguous")
    n = int(pool.shape[0])
    if n == 0:
        raise ValueError("pool has no blocks")
    return pool.view(-1).view(torch.uint8).view(n, -1)


def runs_hold_tag(tags: torch.Tensor, runs: list[tuple[int, int]], tag: int) -> bool:
    """True when every block of ``runs`` carries ``tag``."""
    return all(bool((tags[s : s + c] == tag).all()) for s, c in runs)
