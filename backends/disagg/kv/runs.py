"""Block-id lists: validation, and grouping into runs of consecutive ids.

A run ``(start, count)`` is ``count`` consecutive blocks, i.e. one contiguous byte range
of a pool; copies and wire forms work on runs so a sequence in consecutive blocks moves as
one memcpy and its descriptor stays small.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

Run = tuple[int, int]


def check_block_ids(block_ids: Sequence[int], num_blocks: int, what: str = "block id") -> list[int]:
    """Return ``block_ids`` as a list of ints, refusing bools, negatives, duplicates, out of range."""
    ids = list(block_ids)
    seen: set[int] = set()
    for b in ids:
        if not isinstance(b, int) or isinstance(b, bool):
            raise ValueError(f"{what} must be an integer")
        if not 0 <= b < num_blocks:
            raise ValueError(f"{what} {b} is outside [0, {num_blocks})")
        if b in seen:
            raise ValueError(f"{what} {b} appears twice")
        seen.add(b)
    return ids


def to_runs(block_ids: Iterable[int]) -> list[Run]:
    """Group ids into runs of consecutive ids, keeping their order."""
    runs: list[Run] = []
    for b in block_ids:
        if runs and runs[-1][0] + runs[-1][1] == b:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((b, 1))
    return runs


def from_runs(runs: Iterable[Run]) -> list[int]:
    return [start + i for start, count in runs for i in range(count)]


def paired_runs(src: Sequence[int], dst: Sequence[int]) -> list[tuple[int, int, int]]:
    """Split a block-to-block mapping into ``(src_start, dst_start, count)`` runs contiguous on both sides."""
    out: list[tuple[int, int, int]] = []
    for s, d in zip(src, dst, strict=True):
        if out and out[-1][0] + out[-1][2] == s and out[-1][1] + out[-1][2] == d:
            out[-1] = (out[-1][0], out[-1][1], out[-1][2] + 1)
        else:
            out.append((s, d, 1))
    return out
