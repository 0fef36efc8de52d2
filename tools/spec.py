"""The deployment spec: one reviewed YAML file that says what a server deploys.

    disagg repository --spec deploy/spec.yaml --out model_repository
    disagg serve --spec deploy/spec.yaml

It is read into one frozen :class:`Spec` by ``disagg.config.build``: unknown keys, wrong types and
out-of-range values are refused with an error that starts with the key's path in the file
(``pools.decode.cores: ...``). On top of the types it checks what no single key can:

- the prefill and decode pools run on disjoint core sets, and on disjoint GPUs (the colocated baseline,
  the entry points and the hot prompts' pool share cores on purpose);
- version numbers are unique and the serving version is one of them.

A spec becomes a :class:`disagg_tools.repository.Layout` plus the model versions
(:class:`disagg_tools.repository.ModelVersion`); the repository generator writes both. The committed
``model_repository/`` is generated from the committed ``deploy/spec.yaml`` (a test keeps them equal).

``schedule`` is the day/night split the autoscaler applies (``disagg autoscale --spec``): windows of
the day, each sizing the ``prefill`` and ``decode`` pools in instances or shares of a total, within
their ``autoscale`` bounds and under the autoscaler's guardrails (see
:class:`disagg_tools.autoscaler.config.ScheduleConfig`). It does not change what the repository is
generated with: the pools start at ``instances`` and the autoscaler moves them.

``remote`` places the pools on other hosts (``disagg serve --spec S --role frontend|prefill|decode``):
each pool's servers as the frontend reaches them (``disagg.serving.endpoints``: ``HOST:PORT,...`` or
``dns:NAME:PORT``); null: one server carries every model. ``disagg manifests`` renders the Kubernetes
objects of such a spec.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from disagg.config import ConfigError, build
from disagg.pool.settings import ConditionalPrefill
from disagg.serving.endpoints import parse_remote_pools
from disagg.triton.version import Probe
from disagg_tools.autoscaler.config import ScheduleConfig, check_schedule_pools, load_file
from disagg_tools.repository import (
    AUTO_BORROW,
    KV,
    Dtype,
    HotPrompts,
    Layout,
    ModelVersion,
    check_ids,
    ids_text,
)


@dataclass(frozen=True)
class Autoscale:
    """The autoscaler's bounds for a pool's instance count."""

    min_size: int = 1
    max_size: int = 1

    def __post_init__(self) -> None:
        if not 1 <= self.min_size <= self.max_size <= 64:
            raise ValueError("must have 1 <= min_size <= max_size <= 64")


@dataclass(frozen=True)
class PrefillPool:
    cores: tuple[int, ...] = (0,)
    gpus: tuple[int, ...] = ()  # set: a KIND_GPU group, one instance per GPU (served on one GPU only)
    instances: int = 1
    dtype: Dtype = ""  # "": the spec's dtype
    nice: int = 10  # yields its shared core to the token relay
    local_decode: bool = True  # the fallback ladder's "local" rung
    # the decode pool's cores it borrows while they are lent (disagg.engine.loan); []: none; null: all of
    # them where loans can be (CPU pools of one instance each, on one server, no hot pool on them)
    borrow: tuple[int, ...] | None = None
    autoscale: Autoscale = field(default_factory=Autoscale)

    def __post_init__(self) -> None:
        _check_pool(self)
        if not 0 <= self.nice <= 19:
            raise ValueError("nice: must be in [0, 19]")


@dataclass(frozen=True)
class DecodePool:
    RENAMED: ClassVar[dict[str, str]] = {
        "conditional_prefill_tokens": "conditional.prefill_tokens",
        "conditional_chunk_tokens": "conditional.chunk_tokens",
    }  # old key -> new (config.build)

    cores: tuple[int, ...] = (1,)
    gpus: tuple[int, ...] = ()
    instances: int = 1
    dtype: Dtype = ""
    conditional: ConditionalPrefill = field(default_factory=ConditionalPrefill)
    # the decode batch tuner (disagg.scheduling.tuner): tunes the batch limit under this TPOT (0: off),
    # starting from batch_start (0: the engine's max_batch_size)
    batch_tpot_slo_s: float = 0.0
    batch_start: int = 0
    # while prompts wait, a step plus the time its cores lent to prefill take at most this per token
    # (seconds; null: half the entry points' TPOT SLO, 0: lent while idle only)
    lend_tpot_s: float | None = None
    autoscale: Autoscale = field(default_factory=Autoscale)

    def __post_init__(self) -> None:
        _check_pool(self)
        if self.lend_tpot_s is not None and not self.lend_tpot_s >= 0:
            raise ValueError("lend_tpot_s: must be a number of seconds >= 0, or null")
        if not 0 <= self.batch_tpot_slo_s <= 3600:
            raise ValueError("batch_tpot_slo_s: must be a number of seconds in [0, 3600] (0: off)")
        if not 0 <= self.batch_start <= 4096:
            raise ValueError("batch_start: must be in [0, 4096] (0: max_batch_size)")


@dataclass(frozen=True)
class ColocatedPool:
    cores: tuple[int, ...] = (0, 1)
    gpus: tuple[int, ...] = ()
    instances: int = 1
    dtype: Dtype = ""
    chunk_tokens: int = 0  # prompt tokens per step, in chunks (0: whole prompts)

    def __post_init__(self) -> None:
        _check_pool(self)
        if not 0 <= self.chunk_tokens <= 1 << 20:
            raise ValueError(f"chunk_tokens: must be in [0, {1 << 20}] (0: whole prompts)")


def _check_pool(pool: Any) -> None:
    check_ids(pool.cores, "cores", "core")
    check_ids(pool.gpus, "gpus", "GPU")
    if not pool.cores and not pool.gpus:
        raise ValueError("cores: a CPU pool needs at least one core")
    if not 1 <= pool.instances <= 64:
        raise ValueError("instances: must be in 1..64")
    if pool.gpus and pool.instances != len(pool.gpus):
        raise ValueError("instances: a GPU pool runs one instance per listed GPU")


@dataclass(frozen=True)
class Pools:
    prefill: PrefillPool = field(default_factory=PrefillPool)
    decode: DecodePool = field(default_factory=DecodePool)
    colocated: ColocatedPool = field(default_factory=ColocatedPool)

    def __post_init__(self) -> None:
        p, d = self.prefill, self.decode
        if bool(p.gpus) != bool(d.gpus):
            raise ValueError("decode.gpus: prefill and decode go on GPUs together (GPU to GPU hand-off)")
        shared = sorted(set(p.gpus) & set(d.gpus))
        if shared:
            raise ValueError(f"decode.gpus: overlaps prefill.gpus (GPU {shared[0]})")
        check_ids(p.borrow or (), "prefill.borrow", "core")
        for core in p.borrow or ():
            if core not in d.cores:
                raise ValueError(f"prefill.borrow: core {core} is not the decode pool's {list(d.cores)}")


@dataclass(frozen=True)
class Slo:
    ttft_s: float | None = None  # None: the orchestrator's default
    tpot_s: float | None = None

    def __post_init__(self) -> None:
        for name in ("ttft_s", "tpot_s"):
            value = getattr(self, name)
            if value is not None and not 0 < value <= 3600:
                raise ValueError(f"{name}: must be in (0, 3600] seconds")


@dataclass(frozen=True)
class Admission:
    # refuse at once a request whose wait for its turn exceeds this x the TTFT SLO (0: admit everything;
    # null: 1 where entry_points.slo.ttft_s is set, else 2)
    margin: float | None = None

    def __post_init__(self) -> None:
        if self.margin is not None and not 0 <= self.margin <= 1000:
            raise ValueError("margin: must be in [0, 1000] (0: off)")


@dataclass(frozen=True)
class EntryPoints:
    """The entry points (ensemble, llm, their orchestrators and text steps)."""

    RENAMED: ClassVar[dict[str, str]] = {"admission_margin": "admission.margin"}  # old key -> new

    cores: tuple[int, ...] = (0,)
    request_timeout_s: float = 600.0
    slo: Slo = field(default_factory=Slo)
    admission: Admission = field(default_factory=Admission)

    def __post_init__(self) -> None:
        check_ids(self.cores, "cores", "core")
        if not 0 < self.request_timeout_s <= 86400:
            raise ValueError("request_timeout_s: must be in (0, 86400]")


@dataclass(frozen=True)
class Version:
    version: int
    checkpoint: str = ""  # "": the server's model ($MODEL_DIR, else the default model)
    probe: Probe | None = None  # a short greedy generation a pool must reproduce before it serves

    def __post_init__(self) -> None:
        if not 1 <= self.version <= 1 << 30:
            raise ValueError("version: must be an integer >= 1")


@dataclass(frozen=True)
class Model:
    versions: tuple[Version, ...] = (Version(1),)
    serving: int = 1  # the version loaded at start (the pools' version_policy)

    def __post_init__(self) -> None:
        numbers = [v.version for v in self.versions]
        if not numbers:
            raise ValueError("versions: at least one version")
        if len(set(numbers)) != len(numbers):
            raise ValueError("versions: version numbers must be unique")
        if self.serving not in numbers:
            raise ValueError("serving: must be one of the listed versions")


@dataclass(frozen=True)
class Remote:
    """The pools' servers on other hosts, as the frontend reaches them (the prefill and decode roles
    read nothing here)."""

    prefill: str
    decode: str
    tls: str = ""
    """A folder (relative to the spec's) of ca.pem, cert.pem and key.pem, one per host (disagg.tls):
    the pools serve gRPC over mutual TLS and the frontend dials them so; "": plain gRPC."""

    def __post_init__(self) -> None:
        for pool in ("prefill", "decode"):
            try:
                parse_remote_pools(f"{pool}={getattr(self, pool)}")
            except ValueError as exc:
                raise ValueError(f"{pool}: {exc}") from None

    @property
    def pools(self) -> str:
        """The frontend's ``remote_pools`` parameter."""
        return f"prefill={self.prefill};decode={self.decode}"


@dataclass(frozen=True)
class Spec:
    model: Model = field(default_factory=Model)
    dtype: Dtype = "auto"
    entry_points: EntryPoints = field(default_factory=EntryPoints)
    pools: Pools = field(default_factory=Pools)
    kv: KV = field(default_factory=KV)
    hot_prompts: HotPrompts = field(default_factory=HotPrompts)
    schedule: ScheduleConfig | None = None  # the autoscaler's day/night split of the pools
    remote: Remote | None = None  # pools on other hosts (multi-host roles); None: one server

    def __post_init__(self) -> None:
        if not self.dtype:
            raise ValueError("dtype: must be one of bfloat16, float32, float16, auto")
        p, d = self.pools.prefill, self.pools.decode
        shared = sorted(set(p.cores) & set(d.cores))
        if shared and not p.gpus and self.remote is None:  # on one server; on other hosts, any cores
            raise ValueError(f"pools.decode.cores: overlaps prefill.cores (core {shared[0]})")
        if self.remote is not None and (self.pools.prefill.gpus or self.pools.decode.gpus):
            raise ValueError("remote: pools on other hosts are CPU pools here (NIXL with VRAM not verified)")
        if self.schedule is not None:
            check_schedule_pools(self.schedule, {"prefill", "decode"})
        hot = self.hot_prompts.pool
        if hot is not None and self.pools.decode.gpus:
            raise ValueError("hot_prompts.pool: a hot prompts' pool is a CPU pool (decode is on GPUs)")

    def layout(self, role: str = "all") -> Layout:
        """The repository layout this spec deploys on a server of ``role`` (``all``: every model; with
        ``remote``, ``frontend``, ``prefill`` or ``decode``); ValueError for a role the spec has not."""
        if (role == "all") != (self.remote is None):
            raise ValueError(
                "a spec with remote pools is served by role (frontend, prefill, decode)"
                if self.remote is not None
                else "roles need the spec's remote section (where the frontend finds the pools)"
            )
        p, d, c = self.pools.prefill, self.pools.decode, self.pools.colocated
        return Layout(
            role=role,
            remote_pools=self.remote.pools if role == "frontend" and self.remote is not None else "",
            prefill_cores=ids_text(p.cores),
            decode_cores=ids_text(d.cores),
            colocated_cores=ids_text(c.cores),
            frontend_cores=ids_text(self.entry_points.cores),
            dtype=self.dtype,
            prefill_dtype=p.dtype,
            decode_dtype=d.dtype,
            colocated_dtype=c.dtype,
            kv=self.kv,
            request_timeout_s=self.entry_points.request_timeout_s,
            slo_ttft_s=self.entry_points.slo.ttft_s,
            slo_tpot_s=self.entry_points.slo.tpot_s,
            admission_margin=self.entry_points.admission.margin,
            prefill_nice=p.nice,
            local_decode=p.local_decode,
            colocated_chunk_tokens=c.chunk_tokens,
            hot_prompts=self.hot_prompts,
            conditional_prefill_tokens=d.conditional.prefill_tokens,
            conditional_chunk_tokens=d.conditional.chunk_tokens,
            decode_batch_tpot_slo_s=d.batch_tpot_slo_s,
            decode_batch_start=d.batch_start,
            prefill_borrow=AUTO_BORROW if p.borrow is None else ids_text(p.borrow),
            decode_lend_tpot_s=d.lend_tpot_s,
            prefill_gpus=ids_text(p.gpus),
            decode_gpus=ids_text(d.gpus),
            colocated_gpus=ids_text(c.gpus),
            prefill_instances=p.instances,
            decode_instances=d.instances,
            colocated_instances=c.instances,
        )

    def tls_folder(self, base: Path) -> str:
        """The remote section's TLS folder, absolute (a relative one from ``base``, the spec's folder);
        "" for plain gRPC."""
        if self.remote is None or not self.remote.tls:
            return ""
        return str((base / self.remote.tls).resolve())

    def versions(self, base: Path | None = None) -> tuple[ModelVersion, ...]:
        """The pools' versions; a relative checkpoint path is taken from ``base`` (the spec's folder)."""
        out = []
        for v in self.model.versions:
            checkpoint = v.checkpoint
            if checkpoint and base is not None and not Path(checkpoint).is_absolute():
                checkpoint = str((base / checkpoint).resolve())
            out.append(ModelVersion(v.version, checkpoint, v.probe))
        return tuple(out)

    def autoscaler_pools(self) -> list[dict[str, Any]]:
        """The autoscaler's pool entries (``disagg autoscale``'s ``pools``) with this spec's bounds."""
        p, d = self.pools.prefill.autoscale, self.pools.decode.autoscale
        slo = self.entry_points.slo
        prefill: dict[str, Any] = {"name": "prefill", "role": "prefill", "min_size": p.min_size}
        prefill["max_size"] = p.max_size
        decode: dict[str, Any] = {"name": "decode", "role": "decode", "min_size": d.min_size}
        decode["max_size"] = d.max_size
        if slo.ttft_s is not None:
            prefill["ttft_target_s"] = slo.ttft_s
        if slo.tpot_s is not None:
            decode["tpot_target_s"] = slo.tpot_s
        return [prefill, decode]


def with_overrides(data: Any, overrides: Sequence[str]) -> dict[str, Any]:
    """``data`` (a parsed spec, or None) with each ``KEY=VALUE`` of ``overrides`` set: KEY is a dotted
    path of the spec's keys (``pools.decode.lend_tpot_s``), VALUE a YAML value (``0.03``, ``[1]``,
    ``null``, ``false``). Later overrides win; the keys are checked when the spec is built (an unknown
    one is refused naming its path). ValueError for an override that is not KEY=VALUE."""
    import copy

    import yaml

    out = copy.deepcopy(data) if data is not None else {}
    if not isinstance(out, dict):
        raise ValueError("the spec must be a mapping")
    for override in overrides:
        key, sep, raw = override.partition("=")
        parts = key.strip().split(".")
        if not sep or not all(parts):
            raise ValueError(f"--set {override!r}: expected KEY=VALUE, e.g. pools.decode.lend_tpot_s=0.03")
        node = out
        for i, part in enumerate(parts[:-1]):
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                raise ValueError(f"--set {override!r}: {'.'.join(parts[: i + 1])} is not a section")
            node = child
        try:
            node[parts[-1]] = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError:
            raise ValueError(f"--set {override!r}: the value is not YAML") from None
    return out


def parse_spec(data: Any) -> Spec:
    """A spec from its parsed YAML; ConfigError naming the key path when it is not valid."""
    if data is None:
        data = {}
    return build(Spec, data)


def load_spec(path: Path | None, overrides: Sequence[str] = ()) -> Spec:
    """Read and validate a spec file (None: the defaults, which deploy/spec.yaml spells out), with
    ``overrides`` (``with_overrides``) set on it; ConfigError (prefixed with the file) when the result
    is not valid."""
    where = str(path) if path is not None else "the default spec"
    try:
        data = load_file(Path(path)) if path is not None else {}
        return parse_spec(with_overrides(data, overrides))
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from None
