"""In-process transport for tests: regions live in a per-process table, reached by key.

It exercises the whole protocol (signing, leases, tags, acks, checksums) with plain tensors,
so engine and orchestrator tests can run without /dev/shm or NIXL. Exporter and importer
must be in the same process.
"""

from __future__ import annotations

import re
import secrets
import threading
from typing import Any

import torch

from disagg.kv.descriptor import Descriptor
from disagg.kv.errors import DescriptorError, TransferError
from disagg.kv.mapped import MappedTransport, RemoteView
from disagg.kv.region import Region

_TABLE: dict[str, Region] = {}
_TABLE_LOCK = threading.Lock()
_KEY_RE = re.compile(r"^[a-z0-9_]{1,32}-fake-[0-9a-f]{16}$")


class FakeTransport(MappedTransport):
    kind = "fake"

    def _allocate_region(self, num_blocks: int, block_bytes: int) -> Region:
        key = f"{self.config.prefix}-fake-{secrets.token_hex(8)}"
        region = Region(
            key=key,
            pool=torch.zeros(num_blocks, block_bytes, dtype=torch.uint8),
            tags=torch.zeros(num_blocks, dtype=torch.int64),
            acks=torch.zeros(num_blocks, dtype=torch.int64),
        )

        def close() -> None:
            with _TABLE_LOCK:
                _TABLE.pop(key, None)

        region.closer = close
        with _TABLE_LOCK:
            _TABLE[key] = region
        return region

    def _location(self, region: Region) -> dict[str, Any]:
        return {"region": region.key}

    def _check_location(self, desc: Descriptor) -> None:
        loc = desc.location
        if set(loc) != {"region"} or not isinstance(loc["region"], str) or not _KEY_RE.match(loc["region"]):
            raise DescriptorError("descriptor location is invalid")

    def _open_remote(self, desc: Descriptor) -> RemoteView:
        with _TABLE_LOCK:
            region = _TABLE.get(desc.location["region"])
        if region is None or region.acks is None:
            raise TransferError("KV exporter region is gone")
        if region.num_blocks != desc.pool_blocks or region.block_bytes != desc.layout.block_bytes:
            raise DescriptorError("descriptor does not match the exporter region")
        return RemoteView(region.pool, region.tags, region.acks)


def fake_regions() -> int:
    """Regions currently alive in this process (a leak probe for tests)."""
    with _TABLE_LOCK:
        return len(_TABLE)
