"""Several threads on one Triton custom metric: the Python backend crash, and the lock that prevents it.

On Triton 2.51 a stub-side ``pb_utils.Metric`` rewrites its shared-memory record on every operation
and releases the GIL while the server reads it. This starts one Triton per trial with a one-model
repository (written into `--workdir`) whose model runs `--threads` threads of `--count` increments
on one metric, either raw or through ``disagg.triton.metrics.SerialMetric``, and reports whether the
server survived and whether the metric on ``/metrics`` holds every increment. Writes JSON and a
markdown table.

    python -m disagg_tools.repro.metric_race --workdir /tmp/metric_race --trials 3
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import urllib.request
from pathlib import Path

import numpy as np

from disagg.paths import tiny_model_dir
from disagg_tools.loopback import start_loopback
from disagg_tools.repro import RESULTS

CONFIG = """name: "metric_race"
backend: "python"
max_batch_size: 0
input [ { name: "serial", data_type: TYPE_BOOL, dims: [ 1 ] } ]
output [ { name: "total", data_type: TYPE_FP64, dims: [ 1 ] } ]
instance_group [ { kind: KIND_CPU, count: 1 } ]
parameters { key: "threads" value: { string_value: "%d" } }
parameters { key: "count" value: { string_value: "%d" } }
"""

MODEL = """
import json
import threading

import numpy as np
import triton_python_backend_utils as pb_utils

from disagg.triton.metrics import SerialMetric


class TritonPythonModel:
    def initialize(self, args):
        params = json.loads(args["model_config"])["parameters"]
        self.threads = int(params["threads"]["string_value"])
        self.count = int(params["count"]["string_value"])
        family = pb_utils.MetricFamily(
            name="race_total", description="increments", kind=pb_utils.MetricFamily.COUNTER
        )
        self.family = family
        self.raw = family.Metric(labels={"mode": "raw"})
        self.serial = SerialMetric(family.Metric(labels={"mode": "serial"}))

    def execute(self, requests):
        responses = []
        for request in requests:
            serial = bool(pb_utils.get_input_tensor_by_name(request, "serial").as_numpy()[0])
            metric = self.serial if serial else self.raw

            def hammer():
                for _ in range(self.count):
                    metric.increment(1)

            workers = [threading.Thread(target=hammer) for _ in range(self.threads)]
            for worker in workers:
                worker.start()
            for worker in workers:
                worker.join()
            total = np.asarray([metric.value()], dtype=np.float64)
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("total", total)]))
        return responses
"""


def write_repository(root: Path, threads: int, count: int) -> Path:
    model = root / "repository" / "metric_race"
    (model / "1").mkdir(parents=True, exist_ok=True)
    (model / "config.pbtxt").write_text(CONFIG % (threads, count))
    (model / "1" / "model.py").write_text(MODEL)
    return root / "repository"


def trial(workdir: Path, serial: bool, threads: int, count: int) -> dict:
    import tritonclient.http as http

    repository = write_repository(workdir, threads, count)
    # the model reads no checkpoint; the launcher wants a model folder to hand to its models
    server = start_loopback(repository, workdir, tiny_model_dir(), ready_timeout_s=120)
    config = server.config
    outcome = {"serial": serial, "threads": threads, "count": count}
    try:
        client = http.InferenceServerClient(config.http_url, network_timeout=300)
        flag = http.InferInput("serial", [1], "BOOL")
        flag.set_data_from_numpy(np.asarray([serial]))
        try:
            total = client.infer("metric_race", [flag]).as_numpy("total")[0]
            outcome["returned_total"] = float(total)
        except Exception as exc:  # the server died under the request
            outcome["error"] = type(exc).__name__
        outcome["server_alive"] = server.returncode is None
        if outcome["server_alive"]:
            text = urllib.request.urlopen(config.metrics_url, timeout=10).read().decode()
            mode = "serial" if serial else "raw"
            match = re.search(rf'race_total{{mode="{mode}"}} ([0-9.e+]+)', text)
            outcome["metrics_total"] = float(match.group(1)) if match else None
        outcome["signal_11"] = "Signal (11)" in (workdir / "tritonserver.log").read_text(errors="replace")
    finally:
        server.stop()
    outcome["complete"] = outcome.get("metrics_total") == threads * count
    return outcome


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--workdir", type=Path, required=True)
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--threads", type=int, default=4)
    parser.add_argument("--count", type=int, default=2000)
    parser.add_argument("--out", type=Path, default=RESULTS / "metric_race.json")
    args = parser.parse_args(argv)
    rows = []
    for index in range(args.trials):
        for serial in (True, False):
            workdir = args.workdir / f"{'serial' if serial else 'raw'}{index}"
            workdir.mkdir(parents=True, exist_ok=True)
            row = trial(workdir, serial, args.threads, args.count)
            print(json.dumps(row), flush=True)
            rows.append(row)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"trials": rows}, indent=2) + "\n")
    lines = [
        f"# One metric, {args.threads} threads x {args.count} increments",
        "",
        "Written by `python -m disagg_tools.repro.metric_race` (`make repro-metric-race`).",
        "",
        "| operations | trials | server survived | every increment counted | SIGSEGV in the log |",
        "|---|---:|---:|---:|---:|",
    ]
    for serial, name in ((True, "through SerialMetric"), (False, "raw pb_utils.Metric")):
        chosen = [r for r in rows if r["serial"] is serial]
        lines.append(
            f"| {name} | {len(chosen)} | {sum(r['server_alive'] for r in chosen)} | "
            f"{sum(r['complete'] for r in chosen)} | {sum(r['signal_11'] for r in chosen)} |"
        )
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
