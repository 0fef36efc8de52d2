"""A real Triton 2.51 on the test-only `smoke` repository: the server infrastructure, end to end."""

from __future__ import annotations

import signal
import time
import urllib.request
from collections.abc import Iterable

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from triton_support import (
    GrpcStream,
    StreamEvent,
    TritonFactory,
    http_json,
    http_sse,
    live_group_members,
    shm_entries,
    start_smoke,
    wait_until,
)
from tritonclient.utils import InferenceServerException

from disagg.server import TritonServer


def _request(count: int, delay_ms: int = 0) -> dict[str, np.ndarray]:
    return {"COUNT": np.array([count], dtype=np.int32), "DELAY_MS": np.array([delay_ms], dtype=np.int32)}


def _values(events: Iterable[StreamEvent]) -> list[int]:
    """The VALUEs carried by the events (the bare final response has none)."""
    arrays = [e.result.as_numpy("VALUE") for e in events if e.result is not None]
    return [int(a[0]) for a in arrays if a is not None]


def test_server_is_ready_with_all_models(smoke_server: TritonServer) -> None:
    client = httpclient.InferenceServerClient(smoke_server.config.http_url)
    try:
        assert client.is_server_live() and client.is_server_ready()
        assert client.is_model_ready("streamer") and client.is_model_ready("streamer_ensemble")
    finally:
        client.close()


@pytest.mark.parametrize("model", ["streamer", "streamer_ensemble"])
def test_grpc_stream_delivers_every_response_then_final(smoke_server: TritonServer, model: str) -> None:
    with GrpcStream(smoke_server.config.grpc_url) as stream:
        stream.send(model, _request(5), request_id="r1")
        events = list(stream.until_final())
    assert [e.error for e in events if e.error] == []
    assert _values(events) == [0, 1, 2, 3, 4]
    assert events[-1].final


def test_http_generate_and_generate_stream(smoke_server: TritonServer) -> None:
    base = f"http://{smoke_server.config.http_url}/v2/models/streamer_ensemble"
    status, body = http_json(f"{base}/generate", {"COUNT": 1, "DELAY_MS": 0})
    assert status == 200, body
    assert body["VALUE"] == 0  # generate flattens one-element outputs to scalars
    events = http_sse(f"{base}/generate_stream", {"COUNT": 4, "DELAY_MS": 0})
    assert [e["VALUE"] for e in events] == [0, 1, 2, 3]


def test_python_based_backend_serves_models_without_code_in_the_repository(
    smoke_server: TritonServer,
) -> None:
    server = smoke_server
    body = {"inputs": [{"name": "X", "shape": [1], "datatype": "INT32", "data": [1]}]}
    status, answer = http_json(f"http://{server.config.http_url}/v2/models/adder/infer", body)
    assert status == 200, answer
    assert answer["outputs"][0]["data"] == [6], "offset 5 from the config parameters"


def test_metrics_endpoint_counts_requests(smoke_server: TritonServer) -> None:
    with GrpcStream(smoke_server.config.grpc_url) as stream:
        stream.send("streamer_ensemble", _request(1))
        list(stream.until_final())

    def scraped() -> str:
        with urllib.request.urlopen(smoke_server.config.metrics_url, timeout=5) as response:
            text = response.read().decode()
        return text if 'nv_inference_request_success{model="streamer_ensemble",version="1"}' in text else ""

    assert "# TYPE nv_inference_request_success counter" in wait_until(scraped, 10, "ensemble metrics")


