"""Reproduce the Python backend's iterator-release race, and check the graveyard that avoids it.

Triton 2.51's Python stub can free a finished decoupled BLS call's responses on its stub-to-parent
thread without the GIL (see ``backends/disagg/triton/graveyard.py``). That corrupts the stub's heap,
so the stub crashes, later, somewhere else. This runs a server whose ``relay`` model does what the
orchestrator does (decoupled BLS calls pulled on a thread pool, a cancellation check per response,
Python threads busy meanwhile) against a ``source`` whose responses carry object arrays, under
concurrent gRPC streams, once per release policy, side by side:
  - ``drop``: the finished iterator is let go at once (the orchestrator before the graveyard);
  - ``graveyard``: it is kept until a later cancellation check has passed (the orchestrator now).
Each run lasts ``--seconds`` or until the server dies; it counts the BLS calls completed and reads
the server log for a crashed stub.

    python -m disagg_tools.repro.bls_release_stress [--seconds 300] [--rounds 2] [--streams 16]

Writes perf/results/bls_release_stress.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import queue
import re
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from disagg.paths import REPO_ROOT
from disagg.server import ServerError, TritonServer, process_group_members, server_config
from disagg.tritonbin import prepare_backend_directory
from disagg_tools.loopback import free_port
from disagg_tools.repro import log

BACKEND = Path(__file__).resolve().parent / "bls_stress_backend"
RESULTS = REPO_ROOT / "perf" / "results"
POLICIES = ("drop", "graveyard")
CRASH_MARKS = ("Segmentation fault", "Stub process", "terminate called", "signal 11", "core dumped")


def model_config(role: str, output: str, dtype: str, dims: str, release: str = "") -> str:
    """config.pbtxt of one stress model: both take COUNT and WIDTH and differ in role and output."""
    extra = f'parameters {{ key: "release" value: {{ string_value: "{release}" }} }}\n' if release else ""
    return f"""name: "{role}"
