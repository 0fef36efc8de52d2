"""What serving through Triton adds to the time per output token, at low load (one stream at a time).

Measured side by side, interleaved, in one run:
  - engine step: ``Engine.decode_step()`` alone at batch 1 on the decode core (the floor);
  - engine loop: the decode pool's ``EngineLoop`` without Triton, fed by an in-process prefill loop
    over the shm transport; token times taken where the loop hands each token to its response sink;
  - ``ensemble`` and ``llm`` through a real Triton (gRPC streaming), token times at the client.
TPOT = (last token - first token) / (n - 1), with n fixed by ``min_length = max_tokens``. The Triton
figures count time per token from piece arrival; pieces can merge tokens, never split them, so the
first-to-last span still covers n - 1 token intervals.

Where the difference goes: the decode engine's own time per step is read beside each TPOT, in this
process from the loop's counters and inside the server from the decode instance's
``disagg_engine_busy_seconds_total`` / ``disagg_engine_steps_total`` on /metrics. TPOT minus that step
time is what happens between two steps (response hand-off, the loop itself); the step time inside the
server minus the one here is the engine running slower inside the server (the relay and Triton's own
threads busy on the other core of the same chip).

    python -m perf.orchestration_cost [--triton-url HOST:GRPC_PORT --metrics-url URL] [--reps 5]

The colocated pool is measured the same way, after the rest: ``Engine.decode_step()`` alone on both
cores (two threads, this process) beside TPOT through ``ensemble_colocated`` and the colocated pool's
own step inside the server. Its step inside against alone is what sharing the pool's two cores with
the token relay costs it.

Without --triton-url a server is started on model_repository/. Writes
perf/results/orchestration_cost/orchestration_cost.{json,md} (``make bench-orchestration``).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import os
import secrets
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

from disagg.engine.device import auto_dtype
from disagg.engine.engine import Engine, EngineConfig
from disagg.engine.params import SamplingParams
from disagg.engine.sequence import Request
from disagg.engine.tokenizer import Tokenizer
from disagg.kv.settings import KVSettings
from disagg.paths import REPO_ROOT, resolve_model_dir
from disagg.pool.instance import PoolConfig, build_instance
from disagg.protocol.messages import DecodeJob, Failed, Prefilled, PrefillJob
from disagg_tools.autoscaler.snapshot import parse_exposition
from disagg_tools.autoscaler.source import http_get
from disagg_tools.checkpoints import ensure_model
from perf.benchlib import report
from perf.benchlib.clients import ClientConfig, TritonClient
from perf.benchlib.deploy import start_triton
from perf.benchlib.outputs import write_results
from perf.benchlib.workload import RequestSpec

RESULTS = Path(__file__).resolve().parent / "results" / "orchestration_cost"
PREFILL_CORE, DECODE_CORE = 0, 1  # as in the default repository


class _Sink:
    """Stamps every event as the loop hands it over; signals the final one."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.events: list[object] = []
        self.done = threading.Event()

    def emit(self, event: object, final: bool) -> None:
        self.times.append(time.perf_counter())
        self.events.append(event)
        if final:
            self.done.set()

    def is_cancelled(self) -> bool:
        return False


class LocalPools:
    """A prefill and a decode engine loop in this process, pinned like the default repository."""

    def __init__(self, model_dir: Path, dtype: str) -> None:
        secret = secrets.token_bytes(32)
        prefix = f"oc{os.getpid()}"
        self.loops = {}
        self.transports = []
        for role, core in (("prefill", PREFILL_CORE), ("decode", DECODE_CORE)):
            engine = EngineConfig(model_dir=model_dir, dtype=dtype, cores=(core,))
            config = PoolConfig(role=role, engine=engine, kv=KVSettings(cache_mb=64), prefix=prefix)
            loop, transport = build_instance(config, secret)
            self.loops[role] = loop.start()  # the loop thread inherits this thread's pinning
            self.transports.append(transport)
        os.sched_setaffinity(0, {PREFILL_CORE})

    def decode_counters(self) -> tuple[int, float]:
        stats = self.loops["decode"].stats()
        return stats.engine_steps, stats.engine_busy_s

    def tpot(self, prompt: list[int], tokens: int, handle: str) -> float:
        params = SamplingParams(max_tokens=tokens, min_length=tokens)
        sink = _Sink()
        self.loops["prefill"].submit(PrefillJob(handle, sink, Request(tuple(prompt), params)))
        sink.done.wait(60)
        first = sink.events[-1]
        if not isinstance(first, Prefilled) or first.descriptor is None:
            raise RuntimeError(f"prefill failed: {first}")
        sink = _Sink()
        self.loops["decode"].submit(DecodeJob(handle + "d", sink, first.state, first.descriptor))
        sink.done.wait(120)
        if any(isinstance(e, Failed) for e in sink.events):
            raise RuntimeError(f"decode failed: {sink.events[-1]}")
        # the first token came from prefill: decode's n - 1 tokens span n - 2 intervals
        return (sink.times[-1] - sink.times[0]) / (len(sink.times) - 1)

    def step_time(self, prompt: list[int], steps: int = 32) -> float:
        """decode_step() alone, on the decode core, with the loops idle."""
        os.sched_setaffinity(0, {DECODE_CORE})
        try:
            return decode_step_time(self.loops["decode"].engine, prompt, steps)
        finally:
            os.sched_setaffinity(0, {PREFILL_CORE})

    def close(self) -> None:
        for loop in self.loops.values():
            loop.shutdown()
        for transport in self.transports:
            if transport is not None:
                transport.close()


