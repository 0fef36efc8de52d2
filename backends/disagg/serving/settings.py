"""The entry points' settings, one frozen section of ``OrchestratorConfig`` per concern.

config.pbtxt spells a section's field ``<section>.<field>`` (``admission.margin``), and the spec uses
the same words where it exposes one (``entry_points.admission.margin``,
``pools.decode.conditional.prefill_tokens``). Each section checks its own ranges; the types are
``config.build``'s. The hot-prompt section is ``disagg.hot.settings``, the SLOs'
``disagg.serving.telemetry.SloConfig``.
"""

from __future__ import annotations

from dataclasses import dataclass

from disagg.serving.admission import AdmissionConfig
from disagg.serving.endpoints import parse_remote_pools
from disagg.tls import grpc_tls

ADMISSION_FIELDS = ("margin", "sheddable_margin", "cold_backlog_tokens")


def _seconds(section: object, top: float, *names: str) -> None:
    for name in names:
        if not 0 < getattr(section, name) <= top:
            raise ValueError(f"{name}: must be a number of seconds in (0, {top:g}]")


@dataclass(frozen=True)
class AdmissionSettings:
    """Admission by capacity (``disagg.serving.admission``)."""

    margin: float = AdmissionConfig.margin
    """Refuse a request whose wait for its turn (its predicted TTFT without its own prefill) exceeds
    this x its target: ``slo.ttft_s``, or its own prefill where that is longer (0: off)."""
    sheddable_margin: float = AdmissionConfig.sheddable_margin
    """The same for requests of negative ``priority``, which are so refused first."""
    cold_backlog_tokens: int = AdmissionConfig.cold_backlog_tokens
    """While a pool's prefill speed is not measured yet, the most prompt tokens admitted to wait on it."""

    def __post_init__(self) -> None:
        self.policy(AdmissionConfig.ttft_slo_s)  # the policy's own range checks

    def policy(self, ttft_slo_s: float) -> AdmissionConfig:
        """The admission policy's config, judged against the TTFT SLO ``ttft_slo_s``."""
        return AdmissionConfig(self.margin, self.sheddable_margin, ttft_slo_s, self.cold_backlog_tokens)


@dataclass(frozen=True)
class ConditionalSettings:
    """Conditional disaggregation: a new request of at most ``prefill_tokens`` prompt tokens is served
    whole by the decode pool (deployed with its ``conditional`` section) while the prefill pool's predicted
    time to first token for it exceeds ``backlog_s`` and the decode pool is healthy (0: off)."""

    prefill_tokens: int = 0
    backlog_s: float = 0.25

    def __post_init__(self) -> None:
        if not 0 <= self.prefill_tokens <= 1 << 20:
            raise ValueError(f"prefill_tokens: must be in [0, {1 << 20}]")
        if not 0 <= self.backlog_s < 1e6:
            raise ValueError("backlog_s: must be a number of seconds >= 0")


@dataclass(frozen=True)
class HealthSettings:
    """Pool health (``disagg.serving.watcher``): probes, and restarts of dead pools."""

    probe_interval_s: float = 1.0
    """How often each pool is pinged for its health and load."""
    probe_timeout_s: float = 10.0
    """A ping unanswered this long finds the pool gone."""
    recovery: bool = True
    """This orchestrator restarts dead pools through model control."""
    recovery_backoff_s: float = 5.0
    """First wait between restarts of a pool that stays gone (doubling, up to 60 s)."""

    def __post_init__(self) -> None:
        _seconds(self, 3600, "probe_interval_s", "probe_timeout_s", "recovery_backoff_s")


@dataclass(frozen=True)
class CancelSettings:
    """How waiting requests notice that their client left."""

    poll_s: float = 0.1
    """How often a request waiting for its pool's first answer (queued, being prefilled, waiting for
    decode blocks, or for its hot group's token) checks whether its client left; after that, every
    token checks."""
    checks_per_s: float = 100.0
    """The most such checks per second of one instance's waiting requests together (each is a round
    trip through the server): with more than ``checks_per_s x poll_s`` waiting, each checks less
    often, so a backlog does not spend its core on asking whether clients left."""

    def __post_init__(self) -> None:
        _seconds(self, 10, "poll_s")
        if not 1 <= self.checks_per_s <= 1e6:
            raise ValueError("checks_per_s: must be in [1, 1e+06]")


@dataclass(frozen=True)
class RemoteSettings:
    """Pools served by other Triton servers, reached over gRPC (``disagg.triton.remote``)."""

    pools: str = ""
    """``POOL=SERVERS[;POOL=SERVERS]``, SERVERS being ``HOST:PORT,...`` or ``dns:NAME:PORT`` (see
    ``disagg.serving.endpoints``); "": every pool is a model of this server."""
    tls: str = ""
    """A folder of ``ca.pem``, ``cert.pem`` and ``key.pem`` (``disagg.tls``): the remote pools are
    dialed over mutual TLS; "": plain gRPC."""

    def __post_init__(self) -> None:
        if self.tls and not self.pools:
            raise ValueError("tls: goes with pools (the pools it dials over TLS)")
        self.servers  # noqa: B018 (a malformed list fails here, at load)
        grpc_tls(self.tls)  # a folder without its three files fails here, at load

    @property
    def servers(self) -> dict[str, str]:
        """Pool -> the spec of its servers, for the pools on other servers."""
        return parse_remote_pools(self.pools)


@dataclass(frozen=True)
class DegradationSettings:
    """What a request gets while pools are gone (``disagg.serving.ladder``, ``disagg.serving.router``)."""

    ladder: str = ""
    """Rungs in order, comma-separated; empty: the mode's default."""
    local_max_tokens: int = 128
    """On the ``local`` rung a request gets at most this many more tokens (the degraded output cap)."""
    migration_limit: int = 2
    """Times one stream may move to another rung after its pool failed."""
    retry_after_s: float = 5.0
    """The retry hint of a shed request ("retry after N s")."""
    shed_sheddable: bool = True
    """A new request of negative ``priority`` is shed (fast UNAVAILABLE with the retry hint) while new
    requests cannot take the ladder's first rung: the degraded capacity is kept for the rest."""
    colocated_first_when_decode_gone: bool = True
    """While the decode pool is gone, the ``colocated`` rung is tried before ``local``."""

    def __post_init__(self) -> None:
        if not 0 <= self.local_max_tokens <= 1 << 20:
            raise ValueError(f"local_max_tokens: must be in [0, {1 << 20}]")
        if not 0 <= self.migration_limit <= 100:
            raise ValueError("migration_limit: must be in [0, 100]")
        _seconds(self, 3600, "retry_after_s")
