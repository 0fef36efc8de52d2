from __future__ import annotations

import os
import secrets
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from local_pools import LocalPools

from disagg.engine.engine import EngineConfig
from disagg.engine.tokenizer import Tokenizer
from disagg.kv.settings import KVSettings
from disagg.pool.instance import PoolConfig, build_instance
from disagg.pool.loop import EngineLoop
from disagg.serving.orchestrator import Orchestrator, OrchestratorConfig


@dataclass
class Deployment:
    tokenizer: Tokenizer
    loops: dict[str, EngineLoop]
    transports: list
    pools: LocalPools

    def orchestrator(self, mode: str = "disaggregated", **kw) -> Orchestrator:
        return Orchestrator(OrchestratorConfig(mode=mode, **kw), self.pools, self.tokenizer.decode)

    def clean(self) -> bool:
        """Every block back, no lease held, nothing queued."""
        return all(
            loop.engine.kv.free_blocks == loop.engine.kv.num_blocks
            and not loop.engine.held_sequences()
            and loop.stats().queued == 0
            for loop in self.loops.values()
        ) and all(t.held_leases() == 0 for t in self.transports)


@pytest.fixture(scope="module")
def deployment(tiny_model_dir) -> Iterator[Deployment]:
    secret = secrets.token_bytes(32)
    prefix = f"t{os.getpid()}"
    built = {}
    for role in ("prefill", "decode", "colocated"):
        engine = EngineConfig(model_dir=tiny_model_dir, num_blocks=96, block_size=16)
        built[role] = build_instance(
            PoolConfig(role=role, engine=engine, kv=KVSettings(lease_ttl_s=5.0), prefix=prefix), secret
        )
    loops = {role: loop.start() for role, (loop, _) in built.items()}
    transports = [t for _, t in built.values() if t is not None]
    yield Deployment(Tokenizer(tiny_model_dir), loops, transports, LocalPools(**loops))
    for loop in loops.values():
        loop.shutdown()
    for transport in transports:
        transport.close()