backend: "bls_stress"
max_batch_size: 0
model_transaction_policy {{ decoupled: true }}
input [
  {{ name: "COUNT", data_type: TYPE_INT32, dims: [ 1 ] }},
  {{ name: "WIDTH", data_type: TYPE_INT32, dims: [ 1 ] }}
]
output [ {{ name: "{output}", data_type: {dtype}, dims: [ {dims} ] }} ]
instance_group [ {{ kind: KIND_CPU, count: 1 }} ]
parameters {{ key: "role" value: {{ string_value: "{role}" }} }}
{extra}"""


def write_repository(root: Path, policy: str) -> Path:
    repository = root / f"repo-{policy}"
    configs = {
        "source": model_config("source", "BLOB", "TYPE_STRING", "-1"),
        "relay": model_config("relay", "SEEN", "TYPE_INT32", "1", release=policy),
    }
    for name, text in configs.items():
        (repository / name / "1").mkdir(parents=True, exist_ok=True)
        (repository / name / "config.pbtxt").write_text(text)
    return repository


def start_server(root: Path, policy: str) -> TritonServer:
    backends = prepare_backend_directory(root / "backends")
    link = backends / "bls_stress"
    if not link.is_symlink():
        link.symlink_to(BACKEND)
    config = server_config(
        write_repository(root, policy),
        state_dir=root / ".triton",
        backend_directory=backends,
        address="127.0.0.1",
        metrics_address="127.0.0.1",
        http_port=free_port(),
        grpc_port=free_port(),
        metrics_port=free_port(),
        exit_timeout_s=5,
    )
    server = TritonServer(config, root / f"tritonserver-{policy}-{time.time_ns()}.log").start()
    server.wait_ready(120)
    return server


class Streams:
    """`count` gRPC streams, each sending its next relay request when the previous one finished."""

    def __init__(self, url: str, count: int, responses: int, width: int) -> None:
        import tritonclient.grpc as grpcclient

        self._grpc = grpcclient
        self.url = url
        self.count = count
        self.inputs = {
            "COUNT": np.array([responses], dtype=np.int32),
            "WIDTH": np.array([width], dtype=np.int32),
        }
        self.expected = responses * width
        self.completed = 0
        self.errors: list[str] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()

    def _inputs(self) -> list[Any]:
        tensors = []
        for name, value in self.inputs.items():
            tensor = self._grpc.InferInput(name, list(value.shape), "INT32")
            tensor.set_data_from_numpy(value)
            tensors.append(tensor)
        return tensors

    def _run(self) -> None:
        events: queue.Queue[tuple[Any, Any]] = queue.Queue()
        client = self._grpc.InferenceServerClient(self.url)
        client.start_stream(callback=lambda result, error: events.put((result, error)))
        try:
            while not self._stop.is_set():
                client.async_stream_infer("relay", self._inputs())
                try:
                    result, error = events.get(timeout=30)
                except queue.Empty:
                    self._record("no response within 30 s")
                    return
                if error is not None:
                    self._record(str(error))
                    return
                seen = int(result.as_numpy("SEEN")[0])
                if seen != self.expected:
                    self._record(f"relay saw {seen} strings, expected {self.expected}")
                    return
                with self._lock:
                    self.completed += 1
        finally:
            client.stop_stream()
            client.close()

    def _record(self, error: str) -> None:
        if self._stop.is_set():
            return  # the run is over: the server is being stopped under the streams
        with self._lock:
            self.errors.append(error[:200])

    def run(self, seconds: float, server: TritonServer) -> tuple[float, bool]:
        """Run until `seconds` pass, a client fails or a process of the server dies (the server, or
        a stub: Triton 2.51 keeps running without a dead stub). Returns (elapsed, all alive).
        The server is stopped before the streams, which a dead stub would leave hanging."""
        stubs = set(process_group_members(server.pid)) - {server.pid}
        threads = [threading.Thread(target=self._run, daemon=True) for _ in range(self.count)]
        started = time.monotonic()
        for thread in threads:
            thread.start()
        deadline = started + seconds
        alive = True
        while time.monotonic() < deadline and alive and not self.errors:
            time.sleep(0.5)  # polling the outcome of a timed run, not synchronising with it
            alive = server.returncode is None and stubs <= set(process_group_members(server.pid))
        elapsed = time.monotonic() - started
        self._stop.set()
        server.stop(grace_s=10)
        for thread in threads:
            thread.join(35)
        return elapsed, alive


def one_run(root: Path, policy: str, args: argparse.Namespace) -> dict[str, Any]:
    server = start_server(root, policy)
    streams = Streams(server.config.grpc_url, args.streams, args.responses, args.width)
    elapsed, alive = streams.run(args.seconds, server)
    status = server.returncode
    text = server.log_path.read_text(errors="replace") if server.log_path else ""
    marks = sorted({m for m in CRASH_MARKS if m in text})
    # the last count logged: at finalize, or the stub's last before it hung or died
    counts = re.findall(r"bls-release-tripwire: policy=\S+ with_gil=(\d+) without_gil=(\d+)", text)
    probe = counts[-1] if counts else None
    crashed = (not alive) or bool(marks)
    # a stub left hung never unloads: Triton gives up on it when its exit timeout runs out
    hung = "Exit timeout expired" in text
    return {
        "policy": policy,
        "seconds": round(elapsed, 1),
        "calls": streams.completed,
        "calls_per_s": round(streams.completed / elapsed, 1) if elapsed else 0.0,
        "crashed": crashed,
        "all_processes_alive_at_end": alive,
        "exit_status": status,
        "hung_at_stop": hung,
        "arrays_freed_with_gil": int(probe[0]) if probe else None,
        "arrays_freed_without_gil": int(probe[1]) if probe else None,
        "log_marks": marks,
        "client_errors": streams.errors[:3],
        "log": str(server.log_path),
    }


def _n(value: int | None) -> str:
    return "-" if value is None else str(value)


def markdown(runs: list[dict[str, Any]], args: argparse.Namespace) -> str:
    lines = [
        "# BLS iterator release under load (Triton 2.51 Python backend)",
        "",
        f"{args.streams} gRPC streams, each relay request = one decoupled BLS call of {args.responses} "
        f"responses x {args.width} strings; up to {args.seconds:.0f} s per run; policies alternate.",
        "",
        "`drop` lets each finished BLS response iterator go at once; `graveyard` keeps it until a "
        "cancellation check through the stub's queue has passed (what the orchestrator does). "
        "Response arrays freed without the GIL are counted by a weak-reference callback that asks "
        "CPython whether its thread holds the GIL; a dead process is checked every 0.5 s (the "
        "server, or a stub: Triton 2.51 keeps running without it), so 0.6 s means it died before "
        "the first check. The stub's segfault shows in the kernel log, not in Triton's.",
        "",
        "| round | policy | ran (s) | BLS calls | calls/s | response arrays freed with the GIL "
        "| without the GIL | a process died | log / first client error |",
        "|---|---|---:|---:|---:|---:|---:|---|---|",
    ]
    for run in runs:
        shown = ", ".join(run["log_marks"] + run["client_errors"][:1]) or "-"
        lines.append(
            f"| {run['round']} | {run['policy']} | {run['seconds']} | {run['calls']} "
            f"| {run['calls_per_s']} | {_n(run.get('arrays_freed_with_gil'))} "
            f"| {_n(run.get('arrays_freed_without_gil'))} | {'yes' if run['crashed'] else 'no'} | {shown} |"
        )
    for policy in POLICIES:
        mine = [r for r in runs if r["policy"] == policy]
        crashes = sum(r["crashed"] for r in mine)
        calls = sum(r["calls"] for r in mine)
        lines.append("")
        lines.append(f"- {policy}: {crashes} crash(es) in {len(mine)} run(s), {calls} BLS calls in all")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seconds", type=float, default=300.0, help="length of one run")
    parser.add_argument("--rounds", type=int, default=2, help="runs per policy (alternating)")
    parser.add_argument("--streams", type=int, default=16, help="concurrent client streams")
    parser.add_argument("--responses", type=int, default=16, help="responses per BLS call")
    parser.add_argument("--width", type=int, default=64, help="strings per response")
    parser.add_argument("--policies", default=",".join(POLICIES), help="comma-separated subset")
    parser.add_argument("--out", type=Path, default=RESULTS / "bls_release_stress")
    args = parser.parse_args()
    policies = [p for p in args.policies.split(",") if p]
    if any(p not in POLICIES for p in policies):
        parser.error(f"--policies: choose from {','.join(POLICIES)}")
    runs = []
    with tempfile.TemporaryDirectory(prefix="bls-stress-") as tmp:
        keep = args.out.parent / "bls_release_stress_logs"
        keep.mkdir(parents=True, exist_ok=True)
        for round_index in range(1, args.rounds + 1):
            for policy in policies:
                log(f"round {round_index}: {policy} ...")
                try:
                    run = one_run(Path(tmp), policy, args)
                except ServerError as exc:
                    run = {
                        "policy": policy,
                        "error": str(exc)[:300],
                        "crashed": True,
                        "seconds": 0,
                        "calls": 0,
                        "calls_per_s": 0,
                        "log_marks": ["server did not start"],
                        "client_errors": [],
                    }
                run["round"] = round_index
                if (run.get("crashed") or run.get("client_errors")) and run.get("log"):
                    saved = keep / f"round{round_index}-{policy}.log"
                    saved.write_text(Path(run["log"]).read_text(errors="replace")[-20000:])
                    run["log"] = str(saved.relative_to(REPO_ROOT))
                else:
                    run.pop("log", None)
                log(f"  {json.dumps(run)}")
                runs.append(run)
    result = {
        "host": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "runs": runs,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    args.out.with_suffix(".md").write_text(markdown(runs, args))
    print(markdown(runs, args))


if __name__ == "__main__":
    main()
