"""How often does `kill -9` of the decode pool's stub take tritonserver down with it?

Each run starts the project's repository on the tiny model, opens `--streams` long streams (`llm` and
`ensemble` alternately), waits until each has two pieces, lets a random 0-200 ms pass (so the kill
lands at different points of a decode step), kills the decode stub with SIGKILL, and reads every stream
to its end. Outcomes per run:
  - `pool error`: the server lives; every stream ends with the orchestrator's "decode pool stopped
    responding" (what the project promises on Triton 2.51);
  - `triton aborted`: tritonserver died (exit status and the log line that says why, e.g. Triton 2.51's
    `boost::interprocess::lock_exception` when the stub held its message queue's lock); every stream
    ends with the socket closed;
  - `other`: anything else (a hang, another error): a defect of this project.

    python -m disagg_tools.repro.stub_kill_stress [--runs 10] [--streams 3]

Writes perf/results/stub_kill_stress.{json,md}.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import tritonclient.grpc as grpcclient

from disagg.paths import REPO_ROOT, tiny_model_dir
from disagg.procfs import read_stat
from disagg.server import process_group_members
from disagg_tools.checkpoints import ensure_model
from disagg_tools.loopback import start_loopback
from disagg_tools.repro import RESULTS, log, machine, write_json

POOL_ERROR = "decode pool stopped responding"
CRASH_MARKERS = ("terminate called", "what():", "Segmentation fault", "Signal (")


def _inputs(prompt: str, max_tokens: int) -> list[grpcclient.InferInput]:
    values = {
        "text_input": (np.array([[prompt.encode()]], dtype=np.object_), "BYTES"),
        "max_tokens": (np.array([[max_tokens]], dtype=np.int32), "INT32"),
        "stream": (np.array([[True]], dtype=bool), "BOOL"),
    }
    out = []
    for name, (array, kind) in values.items():
        tensor = grpcclient.InferInput(name, list(array.shape), kind)
        tensor.set_data_from_numpy(array)
        out.append(tensor)
    return out


class Stream:
    """One gRPC stream to one request: counts pieces, keeps the first error, knows when it ended."""

    def __init__(self, url: str, model: str) -> None:
        self.pieces = 0
        self.error: str | None = None
        self.done = False
        self.client = grpcclient.InferenceServerClient(url)
        self.client.start_stream(callback=self._on_response)
        self.client.async_stream_infer(model, _inputs("Hello world", 1500), enable_empty_final_response=True)

    def _on_response(self, result: object, error: object) -> None:
        if error is not None:
            self.error, self.done = str(error), True
            return
        self.pieces += 1
        response = result.get_response()
        final = response.parameters.get("triton_final_response")
        if final is not None and final.bool_param:
            self.done = True

    def close(self) -> None:
        self.client.stop_stream(cancel_requests=True)
        self.client.close()


def _decode_stub(server_pid: int) -> int:
    for pid in process_group_members(server_pid):
        stat = read_stat(pid)
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if stat is not None and stat.ppid == server_pid and b"decode_0_0" in argv:
            return pid
    raise RuntimeError("no decode stub found")


def _until(predicate, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)  # polling a client-side flag; nothing to wait on
    return predicate()


def one_run(index: int, streams_n: int, model_dir: Path, rng: random.Random) -> dict:
    workdir = Path(tempfile.mkdtemp(prefix=f"stub-kill-{index}-"))
    # a short exit timeout: the requests the dead stub held never end, so every stop waits it out
    server = start_loopback(REPO_ROOT / "model_repository", workdir, model_dir, exit_timeout_s=3)
    streams: list[Stream] = []
    try:
        streams = [Stream(server.config.grpc_url, ("llm", "ensemble")[i % 2]) for i in range(streams_n)]
        if not _until(lambda: all(s.pieces >= 2 for s in streams), 60):
            raise RuntimeError("streams did not start")
        time.sleep(rng.random() * 0.2)  # where in a decode step the kill lands
        killed = time.monotonic()
        os.kill(_decode_stub(server.pid), signal.SIGKILL)  # the stub only, not the server
        ended = _until(lambda: all(s.done for s in streams), 60)
        seconds = time.monotonic() - killed
        _until(lambda: server.returncode is not None, 2)
        status = server.returncode
        errors = [s.error for s in streams]
    finally:
        for stream in streams:
            stream.close()
        server.stop(grace_s=5)
    crash = [
        line
        for line in server.log_tail(200).splitlines()
        if line.startswith(CRASH_MARKERS) and not line.startswith("Signal (15)")  # 15: our own stop
    ]
    if ended and status is None and all(e and POOL_ERROR in e for e in errors):
        outcome = "pool error"
    elif ended and status is not None and all(e and "Socket closed" in e for e in errors):
        outcome = "triton aborted"
    else:
        outcome = "other"
    log(f"run {index}: {outcome} after {seconds:.1f} s (server status {status}) {crash[:2]}")
    return dict(
        run=index,
        outcome=outcome,
        seconds_to_end=seconds,
        server_status=status,
        errors=errors,
        crash_lines=crash[:4],
    )


def markdown(result: dict) -> str:
    counts = result["counts"]
    lines = [
        "# kill -9 of the decode stub mid-stream",
        "",
        "`python -m disagg_tools.repro.stub_kill_stress`: "
        f"{result['runs']} runs, {result['streams']} streams each, tiny model, "
        f"Triton 2.51, {result['machine']}.",
        "",
        "| outcome | runs |",
        "|---|---:|",
        *(f"| {name} | {counts.get(name, 0)} |" for name in ("pool error", "triton aborted", "other")),
        "",
        "Crash lines of the aborted runs: "
        + (
            "; ".join(
                sorted(
                    {" / ".join(r["crash_lines"][:2]) for r in result["rows"] if r["outcome"] != "pool error"}
                )
            )
            or "none"
        ),
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--streams", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out-dir", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    model_dir = ensure_model(tiny_model_dir())
    rng = random.Random(args.seed)
    rows = [one_run(i, args.streams, model_dir, rng) for i in range(args.runs)]
    counts: dict[str, int] = {}
    for row in rows:
        counts[row["outcome"]] = counts.get(row["outcome"], 0) + 1
    result = dict(runs=args.runs, streams=args.streams, machine=machine(), counts=counts, rows=rows)
    write_json(args.out_dir / "stub_kill_stress.json", result)
    table = markdown(result)
    (args.out_dir / "stub_kill_stress.md").write_text(table)
    print(table)
    return 0 if not counts.get("other") else 1


if __name__ == "__main__":
    sys.exit(main())
