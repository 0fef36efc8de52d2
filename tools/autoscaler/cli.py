"""`disagg autoscale`: command line over the config file; builds the runner and loops until stopped."""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from pathlib import Path
from typing import Any

from disagg_tools.autoscaler.actuator import Actuator, KubernetesActuator, LogActuator, TritonActuator
from disagg_tools.autoscaler.clock import SystemClock
from disagg_tools.autoscaler.config import AutoscalerConfig, ConfigError, build_config, load_file
from disagg_tools.autoscaler.recommender import load_recommender
from disagg_tools.autoscaler.runner import Runner, inflight_probe
from disagg_tools.autoscaler.source import make_source
from disagg_tools.autoscaler.telemetry import Telemetry

_POOL_FLAGS = {
    # flag dest -> (role, ScaledPool field)
    "ttft_target": ("prefill", "ttft_target_s"),
    "prefill_model": ("prefill", "name"),
    "prefill_min": ("prefill", "min_size"),
    "prefill_max": ("prefill", "max_size"),
    "prefill_capacity": ("prefill", "capacity_tokens_per_s"),
    "tpot_target": ("decode", "tpot_target_s"),
    "decode_model": ("decode", "name"),
    "decode_min": ("decode", "min_size"),
    "decode_max": ("decode", "max_size"),
}


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="disagg autoscale",
        description="Size the prefill and decode pools from the server's SLO metrics.",
    )
    ap.add_argument("--config", type=Path, help="YAML or JSON file (flags below override it)")
    ap.add_argument(
        "--spec",
        type=Path,
        help="deployment spec (deploy/spec.yaml): its pools' autoscale bounds and its SLOs as targets, "
        "laid over --config's pools of the same name (flags override both)",
    )
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--metrics-url", help="Triton /metrics URL (default http://127.0.0.1:8002/metrics)")
    src.add_argument("--prometheus-url", help="Prometheus server base URL (uses /api/v1/query)")
    ap.add_argument("--interval", type=float, help="seconds between decisions (default 15)")
    ap.add_argument("--window", type=float, help="seconds of history for percentiles (default 60)")
    ap.add_argument("--ttft-target", type=float, help="TTFT SLO in seconds (adds/sets the prefill pool)")
    ap.add_argument("--tpot-target", type=float, help="TPOT SLO in seconds (adds/sets the decode pool)")
    ap.add_argument("--prefill-model", help="Triton model name of the prefill pool (default prefill)")
    ap.add_argument("--decode-model", help="Triton model name of the decode pool (default decode)")
    ap.add_argument("--prefill-capacity", type=float, help="prior: prompt tokens/s one prefill instance does")
    for role in ("prefill", "decode"):
        ap.add_argument(f"--{role}-min", type=int, help=f"minimum {role} size (>= 1)")
        ap.add_argument(f"--{role}-max", type=int, help=f"maximum {role} size")
    ap.add_argument("--actuator", choices=["log", "triton", "kubernetes"], help="default log (dry run)")
    ap.add_argument(
        "--triton-url", help="Triton HTTP URL for the triton actuator (default http://127.0.0.1:8000)"
    )
    ap.add_argument("--admin-header", help="header of the restricted model-repository API")
    ap.add_argument("--admin-key-env", help="environment variable holding its key (default DISAGG_ADMIN_KEY)")
    ap.add_argument("--namespace", help="Kubernetes namespace of the Deployments")
    ap.add_argument("--kubeconfig", help="kubeconfig file (default: the client's default)")
    ap.add_argument("--in-cluster", action="store_true", default=None, help="use the pod's service account")
    ap.add_argument("--port", type=int, help="port of the autoscaler's own /metrics (0: off; default 9105)")
    ap.add_argument(
        "--planner-profile",
        type=Path,
        help="`disagg profile` output for the planner (planner.profile; one pool instance)",
    )
    ap.add_argument(
        "--planner-dry-run",
        action="store_true",
        help="run the planner (planner.enabled, mode dry_run): print each run's recommended instance "
        "counts as a JSON line, acting on none of them",
    )
    ap.add_argument("--once", action="store_true", help="run one interval and exit")
    return ap


def config_from_args(args: argparse.Namespace) -> AutoscalerConfig:
    """The file's mapping with the given flags laid over it, validated."""
    data: dict[str, Any] = load_file(args.config) if args.config else {}
    source = dict(data.get("source") or {})
    if args.metrics_url:
        source.update(kind="triton", url=args.metrics_url)
    if args.prometheus_url:
        source.update(kind="prometheus", url=args.prometheus_url)
    if source:
        data["source"] = source
    actuator = dict(data.get("actuator") or {})
    for flag, key in (
        ("actuator", "kind"),
        ("triton_url", "url"),
        ("admin_header", "admin_header"),
        ("admin_key_env", "admin_key_env"),
        ("namespace", "namespace"),
        ("kubeconfig", "kubeconfig"),
        ("in_cluster", "in_cluster"),
    ):
        if getattr(args, flag) is not None:
            actuator[key] = getattr(args, flag)
    if actuator:
        data["actuator"] = actuator
    for flag, key in (("interval", "interval_s"), ("window", "window_s"), ("port", "metrics_port")):
        if getattr(args, flag) is not None:
            data[key] = getattr(args, flag)
    pools = [dict(p) if isinstance(p, dict) else p for p in (data.get("pools") or [])]
    planner = dict(data.get("planner") or {})
    if args.planner_profile is not None:
        planner["profile"] = args.planner_profile
    if args.planner_dry_run:
        planner.update(enabled=True, mode="dry_run")
    if planner:
        data["planner"] = planner
    if args.spec is not None:
        from disagg_tools.spec import load_spec

        spec = load_spec(args.spec)
        if spec.schedule is not None:
            if data.get("schedule") is not None:
                raise ConfigError("schedule: given both in --config and in --spec (keep one)")
            data["schedule"] = spec.schedule
        for entry in spec.autoscaler_pools():
            same = [p for p in pools if isinstance(p, dict) and p.get("name") == entry["name"]]
            if same:
                same[0].update(entry)
            else:
                pools.append(entry)
    for flag, (role, key) in _POOL_FLAGS.items():
        value = getattr(args, flag)
        if value is None:
            continue
        matching = [p for p in pools if isinstance(p, dict) and p.get("role") == role]
        if not matching:
            if key not in ("ttft_target_s", "tpot_target_s"):
                raise ConfigError(f"--{flag.replace('_', '-')}: no {role} pool (give its target first)")
            matching = [{"name": role, "role": role}]
            pools.append(matching[0])
        for pool in matching:
            pool[key] = value
    if pools:
        data["pools"] = pools
    return build_config(data)


def build_actuator(config: AutoscalerConfig, clock: SystemClock, runner_source: Any) -> Actuator:
    kind = config.actuator.kind
    if kind == "triton":
        return TritonActuator(config.actuator, clock, inflight_probe(runner_source))
    if kind == "kubernetes":
        return KubernetesActuator(config.actuator)
    return LogActuator()


def main(argv: list[str] | None = None) -> int:
    """Entry point of `disagg autoscale`; returns the exit status (0 stopped cleanly, 2 bad config)."""
    args = _parser().parse_args(argv)
    try:
        config = config_from_args(args)
    except ConfigError as exc:
        print(f"disagg autoscale: {exc}", file=sys.stderr)
        return 2
    stop = threading.Event()
    clock = SystemClock(stop)
    source = make_source(config.source, clock.time)
    try:
        actuator = build_actuator(config, clock, source)
    except ConfigError as exc:
        print(f"disagg autoscale: {exc}", file=sys.stderr)
        return 2
    try:
        recommender = load_recommender(config)
    except ConfigError as exc:
        print(f"disagg autoscale: {exc}", file=sys.stderr)
        return 2
    telemetry = Telemetry()
    if config.metrics_port and not args.once:
        telemetry.serve(config.metrics_port, config.metrics_address)
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
    dry_run = config.actuator.kind == "log"
    runner = Runner(config, source, actuator, clock, telemetry, dry_run=dry_run, recommender=recommender)
    try:
        runner.run(iterations=1 if args.once else None)
    finally:
        telemetry.close()
    return 0
