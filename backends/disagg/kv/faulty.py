"""A fault-injecting wrapper around any transport, for tests (RELIABILITY.md B3-B6).

Faults go through the named hook points of ``hooks.TransferHooks`` in our own code; nothing
is patched. ``set_faults`` switches them at any time; each applies to every import while set.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from disagg.kv.descriptor import Descriptor
from disagg.kv.errors import TransferError
from disagg.kv.hooks import TransferHooks
from disagg.kv.transport import Transport


@dataclass(frozen=True)
class FaultConfig:
    """``delay_s``: added before each copy; ``fail_after_run``: raise after that run index
    (later runs stay uncopied); ``corrupt``: flip a byte of the first destination block;
    ``drop_ack``: the importer never acks."""

    delay_s: float = 0.0
    fail_after_run: int | None = None
    corrupt: bool = False
    drop_ack: bool = False

    def __post_init__(self) -> None:
        """Ranges; the types are trusted (tests build it in code, ``disagg.pool.faults`` from the
        numbers it parsed)."""
        if not 0 <= self.delay_s <= 60:
            raise ValueError("FaultConfig.delay_s must be in [0, 60]")
        if self.fail_after_run is not None and self.fail_after_run < 0:
            raise ValueError("FaultConfig.fail_after_run must be None or >= 0")


class FaultHooks(TransferHooks):
    def __init__(self, faults: FaultConfig, sleep: Callable[[float], None]) -> None:
        self.faults = faults
        self._sleep = sleep

    def before_copy(self, desc: Descriptor) -> None:
        if self.faults.delay_s:
            self._sleep(self.faults.delay_s)

    def after_run(self, index: int, total: int) -> None:
        if self.faults.fail_after_run is not None and index >= self.faults.fail_after_run:
            raise TransferError("KV transfer failed (injected)")

    def after_copy(self, desc: Descriptor, dest: torch.Tensor, dest_ids: Sequence[int]) -> None:
        if self.faults.corrupt:
            dest[dest_ids[0], 0] ^= 0xFF

    def deliver_ack(self, desc: Descriptor) -> bool:
        return not self.faults.drop_ack


class FaultyTransport:
    """Behaves as ``inner`` (every attribute, ``kind`` too, is delegated), with faults on import."""

    def __init__(
        self, inner: Transport, faults: FaultConfig | None = None, sleep: Callable[[float], None] = time.sleep
    ) -> None:
        self.inner = inner
        self._hooks = FaultHooks(faults or FaultConfig(), sleep)
        inner.hooks = self._hooks

    def set_faults(self, faults: FaultConfig) -> None:
        self._hooks.faults = faults

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def __enter__(self) -> FaultyTransport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.inner.close()