async def triton_tpot(
    url: str, model: str, prompt: str, prompt_tokens: int, tokens: int, index: int
) -> float:
    client = TritonClient(ClientConfig(kind="triton", url=url, model=model))
    await client.open()
    try:
        outcome = await client.stream(RequestSpec(index, 0.0, prompt, prompt_tokens, tokens))
    finally:
        await client.close()
    if outcome.error or outcome.first_piece is None or outcome.last_piece is None:
        raise RuntimeError(f"{model}: {outcome.error}")
    return (outcome.last_piece - outcome.first_piece) / (tokens - 1)


def server_decode_counters(metrics_url: str, pool: str = "decode") -> tuple[int, float]:
    """Engine steps and busy seconds of the server's `pool` (all instances) from /metrics."""
    snapshot = parse_exposition(http_get(metrics_url, 10.0).decode(), time.time())
    steps = snapshot.select("disagg_engine_steps_total", pool=pool).values()
    busy = snapshot.select("disagg_engine_busy_seconds_total", pool=pool).values()
    return int(sum(steps)), sum(busy)


def served_stream(
    url: str,
    metrics_url: str | None,
    model: str,
    prompt: str,
    prompt_tokens: int,
    tokens: int,
    index: int,
    pool: str = "decode",
) -> tuple[float, float | None]:
    """One stream of `tokens` through `model`: its TPOT, and `pool`'s mean engine step inside the server
    over it (from /metrics; None without `metrics_url`), in seconds."""
    read = functools.partial(server_decode_counters, metrics_url, pool) if metrics_url else None
    before = read() if read is not None else None
    tpot = asyncio.run(triton_tpot(url, model, prompt, prompt_tokens, tokens, index))
    if read is None or before is None:
        return tpot, None
    return tpot, step_during(read, before, tokens - 1)


def decode_step_time(engine: Engine, prompt: list[int], steps: int = 32) -> float:
    """`engine.decode_step()` alone at batch 1, after three warm-up steps."""
    (out,) = engine.prefill([Request(tuple(prompt), SamplingParams(max_tokens=steps + 8))])
    try:
        for _ in range(3):
            engine.decode_step()
        start = time.perf_counter()
        for _ in range(steps):
            engine.decode_step()
        return (time.perf_counter() - start) / steps
    finally:
        engine.free(out.seq_id)


def colocated(url: str, metrics_url: str | None, model_dir: Path, dtype: str, reps: int, tokens: int) -> dict:
    """The colocated pool's step alone on both cores (this process, pinned there) and inside the
    server, with TPOT through `ensemble_colocated`; medians of `reps` interleaved rounds (one more,
    dropped, warms up)."""
    tokenizer = Tokenizer(model_dir)
    os.sched_setaffinity(0, {PREFILL_CORE, DECODE_CORE})
    engine = Engine(
        EngineConfig(model_dir=model_dir, dtype=dtype, cores=(PREFILL_CORE, DECODE_CORE), kv_cache_mb=64)
    )
    alone, tpots, inside = [], [], []
    for rep in range(reps + 1):
        prompt = f"Request {rep}: tell a long story about the mountains"
        ids = tokenizer.encode(prompt)
        step = decode_step_time(engine, ids)
        tpot, step_inside = served_stream(
            url, metrics_url, "ensemble_colocated", prompt, len(ids), tokens, 1000 + rep, pool="colocated"
        )
        if rep:
            alone.append(step)
            tpots.append(tpot)
            if step_inside is not None:
                inside.append(step_inside)
    return {
        "engine_step_ms": statistics.median(alone) * 1e3,
        "tpot_ms": statistics.median(tpots) * 1e3,
        "server_step_ms": statistics.median(inside) * 1e3 if inside else None,
        "samples_ms": {
            "engine step": [round(x * 1e3, 3) for x in alone],
            "ensemble_colocated": [round(x * 1e3, 3) for x in tpots],
            "step inside the server": [round(x * 1e3, 3) for x in inside],
        },
    }


