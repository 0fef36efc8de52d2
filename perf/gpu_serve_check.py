"""KIND_GPU pools served by a real Triton on a GPU: the repository of ``disagg repository --set
pools.<pool>.gpus=[...]``, the KV hand-off over CUDA IPC, checked against the engine itself.

    python -m perf.gpu_serve_check --out DIR [--max-tokens N]

Writes the repository (prefill on GPU 0, decode on ``--decode-gpu``, colocated on GPU 0), starts
``disagg serve`` on it, and for each prompt compares, one request at a time:
  - ``ensemble`` (disaggregated: prefill pool, CUDA IPC hand-off, decode pool) and
    ``ensemble_colocated`` with the engine's own greedy text on the same GPU and dtype, run in this
    process at batch 1 (bit for bit the computation the idle pools do);
  - streamed TTFT and time per output token of both entry points (``generate_stream``);
  - the pools' KV gauges after the requests (no block left held) and the hand-offs counted;
  - the served TPOT (``served_tpot``): through ``ensemble`` and ``llm`` over gRPC, ``--tpot-tokens``
    tokens a stream (``min_length`` = ``max_tokens``), beside the decode pool's own engine step inside the
    server over the same tokens (``disagg_engine_busy_seconds_total`` / ``disagg_engine_steps_total``),
    medians of ``--tpot-reps``; TPOT minus the step is what the relay and the loop between steps add to
    each token;
  - the relay's floor (``perf.relay_floor``): a second server on the same repository with every pool's
    engine computing nothing (``null_compute``), the same TPOT measurement on it, and the target
    TPOT <= decode step + floor + 0.5 ms.

On a machine with one GPU, ``--decode-gpu 0`` puts the decode pool on the prefill pool's GPU: the
repository tool refuses that (disaggregation wants disjoint devices), so the decode pool's config is
rewritten to GPU 0 after it is written, which still hands the KV over CUDA IPC between two processes.
Writes serve_check.json into --out; exits 1 when a check fails.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from perf.relay_floor import floor, null_repository, served_tpot

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]
HTTP = "127.0.0.1:18000"
GRPC = "127.0.0.1:18001"
METRICS = "http://127.0.0.1:18002/metrics"


def _post(path: str, body: dict[str, Any], timeout_s: float = 120) -> Any:
    request = urllib.request.Request(
        f"http://{HTTP}{path}", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as exc:  # the server's error text says why
        raise SystemExit(f"{path}: HTTP {exc.code}: {exc.read().decode(errors='replace')}") from None


def _stream(model: str, body: dict[str, Any]) -> tuple[list[str], list[float]]:
    """The streamed pieces of one request and the arrival time of each, from the request's start."""
    request = urllib.request.Request(
        f"http://{HTTP}/v2/models/{model}/generate_stream",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    pieces, times = [], []
    start = time.perf_counter()
    with urllib.request.urlopen(request, timeout=120) as response:
        for line in response:
            text = line.decode().strip()
            if text.startswith("data:"):
                times.append(time.perf_counter() - start)
                pieces.append(json.loads(text[5:])["text_output"])
    return pieces, times


def _get(path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://{HTTP}{path}", timeout=5) as response:
            return response.status, response.read().decode()
    except OSError:
        return 0, ""


def _metrics(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        return response.read().decode()


def _oracle(model_dir: Path, dtype: str, max_tokens: int) -> dict[str, str]:
    """Greedy text of each prompt from the engine on cuda:0, one prompt at a time."""
    from disagg.engine.engine import Engine, EngineConfig
    from disagg.engine.params import SamplingParams
    from disagg.engine.sequence import Request
    from disagg.engine.tokenizer import Tokenizer
    from disagg.pool.offline import generate

    tokenizer = Tokenizer(model_dir)
    engine = Engine(EngineConfig(model_dir=model_dir, device="cuda:0", dtype=dtype, kv_cache_mb=64))
    params = SamplingParams(max_tokens=max_tokens)
    texts = {}
    for prompt in PROMPTS:
        token_ids, _ = generate(engine, Request(tuple(tokenizer.encode(prompt)), params))
        texts[prompt] = tokenizer.decode(token_ids)
    engine.close()
    return texts


def _write_repository(out: Path, decode_gpu: int) -> Path:
    from disagg_tools.repository import main as repository

    repo = out / "gpu_repository"
    gpus = {"prefill": 0, "decode": max(decode_gpu, 1), "colocated": 0}
    keys = [f"pools.{pool}.gpus=[{gpu}]" for pool, gpu in gpus.items()]
    if repository(["--out", str(repo), *(a for key in keys for a in ("--set", key))]) != 0:
        raise SystemExit("disagg repository failed")
    if decode_gpu == 0:  # one GPU: decode beside prefill on GPU 0 (see the module's docstring)
        config = repo / "decode" / "config.pbtxt"
        text, count = re.subn(r"gpus: \[\s*1\s*\]", "gpus: [ 0 ]", config.read_text())
        if count != 1:
            raise SystemExit("the decode pool's GPU list was not found in its config")
        config.write_text(text)
    return repo


@contextlib.contextmanager
def _serving(repo: Path, log_path: Path, model_dir: Path, ready_timeout_s: float) -> Iterator[float]:
    """``disagg serve`` on ``repo`` at the fixed ports, its output into ``log_path``; yields the seconds
    it took to be ready, and stops it (its whole process group) on the way out."""
    log = open(log_path, "w")  # noqa: SIM115 (open for the server's whole life)
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "disagg_tools.cli",
            "serve",
            "--model-repository",
            str(repo),
            "--openai-port",
            "0",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        env={
            **os.environ,
            "MODEL_DIR": str(model_dir),
            "HTTP_PORT": "18000",
            "GRPC_PORT": "18001",
            "METRICS_PORT": "18002",
        },
        start_new_session=True,
    )
    try:
        started = time.monotonic()
        while _get("/v2/health/ready")[0] != 200:
            if server.poll() is not None or time.monotonic() > started + ready_timeout_s:
                raise SystemExit(f"server not ready (exit {server.poll()}); see {log_path.name}")
            time.sleep(1)  # polling a server's readiness, not synchronising our own threads
        yield round(time.monotonic() - started, 1)
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGTERM)
            try:
                server.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(server.pid, signal.SIGKILL)
        log.close()


def _kv_metrics() -> tuple[list[str], list[str], bool]:
    """The KV and engine lines of /metrics once no block is held (or after 15 s), the gauges still
    holding blocks, and whether any KV bytes were handed over."""
    wanted = ("disagg_kv_blocks_used", "disagg_kv_transfer_bytes_total", "disagg_kv_transfer_failures_total")
    deadline = time.monotonic() + 15  # the pools' gauges are published every few seconds
    while True:
        lines = [
            line
            for line in _metrics(18002).splitlines()
            if line.startswith((*wanted, "disagg_engine_info", "disagg_pool_load_seconds"))
        ]
        samples = [line.rsplit(" ", 1) for line in lines]
        held = [name for name, value in samples if name.startswith(wanted[0]) and float(value) != 0]
        if not held or time.monotonic() > deadline:
            break
        time.sleep(0.5)  # polling the server's published gauges
    handed = any(name.startswith(wanted[1]) and float(value) > 0 for name, value in samples)
    return lines, held, handed


def _write(out: Path, report: dict[str, Any]) -> None:
    (out / "serve_check.json").write_text(json.dumps(report, indent=2) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--decode-gpu", type=int, default=0)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--ready-timeout", type=float, default=240)
    parser.add_argument("--tpot-tokens", type=int, default=64, help="tokens a stream for the served TPOT")
    parser.add_argument("--tpot-reps", type=int, default=5, help="its rounds (one more warms up)")
    args = parser.parse_args(argv)
    import torch

    from disagg.paths import resolve_model_dir
    from disagg_tools.checkpoints import ensure_model

    model_dir = ensure_model(resolve_model_dir())
    args.out.mkdir(parents=True, exist_ok=True)
    repo = _write_repository(args.out, args.decode_gpu)
    dtype = "bfloat16" if torch.cuda.is_bf16_supported() else "float32"  # what "auto" resolves to
    expected = _oracle(model_dir, dtype, args.max_tokens)
    report: dict[str, Any] = {"model": str(model_dir), "dtype": dtype, "gpu": torch.cuda.get_device_name()}
    failures: list[str] = []
    with _serving(repo, args.out / "triton.log", model_dir, args.ready_timeout) as ready_s:
        report["ready_s"] = ready_s
        rows = []
        for model in ("ensemble", "ensemble_colocated", "llm"):
            for prompt in PROMPTS:
                body = {"text_input": prompt, "max_tokens": args.max_tokens, "exclude_input_in_output": True}
                got = _post(f"/v2/models/{model}/generate", body)["text_output"]
                pieces, times = _stream(model, body)
                ok = got == expected[prompt] and "".join(pieces) == expected[prompt]
                if not ok:
                    failures.append(f"{model}: {prompt!r} gave {got!r}, engine {expected[prompt]!r}")
                rows.append(
                    dict(
                        model=model,
                        prompt=prompt,
                        equal=ok,
                        first_event_ms=times[0] * 1e3,
                        last_event_ms=times[-1] * 1e3,
                        events=len(times),
                    )
                )
        report["requests"] = rows
        report["served_tpot"] = served_tpot(GRPC, METRICS, args.tpot_reps, args.tpot_tokens)
        report["metrics"], held, handed = _kv_metrics()
    if held:
        failures.append(f"KV blocks still held after the requests: {held}")
    if not handed:
        failures.append("no KV bytes were handed over")
    report["failures"] = failures
    _write(args.out, report)  # kept should the second server fail
    # the relay's floor: the same repository with engines that compute nothing, on a server of its own
    try:
        null = null_repository(repo, args.out / "null")
        with _serving(null, args.out / "triton_null.log", model_dir, args.ready_timeout):
            report["null_served_tpot"] = served_tpot(GRPC, METRICS, args.tpot_reps, args.tpot_tokens)
        report["relay_floor"] = floor(report["served_tpot"], report["null_served_tpot"])
    except (Exception, SystemExit) as exc:
        failures.append(f"relay floor: {exc}")
    _write(args.out, report)
    print(json.dumps(report, indent=2))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
