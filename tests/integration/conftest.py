"""Fixtures for tests against a real Triton server (started from the `nvidia-pytriton` wheel, CPU).

- Every test in this folder is marked `integration` and runs inside a leak probe (`leak_probe`).
- `triton_factory` (module scope) starts servers on free local ports; at the end of the module it stops
  those still running and asserts each exited cleanly (status 0, no process of its group left, none of
  its shared-memory regions left).

Example, a module sharing one server on the project's repository::

    @pytest.fixture(scope="module")
    def server(triton_factory):
        return triton_factory.start(REPO_ROOT / "model_repository", exit_timeout_s=10)

    def test_ready(server):
        assert server.is_ready()
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from pathlib import Path

import pytest
from triton_support import LeakProbe, free_ports, live_group_members, shm_entries, wait_until

from disagg.server import ServerConfig, ServerError, TritonServer

REPO_ROOT = Path(__file__).resolve().parents[2]
TEST_REPOS = Path(__file__).resolve().parent / "repos"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    here = Path(__file__).resolve().parent
    for item in items:
        if here in Path(str(item.path)).resolve().parents:
            item.add_marker(pytest.mark.integration)


class TritonFactory:
    """Starts Triton servers for one test module; see the module docstring."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.backend_directory = workdir / "backends"
        self.admin_key = secrets.token_urlsafe(24)
        self.servers: list[TritonServer] = []

    def config(self, repository: Path, **overrides: object) -> ServerConfig:
        """A config on free loopback ports with this factory's backend directory and admin key."""
        http_port, grpc_port, metrics_port = free_ports(3)
        values: dict[str, object] = {
            "model_repository": Path(repository).resolve(),
            "backend_directory": self.backend_directory,
            "admin_key": self.admin_key,
            "http_port": http_port,
            "grpc_port": grpc_port,
            "metrics_port": metrics_port,
            "address": "127.0.0.1",
            "metrics_address": "127.0.0.1",
            "exit_timeout_s": 5,
        }
        values.update(overrides)
        return ServerConfig.from_mapping(values)

    def start(self, repository: Path, ready_timeout_s: float = 120.0, **overrides: object) -> TritonServer:
        """Start a server on `repository` and wait until it is ready (all models loaded).

        `overrides` are `ServerConfig` fields. On failure the server is cleaned up and `ServerError`
        (carrying the log tail) is raised.
        """
        config = self.config(repository, **overrides)
        log_path = self.workdir / f"tritonserver-{len(self.servers)}-{config.http_port}.log"
        server = TritonServer(config, log_path)
        self.servers.append(server)
        server.start()
        try:
            server.wait_ready(ready_timeout_s)
        except ServerError:
            server.stop(grace_s=5)
            raise
        return server

    def release(self, server: TritonServer) -> None:
        """Take `server` out of the clean-exit check: the test stops it and checks the outcome itself."""
        self.servers.remove(server)

    def stop_all(self) -> list[str]:
        """Stop every server still registered; return a description of each unclean exit."""
        problems = []
        for server in self.servers:
            status = server.stop()
            if status != 0:
                problems.append(f"server {server.pid} exited with {status}:\n{server.log_tail()}")
            if live_group_members(server.pid):
                problems.append(f"server {server.pid} left processes behind")
            if shm_entries(server.config.shm_prefix):
                problems.append(f"server {server.pid} left shared memory behind")
        return problems


@pytest.fixture(scope="module")
def triton_factory(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TritonFactory]:
    """Module-scoped factory of real Triton servers, torn down with a clean-exit check."""
    factory = TritonFactory(tmp_path_factory.mktemp("triton"))
    yield factory
    problems = factory.stop_all()
    if problems:
        pytest.fail("\n".join(problems))


@pytest.fixture(scope="module")
def smoke_server(triton_factory: TritonFactory) -> TritonServer:
    """One server per module on the test-only `smoke` repository (decoupled `streamer` + ensemble)."""
    return triton_factory.start(TEST_REPOS / "smoke")


@pytest.fixture(scope="session", autouse=True)
def client_runtimes() -> None:
    """Create the client libraries' process-wide state once, before any leak baseline: gevent's hub
    (tritonclient.http) and gRPC's poller each keep an epoll/eventfd pair for the life of the process."""
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient

    httpclient.InferenceServerClient("127.0.0.1:1").close()
    grpcclient.InferenceServerClient("127.0.0.1:1").close()


@pytest.fixture(autouse=True)
def leak_probe() -> Iterator[LeakProbe]:
    """Baseline before each test; afterwards /dev/shm entries, fds, threads and child processes of this
    process must return to it (polled with a deadline, never slept on)."""
    probe = LeakProbe()
    yield probe
    probe.check(timeout_s=15.0)


__all__ = ["REPO_ROOT", "TEST_REPOS", "TritonFactory", "wait_until"]