def step_during(read: Callable[[], tuple[int, float]], before: tuple[int, float], steps: int) -> float:
    """Mean engine step since `before`, once the counters show at least `steps` more steps."""
    done, busy = counted_since(read, before, steps)
    return busy / done


def counted_since(
    read: Callable[[], tuple[int, float]], before: tuple[int, float], steps: int
) -> tuple[int, float]:
    """(engine steps, busy seconds) since `before`, once the counters show at least `steps` more steps
    (they are published a quarter of a second apart, so this polls for up to five seconds)."""
    deadline = time.monotonic() + 5.0
    while True:
        after = read()
        if after[0] - before[0] >= steps or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    done = after[0] - before[0]
    if done < steps:
        raise RuntimeError(f"decode counters show {done} steps, expected {steps}")
    return done, after[1] - before[1]


def run(url: str, metrics_url: str | None, model_dir: Path, reps: int, tokens: int) -> dict:
    tokenizer = Tokenizer(model_dir)
    dtype = auto_dtype("cpu")  # what the repository's pools resolve `auto` to on this machine
    local = LocalPools(model_dir, dtype)
    paths = ("engine step", "engine loop", "ensemble", "llm")
    samples: dict[str, list[float]] = {name: [] for name in paths}
    steps: dict[str, list[float]] = {name: [] for name in paths[1:]}
    decode_steps = tokens - 1  # the first token comes from prefill; batch 1: one token per step
    try:
        for rep in range(reps + 1):  # the first round warms every path up and is dropped
            prompt = f"Request {rep}: tell a long story about the sea"
            ids = tokenizer.encode(prompt)
            row = {"engine step": local.step_time(ids)}
            step_row = {}
            before = local.decode_counters()
            row["engine loop"] = local.tpot(ids, tokens, f"oc-{rep}")
            step_row["engine loop"] = step_during(local.decode_counters, before, decode_steps)
            for model in ("ensemble", "llm"):
                row[model], step = served_stream(url, metrics_url, model, prompt, len(ids), tokens, rep)
                if step is not None:
                    step_row[model] = step
            if rep:
                for name, value in row.items():
                    samples[name].append(value)
                for name, value in step_row.items():
                    steps[name].append(value)
    finally:
        local.close()
    both_cores = colocated(url, metrics_url, model_dir, dtype, reps, tokens)
    medians = {name: statistics.median(values) for name, values in samples.items()}
    step_medians = {name: statistics.median(values) for name, values in steps.items() if values}
    base = medians["engine loop"]
    return {
        "finished": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "tokens": tokens,
        "reps": reps,
        "dtype": dtype,
        "tpot_ms": {k: v * 1e3 for k, v in medians.items()},
        "decode_engine_step_ms": {k: v * 1e3 for k, v in step_medians.items()},
        "samples_ms": {k: [round(x * 1e3, 3) for x in v] for k, v in samples.items()},
        "step_samples_ms": {k: [round(x * 1e3, 3) for x in v] for k, v in steps.items()},
        "overhead_vs_engine_loop": {k: medians[k] / base - 1 for k in ("ensemble", "llm")},
        "loop_overhead_vs_step": medians["engine loop"] / medians["engine step"] - 1,
        "colocated": both_cores,
    }


def markdown(result: dict) -> str:
    return "\n".join(["# Orchestration cost at low load", "", *report.orchestration_section(result)])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--triton-url", help="gRPC host:port of a running server (default: start one)")
    parser.add_argument("--metrics-url", help="that server's /metrics URL (for its decode engine step)")
    parser.add_argument("--model", help="checkpoint folder (default: $MODEL_DIR, else SmolLM2-135M-Instruct)")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--out-dir", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    model_dir = ensure_model(resolve_model_dir(args.model))
    server = None
    url, metrics_url = args.triton_url, args.metrics_url
    if url is None:
        server = start_triton(REPO_ROOT / "model_repository", Path(tempfile.mkdtemp(prefix="oc-")), model_dir)
        url, metrics_url = server.config.grpc_url, server.config.metrics_url
    try:
        result = run(url, metrics_url, model_dir, args.reps, args.tokens)
    finally:
        if server is not None:
            server.stop()
    table = markdown(result)
    write_results(args.out_dir, "orchestration_cost", result, table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
