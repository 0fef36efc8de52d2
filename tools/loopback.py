"""A Triton server of this project on loopback and free ports, started and ready: what a benchmark or
a reproduction runs against (``disagg serve`` is what a user runs)."""

from __future__ import annotations

import socket
from pathlib import Path

from disagg.server import TritonServer, server_config


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now (the kernel's pick)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def start_loopback(
    repository: Path,
    workdir: Path,
    model_dir: Path | None = None,
    ready_timeout_s: float = 300.0,
    cpus: tuple[int, ...] = (),
    exit_timeout_s: int | None = None,
    backend_directory: Path | None = None,
) -> TritonServer:
    """Start Triton with the project's launcher on ``repository`` (its state and log under
    ``workdir``), bound to loopback on free ports, and wait until it is ready; its pools and text models
    load ``model_dir``. ``cpus``: where tritonserver's own threads run (empty: unpinned). Raises
    ``disagg.server.ServerError`` when it does not become ready (the server is stopped then)."""
    options: dict = {}
    if model_dir is not None:
        options["model_dir"] = Path(model_dir).resolve()
    if exit_timeout_s is not None:
        options["exit_timeout_s"] = exit_timeout_s
    if backend_directory is not None:
        options["backend_directory"] = backend_directory
    config = server_config(
        Path(repository).resolve(),
        state_dir=workdir / ".triton",
        address="127.0.0.1",
        metrics_address="127.0.0.1",
        http_port=free_port(),
        grpc_port=free_port(),
        metrics_port=free_port(),
        cpus=cpus,
        **options,
    )
    server = TritonServer(config, workdir / "tritonserver.log").start()
    try:
        server.wait_ready(ready_timeout_s)
    except BaseException:
        server.stop()
        raise
    return server
