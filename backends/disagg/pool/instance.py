"""Building one pool instance: engine + (for prefill/decode) a KV transport + its engine loop."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any, ClassVar

from disagg.config import ConfigError, build
from disagg.engine import kernel
from disagg.engine.engine import Engine, EngineConfig, plan_kv
from disagg.engine.loan import Borrower, Lender, Loans
from disagg.kv.settings import ENGINE_FIELDS, TRANSPORT_FIELDS, KVSettings
from disagg.kv.transport import Transport, TransportConfig, create_transport
from disagg.loanpath import loan_scope
from disagg.pool import faults
from disagg.pool.loop import EngineLoop
from disagg.pool.settings import ConditionalPrefill
from disagg.role import Role
from disagg.scheduling import SchedulerConfig, create_scheduler
from disagg.scheduling.pacing import Pacing
from disagg.scheduling.tuner import BatchTuner, TunerConfig

_ENGINE_DEFAULTS = {f.name: f.default for f in fields(EngineConfig)}
PREFILL_TOKENS = 4096  # a pool's prompt tokens per step, unless it says otherwise


@dataclass(frozen=True)
class PoolConfig:
    """One pool instance. ``engine`` settings as EngineConfig, but for its KV part, which is the ``kv``
    section's (``disagg.kv.settings``); the rest is serving policy."""

    RENAMED: ClassVar[dict[str, str]] = {
        "local_generate": "local_decode",
        "local_prefill_tokens": "conditional.prefill_tokens",
        **{engine: f"kv.{name}" for name, engine in ENGINE_FIELDS.items()},
        **{name: f"kv.{name}" for name in TRANSPORT_FIELDS},
    }  # old config.pbtxt parameter -> its name now (config.build)

    role: Role
    engine: EngineConfig
    kv: KVSettings = field(default_factory=KVSettings)
    """The KV cache and its hand-off (config.pbtxt: ``kv.cache_mb``, ``kv.transport``, ...); the
    engine's KV fields are built from it (``_engine_kv``)."""
    max_queue: int = 256
    # prompt tokens per engine step, and whether prompts are cut into chunks to fill it exactly (see
    # disagg.scheduling.SchedulerConfig); chunking bounds how long one prompt stalls a colocated batch
    max_prefill_tokens: int = PREFILL_TOKENS
    chunked_prefill: bool = False
    # A prefill pool that also decodes what it prefilled, when the orchestrator sends it whole requests
    # (its fallback while the decode pool is gone or saturated); prefill pools only. The spec's name
    # (pools.prefill.local_decode); config.pbtxt's "local_generate" still works for this release
    local_decode: bool = False
    conditional: ConditionalPrefill = field(default_factory=ConditionalPrefill)
    """A decode pool's conditional disaggregation (config.pbtxt: ``conditional.prefill_tokens``,
    ``conditional.chunk_tokens``): on, its prompts' chunk is its prefill budget per step."""
    # A decode pool's head import waiting for KV blocks is passed by smaller ones that fit at most
    # this many times (see disagg.scheduling.decode; 0: strict FIFO)
    max_overtakes: int = 16
    # Scheduling niceness of the whole instance process (0..19). A prefill pool sharing its cores with
    # the token relay (orchestrator, text steps, Triton's own threads) runs nicer, so relaying a
    # token preempts a long prefill at once instead of waiting out its time slice.
    nice: int = 0
    # Names the deployment's KV regions; exporter and importer must agree (one per deployment).
    prefix: str = "disagg"
    # nixl only: run NIXL's progress thread. It polls without pause and takes its share of the pool's
    # cores (measured: twice the step times on two cores); without it an importer drives its own
    # transfers and an exporter's are progressed by its reaper every 10 ms (a hand-off takes 5-30 ms
    # longer; perf/kv_transfer_bench.py, nixl against nixl-quiet). Turn it on where a core is spare.
    nixl_progress_thread: bool = False
    # One prompt of this many tokens prefilled (and dropped) before the instance serves: the first
    # call's costs are paid before any request's, and the pool's prefill speed is in its first load
    # report, so admission by capacity has an estimate before traffic comes (0: off)
    warm_up_tokens: int = 256
    # The decode batch tuner (disagg.scheduling.tuner), decode pools only: on when batch_tpot_slo_s > 0,
    # the TPOT its limit is tuned under; batch_start is its first limit (0: max_batch_size; the knee
    # that `disagg profile --tpot-slo` prints), batch_min its lowest, batch_interval_s its period
    batch_tpot_slo_s: float = 0.0
    batch_start: int = 0
    batch_min: int = 1
    batch_interval_s: float = 1.0
    # Core loans (disagg.engine.loan), on one server: a prefill pool borrows these cores of the decode
    # pool while it lends them; the decode pool lends these of its cores while it is idle and, while
    # prompts wait, after each step for what is left of lend_tpot_s (its step plus the time lent, per
    # token; 0: it lends while idle only)
    borrow: tuple[int, ...] = ()
    lend: tuple[int, ...] = ()
    lend_tpot_s: float = 0.0

    def __post_init__(self) -> None:
        """Ranges and consistency; the types are ``config.build``'s (a config built by hand in code is
        trusted to be typed; ``role`` may be given by name)."""
        object.__setattr__(self, "role", Role.parse(self.role))
        object.__setattr__(self, "engine", self._engine_kv())
        self.scheduling()  # validates the scheduler's settings
        if self.local_decode and self.role is not Role.PREFILL:
            raise ValueError("local_decode is a prefill pool's setting")
        if self.conditional.enabled and self.role is not Role.DECODE:
            raise ValueError("conditional.prefill_tokens is a decode pool's setting")
        if self.conditional.enabled and (self.chunked_prefill or self.max_prefill_tokens != PREFILL_TOKENS):
            raise ValueError(
                "max_prefill_tokens / chunked_prefill: a decode pool's prompts are chunked by "
                "conditional.chunk_tokens; give that"
            )
        if not 0 <= self.nice <= 19:
            raise ValueError("nice must be in [0, 19]")
        if not 0 <= self.warm_up_tokens <= 8192:
            raise ValueError("warm_up_tokens must be in [0, 8192]")
        if self.tuning().enabled and self.role is not Role.DECODE:
            raise ValueError("batch_tpot_slo_s (the batch tuner) is a decode pool's setting")
        if self.batch_start > self.engine.max_batch_size:
            raise ValueError(f"batch_start must be at most max_batch_size ({self.engine.max_batch_size})")
        self._check_loans()

    def _engine_kv(self) -> EngineConfig:
        """``engine`` with its KV part from the ``kv`` section, the one place a pool's KV is set: an
        engine KV field given otherwise than the section says (not its engine default) is refused, so a
        setting is never dropped unseen."""
        given = self.engine
        built = replace(given, **self.kv.engine_values())
        for name, engine in ENGINE_FIELDS.items():
            value = getattr(given, engine)
            unset = given.dtype if engine == "kv_dtype" else _ENGINE_DEFAULTS[engine]
            if value != getattr(built, engine) and value != unset:
                raise ValueError(f"engine.{engine}: a pool's KV is its kv section's: give kv.{name}")
        return built

    def _check_loans(self) -> None:
        own = set(self.engine.cores or ())
        if self.borrow and self.role is not Role.PREFILL:
            raise ValueError("borrow is a prefill pool's setting (it borrows the decode pool's cores)")
        if (self.lend or self.lend_tpot_s) and self.role is not Role.DECODE:
            raise ValueError("lend and lend_tpot_s are a decode pool's settings")
        if (self.borrow or self.lend) and self.engine.device != "cpu":
            raise ValueError("core loans are for CPU pools")
        for core in self.borrow:
            if core in own:
                raise ValueError(f"borrow: core {core} is this pool's own")
        for core in self.lend:
            if core not in own:
                raise ValueError(f"lend: core {core} is not this pool's (cores {sorted(own)})")
        if not self.lend_tpot_s >= 0:
            raise ValueError("lend_tpot_s must be a number of seconds >= 0")

    def tuning(self) -> TunerConfig:
        return TunerConfig(
            tpot_slo_s=self.batch_tpot_slo_s,
            start=self.batch_start,
            min_batch=self.batch_min,
            interval_s=self.batch_interval_s,
        )

    def scheduling(self) -> SchedulerConfig:
        conditional = self.conditional
        return SchedulerConfig(
            self.max_queue,
            conditional.chunk_tokens if conditional.enabled else self.max_prefill_tokens,
            conditional.enabled or self.chunked_prefill,
            self.local_decode,
            conditional.prefill_tokens,
            self.max_overtakes,
        )

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, strings: bool = False) -> PoolConfig:
        """From flat parameters (config.pbtxt ones with ``strings``): EngineConfig's keys make ``engine``
        (but for its KV part: ``kv.<field>``, and under their old flat names ``RENAMED``), the rest are
        this class's. Typed by :func:`disagg.config.build`; unknown keys are errors (``ConfigError``, a
        ``ValueError``, naming the key: ``engine.max_batch_size``, ``kv.block_size``)."""
        engine_keys = {f.name for f in fields(EngineConfig)} - set(ENGINE_FIELDS.values())
        if "local_prefill_tokens" in data and "conditional.chunk_tokens" not in data:
            # an older decode pool: its conditional prompts' chunk was its max_prefill_tokens, chunked
            data = dict(data)
            data.pop("chunked_prefill", None)
            if "max_prefill_tokens" in data:
                data["conditional.chunk_tokens"] = data.pop("max_prefill_tokens")
        own = {k: v for k, v in data.items() if k not in engine_keys}
        flat = {k: v for k, v in data.items() if k in engine_keys}
        if "engine" not in own:
            own["engine"] = flat
        elif flat:
            raise ConfigError("engine: give the engine settings flat or as one mapping, not both")
        return build(cls, own, strings=strings)


