"""A rollout under load, measured: what `disagg rollout` costs the requests in flight and arriving.

One Triton on a repository of `disagg repository --spec` with two versions of the pools (`--model-dir`
for version 1, `--checkpoint-b` for version 2; the same checkpoint by default, which measures the swap
itself: a second copy of every pool loads beside the first on the same cores). Poisson arrivals of
unique `--prompt-tokens`-token prompts at `--rate`, `--output` tokens out, to `ensemble` for
`--duration` s; at `--rollout-at` s `disagg rollout --to 2` runs, then, `--gap` s after it ends,
`--rollback`. Reported: TTFT and TPOT p50 / p99 and failures of the requests that arrived before the
first rollout, during a rollout (from its start to its end), and between and after them, with the time
of each rollout step. The SLOs (`chat`, from perf/slos.json) give the attainment of each window.

    .venv/bin/python -m perf.rollout --model-dir .models/smollm2-135m-instruct

Writes `<out-dir>/rollout.json` and `.md`, and its section of `--report` (perf/RESULTS.md).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from perf.benchlib.arrivals import poisson_arrivals
from perf.benchlib.clients import ClientConfig
from perf.benchlib.cliutil import machine, write_json
from perf.benchlib.deploy import start_triton
from perf.benchlib.metrics import RequestRecord, Slo
from perf.benchlib.report import publish
from perf.benchlib.slo import SLO_FILE, load_frozen
from perf.benchlib.workload import PromptFactory, RequestSpec, new_salt
from perf.hot_prompts import latency, replay

REPO_ROOT = Path(__file__).resolve().parents[1]
SECTION = "rollout"


def trace(args: argparse.Namespace, factory: PromptFactory, salt: str) -> list[RequestSpec]:
    rng = np.random.default_rng(args.seed)
    arrivals = poisson_arrivals(args.rate, max(1, int(args.rate * args.duration * 2) + 10), rng)
    return [
        RequestSpec(i, float(t), factory.make(args.prompt_tokens, f"{salt}{i}", rng), args.prompt_tokens,
                    args.output, "")
        for i, t in enumerate(t for t in arrivals if t < args.duration)
    ]  # fmt: skip


class Steps:
    """The rollouts' step messages, timed from the trace's start."""

    def __init__(self, start: float) -> None:
        self.start = start
        self.lines: list[tuple[float, str]] = []

    def say(self, line: str) -> None:
        self.lines.append((time.perf_counter() - self.start, line))


def run_rollouts(
    server: Any, args: argparse.Namespace, steps: Steps, spans: list[dict], errors: list
) -> None:
    """The rollout to 2, then the rollback, on their schedule (a thread beside the load)."""
    from disagg.control import ModelControl
    from disagg.serving.routing import RoutingFile
    from disagg_tools.rollout import Rollout, RolloutConfig, TritonControl

    config = RolloutConfig(f"http://{server.config.http_url}", server.config.metrics_url, 600.0, 600.0)
    control = ModelControl(server.config.http_url)
    rollout = Rollout(TritonControl(config), RoutingFile(control.routing_path), steps.say)
    at = args.rollout_at
    for name in ("rollout", "rollback"):
        delay = steps.start + at - time.perf_counter()
        if delay > 0:
            time.sleep(delay)  # the schedule of the experiment, not a synchronisation
        begin = time.perf_counter() - steps.start
        try:
            rollout.run(rollout.rollback_target() if name == "rollback" else 2)
        except Exception as exc:  # reported, and the run goes on: the load shows what it did
            errors.append(f"{name}: {exc}")
        end = time.perf_counter() - steps.start
        spans.append({"name": name, "begin_s": begin, "end_s": end, "seconds": end - begin})
        at = end + args.gap


def windows(records: list[RequestRecord], spans: list[dict], slo: Slo) -> dict[str, Any]:
    edges = [("before", 0.0, spans[0]["begin_s"])]
    for i, span in enumerate(spans):
        edges.append((f"during {span['name']}", span["begin_s"], span["end_s"]))
        following = spans[i + 1]["begin_s"] if i + 1 < len(spans) else float("inf")
        edges.append((f"after {span['name']}", span["end_s"], following))
    out = {}
    for name, begin, end in edges:
        inside = [r for r in records if begin <= r.arrival < end]
        good = sum(r.meets(slo) for r in inside)
        out[name] = {**latency(inside), "attainment": good / len(inside) if inside else None}
    return out


def _f(value: float | None, spec: str = ".0f") -> str:
    return "–" if value is None else format(value, spec)


def markdown(out: dict[str, Any]) -> str:
    lines = [
        "# Rollout under load",
        "",
        f"`{out['command']}` on {out['machine']}. Versions 1 and 2: {out['checkpoints']}. "
        f"{out['rate']:g} req/s Poisson, {out['prompt_tokens']}-token prompts, {out['output']} tokens out, "
        f"to `ensemble`, for {out['duration']:g} s; SLOs `chat` ({out['slo']}).",
        "",
        "| window | requests | failed | TTFT p50 (ms) | TTFT p99 (ms) | TPOT p50 (ms) | TPOT p99 (ms) "
        "| attainment |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, w in out["windows"].items():
        lines.append(
            f"| {name} | {w['requests']} | {w['failed']} | {_f(w['ttft_ms_p50'])} | {_f(w['ttft_ms_p99'])} | "
            f"{_f(w['tpot_ms_p50'], '.1f')} | {_f(w['tpot_ms_p99'], '.1f')} | {_f(w['attainment'], '.2f')} |"
        )
    lines += ["", "| rollout | start (s) | seconds |", "|---|---:|---:|"]
    lines += [f"| {s['name']} | {s['begin_s']:.1f} | {s['seconds']:.1f} |" for s in out["spans"]]
    lines += ["", "Steps (seconds from the trace's start):", ""]
    lines += [f"- {t:.1f} s: {line}" for t, line in out["steps"]]
    if out["rollout_errors"]:
        lines += ["", "Rollout errors: " + "; ".join(out["rollout_errors"])]
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model-dir", type=Path, default=REPO_ROOT / ".models" / "smollm2-135m-instruct")
    parser.add_argument("--checkpoint-b", type=Path, help="version 2's checkpoint (default: --model-dir)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--rate", type=float, default=1.0)
    parser.add_argument("--prompt-tokens", type=int, default=200)
    parser.add_argument("--output", type=int, default=32)
    parser.add_argument("--duration", type=float, default=150.0)
    parser.add_argument("--rollout-at", type=float, default=30.0)
    parser.add_argument(
        "--gap", type=float, default=20.0, help="s between the rollout's end and the rollback"
    )
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out-dir", type=Path, default=REPO_ROOT / "perf" / "results" / "rollout")
    parser.add_argument("--report", type=Path, default=REPO_ROOT / "perf" / "RESULTS.md")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    model_dir = args.model_dir.resolve()
    checkpoint_b = (args.checkpoint_b or args.model_dir).resolve()
    slo = load_frozen(SLO_FILE, model_dir.name)["chat"].slo
    factory = PromptFactory.from_model_dir(model_dir)
    specs = trace(args, factory, new_salt())
    with tempfile.TemporaryDirectory(prefix="rollout-") as scratch_name:
        scratch = Path(scratch_name)
        spec = {
            "model": {
                "versions": [
                    {"version": 1, "checkpoint": str(model_dir)},
                    {"version": 2, "checkpoint": str(checkpoint_b)},
                ],
                "serving": 1,
            },
            "dtype": args.dtype,
        }
        (scratch / "spec.yaml").write_text(yaml.safe_dump(spec))
        from disagg_tools.repository import write_spec

        with contextlib.redirect_stderr(io.StringIO()):
            if write_spec(scratch / "spec.yaml", scratch / "repository") != 0:
                raise SystemExit("the spec did not validate")
        server = start_triton(scratch / "repository", scratch / "server", model_dir, exit_timeout_s=10)
        try:
            steps, spans, errors = Steps(time.perf_counter()), [], []
            worker = threading.Thread(target=run_rollouts, args=(server, args, steps, spans, errors))
            worker.start()
            client = ClientConfig(kind="triton", url=server.config.grpc_url, model="ensemble")
            records = asyncio.run(replay(client, specs, factory))
            worker.join()
        finally:
            server.stop(grace_s=5)
    out = {
        "command": "python -m perf.rollout " + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": machine(),
        "checkpoints": f"{model_dir.name}, {checkpoint_b.name}",
        "rate": args.rate,
        "prompt_tokens": args.prompt_tokens,
        "output": args.output,
        "duration": args.duration,
        "slo": f"TTFT {slo.ttft_s * 1000:.0f} ms, TPOT {slo.tpot_s * 1000:.1f} ms",
        "spans": spans,
        "steps": steps.lines,
        "rollout_errors": errors,
        "windows": windows(records, spans, slo) if spans else {},
    }
    write_json(args.out_dir / "rollout.json", out)
    publish(markdown(out), args.out_dir / "rollout.md", args.report, SECTION)
    return 0 if not errors else 1


if __name__ == "__main__":
    sys.exit(main())
