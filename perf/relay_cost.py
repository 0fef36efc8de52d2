"""What serving costs a pool's decode step under load: the step inside a real Triton at B concurrent
streams, beside the same engine's step alone at batch B and the profile's prediction, for each
deployment of `perf/planner_validation.py`.

A pool's step inside the server is slower than alone: the entry points relay every token (Triton's
gRPC frontend, the BLS orchestrator, the detokenizer) on the same cores (colocated), or on the other
core of the same chip (disaggregated, where the decode pool has a core of its own). That cost grows with
the tokens a step produces, so it is fitted as

    step inside = profile's step + r x tokens per step        (least squares through the origin)

per deployment: `r` is the simulator's relay term (`Deployment.relay_s_per_token`), what
`perf/planner_validation.py --repredict` adds to its predictions. Measured apart from the goodput runs
it is then checked against: fixed batches of long streams, not Poisson traffic.

For each B: B streams of `--tokens` tokens each (`min_length` = `max_tokens`, greedy) sent together
to the deployment's entry point; the pool's engine steps and busy seconds from /metrics over the run
(`disagg_engine_steps_total`, `disagg_engine_busy_seconds_total`, all instances of the pool); tokens
per step = B x tokens / steps per instance. Alone: the same engine (the pool's cores, this process)
prefills B prompts and decodes at batch B per instance, after the server has stopped.

    .venv/bin/python -m perf.relay_cost --model-dir .models/smollm2-135m-instruct

Writes `<out-dir>/relay_cost.json` and `.md`.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from disagg.engine.engine import Engine, EngineConfig
from disagg.engine.params import SamplingParams
from disagg.engine.sequence import Request
from disagg.procfs import cmdline, read_stat, serves
from disagg.server import process_group_members
from disagg_tools.planner.profile import Profile
from disagg_tools.repository import POOL_MODELS
from perf.benchlib.clients import ClientConfig, TritonClient
from perf.benchlib.cliutil import log, machine, write_json
from perf.benchlib.deploy import start_triton
from perf.benchlib.workload import PromptFactory, RequestSpec
from perf.orchestration_cost import counted_since, server_decode_counters
from perf.planner_validation import SETUPS, repository

REPO_ROOT = Path(__file__).resolve().parents[1]
PROMPT_TOKENS = 32
# per deployment: the pool that decodes, its instances' cores, and the profile (cores per instance)
POOLS = {
    "disagg": ("decode", ((1,),), 1),
    "colocated": ("colocated", ((0, 1),), 2),
    "colocated2": ("colocated", ((0,), (1,)), 1),
}


async def _streams(url: str, model: str, specs: list[RequestSpec]) -> list[Any]:
    clients = [TritonClient(ClientConfig(kind="triton", url=url, model=model)) for _ in specs]
    for client in clients:
        await client.open()
    try:
        return await asyncio.gather(*(c.stream(s) for c, s in zip(clients, specs, strict=True)))
    finally:
        for client in clients:
            await client.close()


def entry_cpu_s(server_pid: int) -> float:
    """CPU seconds so far of the server's processes that are not pool instances: tritonserver itself
    (its frontends, the ensemble) and the entry points' stubs (orchestrator, text steps): the relay.
    The pool models' stubs (``POOL_MODELS``) are not counted."""
    ticks = 0
    for pid in [server_pid, *process_group_members(server_pid)]:
        argv, stat = cmdline(pid), read_stat(pid)
        if argv is None or stat is None:
            continue
        if pid == server_pid or not any(serves(argv, pool) for pool in POOL_MODELS):
            ticks += stat.cpu_ticks
    return ticks / os.sysconf("SC_CLK_TCK")


