"""The relay's floor: what a streamed token costs through Triton beside the model.

Serves a repository twice, one server after the other: as it is, then with every pool's engine
computing nothing (``null_compute``: no weights, no forward pass, each step repeats a row's own token,
``disagg.engine.nullmodel``). On each, TPOT through ``ensemble`` and ``llm`` over gRPC (``--tokens`` a
stream, ``min_length`` = ``max_tokens``, greedy), beside the decode pool's own engine step inside the
server over the same tokens (``disagg_engine_busy_seconds_total`` / ``disagg_engine_steps_total``),
medians of ``--reps`` after one dropped warm-up round.

- **floor**: the null server's TPOT minus its step: the relay (Triton's frontend, the orchestrator,
  the text steps, the pool loop between steps) with no model behind it;
- **between steps**: the real server's TPOT minus its step: what a token costs beyond the model there;
- the relay runs beside the steps (its own threads and processes, on the other cores where it can):
  where the floor is above the time between steps, it overlaps the steps and only its serial part
  shows in TPOT; where the step gets shorter than the floor (a GPU), the floor bounds TPOT instead;
- **target** (the GPU issue): real TPOT <= real step + floor + 0.5 ms.

    .venv/bin/python -m perf.relay_floor --model-dir .models/smollm2-135m-instruct

On a GPU the served check (``perf.gpu_serve_check``) runs the same measurement on its KIND_GPU
repository. Writes ``<out-dir>/relay_floor.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
RESULTS = REPO_ROOT / "perf" / "results" / "relay_floor"
MODELS = ("ensemble", "llm")
SLACK_MS = 0.5  # the target's allowance over step + floor
NULL = {"null_compute": "true"}


def served_tpot(grpc_url: str, metrics_url: str, reps: int, tokens: int) -> dict[str, Any]:
    """TPOT through ``ensemble`` and ``llm`` and the decode pool's engine step inside the server over
    the same request (ms, medians of ``reps`` after one dropped warm-up round), and TPOT minus the step
    (``perf.orchestration_cost.served_stream``, over gRPC and /metrics)."""
    from perf.orchestration_cost import served_stream

    out: dict[str, Any] = {"tokens": tokens, "reps": reps}
    for model in MODELS:
        tpots, steps = [], []
        for rep in range(reps + 1):
            prompt = f"Request {rep}: tell a long story about the sea"
            seconds, step = served_stream(grpc_url, metrics_url, model, prompt, 0, tokens, 5000 + rep)
            if rep and step is not None:
                tpots.append(seconds * 1e3)
                steps.append(step * 1e3)
        if not tpots:
            raise RuntimeError(f"{model}: the decode pool's step was not readable on /metrics")
        tpot_ms, step_ms = statistics.median(tpots), statistics.median(steps)
        out[model] = {
            "tpot_ms": tpot_ms,
            "decode_step_ms": step_ms,
            "between_steps_ms": tpot_ms - step_ms,
            "samples": {"tpot_ms": tpots, "decode_step_ms": steps},
        }
    return out


def null_repository(repository: Path, scratch: Path) -> Path:
    """A copy of ``repository`` under ``scratch`` whose every pool runs the null engine."""
    from perf.benchlib.deploy import with_pools_parameters

    return with_pools_parameters(repository, scratch, NULL)


def floor(real: dict[str, Any], null: dict[str, Any]) -> dict[str, Any]:
    """Per entry point: the floor beside the real server's time between steps, and the target (real
    TPOT <= real step + floor + SLACK_MS), from two ``served_tpot`` results."""
    out: dict[str, Any] = {}
    for model in MODELS:
        r, n = real[model], null[model]
        relay = n["tpot_ms"] - n["decode_step_ms"]
        bound = r["decode_step_ms"] + relay + SLACK_MS
        between = r["between_steps_ms"]
        out[model] = {
            "tpot_ms": r["tpot_ms"],
            "decode_step_ms": r["decode_step_ms"],
            "between_steps_ms": between,
            "null_tpot_ms": n["tpot_ms"],
            "null_step_ms": n["decode_step_ms"],
            "floor_ms": relay,
            "overlapped": relay > between,  # the relay ran beside the steps, not between them
            "bound_ms": bound,
            "met": r["tpot_ms"] <= bound,
        }
    return out


def markdown(result: dict[str, Any]) -> str:
    rows = [
        "| entry point | TPOT | decode step inside | between steps | null TPOT | null step | floor | "
        "target: TPOT <= step + floor + 0.5 |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for model in MODELS:
        m = result["floor"][model]
        verdict = f"{'met' if m['met'] else 'missed'} ({m['tpot_ms']:.2f} vs {m['bound_ms']:.2f})"
        rows.append(
            f"| `{model}` | {m['tpot_ms']:.2f} | {m['decode_step_ms']:.2f} | {m['between_steps_ms']:.2f} | "
            f"{m['null_tpot_ms']:.2f} | {m['null_step_ms']:.2f} | {m['floor_ms']:.2f} | {verdict} |"
        )
    return "\n".join(
        [
            "# The relay's floor (ms per output token)",
            "",
            f"Written by `perf/relay_floor.py`: `{result['command']}`. {result['tokens']} tokens a stream, "
            f"medians of {result['reps']}; {result['machine']}.",
            "",
            *rows,
            "",
            "floor = null TPOT - null step: the relay with no model behind it. between steps = TPOT - "
            "step on the real server. The relay runs beside the steps: a floor above the time between "
            "steps overlaps them, and only the serial part of the relay shows in TPOT; a step shorter "
            "than the floor leaves TPOT at the floor.",
            "",
        ]
    )


def measure(repository: Path, model_dir: Path, reps: int, tokens: int) -> dict[str, Any]:
    """Both servers, one after the other, on this machine's CPUs."""
    from perf.benchlib.deploy import start_triton

    runs = {}
    with tempfile.TemporaryDirectory(prefix="relay-floor-") as scratch:
        for name, repo in (("real", repository), ("null", null_repository(repository, Path(scratch)))):
            work = Path(scratch) / f"work-{name}"
            work.mkdir()
            server = start_triton(repo, work, model_dir)
            try:
                runs[name] = served_tpot(server.config.grpc_url, server.config.metrics_url, reps, tokens)
            finally:
                server.stop()
    return {"real": runs["real"], "null": runs["null"], "floor": floor(runs["real"], runs["null"])}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model-dir", type=Path, default=REPO_ROOT / ".models" / "smollm2-135m-instruct")
    parser.add_argument("--repository", type=Path, default=REPO_ROOT / "model_repository")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--out-dir", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    from perf.benchlib.cliutil import machine
    from perf.benchlib.outputs import write_results

    result = measure(args.repository, args.model_dir, args.reps, args.tokens)
    result.update(
        tokens=args.tokens,
        reps=args.reps,
        machine=machine(),
        command="python -m perf.relay_floor " + " ".join(argv if argv is not None else sys.argv[1:]),
    )
    write_results(args.out_dir, "relay_floor", result, markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
