"""The autoscaler's one frozen, validated configuration, read from a YAML/JSON file and/or CLI flags.

Every section is a frozen dataclass; :func:`build_config` turns a plain mapping (the parsed file with
flags laid over it) into them, refusing unknown keys, wrong types and inconsistent values with a
:class:`ConfigError` (the project's one, :class:`disagg.config.ConfigError`) whose message names the key.

Two optional sections size pools from something other than the reactive rules:

- ``schedule`` (:class:`ScheduleConfig`): pool sizes by time of day (the day/night split), applied
  with guardrails by :mod:`~.schedule`;
- ``planner`` (:class:`PlannerConfig`): the planner's simulation asked, every few intervals, for the
  instance counts that meet the SLOs at the traffic observed (:mod:`~.recommender`).
"""

from __future__ import annotations

import json
import math
import re
import zoneinfo
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import timedelta, tzinfo
from datetime import timezone as fixed_zone
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
class ScaledPool:
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


_HHMM = re.compile(r"^([01][0-9]|2[0-3]):([0-5][0-9])$")
_OFFSET = re.compile(r"^([+-])([01][0-9]|2[0-3]):([0-5][0-9])$")


def _pool_numbers(value: Any, key: str, kind: type, low: float, high: float | None) -> dict[str, Any]:
    """A ``{pool name: number}`` mapping checked entry by entry (`kind` int or float, in [low, high])."""
    if value is None or value == ():
        return {}
    if isinstance(value, tuple):  # the stored form: sorted (pool, value) pairs
        try:
            value = dict(value)
        except (TypeError, ValueError):
            raise ValueError(f"{key}: must be a mapping of pool name to number") from None
    if not isinstance(value, Mapping) or not value:
        raise ValueError(f"{key}: must be a non-empty mapping of pool name to number")
    out: dict[str, Any] = {}
    for name, number in value.items():
        if not isinstance(name, str) or not name:
            raise ValueError(f"{key}: pool names must be non-empty strings")
        is_int = isinstance(number, int) and not isinstance(number, bool)
        ok = is_int if kind is int else (is_int or isinstance(number, float))
        if not ok or not math.isfinite(number) or number < low or (high is not None and number > high):
            span = f">= {low:g}" if high is None else f"in [{low:g}, {high:g}]"
            what = "an integer" if kind is int else "a number"
            raise ValueError(f"{key}.{name}: must be {what} {span}")
        out[name] = kind(number)
    return out


@dataclass(frozen=True)
class ScheduleWindow:
    """From `start` (local "HH:MM") until the next window's start, these pools are sized so.

    Each named pool gets either an instance count (`sizes: {decode: 7}`) or a share of the schedule's
    `total` (`shares: {decode: 0.7}`, rounded to the nearest instance). `release: {decode: 0.5}` hands
    that fraction of the pool's size to other work (rounded down, so the pool keeps the larger part):
    the scheduled size is the size minus the released instances, which decisions report as
    `released`. A pool the window does not name is left to the reactive rules while it lasts.
    The mappings are stored as sorted `(pool, value)` pairs.
    """

    start: str
    sizes: Any = None
    shares: Any = None
    release: Any = None
    name: str = ""
    """Label of the window in decisions (default: its start)."""
    minute: int = field(init=False, default=0)
    """Minutes after local midnight (from `start`)."""

    def __post_init__(self) -> None:
        found = _HHMM.match(self.start)
        if not found:
            raise ValueError('start: must be "HH:MM" (00:00 .. 23:59)')
        object.__setattr__(self, "minute", int(found[1]) * 60 + int(found[2]))
        sizes = _pool_numbers(self.sizes, "sizes", int, 0, None)
        shares = _pool_numbers(self.shares, "shares", float, 0, 1)
        release = _pool_numbers(self.release, "release", float, 0, 0.99)
        if not sizes and not shares:
            raise ValueError("sizes: a window needs sizes or shares (or both, for different pools)")
        both = sorted(set(sizes) & set(shares))
        if both:
            raise ValueError(f"shares.{both[0]}: a pool takes sizes or shares, not both")
        if sum(shares.values()) > 1 + 1e-9:
            raise ValueError("shares: must add up to at most 1")
        loose = sorted(set(release) - set(sizes) - set(shares))
        if loose:
            raise ValueError(f"release.{loose[0]}: release only from a pool the window sizes")
        for key, value in (("sizes", sizes), ("shares", shares), ("release", release)):
            object.__setattr__(self, key, tuple(sorted(value.items())))

    @property
    def label(self) -> str:
        return self.name or self.start

    def pools(self) -> tuple[str, ...]:
        """The pools this window sizes."""
        return tuple(sorted({name for name, _ in (*self.sizes, *self.shares)}))


