"""Prefix keys: the hash chain that names a full KV block by every token up to its end.

Block ``i`` of a token sequence is keyed by ``H(key(i-1) || tokens of block i)``, so two sequences
share a key exactly when they share every token up to that block's end (the key of a block implies
its position and everything before it). ``H`` is BLAKE2b with a 128-bit digest: a collision, which
would hand one prompt another's KV, is not a practical concern, unlike with Python's 64-bit ``hash``.
Only full blocks have keys: a partial last block is still being written.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

DIGEST_BYTES = 16
ROOT = b"disagg-prefix-v1"


def block_keys(tokens: Sequence[int], block_size: int, limit: int | None = None) -> list[bytes]:
    """The keys of the full blocks of ``tokens`` (at most ``limit`` of them), in order."""
    if block_size < 1:
        raise ValueError("block_size must be a positive integer")
    count = len(tokens) // block_size
    if limit is not None:
        count = min(count, max(0, limit))
    if count == 0:
        return []
    data = np.asarray(tokens[: count * block_size], dtype=np.int64).reshape(count, block_size)
    keys = []
    parent = ROOT
    for row in data:
        parent = hashlib.blake2b(parent + row.tobytes(), digest_size=DIGEST_BYTES).digest()
        keys.append(parent)
    return keys
