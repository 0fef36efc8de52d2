"""The bookkeeping of captured decode steps: batch buckets, padding, and the static input buffers.

A captured step (a CUDA graph, ``disagg.engine.replay``) replays fixed kernels on fixed memory, so each
batch size it serves needs a graph of its own. Batches are rounded up to a *bucket* (1, 2, 4, ... by
default): a step of ``n`` sequences replays the graph of the smallest bucket ``>= n``, its rows
``n..bucket`` padding. A batch larger than every bucket runs eagerly.

Padding rows are masked out, not computed on real data:

- their block table points at one *scratch* block that no sequence holds, so the KV they write lands
  there and never in a real sequence's blocks;
- their sequence length is 1 (one position to attend to, so their softmax has no empty row);
- they sample greedily, and their ids are dropped (``unpad``).

The step's inputs live in ``StaticBuffers``: one int64 matrix ``[R, 5 + MB]`` holding, per row, the
token, its position, the sequence length (position + 1), top-k, the draw's key
(``disagg.engine.sampling.row_key``) and the block table, and one float32 matrix ``[R, 2]`` holding
temperature and top-p, ``R`` the largest bucket and ``MB`` the most blocks a sequence can hold. A
bucket's graph reads the first ``bucket`` rows (views, so their addresses never move); a step's inputs
go in through a host staging copy of each matrix, one copy each per step. The sampling parameters and
keys are what the captured step samples by, inside the graph (``disagg.engine.sampling.draw``).

Pure bookkeeping: torch tensors only, no CUDA call, so all of it is tested on CPU.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)

# column layout of StaticBuffers.ints and .floats
TOKEN, POSITION, SEQ_LEN, TOP_K, KEY, TABLE = 0, 1, 2, 3, 4, 5
TEMPERATURE, TOP_P = 0, 1


@dataclass(frozen=True)
class GraphConfig:
    """What a set of captured decode steps is sized by; validated at construction.

    ``buckets``: the batch sizes to capture, strictly increasing; those above ``max_batch_size`` are
    dropped and ``max_batch_size`` itself is added when it falls between two (``sizes``), so every
    batch the engine admits has a bucket. ``max_blocks``: the block table's width (the most blocks a
    sequence holds); ``block_size``: tokens per block; ``scratch_block``: the KV block padding rows
    write to (one that no sequence holds)."""

    max_batch_size: int
    max_blocks: int
    block_size: int
    scratch_block: int
    buckets: tuple[int, ...] = DEFAULT_BUCKETS

    def __post_init__(self) -> None:
        for name in ("max_batch_size", "max_blocks", "block_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        block = self.scratch_block
        if not isinstance(block, int) or isinstance(block, bool) or block < 0:
            raise ValueError(f"scratch_block must be a block id >= 0, got {self.scratch_block!r}")
        buckets = tuple(self.buckets)
        if not buckets:
            raise ValueError("buckets must name at least one batch size")
        if any(not isinstance(b, int) or isinstance(b, bool) or b < 1 for b in buckets):
            raise ValueError(f"buckets must be positive integers, got {buckets!r}")
        if any(a >= b for a, b in itertools.pairwise(buckets)):
            raise ValueError(f"buckets must be strictly increasing, got {buckets!r}")
        object.__setattr__(self, "buckets", buckets)

    @property
    def sizes(self) -> tuple[int, ...]:
        """The buckets captured: ``buckets`` capped at ``max_batch_size``, which is itself one when
        some bucket lies above it (16, 32, 64 and a batch limit of 48 give 16, 32, 48)."""
        below = tuple(b for b in self.buckets if b < self.max_batch_size)
        if len(below) < len(self.buckets):  # a bucket reaches the batch limit: the limit is one
            return (*below, self.max_batch_size)
        return below

    @property
    def rows(self) -> int:
        """Rows of the static buffers: the largest bucket."""
        return self.sizes[-1]

    def bucket_for(self, rows: int) -> int | None:
        """The smallest bucket holding ``rows`` sequences; None when none does (run eagerly)."""
        if not isinstance(rows, int) or isinstance(rows, bool) or rows < 1:
            raise ValueError(f"rows must be a positive integer, got {rows!r}")
        return next((b for b in self.sizes if b >= rows), None)


@dataclass(frozen=True)
class StepInputs:
    """One decode step's rows, on the host: ``tokens``, ``positions`` (of the token, so it attends to
    positions 0..position), ``top_k`` and ``keys`` (each row's draw, ``sampling.row_key``) int64 [n];
    ``block_table`` int64 [n, w], ``w`` at most the config's ``max_blocks``, each row's blocks in order;
    ``temperature`` and ``top_p`` float32 [n]."""

    tokens: torch.Tensor
    positions: torch.Tensor
    block_table: torch.Tensor
    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    keys: torch.Tensor

    @property
    def rows(self) -> int:
        return int(self.tokens.shape[0])

    def check(self, config: GraphConfig) -> None:
        """Raise ValueError naming the first field that does not fit ``config``."""
        n = self.rows
        if self.tokens.dim() != 1 or n < 1:
            raise ValueError(f"tokens must be a non-empty [n] tensor, got shape {tuple(self.tokens.shape)}")
        for name in ("positions", "temperature", "top_k", "top_p", "keys"):
            shape = tuple(getattr(self, name).shape)
            if shape != (n,):
                raise ValueError(f"{name} must have shape ({n},), got {shape}")
        table = tuple(self.block_table.shape)
        if len(table) != 2 or table[0] != n or not 1 <= table[1] <= config.max_blocks:
            raise ValueError(f"block_table must have shape ({n}, 1..{config.max_blocks}), got {table}")
        if int(self.positions.min()) < 0 or int(self.positions.max()) >= table[1] * config.block_size:
            raise ValueError("positions must lie in the blocks of block_table")


@dataclass(frozen=True)
class BucketView:
    """The first ``size`` rows of the static buffers, as a captured step reads them."""

    size: int
    tokens: torch.Tensor  # [b] int64
    positions: torch.Tensor  # [b] int64
    seq_lens: torch.Tensor  # [b] int64: positions + 1
    top_k: torch.Tensor  # [b] int64
    keys: torch.Tensor  # [b] int64: each row's draw (sampling.row_key)
    block_table: torch.Tensor  # [b, MB] int64 (a strided view)
    temperature: torch.Tensor  # [b] float32
    top_p: torch.Tensor  # [b] float32


class StaticBuffers:
    """The device memory a captured step reads its inputs from, and its host staging copy.

    Starts with every row padding, so a capture reads valid block ids. Not thread-safe: the engine
    loop alone loads it. ``load`` copies asynchronously from pinned memory on CUDA; the staging rows
    are rewritten by the next ``load`` only, after the caller has read the previous step's sampled ids
    (a synchronising copy), so a copy in flight never sees them change."""

    def __init__(self, config: GraphConfig, device: torch.device | str = "cpu") -> None:
        self.config = config
        self.device = torch.device(device)
        rows, width = config.rows, TABLE + config.max_blocks
        pin = self.device.type == "cuda"
        self._host_ints = torch.zeros(rows, width, dtype=torch.int64, pin_memory=pin)
        self._host_floats = torch.zeros(rows, 2, dtype=torch.float32, pin_memory=pin)
        self.ints = torch.zeros(rows, width, dtype=torch.int64, device=self.device)  # [R, 5 + MB]
        self.floats = torch.zeros(rows, 2, dtype=torch.float32, device=self.device)  # [R, 2]
        self._pad(0, rows)
        self.ints.copy_(self._host_ints)
        self.floats.copy_(self._host_floats)

    def view(self, size: int) -> BucketView:
        """The rows a graph captured for bucket ``size`` reads."""
        if size not in self.config.sizes:
            raise ValueError(f"size must be one of the buckets {self.config.sizes}, got {size!r}")
        ints, floats = self.ints[:size], self.floats[:size]
        return BucketView(
            size,
            ints[:, TOKEN],
            ints[:, POSITION],
            ints[:, SEQ_LEN],
            ints[:, TOP_K],
            ints[:, KEY],
            ints[:, TABLE:],
            floats[:, TEMPERATURE],
            floats[:, TOP_P],
        )

    def load(self, inputs: StepInputs) -> int:
        """Copy one step's rows in, padded up to their bucket; returns the bucket. Raises ValueError
        when the inputs do not fit (more rows than the largest bucket, a table too wide)."""
        inputs.check(self.config)
        n = inputs.rows
        size = self.config.bucket_for(n)
        if size is None:
            raise ValueError(f"rows must be at most {self.config.rows} (the largest bucket), got {n}")
        ints, floats = self._host_ints, self._host_floats
        ints[:n, TOKEN] = inputs.tokens
        ints[:n, POSITION] = inputs.positions
        ints[:n, SEQ_LEN] = inputs.positions + 1
        ints[:n, TOP_K] = inputs.top_k
        ints[:n, KEY] = inputs.keys
        width = inputs.block_table.shape[1]
        ints[:n, TABLE : TABLE + width] = inputs.block_table
        # past a row's own blocks: the scratch block, never read by a correct step but a valid id
        ints[:n, TABLE + width :] = self.config.scratch_block
        floats[:n, TEMPERATURE] = inputs.temperature
        floats[:n, TOP_P] = inputs.top_p
        self._pad(n, size)
        async_copy = self.device.type == "cuda"
        self.ints[:size].copy_(ints[:size], non_blocking=async_copy)
        self.floats[:size].copy_(floats[:size], non_blocking=async_copy)
        return size

    def _pad(self, start: int, end: int) -> None:
        """Make staging rows ``start..end`` padding: token 0 at position 0 of the scratch block, length
        1, greedy."""
        ints, floats = self._host_ints[start:end], self._host_floats[start:end]
        ints[:, TOKEN] = 0
        ints[:, POSITION] = 0
        ints[:, SEQ_LEN] = 1
        ints[:, TOP_K] = 0
        ints[:, KEY] = 0
        ints[:, TABLE:] = self.config.scratch_block
        floats[:, TEMPERATURE] = 0.0
        floats[:, TOP_P] = 1.0


def unpad(values: torch.Tensor, rows: int) -> torch.Tensor:
    """The real rows of a padded step's output (the first ``rows``); padding rows' values dropped."""
    if rows < 1 or rows > values.shape[0]:
        raise ValueError(f"rows must be in [1, {values.shape[0]}], got {rows}")
    return values[:rows]
