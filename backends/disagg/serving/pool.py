"""Building one pool instance: engine + (for prefill/decode) a KV transport + its engine loop."""

from __future__ import annotations

import os
from dataclasses import dataclass, fields
from typing import Any

from disagg.engine.engine import Engine, EngineConfig, plan_kv
from disagg.kv.transport import Transport, TransportConfig, create_transport
from disagg.serving.loop import ROLES, EngineLoop


@dataclass(frozen=True)
class PoolConfig:
    """One pool instance. ``engine`` settings as EngineConfig; the rest is serving policy."""

    role: str
    engine: EngineConfig
    transport: str = "shm"
    lease_ttl_s: float = 30.0
    checksum: bool = False
    max_queue: int = 256
    # Scheduling niceness of the whole instance process (0..19). A prefill pool sharing its cores with
    # the token relay (orchestrator, text steps, Triton's own threads) runs nicer, so relaying a
    # token preempts a long prefill at once instead of waiting out its time slice.
    nice: int = 0
    # Names the deployment's KV regions; exporter and importer must agree (one per deployment).
    prefix: str = "disagg"

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}")
        if not 0 < self.lease_ttl_s <= 3600:
            raise ValueError("lease_ttl_s must be in (0, 3600]")
        if not isinstance(self.max_queue, int) or self.max_queue < 1:
            raise ValueError("max_queue must be a positive integer")
        if not isinstance(self.nice, int) or not 0 <= self.nice <= 19:
            raise ValueError("nice must be an integer in [0, 19]")

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PoolConfig:
        """From flat parameters (config.pbtxt); engine keys go to EngineConfig; unknown keys are errors."""
        mine = {f.name for f in fields(cls)} - {"engine"}
        engine_keys = {f.name for f in fields(EngineConfig)}
        unknown = set(data) - mine - engine_keys
        if unknown:
            raise ValueError(f"unknown pool parameter(s): {sorted(unknown)}")
        engine = EngineConfig.from_dict({k: v for k, v in data.items() if k in engine_keys})
        return cls(engine=engine, **{k: v for k, v in data.items() if k in mine})


def transport_options(config: PoolConfig) -> dict[str, Any]:
    """Transport settings that follow from the engine: ``cuda_ipc`` regions live on its GPU."""
    if config.transport != "cuda_ipc":
        return {}
    from disagg.kv.cuda_ipc import CudaIpcConfig

    device = config.engine.device
    return {"cuda": CudaIpcConfig(device=device if ":" in device else f"{device}:0")}


def build_pool(config: PoolConfig, secret: bytes) -> tuple[EngineLoop, Transport | None]:
    """Create the engine (its KV memory from the transport for prefill), the transport, the loop.

    The caller starts the loop and, on shutdown, stops it and closes the transport.
    """
    if config.nice:
        os.setpriority(os.PRIO_PROCESS, 0, max(os.getpriority(os.PRIO_PROCESS, 0), config.nice))
    transport: Transport | None = None
    relay: list[EngineLoop] = []
    if config.role in ("prefill", "decode"):
        transport = create_transport(
            config.transport,
            TransportConfig(
                secret=secret, prefix=config.prefix, ttl_s=config.lease_ttl_s, checksum=config.checksum
            ),
            # the loop exists only after the engine, which needs the transport's memory first
            on_release=lambda lease_id, reason: relay[0].lease_released(lease_id, reason) if relay else None,
            **transport_options(config),
        )
    try:
        memory = None
        if config.role == "prefill":
            layout, num_blocks = plan_kv(config.engine)
            memory = transport.allocate_pool(num_blocks, layout.block_bytes)  # type: ignore[union-attr]
        engine = Engine(config.engine, kv_memory=memory)
        loop = EngineLoop(engine, config.role, transport, max_queue=config.max_queue)
    except BaseException:
        if transport is not None:
            transport.close()
        raise
    relay.append(loop)
    if transport is not None and config.role == "prefill":
        transport.start_reaper(0.01)  # takes in native acks and expires leases
    return loop, transport
