"""Transports whose importer maps the exporter's region and copies with the CPU/GPU itself.

``shm`` (a file in /dev/shm), ``fake`` (an in-process table) and ``cuda_ipc`` (CUDA IPC
handles) differ only in how a region is reached; the copy, tag checks and the ack through
the region's ``acks`` words are shared here.
"""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass

import numpy as np
import torch

from disagg.kv.descriptor import Descriptor, lease_tag
from disagg.kv.errors import LeaseGone
from disagg.kv.region import runs_hold_tag
from disagg.kv.runs import paired_runs
from disagg.kv.transport import Transport


@dataclass
class RemoteView:
    """The importer's view of an exporter region (same tensors as ``Region`` minus ownership)."""

    pool: torch.Tensor
    tags: torch.Tensor
    acks: torch.Tensor


class MappedTransport(Transport):
    @abstractmethod
    def _open_remote(self, desc: Descriptor) -> RemoteView:
        """Map (or fetch from cache) the exporter region named by a verified descriptor."""

    def _copy_run(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        if dst.device.type == "cpu" and src.device.type == "cpu":
            # numpy's copyto is a plain memcpy; torch's uint8 copy_ measured 2-3x slower here.
            np.copyto(dst.numpy(), src.numpy())
        else:
            dst.copy_(src)

    def _sync(self) -> None:
        """Wait for queued copies (GPU transports); CPU copies are already done."""

    def _copy_in(self, desc: Descriptor, dest: torch.Tensor, dest_ids: list[int]) -> None:
        view = self._open_remote(desc)
        src_runs = desc.runs()
        tag = desc.tag
        if not runs_hold_tag(view.tags, src_runs, tag):
            raise LeaseGone("KV lease is no longer held by the exporter")
        runs = paired_runs(desc.block_ids, dest_ids)
        for i, (s, d, c) in enumerate(runs):
            self._copy_run(dest[d : d + c], view.pool[s : s + c])
            self.hooks.after_run(i, len(runs))
        self._sync()
        # The exporter clears tags before handing blocks back to its engine, so tags still
        # intact after the copy prove that no block was reused while we read it.
        if not runs_hold_tag(view.tags, src_runs, tag):
            raise LeaseGone("KV lease was released during the copy")

    def _send_ack(self, desc: Descriptor, ack: bytes) -> None:
        # The exporter's poll looks for its lease tag in the acks word of the first block.
        self._open_remote(desc).acks[desc.block_ids[0]] = desc.tag
        self._sync()

    def _native_acks(self) -> list[str]:
        done = []
        for lease_id in self._leases.live_ids():
            lease = self._leases.get(lease_id)
            if lease is None:
                continue
            with self._lock:
                region = self._regions.get(str(lease.region))
            if region is None or region.acks is None:
                continue
            first = lease.block_ids[0]
            if int(region.acks[first]) == lease_tag(lease_id):
                done.append(lease_id)
        return done
