"""A pool's KV settings: one frozen section of ``PoolConfig`` (``disagg.pool.instance``).

config.pbtxt spells its fields ``kv.<field>`` (``kv.cache_mb``), and the deployment spec's section
``kv`` uses the same words (``kv.checksum`` is config.pbtxt's alone). The section is the one place a
pool's KV is configured: the pool builds its engine's KV part from it (``ENGINE_FIELDS``: the cache's
size, block size, dtype and prefix cache) and its transport's from the rest (``transport``,
``lease_ttl_s``, ``checksum``). It checks its own ranges; the types are ``config.build``'s.

Torch-free on purpose, as ``disagg.config``: the repository builder reads its defaults.
"""

from __future__ import annotations

from dataclasses import dataclass

from disagg.kv.layout import DTYPE_BYTES

AUTO = "auto"  # the engine's word for "the compute dtype's rule" (``disagg.engine.device.auto_dtype``)
DTYPES = (*sorted(DTYPE_BYTES), AUTO)

# the section's fields the engine takes -> their names in ``EngineConfig``
ENGINE_FIELDS = {
    "cache_mb": "kv_cache_mb",
    "block_size": "block_size",
    "dtype": "kv_dtype",
    "prefix_cache": "prefix_cache",
}
TRANSPORT_FIELDS = ("transport", "lease_ttl_s", "checksum")  # the hand-off's part


@dataclass(frozen=True)
class KVSettings:
    """One pool instance's KV cache and its hand-off. A prefill/decode pair must agree on
    ``block_size`` and ``dtype`` (an import of other KV is refused) and on ``transport``."""

    cache_mb: int = 256
    """The KV cache's memory, MiB: as many blocks as it holds (the engine's ``num_blocks``, where set,
    wins)."""
    block_size: int = 16
    """Token positions per KV block; the prefix cache and the hot prompt groups work in whole blocks."""
    dtype: str | None = None
    """The KV cache's dtype: unset, the pool's compute dtype; ``auto``, the compute dtype's rule (so two
    ``auto`` pools on one machine agree)."""
    prefix_cache: bool = False
    """Keep the KV of full prompt blocks after their request ends, for later prompts sharing them
    (``disagg.engine.kvcache``)."""
    transport: str = "shm"
    """How KV is handed off: ``shm``, ``nixl``, ``cuda_ipc`` (``disagg.kv.transport``; an unknown name is
    refused when the pool is built)."""
    lease_ttl_s: float = 30.0
    """How long an exporter holds handed-off KV for its importer's ack (the lease's expiry)."""
    checksum: bool = False
    """The exporter signs a digest of the blocks into each descriptor; the importer checks it."""

    def __post_init__(self) -> None:
        for name in ("cache_mb", "block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be positive")
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ValueError(f"dtype: must be one of {', '.join(DTYPES)} (unset: the compute dtype)")
        if not 0 < self.lease_ttl_s <= 3600:
            raise ValueError("lease_ttl_s: must be a number of seconds in (0, 3600]")

    def engine_values(self) -> dict[str, object]:
        """The engine's KV part: ``EngineConfig`` field -> value."""
        return {engine: getattr(self, name) for name, engine in ENGINE_FIELDS.items()}