def test_http_repository_and_shm_apis_need_the_admin_key(smoke_server: TritonServer) -> None:
    config = smoke_server.config
    client = httpclient.InferenceServerClient(config.http_url)
    try:
        with pytest.raises(InferenceServerException, match="restricted"):
            client.get_model_repository_index()
        with pytest.raises(InferenceServerException, match="restricted"):
            client.get_model_repository_index(headers={"disagg-admin-key": "not-the-key-0123456789"})
        with pytest.raises(InferenceServerException, match="restricted"):
            client.get_system_shared_memory_status()
        with pytest.raises(InferenceServerException, match="restricted"):
            client.load_model("streamer")
        index = client.get_model_repository_index(headers=config.admin_headers("http"))
        states = {m["name"]: m["state"] for m in index}
        assert states == {"adder": "READY", "streamer": "READY", "streamer_ensemble": "READY"}
        assert client.get_system_shared_memory_status(headers=config.admin_headers("http")) == []
    finally:
        client.close()
    # The refusal never echoes the key.
    status, body = http_json(f"http://{config.http_url}/v2/repository/index", {})
    assert status == 403 and config.admin_key not in str(body)


def test_grpc_repository_api_needs_the_admin_key(smoke_server: TritonServer) -> None:
    config = smoke_server.config
    client = grpcclient.InferenceServerClient(config.grpc_url)
    try:
        with pytest.raises(InferenceServerException, match="restricted"):
            client.get_model_repository_index()
        with pytest.raises(InferenceServerException, match="restricted"):
            client.unload_model("streamer")
        index = client.get_model_repository_index(headers=config.admin_headers("grpc"))
        assert sorted(m.name for m in index.models) == ["adder", "streamer", "streamer_ensemble"]
        # Inference and metadata stay open.
        assert client.is_model_ready("streamer_ensemble")
    finally:
        client.close()


def test_sigterm_drains_stream_in_flight_and_exits_cleanly(triton_factory: TritonFactory) -> None:
    exit_timeout_s = 5
    server = start_smoke(triton_factory, exit_timeout_s=exit_timeout_s)
    triton_factory.release(server)
    pgid, prefix = server.pid, server.config.shm_prefix
    assert shm_entries(prefix), "the python backend holds shared memory while running"
    with GrpcStream(server.config.grpc_url) as stream:
        stream.send("streamer_ensemble", _request(10, 100))
        first = stream.next()
        started = time.monotonic()
        server.signal(signal.SIGTERM)
        events = [first, *stream.until_final(timeout_s=exit_timeout_s)]
    # Closed at once: an open stream, even idle, keeps its model loaded and blocks Triton's exit.
    status = server.wait(timeout_s=exit_timeout_s + 5)
    elapsed = time.monotonic() - started
    assert [e.error for e in events if e.error] == []
    assert _values(events) == list(range(10)), "the stream in flight is drained, not cut"
    assert status == 0, server.log_tail()
    assert elapsed < exit_timeout_s + 1  # Triton checks its exit timeout once a second
    wait_until(lambda: not live_group_members(pgid), 10, "no process of the server left")
    assert not shm_entries(prefix), "Triton removes the python backend's shared memory on a clean exit"


def test_sigterm_with_stream_longer_than_exit_timeout_is_bounded_and_leaves_nothing(
    triton_factory: TritonFactory,
) -> None:
    exit_timeout_s = 2
    server = start_smoke(triton_factory, exit_timeout_s=exit_timeout_s)
    triton_factory.release(server)
    pgid, prefix = server.pid, server.config.shm_prefix
    with GrpcStream(server.config.grpc_url) as stream:
        stream.send("streamer_ensemble", _request(200, 100))
        assert stream.next().error is None
        started = time.monotonic()
        status = server.stop(grace_s=3)
        elapsed = time.monotonic() - started
        # The client is not left hanging: its stream ends with an error (UNAVAILABLE, connection gone).
        events = list(stream.until_final(timeout_s=10))
    # Seen on Triton 2.51: after "Exit timeout expired. Exiting immediately." the process does not exit
    # while the stream is open (once it aborted in malloc instead); `stop` kills the group after the
    # grace period and removes the Python backend's shared memory that Triton left behind.
    assert elapsed < exit_timeout_s + 3 + 5, f"stop took {elapsed:.1f} s (status {status})"
    assert events[-1].error is not None
    wait_until(lambda: not live_group_members(pgid), 10, "no process of the server left")
    assert not shm_entries(prefix)
