"""RELIABILITY C6: requests to `llm` cancelled at random moments, then a check that nothing stayed behind.

Each request is a gRPC stream to `llm` (a short or a long prompt, seeded) that its client cancels: a
third as soon as sent, a third after a random delay (from before its first token, queued or being
prefilled, to mid-stream), a third after 1 to 8 pieces; `--concurrency` streams are open at once.
Afterwards the server's `/metrics` must come back to where it was before:
the pools' queues, active sequences, prompt tokens waiting and KV blocks in use, and no call from an
entry point to a pool left open (`disagg_pool_calls_open`); `disagg_requests_total{model="llm"}` must
count every request that got a response, and none twice (one cancelled as soon as it is sent may never
reach the model). The report says how long that took and what the clients saw.

    .venv/bin/python -m perf.cancel_storm --start-triton --model-dir .models/tiny --requests 1000

`--grpc-url` and `--metrics-url` run it against a server already up instead (the integration suite
does, with a few dozen requests). Writes `<out-dir>/cancel_storm.json` and `.md`; exits 1 when
something stayed behind.
"""

from __future__ import annotations

import argparse
import queue
import random
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from perf.benchlib.cliutil import log, machine, write_json
from perf.benchlib.gauges import scrape, settle

REPO_ROOT = Path(__file__).resolve().parents[1]
SHORT_PROMPT = "Hello world"
LONG_PROMPT = " ".join(["the quick brown fox jumps over the lazy dog"] * 60)  # ~540 tokens


@dataclass(frozen=True)
class StormResult:
    requests: int
    cancelled_before_first_piece: int  # the client left before any text came back
    cancelled_mid_stream: int
    finished_before_cancel: int  # the stream ended (final or error) before its client left
    errors_seen: int  # error responses the clients got before leaving (not CANCELLED)
    counted: float  # disagg_requests_total{model="llm"} increase: the requests that reached `llm`
    settle_s: float | None  # from the last cancel to every gauge back at its baseline (None: never)
    leftover: dict[str, float]  # gauges still off their baseline at the end (empty when clean)

    @property
    def clean(self) -> bool:
        """Everything back, and each request counted at most once; at least every one that got a
        response counted (one cancelled as soon as sent may never have reached the model)."""
        reached = self.cancelled_mid_stream + self.finished_before_cancel
        counted_once = reached <= self.counted <= self.requests
        return self.settle_s is not None and not self.leftover and counted_once


def _inputs(prompt: str, max_tokens: int) -> list[Any]:
    import numpy as np
    import tritonclient.grpc as grpcclient

    out = []
    for name, value, kind in (
        ("text_input", np.array([[prompt.encode()]], dtype=np.object_), "BYTES"),
        ("max_tokens", np.array([[max_tokens]], dtype=np.int32), "INT32"),
        ("min_length", np.array([[max_tokens]], dtype=np.int32), "INT32"),  # no early end token
        ("stream", np.array([[True]], dtype=bool), "BOOL"),
    ):
        tensor = grpcclient.InferInput(name, list(value.shape), kind)
        tensor.set_data_from_numpy(value)
        out.append(tensor)
    return out


def one(grpc_url: str, prompt: str, max_tokens: int, delay_s: float, after: int | None) -> tuple[str, int]:
    """One stream cancelled after `delay_s` (0: right after it is sent), or after `after` pieces when
    that is given: (what happened first, error responses seen)."""
    import tritonclient.grpc as grpcclient

    events: queue.SimpleQueue[Any] = queue.SimpleQueue()
    client = grpcclient.InferenceServerClient(grpc_url)
    pieces = errors = 0
    ended = False
    try:
        client.start_stream(callback=lambda result, error: events.put((result, error)))
        client.async_stream_infer("llm", _inputs(prompt, max_tokens), enable_empty_final_response=True)
        deadline = time.monotonic() + (60.0 if after is not None else delay_s)
        while (left := deadline - time.monotonic()) > 0 and pieces != after:
            try:
                result, error = events.get(timeout=left)
            except queue.Empty:
                break
            if error is not None:
                errors += 1
                ended = True
                break
            pieces += 1
            if result.get_response().parameters["triton_final_response"].bool_param:
                ended = True
                break
        client.stop_stream(cancel_requests=True)
    finally:
        client.close()
    if ended:
        return "finished", errors
    return ("mid_stream" if pieces else "before_first_piece"), errors


