"""Process faults on the project's model repository (RELIABILITY.md D1, D2), each on a server of its
own: `kill -9` of the decode instance's stub mid-stream, of the prefill instance's stub with requests
arriving, and of tritonserver itself (its stubs must not outlive it).

Seen on Triton 2.51: the Python backend does not restart the stub of a decoupled model, and the
requests the dead stub held never get a response from Triton. The orchestrator notices an overdue
pool (a liveness probe, `disagg.triton.bls`) and ends those streams UNAVAILABLE; afterwards requests
needing the dead pool fail fast with an error naming it, and `ensemble_colocated` keeps serving.

Also seen on Triton 2.51 (about 1 kill in 10, `perf/stub_kill_stress.py`): a stub killed while it holds
the lock of its shared-memory message queue makes tritonserver itself abort (`boost::interprocess::
lock_exception`), and every stream ends with the socket closed. That is Triton's defect; `disagg serve`
starts such a server again (`disagg.restart`, tested in test_server_startup.py)."""

from __future__ import annotations

import os
import signal
import time

import pytest
from serving_support import REPOSITORY, engine_texts, generate, read_stream, stub_pids, text_inputs
from triton_support import (
    GrpcStream,
    LeakProbe,
    TritonFactory,
    live_group_members,
    metric_sum,
    scrape_metrics,
    shm_entries,
    wait_until,
)

from disagg.server import TritonServer

ERROR_BOUND_S = 30.0  # probe after 5 s overdue, probe deadline 10 s, plus slack for a loaded CI machine


@pytest.fixture(scope="module")
def server(triton_factory: TritonFactory) -> TritonServer:
    server = triton_factory.start(REPOSITORY, exit_timeout_s=10)
    triton_factory.release(server)  # a server that lost a stub is stopped and checked by the test
    yield server
    server.stop(grace_s=5)


@pytest.fixture(autouse=True)
def own_regions_ignored(leak_probe: LeakProbe, server: TritonServer) -> None:
    leak_probe.ignore_shm(server.config.shm_prefix)


def test_kill_decode_stub_mid_stream_ends_streams_with_an_error(server: TritonServer) -> None:
    expected = engine_texts(["Hello world"], 8)["Hello world"]
    (decode_pid,) = stub_pids(server.pid, "decode")
    streams = [GrpcStream(server.config.grpc_url) for _ in range(3)]
    try:
        for stream, model in zip(streams, ("llm", "ensemble", "llm"), strict=True):
            stream.send(model, text_inputs("Hello world", 1500, stream=True))
        for stream in streams:
            for _ in range(2):
                event = stream.next(30)
                assert event.error is None, event
        os.kill(decode_pid, signal.SIGKILL)
        killed_at = time.monotonic()
        results = [read_stream(stream, timeout_s=ERROR_BOUND_S) for stream in streams]
        ended_after = time.monotonic() - killed_at
    finally:
        for stream in streams:
            stream.close()
    assert ended_after < ERROR_BOUND_S
    for result in results:
        assert result.error is not None, "a stream outlived its decode instance"
    if any("Socket closed" in result.error for result in results):
        # tritonserver went down with the stub: only Triton 2.51's own abort is accepted here
        status = wait_until(lambda: server.returncode, 10, "tritonserver exited")
        assert status == -signal.SIGABRT, server.log_tail()
        assert "boost::interprocess::lock_exception" in server.log_tail(200), server.log_tail()
        assert all("Socket closed" in result.error for result in results), results
        pytest.xfail("Triton 2.51 aborted with the killed stub (lock_exception); disagg serve restarts it")
    for result in results:
        assert "decode pool stopped responding" in result.error, result.error

    # The dead stub is not restarted: a request needing decode fails, fast, naming the pool.
    start = time.monotonic()
    status, reply = generate(server, "llm", {"text_input": "Hello world", "max_tokens": 8})
    assert status != 200 and "decode" in reply["error"], reply
    assert time.monotonic() - start < ERROR_BOUND_S
    assert not stub_pids(server.pid, "decode"), "Triton 2.51 restarted the decode stub: update the docs"
    # The colocated path is untouched and keeps serving.
    status, reply = generate(
        server,
        "ensemble_colocated",
        {"text_input": "Hello world", "max_tokens": 8, "exclude_input_in_output": True},
    )
    assert (status, reply["text_output"]) == (200, expected)