def inside(
    url: str, metrics_url: str, setup: str, batch: int, tokens: int, factory: PromptFactory, server_pid: int
) -> dict:
    """B streams together; the pool's mean step and tokens per step over the run, from /metrics, and
    the entry points' CPU time per token streamed."""
    pool = POOLS[setup][0]
    rng = np.random.default_rng(batch)
    specs = [
        RequestSpec(i, 0.0, factory.make(PROMPT_TOKENS, f"r{batch}x{i}", rng), PROMPT_TOKENS, tokens)
        for i in range(batch)
    ]
    before = server_decode_counters(metrics_url, pool)
    cpu_before = entry_cpu_s(server_pid)
    outcomes = asyncio.run(_streams(url, SETUPS[setup].model, specs))
    cpu = entry_cpu_s(server_pid) - cpu_before
    failed = [o.error for o in outcomes if o.error]
    if failed:
        raise RuntimeError(f"{setup}: {len(failed)} of {batch} streams failed: {failed[0]}")
    read = functools.partial(server_decode_counters, metrics_url, pool)
    # at least: one instance stepped every token of one stream
    steps, busy = counted_since(read, before, tokens - 1)
    return {
        "batch": batch,
        "steps": steps,
        "step_ms": busy / steps * 1e3,
        "tokens_per_step": batch * tokens / steps,  # per step of an instance (steps: of all of them)
        "entry_cpu_ms_per_token": cpu / (batch * tokens) * 1e3,
    }


def alone(engine: Engine, batch: int, tokens: int) -> float:
    """Mean decode step of ``engine`` alone (this process, pinned to its cores) at ``batch``, over
    ``tokens`` steps after ten that warm it up."""
    params = SamplingParams(max_tokens=tokens + 16, min_length=tokens + 16)
    outs = engine.prefill([Request(tuple(range(100, 100 + PROMPT_TOKENS)), params) for _ in range(batch)])
    try:
        for _ in range(10):
            engine.decode_step()
        started = time.perf_counter()
        for _ in range(tokens):
            engine.decode_step()
        return (time.perf_counter() - started) / tokens
    finally:
        for out in outs:
            engine.free(out.seq_id)


def fit_relay(rows: list[dict]) -> float:
    """r of step inside = profile's step + r x tokens per step, least squares through the origin."""
    num = sum((r["step_ms"] - r["profile_ms"]) * r["tokens_per_step"] for r in rows)
    den = sum(r["tokens_per_step"] ** 2 for r in rows)
    return num / den / 1e3 if den else 0.0


def entry_cpu_per_token(rows: list[dict]) -> float:
    """The entry points' CPU seconds per token streamed over all the runs (each run weighs by its
    tokens): what the relay takes from the core it shares, the disaggregated prefill pool's."""
    tokens = sum(r["batch"] for r in rows)  # every stream has the same length
    return sum(r["entry_cpu_ms_per_token"] * r["batch"] for r in rows) / tokens / 1e3 if tokens else 0.0