@dataclass(frozen=True)
class ScheduleConfig:
    """The day/night split: pool sizes by local time of day, each window lasting until the next one's
    start (the last one until the first one's, the next day). Local time is `timezone` (an IANA name,
    e.g. ``Europe/Paris``, daylight saving included) or a fixed `utc_offset` (``+02:00``); neither: UTC.

    Guardrails (applied by :func:`disagg_tools.autoscaler.schedule.guard`): a scheduled size is kept in
    the pool's [min_size, max_size]; a scheduled scale-in waits while the pool's windowed TTFT / TPOT
    quantile is above its target, or its policy asks for more, or the pool changed less than its
    `cooldown_in_s` ago; the reactive rules may scale a pool out above its scheduled size, and bring it
    back down to it, never below it. Example (10 instances: 30 % prefill, 70 % decode by day; at night
    half of decode released to batch work)::

        schedule:
          timezone: Europe/Paris
          total: 10
          windows:
            - {start: "07:00", name: day, shares: {prefill: 0.3, decode: 0.7}}
            - {start: "22:00", name: night, shares: {prefill: 0.3, decode: 0.7}, release: {decode: 0.5}}
    """

    windows: tuple[ScheduleWindow, ...]
    timezone: str = ""
    utc_offset: str = ""
    total: int | None = None
    """Instances the `shares` of the windows are of."""
    tz: tzinfo = field(init=False, default=fixed_zone.utc, compare=False, repr=False)

    def __post_init__(self) -> None:
        if not self.windows:
            raise ValueError("windows: at least one window")
        starts = [w.minute for w in self.windows]
        if len(set(starts)) != len(starts):
            raise ValueError("windows: two windows start at the same time")
        if self.timezone and self.utc_offset:
            raise ValueError("utc_offset: give timezone or utc_offset, not both")
        if self.timezone:
            try:
                zone: tzinfo = zoneinfo.ZoneInfo(self.timezone)
            except (zoneinfo.ZoneInfoNotFoundError, ValueError):
                raise ValueError("timezone: not a known time zone name") from None
        elif self.utc_offset:
            found = _OFFSET.match(self.utc_offset)
            if not found:
                raise ValueError('utc_offset: must be "+HH:MM" or "-HH:MM"')
            minutes = int(found[2]) * 60 + int(found[3])
            zone = fixed_zone(timedelta(minutes=-minutes if found[1] == "-" else minutes))
        else:
            zone = fixed_zone.utc
        object.__setattr__(self, "tz", zone)
        if self.total is not None and self.total < 1:
            raise ValueError("total: must be >= 1")
        for i, window in enumerate(self.windows):
            if window.shares and self.total is None:
                raise ValueError(f"windows[{i}].shares: shares need the schedule's total")
        object.__setattr__(self, "windows", tuple(sorted(self.windows, key=lambda w: w.minute)))


def check_schedule_pools(schedule: ScheduleConfig, names: set[str], where: str = "schedule") -> None:
    """ConfigError naming the key when a window sizes a pool that is not among `names`."""
    for i, window in enumerate(schedule.windows):
        for pool in window.pools():
            if pool not in names:
                raise ConfigError(f"{where}.windows[{i}]: no pool named {pool!r}")