def storm(
    grpc_url: str,
    metrics_url: str,
    requests: int,
    concurrency: int,
    seed: int,
    max_delay_s: float,
    max_tokens: int,
    settle_timeout_s: float = 30.0,
) -> StormResult:
    rng = random.Random(seed)
    # a third each: cancelled as soon as sent (before dispatch or queued), after a random delay (any
    # moment: queued, prefilling, mid-stream), after 1 to 8 pieces (mid-stream for certain)
    plan = []
    for i in range(requests):
        prompt = LONG_PROMPT if rng.random() < 0.3 else SHORT_PROMPT
        delay, after = rng.uniform(0, max_delay_s), rng.randint(1, 8)
        plan.append((prompt, (0.0, None) if i % 3 == 0 else (delay, None) if i % 3 == 1 else (0.0, after)))
    baseline = scrape(metrics_url)
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        outcomes = list(pool.map(lambda p: one(grpc_url, p[0], max_tokens, *p[1]), plan))
    settle_s, leftover = settle(metrics_url, baseline, settle_timeout_s)
    kinds = [kind for kind, _ in outcomes]
    return StormResult(
        requests=requests,
        cancelled_before_first_piece=kinds.count("before_first_piece"),
        cancelled_mid_stream=kinds.count("mid_stream"),
        finished_before_cancel=kinds.count("finished"),
        errors_seen=sum(errors for _, errors in outcomes),
        counted=scrape(metrics_url)["llm_requests"] - baseline["llm_requests"],
        settle_s=settle_s,
        leftover=leftover,
    )


def markdown(result: StormResult, args: argparse.Namespace, command: str) -> str:
    rows = [
        ("requests", result.requests),
        ("cancelled before their first piece", result.cancelled_before_first_piece),
        ("cancelled mid-stream", result.cancelled_mid_stream),
        ("ended before their cancel", result.finished_before_cancel),
        ("error responses seen by clients", result.errors_seen),
        ("counted in disagg_requests_total (reached the model)", f"{result.counted:g}"),
        (
            "seconds until every gauge was back",
            "never" if result.settle_s is None else f"{result.settle_s:.1f}",
        ),
        ("left behind", ", ".join(f"{k}={v:g}" for k, v in result.leftover.items()) or "nothing"),
    ]
    lines = [
        "# Cancel storm (RELIABILITY C6)",
        "",
        f"`{command}` on {machine()}: {args.concurrency} streams at once, a third each cancelled as "
        f"soon as sent, after U(0, {args.max_delay_s:g}) s, after 1 to 8 pieces; 30 % with a "
        f"~540-token prompt, max_tokens (and min_length) {args.max_tokens}.",
        "",
        "| | |",
        "|---|---:|",
        *(f"| {name} | {value} |" for name, value in rows),
        "",
        f"**{'Clean' if result.clean else 'NOT clean'}.**",
        "",
    ]
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--start-triton", action="store_true", help="start a server on --repository")
    parser.add_argument("--repository", type=Path, default=REPO_ROOT / "model_repository")
    parser.add_argument("--model-dir", type=Path, default=REPO_ROOT / ".models" / "tiny")
    parser.add_argument("--grpc-url", help="a running server's gRPC address (host:port)")
    parser.add_argument("--metrics-url", help="its /metrics URL")
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--max-delay-s", type=float, default=1.0)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out-dir", type=Path, default=REPO_ROOT / "perf" / "results" / "cancel_storm")
    args = parser.parse_args(argv)
    if not args.start_triton and not (args.grpc_url and args.metrics_url):
        parser.error("give --start-triton, or --grpc-url and --metrics-url")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    knobs = (args.requests, args.concurrency, args.seed, args.max_delay_s, args.max_tokens)
    if args.start_triton:
        from perf.benchlib.deploy import start_triton

        with tempfile.TemporaryDirectory(prefix="cancel-storm-") as scratch:
            server = start_triton(args.repository, Path(scratch), args.model_dir, exit_timeout_s=10)
            try:
                result = storm(server.config.grpc_url, server.config.metrics_url, *knobs)
            finally:
                server.stop(grace_s=5)
    else:
        result = storm(args.grpc_url, args.metrics_url, *knobs)
    command = "python -m perf.cancel_storm " + " ".join(argv if argv is not None else sys.argv[1:])
    out = {"machine": machine(), "args": {k: str(v) for k, v in vars(args).items()}, **asdict(result)}
    out["clean"] = result.clean
    write_json(args.out_dir / "cancel_storm.json", out)
    report = markdown(result, args, command)
    (args.out_dir / "cancel_storm.md").write_text(report)
    log(report)
    return 0 if result.clean else 1


if __name__ == "__main__":
    sys.exit(main())
