"""The orchestrator's one PoolClient: each pool reached over BLS (a model of this server) or over gRPC
(``disagg.triton.remote``: servers on other hosts), as the orchestrator's ``remote_pools`` says."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any

from disagg.engine.sequence import Request, SequenceState
from disagg.protocol.messages import PoolLoad, Prefilled, Token
from disagg.triton.bls import TritonPools
from disagg.triton.graveyard import Graveyard
from disagg.triton.remote import RemotePools


class Pools:
    def __init__(self, local: TritonPools, remote: RemotePools | None = None) -> None:
        self.local = local
        self.remote = remote

    def is_remote(self, pool: str) -> bool:
        return self.remote is not None and pool in self.remote

    def _for(self, pool: str) -> Any:
        return self.remote if self.is_remote(pool) else self.local

    @property
    def graveyard(self) -> Graveyard:
        return self.local.graveyard

    @property
    def overloaded(self) -> Callable[[str], bool]:
        return self.local.overloaded

    @overloaded.setter
    def overloaded(self, judge: Callable[[str], bool]) -> None:
        self.local.overloaded = judge  # a remote call is not probed while overdue: keepalive is

    @property
    def open_calls(self) -> int:
        return self.local.open_calls + (self.remote.open_calls if self.remote is not None else 0)

    def pool_lost(self, pool: str) -> None:
        self._for(pool).pool_lost(pool)

    async def prefill(self, handle: str, request: Request) -> Prefilled:
        return await self._for("prefill").prefill(handle, request)

    def decode(
        self, handle: str, state: SequenceState, descriptor: bytes, pool: str = "decode"
    ) -> AsyncIterator[Token]:
        return self._for(pool).decode(handle, state, descriptor, pool)

    def generate(self, handle: str, request: Request, pool: str = "colocated") -> AsyncIterator[Token]:
        return self._for(pool).generate(handle, request, pool)

    async def stop(self, pool: str, handle: str) -> None:
        await self._for(pool).stop(pool, handle)

    async def ping(self, pool: str) -> PoolLoad:
        return await self._for(pool).ping(pool)

    def close(self) -> None:
        """Close both clients; the remote one's channels on the running loop if there is one."""
        self.local.close()
        if self.remote is not None:
            with contextlib.suppress(RuntimeError):  # no running loop: the channels go with the process
                asyncio.get_running_loop().create_task(self.remote.close())
