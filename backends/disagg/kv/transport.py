"""The transport interface, the logic every transport shares, and the registry.

One ``Transport`` object per process serves both sides:

exporter (prefill)                              importer (decode)
  pool = t.allocate_memory(n, layout.block_bytes)   pool = t.allocate_memory(m, layout.block_bytes)
  token = t.export_blocks(pool, ids, layout) ──▶  res = t.import_blocks(token, pool, my_ids)
  (blocks held under a lease)                     (one copy: exporter blocks -> my blocks)
  (lease released)  ◀── native ack ──────────────  (sent by import_blocks)
  t.poll() / reaper: native acks, renewals, expiry
  (lease extended)  ◀── native ──────────────────  t.renew(token)  (still waiting for blocks)

Everything except moving bytes lives here: signing, verification, leases, block tags,
staging, checksums, counters, replay protection. A subclass supplies memory
(``_allocate_region``), a location for its descriptors, a pure location check, and the copy.
"""

from __future__ import annotations

import hashlib
import importlib
import logging
import os
import re
import secrets
import threading
import time
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from disagg.config import ConfigError, build
from disagg.kv.descriptor import (
    Descriptor,
    DescriptorLimits,
    check_live,
    new_lease_id,
    parse_descriptor,
    sign_ack,
)
from disagg.kv.errors import (
    ChecksumMismatch,
    DescriptorError,
    KVError,
    LeaseGone,
    TransferError,
    TransportClosed,
)
from disagg.kv.hooks import TransferHooks
from disagg.kv.layout import KVLayout
from disagg.kv.lease import Lease, LeaseConfig, LeaseTable, ReleaseCallback
from disagg.kv.region import Region, as_block_bytes
from disagg.kv.runs import check_block_ids, to_runs
from disagg.kv.staging import Staging
from disagg.kv.stats import TransferStats

log = logging.getLogger(__name__)
_PREFIX_RE = re.compile(r"^[a-z0-9][a-z0-9_]{0,31}$")
Clock = Callable[[], float]


@dataclass(frozen=True)
class TransportConfig:
    """Settings every transport shares. ``prefix`` names this deployment's regions and agents."""

    secret: bytes = field(repr=False)
    prefix: str = "disagg"
    ttl_s: float = 30.0
    max_leases: int = 4096
    checksum: bool = False
    staging_blocks: int = 0
    transfer_timeout_s: float = 30.0
    replay_window: int = 1 << 16
    limits: DescriptorLimits = field(default_factory=DescriptorLimits)

    def __post_init__(self) -> None:
        """Ranges and consistency; the types are ``config.build``'s (``from_dict``; a config built by
        hand in code is trusted to be typed)."""
        if len(self.secret) < 16:
            raise ValueError("TransportConfig.secret must be at least 16 bytes")
        if not _PREFIX_RE.match(self.prefix):
            raise ValueError("TransportConfig.prefix must match [a-z0-9][a-z0-9_]{0,31}")
        LeaseConfig(self.ttl_s, self.max_leases)  # validates both
        if self.ttl_s > self.limits.max_ttl_s:
            raise ValueError("TransportConfig.ttl_s exceeds limits.max_ttl_s")
        for name in ("staging_blocks", "replay_window"):
            if getattr(self, name) < 0:
                raise ValueError(f"TransportConfig.{name} must be >= 0")
        if not 0 < self.transfer_timeout_s <= 3600:
            raise ValueError("TransportConfig.transfer_timeout_s must be in (0, 3600]")

    @classmethod
    def from_dict(
        cls, data: Mapping[str, Any], secret: bytes, *, strings: bool = False, where: str = ""
    ) -> TransportConfig:
        """Build from parsed config (e.g. config.pbtxt parameters with ``strings``) and the deployment
        secret, which is never a setting; typed by :func:`disagg.config.build`, unknown keys are errors."""
        if "secret" in data:
            key = f"{where}.secret" if where else "secret"
            raise ConfigError(f"{key}: not a setting (the deployment secret is passed apart)")
        return build(cls, {**data, "secret": secret}, strings=strings, where=where)


@dataclass(frozen=True)
class ImportResult:
    """What the importer got. Its ack went back through the transport itself (unless a fault hook
    dropped it): the exporter's ``poll`` takes it in."""

    lease_id: str
    nbytes: int
    seconds: float


