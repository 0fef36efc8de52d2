"""The KV cache of one engine: fixed-size blocks, their reference counts, and the prefix cache.

The cache memory is one ``[num_blocks, block_bytes]`` uint8 tensor, viewed as
``[num_blocks, layers, 2, block_size, kv_heads, head_dim]`` of the cache dtype (see
``disagg.kv.layout``). It may be supplied from outside (shared or transport-registered memory), so
a hand-off can copy whole blocks straight out of it.

Every block is in exactly one of three states:

- **used**: held by one or more sequences (its reference count);
- **cached**: held by none, but it holds the KV of a full prompt block published under its prefix
  key (``disagg.engine.prefix``), so a later prompt with that prefix takes it instead of
  recomputing it. Cached blocks are evicted least recently used first, when an allocation finds no
  free block;
- **free**: neither.

So ``used + cached + free == num_blocks`` always, and with nothing running, ``used == 0``. A shared
block is never written again: only full prompt blocks are published, and a sequence that takes
cached blocks starts computing at the first block boundary after them, in blocks of its own.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch

from disagg.engine.errors import OutOfBlocks
from disagg.kv.layout import KVLayout

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class PrefixCounters:
    """The prefix cache's counters so far, in blocks."""

    hits: int = 0  # full prompt blocks found cached
    misses: int = 0  # full prompt blocks looked up and not found (computed)
    evictions: int = 0  # cached blocks dropped to make room


class KVCache:
    """Allocates, shares and frees blocks of one engine's KV cache. Thread-safe.

    With ``prefix_cache`` off, ``publish`` keeps nothing, so freed blocks go straight back to free.
    """

    def __init__(
        self,
        layout: KVLayout,
        num_blocks: int,
        memory: torch.Tensor | None = None,
        *,
        prefix_cache: bool = False,
    ) -> None:
        if num_blocks < 1:
            raise ValueError("a block pool needs at least one block")
        self.layout = layout.with_tokens(0)
        self.num_blocks = num_blocks
        self.prefix_cache = prefix_cache
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
        self._refs: dict[int, int] = {}  # used blocks -> sequences holding them
        self._key_of: dict[int, bytes] = {}  # published blocks (used or cached) -> prefix key
        self._block_of: dict[bytes, int] = {}  # prefix key -> its block
        self._lru: OrderedDict[int, None] = OrderedDict()  # cached blocks, least recently used first
        self._lock = threading.Lock()
        self.allocations = 0
        self.frees = 0
        self._hits = self._misses = self._evictions = 0

    # ------------------------------------------------------------- counts

    @property
    def free_blocks(self) -> int:
        """Blocks that hold nothing."""
        with self._lock:
            return len(self._free)

    @property
    def cached_blocks(self) -> int:
        """Blocks held by no sequence that keep a published prefix (evictable)."""
        with self._lock:
            return len(self._lru)

    @property
    def available_blocks(self) -> int:
        """Blocks an allocation may take now: the free ones and the cached ones."""
        with self._lock:
            return len(self._free) + len(self._lru)

    @property
    def used_blocks(self) -> int:
        """Blocks held by at least one sequence."""
        with self._lock:
            return len(self._refs)

    def counters(self) -> PrefixCounters:
        with self._lock:
            return PrefixCounters(self._hits, self._misses, self._evictions)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.layout.block_size)

    # ------------------------------------------------------------- allocation

    def allocate(self, count: int) -> list[int]:
        """Take ``count`` blocks or none at all: free ones first, then cached ones, least recently used
        first (their prefixes are forgotten). Raises OutOfBlocks when too few are available."""
        with self._lock:
            return self._take(count)

    def _take(self, count: int) -> list[int]:
        """``allocate``'s work, under the lock its callers hold."""
        available = len(self._free) + len(self._lru)
        if count > available:
            raise OutOfBlocks(count, available)
        taken = []
        for _ in range(count):
            if self._free:
                block = self._free.pop()
            else:
                block, _ = self._lru.popitem(last=False)
                del self._block_of[self._key_of.pop(block)]
                self._evictions += 1
            self._refs[block] = 1
            taken.append(block)
        self.allocations += count
        return taken

    def match(self, keys: list[bytes]) -> list[int]:
        """Take the cached blocks of the longest run of ``keys`` from the first (each block gains a
        reference; a cached one becomes used). Counts each key found as a hit and the rest as misses."""
        with self._lock:
            taken = []
            for key in keys:
                block = self._block_of.get(key)
                if block is None:
                    break
                if block in self._lru:
                    del self._lru[block]
                    self._refs[block] = 1
                else:
                    self._refs[block] += 1
                taken.append(block)
            self._hits += len(taken)
            self._misses += len(keys) - len(taken)
            return taken

    def publish(self, block: int, key: bytes) -> bool:
        """Keep a used block's KV under ``key`` once nothing holds it; it must hold every token of that
        prefix's last block, written and never to be written again. False (nothing kept) when the
        prefix cache is off, or ``key`` or the block is already published (two prompts computed the
        same block at once: the second stays private and is freed as usual)."""
        with self._lock:
            if block not in self._refs:
                raise RuntimeError("block pool misuse: publishing a block that is not allocated")
            if not self.prefix_cache or key in self._block_of or block in self._key_of:
                return False
            self._block_of[key] = block
            self._key_of[block] = key
            return True

    def privatize(self, blocks: list[int]) -> list[int]:
        """``blocks`` of one holder, each one another holder shares replaced by a private copy (the
        holder's reference moves to the copy): what a hand-off exports, since a block is in one live
        lease at most. Raises OutOfBlocks (nothing changed) when too few blocks are available."""
        with self._lock:
            if any(b not in self._refs for b in blocks):
                raise RuntimeError("block pool misuse: privatizing a block that is not allocated")
            shared = [i for i, b in enumerate(blocks) if self._refs[b] > 1]
            if not shared:
                return list(blocks)
            out = list(blocks)
            for i, copy in zip(shared, self._take(len(shared)), strict=True):
                self.memory[copy] = self.memory[blocks[i]]
                self._refs[blocks[i]] -= 1  # still > 0: the other holders keep it
                out[i] = copy
            self.frees += len(shared)
            return out

    def free(self, blocks: list[int]) -> None:
        """Drop one reference to each block: one no sequence holds any more becomes cached if it is
        published (most recently used), else free."""
        with self._lock:
            if len(set(blocks)) != len(blocks) or any(b not in self._refs for b in blocks):
                raise RuntimeError("block pool misuse: freeing a block that is not allocated")
            for block in reversed(blocks):
                refs = self._refs[block] - 1
                if refs:
                    self._refs[block] = refs
                    continue
                del self._refs[block]
                if block in self._key_of:
                    self._lru[block] = None
                else:
                    self._free.append(block)
            self.frees += len(blocks)