def transport_options(config: PoolConfig) -> dict[str, Any]:
    """Transport settings that follow from the pool: ``cuda_ipc`` regions live on its engine's GPU;
    ``nixl`` runs its progress thread only where ``nixl_progress_thread`` says so."""
    if config.kv.transport == "nixl":
        from disagg.kv.nixl import NixlConfig

        return {"nixl": NixlConfig(progress_thread=config.nixl_progress_thread)}
    if config.kv.transport != "cuda_ipc":
        return {}
    from disagg.kv.cuda_ipc import CudaIpcConfig

    device = config.engine.device
    return {"cuda": CudaIpcConfig(device=device if ":" in device else f"{device}:0")}


def loans(config: PoolConfig, name: str, version: int = 1) -> Loans | None:
    """The pool's side of its core loans (``disagg.engine.loan``), or None; LoanError (a ValueError)
    naming a core that cannot be borrowed or lent here. A borrowing pool's kernels split their work
    over its own cores and the borrowed ones."""
    scope = loan_scope(config.prefix, version)
    if config.borrow:
        borrower = Borrower(scope, config.borrow)
        kernel.use_threads(len(config.engine.cores or ()) + len(config.borrow))
        return borrower
    if config.lend:
        return Lender(scope, config.lend, name, Pacing(config.lend_tpot_s))
    return None


