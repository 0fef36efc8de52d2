"""The autoscaler with the `triton` actuator against a live server (issue 5, RELIABILITY F3).

A background load streams requests to `llm` the whole time and counts every error. The autoscaler runs
as its own process (`disagg autoscale --config ...`) and is watched, never slept on:

1. with an impossible TTFT target (1 ms) it scales the prefill pool out to 2 instances;
2. then, bounded to one instance (max_size 1, a generous 100 s target), it scales back in under the
   same load: the removed instance drains itself, its KV region goes and its gauges read 0.

This machine (CI) has 2 cores: the added prefill instance shares core 0 with the first, so the test
checks the change of instance count and its safety (no failed request, no region left behind), not a
gain in capacity.

Two regression tests without a server cover the fixes this test needed: the actuator posts the live
config without the `runtime` Triton fills in (else every change is a full reload of the pool), and the
controller reads the request-level histograms by `path` (their `model` label is the entry point).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from triton_support import (
    REPO_ROOT,
    ClientThreads,
    GrpcStream,
    TritonFactory,
    http_json,
    live_group_members,
    metric_series,
    scrape_metrics,
    shm_entries,
    text_request,
    timed_stream,
    wait_until,
)

from disagg.server import TritonServer
from disagg_tools.autoscaler.actuator import with_instance_count
from disagg_tools.autoscaler.config import build_config
from disagg_tools.autoscaler.controller import Controller
from disagg_tools.autoscaler.snapshot import parse_exposition

# ---- regression tests of the fixes (no server) --------------------------------------------------------


def test_posted_config_leaves_out_the_runtime_triton_fills_in() -> None:
    """Triton sets `runtime: "model.py"` on a Python-based backend's live config; the config the model
    was loaded from has none, and any difference outside `instance_group` turns the update into a full
    reload (every instance replaced, the pool's KV regions and leases with them)."""
    live = {
        "name": "prefill",
        "backend": "disagg",
        "runtime": "model.py",
        "instance_group": [{"name": "prefill_0", "kind": "KIND_CPU", "count": 1}],
        "parameters": {"role": {"string_value": "prefill"}},
    }
    posted = with_instance_count(live, 2)
    assert "runtime" not in posted
    assert posted["instance_group"] == [{"name": "prefill_0", "kind": "KIND_CPU", "count": 2}]
    assert posted["parameters"] == live["parameters"] and live["runtime"] == "model.py"  # a copy
    custom = {**live, "runtime": "libtriton_custom.so"}
    assert with_instance_count(custom, 2)["runtime"] == "libtriton_custom.so"


def _exposition(ttft_llm: float, ttft_colocated: float, count: int) -> str:
    """A /metrics page labelled as the server labels it: request-level histograms by entry point
    (`llm`, `orchestrator_colocated`) and path, pool gauges by pool model and instance."""
    lines = ["# TYPE disagg_time_to_first_token_seconds histogram", "# TYPE disagg_prompt_tokens histogram"]
    for model, path, value in (
        ("llm", "disaggregated", ttft_llm),
        ("orchestrator_colocated", "colocated", ttft_colocated),
    ):
        labels = f'model="{model}",path="{path}"'
        for family, bounds, observed in (
            ("disagg_time_to_first_token_seconds", (0.01, 1.0, 100.0), value),
            ("disagg_prompt_tokens", (16.0, 64.0), 20.0),
        ):
            for bound in (*bounds, float("inf")):
                n = count if observed <= bound else 0
                le = "+Inf" if bound == float("inf") else repr(bound)
                lines.append(f'{family}_bucket{{{labels},le="{le}"}} {n}')
            lines.append(f"{family}_sum{{{labels}}} {observed * count}")
            lines.append(f"{family}_count{{{labels}}} {count}")
    pool = 'model="prefill",pool="prefill",instance="prefill_0_0"'
    lines += [
        "# TYPE disagg_prefill_pending_tokens gauge",
        f"disagg_prefill_pending_tokens{{{pool}}} 0",
        "# TYPE disagg_prefill_queue_requests gauge",
        f"disagg_prefill_queue_requests{{{pool}}} 0",
    ]
    return "\n".join(lines) + "\n"


def test_controller_reads_ttft_of_the_entry_points_by_path() -> None:
    """TTFT is observed by the orchestrator (`model` = `llm`, the entry point), not by the prefill pool:
    read by `model=prefill` the family was always missing, so against a real server the prefill pool
    was held fail-static forever. Colocated requests (slow here) never touch the pool: left out."""
    config = build_config(
        {
            "pools": [
                {"name": "prefill", "role": "prefill", "ttft_target_s": 0.5, "min_samples": 5},
            ],
            "interval_s": 1.0,
            "window_s": 10.0,
            "metrics_port": 0,
        }
    )
    slow = Controller(config)
    slow.step(parse_exposition(_exposition(5.0, 0.005, 0), 0.0), {"prefill": 1}, 0.0)
    (decision,) = slow.step(parse_exposition(_exposition(5.0, 0.005, 10), 1.0), {"prefill": 1}, 1.0)
    assert not decision.fail_static, decision
    assert decision.desired == 2 and "ttft_above_target" in decision.signals

    fast = Controller(config)  # fast disaggregated requests, slow colocated ones: no reason to grow
    fast.step(parse_exposition(_exposition(0.005, 50.0, 0), 0.0), {"prefill": 1}, 0.0)
    (decision,) = fast.step(parse_exposition(_exposition(0.005, 50.0, 10), 1.0), {"prefill": 1}, 1.0)
    assert not decision.fail_static and decision.desired == 1, decision


# ---- live server --------------------------------------------------------------------------------------


class LoadLoop(ClientThreads):
    """Client threads streaming `llm` requests one after another until stopped; every error is kept."""

    JOIN_TIMEOUT_S = 90.0

    def __init__(self, grpc_url: str, threads: int = 2, tokens: int = 8) -> None:
        super().__init__(threads)
        self._url, self._tokens = grpc_url, tokens
        self.completed = 0
        self.errors: list[str] = []

    def _run(self, index: int) -> None:
        with GrpcStream(self._url) as stream:
            n = 0
            while not self._stop.is_set():
                prompt = f"Load {index}.{n}: a long enough prompt to need a few KV blocks " * 2
                try:
                    timed = timed_stream(stream, "llm", text_request(prompt, self._tokens), timeout_s=60)
                    problem = None if timed.error is None else str(timed.error)
                    if problem is None and timed.final is None:
                        problem = "stream ended without a final response"
                except AssertionError as exc:  # no response within the timeout
                    problem = str(exc)
                with self._lock:
                    if problem is None:
                        self.completed += 1
                    else:
                        self.errors.append(problem)
                n += 1

    def done(self) -> int:
        with self._lock:
            return self.completed


class Autoscaler:
    """`disagg autoscale` as a subprocess; its decision records (JSON lines) are collected."""

    def __init__(self, config_path: Path, admin_key: str) -> None:
        disagg = Path(sys.executable).parent / "disagg"
        env = {**os.environ, "DISAGG_ADMIN_KEY": admin_key}
        self.proc = subprocess.Popen(
            [str(disagg), "autoscale", "--config", str(config_path)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        self.records: list[dict[str, Any]] = []
        self._reader = threading.Thread(target=self._read, name="autoscaler-out")
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            try:
                self.records.append(json.loads(line))
            except json.JSONDecodeError:
                self.records.append({"raw": line})

    def applied(self, kind: str) -> list[dict[str, Any]]:
        return [r for r in list(self.records) if r.get("kind") == kind and r.get("applied")]

    def stop(self) -> tuple[int, str]:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            status = self.proc.wait(timeout=150)  # a load in progress finishes first
        except subprocess.TimeoutExpired:
            self.proc.kill()
            status = self.proc.wait()
        self._reader.join(timeout=10)
        assert self.proc.stderr is not None
        err = self.proc.stderr.read()
        self.proc.stdout.close()  # type: ignore[union-attr]
        self.proc.stderr.close()
        return status, err


@contextmanager
def autoscaler(
    tmp_path: Path, server: TritonServer, ttft_target_s: float, max_size: int = 2
) -> Iterator[Autoscaler]:
    config = {
        "source": {"kind": "triton", "url": server.config.metrics_url},
        "actuator": {
            "kind": "triton",
            "url": f"http://{server.config.http_url}",
            "drain_poll_s": 0.05,
            "drain_timeout_s": 30.0,
        },
        "interval_s": 1.0,
        "window_s": 5.0,
        "metrics_port": 0,
        "pools": [
            {
                "name": "prefill",
                "role": "prefill",
                "ttft_target_s": ttft_target_s,
                "min_size": 1,
                "max_size": max_size,
                "min_samples": 3,
                "scale_out_after": 1,
                "scale_in_after": 1,
                "cooldown_out_s": 1.0,
                "cooldown_in_s": 1.0,
            }
        ],
    }
    path = tmp_path / f"autoscale-{ttft_target_s:g}.json"
    path.write_text(json.dumps(config))
    scaler = Autoscaler(path, server.config.admin_key)
    try:
        yield scaler
    finally:
        status, err = scaler.stop()
        assert status == 0, err[-2000:]


def instance_count(server: TritonServer) -> int:
    status, config = http_json(f"http://{server.config.http_url}/v2/models/prefill/config")
    assert status == 200, config
    return sum(int(g["count"]) for g in config["instance_group"])


def prefill_instances(server: TritonServer) -> set[str]:
    """Serving instances of the prefill pool on /metrics: those with free KV blocks (an instance that
    was removed keeps its series, with its gauges zeroed)."""
    series = metric_series(
        scrape_metrics(server.config.metrics_url), "disagg_kv_blocks_free", model="prefill"
    )
    return {dict(labels)["instance"] for labels, value in series.items() if value > 0}


def kv_regions(server: TritonServer) -> set[str]:
    """The server's KV regions in /dev/shm (`disagg-<owner pid>-<random>`, owners in its process group)."""
    members = live_group_members(server.pid)
    return {name for name in shm_entries("disagg-") if int(name.split("-")[1]) in members}


@pytest.mark.slow
def test_autoscaler_scales_prefill_out_and_in_under_load_without_failed_requests(
    triton_factory: TritonFactory, tmp_path: Path
) -> None:
    # Its own server: instance changes create and remove the pool's regions; it is stopped here.
    server = triton_factory.start(REPO_ROOT / "model_repository", exit_timeout_s=10)
    triton_factory.release(server)
    try:
        assert instance_count(server) == 1
        regions_before = kv_regions(server)
        assert len(regions_before) == 1  # the prefill instance's export region
        with LoadLoop(server.config.grpc_url) as load:
            wait_until(lambda: load.done() >= 4, 60, "load running")

            with autoscaler(tmp_path, server, ttft_target_s=0.001) as scaler:
                wait_until(lambda: instance_count(server) == 2, 120, "prefill scaled out to 2")
                during_out = load.done()
                wait_until(lambda: scaler.applied("scale_out"), 10, "scale-out record")
            assert wait_until(lambda: prefill_instances(server) == {"prefill_0_0", "prefill_0_1"}, 10)
            regions_out = kv_regions(server)
            # an in-place update: the first instance (and its region) kept, one region added
            assert regions_before < regions_out and len(regions_out) == 2
            wait_until(lambda: load.done() >= during_out + 4, 60, "requests served by the larger pool")
            assert load.errors == [], "no request may fail while the pool scales out"

            # Scale-in under the same steady load: sent at once, the removed instance drains itself.
            # Forced by the bound (max_size 1): whether the policy itself scales in under this load
            # depends on the capacity it learned, and on two cores the instances share core 0, so the
            # per-instance capacity learned at size 2 is half the real one (seen: a scale-in followed by
            # a scale-out at once, and in another run no scale-in within 120 s). The policy's rules are
            # unit-tested; here it is the change under load that is checked.
            with autoscaler(tmp_path, server, ttft_target_s=100.0, max_size=1) as scaler:
                wait_until(lambda: instance_count(server) == 1, 120, "prefill scaled in to 1")
                wait_until(lambda: scaler.applied("scale_in"), 10, "scale-in record")
            # it finishes its queued work and waits (bounded at 10 s) for its KV leases to be pulled
            wait_until(lambda: len(kv_regions(server)) == 1, 30, "removed instance's region unlinked")
            wait_until(lambda: len(prefill_instances(server)) == 1, 30, "removed instance's gauges zeroed")
            remaining = prefill_instances(server)
            after_in = load.done()
            wait_until(lambda: load.done() >= after_in + 4, 60, "requests served after the scale-in")
        print(f"load: {load.completed} requests, errors {load.errors}; prefill instance left: {remaining}")
        assert load.errors == []
    finally:
        status = server.stop()
    assert status == 0, server.log_tail()
    assert not live_group_members(server.pid)
    assert not shm_entries(server.config.shm_prefix)
