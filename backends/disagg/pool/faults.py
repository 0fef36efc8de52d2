"""Faults a pool can be started with, for live reliability tests (RELIABILITY.md B1-B6, D3).

Off unless ``DISAGG_FAULTS`` names some, and refused unless ``DISAGG_ALLOW_FAULTS=1`` is set too (a
test's flag: a production server never starts with faults by mistake). Read once, when a pool
instance is built (``disagg.pool.instance.build_instance``); nothing switches them later.

``DISAGG_FAULTS`` is a comma-separated list of ``SEED=FAULT[:SECONDS][@POOL]``: the fault strikes only
the requests whose sampling ``seed`` (the ``random_seed`` input, the OpenAI ``seed``) is SEED, so that
one server serves several faults and every other request runs clean beside them, and with ``@POOL``
(prefill, decode or colocated) only in the pools of that role: a request whose fault breaks its
engine would otherwise break each pool it migrates to. The faults:

- ``drop_ack``: the decode pool imports the KV but never acks it: the prefill pool keeps the blocks
  until the lease expires (B1);
- ``fail_copy``: the import fails after its first run of blocks, the rest uncopied (B3);
- ``corrupt``: a byte of the first imported block is flipped after the copy (B5; caught with
  ``kv.checksum`` on);
- ``delay:S``: the import waits S seconds before its first byte moves (a slow link, B6; longer than
  the lease, a late read, B2);
- ``step_error``: the first decode step after the sequence joins the batch fails it alone, as an
  engine that lost one stream does (``SequenceFailed``); the batch's other sequences carry on (D3);
- ``step_fatal``: that step raises: the engine is lost, every request of the pool fails and the pool
  stops serving (D3);
- ``slow_prefill:S``: each prefill call of the sequence's prompt waits S seconds first (a prompt still
  being prefilled when its client cancels, C2).

The KV faults act where KV is imported (a decode pool), through the transport's named hook points
(``disagg.kv.faulty``); the step faults wherever the sequence decodes. Nothing else of the engine
changes: ``FaultyBackend`` passes every other call through.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from disagg.engine.backend import EngineBackend, Imported
from disagg.engine.errors import SequenceFailed
from disagg.engine.sequence import Request, SequenceState, StepOutput
from disagg.kv.descriptor import Descriptor
from disagg.kv.faulty import FaultConfig, FaultHooks
from disagg.role import Role

log = logging.getLogger(__name__)

ENV_FAULTS = "DISAGG_FAULTS"
ENV_ALLOW = "DISAGG_ALLOW_FAULTS"
KV_FAULTS = ("drop_ack", "fail_copy", "corrupt", "delay")
STEP_FAULTS = ("step_error", "step_fatal")
TIMED = ("delay", "slow_prefill")  # the faults that take seconds


class FaultError(ValueError):
    """A fault list that cannot be read, or faults without the test flag."""


class EngineFault(RuntimeError):
    """The engine step an injected ``step_fatal`` fault broke."""


@dataclass(frozen=True)
class Fault:
    """One fault and the sampling seed of the requests it strikes."""

    seed: int
    kind: str
    seconds: float = 0.0
    role: Role | None = None  # the pools it strikes in (None: every pool)

    def __str__(self) -> str:
        """The fault as ``DISAGG_FAULTS`` spells it: ``SEED=KIND[:SECONDS][@POOL]``."""
        seconds = f":{self.seconds:g}" if self.kind in TIMED else ""
        role = f"@{self.role.value}" if self.role is not None else ""
        return f"{self.seed}={self.kind}{seconds}{role}"

    @property
    def kv(self) -> FaultConfig | None:
        """The transport faults of an import it strikes, or None (a step fault)."""
        if self.kind not in KV_FAULTS:
            return None
        return FaultConfig(
            delay_s=self.seconds,
            fail_after_run=0 if self.kind == "fail_copy" else None,
            corrupt=self.kind == "corrupt",
            drop_ack=self.kind == "drop_ack",
        )


def parse(text: str) -> dict[int, Fault]:
    """``SEED=FAULT[:SECONDS][@POOL],...`` as one fault per seed; FaultError naming the entry it cannot
    read."""
    faults: dict[int, Fault] = {}
    for entry in filter(None, (part.strip() for part in text.split(","))):
        seed_text, _, spec = entry.partition("=")
        spec, _, role = spec.partition("@")
        kind, _, value = spec.partition(":")
        if not seed_text.strip().isdigit() or int(seed_text) == 0:
            raise FaultError(f"{ENV_FAULTS} entry {entry!r}: the seed must be a positive integer")
        known = (*KV_FAULTS, *STEP_FAULTS, "slow_prefill")
        if kind not in known:
            raise FaultError(
                f"{ENV_FAULTS} entry {entry!r}: unknown fault {kind!r} (one of {', '.join(known)})"
            )
        if (kind in TIMED) != bool(value):
            raise FaultError(
                f"{ENV_FAULTS} entry {entry!r}: delay and slow_prefill take seconds (KIND:S), no other"
            )
        try:
            seconds = float(value) if value else 0.0
            fault = Fault(int(seed_text), kind, seconds, Role.parse(role) if role else None)
            FaultConfig(delay_s=seconds)  # validates the seconds
        except ValueError as exc:
            raise FaultError(f"{ENV_FAULTS} entry {entry!r}: {exc}") from None
        if fault.seed in faults:
            raise FaultError(f"{ENV_FAULTS} entry {entry!r}: seed {fault.seed} has a fault already")
        faults[fault.seed] = fault
    return faults


def from_environment(role: Role, env: Mapping[str, str] | None = None) -> dict[int, Fault]:
    """The faults the environment asks for in a pool of ``role`` ({} when none); FaultError when it
    asks for any without the test flag, or cannot be read."""
    env = os.environ if env is None else env
    every = parse(env.get(ENV_FAULTS, ""))
    faults = {seed: f for seed, f in every.items() if f.role in (None, role)}
    if every and env.get(ENV_ALLOW) != "1":
        raise FaultError(f"{ENV_FAULTS} is set but {ENV_ALLOW}=1 is not: faults are for tests only")
    return faults


class FaultyBackend:
    """``inner`` with ``faults`` striking the requests of their seeds; every other attribute is
    ``inner``'s. Driven by the pool's engine thread, as any backend."""

    def __init__(self, inner: EngineBackend, faults: Mapping[int, Fault], sleep: Any = time.sleep) -> None:
        self.inner = inner
        self.faults = dict(faults)
        self._sleep = sleep
        self._pending: dict[int, Fault] = {}  # started sequences a step fault waits for, until prefilled
        self._armed: dict[int, Fault] = {}  # sequences in the decode batch a step fault strikes next step
        self._slow: dict[int, float] = {}  # started sequences whose prefill calls wait first (seconds)
        log.warning(
            "pool started with injected faults: %s", sorted(self.faults.values(), key=lambda f: f.seed)
        )

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def _step_fault(self, params_seed: int) -> Fault | None:
        fault = self.faults.get(params_seed)
        return fault if fault is not None and fault.kind in STEP_FAULTS else None

    def start(self, request: Request, *, decode: bool) -> int:
        seq_id = self.inner.start(request, decode=decode)
        fault = self.faults.get(request.params.seed)
        if fault is not None and fault.kind == "slow_prefill":
            self._slow[seq_id] = fault.seconds
        elif fault is not None and fault.kind in STEP_FAULTS and decode:
            self._pending[seq_id] = fault
        return seq_id

    def prefill_chunk(self, seq_id: int, max_tokens: int) -> StepOutput | None:
        self._wait_for([seq_id])
        output = self.inner.prefill_chunk(seq_id, max_tokens)
        if output is not None:
            self._joined(seq_id)
        return output

    def import_sequence(
        self, state: SequenceState, descriptor: bytes | Descriptor, transport: Any
    ) -> Imported:
        fault = self.faults.get(state.params.seed)
        kv = fault.kv if fault is not None else None
        if kv is None:
            imported = self.inner.import_sequence(state, descriptor, transport)
        else:
            log.warning("injected fault %s on an import", fault)
            before = transport.hooks
            transport.hooks = FaultHooks(kv, self._sleep)
            try:
                imported = self.inner.import_sequence(state, descriptor, transport)
            finally:
                transport.hooks = before
        step = self._step_fault(state.params.seed)
        if step is not None:
            self._armed[imported.seq_id] = step
        return imported

    def decode_step(self) -> list[StepOutput]:
        self._strike()
        return self.inner.decode_step()

    def step(
        self, chunks: list[tuple[int, int]], *, decode: bool = True
    ) -> tuple[list[StepOutput], list[StepOutput | None]]:
        if decode:
            self._strike()
        self._wait_for([seq_id for seq_id, _ in chunks])
        outputs, firsts = self.inner.step(chunks, decode=decode)
        for (seq_id, _), first in zip(chunks, firsts, strict=True):
            if first is not None:
                self._joined(seq_id)
        return outputs, firsts

    def free(self, seq_id: int) -> bool:
        self._pending.pop(seq_id, None)
        self._armed.pop(seq_id, None)
        self._slow.pop(seq_id, None)
        return self.inner.free(seq_id)

    def _wait_for(self, seq_ids: list[int]) -> None:
        seconds = max((self._slow.get(seq_id, 0.0) for seq_id in seq_ids), default=0.0)
        if seconds:
            self._sleep(seconds)

    def _joined(self, seq_id: int) -> None:
        fault = self._pending.pop(seq_id, None)
        if fault is not None:
            self._armed[seq_id] = fault

    def _strike(self) -> None:
        """Before a decode step: a ``step_fatal`` armed raises; ``step_error``s free their sequences
        and name them lost, as an engine that lost those streams (the rest step next call)."""
        if not self._armed:
            return
        if any(f.kind == "step_fatal" for f in self._armed.values()):
            self._armed.clear()
            raise EngineFault("engine step failed (injected fault step_fatal)")
        lost = list(self._armed)
        self._armed.clear()
        for seq_id in lost:
            self.inner.free(seq_id)
        log.warning("injected fault step_error: sequences %s lost", lost)
        raise SequenceFailed(lost)
