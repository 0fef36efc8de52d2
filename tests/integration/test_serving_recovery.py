"""Recovery keeps what the autoscaler set (RELIABILITY D1 with a scaled pool): the decode pool is scaled
to two instances through the model repository API, as the autoscaler's `triton` actuator does, then
both of its stubs are killed. The pool is restarted once, by whichever entry point's watcher got model
control first (`disagg.control`), with the live config: two instances again, not the repository's one."""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Iterator

import pytest
from serving_support import REPOSITORY, engine_texts, generate
from triton_support import (
    LeakProbe,
    TritonFactory,
    http_json,
    live_group_members,
    metric_series,
    scrape_metrics,
    wait_until,
)

from disagg.procfs import stub_pids
from disagg.server import TritonServer
from disagg.serverconfig import ADMIN_HEADER
from disagg_tools.autoscaler.actuator import instance_count, with_instance_count


@pytest.fixture(scope="module")
def server(triton_factory: TritonFactory) -> Iterator[TritonServer]:
    server = triton_factory.start(REPOSITORY, exit_timeout_s=10)
    # Triton 2.51 never finishes unloading a model instance whose stub was killed, so this server
    # cannot exit cleanly (test_serving_faults.py): it is stopped here, and nothing may outlive it.
    triton_factory.release(server)
    yield server
    server.stop(grace_s=5)
    wait_until(lambda: not live_group_members(server.pid), 10, "no process of the server left")


@pytest.fixture(autouse=True)
def own_regions_ignored(leak_probe: LeakProbe, server: TritonServer) -> None:
    leak_probe.ignore_shm(server.config.shm_prefix)


def _decode_config(server: TritonServer) -> dict:
    status, config = http_json(f"http://{server.config.http_url}/v2/models/decode/config")
    assert status == 200, config
    return config


def _series(server: TritonServer, name: str, **labels: str) -> dict[frozenset, float]:
    return metric_series(scrape_metrics(server.config.metrics_url), name, **labels)


def test_a_restart_keeps_the_instance_count_the_autoscaler_set(server: TritonServer) -> None:
    expected = "Hello world" + engine_texts(["Hello world"], 8)["Hello world"]
    status, reply = generate(server, "llm", {"text_input": "Hello world", "max_tokens": 8})
    assert status == 200 and reply["text_output"] == expected, reply  # the watchers are running

    scaled = with_instance_count(_decode_config(server), 2)
    status, answer = http_json(
        f"http://{server.config.http_url}/v2/repository/models/decode/load",
        {"parameters": {"config": json.dumps(scaled)}},
        headers={ADMIN_HEADER: server.config.admin_key},
        timeout_s=120,
    )
    assert status == 200, answer
    wait_until(lambda: len(stub_pids(server.pid, "decode")) == 2, 60, "two decode stubs")
    killed = stub_pids(server.pid, "decode")
    for pid in killed:
        os.kill(pid, signal.SIGKILL)

    def recovered() -> bool:
        health = _series(server, "disagg_pool_health", pool="decode")
        alive = stub_pids(server.pid, "decode")
        return (
            len(alive) == 2 and not set(alive) & set(killed) and len(health) >= 2 and not any(health.values())
        )

    wait_until(recovered, 120, "the decode pool restarted with two instances, healthy in every view")
    assert instance_count(_decode_config(server)) == 2, "the restart kept the live instance count"
    restarts = sum(_series(server, "disagg_pool_restarts_total", pool="decode").values())
    assert restarts == 1, f"{restarts} restarts counted: one death, one restart"
    status, reply = generate(server, "llm", {"text_input": "Hello world", "max_tokens": 8})
    assert status == 200 and reply["text_output"] == expected, reply