class Transport(ABC):
    """Base of every transport; see the module docstring for the protocol."""

    kind: ClassVar[str] = ""
    # True where ``close`` leaves something that only its objects' destructors release, so that the
    # process must tear its interpreter down at exit (see disagg.triton.entry.finalize_adapter)
    teardown_at_exit: ClassVar[bool] = False

    def __init__(
        self,
        config: TransportConfig,
        *,
        clock: Clock | None = None,
        on_release: ReleaseCallback | None = None,
    ) -> None:
        self.config = config
        self.origin = f"{config.prefix}.{self.kind}.{os.getpid()}.{secrets.token_hex(4)}"
        self.stats = TransferStats()
        self.hooks = TransferHooks()
        self._clock = clock or time.time
        self._lock = threading.Lock()
        self._closed = False
        self._regions: dict[str, Region] = {}
        self._staging: Staging | None = None
        self._consumed: OrderedDict[str, float] = OrderedDict()
        self._renewed: dict[str, tuple[int, float]] = {}  # importer: lease id -> (renewals, until)
        self._leases = LeaseTable(
            LeaseConfig(config.ttl_s, config.max_leases),
            on_release=self._on_lease_end,
            on_release_user=on_release,
        )
        self._reaper: threading.Thread | None = None
        self._reaper_stop = threading.Event()

    # ---- memory -------------------------------------------------------------------------

    def allocate_memory(self, num_blocks: int, block_bytes: int) -> torch.Tensor:
        """Allocate a ``[num_blocks, block_bytes]`` uint8 pool that exports without a copy.

        The engine views it as its typed block shape; it stays valid until ``close``.
        """
        self._check_open()
        for name, v in (("num_blocks", num_blocks), ("block_bytes", block_bytes)):
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"{name} must be a positive integer")
        region = self._allocate_region(num_blocks, block_bytes)
        with self._lock:
            self._regions[region.key] = region
        return region.pool

    # ---- exporter side ----------------------------------------------------------------

    def export_blocks(self, pool: torch.Tensor, block_ids: Sequence[int], layout: KVLayout) -> bytes:
        """Lease ``block_ids`` of ``pool`` and return a signed descriptor of them.

        ``layout.num_tokens`` tokens must fill exactly ``len(block_ids)`` blocks. A pool from
        ``allocate_memory`` is exported in place (the caller must not reuse these blocks until
        its ``on_release`` callback names the lease); any other pool is copied into staging
        blocks first (needs ``staging_blocks`` > 0). Raises ValueError on bad arguments.
        """
        self._check_open()
        if not isinstance(layout, KVLayout) or layout.num_tokens <= 0:
            raise ValueError("layout must be a KVLayout with num_tokens > 0")
        flat = as_block_bytes(pool)
        if flat.shape[1] != layout.block_bytes:
            raise ValueError("pool block size does not match the layout")
        ids = check_block_ids(block_ids, flat.shape[0])
        if len(ids) != layout.num_blocks:
            raise ValueError(f"{layout.num_tokens} tokens need {layout.num_blocks} blocks, got {len(ids)}")
        if len(ids) > self.config.limits.max_blocks or layout.byte_size > self.config.limits.max_bytes:
            raise ValueError("export exceeds the descriptor limits")
        region = self._region_of(flat)
        staged: list[int] | None = None
        if region is None:
            region, staged = self._stage(flat, ids, layout)
            ids = staged
        lease_id = new_lease_id()
        now = self._clock()
        try:
            checksum = None
            if self.config.checksum:
                checksum = {"alg": "blake2b-128", "hex": _digest(region.pool, to_runs(ids))}
            lease = self._leases.grant(lease_id, region.key, tuple(ids), now, layout.byte_size, staged)
        except BaseException:
            if staged is not None and self._staging is not None:
                self._staging.give(staged)
            raise
        desc = Descriptor(
            transport=self.kind,
            origin=self.origin,
            location=self._location(region),
            layout=layout,
            pool_blocks=region.num_blocks,
            block_ids=tuple(ids),
            lease_id=lease_id,
            issued_at=now,
            expires_at=lease.expires_at,
            checksum=checksum,
        )
        self._set_tags(region, ids, desc.tag)
        self.stats.add(exported=1, bytes_exported=layout.byte_size)
        return desc.sign(self.config.secret)

    def release(self, lease_id: str, reason: str = "ack") -> bool:
        """Release a lease (idempotent). True only for the call that released it."""
        done = self._leases.release(lease_id, reason)
        if reason == "ack":
            self.stats.add(**({"acks": 1} if done else {"stale_acks": 1}))
        return done

    def abort(self, lease_id: str) -> bool:
        """Give the blocks back now (the request was cancelled or failed). Idempotent."""
        done = self._leases.release(lease_id, "abort")
        if done:
            self.stats.add(aborts=1)
        return done

    def poll(self, now: float | None = None) -> int:
        """Take in native acks and renewals, then expire overdue leases; returns how many expired.

        A renewal keeps its lease for one more ``ttl_s`` from now (at most ``limits.max_ttl_s``
        after the export); it is taken in before expiry, so one that arrived in time always counts.
        """
        now = self._clock() if now is None else now
        acked, renewed = self._native_signals()
        for lease_id in acked:
            self.release(lease_id, "ack")
        for lease_id in renewed:
            if self._leases.extend(lease_id, now + self.config.ttl_s, self.config.limits.max_ttl_s):
                self.stats.add(lease_renewals=1)
        expired = self._leases.expire(now)
        if expired:
            self.stats.add(lease_expiries=len(expired))
        self._prune_consumed(now)
        return len(expired)

    def held_leases(self) -> int:
        return self._leases.held()

    def lease_ids(self) -> list[str]:
        return self._leases.live_ids()

    def start_reaper(self, interval_s: float = 0.5) -> None:
        """Call ``poll`` every ``interval_s`` on a daemon thread until ``close``."""
        if self._reaper is not None:
            return

        def loop() -> None:
            while not self._reaper_stop.wait(interval_s):
                try:
                    self.poll()
                except Exception:
                    log.exception("KV lease reaper poll failed")

        self._reaper = threading.Thread(target=loop, name=f"kv-reaper-{self.kind}", daemon=True)
        self._reaper.start()

    # ---- importer side ------------------------------------------------------------------

    def verify(self, token: bytes) -> Descriptor:
        """Check a descriptor without touching memory: signature, schema, limits, expiry, replay.
        The pool does this once, when the import is submitted; the import and the renewals then
        take the ``Descriptor`` and check only what time changes (``_live``)."""
        now = self._clock()
        try:
            desc = parse_descriptor(
                token, self.config.secret, self.config.limits, now, self.kind, self._until()
            )
            self._check_location(desc)
        except DescriptorError:
            self.stats.add(refused=1)
            raise
        self._check_unused(desc)
        return desc

    def _until(self) -> dict[str, float]:
        with self._lock:
            return {lid: until for lid, (_, until) in self._renewed.items()}

    def _check_unused(self, desc: Descriptor) -> None:
        with self._lock:
            if desc.lease_id in self._consumed:
                raise LeaseGone("descriptor was already used")

    def _live(self, descriptor: bytes | Descriptor) -> Descriptor:
        """``descriptor`` verified: a token in full, a ``Descriptor`` (verified by ``verify``) for
        what time changes since, its lease's expiry and whether it was used."""
        if not isinstance(descriptor, Descriptor):
            return self.verify(descriptor)
        check_live(descriptor.lease_id, descriptor.expires_at, self._clock(), self._until())
        self._check_unused(descriptor)
        return descriptor

    def renew(self, token: bytes | Descriptor) -> float:
        """Ask the exporter to keep this descriptor's blocks for one more lifetime: the request
        still waits for destination blocks to copy into. Returns the expiry this side now assumes
        (``verify`` and ``import_blocks`` accept the descriptor until then). Raises like ``verify``
        when the descriptor is refused, used or already expired; an exporter that did not take
        the renewal in time has dropped its tags, so a late import still fails cleanly (LeaseGone).
        """
        self._check_open()
        desc = self._live(token)
        until = self._clock() + (desc.expires_at - desc.issued_at)
        with self._lock:
            seq = self._renewed.get(desc.lease_id, (0, 0.0))[0] + 1
            self._renewed[desc.lease_id] = (seq, until)
        self._send_renewal(desc, seq)
        self.stats.add(renewals_sent=1)
        return until

    def import_blocks(
        self, token: bytes | Descriptor, pool: torch.Tensor, block_ids: Sequence[int]
    ) -> ImportResult:
        """Verify ``token`` (given a ``Descriptor`` from ``verify``: its lease's life only) and copy
        its blocks into ``block_ids`` of ``pool`` (one copy).

        Raises DescriptorError (refused, nothing copied), LeaseGone / LeaseExpired (the
        exporter no longer holds the blocks), TransferError / ChecksumMismatch (destination
        blocks are partial; the caller frees them). A failed import may be retried while the
        lease lives; a successful one cannot be repeated.
        """
        self._check_open()
        start = time.perf_counter()
        desc = self._live(token)
        dest = as_block_bytes(pool)
        if dest.shape[1] != desc.layout.block_bytes:
            raise ValueError("destination pool block size does not match the descriptor")
        ids = check_block_ids(block_ids, dest.shape[0], "destination block id")
        if len(ids) != len(desc.block_ids):
            raise ValueError("destination block count does not match the descriptor")
        with self._lock:
            if desc.lease_id in self._consumed:
                self.stats.add(refused=1)
                raise LeaseGone("descriptor was already used")
            until = max(desc.expires_at, self._renewed.get(desc.lease_id, (0, 0.0))[1])
            self._consumed[desc.lease_id] = until + self.config.limits.clock_skew_s
        send_ack = self.hooks.deliver_ack(desc)
        try:
            self.hooks.before_copy(desc)
            self._copy_in(desc, dest, ids)
            self.hooks.after_copy(desc, dest, ids)
            if desc.checksum is not None and _digest(dest, to_runs(ids)) != desc.checksum["hex"]:
                self.stats.add(checksum_failures=1)
                raise ChecksumMismatch("KV payload checksum mismatch")
        except BaseException as exc:
            self.stats.add(failures=1)
            with self._lock:  # no ack was sent: the caller may retry while the lease lives
                self._consumed.pop(desc.lease_id, None)
            if isinstance(exc, KVError) or not isinstance(exc, Exception):
                raise
            raise TransferError("KV transfer failed") from exc
        if send_ack:
            try:
                self._send_ack(desc, sign_ack(desc.lease_id, desc.origin, self.config.secret))
            except Exception:
                # The bytes are in place; the lease's TTL still frees them.
                log.warning("native KV ack could not be delivered", exc_info=True)
        with self._lock:
            self._renewed.pop(desc.lease_id, None)
        seconds = time.perf_counter() - start
        self.stats.add(imported=1, bytes_imported=desc.byte_size, transfer_seconds=seconds)
        return ImportResult(desc.lease_id, desc.byte_size, seconds)

    # ---- lifecycle ----------------------------------------------------------------------

    def close(self) -> None:
        """Release every lease (reason "closed"), stop the reaper, free all regions. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._reaper_stop.set()
        if self._reaper is not None:
            self._reaper.join(timeout=5)
        self._leases.release_all("closed")
        self._close_transport()
        with self._lock:
            regions, self._regions = list(self._regions.values()), {}
        for region in regions:
            try:
                region.close()
            except Exception:
                log.exception("closing a KV region failed")

    def __enter__(self) -> Transport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- subclass contract --------------------------------------------------------------

    @abstractmethod
    def _allocate_region(self, num_blocks: int, block_bytes: int) -> Region:
        """Allocate pool, tags and (if used) acks memory that the importer side can reach."""

    @abstractmethod
    def _location(self, region: Region) -> dict[str, Any]:
        """JSON-safe data the importer needs to reach ``region``."""

    @abstractmethod
    def _check_location(self, desc: Descriptor) -> None:
        """Validate ``desc.location`` without touching memory; raise DescriptorError."""

    @abstractmethod
    def _copy_in(self, desc: Descriptor, dest: torch.Tensor, dest_ids: list[int]) -> None:
        """Check tags, copy every block (calling ``hooks.after_run`` per run), re-check tags."""

    def _send_ack(self, desc: Descriptor, ack: bytes) -> None:  # noqa: B027 - optional hook
        """Deliver ``ack`` to the exporter through the transport itself, if it can."""

    def _native_signals(self) -> tuple[list[str], list[str]]:
        """Lease ids acked, and lease ids renewed, through the transport itself since the last call."""
        return [], []

    def _send_renewal(self, desc: Descriptor, seq: int) -> None:
        """Deliver the ``seq``-th renewal of ``desc``'s lease to its exporter (``renew``)."""
        raise TransferError(f"the {self.kind} transport cannot renew KV leases")

    def _close_transport(self) -> None:  # noqa: B027 - optional hook, no-op by default
        """Free importer-side resources (mappings, connections)."""

    # ---- shared helpers -----------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise TransportClosed("KV transport is closed")

    def _region_of(self, flat: torch.Tensor) -> Region | None:
        ptr, nbytes = flat.data_ptr(), flat.numel()
        with self._lock:
            for region in self._regions.values():
                if region.pool.data_ptr() == ptr and region.pool.numel() == nbytes:
                    return region
        return None

    def _stage(self, flat: torch.Tensor, ids: list[int], layout: KVLayout) -> tuple[Region, list[int]]:
        if self.config.staging_blocks == 0:
            raise ValueError("pool was not allocated by this transport and staging is disabled")
        with self._lock:
            staging = self._staging
        if staging is None:
            region = self._allocate_region(self.config.staging_blocks, layout.block_bytes)
            with self._lock:
                if self._staging is None:
                    self._regions[region.key] = region
                    self._staging = Staging(region)
                    region = None  # type: ignore[assignment]
                staging = self._staging
            if region is not None:
                region.close()
        if staging.region.block_bytes != layout.block_bytes:
            raise ValueError("staging blocks were sized for another layout")
        staged = staging.take(len(ids))
        src = torch.as_tensor(ids, dtype=torch.long, device=flat.device)
        dst = torch.as_tensor(staged, dtype=torch.long, device=staging.region.pool.device)
        staging.region.pool.index_copy_(0, dst, flat.index_select(0, src).to(staging.region.pool.device))
        return staging.region, staged

    def _set_tags(self, region: Region, ids: Sequence[int], tag: int) -> None:
        idx = torch.as_tensor(list(ids), dtype=torch.long, device=region.tags.device)
        region.tags.index_fill_(0, idx, tag)

    def _on_lease_end(self, lease: Lease, reason: str) -> None:
        with self._lock:
            region = self._regions.get(str(lease.region))
            staging = self._staging
        if region is not None:
            # Clear tags before the engine may reuse the blocks (its callback runs after this).
            self._set_tags(region, lease.block_ids, 0)
        if lease.context is not None and staging is not None:
            staging.give(lease.context)

    def _prune_consumed(self, now: float) -> None:
        with self._lock:
            while self._consumed:
                _lease_id, until = next(iter(self._consumed.items()))
                if until > now and len(self._consumed) <= self.config.replay_window:
                    break
                self._consumed.popitem(last=False)
            for lease_id in [lid for lid, (_, until) in self._renewed.items() if until <= now]:
                del self._renewed[lease_id]


