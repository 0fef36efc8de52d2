"""Starting and stopping Triton as an operator does: a model that cannot load, `serve_main` in the
foreground stopped by Ctrl-C or SIGTERM, `serve_main` starting again a server that died on its own, and
the OpenAI front end `serve_main` runs beside Triton."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from triton_support import (
    TEST_BACKENDS,
    TEST_REPOS,
    TritonFactory,
    free_ports,
    http_json,
    link_backend,
    live_children,
    live_group_members,
    shm_entries,
    wait_until,
)

from disagg.paths import resolve_model_dir
from disagg.server import ENV_ADMIN_KEY, ServerError

SERVE = "import sys; from disagg_tools.cli import serve_main; sys.exit(serve_main(sys.argv[1:]))"


def test_model_failing_to_initialize_stops_startup_with_a_clear_error(triton_factory: TritonFactory) -> None:
    with pytest.raises(ServerError) as info:
        triton_factory.start(TEST_REPOS / "broken", ready_timeout_s=60)
    message = str(info.value)
    assert "tritonserver exited with 1" in message
    assert "failed to load 'bad_init'" in message
    assert "deliberate test failure" in message
    assert triton_factory.admin_key not in message
    server = triton_factory.failed[-1]
    assert not live_group_members(server.pid), "no orphan stub"
    assert not shm_entries(server.config.shm_prefix)


def _serve(
    tmp_path: Path, triton_factory: TritonFactory, *extra: str, openai_port: int = 0
) -> tuple[subprocess.Popen, Any]:
    """`serve_main` in a child process on the smoke repository, on free ports (the OpenAI front end
    off unless `openai_port` is given); returns it and its config."""
    config = triton_factory.config(TEST_REPOS / "smoke")  # only for free ports and the key
    env = {
        **os.environ,
        "HTTP_PORT": str(config.http_port),
        "GRPC_PORT": str(config.grpc_port),
        "METRICS_PORT": str(config.metrics_port),
        "METRICS_ADDRESS": "127.0.0.1",
        "OPENAI_PORT": str(openai_port),
        ENV_ADMIN_KEY: config.admin_key,
    }
    link_backend(tmp_path / ".triton" / "backends", "smoke_pybackend", TEST_BACKENDS / "smoke_pybackend")
    argv = ["--model-repository", str(TEST_REPOS / "smoke"), "--exit-timeout", "5", "--address", "127.0.0.1"]
    with (tmp_path / "serve.log").open("wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-c", SERVE, *argv, *extra],
            cwd=tmp_path,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    return process, config


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_serve_main_stops_cleanly_on_signal(
    tmp_path: Path, triton_factory: TritonFactory, signum: int
) -> None:
    process, config = _serve(tmp_path, triton_factory)
    try:
        triton_pid = next(iter(wait_until(lambda: live_children(process.pid), 30, "tritonserver started")))
        wait_until(lambda: _ready(config.http_url), 60, "server ready")
        wait_until(lambda: b"disagg serve: ready" in (tmp_path / "serve.log").read_bytes(), 10, "announced")
    finally:
        status = _stop(process, signum, timeout_s=5 + 15)
    log_text = (tmp_path / "serve.log").read_text(errors="replace")
    assert status == 0, log_text[-3000:]
    assert config.admin_key not in log_text
    assert not live_group_members(triton_pid)
    assert not (tmp_path / ".triton" / "admin-key").exists(), "a key given by the environment is not stored"


def test_serve_main_restarts_a_server_that_aborts_while_serving(
    tmp_path: Path, triton_factory: TritonFactory
) -> None:
    """tritonserver aborting on its own (as Triton 2.51 does when a stub dies holding its queue's lock,
    see disagg.restart) is started again on the same ports; past the restart budget, serve_main exits
    with the server's status and leaves nothing behind."""
    process, config = _serve(tmp_path, triton_factory, "--max-restarts", "1")
    servers = []
    try:
        for round_ in range(2):
            pid = wait_until(
                lambda: next(iter(live_children(process.pid) - set(servers)), None), 60, "a new tritonserver"
            )
            servers.append(pid)
            wait_until(lambda: _ready(config.http_url), 60, f"server {round_} ready")
            # serve_main restarts only a server it saw ready: wait for its announcement
            wait_until(lambda n=round_ + 1: _announced(tmp_path) == n, 10, f"server {round_} announced")
            os.kill(pid, signal.SIGABRT)  # the server alone, as its own abort() would
        status = process.wait(timeout=30)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    log_text = (tmp_path / "serve.log").read_text(errors="replace")
    assert log_text.count("disagg serve: ready") == 2, log_text[-3000:]
    assert "tritonserver exited with signal SIGABRT while serving; restarting it (1 of at most 1" in log_text
    assert status == 128 + signal.SIGABRT, log_text[-3000:]
    for pid in servers:
        wait_until(lambda pid=pid: not live_group_members(pid), 15, "no process of a dead server left")
    # shared memory of both servers: checked by the leak probe around every test of this folder


def test_serve_main_runs_the_openai_front_end_beside_triton_and_stops_it(
    tmp_path: Path, triton_factory: TritonFactory
) -> None:
    """On by default beside Triton (here on a free port): it answers 503 while `llm` is not served (the
    smoke repository has none), names the model folder in /v1/models, never holds the admin key, and
    goes with the server on SIGTERM."""
    port = free_ports(1)[0]
    process, config = _serve(tmp_path, triton_factory, openai_port=port)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: _announced(tmp_path) == 1, 60, "server announced ready")
        frontend = wait_until(lambda: _children_running(process.pid, b"disagg.openai"), 10, "front end")
        status, _ = wait_until(lambda: _get(f"{base}/health"), 30, "front end answering")
        assert status == 503
        status, models = _get(f"{base}/v1/models")
        assert status == 200 and [m["id"] for m in models["data"]] == [resolve_model_dir().resolve().name]
        assert config.admin_key.encode() not in Path(f"/proc/{frontend[0]}/environ").read_bytes()
    finally:
        status = _stop(process, signal.SIGTERM, timeout_s=5 + 30)
    log_text = (tmp_path / "serve.log").read_text(errors="replace")
    assert status == 0, log_text[-3000:]
    assert f"disagg serve: OpenAI-compatible API http://127.0.0.1:{port}/v1" in log_text
    assert config.admin_key not in log_text
    assert not live_group_members(frontend[0]), "the front end's process group is gone"
    assert not live_children(process.pid)


def _stop(process: subprocess.Popen, signum: int, timeout_s: float) -> int:
    """Send `signum` to serve_main's process group (as a terminal does for Ctrl-C, or an init system
    for SIGTERM) and wait for its exit status; past `timeout_s`, SIGKILL the group (status -9)."""
    if process.poll() is None:
        os.killpg(process.pid, signum)
    try:
        return process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        return process.wait()


def _children_running(pid: int, marker: bytes) -> list[int]:
    """Live children of `pid` whose command line holds `marker`."""
    found = []
    for child in live_children(pid):
        try:
            if marker in Path(f"/proc/{child}/cmdline").read_bytes():
                found.append(child)
        except OSError:
            continue
    return found


def _get(url: str) -> tuple[int, Any] | None:
    try:
        return http_json(url, timeout_s=5)
    except OSError:
        return None


def _announced(tmp_path: Path) -> int:
    return (tmp_path / "serve.log").read_bytes().count(b"disagg serve: ready")


def _ready(http_url: str) -> bool:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(f"http://{http_url}/v2/health/ready", timeout=1) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False