def build_instance(
    config: PoolConfig, secret: bytes, name: str = "", version: int = 1
) -> tuple[EngineLoop, Transport | None]:
    """Create the engine (its KV memory from the transport for prefill), the transport, the loop.

    ``name`` and ``version``: the pool's model and its version, which name its core loans. The caller
    starts the loop and, on shutdown, stops it and closes the transport.
    """
    injected = faults.from_environment(config.role)  # none unless a test started the server with faults
    if config.nice:
        os.setpriority(os.PRIO_PROCESS, 0, max(os.getpriority(os.PRIO_PROCESS, 0), config.nice))
    transport: Transport | None = None
    relay: list[EngineLoop] = []
    if config.role.needs_transport:
        kv = config.kv
        transport = create_transport(
            kv.transport,
            TransportConfig(secret=secret, prefix=config.prefix, ttl_s=kv.lease_ttl_s, checksum=kv.checksum),
            # the loop exists only after the engine, which needs the transport's memory first
            on_release=lambda lease_id, reason: relay[0].lease_released(lease_id, reason) if relay else None,
            **transport_options(config),
        )
    try:
        memory = None
        if config.role.exports_kv:  # the exported blocks are copied straight out of transport memory
            layout, num_blocks = plan_kv(config.engine)
            memory = transport.allocate_memory(num_blocks, layout.block_bytes)  # type: ignore[union-attr]
        engine = Engine(config.engine, kv_memory=memory)
        scheduler = create_scheduler(config.role, engine.limits, config.scheduling())
        tuning = config.tuning()
        tuner = BatchTuner(tuning, engine.limits.max_batch_size) if tuning.enabled else None
        lent = loans(config, name or config.role.value, version)
        backend = faults.FaultyBackend(engine, injected) if injected else engine
        loop = EngineLoop(backend, scheduler, transport, tuner=tuner, loans=lent)
    except BaseException:
        if transport is not None:
            transport.close()
        raise
    relay.append(loop)
    if config.warm_up_tokens and config.role is not Role.DECODE:
        loop.warm_up(config.warm_up_tokens)
    if transport is not None and config.role.exports_kv:
        transport.start_reaper(0.01)  # takes in native acks and expires leases
    return loop, transport
