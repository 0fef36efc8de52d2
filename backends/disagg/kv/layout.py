"""The byte layout of a KV cache block, shared by the engine and every transport.

One block holds ``block_size`` token positions of every layer, keys and values:

    block = [num_layers, 2 (k, v), block_size, num_kv_heads, head_dim]   (row-major, ``dtype``)

so a block is one contiguous run of ``block_bytes`` bytes, and a block pool is
``[num_blocks, block_bytes]``. Moving a sequence's KV is moving whole blocks.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, replace
from typing import Any

DTYPE_BYTES: dict[str, int] = {"float32": 4, "bfloat16": 2, "float16": 2}

# Upper bounds used to refuse absurd layouts (e.g. from a forged descriptor) before any
# arithmetic turns them into huge allocations.
MAX_LAYERS = 1024
MAX_KV_HEADS = 1024
MAX_HEAD_DIM = 4096
MAX_BLOCK_SIZE = 4096
MAX_TOKENS = 1 << 22
_FINGERPRINT_RE = re.compile(r"(?:[0-9a-f]{32})?")


class LayoutError(ValueError):
    """A layout field is missing, of the wrong type, or out of range."""


@dataclass(frozen=True)
class KVLayout:
    """Shape of the KV cache of one sequence (or, with ``num_tokens=0``, of a pool's blocks)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    block_size: int
    num_tokens: int = 0
    # what the bytes mean (``disagg.engine.fingerprint``): 32 hex digits, or "" where nobody stamped it
    fingerprint: str = ""

    def __post_init__(self) -> None:
        limits = {
            "num_layers": (1, MAX_LAYERS),
            "num_kv_heads": (1, MAX_KV_HEADS),
            "head_dim": (1, MAX_HEAD_DIM),
            "block_size": (1, MAX_BLOCK_SIZE),
            "num_tokens": (0, MAX_TOKENS),
        }
        for name, (lo, hi) in limits.items():
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise LayoutError(f"layout.{name} must be an integer")
            if not lo <= value <= hi:
                raise LayoutError(f"layout.{name}={value} is outside [{lo}, {hi}]")
        if self.dtype not in DTYPE_BYTES:
            raise LayoutError(f"layout.dtype must be one of {sorted(DTYPE_BYTES)}")
        if not isinstance(self.fingerprint, str) or not _FINGERPRINT_RE.fullmatch(self.fingerprint):
            raise LayoutError("layout.fingerprint must be 32 hex digits or empty")

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def bytes_per_token(self) -> int:
        """2 (k and v) x layers x kv heads x head dim x bytes per element."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes

    @property
    def block_bytes(self) -> int:
        return self.bytes_per_token * self.block_size

    @property
    def num_blocks(self) -> int:
        """Blocks needed for ``num_tokens`` positions."""
        return math.ceil(self.num_tokens / self.block_size)

    @property
    def byte_size(self) -> int:
        """Bytes of the whole blocks holding ``num_tokens`` positions."""
        return self.num_blocks * self.block_bytes

    def block_shape(self) -> tuple[int, int, int, int, int]:
        return (self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim)

    def with_tokens(self, num_tokens: int) -> KVLayout:
        return replace(self, num_tokens=num_tokens)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Any) -> KVLayout:
        """Parse a layout from untrusted data; unknown or missing keys are errors."""
        if not isinstance(data, dict):
            raise LayoutError("layout must be an object")
        fields = set(cls.__dataclass_fields__)
        unknown = set(data) - fields
        if unknown:
            raise LayoutError(f"unknown layout field(s): {sorted(unknown)}")
        missing = fields - set(data) - {"fingerprint"}  # optional: "" (unstamped) when absent
        if missing:
            raise LayoutError(f"missing layout field(s): {sorted(missing)}")
        return cls(**data)