@dataclass(frozen=True)
class PlannerConfig:
    """The planner in the loop: every `interval_s` it takes the request rate and the prompt / output
    length histograms of the window, simulates the prefill and decode pools with the profiles
    (``disagg profile`` output), and looks for the smallest (prefill, decode) instance counts within
    the pools' bounds whose simulated attainment of both SLOs (the pools' `ttft_target_s` and
    `tpot_target_s`) at `headroom` x the observed rate reaches `target`.

    `mode: dry_run` only reports the recommendation (one JSON record per run beside the decisions);
    `mode: floor` makes it a lower bound for the reactive rules: a pool below it is raised to it, a
    reactive scale-in stops at it (the final size is max(reactive, planner), within the pool's bounds).
    Needs exactly one prefill and one decode pool. The simulation is deterministic (`seed`) and small
    (`requests` simulated requests per try), since it runs in the loop.
    """

    enabled: bool = False
    mode: Literal["dry_run", "floor"] = "dry_run"
    profile: Path | None = None
    """Profile of one prefill instance (and of one decode instance unless `decode_profile` is set)."""
    decode_profile: Path | None = None
    target: float = 0.9
    headroom: float = 1.0
    """Plan for this multiple of the observed rate (>= 1)."""
    interval_s: float | None = None
    """Seconds between runs (default: every interval); at least the autoscaler's interval."""
    requests: int = 300
    min_requests: int = 20
    """Fewer requests observed in the window: no recommendation (and no floor)."""
    seed: int = 0
    transfer_gbps: float = 0.0
    """KV hand-off rate between the pools, GB/s (0: the hand-off is free)."""
    max_prefill_tokens: int = 4096
    max_batch: int = 64


@dataclass(frozen=True)
class AutoscalerConfig:
    """The whole autoscaler: the pools and their reactive rules, where metrics come from, how sizes
    are applied, and optionally a time-of-day `schedule` and the `planner` in the loop."""

    pools: tuple[ScaledPool, ...]
    source: SourceConfig = field(default_factory=SourceConfig)
    actuator: ActuatorConfig = field(default_factory=ActuatorConfig)
    schedule: ScheduleConfig | None = None
    planner: PlannerConfig = field(default_factory=PlannerConfig)
    interval_s: float = 15.0
    window_s: float = 60.0
    metrics_port: int = 9105
    """Port of the autoscaler's own `/metrics`; 0 turns it off."""
    metrics_address: str = "127.0.0.1"


def _positive(value: float, key: str) -> None:
    if value <= 0:
        raise ConfigError(f"{key}: must be > 0")


def _check_pool(pool: ScaledPool, where: str, interval_s: float) -> None:
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
    if config.schedule is not None:
        check_schedule_pools(config.schedule, set(names))
    _check_planner(config)
    return config


def _check_planner(config: AutoscalerConfig) -> None:
    planner = config.planner
    if not 0 < planner.target <= 1:
        raise ConfigError("planner.target: must be in (0, 1]")
    if planner.headroom < 1:
        raise ConfigError("planner.headroom: must be >= 1")
    if planner.interval_s is not None and planner.interval_s < config.interval_s:
        raise ConfigError("planner.interval_s: must be >= interval_s")
    for key in ("requests", "min_requests", "max_prefill_tokens", "max_batch"):
        if getattr(planner, key) < 1:
            raise ConfigError(f"planner.{key}: must be >= 1")
    if planner.transfer_gbps < 0:
        raise ConfigError("planner.transfer_gbps: must be >= 0")
    if not planner.enabled:
        return
    if planner.profile is None:
        raise ConfigError("planner.profile: required when the planner is enabled")
    roles = [p.role for p in config.pools]
    if roles.count("prefill") != 1 or roles.count("decode") != 1:
        raise ConfigError("planner: needs exactly one prefill and one decode pool")


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
