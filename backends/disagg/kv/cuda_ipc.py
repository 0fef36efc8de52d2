"""CUDA IPC transport for GPUs of one node: run on one GPU (docs/gpu.md), never between two.

The exporter's pool, tags and acks are CUDA allocations; their IPC handles travel in the
descriptor (base64 inside the signed JSON, never pickled). The importer opens them once
(cached), checks tags, and copies each run with ``copy_`` into its own device: a peer copy
over NVLink/PCIe when the devices differ. All CUDA calls go through ``CudaIpcBackend`` so the
logic is tested with ``FakeCudaIpc`` on CPU machines; ``TorchCudaIpc`` is the real boundary,
written against torch's storage IPC API (``_share_cuda_`` / ``_new_shared_cuda``); CI has no
GPU, so it runs only in ``tests/gpu`` on a lent GPU machine (``perf/gpu_check.sh``).
"""

from __future__ import annotations

import base64
import re
import secrets
import threading
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from disagg.config import build
from disagg.kv.descriptor import Descriptor
from disagg.kv.errors import DescriptorError, TransferError
from disagg.kv.lease import ReleaseCallback
from disagg.kv.mapped import MappedTransport, RemoteView
from disagg.kv.region import Region
from disagg.kv.transport import Clock, TransportConfig

_B64_RE = re.compile(r"^[A-Za-z0-9+/=]{4,4096}$")


class CudaIpcBackend(Protocol):
    """The only place CUDA is touched. Handles are JSON-safe dicts."""

    def allocate(self, nbytes: int, device: str) -> torch.Tensor:
        """A zeroed 1-D uint8 tensor of ``nbytes`` on ``device``."""

    def share(self, tensor: torch.Tensor) -> dict[str, Any]:
        """An IPC handle for the whole of ``tensor``."""

    def open(self, handle: dict[str, Any], nbytes: int) -> torch.Tensor:
        """Map a peer's handle as a 1-D uint8 tensor of ``nbytes`` (raises on a bad handle)."""

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Queue ``dst.copy_(src)`` (peer copy when devices differ)."""

    def synchronize(self) -> None:
        """Wait for every queued copy and tag write."""


class TorchCudaIpc:
    """Real boundary through torch's CUDA storage IPC (``tests/gpu``; skipped where CI runs, no GPU)."""

    _FIELDS = ("device", "handle", "size", "offset", "ref_handle", "ref_offset", "event", "event_sync")

    def allocate(self, nbytes: int, device: str) -> torch.Tensor:
        return torch.zeros(nbytes, dtype=torch.uint8, device=device)

    def share(self, tensor: torch.Tensor) -> dict[str, Any]:
        dev, handle, size, offset, ref_handle, ref_offset, event, sync = (
            tensor.untyped_storage()._share_cuda_()
        )
        return {
            "device": int(dev),
            "handle": base64.b64encode(handle).decode(),
            "size": int(size),
            "offset": int(offset),
            "ref_handle": base64.b64encode(ref_handle).decode(),
            "ref_offset": int(ref_offset),
            "event": base64.b64encode(event).decode() if event else "",
            "event_sync": bool(sync),
            "storage_offset": int(tensor.storage_offset()),
        }

    def open(self, handle: dict[str, Any], nbytes: int) -> torch.Tensor:
        storage = torch.UntypedStorage._new_shared_cuda(
            handle["device"],
            base64.b64decode(handle["handle"]),
            handle["size"],
            handle["offset"],
            base64.b64decode(handle["ref_handle"]),
            handle["ref_offset"],
            base64.b64decode(handle["event"]) if handle["event"] else b"",
            handle["event_sync"],
        )
        t = torch.empty(0, dtype=torch.uint8, device=f"cuda:{handle['device']}")
        t.set_(storage, handle["storage_offset"], (nbytes,))
        return t

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src, non_blocking=True)

    def synchronize(self) -> None:
        torch.cuda.synchronize()


