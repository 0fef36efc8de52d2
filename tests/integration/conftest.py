"""Fixtures for tests against a real Triton server (started from the `nvidia-pytriton` wheel, CPU).

- Every test in this folder is marked `integration` and runs inside a leak probe (`leak_probe`).
- `triton_factory` (module scope) starts servers on free local ports; at the end of the module it stops
  those still running and asserts each exited cleanly (status 0, no process of its group left, none of
  its shared-memory regions left).

Example, a module sharing one server on the project's repository::

    from triton_support import REPO_ROOT

    @pytest.fixture(scope="module")
    def server(triton_factory):
        return triton_factory.start(REPO_ROOT / "model_repository", exit_timeout_s=10)

    def test_ready(server):
        assert server.is_ready()
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from triton_support import TRITON_ABORTS, LeakProbe, TritonFactory, open_fds, start_smoke, wait_until

from disagg.server import TritonServer


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """Count the runs in which Triton 2.51 itself aborted under a killed stub (its defect, not this
    project's; the tests then check the restart instead of the migration)."""
    if TRITON_ABORTS:
        terminalreporter.write_line(
            f"tritonserver aborted under a killed stub (Triton 2.51 lock_exception) in {len(TRITON_ABORTS)} "
            f"test(s): {', '.join(TRITON_ABORTS)}; each checked the restart instead"
        )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark every test of this folder `integration` (select or skip them with `-m`)."""
    here = Path(__file__).resolve().parent
    for item in items:
        if here in Path(str(item.path)).resolve().parents:
            item.add_marker(pytest.mark.integration)


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
    """One server per module on the test-only `smoke` repository: the decoupled `streamer`, the
    `streamer_ensemble` over it, and `adder` served by the test-only Python-based backend."""
    return start_smoke(triton_factory)


@pytest.fixture(scope="session", autouse=True)
def client_runtimes() -> None:
    """Create the client libraries' process-wide state once, before any leak baseline: gevent's hub
    (tritonclient.http) keeps an epoll/eventfd pair for the life of the process. gRPC's poller does
    not: it is created with the first channel and closed on another thread a few milliseconds after
    the last one closes, so the first test's baseline waits until this process's fds stop changing."""
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient

    httpclient.InferenceServerClient("127.0.0.1:1").close()
    grpcclient.InferenceServerClient("127.0.0.1:1").close()
    last: list[frozenset[int]] = []

    def settled() -> bool:
        last.append(open_fds())
        return len(last) >= 3 and last[-1] == last[-2] == last[-3]

    wait_until(settled, 5.0, "fds of the client warm-up settled", interval_s=0.02)


@pytest.fixture(autouse=True)
def leak_probe() -> Iterator[LeakProbe]:
    """Baseline before each test; afterwards /dev/shm entries, fds, threads and child processes of this
    process, and the KV blocks every running server's pools hold for requests, must return to it
    (polled with a deadline, never slept on)."""
    probe = LeakProbe()
    yield probe
    probe.check(timeout_s=15.0)
