"""Command-line pieces shared by perf/bench_serving.py, perf/interference.py and perf/run_all.py."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from disagg_tools.runrecord import log as log  # re-exported: perf's scripts take them from here
from disagg_tools.runrecord import machine as machine
from disagg_tools.runrecord import write_json as write_json
from perf.benchlib.clients import COUNT_MODES, ClientConfig

REPO_ROOT = Path(__file__).resolve().parents[2]
# The tiny model unless MODEL_DIR says otherwise; `make bench` passes SmolLM2 explicitly.
DEFAULT_MODEL_DIR = Path(os.environ.get("MODEL_DIR", REPO_ROOT / ".models" / "tiny"))


def add_target_args(parser: argparse.ArgumentParser) -> None:
    """--kind/--url/--model/--count-tokens: one deployment to talk to."""
    parser.add_argument("--kind", choices=("triton", "openai"), required=True, help="client protocol")
    parser.add_argument(
        "--url", required=True, help="triton: gRPC host:port; openai: http://host:port (loopback only)"
    )
    parser.add_argument(
        "--model", required=True, help="Triton model (ensemble, llm, ensemble_colocated) or served name"
    )
    parser.add_argument("--count-tokens", choices=COUNT_MODES, default="", help="output-token counting")
    parser.add_argument("--model-dir", type=Path, default=DEFAULT_MODEL_DIR, help="checkpoint (tokenizer)")


def add_search_args(parser: argparse.ArgumentParser, runs: int = 1, max_requests: int = 150) -> None:
    """The sizes of `benchlib.experiment.goodput_runs`' searches: searches per cell, seconds of
    arrivals per probe (clamped to a request count), probes per search and the rate tolerance."""
    parser.add_argument("--runs", type=int, default=runs, help="goodput searches per cell")
    parser.add_argument("--duration", type=float, default=25.0, help="seconds of arrivals per probe")
    parser.add_argument("--min-requests", type=int, default=16)
    parser.add_argument("--max-requests", type=int, default=max_requests)
    parser.add_argument("--max-probes", type=int, default=5)
    parser.add_argument("--rel-tol", type=float, default=0.1)
    parser.add_argument(
        "--growth", type=float, default=2.0, help="a search's bracketing step: x this while it passes"
    )
    parser.add_argument(
        "--lowest-rate",
        type=float,
        default=0.125,
        help="a search goes no lower than this fraction of its start (the idle capacity): a probe's "
        "minimum of requests at a low rate takes minutes",
    )


def client_config(args: argparse.Namespace) -> ClientConfig:
    return ClientConfig(kind=args.kind, url=args.url, model=args.model, count_tokens=args.count_tokens)


def pin_self(cpus: str | None) -> None:
    """Pin this process (the load generator) to `cpus` ("0" or "0,1"); None leaves it alone."""
    if cpus:
        os.sched_setaffinity(0, {int(c) for c in cpus.split(",")})


def add_run_args(parser: argparse.ArgumentParser, rate_help: str, rate_required: bool = True) -> None:
    """--model-dir/--repository/--workload/--rate: one seeded workload at a rate, on a fresh server of a
    repository (the project's by default) loading a model (the tiny one by default)."""
    from perf.benchlib.workload import WORKLOADS

    parser.add_argument("--model-dir", type=Path, default=REPO_ROOT / ".models" / "tiny")
    parser.add_argument("--repository", type=Path, default=REPO_ROOT / "model_repository")
    parser.add_argument("--workload", default="codegen", choices=sorted(WORKLOADS))
    parser.add_argument("--rate", type=float, required=rate_required, help=rate_help)
