"""The Triton gRPC streaming client against a real Triton 2.51 serving a test-only model with the serving
contract's tensors (triton_repo/fake_llm): pieces, the bare final response, error attribution."""

from __future__ import annotations

import asyncio
import secrets
from pathlib import Path

import pytest

from perf.benchlib.clients import ClientConfig, TritonClient
from perf.benchlib.deploy import free_port
from perf.benchlib.loadgen import LoadConfig, run_trace
from perf.benchlib.workload import WORKLOADS, PromptFactory, RequestSpec, build_trace, new_salt

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parent / "triton_repo"


@pytest.fixture(scope="module")
def grpc_url(tmp_path_factory):
    from disagg.server import ServerConfig, TritonServer

    try:
        from disagg.tritonbin import locate_triton_files

        locate_triton_files()
    except Exception as exc:  # binaries not installed: the `serve` extra
        pytest.skip(f"Triton binaries not available: {exc}")
    workdir = tmp_path_factory.mktemp("triton")
    config = ServerConfig(
        model_repository=REPO, backend_directory=workdir / "backends", admin_key=secrets.token_urlsafe(24),
        http_port=free_port(), grpc_port=free_port(), metrics_port=free_port(),
        address="127.0.0.1", metrics_address="127.0.0.1", exit_timeout_s=3,
    )  # fmt: skip
    server = TritonServer(config, workdir / "triton.log").start()
    try:
        server.wait_ready(120)
        yield config.grpc_url
    finally:
        # The fake's unload sometimes outlives a short exit timeout on a busy machine; `stop` then kills
        # the group and removes its shared memory. A clean exit is not what this test is about.
        server.stop(grace_s=5)


def test_streams_are_timed_per_piece_and_errors_attributed(grpc_url, tiny_model_dir):
    factory = PromptFactory.from_model_dir(tiny_model_dir)
    trace = build_trace(WORKLOADS["codegen"], factory, 20.0, 8, seed=0, salt=new_salt())
    trace.append(RequestSpec(8, trace[-1].arrival, "fail this one", 4, 5))

    async def main():
        client = TritonClient(ClientConfig("triton", grpc_url, "fake_llm"))
        await client.open()
        try:
            ready = await client.is_ready(), await TritonClient(client.config).is_ready()
            missing = TritonClient(ClientConfig("triton", grpc_url, "no_such_model"))
            await missing.open()
            ready += (await missing.is_ready(),)
            await missing.close()
            return ready, await run_trace(client, trace, LoadConfig(drain_timeout_s=30), factory.count_output)
        finally:
            await client.close()

    ready, records = asyncio.run(main())
    assert ready[0] is True and ready[2] is False
    for r in records[:-1]:
        assert r.error is None
        assert r.n_pieces == r.n_tokens == r.target_output_tokens  # the bare final response is no piece
        assert r.ttft is not None and r.ttft < 2.0
        assert r.tpot == pytest.approx(0.010, abs=0.03)  # the fake streams every 10 ms
        assert r.send_lag < 0.5
    assert records[-1].error == "triton: refused by the fake"
