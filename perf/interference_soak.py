"""Repeat the interference experiment against one server until it fails: a soak for crashes under load.

Starts one Triton on `--repository` (the project's launcher, loopback, free ports), runs
`perf/interference.py` `--runs` times against `--model`, and reports each run's errors. The server's
log stays in `--workdir` (a crash's backtrace is there), and the exit status says whether the server
survived. Compare two trees by running this file from each checkout.

    python -m perf.interference_soak --workdir /tmp/soak --runs 6
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
from perf.benchlib.deploy import start_triton  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--workdir", type=Path, required=True, help="server state, its log, the runs' JSON")
    parser.add_argument("--repository", type=Path, default=HERE.parent / "model_repository")
    parser.add_argument("--model-dir", type=Path, default=HERE.parent / ".models" / "tiny")
    parser.add_argument("--model", default="ensemble_colocated")
    parser.add_argument("--rate", type=float, default=4.0)
    parser.add_argument("--count", type=int, default=100)
    parser.add_argument("--runs", type=int, default=6)
    args = parser.parse_args(argv)
    args.workdir.mkdir(parents=True, exist_ok=True)
    server = start_triton(args.repository, args.workdir, args.model_dir)
    failed_runs = 0
    try:
        for run in range(args.runs):
            out = args.workdir / f"run{run}.json"
            command = [sys.executable, "-m", "perf.interference", "--kind", "triton"]
            command += [
                "--url",
                server.config.grpc_url,
                "--model",
                args.model,
                "--model-dir",
                str(args.model_dir),
            ]
            command += ["--rate", str(args.rate), "--count", str(args.count), "--out", str(out)]
            subprocess.run(command, check=True, capture_output=True, cwd=HERE.parent)
            result = json.loads(out.read_text())
            errors = sum(
                1 for part in ("decode_only", "mixed") for r in result[part]["records"] if r["error"]
            )
            failed_runs += errors > 0
            print(f"run {run}: {errors} failed requests, ratio p50 {result['ratio_p50']}", flush=True)
            if server.returncode is not None:
                print(f"the server exited ({server.returncode}); log: {args.workdir / 'tritonserver.log'}")
                return 1
    finally:
        status = server.stop()
    print(f"server stopped with status {status}; {failed_runs} of {args.runs} runs had failed requests")
    return 0 if status == 0 and failed_runs == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