def test_server_with_a_dead_stub_still_stops_without_leftovers(server: TritonServer) -> None:
    server.stop(grace_s=5)  # SIGTERM to the group; SIGKILL after the exit timeout if it must
    wait_until(lambda: not live_group_members(server.pid), 10, "no process of the server left")
    assert not shm_entries(server.config.shm_prefix)


def test_stubs_exit_when_their_server_dies_unreaped(triton_factory: TritonFactory) -> None:
    """`kill -9` of tritonserver itself, with nobody reaping it yet (it stays a zombie): the stubs'
    own parent check (`kill(pid, 0)`) still sees it; the project's watch (`disagg.triton.watchdog`)
    ends them and the pools unlink their KV regions."""
    kv_before = shm_entries("disagg-")
    server = triton_factory.start(REPOSITORY, exit_timeout_s=10)
    triton_factory.release(server)
    try:
        stubs = live_group_members(server.pid) - {server.pid}
        assert len(stubs) >= 5, stubs
        assert shm_entries("disagg-") - kv_before, "the pools created no KV region"
        os.kill(server.pid, signal.SIGKILL)  # not waited for: the server stays a zombie meanwhile
        wait_until(lambda: not live_group_members(server.pid), 20, "every stub gone after the server died")
        assert not shm_entries("disagg-") - kv_before, "KV regions outlived their pools"
    finally:
        server.stop(grace_s=5)  # reaps the zombie, removes the Python backend's regions
    assert not shm_entries(server.config.shm_prefix)


def test_kill_prefill_stub_requests_fail_fast_and_nothing_is_left(triton_factory: TritonFactory) -> None:
    """RELIABILITY D2: `kill -9` of the prefill instance's stub with requests arriving. Each request
    either finished before it died or ends UNAVAILABLE naming the prefill pool within the bound; later
    ones fail fast; the decode pool holds no KV block; `ensemble_colocated` keeps serving; once the
    server stops, the dead pool's KV region is gone too (the launcher sweeps regions of dead owners)."""
    expected = engine_texts(["Hello world"], 8)["Hello world"]
    kv_before = shm_entries("disagg-")
    server = triton_factory.start(REPOSITORY, exit_timeout_s=10)
    triton_factory.release(server)
    streams = [GrpcStream(server.config.grpc_url) for _ in range(3)]
    try:
        (prefill_pid,) = stub_pids(server.pid, "prefill")
        prompt = "The quick brown fox jumps over the lazy dog. " * 40
        for stream in streams:
            stream.send("llm", text_inputs(prompt, 64, stream=True))
        os.kill(prefill_pid, signal.SIGKILL)
        killed_at = time.monotonic()
        results = [read_stream(stream, timeout_s=ERROR_BOUND_S) for stream in streams]
        assert time.monotonic() - killed_at < ERROR_BOUND_S
        for result in results:
            assert result.error is None or "prefill" in result.error, result.error

        start = time.monotonic()
        status, reply = generate(server, "llm", {"text_input": "Hello world", "max_tokens": 8})
        assert status != 200 and "prefill" in reply["error"], reply
        assert time.monotonic() - start < ERROR_BOUND_S

        def decode_blocks_used() -> float:
            return metric_sum(
                scrape_metrics(server.config.metrics_url), "disagg_kv_blocks_used", pool="decode"
            )

        wait_until(lambda: decode_blocks_used() == 0, 15, "decode KV blocks all free")
        status, reply = generate(
            server,
            "ensemble_colocated",
            {"text_input": "Hello world", "max_tokens": 8, "exclude_input_in_output": True},
        )
        assert (status, reply["text_output"]) == (200, expected)
    finally:
        for stream in streams:
            stream.close()
        server.stop(grace_s=5)
    assert not live_group_members(server.pid)
    assert not shm_entries(server.config.shm_prefix)
    assert not shm_entries("disagg-") - kv_before, "the dead prefill pool's KV region is still there"
