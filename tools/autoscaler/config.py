"""The autoscaler's one frozen, validated configuration, read from a YAML/JSON file and/or CLI flags.

Every section is a frozen dataclass; :func:`build_config` turns a plain mapping (the parsed file with
flags laid over it) into them, refusing unknown keys, wrong types and inconsistent values with a
:class:`ConfigError` (the project's one, :class:`disagg.config.ConfigError`) whose message names the key.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from disagg.config import ConfigError, build

SOURCE_KINDS = ("triton", "prometheus")
ACTUATOR_KINDS = ("log", "triton", "kubernetes")
ROLES = ("prefill", "decode")
DEFAULT_ADMIN_HEADER = "disagg-admin-key"  # the header the server's restricted APIs expect
DEFAULT_ADMIN_KEY_ENV = "DISAGG_ADMIN_KEY"


@dataclass(frozen=True)
class SourceConfig:
    """Where metrics come from: `triton` scrapes a `/metrics` URL, `prometheus` asks a server's HTTP API."""

    kind: Literal["triton", "prometheus"] = "triton"
    url: str = "http://127.0.0.1:8002/metrics"
    timeout_s: float = 5.0
    label_matchers: str = ""
    """Prometheus only: extra PromQL label matchers for every query, e.g. `namespace="llm"`."""
    stale_after_s: float = 60.0
    """Prometheus only: a series whose newest sample is older than this is stale."""


@dataclass(frozen=True)
class PoolConfig:
    """One pool (a Triton model, or one Deployment running it) and the targets it is sized for."""

    name: str
    """Triton model name: the `model` label on the metrics and the model the triton actuator reloads."""
    role: Literal["prefill", "decode"]
    min_size: int = 1
    max_size: int = 4
    step: int = 1
    quantile: float = 0.99
    out_ratio: float = 1.2
    in_ratio: float = 0.8
    min_samples: int = 20
    """Fewer observations in the window than this: the percentile is not trusted (no scale on it)."""
    scale_out_after: int = 1
    """Consecutive intervals an out-signal must hold before acting."""
    scale_in_after: int = 3
    cooldown_out_s: float = 30.0
    """Seconds after any size change before the next scale-out."""
    cooldown_in_s: float = 120.0
    """Seconds after any size change before the next scale-in."""
    paths: tuple[str, ...] = ()
    """`path` label values of the request-level families (TTFT, TPOT, prompt tokens) to read (empty:
    `disaggregated`, the only path whose requests run on the prefill and decode pools)."""
    request_models: tuple[str, ...] = ()
    """`model` label values of the request-level families to read (empty: every model). Those families
    are observed by the entry point that served the request (`llm`, `orchestrator`), so their `model`
    label names the entry point, never the pool; pools are told apart by `path`, and by this list
    where one server runs several disaggregated deployments."""
    # prefill
    ttft_target_s: float | None = None
    capacity_tokens_per_s: float | None = None
    """Prior for prompt tokens one instance prefills per second; replaced by measurement when busy."""
    max_utilisation: float = 0.85
    min_utilisation: float = 0.5
    # decode
    tpot_target_s: float | None = None
    kv_high: float = 0.85
    kv_low: float = 0.5
    kv_pool: str | None = None
    """Select the KV block gauges by this `pool` label value (default: by `model` = the pool's name)."""
    # actuation
    deployment: str | None = None
    """Kubernetes Deployment running this pool (default: the pool's name)."""
    drain_max_inflight: float | None = None
    """triton actuator: unset (default), a scale-in is sent at once and the removed instance drains
    itself (Triton stops routing to it; it finishes what it was handed and waits, bounded, for its
    exported KV to be pulled). Set, a scale-in first waits until the pool's in-flight gauge is at most
    this, for up to `drain_timeout_s` (a pool under steady load then never scales in)."""


@dataclass(frozen=True)
class ActuatorConfig:
    """How decisions are applied."""

    kind: Literal["log", "triton", "kubernetes"] = "log"
    url: str = "http://127.0.0.1:8000"
    """triton: the server's HTTP endpoint (model repository API)."""
    admin_header: str = DEFAULT_ADMIN_HEADER
    admin_key_env: str = DEFAULT_ADMIN_KEY_ENV
    """Environment variable holding the restricted-API key (never a flag: flags show up in `ps`)."""
    timeout_s: float = 120.0
    """triton: a load with new instances may take this long (the model initialises its instances)."""
    drain_timeout_s: float = 60.0
    drain_poll_s: float = 1.0
    namespace: str = "default"
    kubeconfig: str | None = None
    in_cluster: bool = False


@dataclass(frozen=True)
class AutoscalerConfig:
    """The whole autoscaler."""

    pools: tuple[PoolConfig, ...]
    source: SourceConfig = field(default_factory=SourceConfig)
    actuator: ActuatorConfig = field(default_factory=ActuatorConfig)
    interval_s: float = 15.0
    window_s: float = 60.0
    metrics_port: int = 9105
    """Port of the autoscaler's own `/metrics`; 0 turns it off."""
    metrics_address: str = "127.0.0.1"