def measure(args: argparse.Namespace, setup: str, profile: Profile) -> dict:
    pool, cores, _ = POOLS[setup]
    factory = PromptFactory.from_model_dir(args.model_dir)
    rows = []
    with tempfile.TemporaryDirectory(prefix="relay-") as name:
        scratch = Path(name)
        repo = repository(SETUPS[setup], args.model_dir, args.dtype, scratch)
        server = start_triton(repo, scratch / "server", args.model_dir, exit_timeout_s=10)
        try:
            url, metrics_url = server.config.grpc_url, server.config.metrics_url
            inside(url, metrics_url, setup, 2, 16, factory, server.pid)  # warms every path up; dropped
            for batch in args.batches:
                row = inside(url, metrics_url, setup, batch, args.tokens, factory, server.pid)
                log(f"{setup} B={batch}: {row['step_ms']:.2f} ms a step, {row['tokens_per_step']:.1f} tokens")
                rows.append(row)
        finally:
            server.stop(grace_s=5)
    os.sched_setaffinity(0, set(cores[0]))  # the engine's threads run where the pool's did
    config = EngineConfig(model_dir=args.model_dir, dtype=server_dtype(args.dtype), cores=cores[0])
    engine = Engine(config)
    alone(engine, 1, args.tokens)  # the first steps of a new engine are slower: dropped
    for row in rows:
        per_instance = max(1, round(row["tokens_per_step"]))
        context = per_instance * (PROMPT_TOKENS + args.tokens // 2)
        row["alone_ms"] = alone(engine, per_instance, args.tokens) * 1e3
        row["profile_ms"] = profile.decode_s(per_instance, context) * 1e3
    return {
        "pool": pool,
        "cores": [list(c) for c in cores],
        "rows": rows,
        "relay_s_per_token": fit_relay(rows),
        "entry_cpu_s_per_token": entry_cpu_per_token(rows),
    }


def server_dtype(dtype: str) -> str:
    from disagg.engine.device import auto_dtype

    return auto_dtype("cpu") if dtype == "auto" else dtype


def markdown(out: dict) -> str:
    lines = [
        "# Relay cost: a pool's decode step inside the server against alone",
        "",
        f"`{out['command']}` on {out['machine']}, "
        f"{out['model']}, {out['dtype']}. B streams of {out['tokens']} tokens sent together; the pool's "
        "step from /metrics over the run; alone: the same engine on the pool's cores in one process at "
        "the same batch per instance; profile: `disagg profile`'s fit (what the simulator uses). "
        "r: step inside = profile + r x tokens per step, least squares through the origin.",
        "",
        "| deployment | B | tokens a step | step inside (ms) | alone (ms) | profile (ms) | inside / alone "
        "| entry points' CPU per token (ms) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for setup, found in out["deployments"].items():
        for r in found["rows"]:
            lines.append(
                f"| {setup} | {r['batch']} | {r['tokens_per_step']:.1f} | {r['step_ms']:.2f} | "
                f"{r['alone_ms']:.2f} | {r['profile_ms']:.2f} | {r['step_ms'] / r['alone_ms']:.2f} | "
                f"{r['entry_cpu_ms_per_token']:.3f} |"
            )
    lines += [
        "",
        "| deployment | r (ms per token a step produces) | entry points' CPU per token (ms, over all runs) |",
        "|---|---:|---:|",
    ]
    for setup, found in out["deployments"].items():
        r, cpu = found["relay_s_per_token"] * 1e3, found["entry_cpu_s_per_token"] * 1e3
        lines.append(f"| {setup} | {r:.3f} | {cpu:.3f} |")
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model-dir", type=Path, default=REPO_ROOT / ".models" / "smollm2-135m-instruct")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--deployments", default="disagg,colocated,colocated2")
    parser.add_argument("--batches", default="1,4,8,16", type=lambda s: [int(x) for x in s.split(",")])
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument(
        "--profile", action="append", default=[], metavar="K=FILE",
        help="the K-core profile (default: perf/results/planner/profile-K.json)",
    )  # fmt: skip
    parser.add_argument("--out-dir", type=Path, default=REPO_ROOT / "perf" / "results" / "planner")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.model_dir = args.model_dir.resolve()
    given = {int(k): Path(v) for k, _, v in (item.partition("=") for item in args.profile)}
    profiles = {k: Profile.load(given.get(k, args.out_dir / f"profile-{k}.json")) for k in (1, 2)}
    out: dict[str, Any] = {
        "command": "python -m perf.relay_cost " + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": machine(),
        "model": args.model_dir.name,
        "dtype": server_dtype(args.dtype),
        "tokens": args.tokens,
        "deployments": {},
    }
    for setup in args.deployments.split(","):
        out["deployments"][setup] = measure(args, setup, profiles[POOLS[setup][2]])
        log(f"{setup}: r = {out['deployments'][setup]['relay_s_per_token'] * 1e3:.3f} ms per token")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    write_json(args.out_dir / "relay_cost.json", out)
    table = markdown(out)
    (args.out_dir / "relay_cost.md").write_text(table)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
