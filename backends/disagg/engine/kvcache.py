"""The KV cache of one engine: fixed-size blocks, their allocation, usage counters.

The cache memory is one ``[num_blocks, block_bytes]`` uint8 tensor, viewed as
``[num_blocks, layers, 2, block_size, kv_heads, head_dim]`` of the cache dtype (see
``disagg.kv.layout``). It may be supplied from outside (shared or transport-registered memory), so
a hand-off can copy whole blocks straight out of it.
"""

from __future__ import annotations

import threading

import torch

from disagg.engine.errors import OutOfBlocks
from disagg.kv.layout import KVLayout

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class KVCache:
    """Allocates and frees blocks of one engine's KV cache. Thread-safe."""

    def __init__(self, layout: KVLayout, num_blocks: int, memory: torch.Tensor | None = None) -> None:
        if num_blocks < 1:
            raise ValueError("a block pool needs at least one block")
        self.layout = layout.with_tokens(0)
        self.num_blocks = num_blocks
        if memory is None:
            memory = torch.zeros(num_blocks, layout.block_bytes, dtype=torch.uint8)
        elif memory.dtype != torch.uint8 or memory.numel() < num_blocks * layout.block_bytes:
            raise ValueError("supplied KV memory must be uint8 with at least num_blocks * block_bytes bytes")
        else:
            memory = memory.reshape(-1)[: num_blocks * layout.block_bytes].view(num_blocks, -1)
            memory.zero_()  # masked attention still multiplies by stale values: no NaN garbage
        self.memory = memory  # [NB, block_bytes] uint8
        # [NB, layers, 2, bs, kvh, hd] typed view of the same bytes
        self.cache = memory.view(TORCH_DTYPES[layout.dtype]).view(num_blocks, *layout.block_shape())
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._used: set[int] = set()
        self._lock = threading.Lock()
        self.allocations = 0
        self.frees = 0

    @property
    def free_blocks(self) -> int:
        with self._lock:
            return len(self._free)

    @property
    def used_blocks(self) -> int:
        return self.num_blocks - self.free_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.layout.block_size)

    def allocate(self, count: int) -> list[int]:
        """Take ``count`` blocks or none at all; raises OutOfBlocks when too few are free."""
        with self._lock:
            if count > len(self._free):
                raise OutOfBlocks(count, len(self._free))
            taken = [self._free.pop() for _ in range(count)]
            self._used.update(taken)
            self.allocations += count
            return taken

    def free(self, blocks: list[int]) -> None:
        with self._lock:
            if not self._used.issuperset(blocks) or len(set(blocks)) != len(blocks):
                raise RuntimeError("block pool misuse: freeing a block that is not allocated")
            self._used.difference_update(blocks)
            self._free.extend(reversed(blocks))
            self.frees += len(blocks)