def _positive(value: float, key: str) -> None:
    if value <= 0:
        raise ConfigError(f"{key}: must be > 0")


def _check_pool(pool: PoolConfig, where: str, interval_s: float) -> None:
    if pool.min_size < 1:
        # Zero would let missing data (or a quiet night) turn a pool off; scale-to-zero is not offered.
        raise ConfigError(f"{where}.min_size: must be >= 1")
    if pool.max_size < pool.min_size:
        raise ConfigError(f"{where}.max_size: must be >= min_size")
    if pool.step < 1:
        raise ConfigError(f"{where}.step: must be >= 1")
    if not 0.5 <= pool.quantile < 1:
        raise ConfigError(f"{where}.quantile: must be in [0.5, 1)")
    if not 0 < pool.in_ratio < 1 < pool.out_ratio:
        raise ConfigError(f"{where}: need 0 < in_ratio < 1 < out_ratio (the gap is the hysteresis band)")
    if pool.min_samples < 1 or pool.scale_out_after < 1 or pool.scale_in_after < 1:
        raise ConfigError(f"{where}: min_samples, scale_out_after, scale_in_after must be >= 1")
    for key in ("cooldown_out_s", "cooldown_in_s"):
        if getattr(pool, key) < interval_s:
            raise ConfigError(f"{where}.{key}: must be >= interval_s")
    if pool.role == "prefill":
        if pool.ttft_target_s is None:
            raise ConfigError(f"{where}.ttft_target_s: required for a prefill pool")
        _positive(pool.ttft_target_s, f"{where}.ttft_target_s")
        if pool.capacity_tokens_per_s is not None:
            _positive(pool.capacity_tokens_per_s, f"{where}.capacity_tokens_per_s")
        if not 0 < pool.min_utilisation < pool.max_utilisation <= 1:
            raise ConfigError(f"{where}: need 0 < min_utilisation < max_utilisation <= 1")
    else:
        if pool.tpot_target_s is None:
            raise ConfigError(f"{where}.tpot_target_s: required for a decode pool")
        _positive(pool.tpot_target_s, f"{where}.tpot_target_s")
        if not 0 < pool.kv_low < pool.kv_high <= 1:
            raise ConfigError(f"{where}: need 0 < kv_low < kv_high <= 1")
    if pool.drain_max_inflight is not None and pool.drain_max_inflight < 0:
        raise ConfigError(f"{where}.drain_max_inflight: must be >= 0")


def build_config(data: Any) -> AutoscalerConfig:
    """Validate a plain mapping (parsed file + flags) into an :class:`AutoscalerConfig`.

    Types, unknown and missing keys: :func:`disagg.config.build`; the ranges and cross-field rules here.
    """
    if isinstance(data, Mapping):
        if "pools" not in data:
            raise ConfigError("pools: required (or give --ttft-target / --tpot-target)")
        pools = data["pools"]
        if isinstance(pools, Mapping) or not isinstance(pools, (list, tuple)) or not pools:
            raise ConfigError("pools: must be a non-empty list")
    config = build(AutoscalerConfig, data)
    _positive(config.interval_s, "interval_s")
    if config.window_s < config.interval_s:
        raise ConfigError("window_s: must be >= interval_s")
    if not 0 <= config.metrics_port <= 65535:
        raise ConfigError("metrics_port: must be in 0..65535")
    _positive(config.source.timeout_s, "source.timeout_s")
    _positive(config.source.stale_after_s, "source.stale_after_s")
    for key in ("timeout_s", "drain_timeout_s", "drain_poll_s"):
        _positive(getattr(config.actuator, key), f"actuator.{key}")
    names = [p.name for p in config.pools]
    if len(set(names)) != len(names):
        raise ConfigError("pools: names must be unique")
    for i, pool in enumerate(config.pools):
        _check_pool(pool, f"pools[{i}]", config.interval_s)
    return config


def load_file(path: Path) -> dict[str, Any]:
    """Read a YAML (.yaml/.yml) or JSON config file into a plain mapping."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read config file ({exc.strerror})") from None
    try:
        if path.suffix in (".yaml", ".yml"):
            import yaml

            data = yaml.safe_load(text)
        else:
            data = json.loads(text)
    except ValueError as exc:  # yaml.YAMLError is not a ValueError: caught below
        raise ConfigError(f"config file is not valid JSON ({exc.__class__.__name__})") from None
    except Exception as exc:
        raise ConfigError(f"config file is not valid YAML ({exc.__class__.__name__})") from None
    if not isinstance(data, dict):
        raise ConfigError("config file: top level must be a mapping")
    return data
