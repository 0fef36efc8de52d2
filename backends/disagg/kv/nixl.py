"""NIXL transport (UCX backend): one-sided READs from the exporter's registered pool.

- The exporter's pool is allocated here and registered with its NIXL agent once, so an
  export is a descriptor only; the importer READs straight into its own (registered) pool:
  one copy. DRAM pools on CPU; a ``device="cuda:N"`` pool is VRAM (that path is written
  against NIXL's documented API and NOT verified on a GPU here).
- Agent metadata (about 0.5 KiB) travels inside each signed descriptor, with its digest;
  the importer calls ``add_remote_agent`` only the first time it sees an agent (or when its
  digest changes, e.g. after the exporter registered more memory). No separate handshake
  channel, no NIXL listener socket: the descriptor's signature authenticates the metadata.
- NIXL's own ``get_serialized_descs`` pickles; we never use it. The descriptor carries plain
  integers (addresses of the pool and tag words) and the importer builds NIXL descriptor
  lists locally.
- Block tags live in DRAM next to the pool. The importer READs them before and after the
  data; once the bytes (and checksum) are good it sends the signed ack as a NIXL
  notification, which the exporter's ``poll`` takes in, so no relay is needed. A renewal
  (``Transport.renew``) is a signed notification too.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from disagg.config import build
from disagg.kv.descriptor import ACK_PURPOSE, Descriptor, parse_signal, sign_renewal
from disagg.kv.errors import DescriptorError, LeaseGone, TransferError
from disagg.kv.lease import ReleaseCallback
from disagg.kv.region import Region
from disagg.kv.runs import paired_runs
from disagg.kv.transport import Clock, Transport, TransportConfig

_LOCATION_KEYS = {"agent", "meta", "digest", "mem", "dev", "pool", "tags"}
_NAME_RE = re.compile(r"^[A-Za-z0-9_.-]{1,128}$")
_MAX_META = 1 << 16


@dataclass(frozen=True)
class NixlConfig:
    """``device``: "cpu" (DRAM) or "cuda:N" (VRAM, unverified); ``backends``: NIXL backends."""

    device: str = "cpu"
    backends: tuple[str, ...] = ("UCX",)
    num_threads: int = 0
    dest_cache: int = 8
    # UCX over TCP emulates one-sided READs with messages the exporter must progress: NIXL's progress
    # thread does (polling without pause), or the exporter's reaper, every time it polls for acks (the
    # pools: see PoolConfig.nixl_progress_thread). With neither, READs time out.
    progress_thread: bool = True

    def __post_init__(self) -> None:
        """Ranges; the types are ``config.build``'s (``from_dict``; a config built by hand in code is
        trusted to be typed)."""
        if not re.fullmatch(r"cpu|cuda:\d{1,2}", self.device):
            raise ValueError('NixlConfig.device must be "cpu" or "cuda:N"')
        if not self.backends:
            raise ValueError("NixlConfig.backends must name at least one backend")
        for name in ("num_threads", "dest_cache"):
            if getattr(self, name) < 0:
                raise ValueError(f"NixlConfig.{name} must be >= 0")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, strings: bool = False, where: str = "") -> NixlConfig:
        """Typed by :func:`disagg.config.build`; unknown keys are errors."""
        return build(cls, data, strings=strings, where=where)


def _mem_type(t: torch.Tensor) -> str:
    return "VRAM" if t.is_cuda else "DRAM"


class NixlTransport(Transport):
    kind = "nixl"
    teardown_at_exit = True  # the agent's UCX context is released by its destructor only

    def __init__(
        self,
        config: TransportConfig,
        nixl: NixlConfig | None = None,
        *,
        clock: Clock | None = None,
        on_release: ReleaseCallback | None = None,
    ) -> None:
        super().__init__(config, clock=clock, on_release=on_release)
        from nixl_cu12._api import nixl_agent, nixl_agent_config, nixl_thread_sync_t

        self.nixl = nixl or NixlConfig()
        conf = nixl_agent_config(
            backends=list(self.nixl.backends),
            enable_prog_thread=self.nixl.progress_thread,
            num_threads=self.nixl.num_threads,
            sync_mode=nixl_thread_sync_t.NIXL_THREAD_SYNC_RW,
        )
        self._agent = nixl_agent(self.origin, conf)
        self._agent_lock = threading.Lock()
        self._registrations: list[Any] = []
        self._meta = b""
        self._digest = ""
        self._peers: dict[str, str] = {}
        self._dest_regs: OrderedDict[tuple[int, int], Any] = OrderedDict()
        self._local = threading.local()
        self._scratches: list[torch.Tensor] = []

    # ---- exporter ---------------------------------------------------------------------

    def _register(self, tensor: torch.Tensor, publish: bool = True) -> Any:
        """Register with NIXL; ``publish`` refreshes the metadata that exports carry."""
        with self._agent_lock:
            reg = self._agent.register_memory(tensor)
            if publish:
                self._meta = self._agent.get_agent_metadata()
                self._digest = hashlib.blake2b(self._meta, digest_size=16).hexdigest()
        return reg

    def _allocate_region(self, num_blocks: int, block_bytes: int) -> Region:
        pool = torch.zeros(num_blocks, block_bytes, dtype=torch.uint8, device=self.nixl.device)
        tags = torch.zeros(num_blocks, dtype=torch.int64)  # always DRAM: written by the CPU
        regs = [self._register(pool), self._register(tags)]
        with self._agent_lock:
            self._registrations.extend(regs)
        region = Region(key=f"{self.origin}.{len(self._registrations)}", pool=pool, tags=tags, acks=None)

        def close() -> None:
            with self._agent_lock:
                for reg in regs:
                    with contextlib.suppress(Exception):
                        self._agent.deregister_memory(reg)
                    if reg in self._registrations:
                        self._registrations.remove(reg)

        region.closer = close
        return region

    def _location(self, region: Region) -> dict[str, Any]:
        with self._agent_lock:
            meta, digest = self._meta, self._digest
        return {
            "agent": self.origin,
            "meta": base64.b64encode(meta).decode(),
            "digest": digest,
            "mem": _mem_type(region.pool),
            "dev": max(region.pool.get_device(), 0),
            "pool": region.pool.data_ptr(),
            "tags": region.tags.data_ptr(),
        }

    def _native_signals(self) -> tuple[list[str], list[str]]:
        with self._agent_lock:
            notifs = self._agent.get_new_notifs()
        acked, renewed = [], []
        for messages in notifs.values():
            for msg in messages:
                try:
                    purpose, lease_id, origin = parse_signal(msg, self.config.secret)
                except DescriptorError:
                    self.stats.add(refused=1)
                    continue
                if origin == self.origin:
                    (acked if purpose == ACK_PURPOSE else renewed).append(lease_id)
        return acked, renewed

    # ---- importer ---------------------------------------------------------------------

    def _check_location(self, desc: Descriptor) -> None:
        loc = desc.location
        ok = (
            set(loc) == _LOCATION_KEYS
            and isinstance(loc["agent"], str)
            and _NAME_RE.match(loc["agent"]) is not None
            and loc["agent"] == desc.origin
            and isinstance(loc["meta"], str)
            and 0 < len(loc["meta"]) <= _MAX_META
            and isinstance(loc["digest"], str)
            and re.fullmatch(r"[0-9a-f]{32}", loc["digest"]) is not None
            and loc["mem"] in ("DRAM", "VRAM")
            and all(isinstance(loc[k], int) and not isinstance(loc[k], bool) for k in ("dev", "pool", "tags"))
            and 0 <= loc["dev"] < 1024
            and 0 < loc["pool"] < 1 << 64
            and 0 < loc["tags"] < 1 << 64
        )
        if not ok:
            raise DescriptorError("descriptor location is invalid")

    def _connect(self, loc: dict[str, Any]) -> str:
        name = loc["agent"]
        with self._agent_lock:
            if self._peers.get(name) == loc["digest"]:
                return name
            try:
                meta = base64.b64decode(loc["meta"], validate=True)
            except ValueError:
                raise DescriptorError("descriptor location is invalid") from None
            if hashlib.blake2b(meta, digest_size=16).hexdigest() != loc["digest"]:
                raise DescriptorError("descriptor location is invalid")
            try:
                if name in self._peers:
                    self._agent.remove_remote_agent(name)
                    del self._peers[name]
                added = self._agent.add_remote_agent(meta)
            except Exception:
                raise TransferError("KV exporter agent cannot be reached") from None
            if (added.decode() if isinstance(added, bytes) else added) != name:
                self._agent.remove_remote_agent(added)
                raise DescriptorError("descriptor location is invalid")
            self._peers[name] = loc["digest"]
        return name

    def _local_registered(self, dest: torch.Tensor) -> None:
        key = (dest.data_ptr(), dest.numel())
        if self._region_of(dest) is not None:
            return
        with self._agent_lock:
            if key in self._dest_regs:
                self._dest_regs.move_to_end(key)
                return
        reg = self._register(dest)
        with self._agent_lock:
            self._dest_regs[key] = reg
            while len(self._dest_regs) > max(self.nixl.dest_cache, 1):
                _, old = self._dest_regs.popitem(last=False)
                self._agent.deregister_memory(old)

    def _tags_scratch(self, n: int) -> torch.Tensor:
        """A registered int64 buffer of at least ``n`` words, private to the calling thread."""
        scratch = getattr(self._local, "scratch", None)
        if scratch is None or scratch.numel() < n:
            if scratch is not None:
                self._deregister_scratch(scratch)
            scratch = torch.zeros(max(n, 1024), dtype=torch.int64)
            self._register(scratch, publish=False)
            self._local.scratch = scratch
            with self._agent_lock:
                self._scratches.append(scratch)
        return scratch

    def _read(
        self,
        peer: str,
        local: list[tuple[int, int, int]],
        lmem: str,
        remote: list[tuple[int, int, int]],
        rmem: str,
        notif: bytes = b"",
    ) -> None:
        agent = self._agent
        deadline = time.monotonic() + self.config.transfer_timeout_s
        try:
            handle = agent.initialize_xfer(
                "READ", agent.get_xfer_descs(local, lmem), agent.get_xfer_descs(remote, rmem), peer, notif
            )
        except Exception:
            raise TransferError("KV transfer could not be started") from None
        try:
            state = agent.transfer(handle)
            while state != "DONE":
                if state == "ERR":
                    raise TransferError("KV transfer failed in the network layer")
                if time.monotonic() > deadline:
                    raise TransferError("KV transfer timed out")
                state = agent.check_xfer_state(handle)
        except TransferError:
            raise
        except Exception:
            raise TransferError("KV transfer failed in the network layer") from None
        finally:
            with contextlib.suppress(Exception):
                agent.release_xfer_handle(handle)

    def _read_tags(self, peer: str, desc: Descriptor, scratch: torch.Tensor) -> bool:
        base, off = desc.location["tags"], 0
        local, remote = [], []
        for s, c in desc.runs():
            local.append((scratch.data_ptr() + 8 * off, 8 * c, 0))
            remote.append((base + 8 * s, 8 * c, 0))
            off += c
        self._read(peer, local, "DRAM", remote, "DRAM")
        return bool((scratch[:off] == desc.tag).all())

    def _copy_in(self, desc: Descriptor, dest: torch.Tensor, dest_ids: list[int]) -> None:
        loc = desc.location
        peer = self._connect(loc)
        self._local_registered(dest)
        scratch = self._tags_scratch(len(desc.block_ids))
        if not self._read_tags(peer, desc, scratch):
            raise LeaseGone("KV lease is no longer held by the exporter")
        bb = desc.layout.block_bytes
        runs = paired_runs(desc.block_ids, dest_ids)
        dev = max(dest.get_device(), 0)
        local = [(dest.data_ptr() + d * bb, c * bb, dev) for _, d, c in runs]
        remote = [(loc["pool"] + s * bb, c * bb, loc["dev"]) for s, _, c in runs]
        self._read(peer, local, _mem_type(dest), remote, loc["mem"])
        # One NIXL request carries every run, so the fault hook sees it as a single run.
        self.hooks.after_run(0, 1)
        if not self._read_tags(peer, desc, scratch):
            raise LeaseGone("KV lease was released during the copy")

    def _send_ack(self, desc: Descriptor, ack: bytes) -> None:
        with self._agent_lock:
            self._agent.send_notif(desc.location["agent"], ack)

    def _send_renewal(self, desc: Descriptor, seq: int) -> None:
        self._connect(desc.location)  # a renewal may come before the first read from this exporter
        message = sign_renewal(desc.lease_id, desc.origin, seq, self.config.secret)
        with self._agent_lock:
            self._agent.send_notif(desc.location["agent"], message)

    def _deregister_scratch(self, scratch: torch.Tensor) -> None:
        with self._agent_lock:
            with contextlib.suppress(Exception):
                self._agent.deregister_memory(self._agent.get_reg_descs(scratch))
            if any(t is scratch for t in self._scratches):
                self._scratches = [t for t in self._scratches if t is not scratch]

    def _close_transport(self) -> None:
        with self._agent_lock:
            for name in list(self._peers):
                with contextlib.suppress(Exception):
                    self._agent.remove_remote_agent(name)
            self._peers.clear()
            for reg in self._dest_regs.values():
                with contextlib.suppress(Exception):
                    self._agent.deregister_memory(reg)
            self._dest_regs.clear()
        for scratch in list(self._scratches):
            self._deregister_scratch(scratch)