class FakeCudaIpc:
    """CPU stand-in for tests: "device" memory is host memory, handles are keys of a table."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._table: dict[str, torch.Tensor] = {}
        self.syncs = 0
        self.opens = 0

    def allocate(self, nbytes: int, device: str) -> torch.Tensor:
        return torch.zeros(nbytes, dtype=torch.uint8)

    def share(self, tensor: torch.Tensor) -> dict[str, Any]:
        key = base64.b64encode(secrets.token_bytes(48)).decode()
        flat = tensor.reshape(-1).view(torch.uint8)
        with self._lock:
            self._table[key] = flat
        return {"device": 0, "handle": key, "size": flat.numel(), "storage_offset": 0}

    def forget(self, handle: dict[str, Any]) -> None:
        with self._lock:
            self._table.pop(handle["handle"], None)

    def open(self, handle: dict[str, Any], nbytes: int) -> torch.Tensor:
        with self._lock:
            t = self._table.get(handle["handle"])
            self.opens += 1
        if t is None or t.numel() != nbytes:
            raise TransferError("CUDA IPC handle cannot be opened")
        return t

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src)

    def synchronize(self) -> None:
        with self._lock:
            self.syncs += 1


@dataclass(frozen=True)
class CudaIpcConfig:
    """``device``: where this process's pools live; ``map_cache``: peer regions kept open."""

    device: str = "cuda:0"
    map_cache: int = 32

    def __post_init__(self) -> None:
        """Ranges; the types are ``config.build``'s (``from_dict``; a config built by hand in code is
        trusted to be typed)."""
        if not re.fullmatch(r"cuda:\d{1,2}", self.device):
            raise ValueError('CudaIpcConfig.device must be "cuda:N"')
        if self.map_cache < 1:
            raise ValueError("CudaIpcConfig.map_cache must be positive")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, strings: bool = False, where: str = "") -> CudaIpcConfig:
        """Typed by :func:`disagg.config.build`; unknown keys are errors."""
        return build(cls, data, strings=strings, where=where)


def _check_handle(h: Any) -> bool:
    return (
        isinstance(h, dict)
        and isinstance(h.get("handle"), str)
        and _B64_RE.match(h["handle"]) is not None
        and all(isinstance(v, int | str | bool) for v in h.values())
        and len(h) <= 16
    )


class CudaIpcTransport(MappedTransport):
    kind = "cuda_ipc"

    def __init__(
        self,
        config: TransportConfig,
        cuda: CudaIpcConfig | None = None,
        *,
        backend: CudaIpcBackend | None = None,
        clock: Clock | None = None,
        on_release: ReleaseCallback | None = None,
    ) -> None:
        super().__init__(config, clock=clock, on_release=on_release)
        self.cuda = cuda or CudaIpcConfig()
        self.backend: CudaIpcBackend = backend or TorchCudaIpc()
        self._maps: OrderedDict[str, RemoteView] = OrderedDict()
        self._maps_lock = threading.Lock()

    def _allocate_region(self, num_blocks: int, block_bytes: int) -> Region:
        b = self.backend
        pool = b.allocate(num_blocks * block_bytes, self.cuda.device).view(num_blocks, block_bytes)
        tags = b.allocate(8 * num_blocks, self.cuda.device).view(torch.int64)
        acks = b.allocate(8 * num_blocks, self.cuda.device).view(torch.int64)
        handles = {"pool": b.share(pool), "tags": b.share(tags), "acks": b.share(acks)}
        region = Region(key=f"{self.origin}.{secrets.token_hex(4)}", pool=pool, tags=tags, acks=acks)
        region.extra["handles"] = handles
        forget = getattr(b, "forget", None)
        if forget is not None:
            region.closer = lambda: [forget(h) for h in handles.values()] and None
        return region

    def _location(self, region: Region) -> dict[str, Any]:
        return dict(region.extra["handles"])

    def _check_location(self, desc: Descriptor) -> None:
        loc = desc.location
        if set(loc) != {"pool", "tags", "acks"} or not all(_check_handle(loc[k]) for k in loc):
            raise DescriptorError("descriptor location is invalid")

    def _open_remote(self, desc: Descriptor) -> RemoteView:
        key = desc.location["pool"]["handle"]
        with self._maps_lock:
            view = self._maps.get(key)
            if view is not None:
                self._maps.move_to_end(key)
        if view is None:
            n, bb = desc.pool_blocks, desc.layout.block_bytes
            view = RemoteView(
                pool=self.backend.open(desc.location["pool"], n * bb).view(n, bb),
                tags=self.backend.open(desc.location["tags"], 8 * n).view(torch.int64),
                acks=self.backend.open(desc.location["acks"], 8 * n).view(torch.int64),
            )
            with self._maps_lock:
                self._maps[key] = view
                while len(self._maps) > self.cuda.map_cache:
                    self._maps.popitem(last=False)
        return view

    def _copy_run(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        self.backend.copy(dst, src)

    def _sync(self) -> None:
        self.backend.synchronize()

    def _set_tags(self, region: Region, ids: Any, tag: int) -> None:
        super()._set_tags(region, ids, tag)
        # Tag writes are kernels on the exporter's stream: finish them before the descriptor leaves.
        self.backend.synchronize()

    def _close_transport(self) -> None:
        with self._maps_lock:
            self._maps.clear()
