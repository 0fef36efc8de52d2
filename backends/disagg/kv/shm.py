"""POSIX shared-memory transport (one host): the exporter's pool lives in a /dev/shm file.

Design:
- A region is one file ``<dir>/<prefix>-<owner pid>-<16 random hex>``, mode 0600, created
  with O_EXCL and reserved with posix_fallocate (a full /dev/shm fails at allocation, not
  with SIGBUS mid-copy). Layout: 4 KiB header | tags | acks | pool (see ``region``).
- We open and mmap the files ourselves instead of ``multiprocessing.shared_memory``: its
  resource_tracker unlinks or warns about segments that another process owns, which is
  wrong for a region that outlives the importer's interest in it.
- Regions are unlinked on ``close``; a later start with the same prefix unlinks regions whose
  owner pid is dead (or reused: the header records the owner's start time), so a kill -9
  leaves nothing behind after the restart.
- Importers validate a region's owner, mode and header against the descriptor before mmap,
  and keep an LRU cache of mappings (mapping 100s of MiB per hand-off would dominate).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import secrets
import threading
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from disagg.config import build
from disagg.kv.descriptor import Descriptor
from disagg.kv.errors import DescriptorError, TransferError
from disagg.kv.lease import ReleaseCallback
from disagg.kv.mapped import MappedTransport, RemoteView
from disagg.kv.region import Region
from disagg.kv.stale import HEADER as _HEADER
from disagg.kv.stale import MAGIC as _MAGIC
from disagg.kv.stale import clean_stale_regions, name_pattern, owner_start_time
from disagg.kv.transport import Clock, TransportConfig

_HEADER_BYTES = 4096
_PAGE = 4096


@dataclass(frozen=True)
class ShmConfig:
    """``directory``: where regions live (/dev/shm); ``map_cache``: importer mappings kept open."""

    directory: str = "/dev/shm"
    map_cache: int = 64
    populate: bool = True

    def __post_init__(self) -> None:
        """Ranges; the types are ``config.build``'s (``from_dict``; a config built by hand in code is
        trusted to be typed)."""
        if not os.path.isabs(self.directory):
            raise ValueError("ShmConfig.directory must be an absolute path")
        if self.map_cache < 1:
            raise ValueError("ShmConfig.map_cache must be positive")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, strings: bool = False, where: str = "") -> ShmConfig:
        """Typed by :func:`disagg.config.build`; unknown keys are errors."""
        return build(cls, data, strings=strings, where=where)


def _round(n: int) -> int:
    return (n + _PAGE - 1) // _PAGE * _PAGE


def _offsets(num_blocks: int) -> tuple[int, int, int]:
    tags = _HEADER_BYTES
    acks = tags + _round(8 * num_blocks)
    pool = acks + _round(8 * num_blocks)
    return tags, acks, pool


class _Mapping:
    def __init__(self, mm: mmap.mmap, view: RemoteView) -> None:
        self.mm = mm
        self.view = view

    def close(self) -> None:
        self.view = None  # type: ignore[assignment]
        # A copy in flight may still hold a view; the mapping then goes when that is dropped.
        with contextlib.suppress(BufferError):
            self.mm.close()


class ShmTransport(MappedTransport):
    kind = "shm"

    def __init__(
        self,
        config: TransportConfig,
        shm: ShmConfig | None = None,
        *,
        clock: Clock | None = None,
        on_release: ReleaseCallback | None = None,
    ) -> None:
        super().__init__(config, clock=clock, on_release=on_release)
        self.shm = shm or ShmConfig()
        self._name_pattern = name_pattern(config.prefix)
        self._maps: OrderedDict[str, _Mapping] = OrderedDict()
        self._maps_lock = threading.Lock()
        self.stale_removed = clean_stale_regions(self.shm.directory, config.prefix)

    # ---- exporter ---------------------------------------------------------------------

    def _allocate_region(self, num_blocks: int, block_bytes: int) -> Region:
        pid = os.getpid()
        name = f"{self.config.prefix}-{pid}-{secrets.token_hex(8)}"
        path = os.path.join(self.shm.directory, name)
        tags_off, acks_off, pool_off = _offsets(num_blocks)
        total = pool_off + num_blocks * block_bytes
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            os.fchmod(fd, 0o600)
            os.ftruncate(fd, total)
            try:
                os.posix_fallocate(fd, 0, total)
            except OSError:
                raise TransferError("not enough shared memory for the KV pool") from None
            header = _HEADER.pack(
                _MAGIC, pid, owner_start_time(pid) or 0, num_blocks, block_bytes, tags_off, acks_off, pool_off
            )
            os.pwrite(fd, header, 0)
            flags = mmap.MAP_SHARED | (mmap.MAP_POPULATE if self.shm.populate else 0)
            mm = mmap.mmap(fd, total, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            _unlink(path)
            raise
        os.close(fd)
        pool = torch.frombuffer(mm, dtype=torch.uint8, count=num_blocks * block_bytes, offset=pool_off)
        region = Region(
            key=name,
            pool=pool.view(num_blocks, block_bytes),
            tags=torch.frombuffer(mm, dtype=torch.int64, count=num_blocks, offset=tags_off),
            acks=torch.frombuffer(mm, dtype=torch.int64, count=num_blocks, offset=acks_off),
        )

        def close() -> None:
            _unlink(path)
            # The engine may still hold the pool tensor; the mapping then goes with it.
            with contextlib.suppress(BufferError):
                mm.close()

        region.closer = close
        return region

    def _location(self, region: Region) -> dict[str, Any]:
        return {"region": region.key}

    # ---- importer ---------------------------------------------------------------------

    def _check_location(self, desc: Descriptor) -> None:
        loc = desc.location
        if (
            set(loc) != {"region"}
            or not isinstance(loc["region"], str)
            or not self._name_pattern.match(loc["region"])
        ):
            raise DescriptorError("descriptor location is invalid")

    def _open_remote(self, desc: Descriptor) -> RemoteView:
        name = desc.location["region"]
        path = os.path.join(self.shm.directory, name)
        with self._maps_lock:
            cached = self._maps.get(name)
            if cached is not None:
                if os.path.exists(path):
                    self._maps.move_to_end(name)
                    view = cached.view
                    self._check_shape(view, desc)
                    return view
                # The exporter closed (or lost) the region: drop our mapping of the dead file.
                self._maps.pop(name).close()
        mapping = self._map(path, desc)
        with self._maps_lock:
            if name in self._maps:  # another thread mapped it meanwhile
                mapping.close()
                return self._maps[name].view
            self._maps[name] = mapping
            while len(self._maps) > self.shm.map_cache:
                self._maps.popitem(last=False)[1].close()
        return mapping.view

    @staticmethod
    def _check_shape(view: RemoteView, desc: Descriptor) -> None:
        if view.pool.shape[0] != desc.pool_blocks or view.pool.shape[1] != desc.layout.block_bytes:
            raise DescriptorError("descriptor does not match the exporter region")

    def _map(self, path: str, desc: Descriptor) -> _Mapping:
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            raise TransferError("KV exporter region is gone") from None
        except OSError:
            raise TransferError("KV exporter region cannot be opened") from None
        try:
            st = os.fstat(fd)
            if st.st_uid != os.geteuid() or st.st_mode & 0o077:
                raise TransferError("KV exporter region has unsafe ownership or mode")
            raw = os.pread(fd, _HEADER.size, 0)
            if len(raw) != _HEADER.size or raw[:8] != _MAGIC:
                raise DescriptorError("descriptor does not match the exporter region")
            _, _, _, blocks, block_bytes, tags_off, acks_off, pool_off = _HEADER.unpack(raw)
            expect = _offsets(blocks)
            if (
                blocks != desc.pool_blocks
                or block_bytes != desc.layout.block_bytes
                or (tags_off, acks_off, pool_off) != expect
                or st.st_size != pool_off + blocks * block_bytes
            ):
                raise DescriptorError("descriptor does not match the exporter region")
            flags = mmap.MAP_SHARED | (mmap.MAP_POPULATE if self.shm.populate else 0)
            mm = mmap.mmap(fd, st.st_size, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        view = RemoteView(
            pool=torch.frombuffer(mm, dtype=torch.uint8, count=blocks * block_bytes, offset=pool_off).view(
                blocks, block_bytes
            ),
            tags=torch.frombuffer(mm, dtype=torch.int64, count=blocks, offset=tags_off),
            acks=torch.frombuffer(mm, dtype=torch.int64, count=blocks, offset=acks_off),
        )
        return _Mapping(mm, view)

    def _close_transport(self) -> None:
        with self._maps_lock:
            maps, self._maps = list(self._maps.values()), OrderedDict()
        for m in maps:
            m.close()

    def region_names(self) -> list[str]:
        """Names of the regions this transport owns (for leak probes; never put them in errors)."""
        with self._lock:
            return sorted(self._regions)


def _unlink(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