def _digest(pool: torch.Tensor, runs: list[tuple[int, int]]) -> str:
    h = hashlib.blake2b(digest_size=16)
    for start, count in runs:
        chunk = pool[start : start + count]
        if chunk.device.type != "cpu":
            chunk = chunk.cpu()
        h.update(memoryview(chunk.contiguous().numpy()).cast("B"))
    return h.hexdigest()


# ---- registry -----------------------------------------------------------------------------

Factory = Callable[..., Transport]


def _builtin(module: str, name: str) -> Callable[[], Factory]:
    """A loader that imports ``module`` only when its kind is created (NIXL imports are heavy)."""

    def load() -> Factory:
        return getattr(importlib.import_module(module), name)

    return load


# The built-in kinds are known from the first import of this module, however it is reached
# (``disagg.kv`` or ``disagg.kv.transport``); their modules load on first use.
_REGISTRY: dict[str, Callable[[], Factory]] = {
    "cuda_ipc": _builtin("disagg.kv.cuda_ipc", "CudaIpcTransport"),
    "fake": _builtin("disagg.kv.fake", "FakeTransport"),
    "nixl": _builtin("disagg.kv.nixl", "NixlTransport"),
    "shm": _builtin("disagg.kv.shm", "ShmTransport"),
}


def register_transport(kind: str, loader: Callable[[], Factory]) -> None:
    """Register a transport kind; ``loader`` returns its class lazily (NIXL imports are heavy)."""
    _REGISTRY[kind] = loader


def transport_kinds() -> list[str]:
    return sorted(_REGISTRY)


def create_transport(kind: str, config: TransportConfig, **kwargs: Any) -> Transport:
    """Create a transport by kind name (``shm``, ``nixl``, ``cuda_ipc``, ``fake``)."""
    if kind not in _REGISTRY:
        raise ValueError(f"unknown KV transport {kind!r}; known: {transport_kinds()}")
    return _REGISTRY[kind]()(config, **kwargs)
